//! The ordered index of a pool's free blocks, keyed by (size, address, block id): best fit is
//! the first key at or above (request, 0, 0).
//!
//! Sizes up to [`BINNED_MAX`] (every size of the small pool) have one bin per size, found
//! through a two-level bitmap, each bin listing its blocks by address, highest first. A cached
//! malloc+free takes the lowest-addressed block of the best size and gives back a block at the
//! same address, so it pops and pushes the ends of bins: its cost does not depend on how many
//! blocks the pool holds.
//!
//! Other sizes (the large pool's) go to size classes, 64 per power of two, also found through
//! a two-level bitmap; each class keeps its keys in order, in a vector sorted largest first
//! while few (a vector beats a B-tree several times over at a handful of keys, and the best
//! fit then comes off its end), in a B-tree when thousands of blocks fall into one class
//! (logarithmic updates win), switching between the two with hysteresis. Classes are ordered
//! as sizes are, so the first key at or above a key is in that key's class or is the first
//! key of the next class in use: a search or an update touches one class's few keys, however
//! many blocks the pool holds.

use std::collections::BTreeSet;

pub(crate) type Key = (usize, usize, u32);

/// Sizes are binned in steps of this many bytes...
const STEP: usize = 512;
/// ...up to this size.
const BINNED_MAX: usize = BINS * STEP;
const BINS: usize = 64 * 64;

/// Above this many keys a class becomes a B-tree...
const PROMOTE: usize = 64;
/// ...and below this many it becomes a vector again.
const DEMOTE: usize = 16;

/// A pool's free blocks.
#[derive(Default)]
pub(crate) struct FreeIndex {
    bins: Bins,
    classes: Classes,
    /// Counts insertions and removals: equal counts mean the same contents (see
    /// [`super::shard::Memo`]).
    generation: u64,
}

impl FreeIndex {
    /// Changes so far; the index is unchanged while this is.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    #[inline(always)]
    pub fn insert(&mut self, key: Key) {
        self.generation += 1;
        match bin_of(key.0) {
            Some(b) => self.bins.insert(b, (key.1, key.2)),
            None => self.classes.insert(key),
        }
    }

    #[inline(always)]
    pub fn remove(&mut self, key: &Key) -> bool {
        self.generation += 1;
        match bin_of(key.0) {
            Some(b) => self.bins.remove(b, (key.1, key.2)),
            None => self.classes.remove(key),
        }
    }

    /// The smallest key at or above `from`.
    #[inline]
    pub fn first_at_least(&self, from: Key) -> Option<Key> {
        self.find(from).map(|f| f.key)
    }

    /// The smallest key at or above `from`, with where it lies, so that
    /// [`FreeIndex::remove_found`] takes it out without searching again.
    #[inline(always)]
    pub fn find(&self, from: Key) -> Option<Found> {
        let binned = if from.0 <= BINNED_MAX {
            self.bins
                .first_at_least(from)
                .map(|key| Found { key, at: None })
        } else {
            None
        };
        if self.classes.0.used.is_empty() {
            return binned;
        }
        match (binned, self.classes.find(from)) {
            (Some(a), Some(b)) => Some(if b.key < a.key { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// Removes the key `found` by [`FreeIndex::find`], with no change to the index since.
    #[inline(always)]
    pub fn remove_found(&mut self, found: &Found) {
        match found.at {
            Some((class, at)) => {
                self.generation += 1;
                self.classes
                    .remove_at(class as usize, at as usize, &found.key);
            }
            None => {
                self.remove(&found.key);
            }
        }
    }

    /// The keys at or above `from`, in order (slow paths only: it walks the bins below too).
    #[cfg(test)]
    pub fn iter_from(&self, from: Key) -> impl Iterator<Item = Key> + '_ {
        self.iter().skip_while(move |k| *k < from)
    }

    /// Every key, in order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = Key> + '_> {
        let mut binned = self.bins.iter().peekable();
        let mut classed = self.classes.iter().peekable();
        Box::new(std::iter::from_fn(move || {
            match (binned.peek(), classed.peek()) {
                (Some(a), Some(b)) if b < a => classed.next(),
                (Some(_), _) => binned.next(),
                _ => classed.next(),
            }
        }))
    }
}

/// A key found by [`FreeIndex::find`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Found {
    pub key: Key,
    /// Its class and position in that class's sorted vector, if it lies in one.
    at: Option<(u32, u32)>,
}

/// The bin of blocks of exactly `size` bytes, if such sizes are binned.
#[inline]
fn bin_of(size: usize) -> Option<usize> {
    // Size 0 wraps to a bin past the last.
    let bin = (size / STEP).wrapping_sub(1);
    (size.is_multiple_of(STEP) && bin < BINS).then_some(bin)
}

/// A set of up to 64 × 64 numbers, with the next member at or after a number in a few
/// instructions.
struct Bitmap {
    /// Bit `g`: `words[g]` is not 0.
    groups: u64,
    /// Bit `b` of `words[g]`: `64 * g + b` is a member.
    words: [u64; 64],
}

impl Default for Bitmap {
    fn default() -> Self {
        Bitmap {
            groups: 0,
            words: [0; 64],
        }
    }
}

impl Bitmap {
    #[inline]
    fn is_empty(&self) -> bool {
        self.groups == 0
    }

    #[inline]
    fn contains(&self, n: usize) -> bool {
        self.words[n / 64] & (1 << (n % 64)) != 0
    }

    #[inline]
    fn set(&mut self, n: usize) {
        let (g, b) = (n / 64, n % 64);
        self.words[g] |= 1 << b;
        self.groups |= 1 << g;
    }

    #[inline]
    fn clear(&mut self, n: usize) {
        let (g, b) = (n / 64, n % 64);
        self.words[g] &= !(1 << b);
        if self.words[g] == 0 {
            self.groups &= !(1 << g);
        }
    }

    /// The first member at or after `n` (`n` may be 64 × 64).
    #[inline]
    fn next(&self, n: usize) -> Option<usize> {
        let (g, b) = (n / 64, n % 64);
        if g < 64 {
            let here = self.words[g] & (u64::MAX << b);
            if here != 0 {
                return Some(g * 64 + here.trailing_zeros() as usize);
            }
        }
        let later = self.groups & u64::MAX.checked_shl(g as u32 + 1).unwrap_or(0);
        if later == 0 {
            return None;
        }
        let g = later.trailing_zeros() as usize;
        Some(g * 64 + self.words[g].trailing_zeros() as usize)
    }
}

impl<T> Slots<T> {
    /// The slots in use, in order (found through the bitmap, not by trying every slot).
    fn used_in_order(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(self.used.next(0), |&n| self.used.next(n + 1))
    }
}

/// 64 × 64 numbered slots of `T`, made in groups of 64 when first used, with a bitmap of the
/// slots in use (whose content the owner keeps non-empty).
struct Slots<T> {
    used: Bitmap,
    groups: [Option<Box<[T; 64]>>; 64],
}

impl<T: Default> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            used: Bitmap::default(),
            groups: std::array::from_fn(|_| None),
        }
    }
}

impl<T: Default> Slots<T> {
    /// Slot `n`, if its group was made.
    #[inline(always)]
    fn get(&self, n: usize) -> Option<&T> {
        self.groups[n / 64].as_ref().map(|g| &g[n % 64])
    }

    #[inline(always)]
    fn get_mut(&mut self, n: usize) -> Option<&mut T> {
        self.groups[n / 64].as_mut().map(|g| &mut g[n % 64])
    }

    /// Slot `n`, its group made if it has none yet.
    #[inline(always)]
    fn get_or_new(&mut self, n: usize) -> &mut T {
        let group = &mut self.groups[n / 64];
        match group {
            Some(g) => &mut g[n % 64],
            None => &mut Self::new_group(group)[n % 64],
        }
    }

    #[cold]
    fn new_group(group: &mut Option<Box<[T; 64]>>) -> &mut [T; 64] {
        group.insert(Box::new(std::array::from_fn(|_| T::default())))
    }
}

/// One list of blocks per binned size, (address, id) highest first.
#[derive(Default)]
struct Bins(Slots<Vec<(usize, u32)>>);

impl Bins {
    fn list(&self, bin: usize) -> &[(usize, u32)] {
        self.0.get(bin).map_or(&[], |v| v)
    }

    #[inline(always)]
    fn insert(&mut self, bin: usize, entry: (usize, u32)) {
        let list = self.0.get_or_new(bin);
        // The usual case: the lowest address of its size (a block given back where it was taken).
        if list.last().is_none_or(|last| *last > entry) {
            list.push(entry);
        } else {
            let at = list.partition_point(|e| *e > entry);
            list.insert(at, entry);
        }
        self.0.used.set(bin);
    }

    #[inline(always)]
    fn remove(&mut self, bin: usize, entry: (usize, u32)) -> bool {
        let Some(list) = self.0.get_mut(bin) else {
            return false;
        };
        if list.last() == Some(&entry) {
            list.pop();
        } else {
            match list.binary_search_by(|e| entry.cmp(e)) {
                Ok(at) => {
                    list.remove(at);
                }
                Err(_) => return false,
            }
        }
        if list.is_empty() {
            self.0.used.clear(bin);
        }
        true
    }

    #[inline(always)]
    fn first_at_least(&self, from: Key) -> Option<Key> {
        let key = |bin: usize, (addr, id): (usize, u32)| ((bin + 1) * STEP, addr, id);
        // Bins of sizes above `from.0`: their lowest entry.
        let above = |bin: usize| {
            let b = self.0.used.next(bin)?;
            self.list(b).last().map(|&e| key(b, e))
        };
        let first = from.0.div_ceil(STEP).max(1) - 1;
        if (first + 1) * STEP != from.0 {
            return above(first);
        }
        // The bin of exactly `from.0`: its lowest entry at or above (address, id).
        let list = self.list(first);
        let at = list.partition_point(|e| *e >= (from.1, from.2));
        match at.checked_sub(1) {
            Some(i) => Some(key(first, list[i])),
            None => above(first + 1),
        }
    }

    fn iter(&self) -> impl Iterator<Item = Key> + '_ {
        self.0.used_in_order().flat_map(move |b| {
            self.list(b)
                .iter()
                .rev()
                .map(move |&(addr, id)| ((b + 1) * STEP, addr, id))
        })
    }
}

/// The size class of `size`: sizes below 64 each have their own; above, each power of two
/// is cut into 64 classes by the 6 bits after the leading one. Larger sizes have larger or
/// equal classes, and every class is below 64 × 64.
#[inline]
fn class_of(size: usize) -> usize {
    if size < 64 {
        return size;
    }
    let e = (usize::BITS - 1 - size.leading_zeros()) as usize;
    (e - 5) * 64 + ((size >> (e - 6)) & 63)
}

/// Keys in size classes, each class in order.
#[derive(Default)]
struct Classes(Slots<Ordered>);

impl Classes {
    /// Class `class`, which is in use.
    #[inline(always)]
    fn class(&self, class: usize) -> &Ordered {
        self.0.get(class).expect("a class in use has its group")
    }

    /// Class `class`, which is in use.
    #[inline(always)]
    fn class_mut(&mut self, class: usize) -> &mut Ordered {
        self.0.get_mut(class).expect("a class in use has its group")
    }

    #[inline(always)]
    fn insert(&mut self, key: Key) {
        let class = class_of(key.0);
        self.0.get_or_new(class).insert(key);
        self.0.used.set(class);
    }

    #[inline(always)]
    fn remove(&mut self, key: &Key) -> bool {
        let class = class_of(key.0);
        if !self.0.used.contains(class) {
            return false;
        }
        let list = self.class_mut(class);
        let removed = list.remove(key);
        if list.is_empty() {
            self.0.used.clear(class);
        }
        removed
    }

    /// Removes `key`, at position `at` of class `class`'s sorted vector.
    #[inline(always)]
    fn remove_at(&mut self, class: usize, at: usize, key: &Key) {
        let list = self.class_mut(class);
        match list {
            Ordered::Sorted(v) => {
                debug_assert_eq!(v[at], *key);
                v.remove(at);
            }
            Ordered::Tree(_) => {
                list.remove(key);
            }
        }
        if list.is_empty() {
            self.0.used.clear(class);
        }
    }

    #[inline(always)]
    fn find(&self, from: Key) -> Option<Found> {
        let class = class_of(from.0);
        if self.0.used.contains(class) {
            if let Some((key, at)) = self.class(class).find(from) {
                return Some(Found {
                    key,
                    at: at.map(|at| (class as u32, at as u32)),
                });
            }
        }
        let next = self.0.used.next(class + 1)?;
        let (key, at) = self.class(next).first();
        Some(Found {
            key,
            at: at.map(|at| (next as u32, at as u32)),
        })
    }

    fn iter(&self) -> impl Iterator<Item = Key> + '_ {
        self.0
            .used_in_order()
            .flat_map(move |c| self.class(c).iter())
    }
}

/// Keys in order: a vector while few, a B-tree when many. The vector is sorted from the
/// largest key down, so that the smallest key (the best fit when the class is reached from
/// below, and the block a cached pair takes and gives back) is at its end: taking it and
/// putting it back move no other key.
enum Ordered {
    Sorted(Vec<Key>),
    Tree(BTreeSet<Key>),
}

impl Default for Ordered {
    fn default() -> Self {
        Ordered::Sorted(Vec::new())
    }
}

impl Ordered {
    #[inline]
    fn is_empty(&self) -> bool {
        match self {
            Ordered::Sorted(v) => v.is_empty(),
            Ordered::Tree(t) => t.is_empty(),
        }
    }

    #[inline(always)]
    fn insert(&mut self, key: Key) {
        match self {
            Ordered::Sorted(v) => {
                if v.last().is_none_or(|last| *last > key) {
                    v.push(key);
                } else {
                    let at = v.partition_point(|k| *k > key);
                    v.insert(at, key);
                }
                if v.len() > PROMOTE {
                    *self = Ordered::Tree(v.drain(..).collect());
                }
            }
            Ordered::Tree(t) => {
                t.insert(key);
            }
        }
    }

    #[inline(always)]
    fn remove(&mut self, key: &Key) -> bool {
        match self {
            Ordered::Sorted(v) if v.last() == Some(key) => {
                v.pop();
                true
            }
            Ordered::Sorted(v) => match v.binary_search_by(|k| key.cmp(k)) {
                Ok(at) => {
                    v.remove(at);
                    true
                }
                Err(_) => false,
            },
            Ordered::Tree(t) => {
                let removed = t.remove(key);
                if t.len() < DEMOTE {
                    let mut v = Vec::with_capacity(PROMOTE);
                    v.extend(t.iter().rev().copied());
                    *self = Ordered::Sorted(v);
                }
                removed
            }
        }
    }

    /// The first key at or above `from`, with its position if the keys are in a vector.
    #[inline(always)]
    fn find(&self, from: Key) -> Option<(Key, Option<usize>)> {
        match self {
            Ordered::Sorted(v) => {
                // Keys at or above `from` come first; the last of them is the smallest.
                let at = v.partition_point(|k| *k >= from).checked_sub(1)?;
                Some((v[at], Some(at)))
            }
            Ordered::Tree(t) => t.range(from..).next().map(|&key| (key, None)),
        }
    }

    /// The first key of a class in use, with its position if the keys are in a vector.
    #[inline]
    fn first(&self) -> (Key, Option<usize>) {
        match self {
            Ordered::Sorted(v) => {
                let at = v.len() - 1;
                (v[at], Some(at))
            }
            Ordered::Tree(t) => (*t.first().expect("a class in use is not empty"), None),
        }
    }

    /// The keys, smallest first.
    fn iter(&self) -> Box<dyn Iterator<Item = Key> + '_> {
        match self {
            Ordered::Sorted(v) => Box::new(v.iter().rev().copied()),
            Ordered::Tree(t) => Box::new(t.iter().copied()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::xorshift;

    #[test]
    fn the_index_agrees_with_a_btree_through_promotion_and_demotion() {
        let mut index = FreeIndex::default();
        let mut model = BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000u32 {
            xorshift(&mut x);
            // Grow for a while, then shrink, so both representations are exercised.
            let grow = (step / 2000) % 2 == 0;
            let key = (
                match x % 8 {
                    // Binned sizes, most of them.
                    0..=4 => (x % 50) as usize * 512,
                    // Classed ones: many in one class (a B-tree), spread over many classes,
                    // or not a multiple of 512.
                    5 => (2 << 20) + (x % 50) as usize * 512,
                    6 => {
                        (2 << 20) + ((x >> 4) % 4000) as usize * 512 * ((x >> 24) % 64 + 1) as usize
                    }
                    _ => (x % 50) as usize * 512 + 100,
                },
                (x >> 8) as usize % 4096 * 512,
                step,
            );
            if grow || model.is_empty() || x.is_multiple_of(3) {
                index.insert(key);
                model.insert(key);
            } else {
                let victim = *model.iter().nth((x >> 20) as usize % model.len()).unwrap();
                assert!(index.remove(&victim));
                model.remove(&victim);
            }
            let probe = match (x >> 40) % 4 {
                0 => ((x >> 30) as usize % 60 * 512, 0, 0),
                1 => ((2 << 20) + (x >> 30) as usize % 60 * 512, 0, 0),
                2 => ((2 << 20) + (x >> 30) as usize % 300_000 * 512, 0, 0),
                _ => (key.0, (x >> 12) as usize % 4096 * 512, step / 2),
            };
            assert_eq!(
                index.first_at_least(probe),
                model.range(probe..).next().copied()
            );
            // Taking the found key out without a second search (the best-fit path).
            if !grow && x.is_multiple_of(5) {
                if let Some(found) = index.find(probe) {
                    index.remove_found(&found);
                    assert!(model.remove(&found.key));
                }
            }
        }
        assert!(index.iter().eq(model.iter().copied()));
        let probe = (20 * 512, 0, 0);
        assert!(index.iter_from(probe).eq(model.range(probe..).copied()));
        assert!(!index.remove(&(1, 1, 1)));
        assert!(!index.remove(&(3 << 30, 1, 1)));
    }

    #[test]
    fn size_classes_follow_sizes() {
        let mut sizes: Vec<usize> = (0..usize::BITS)
            .flat_map(|e| [1usize << e, (1 << e) + 1, (1 << e) | ((1 << e) - 1)])
            .chain(0..5000)
            .collect();
        sizes.sort();
        let mut last = 0;
        for size in sizes {
            let class = class_of(size);
            assert!(
                class >= last && class < 64 * 64,
                "size {size}: class {class}"
            );
            last = class;
        }
        assert_eq!(class_of(usize::MAX), class_of(1 << 63) + 63);
        // A power of two's 64 classes are as wide as each other.
        assert_eq!(class_of((20 << 20) - 1) + 1, class_of(20 << 20));
        assert_eq!(class_of(20 << 20), class_of((20 << 20) + (256 << 10) - 1));
    }
}

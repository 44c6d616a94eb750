//! Shards: the cached path's only lock.
//!
//! Each thread is given a home shard when it first allocates: the one with the fewest live
//! threads, given back when the thread exits, so up to as many threads as shards never share
//! one, however many threads came and went before (no run-to-run lottery). A shard owns free
//! blocks, one list per size class ordered by address (the lowest kept apart from a min-heap
//! of the others, [`FreeList`]), and the counters of the blocks it handed out. Shards are
//! padded to separate cache lines, so threads that allocate and free on their own shards share
//! no written memory. A shard's lock ([`crate::lock`], the device shards' too) costs one
//! atomic operation to take and a plain store to release.
//!
//! Peaks of sharded counters stay exact with a reservation scheme: every shard has a limit
//! per counter, the limits add up to the recorded peak, and a shard may grow a counter only
//! up to its limit. Only when a shard would pass its limit does the allocator lock every shard
//! and move unused headroom from other shards to it, raising the peak by what is still
//! missing (`HostAllocator::rebalance`). While no counter passes its limit, the sum cannot
//! pass the peak, so the cached path never looks at other shards.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::lock::ShardMutex;

/// Size classes: a block of `size` bytes is in class `floor(log2(size))`.
pub(crate) const CLASSES: usize = usize::BITS as usize;

/// Entries a free list's heap makes room for when first used (16 × 24 bytes).
const HEAP_START: usize = 16;

/// Counters kept per shard.
pub(crate) const ALLOCATIONS: usize = 0;
pub(crate) const ALLOCATED_BYTES: usize = 1;
pub(crate) const ACTIVE_BLOCKS: usize = 2;
pub(crate) const COUNTERS: usize = 3;

pub(crate) type Counts = [i64; COUNTERS];

/// A shard, on its own cache lines.
#[repr(align(128))]
pub(crate) struct Shard {
    pub(crate) inner: ShardMutex<ShardInner>,
}

pub(crate) struct ShardInner {
    /// Bit `c` is set when `free[c]` is not empty.
    nonempty: u64,
    /// Free blocks per class, smallest address first.
    free: [FreeList; CLASSES],
    /// Current values of the counters for blocks whose home is this shard.
    pub(crate) counts: Counts,
    /// How far each counter may grow before the peak must be checked.
    pub(crate) limits: Counts,
}

impl Shard {
    pub(crate) fn new() -> Shard {
        Shard {
            inner: ShardMutex::new(ShardInner {
                nonempty: 0,
                free: std::array::from_fn(|_| FreeList::default()),
                counts: [0; COUNTERS],
                limits: [0; COUNTERS],
            }),
        }
    }
}

/// A free block as a shard lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FreeBlock {
    pub(crate) address: usize,
    pub(crate) size: usize,
    pub(crate) id: u32,
}

impl ShardInner {
    /// The best free block for `need` bytes: the smallest, then the lowest address. With
    /// `uniform` (every block of a class has the same size, as with power-of-two rounding)
    /// each class's first block is its best.
    pub(crate) fn best_fit(&self, need: usize, uniform: bool) -> Option<FreeBlock> {
        let mut mask = self.nonempty & u64::MAX.checked_shl(floor_log2(need) as u32).unwrap_or(0);
        while mask != 0 {
            let class = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            let list = &self.free[class];
            let best = if uniform {
                list.peek().filter(|&(_, size, _)| size >= need)
            } else {
                list.iter()
                    .filter(|&(_, size, _)| size >= need)
                    .min_by_key(|&(address, size, _)| (size, address))
            };
            if let Some((address, size, id)) = best {
                return Some(FreeBlock {
                    address,
                    size,
                    id: id as u32,
                });
            }
        }
        None
    }

    /// Takes the best free block for `need` bytes (see [`ShardInner::best_fit`]).
    #[inline]
    pub(crate) fn take_best(&mut self, need: usize, uniform: bool) -> Option<FreeBlock> {
        if uniform {
            // The first non-empty class from `need`'s own: its lowest address is the best.
            let class = (self.nonempty & (u64::MAX << floor_log2(need))).trailing_zeros() as usize;
            let list = self.free.get_mut(class)?;
            let (address, size, id) = list.peek()?;
            if size >= need {
                list.pop();
                if list.is_empty() {
                    self.nonempty &= !(1u64 << class);
                }
                return Some(FreeBlock {
                    address,
                    size,
                    id: id as u32,
                });
            }
        }
        let b = self.best_fit(need, uniform)?;
        let class = floor_log2(b.size);
        if self.free[class].peek().map(|(_, _, id)| id) == Some(b.id as u64) {
            self.free[class].pop();
            if self.free[class].is_empty() {
                self.nonempty &= !(1u64 << class);
            }
        } else {
            self.remove(&b);
        }
        Some(b)
    }

    /// Removes the free block `b` (found by `best_fit`); false if it is no longer here.
    pub(crate) fn remove(&mut self, b: &FreeBlock) -> bool {
        let class = floor_log2(b.size);
        let list = &mut self.free[class];
        let removed = list.remove(b.id as u64);
        if list.is_empty() {
            self.nonempty &= !(1u64 << class);
        }
        removed
    }

    /// Adds a free block.
    #[inline]
    pub(crate) fn push(&mut self, b: FreeBlock) {
        let class = floor_log2(b.size);
        self.free[class].push((b.address, b.size, b.id as u64));
        self.nonempty |= 1u64 << class;
    }

    /// Removes every free block, handing each to `f`.
    pub(crate) fn drain(&mut self, mut f: impl FnMut(FreeBlock)) {
        for list in self.free.iter_mut() {
            for (address, size, id) in list.drain() {
                f(FreeBlock {
                    address,
                    size,
                    id: id as u32,
                });
            }
        }
        self.nonempty = 0;
    }

    /// Number of free blocks.
    pub(crate) fn free_blocks(&self) -> usize {
        self.free.iter().map(FreeList::len).sum()
    }

    /// Whether adding `delta` keeps every counter within its limit.
    pub(crate) fn fits(&self, delta: &Counts) -> bool {
        (0..COUNTERS).all(|c| delta[c] <= 0 || self.counts[c] + delta[c] <= self.limits[c])
    }

    pub(crate) fn apply(&mut self, delta: &Counts) {
        for (count, d) in self.counts.iter_mut().zip(delta) {
            *count += d;
        }
    }
}

/// A free block in a [`FreeList`]: `(address, size, id)`, ordered by address. The id is
/// widened to 64 bits so an entry is written and read as whole words (a narrower field made
/// the read-back of a just-written entry miss store forwarding on the cached path).
type Entry = (usize, usize, u64);

/// The free blocks of one size class, lowest address first: the lowest one on its own, the
/// others in a min-heap. A thread that takes a block and gives it back, the cached path's
/// usual pattern, then moves one entry in and out of the shard's own cache lines, whatever
/// the number of blocks the class holds; with every block in the heap, each take and give
/// back sifts through it (a 4 KiB pair took 29 ns rather than 22 in a shard holding a hundred
/// blocks of larger classes).
#[derive(Default)]
struct FreeList {
    /// The block of the lowest address, when it is not in `rest`: lower than all of them.
    lowest: Option<Entry>,
    rest: BinaryHeap<Reverse<Entry>>,
}

impl FreeList {
    /// The block of the lowest address.
    #[inline]
    fn peek(&self) -> Option<Entry> {
        self.lowest.or_else(|| self.rest.peek().map(|r| r.0))
    }

    /// Takes the block of the lowest address.
    #[inline]
    fn pop(&mut self) -> Option<Entry> {
        self.lowest.take().or_else(|| self.rest.pop().map(|r| r.0))
    }

    #[inline]
    fn push(&mut self, entry: Entry) {
        match self.lowest {
            Some(lowest) if lowest < entry => self.push_rest(entry),
            Some(lowest) => {
                self.push_rest(lowest);
                self.lowest = Some(entry);
            }
            None if self.rest.peek().is_some_and(|r| r.0 < entry) => self.push_rest(entry),
            None => self.lowest = Some(entry),
        }
    }

    #[inline]
    fn push_rest(&mut self, entry: Entry) {
        if self.rest.capacity() == 0 {
            // Room for several blocks at once, so that the first entries of different shards'
            // heaps never share a cache line (small heap buffers sit next to each other).
            self.rest.reserve(HEAP_START);
        }
        self.rest.push(Reverse(entry));
    }

    /// Removes the block `id`; false if the list does not hold it.
    fn remove(&mut self, id: u64) -> bool {
        if self.lowest.is_some_and(|(_, _, held)| held == id) {
            self.lowest = None;
            return true;
        }
        let before = self.rest.len();
        self.rest.retain(|r| r.0 .2 != id);
        self.rest.len() != before
    }

    fn len(&self) -> usize {
        usize::from(self.lowest.is_some()) + self.rest.len()
    }

    fn is_empty(&self) -> bool {
        self.lowest.is_none() && self.rest.is_empty()
    }

    /// Every block, in no particular order.
    fn iter(&self) -> impl Iterator<Item = Entry> + '_ {
        self.lowest.into_iter().chain(self.rest.iter().map(|r| r.0))
    }

    /// Takes every block, in no particular order.
    fn drain(&mut self) -> impl Iterator<Item = Entry> + '_ {
        self.lowest
            .take()
            .into_iter()
            .chain(self.rest.drain().map(|r| r.0))
    }
}

/// `floor(log2(n))` for `n > 0`: the class of a block of `n` bytes.
pub(crate) fn floor_log2(n: usize) -> usize {
    (usize::BITS - 1 - n.max(1).leading_zeros()) as usize
}

/// Most shards an allocator has.
const MAX_SHARDS: usize = 64;

/// Live threads that have each shard slot as their home (process-wide: every allocator of the
/// process has the same number of shards).
static USERS: [AtomicU32; MAX_SHARDS] = [const { AtomicU32::new(0) }; MAX_SHARDS];

/// The calling thread's shard slot; given back when the thread exits.
struct HomeSlot(Cell<usize>);

impl Drop for HomeSlot {
    fn drop(&mut self) {
        let slot = self.0.get();
        if slot != usize::MAX {
            USERS[slot].fetch_sub(1, Ordering::Relaxed);
        }
    }
}

thread_local! {
    static HOME: HomeSlot = const { HomeSlot(Cell::new(usize::MAX)) };
}

/// The calling thread's shard slot, in `0..shard_count()`. A thread gets the slot with the
/// fewest live threads (the lowest such) when it first asks, so threads never share a shard
/// while there are no more of them than shards, whatever threads came and went before.
#[inline]
pub(crate) fn home_slot() -> usize {
    HOME.try_with(|home| {
        let slot = home.0.get();
        if slot != usize::MAX {
            return slot;
        }
        let slot = claim_slot(&USERS[..shard_count()]);
        home.0.set(slot);
        slot
    })
    .unwrap_or(0)
}

/// Takes a place in the slot with the fewest users (the lowest such) and returns it.
#[cold]
fn claim_slot(slots: &[AtomicU32]) -> usize {
    loop {
        let (slot, users) = slots
            .iter()
            .map(|u| u.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(i, users)| (users, i))
            .expect("at least one shard");
        if slots[slot]
            .compare_exchange(users, users + 1, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            return slot;
        }
    }
}

/// Shards per allocator: twice the CPUs, as a power of two, at least 4.
pub(crate) fn shard_count() -> usize {
    static COUNT: once_cell::sync::OnceCell<usize> = once_cell::sync::OnceCell::new();
    *COUNT.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
        (cpus * 2).next_power_of_two().clamp(4, MAX_SHARDS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::xorshift;

    fn block(address: usize, size: usize, id: u32) -> FreeBlock {
        FreeBlock { address, size, id }
    }

    #[test]
    fn best_fit_is_the_smallest_block_that_fits_then_the_lowest_address() {
        let s = Shard::new();
        let mut g = s.inner.lock();
        assert_eq!(g.best_fit(1, true), None);
        g.push(block(0x10_0000, 1 << 20, 1));
        g.push(block(0x9000, 4096, 2));
        g.push(block(0x3000, 4096, 3));
        assert_eq!(g.best_fit(4096, true), Some(block(0x3000, 4096, 3)));
        assert_eq!(g.best_fit(4097, true), Some(block(0x10_0000, 1 << 20, 1)));
        assert_eq!(g.best_fit((1 << 20) + 1, true), None);
    }

    #[test]
    fn best_fit_without_uniform_classes_skips_blocks_too_small() {
        let s = Shard::new();
        let mut g = s.inner.lock();
        g.push(block(0x1000, 5 * 4096, 1));
        g.push(block(0x9_0000, 7 * 4096, 2));
        g.push(block(0x5_0000, 6 * 4096, 3));
        assert_eq!(
            g.best_fit(6 * 4096, false),
            Some(block(0x5_0000, 6 * 4096, 3))
        );
        assert!(g.remove(&block(0x5_0000, 6 * 4096, 3)));
        assert!(!g.remove(&block(0x5_0000, 6 * 4096, 3)));
        assert_eq!(
            g.best_fit(6 * 4096, false),
            Some(block(0x9_0000, 7 * 4096, 2))
        );
    }

    #[test]
    fn threads_take_the_least_used_slot_and_a_freed_slot_is_taken_again() {
        let slots: [AtomicU32; 4] = [const { AtomicU32::new(0) }; 4];
        let taken: Vec<usize> = (0..4).map(|_| claim_slot(&slots)).collect();
        assert_eq!(
            taken,
            [0, 1, 2, 3],
            "no two of four threads share one of four slots"
        );
        slots[2].fetch_sub(1, Ordering::Relaxed);
        assert_eq!(claim_slot(&slots), 2, "a slot given back is the least used");
        assert_eq!(claim_slot(&slots), 0, "then slots are shared evenly");
    }

    #[test]
    fn a_class_hands_out_its_lowest_address_first() {
        let s = Shard::new();
        let mut g = s.inner.lock();
        g.push(block(0x9000, 4096, 1));
        g.push(block(0x3000, 4096, 2));
        g.push(block(0x5000, 4096, 3));
        assert_eq!(g.take_best(4096, true).map(|b| b.id), Some(2));
        assert_eq!(g.take_best(4096, true).map(|b| b.id), Some(3));
        assert_eq!(g.take_best(4096, true).map(|b| b.id), Some(1));
        assert_eq!(g.take_best(4096, true), None);
        assert_eq!(g.best_fit(1, true), None);
    }

    /// A free list hands out the lowest address held, whatever the mix of pushes (below,
    /// between and above the lowest), takes and removals (of the lowest and of others), the
    /// same as a sorted set would; its length and contents agree with the set throughout.
    #[test]
    fn a_free_list_is_a_sorted_set_by_address() {
        use std::collections::BTreeSet;
        let mut list = FreeList::default();
        let mut model = BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000u64 {
            xorshift(&mut x);
            match x % 5 {
                0 | 1 => {
                    // Distinct addresses: the step number in the low bits.
                    let entry = (((x >> 40) as usize) << 20 | step as usize, 4096, step);
                    list.push(entry);
                    model.insert(entry);
                }
                2 => assert_eq!(list.pop(), model.pop_first()),
                3 => {
                    let pick = model
                        .iter()
                        .nth((x >> 32) as usize % model.len().max(1))
                        .copied();
                    if let Some(entry) = pick {
                        assert!(list.remove(entry.2));
                        model.remove(&entry);
                    }
                    assert!(!list.remove(u64::MAX), "an id it never held");
                }
                _ => {
                    // Take the lowest and give it back, the cached path's pattern.
                    let lowest = list.pop();
                    assert_eq!(lowest, model.first().copied());
                    if let Some(entry) = lowest {
                        list.push(entry);
                    }
                }
            }
            assert_eq!(list.peek(), model.first().copied());
            assert_eq!(list.len(), model.len());
            assert_eq!(list.is_empty(), model.is_empty());
        }
        let mut held: Vec<Entry> = list.iter().collect();
        held.sort_unstable();
        assert_eq!(held, model.iter().copied().collect::<Vec<_>>());
        let mut drained: Vec<Entry> = list.drain().collect();
        drained.sort_unstable();
        assert_eq!(drained, model.into_iter().collect::<Vec<_>>());
        assert!(list.is_empty());
    }

    #[test]
    fn floor_log2_names_the_class() {
        assert_eq!(floor_log2(1), 0);
        assert_eq!(floor_log2(4096), 12);
        assert_eq!(floor_log2(4097), 12);
        assert_eq!(floor_log2(usize::MAX), 63);
    }
}

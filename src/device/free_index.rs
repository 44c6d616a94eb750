//! The ordered index of a pool's free blocks, keyed by (size, address, block id): best fit is
//! the first key at or above (request, 0, 0).
//!
//! Most pools hold a handful of free blocks, where a sorted vector beats a B-tree several times
//! over (a cached malloc+free moves a few keys); fragmented pools can hold thousands, where a
//! B-tree's logarithmic updates win. The index switches between the two with hysteresis.

use std::collections::BTreeSet;

pub(crate) type Key = (usize, usize, u32);

/// Above this many keys the index becomes a B-tree...
const PROMOTE: usize = 64;
/// ...and below this many it becomes a vector again.
const DEMOTE: usize = 16;

pub(crate) enum FreeIndex {
    Sorted(Vec<Key>),
    Tree(BTreeSet<Key>),
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex::Sorted(Vec::with_capacity(PROMOTE))
    }
}

impl FreeIndex {
    pub fn insert(&mut self, key: Key) {
        match self {
            FreeIndex::Sorted(v) => {
                // Appending is the common case in small pools (one free block, or the largest).
                if v.last().is_none_or(|last| *last < key) {
                    v.push(key);
                } else {
                    let at = v.partition_point(|k| *k < key);
                    v.insert(at, key);
                }
                if v.len() > PROMOTE {
                    *self = FreeIndex::Tree(v.drain(..).collect());
                }
            }
            FreeIndex::Tree(t) => {
                t.insert(key);
            }
        }
    }

    pub fn remove(&mut self, key: &Key) -> bool {
        match self {
            FreeIndex::Sorted(v) if v.last() == Some(key) => {
                v.pop();
                true
            }
            FreeIndex::Sorted(v) => match v.binary_search(key) {
                Ok(at) => {
                    v.remove(at);
                    true
                }
                Err(_) => false,
            },
            FreeIndex::Tree(t) => {
                let removed = t.remove(key);
                if t.len() < DEMOTE {
                    let mut v = Vec::with_capacity(PROMOTE);
                    v.extend(t.iter().copied());
                    *self = FreeIndex::Sorted(v);
                }
                removed
            }
        }
    }

    /// The smallest key at or above `from`.
    pub fn first_at_least(&self, from: Key) -> Option<Key> {
        match self {
            FreeIndex::Sorted(v) => v.get(v.partition_point(|k| *k < from)).copied(),
            FreeIndex::Tree(t) => t.range(from..).next().copied(),
        }
    }

    /// The keys at or above `from`, in order.
    pub fn iter_from(&self, from: Key) -> Box<dyn Iterator<Item = Key> + '_> {
        match self {
            FreeIndex::Sorted(v) => Box::new(v[v.partition_point(|k| *k < from)..].iter().copied()),
            FreeIndex::Tree(t) => Box::new(t.range(from..).copied()),
        }
    }

    pub fn iter(&self) -> Box<dyn Iterator<Item = Key> + '_> {
        match self {
            FreeIndex::Sorted(v) => Box::new(v.iter().copied()),
            FreeIndex::Tree(t) => Box::new(t.iter().copied()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_agrees_with_a_btree_through_promotion_and_demotion() {
        let mut index = FreeIndex::default();
        let mut model = BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Grow for a while, then shrink, so both representations are exercised.
            let grow = (step / 2000) % 2 == 0;
            let key = (
                (x % 50) as usize * 512,
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
            let probe = ((x >> 30) as usize % 60 * 512, 0, 0);
            assert_eq!(
                index.first_at_least(probe),
                model.range(probe..).next().copied()
            );
        }
        assert!(index.iter().eq(model.iter().copied()));
        let probe = (20 * 512, 0, 0);
        assert!(index.iter_from(probe).eq(model.range(probe..).copied()));
        assert!(!index.remove(&(1, 1, 1)));
    }
}

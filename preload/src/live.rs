//! The allocations the hooks handed out and not yet took back: address -> where it came from.
//!
//! Every cached pair inserts and removes one entry, so this is built for that: a fixed table of
//! groups of eight slots (the keys of a group share one cache line), claimed and released with
//! one compare-and-swap each, no lock. An address has one home group; when all eight slots are
//! taken the entry goes to a locked overflow map, which is only consulted while it holds
//! anything. A compare-and-swap on removal makes a racing double free take the entry once.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

/// A device or pinned-host allocation handed out by a hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Live {
    /// The pool it came from: a stream handle or [`crate::state::SYNC_POOL`] for device
    /// memory; the host allocator's context for pinned memory.
    pub pool: usize,
    /// The size asked for.
    pub size: usize,
    /// The device index, or [`HOST`].
    pub device: u8,
}

/// The `device` of pinned-host allocations.
pub const HOST: u8 = u8::MAX;

const WAYS: usize = 8;
const GROUPS: usize = 1 << 12;

#[repr(align(64))]
struct Group {
    keys: [AtomicUsize; WAYS],
    pools: [AtomicUsize; WAYS],
    /// `size << 8 | device`.
    meta: [AtomicU64; WAYS],
}

type Map<V> = FxHashMap<usize, V>;
const MAP_SHARDS: usize = 32;

/// A map from addresses, sharded so threads rarely meet on a lock (for the paths that are not
/// hot).
pub struct PtrMap<V> {
    shards: [Mutex<Map<V>>; MAP_SHARDS],
}

impl<V> PtrMap<V> {
    pub fn new() -> Self {
        PtrMap {
            shards: std::array::from_fn(|_| Mutex::new(Map::default())),
        }
    }
    fn shard(&self, ptr: usize) -> &Mutex<Map<V>> {
        &self.shards[(ptr >> 9) % MAP_SHARDS]
    }
    pub fn insert(&self, ptr: usize, v: V) {
        self.shard(ptr).lock().insert(ptr, v);
    }
    pub fn remove(&self, ptr: usize) -> Option<V> {
        self.shard(ptr).lock().remove(&ptr)
    }
    pub fn contains(&self, ptr: usize) -> bool {
        self.shard(ptr).lock().contains_key(&ptr)
    }
}

/// The live allocations.
pub struct LiveTable {
    groups: Box<[Group]>,
    overflow: PtrMap<Live>,
    /// Entries in `overflow`.
    overflowed: AtomicUsize,
}

impl LiveTable {
    pub fn new() -> Self {
        LiveTable {
            groups: (0..GROUPS)
                .map(|_| Group {
                    keys: Default::default(),
                    pools: Default::default(),
                    meta: Default::default(),
                })
                .collect(),
            overflow: PtrMap::new(),
            overflowed: AtomicUsize::new(0),
        }
    }

    #[inline]
    fn group(&self, ptr: usize) -> &Group {
        let h = ((ptr >> 9) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        &self.groups[(h >> (64 - GROUPS.trailing_zeros())) as usize]
    }

    /// Notes a new allocation at `ptr` (non-zero, not live).
    #[inline]
    pub fn insert(&self, ptr: usize, live: Live) {
        debug_assert!(ptr != 0);
        let g = self.group(ptr);
        for i in 0..WAYS {
            if g.keys[i].load(Relaxed) == 0
                && g.keys[i].compare_exchange(0, ptr, Acquire, Relaxed).is_ok()
            {
                // The program learns `ptr` from this thread only after these stores, so
                // whichever thread frees it sees them.
                g.pools[i].store(live.pool, Relaxed);
                g.meta[i].store((live.size as u64) << 8 | live.device as u64, Relaxed);
                return;
            }
        }
        self.insert_overflow(ptr, live);
    }

    #[cold]
    fn insert_overflow(&self, ptr: usize, live: Live) {
        self.overflowed.fetch_add(1, Relaxed);
        self.overflow.insert(ptr, live);
    }

    /// Takes the entry of `ptr` out, if `ptr` is live.
    #[inline]
    pub fn remove(&self, ptr: usize) -> Option<Live> {
        // 0 is the key of an empty slot, never a live address.
        if ptr == 0 {
            return None;
        }
        let g = self.group(ptr);
        for i in 0..WAYS {
            if g.keys[i].load(Relaxed) == ptr {
                let meta = g.meta[i].load(Relaxed);
                let live = Live {
                    pool: g.pools[i].load(Relaxed),
                    size: (meta >> 8) as usize,
                    device: meta as u8,
                };
                // Release: the reads above come before another insert claims the slot.
                return g.keys[i]
                    .compare_exchange(ptr, 0, Release, Relaxed)
                    .is_ok()
                    .then_some(live);
            }
        }
        if self.overflowed.load(Relaxed) == 0 {
            return None;
        }
        self.remove_overflow(ptr)
    }

    #[cold]
    fn remove_overflow(&self, ptr: usize) -> Option<Live> {
        let live = self.overflow.remove(ptr)?;
        self.overflowed.fetch_sub(1, Relaxed);
        Some(live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(pool: usize, size: usize, device: u8) -> Live {
        Live { pool, size, device }
    }

    #[test]
    fn an_entry_comes_out_once_with_what_went_in() {
        let t = LiveTable::new();
        t.insert(0x7f00_0000_0200, live(42, 4096, 1));
        assert_eq!(t.remove(0x7f00_0000_0200), Some(live(42, 4096, 1)));
        assert_eq!(t.remove(0x7f00_0000_0200), None);
    }

    #[test]
    fn an_unknown_address_is_not_live() {
        let t = LiveTable::new();
        t.insert(0x1000, live(1, 512, 0));
        assert_eq!(t.remove(0x1200), None);
        assert_eq!(t.remove(0), None);
    }

    #[test]
    fn addresses_past_a_full_group_overflow_and_still_come_back() {
        let t = LiveTable::new();
        // Addresses GROUPS * 512 apart... are not guaranteed to share a group, so insert enough
        // that many groups fill up.
        let ptrs: Vec<usize> = (1..=GROUPS * WAYS * 2).map(|i| i * 512).collect();
        for (i, &p) in ptrs.iter().enumerate() {
            t.insert(p, live(i, i * 2, (i % 4) as u8));
        }
        assert!(t.overflowed.load(Relaxed) >= GROUPS * WAYS);
        for (i, &p) in ptrs.iter().enumerate().rev() {
            assert_eq!(t.remove(p), Some(live(i, i * 2, (i % 4) as u8)), "{p:#x}");
        }
        assert_eq!(t.overflowed.load(Relaxed), 0);
    }

    /// `n` addresses that all have the same home group as `0x7f00_0000_0000`.
    fn same_group(t: &LiveTable, n: usize) -> Vec<usize> {
        let home = t.group(0x7f00_0000_0000);
        (0..)
            .map(|i| 0x7f00_0000_0000 + i * 512)
            .filter(|&p| std::ptr::eq(t.group(p), home))
            .take(n)
            .collect()
    }

    #[test]
    fn threads_inserting_and_removing_in_one_group_never_lose_or_duplicate_an_entry() {
        const THREADS: usize = 4;
        const PER_THREAD: usize = 6;
        const ROUNDS: usize = 3000;
        let t = LiveTable::new();
        // 24 addresses for 8 slots: the threads race for the same slots, and some of the
        // entries go to the overflow map.
        let ptrs = same_group(&t, THREADS * PER_THREAD);
        let taken = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for (id, mine) in ptrs.chunks(PER_THREAD).enumerate() {
                let (t, taken) = (&t, &taken);
                s.spawn(move || {
                    for round in 0..ROUNDS {
                        let value =
                            |k: usize| live(id << 32 | round << 8 | k, 512 * (k + 1), id as u8);
                        for (k, &p) in mine.iter().enumerate() {
                            t.insert(p, value(k));
                        }
                        for (k, &p) in mine.iter().enumerate().rev() {
                            assert_eq!(t.remove(p), Some(value(k)), "thread {id} round {round}");
                            assert_eq!(t.remove(p), None, "thread {id} round {round}");
                            taken.fetch_add(1, Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(taken.load(Relaxed), THREADS * PER_THREAD * ROUNDS);
        assert_eq!(t.overflowed.load(Relaxed), 0);
        for p in ptrs {
            assert_eq!(t.remove(p), None);
        }
    }

    #[test]
    fn racing_removals_of_one_entry_take_it_once() {
        let t = LiveTable::new();
        for round in 0..2000usize {
            let p = (round + 1) * 4096;
            t.insert(p, live(round, 512, 0));
            let taken = std::thread::scope(|s| {
                let a = s.spawn(|| t.remove(p).is_some() as u32);
                let b = s.spawn(|| t.remove(p).is_some() as u32);
                a.join().unwrap() + b.join().unwrap()
            });
            assert_eq!(taken, 1, "round {round}");
        }
    }
}

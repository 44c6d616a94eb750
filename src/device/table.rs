//! A table from stream handle to shard, read without locks or shared writes.
//!
//! Lookups read a few atomics that are written only when a stream is first seen, so threads
//! on different streams share no written cache line. Insertion takes a mutex. Shards are
//! never freed while the table lives: a process has at most [`MAX_SHARDS`] of them per device.
//! A new stream first takes a shard offered as idle ([`ShardTable::offer_idle`]: the last
//! emptying of the cache left it holding nothing), whose structures are already grown, if it
//! still holds nothing (`adopt`); when the table is full, a shard that holds nothing once its
//! cache is returned (its stream is gone or idle) moves to the new stream (`reuse`). A lookup
//! racing with such a move may return a shard that does not serve the stream looked up, so
//! callers that act for a stream check, under the shard's lock, that the shard serves it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering::*};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Streams a device serves at once.
pub(crate) const MAX_SHARDS: usize = 4096;
const BUCKETS: usize = MAX_SHARDS * 2;
/// How many times a full table offers its shards for reuse before a new stream is refused
/// (about 0.1 s of pauses in all).
const REUSE_ROUNDS: usize = 25;
/// The key of a bucket whose shard moved to another stream: an address that no stream
/// handle has (the lowest non-canonical address of 64-bit machines), refused as a key.
pub(crate) const VACATED: usize = 1 << (usize::BITS - 1);

pub(crate) struct ShardTable<T> {
    /// Shards by index, in creation order; owned by the table.
    slots: Box<[AtomicPtr<T>]>,
    count: AtomicUsize,
    /// Open-addressed hash of keys: `index + 1` of the shard, 0 when empty. A bucket never
    /// becomes empty again: a moved shard's old bucket keeps [`VACATED`] as its key until a
    /// later insertion takes it.
    buckets: Box<[AtomicU32]>,
    keys: Box<[AtomicUsize]>,
    /// Taken to insert or move.
    insert: Mutex<Inserts>,
}

/// What insertions and moves share.
#[derive(Default)]
struct Inserts {
    /// Where the next search for a shard to reuse starts, so that successive searches take
    /// turns over the shards.
    next_reuse: usize,
    /// Indices of the shards last offered as idle and not taken yet, in the order offered.
    idle: VecDeque<u32>,
}

fn bucket_of(key: usize) -> usize {
    let m = (key as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((m as u64) ^ ((m >> 64) as u64)) as usize & (BUCKETS - 1)
}

impl<T> ShardTable<T> {
    pub fn new() -> Self {
        ShardTable {
            slots: (0..MAX_SHARDS)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            count: AtomicUsize::new(0),
            buckets: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
            keys: (0..BUCKETS).map(|_| AtomicUsize::new(0)).collect(),
            insert: Mutex::default(),
        }
    }

    /// The shard of `key`, if it exists. While a shard moves to another key, this may return a
    /// shard that does not serve `key`: the moving one for its old key, or, for the new key,
    /// the shard whose vacated bucket the move takes (module documentation). Never a shard
    /// for [`VACATED`].
    #[inline]
    pub fn get(&self, key: usize) -> Option<&T> {
        // Vacated buckets hold that key: it names no shard.
        if key == VACATED {
            return None;
        }
        let mut b = bucket_of(key);
        // Every bucket may be taken once shards have moved, so the probe is bounded.
        for _ in 0..BUCKETS {
            let index = self.buckets[b].load(Acquire);
            if index == 0 {
                return None;
            }
            if self.keys[b].load(Relaxed) == key {
                return self.by_index(index - 1);
            }
            b = (b + 1) & (BUCKETS - 1);
        }
        None
    }

    /// The shard of `key`. If there is none yet, the shards offered as idle
    /// ([`ShardTable::offer_idle`]) go to `adopt` in the order offered (each once): the first
    /// for which it returns the key the shard served (having made the shard serve `key`, under
    /// the shard's lock) moves to `key`. Otherwise `make(index)` makes a new one, and when the
    /// table is full, the shards are offered to `reuse` in turn, starting after the last one
    /// reused, in the same way. Fails when `key` is [`VACATED`], or the table is full and
    /// `reuse` takes no shard.
    #[inline]
    pub fn get_or_insert(
        &self,
        key: usize,
        make: impl FnOnce(u32) -> T,
        adopt: impl FnMut(&T) -> Option<usize>,
        reuse: impl FnMut(&T) -> Option<usize>,
    ) -> Result<&T> {
        if let Some(shard) = self.get(key) {
            return Ok(shard);
        }
        self.insert_slow(key, make, adopt, reuse)
    }

    /// Offers the shards of `indices`, in that order, to the next new keys
    /// ([`ShardTable::get_or_insert`]'s `adopt`), in place of those offered before: the
    /// caller names every shard that holds nothing.
    pub fn offer_idle(&self, indices: Vec<u32>) {
        self.insert.lock().idle = indices.into();
    }

    #[cold]
    fn insert_slow(
        &self,
        key: usize,
        make: impl FnOnce(u32) -> T,
        mut adopt: impl FnMut(&T) -> Option<usize>,
        mut reuse: impl FnMut(&T) -> Option<usize>,
    ) -> Result<&T> {
        if key == VACATED {
            return Err(Error::InvalidArgument(format!(
                "stream {key:#x} is not a stream handle"
            )));
        }
        let mut inserts = self.insert.lock();
        if let Some(shard) = self.get(key) {
            return Ok(shard);
        }
        // An offered shard that is not idle any more is not offered again.
        while let Some(index) = inserts.idle.pop_front() {
            let Some(shard) = self.by_index(index) else {
                continue;
            };
            if let Some(old) = adopt(shard) {
                self.moved(old, key, index as usize);
                return Ok(shard);
            }
        }
        let index = self.count.load(Relaxed);
        if index < MAX_SHARDS {
            let shard = Box::into_raw(Box::new(make(index as u32)));
            self.slots[index].store(shard, Release);
            self.count.store(index + 1, Release);
            self.place(key, index);
            // SAFETY: `shard` was just made from a Box and is only freed when the table drops.
            return Ok(unsafe { &*shard });
        }
        // `reuse` passes over shards whose lock is taken (a settle of peaks may hold every
        // shard's lock for a moment), so the shards are offered a few times, with pauses.
        let mut pause = std::time::Duration::from_micros(50);
        for round in 0..REUSE_ROUNDS {
            if round > 0 {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(5));
            }
            for step in 0..MAX_SHARDS {
                let index = (inserts.next_reuse + step) % MAX_SHARDS;
                let Some(shard) = self.by_index(index as u32) else {
                    continue;
                };
                if let Some(old) = reuse(shard) {
                    inserts.next_reuse = (index + 1) % MAX_SHARDS;
                    self.moved(old, key, index);
                    return Ok(shard);
                }
            }
        }
        Err(Error::InvalidArgument(format!(
            "too many streams: a device serves at most {MAX_SHARDS} streams at once, and every \
             one of them holds memory (allocations in use, frees waiting for work queued on \
             other streams, or mapped pages of expandable segments, which empty_cache returns)"
        )))
    }

    /// Maps `key` to shard `index` in the first bucket of `key`'s probe that is empty or
    /// vacated. The caller holds the insertion lock.
    fn place(&self, key: usize, index: usize) {
        let mut b = bucket_of(key);
        loop {
            let taken = self.buckets[b].load(Relaxed);
            if taken == 0 {
                // Readers that see the bucket taken see its key.
                self.keys[b].store(key, Relaxed);
                self.buckets[b].store(index as u32 + 1, Release);
                return;
            }
            if self.keys[b].load(Relaxed) == VACATED {
                // A reader may see the old index with the new key: it gets a shard that does
                // not serve `key`, which the callers' check under the shard's lock catches.
                self.buckets[b].store(index as u32 + 1, Release);
                self.keys[b].store(key, Release);
                return;
            }
            // At most MAX_SHARDS buckets hold a key, so an empty or vacated one comes.
            b = (b + 1) & (BUCKETS - 1);
        }
    }

    /// Maps `key` to shard `index`, which served `old` until now. The caller holds the
    /// insertion lock.
    fn moved(&self, old: usize, key: usize, index: usize) {
        self.vacate(old, index);
        self.place(key, index);
    }

    /// Marks vacated the bucket that maps `key`, the key shard `index` served, to it: the one
    /// along `key`'s probe. The caller holds the insertion lock.
    fn vacate(&self, key: usize, index: usize) {
        let wanted = index as u32 + 1;
        let mut b = bucket_of(key);
        for _ in 0..BUCKETS {
            match self.buckets[b].load(Relaxed) {
                0 => return,
                taken if taken == wanted && self.keys[b].load(Relaxed) == key => {
                    self.keys[b].store(VACATED, Release);
                    return;
                }
                _ => b = (b + 1) & (BUCKETS - 1),
            }
        }
    }

    /// The shard with creation index `index`.
    #[inline]
    pub fn by_index(&self, index: u32) -> Option<&T> {
        let p = self.slots.get(index as usize)?.load(Acquire);
        // SAFETY: non-null slots point to shards owned by the table until it drops, and `&self`
        // keeps the table alive.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Every shard, in creation order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        (0..self.count.load(Acquire) as u32).filter_map(|i| self.by_index(i))
    }
}

impl<T> Drop for ShardTable<T> {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            let p = slot.load(Acquire);
            if !p.is_null() {
                // SAFETY: each non-null slot holds a pointer from Box::into_raw, freed once here.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

// SAFETY: the table hands out shared references to `T` across threads and moves ownership of
// boxed `T`s; this is sound when `T` is Send + Sync.
unsafe impl<T: Send + Sync> Sync for ShardTable<T> {}
// SAFETY: as above; the raw pointers are owned boxes.
unsafe impl<T: Send + Sync> Send for ShardTable<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A full table's shard moves from the stream hashed where the vacated key hashes: the
    /// vacated key still finds no shard, and is refused as a stream.
    #[test]
    fn the_vacated_key_never_finds_a_moved_shard() {
        let table: ShardTable<AtomicUsize> = ShardTable::new();
        let first = (0..)
            .find(|&k| k != VACATED && bucket_of(k) == bucket_of(VACATED))
            .unwrap();
        let make = |key: usize| move |_| AtomicUsize::new(key);
        table
            .get_or_insert(first, make(first), |_| None, |_| None)
            .unwrap();
        for key in (1..).map(|k| first + k).take(MAX_SHARDS - 1) {
            table
                .get_or_insert(key, make(key), |_| None, |_| None)
                .unwrap();
        }
        let newcomer = usize::MAX / 4;
        let moved = table
            .get_or_insert(
                newcomer,
                make(newcomer),
                |_| None,
                |s| (s.load(Relaxed) == first).then(|| s.swap(newcomer, Relaxed)),
            )
            .unwrap();
        assert_eq!(moved.load(Relaxed), newcomer);
        assert!(std::ptr::eq(table.get(newcomer).unwrap(), moved));
        assert!(table.get(first).is_none());
        assert!(table.get(VACATED).is_none());
        assert!(table
            .get_or_insert(VACATED, make(VACATED), |_| Some(0), |_| Some(0))
            .is_err());
    }
}

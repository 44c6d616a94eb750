//! An insert-only table from stream handle to shard, read without locks or shared writes.
//!
//! Streams are few and live as long as the process, so shards are never removed. Lookups
//! read a few atomics that are written only when a stream is first seen, so threads on
//! different streams share no written cache line. Insertion takes a mutex.

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering::*};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Streams a device can serve.
pub(crate) const MAX_SHARDS: usize = 4096;
const BUCKETS: usize = MAX_SHARDS * 2;

pub(crate) struct ShardTable<T> {
    /// Shards by index, in creation order; owned by the table.
    slots: Box<[AtomicPtr<T>]>,
    count: AtomicUsize,
    /// Open-addressed hash of keys: `index + 1` of the shard, 0 when empty.
    buckets: Box<[AtomicU32]>,
    keys: Box<[AtomicUsize]>,
    insert: Mutex<()>,
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
            insert: Mutex::new(()),
        }
    }

    /// The shard of `key`, if it exists.
    #[inline]
    pub fn get(&self, key: usize) -> Option<&T> {
        let mut b = bucket_of(key);
        loop {
            let index = self.buckets[b].load(Acquire);
            if index == 0 {
                return None;
            }
            if self.keys[b].load(Relaxed) == key {
                return self.by_index(index - 1);
            }
            b = (b + 1) & (BUCKETS - 1);
        }
    }

    /// The shard of `key`, made by `make(index)` if it does not exist yet.
    #[inline]
    pub fn get_or_insert(&self, key: usize, make: impl FnOnce(u32) -> T) -> Result<&T> {
        if let Some(shard) = self.get(key) {
            return Ok(shard);
        }
        self.insert_slow(key, make)
    }

    #[cold]
    fn insert_slow(&self, key: usize, make: impl FnOnce(u32) -> T) -> Result<&T> {
        let _guard = self.insert.lock();
        if let Some(shard) = self.get(key) {
            return Ok(shard);
        }
        let index = self.count.load(Relaxed);
        if index >= MAX_SHARDS {
            return Err(Error::InvalidArgument(format!(
                "too many streams: a device serves at most {MAX_SHARDS} distinct streams"
            )));
        }
        let shard = Box::into_raw(Box::new(make(index as u32)));
        self.slots[index].store(shard, Release);
        self.count.store(index + 1, Release);
        let mut b = bucket_of(key);
        while self.buckets[b].load(Relaxed) != 0 {
            b = (b + 1) & (BUCKETS - 1);
        }
        self.keys[b].store(key, Relaxed);
        self.buckets[b].store(index as u32 + 1, Release);
        // SAFETY: `shard` was just made from a Box and is only freed when the table drops.
        Ok(unsafe { &*shard })
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

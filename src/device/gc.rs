//! `garbage_collection_threshold`, with PyTorch's rules.
//!
//! Garbage collection runs only once a memory fraction is set (the threshold is a share of the
//! bytes the fraction allows), just before a request that no cached block serves asks the
//! driver for memory, and only while the device reserves more than the threshold. It then
//! returns whole free segments of the large pool to the driver, oldest first: a segment's age
//! is the number of large-pool requests made since it last became free. Each pass frees every
//! segment at least as old as the average age of those left, in the order of PyTorch's free
//! set (stream, size, address), and passes repeat until the excess over the threshold is
//! returned or nothing more can be freed. Expandable segments instead unmap free pages before
//! growing past the threshold.
//!
//! Ages are counted only while collection is enabled, so the hot paths pay one branch on a
//! plain field when it is not.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use super::shard::ShardInner;
use super::size::PoolKind;
use super::stats::{self, StatKind};
use super::{DeviceAllocator, Shard};

/// The clock of large-pool requests and the time each whole free segment became free.
#[derive(Default)]
pub(super) struct Ages {
    /// Large-pool requests made while collection was enabled.
    requests: AtomicU64,
    /// Address of a whole free large segment -> `requests` when it became free. Entries of
    /// segments allocated from since are stale and overwritten when the address next becomes
    /// a whole free segment, and go when the segment goes back to the driver; segments free
    /// since before collection was enabled have none (age counted from 0).
    freed_at: Mutex<HashMap<usize, u64>>,
}

/// A whole free segment considered for collection.
struct Candidate {
    shard: usize,
    id: u32,
    size: usize,
    age: u64,
    freed: bool,
}

impl DeviceAllocator {
    /// Whether garbage collection is enabled: a threshold is configured and a memory fraction
    /// set.
    #[inline]
    fn collecting(&self) -> bool {
        self.gc_threshold > 0.0 && self.limit.bytes().is_some()
    }

    /// Counts a request of `pool` for the ages of free segments. Returns whether collection
    /// is enabled: then requests take the full path, whose frees note when segments become
    /// free (a replayed pair leaves its block in the free index).
    #[inline(always)]
    pub(super) fn gc_note_request(&self, pool: PoolKind) -> bool {
        self.gc_threshold > 0.0 && self.gc_note_request_slow(pool)
    }

    #[cold]
    fn gc_note_request_slow(&self, pool: PoolKind) -> bool {
        if !self.collecting() {
            return false;
        }
        if pool == PoolKind::Large {
            self.gc_ages.requests.fetch_add(1, Relaxed);
        }
        true
    }

    /// Notes the time block `id`, just freed, became a whole free large segment (if it did).
    #[inline(always)]
    pub(super) fn gc_note_free(&self, inner: &ShardInner, id: u32) {
        if self.gc_threshold > 0.0 {
            self.gc_note_free_slow(inner, id);
        }
    }

    #[cold]
    fn gc_note_free_slow(&self, inner: &ShardInner, id: u32) {
        let b = inner.block(id);
        if b.pool == PoolKind::Large && !b.is_split() && self.collecting() {
            let now = self.gc_ages.requests.load(Relaxed);
            self.gc_ages.freed_at.lock().insert(b.addr, now);
        }
    }

    /// Forgets when the segment at `addr`, going back to the driver, became free.
    #[inline(always)]
    pub(super) fn gc_forget(&self, addr: usize) {
        if self.gc_threshold > 0.0 {
            self.gc_ages.freed_at.lock().remove(&addr);
        }
    }

    /// Before asking the driver for `want` more bytes for `shard`: collects garbage if the
    /// device reserves more than the threshold.
    pub(super) fn collect_garbage(&self, shard: &Shard, inner: &mut ShardInner, want: usize) {
        let Some(allowed) = self.limit.bytes() else {
            return;
        };
        let threshold = (self.gc_threshold * allowed as f64) as u64;
        let reserved = self
            .total_current(stats::aggregate(StatKind::ReservedBytes))
            .max(0) as u64;
        if self.layout.is_some() {
            // Expandable segments: unmap this stream's free pages before growing past it.
            let excess = (reserved + want as u64).saturating_sub(threshold) as usize;
            if excess > 0 {
                let _ = self.release_expandable(shard, inner, excess);
            }
            return;
        }
        let excess = reserved.saturating_sub(threshold) as usize;
        if excess > 0 {
            self.collect_segments(shard, inner, excess);
        }
    }

    /// PyTorch's collection passes over the whole free large segments of every stream, until
    /// `target` bytes are returned or no segment is old enough. Streams whose lock another
    /// thread holds are left out of this collection.
    fn collect_segments(&self, home: &Shard, home_inner: &mut ShardInner, target: usize) {
        let mut shards: Vec<&Shard> = self.shards.iter().filter(|s| !s.private).collect();
        shards.sort_by_key(|s| s.stream());
        let mut guards: Vec<Option<_>> = shards
            .iter()
            .map(|s| {
                (!std::ptr::eq(*s, home))
                    .then(|| s.inner.try_lock())
                    .flatten()
            })
            .collect();
        let now = self.gc_ages.requests.load(Relaxed);
        let mut candidates = Vec::new();
        {
            let freed_at = self.gc_ages.freed_at.lock();
            for (i, s) in shards.iter().enumerate() {
                let inner: &ShardInner = if std::ptr::eq(*s, home) {
                    &*home_inner
                } else if let Some(g) = &guards[i] {
                    g
                } else {
                    continue;
                };
                for id in inner.whole_free_segments() {
                    let b = inner.block(id);
                    if b.pool != PoolKind::Large {
                        continue;
                    }
                    let since = freed_at.get(&b.addr).copied().unwrap_or(0);
                    candidates.push(Candidate {
                        shard: i,
                        id,
                        size: b.size,
                        age: now.saturating_sub(since),
                        freed: false,
                    });
                }
            }
        }
        let mut total_age: u64 = candidates.iter().map(|c| c.age).sum();
        let mut left = candidates.len();
        let mut reclaimed = 0;
        let mut progress = true;
        while reclaimed < target && progress && left > 0 {
            let average = total_age as f64 / left as f64;
            progress = false;
            // Every segment of at least the average age goes, even past the target, so that
            // collection does not run again at once.
            for c in candidates.iter_mut().filter(|c| !c.freed) {
                if (c.age as f64) < average {
                    continue;
                }
                let shard = shards[c.shard];
                let inner: &mut ShardInner = if std::ptr::eq(shard, home) {
                    &mut *home_inner
                } else {
                    guards[c.shard]
                        .as_mut()
                        .expect("candidates come from locked shards")
                };
                if self.free_segment(shard, inner, c.id).is_err() {
                    continue;
                }
                c.freed = true;
                progress = true;
                reclaimed += c.size;
                total_age -= c.age;
                left -= 1;
            }
        }
    }
}

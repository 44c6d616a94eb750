//! The caching pinned-host allocator.
//!
//! Host-to-device copies are asynchronous only from page-locked (pinned) memory, and pinning
//! is slow, so pinned blocks are cached and reused (PyTorch's `CachingHostAllocator`
//! behaviour):
//!
//! - a request is rounded up to a power of two and served by a free block of at least that
//!   size, the smallest first and then the lowest address; only when none is free is new
//!   memory pinned through the [`Driver`]. The cached path looks only at the calling
//!   thread's shard, for the best fit there (the smallest size class with a fitting block,
//!   lowest address first): a block this thread's shard holds is preferred to a smaller one
//!   another thread's shard holds, so a thread never takes another thread's locks while its
//!   own shard can serve it. When it has none, every shard is searched for the best fit
//!   before the driver is asked;
//! - a block named in [`HostAllocator::record_event`] is, when freed, guarded by one event per
//!   stream that used it and becomes reusable once all have completed. Events are polled by
//!   later calls and never waited for;
//! - [`HostAllocator::empty_cache`] returns every free block to the driver.
//!
//! Layout of the module:
//! - `arena.rs`: blocks, named by small ids, readable without a lock;
//! - `table.rs`: the lock-free pointer → block index;
//! - `shard.rs`: per-thread free lists and counters, the only lock of the cached path;
//! - `events.rs`: the event pool and the queue of events guarding freed blocks;
//! - `pinning.rs`: driver allocation or registration of ordinary pages;
//! - `stats.rs`: the statistics snapshot;
//! - `alloc.rs`, `free.rs`, `release.rs`: the operations.

mod alloc;
mod arena;
mod events;
mod free;
mod pinning;
mod release;
mod shard;
mod stats;
mod table;

use std::sync::Arc;

use parking_lot::Mutex;

use crate::config::Config;
use crate::driver::Driver;

pub use stats::{HostStats, Stat};

use arena::Arena;
use events::{EventPool, EventQueue};
use pinning::{Mode, Pinner};
use shard::{Counts, Shard, COUNTERS};
use stats::Accumulated;
use table::PtrIndex;

/// A block handed out by [`HostAllocator::malloc`]: its address and the context that
/// identifies it to `free` and `record_event` without a lookup. Both are 0 for a 0-byte
/// request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBlock {
    pub ptr: usize,
    pub ctx: usize,
}

/// Largest request accepted: the largest power of two a `usize` holds.
const MAX_REQUEST: usize = 1 << (usize::BITS - 1);
/// Granularity of requests when power-of-two rounding is off.
const UNROUNDED_GRANULE: usize = 4096;

/// State changed only on the slow path, under one lock.
struct Global {
    /// Ids of released blocks, reused before new ones.
    free_ids: Vec<u32>,
    next_id: u32,
    acc: Accumulated,
}

/// A caching allocator of pinned host memory over a [`Driver`].
///
/// Thread-safe. Each instance has its own cache; the C functions use one per process.
pub struct HostAllocator {
    pinner: Pinner,
    round_power2: bool,
    arena: Arena,
    index: PtrIndex,
    shards: Box<[Shard]>,
    shard_mask: usize,
    events: EventQueue,
    pool: EventPool,
    global: Mutex<Global>,
    /// Peaks of the sharded counters; also serialises rebalancing of the shard limits.
    peaks: Mutex<Counts>,
}

impl HostAllocator {
    /// An allocator that pins through `driver`, in the mode `config` selects
    /// (`pinned_use_host_register`, `pinned_num_register_threads`, `pinned_round_power2`).
    pub fn new(driver: Arc<dyn Driver>, config: &Config) -> HostAllocator {
        let mode = if config.pinned_use_host_register {
            Mode::Register {
                threads: config.pinned_num_register_threads.max(1),
                chunk: pinning::DEFAULT_REGISTER_CHUNK,
            }
        } else {
            Mode::Alloc
        };
        let shards: Box<[Shard]> = (0..shard::shard_count()).map(|_| Shard::new()).collect();
        HostAllocator {
            pinner: Pinner { driver, mode },
            round_power2: config.pinned_round_power2,
            arena: Arena::new(),
            index: PtrIndex::new(),
            shard_mask: shards.len() - 1,
            shards,
            events: EventQueue::new(),
            pool: EventPool::new(),
            global: Mutex::new(Global {
                free_ids: Vec::new(),
                next_id: 0,
                acc: Accumulated::default(),
            }),
            peaks: Mutex::new([0; COUNTERS]),
        }
    }

    /// Sets the largest single registration in registration mode (rounded up to whole
    /// pages). No effect in driver-allocation mode.
    pub fn with_register_chunk(mut self, bytes: usize) -> HostAllocator {
        if let Mode::Register { chunk, .. } = &mut self.pinner.mode {
            *chunk = bytes.max(1);
        }
        self
    }

    /// Whether pinned memory is obtained by registering ordinary pages.
    pub fn uses_host_register(&self) -> bool {
        matches!(self.pinner.mode, Mode::Register { .. })
    }

    /// The driver this allocator pins through.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.pinner.driver
    }

    fn home_shard(&self) -> usize {
        shard::home_slot() & self.shard_mask
    }

    /// A snapshot of the statistics. Locks each shard briefly, one at a time.
    pub fn stats(&self) -> HostStats {
        let peaks = self.peaks.lock();
        let mut sums = [0i64; COUNTERS];
        let mut cached = 0u64;
        for s in self.shards.iter() {
            let g = s.inner.lock();
            for (sum, count) in sums.iter_mut().zip(g.counts) {
                *sum += count;
            }
            cached += g.free_blocks() as u64;
        }
        let stat = |c: usize| Stat {
            current: sums[c].max(0) as u64,
            peak: peaks[c].max(sums[c]).max(0) as u64,
        };
        let g = self.global.lock();
        let acc = &g.acc;
        HostStats {
            allocations: stat(shard::ALLOCATIONS),
            active_blocks: stat(shard::ACTIVE_BLOCKS),
            allocated_bytes: stat(shard::ALLOCATED_BYTES),
            reserved_bytes: Stat {
                current: acc.reserved_bytes,
                peak: acc.reserved_peak,
            },
            cached_blocks: cached,
            driver_allocations: acc.driver_allocations,
            driver_frees: acc.driver_frees,
            pin_time_total: acc.pin_total,
            pin_time_max: acc.pin_max,
            unpin_time_total: acc.unpin_total,
            unpin_time_max: acc.unpin_max,
        }
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut peaks = self.peaks.lock();
        let mut guards: Vec<_> = self.shards.iter().map(|s| s.inner.lock()).collect();
        for (c, peak) in peaks.iter_mut().enumerate() {
            *peak = guards.iter().map(|g| g.counts[c]).sum();
            for g in guards.iter_mut() {
                g.limits[c] = g.counts[c];
            }
        }
        drop(guards);
        let mut g = self.global.lock();
        g.acc.reserved_peak = g.acc.reserved_bytes;
    }

    /// Sets the accumulated counters (driver allocations and frees, pinning times) to zero.
    pub fn reset_accumulated_stats(&self) {
        self.global.lock().acc.reset_accumulated();
    }

    /// Adds `delta` to the counters of shard `home`, moving limits first if a counter would
    /// pass its limit (that is when a new peak may be reached).
    fn account(&self, home: usize, delta: &Counts) {
        loop {
            {
                let mut g = self.shards[home].inner.lock();
                if g.fits(delta) {
                    g.apply(delta);
                    return;
                }
            }
            self.rebalance(home, delta);
        }
    }

    /// Locks every shard and gives `home` the headroom it lacks to apply `delta`: first the
    /// unused headroom of other shards, then, if that is not enough, a raised peak. Raising
    /// happens only when every other shard is at its limit, so the new peak is the exact sum.
    /// Afterwards the limits again add up to the peaks. Taking only what is missing leaves
    /// the other shards' headroom alone, so threads that each hold steady stop rebalancing.
    fn rebalance(&self, home: usize, delta: &Counts) {
        let mut peaks = self.peaks.lock();
        let mut guards: Vec<_> = self.shards.iter().map(|s| s.inner.lock()).collect();
        for (c, peak) in peaks.iter_mut().enumerate() {
            let deficit = guards[home].counts[c] + delta[c].max(0) - guards[home].limits[c];
            if deficit <= 0 {
                continue;
            }
            let mut missing = deficit;
            for (j, g) in guards.iter_mut().enumerate() {
                if missing == 0 {
                    break;
                }
                let spare = g.limits[c] - g.counts[c];
                if j != home && spare > 0 {
                    let take = spare.min(missing);
                    g.limits[c] -= take;
                    missing -= take;
                }
            }
            guards[home].limits[c] += deficit;
            *peak += missing;
        }
    }
}

impl Drop for HostAllocator {
    fn drop(&mut self) {
        // Cached blocks go back to the driver; blocks still handed out stay with their
        // owners, and pending ones stay pinned because a stream may still use them.
        let _ = self.empty_cache();
        self.events.destroy_all(&*self.pinner.driver);
        self.pool.destroy_all(&*self.pinner.driver);
    }
}

impl std::fmt::Debug for HostAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAllocator")
            .field("driver", &self.pinner.driver.name())
            .field("mode", &self.pinner.mode)
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

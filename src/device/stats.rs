//! Statistics of the caching device allocator, PyTorch's `DeviceStats` field for field.
//!
//! Each stream shard keeps its own counters (written under the shard's lock, read lock-free
//! by anyone), so allocation on one stream never writes a cache line that another stream's
//! allocation writes. Device-wide values are sums over shards.
//!
//! Device-wide peaks are kept exact without a shared counter on the hot path: each shard
//! also keeps its own peak, and the device keeps the sum of those shard peaks. When a shard's
//! counter rises, the device total can only be a new peak if this shard's current value plus
//! the other shards' peaks exceeds the device peak; only then are all shards' current values
//! summed. In a warm loop the bound holds and the check reads two rarely written words.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use super::size::PoolKind;

/// Counted quantities that PyTorch tracks per pool (aggregate, small, large).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatKind {
    /// Allocations requested by clients.
    Allocation = 0,
    /// Segments obtained from the driver.
    Segment,
    /// Active blocks (allocated, or freed but still in use by a stream).
    Active,
    /// Free blocks that are part of a split segment (cannot be returned to the driver).
    InactiveSplit,
    /// Bytes allocated to clients (rounded sizes).
    AllocatedBytes,
    /// Bytes reserved from the driver.
    ReservedBytes,
    /// Bytes in active blocks.
    ActiveBytes,
    /// Bytes in inactive split blocks.
    InactiveSplitBytes,
    /// Bytes clients asked for (unrounded).
    RequestedBytes,
}

/// Number of [`StatKind`]s.
pub(crate) const KINDS: usize = 9;
/// Index of the oversize-allocation counter among tracked statistics.
pub(crate) const OVERSIZE_ALLOCATIONS: usize = KINDS * 3;
/// Index of the oversize-segment counter among tracked statistics.
pub(crate) const OVERSIZE_SEGMENTS: usize = KINDS * 3 + 1;
/// Number of tracked statistics (each with current, peak, allocated, freed).
pub(crate) const TRACKED: usize = KINDS * 3 + 2;

/// Index of a statistic: the aggregate column of a kind.
pub fn aggregate(kind: StatKind) -> usize {
    kind as usize * 3
}

/// Index of a statistic: a pool's column of a kind.
pub fn of_pool(kind: StatKind, pool: PoolKind) -> usize {
    kind as usize * 3
        + match pool {
            PoolKind::Small => 1,
            PoolKind::Large => 2,
        }
}

/// One statistic as reported: current value, peak since the last peak reset, and totals
/// added and removed since the last reset of accumulated statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

/// A statistic for all pools, the small pool and the large pool.
pub type StatArray = [Stat; 3];

/// A device's statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    /// Driver allocations that failed and were retried after freeing the cache.
    pub num_alloc_retries: i64,
    /// Requests that failed even after freeing the cache.
    pub num_ooms: i64,
    /// Allocations of blocks at least `max_split_size` large.
    pub oversize_allocations: Stat,
    /// Segments at least `max_split_size` large.
    pub oversize_segments: Stat,
    /// Times the allocator waited for all outstanding stream events before freeing segments.
    pub num_sync_all_streams: i64,
    /// Segments obtained from the driver.
    pub num_device_alloc: i64,
    /// Segments returned to the driver.
    pub num_device_free: i64,
    /// Blocks at least this large are not split; -1 when unlimited.
    pub max_split_size: i64,
    /// Frees of pointers that were not allocated (or already freed).
    pub num_invalid_frees: i64,
}

impl DeviceStats {
    pub(crate) fn set(&mut self, index: usize, stat: Stat) {
        let array = match index {
            OVERSIZE_ALLOCATIONS => return self.oversize_allocations = stat,
            OVERSIZE_SEGMENTS => return self.oversize_segments = stat,
            i if i < 3 => &mut self.allocation,
            i if i < 6 => &mut self.segment,
            i if i < 9 => &mut self.active,
            i if i < 12 => &mut self.inactive_split,
            i if i < 15 => &mut self.allocated_bytes,
            i if i < 18 => &mut self.reserved_bytes,
            i if i < 21 => &mut self.active_bytes,
            i if i < 24 => &mut self.inactive_split_bytes,
            _ => &mut self.requested_bytes,
        };
        array[index % 3] = stat;
    }
}

/// One statistic of one shard. Written only under the shard's lock.
///
/// `freed` is not stored: it is `allocated - current + freed_base`, where `freed_base` is the
/// current value when accumulated statistics were last reset, so a decrease writes one word.
#[derive(Default)]
pub(crate) struct Cell {
    pub current: AtomicI64,
    pub local_peak: AtomicI64,
    pub allocated: AtomicI64,
    pub freed_base: AtomicI64,
}

impl Cell {
    pub fn freed(&self) -> i64 {
        self.allocated.load(Relaxed) - self.current.load(Relaxed) + self.freed_base.load(Relaxed)
    }

    /// Starts the accumulated totals from zero.
    pub fn reset_accumulated(&self) {
        self.allocated.store(0, Relaxed);
        self.freed_base.store(self.current.load(Relaxed), Relaxed);
    }
}

/// The statistics of one stream shard.
pub(crate) struct ShardStats {
    pub cells: [Cell; TRACKED],
}

impl Default for ShardStats {
    fn default() -> Self {
        ShardStats {
            cells: std::array::from_fn(|_| Cell::default()),
        }
    }
}

/// Device-wide statistics state: peaks and the counters of rare events.
pub(crate) struct DeviceCounters {
    pub peak: [AtomicI64; TRACKED],
    /// Sum over shards of each shard's own peak (an upper bound on any device total).
    pub sum_local_peaks: [AtomicI64; TRACKED],
    pub num_alloc_retries: AtomicI64,
    pub num_ooms: AtomicI64,
    pub num_sync_all_streams: AtomicI64,
    pub num_device_alloc: AtomicI64,
    pub num_device_free: AtomicI64,
    pub num_invalid_frees: AtomicI64,
}

impl Default for DeviceCounters {
    fn default() -> Self {
        DeviceCounters {
            peak: std::array::from_fn(|_| AtomicI64::new(0)),
            sum_local_peaks: std::array::from_fn(|_| AtomicI64::new(0)),
            num_alloc_retries: AtomicI64::new(0),
            num_ooms: AtomicI64::new(0),
            num_sync_all_streams: AtomicI64::new(0),
            num_device_alloc: AtomicI64::new(0),
            num_device_free: AtomicI64::new(0),
            num_invalid_frees: AtomicI64::new(0),
        }
    }
}

impl DeviceCounters {
    /// Adds `delta` to statistic `index` of `shard`. The caller holds the shard's lock;
    /// `total` sums the current value of `index` over all shards (called only when the device
    /// peak may have been passed).
    #[inline(always)]
    pub fn change(
        &self,
        shard: &ShardStats,
        index: usize,
        delta: i64,
        total: impl Fn(usize) -> i64,
    ) {
        let cell = &shard.cells[index];
        let current = cell.current.load(Relaxed) + delta;
        cell.current.store(current, Relaxed);
        if delta > 0 {
            cell.allocated
                .store(cell.allocated.load(Relaxed) + delta, Relaxed);
            self.track_peak(cell, index, current, total);
        }
    }

    #[inline(always)]
    fn track_peak(&self, cell: &Cell, index: usize, current: i64, total: impl Fn(usize) -> i64) {
        let mut local_peak = cell.local_peak.load(Relaxed);
        if current > local_peak {
            self.sum_local_peaks[index].fetch_add(current - local_peak, Relaxed);
            cell.local_peak.store(current, Relaxed);
            local_peak = current;
        }
        let others_bound = self.sum_local_peaks[index].load(Relaxed) - local_peak;
        if current + others_bound > self.peak[index].load(Relaxed) {
            self.raise_peak(index, total);
        }
    }

    #[cold]
    #[inline(never)]
    fn raise_peak(&self, index: usize, total: impl Fn(usize) -> i64) {
        self.peak[index].fetch_max(total(index), Relaxed);
    }

    pub fn bump(counter: &AtomicI64) {
        counter.fetch_add(1, Relaxed);
    }
}

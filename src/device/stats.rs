//! Statistics of the caching device allocator, PyTorch's `DeviceStats` field for field.
//!
//! Each stream shard keeps its own counters (written under the shard's lock, read lock-free
//! by anyone), so allocation on one stream never writes a cache line that another stream's
//! allocation writes. Device-wide values are sums over shards.
//!
//! Device-wide peaks stay exact with reservations: every shard has a limit per statistic,
//! the limits add up to the device peak, and a shard's counter may rise up to its limit
//! without looking anywhere else (the sum then cannot pass the peak). Only a counter that
//! would pass its limit is settled (once per block operation, after its changes), under the
//! device's settle lock, in one of two ways:
//!
//! - [`ShardStats::take_spare`]: the shard takes unused headroom from other shards, one donor
//!   at a time under that donor's lock (tried, never waited for). Peaks do not change. The
//!   shard takes up to the most it needed at any earlier settle ([`ShardStats`]' `top`), so
//!   streams that take turns holding memory (a producer and a consumer stream on one thread)
//!   settle once per turn rather than once per allocation, and all of a donor's headroom of a
//!   statistic it holds none of (an idle stream), so a growing stream does not settle at
//!   every new high while idle streams hold headroom.
//! - [`settle`], when donors cannot cover it (or another shard's overdraft is waiting): under
//!   every shard's lock the shard takes only what is missing from the others' headroom, and
//!   the peak rises by what is still missing. The peak rises only when every other shard is
//!   at its limit, so it is the exact total.
//!
//! A shard's limit never passes what it needed at some settle, so streams that each hold
//! steady stop settling after their first rounds.
//!
//! Lock order: the settle lock, then shard locks. A thread that holds a shard lock only
//! *tries* the settle lock; when another thread holds it, the overdraft is left marked on the
//! shard, and the holder looks for marked overdrafts once more after releasing the settle
//! lock (a sequentially consistent fence on both sides makes sure one of the two sees the
//! other) and settles them.

use std::sync::atomic::{fence, AtomicI64, AtomicU32, Ordering::Relaxed, Ordering::SeqCst};

use parking_lot::Mutex;

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

/// One statistic of one shard. Written only under the shard's lock (a settle holds them all).
///
/// `freed` is not stored: it is `allocated - current + freed_base`, where `freed_base` is the
/// current value when accumulated statistics were last reset, so a decrease writes one word.
#[derive(Default)]
pub(crate) struct Cell {
    pub current: AtomicI64,
    /// How far `current` may rise before the device peak must be settled.
    pub limit: AtomicI64,
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
    /// Bit `i`: statistic `i` passed its limit and is not settled yet.
    over: AtomicU32,
    /// Highest value of each unsettled statistic since it passed its limit.
    high: [AtomicI64; TRACKED],
    /// Highest need of each statistic at a settle of this shard since peaks were reset: the
    /// headroom it takes from donors when it settles.
    top: [AtomicI64; TRACKED],
}

impl Default for ShardStats {
    fn default() -> Self {
        ShardStats {
            cells: std::array::from_fn(|_| Cell::default()),
            over: AtomicU32::new(0),
            high: std::array::from_fn(|_| AtomicI64::new(0)),
            top: std::array::from_fn(|_| AtomicI64::new(0)),
        }
    }
}

impl ShardStats {
    /// Adds `delta` to statistic `index`. The caller holds the shard's lock. Returns true when
    /// the statistic passed its limit, so that the device peak must be settled.
    #[inline(always)]
    pub fn change(&self, index: usize, delta: i64) -> bool {
        let cell = &self.cells[index];
        let current = cell.current.load(Relaxed) + delta;
        cell.current.store(current, Relaxed);
        if delta > 0 {
            cell.allocated
                .store(cell.allocated.load(Relaxed) + delta, Relaxed);
            if current > cell.limit.load(Relaxed) {
                self.mark_over(index, current);
                return true;
            }
        }
        false
    }

    #[cold]
    #[inline(never)]
    fn mark_over(&self, index: usize, current: i64) {
        let bit = 1u32 << index;
        let high = &self.high[index];
        if self.over.load(Relaxed) & bit == 0 || high.load(Relaxed) < current {
            high.store(current, Relaxed);
        }
        self.over.store(self.over.load(Relaxed) | bit, Relaxed);
        // Pairs with the fence after the settle lock is released (module documentation).
        fence(SeqCst);
    }

    /// Whether some statistic passed its limit and is not settled yet.
    pub fn is_over(&self) -> bool {
        self.over.load(Relaxed) != 0
    }

    /// Records the current needs in `top`, before this shard settles. The caller holds the
    /// settle lock and the shard's lock.
    pub fn raise_top(&self) {
        for i in 0..TRACKED {
            let need = self.need(i);
            if need > self.top[i].load(Relaxed) {
                self.top[i].store(need, Relaxed);
            }
        }
    }

    /// [`ShardStats::raise_top`], then the statistics whose limit is below what this shard
    /// wants: its `top` (a bit per statistic, for [`ShardStats::take_spare`]), in one pass.
    /// The caller holds the settle lock and the shard's lock.
    pub fn raise_top_wanted(&self) -> u32 {
        let mut wanted = 0;
        for i in 0..TRACKED {
            let need = self.need(i);
            let top = &self.top[i];
            let mut t = top.load(Relaxed);
            if need > t {
                top.store(need, Relaxed);
                t = need;
            }
            if t > self.cells[i].limit.load(Relaxed) {
                wanted |= 1 << i;
            }
        }
        wanted
    }

    /// Whether this shard has unused headroom (limit above current) of a statistic of
    /// `wanted`: what [`ShardStats::take_spare`] could take from it as a donor.
    pub fn may_spare(&self, wanted: u32) -> bool {
        let mut left = wanted;
        while left != 0 {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            let cell = &self.cells[i];
            if cell.limit.load(Relaxed) > cell.current.load(Relaxed) {
                return true;
            }
        }
        false
    }

    /// Moves unused headroom of `donor` to this shard, for the statistics of `wanted` (from
    /// [`ShardStats::raise_top_wanted`]): up to their `top` (or their need), or all of it where the
    /// donor holds none of that statistic (an idle stream's headroom serves the busy one until
    /// it is busy again; it takes it back then). Peaks do not change. The caller holds the
    /// settle lock and both shards' locks, and `donor` has no overdraft. Returns the
    /// statistics still wanting headroom; [`ShardStats::clear_covered`] then clears the
    /// overdrafts that are covered.
    pub fn take_spare(&self, donor: &ShardStats, wanted: u32) -> u32 {
        debug_assert!(!donor.is_over());
        let mut still = 0;
        let mut left = wanted;
        while left != 0 {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            let limit = &self.cells[i].limit;
            let short = self.top[i].load(Relaxed).max(self.need(i)) - limit.load(Relaxed);
            if short <= 0 {
                continue;
            }
            let theirs = &donor.cells[i].limit;
            let held = donor.cells[i].current.load(Relaxed);
            let spare = theirs.load(Relaxed) - held;
            let take = if held == 0 { spare } else { spare.min(short) };
            if take > 0 {
                theirs.store(theirs.load(Relaxed) - take, Relaxed);
                limit.store(limit.load(Relaxed) + take, Relaxed);
            }
            if take < short {
                still |= 1 << i;
            }
        }
        still
    }

    /// Clears the overdrafts that this shard's limits now cover. The caller holds the settle
    /// lock and the shard's lock.
    pub fn clear_covered(&self) {
        let mut over = self.over.load(Relaxed);
        let mut left = over;
        while left != 0 {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            if self.need(i) <= self.cells[i].limit.load(Relaxed) {
                over &= !(1 << i);
            }
        }
        self.over.store(over, Relaxed);
    }

    /// What statistic `index` needs as its limit: its current value, or its highest value
    /// while unsettled.
    fn need(&self, index: usize) -> i64 {
        let current = self.cells[index].current.load(Relaxed);
        if self.over.load(Relaxed) & (1 << index) != 0 {
            current.max(self.high[index].load(Relaxed))
        } else {
            current
        }
    }
}

/// Settles every shard's overdrafts. The caller holds the settle lock and every shard's lock;
/// `shards()` yields every shard.
pub(crate) fn settle<'a, I>(counters: &DeviceCounters, shards: impl Fn() -> I)
where
    I: Iterator<Item = &'a ShardStats>,
{
    for shard in shards() {
        let mut over = shard.over.load(Relaxed);
        if over == 0 {
            continue;
        }
        shard.raise_top();
        while over != 0 {
            let i = over.trailing_zeros() as usize;
            over &= over - 1;
            let deficit = shard.need(i) - shard.cells[i].limit.load(Relaxed);
            if deficit <= 0 {
                continue;
            }
            let mut missing = deficit;
            for other in shards() {
                if missing == 0 {
                    break;
                }
                let limit = &other.cells[i].limit;
                let spare = limit.load(Relaxed) - other.need(i);
                if !std::ptr::eq(other, shard) && spare > 0 {
                    let take = spare.min(missing);
                    limit.store(limit.load(Relaxed) - take, Relaxed);
                    missing -= take;
                }
            }
            let limit = &shard.cells[i].limit;
            limit.store(limit.load(Relaxed) + deficit, Relaxed);
            counters.peak[i].fetch_add(missing, Relaxed);
        }
        shard.over.store(0, Relaxed);
    }
}

/// Called after the settle lock is released: pairs with the fence of a thread that marked
/// an overdraft and then failed to take the settle lock (module documentation).
pub(crate) fn after_settle_unlock() {
    fence(SeqCst);
}

/// Sets every limit to its statistic's current value and each peak to the current total.
/// The caller holds the settle lock and every shard's lock.
pub(crate) fn reset_peaks(counters: &DeviceCounters, shards: &[&ShardStats]) {
    for i in 0..TRACKED {
        let mut total = 0;
        for s in shards {
            let cur = s.cells[i].current.load(Relaxed);
            s.cells[i].limit.store(cur, Relaxed);
            s.top[i].store(cur, Relaxed);
            total += cur;
        }
        counters.peak[i].store(total, Relaxed);
    }
    for s in shards {
        s.over.store(0, Relaxed);
    }
}

/// Device-wide statistics state: peaks and the counters of rare events.
pub(crate) struct DeviceCounters {
    /// Each peak equals the sum of the shards' limits of its statistic.
    pub peak: [AtomicI64; TRACKED],
    /// Taken before shard locks to settle or reset peaks (see the module documentation).
    pub settle: Mutex<()>,
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
            settle: Mutex::new(()),
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
    pub fn bump(counter: &AtomicI64) {
        counter.fetch_add(1, Relaxed);
    }
}

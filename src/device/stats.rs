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
//! Headroom of shards that hold nothing goes to the device's unowned headroom ([`Unowned`],
//! guarded by the settle lock) when the cache is emptied, so a later settle takes it without
//! locking anyone, and such shards are no longer *engaged*: a settle neither locks nor reads
//! them. Every peak is the sum of its statistic's limits and its unowned headroom.
//!
//! Lock order: the settle lock, then shard locks. A thread that holds a shard lock and finds
//! the settle lock taken waits for it *holding its shard lock*, so that its overdraft is
//! settled against the other shards as they are while its own statistics stay at their
//! highest (settling it later, after the other shards changed, could raise a peak past any
//! total the device reached). It first marks the shard *waiting*; the holder of the settle
//! lock, which never waits for a waiting shard's lock, settles such a shard in its place, as
//! if it held its lock (*proxied*), since the waiting thread changes nothing meanwhile. An
//! overdraft left marked by an operation that could not settle (one that marks only, under
//! two shard locks) is looked for again by every holder after it releases the settle lock (a
//! sequentially consistent fence on both sides, on the marking side one per operation rather
//! than per mark, makes sure one of the two sees the other).

use std::sync::atomic::{
    fence, AtomicBool, AtomicI64, AtomicU32, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst,
};
use std::sync::Arc;

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
    /// Whether some limit may be above zero or some statistic is over its limit. When false,
    /// every limit is zero and the shard counts as holding nothing: an operation in progress
    /// on it takes effect for settles when it marks its first overdraft (which sets this), and
    /// that overdraft is settled after any settle that left the shard out. Set by
    /// [`ShardStats::change`] when a statistic passes its limit (limits rise only for shards
    /// that are over), cleared under the settle lock and the shard's lock.
    engaged: AtomicBool,
    /// Whether the settle in progress holds this shard's lock (read and written only by the
    /// holder of the settle lock).
    pub held: AtomicBool,
    /// Whether the settle in progress reads and changes this shard on behalf of its thread,
    /// which holds the shard's lock and waits for the settle lock ([`ShardStats::waiting`]).
    /// Read and written only by the holder of the settle lock.
    pub proxied: AtomicBool,
    /// Whether this shard's thread holds the shard's lock and waits for the settle lock to
    /// settle an overdraft: the shard changes nothing until then, so the holder of the settle
    /// lock may settle it without its lock.
    pub waiting: AtomicBool,
    /// The device's count of engaged shards ([`DeviceCounters`]' `engaged_shards`).
    engaged_shards: Arc<AtomicUsize>,
}

impl ShardStats {
    /// Statistics of a new shard of the device whose counters are `counters`.
    pub fn new(counters: &DeviceCounters) -> Self {
        ShardStats {
            engaged_shards: Arc::clone(&counters.engaged_shards),
            cells: std::array::from_fn(|_| Cell::default()),
            over: AtomicU32::new(0),
            high: std::array::from_fn(|_| AtomicI64::new(0)),
            top: std::array::from_fn(|_| AtomicI64::new(0)),
            engaged: AtomicBool::new(false),
            held: AtomicBool::new(false),
            proxied: AtomicBool::new(false),
            waiting: AtomicBool::new(false),
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
        self.set_engaged(true);
        // Published to the settle lock's holder by the fence of `before_settle_try`.
        self.over.store(self.over.load(Relaxed) | bit, Relaxed);
    }

    /// Whether every statistic's current value is zero and none is over its limit.
    pub fn holds_nothing(&self) -> bool {
        !self.is_over() && self.cells.iter().all(|c| c.current.load(Relaxed) == 0)
    }

    /// Whether some statistic passed its limit and is not settled yet.
    pub fn is_over(&self) -> bool {
        self.over.load(Relaxed) != 0
    }

    /// Whether a settle must lock and read this shard: it may hold headroom or be over.
    pub fn is_engaged(&self) -> bool {
        self.engaged.load(Relaxed) || self.is_over()
    }

    /// Whether this shard is the device's only engaged one: then a settle of it needs no
    /// other shard. The caller holds the shard's lock (so it cannot become engaged or stop
    /// being so meanwhile).
    pub fn engaged_alone(&self) -> bool {
        self.engaged.load(Relaxed) && self.engaged_shards.load(Relaxed) == 1
    }

    fn set_engaged(&self, on: bool) {
        if self.engaged.swap(on, Relaxed) != on {
            if on {
                self.engaged_shards.fetch_add(1, Relaxed);
            } else {
                self.engaged_shards.fetch_sub(1, Relaxed);
            }
        }
    }

    /// Records the current needs in `top` ([`ShardStats::raise_top_wanted`]), then moves
    /// unowned headroom to this shard for the statistics that want it: whole parcels (what
    /// one emptied shard gave up), as from a donor that holds none of a statistic, so that
    /// streams that come back take about what they held before. Returns the statistics still
    /// wanting headroom. The caller holds the settle lock and the shard's lock.
    pub fn take_unowned(&self, unowned: &mut Unowned) -> u32 {
        let wanted = self.raise_top_wanted();
        if wanted == 0 || unowned.parcels.is_empty() {
            return wanted;
        }
        self.take_headroom(wanted, |i, short| unowned.take(i, short, true))
    }

    /// When this shard holds nothing, gives all its headroom to the device's unowned
    /// headroom as one parcel and stops being engaged; returns whether it did. The caller
    /// holds the settle lock and the shard's lock.
    pub fn retire(&self, unowned: &mut Unowned) -> bool {
        if !self.engaged.load(Relaxed)
            || self.is_over()
            || self.cells.iter().any(|c| c.current.load(Relaxed) != 0)
        {
            return false;
        }
        let parcel = std::array::from_fn(|i| {
            self.top[i].store(0, Relaxed);
            self.cells[i].limit.swap(0, Relaxed)
        });
        unowned.give(parcel);
        self.set_engaged(false);
        true
    }

    /// Settles this shard's overdrafts when it is the device's only engaged shard
    /// ([`ShardStats::engaged_alone`]): [`settle`] of this shard alone, with the unowned
    /// headroom taken first as [`ShardStats::take_unowned`] takes it. The caller holds the
    /// settle lock and the shard's lock.
    pub fn settle_alone(&self, counters: &DeviceCounters, unowned: &mut Unowned) {
        self.take_unowned(unowned);
        settle(counters, unowned, self, || std::iter::once(self));
    }

    /// Records the current needs in `top`, before this shard settles, and returns the
    /// statistics whose limit is below their `top` (a bit per statistic, for
    /// [`ShardStats::take_spare`]). The caller holds the settle lock and the shard's lock.
    pub fn raise_top_wanted(&self) -> u32 {
        // The overdraft mask read once for every statistic.
        let over = self.over.load(Relaxed);
        let mut wanted = 0;
        for (i, cell) in self.cells.iter().enumerate() {
            let need = self.need_in(over, i);
            let top = &self.top[i];
            let mut t = top.load(Relaxed);
            if need > t {
                top.store(need, Relaxed);
                t = need;
            }
            if t > cell.limit.load(Relaxed) {
                wanted |= 1 << i;
            }
        }
        wanted
    }

    /// The statistics of `wanted` of which this shard has unused headroom (limit above
    /// current): what [`ShardStats::take_spare`] could take from it as a donor.
    pub fn spare_of(&self, wanted: u32) -> u32 {
        let mut offer = 0;
        let mut left = wanted;
        while left != 0 {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            let cell = &self.cells[i];
            if cell.limit.load(Relaxed) > cell.current.load(Relaxed) {
                offer |= 1 << i;
            }
        }
        offer
    }

    /// Moves unused headroom of `donor` to this shard, for the statistics of `wanted` (from
    /// [`ShardStats::raise_top_wanted`]): up to their `top` (or their need), or all of it where the
    /// donor holds none of that statistic (an idle stream's headroom serves the busy one until
    /// it is busy again; it takes it back then). Peaks do not change. The caller holds the
    /// settle lock and both shards' locks, and `donor` has no overdraft. Returns the
    /// statistics still wanting headroom; [`ShardStats::clear_covered`] then clears the
    /// overdrafts that are covered.
    #[inline(always)]
    pub fn take_spare(&self, donor: &ShardStats, wanted: u32) -> u32 {
        debug_assert!(!donor.is_over());
        self.take_headroom(wanted, |i, short| {
            let theirs = &donor.cells[i].limit;
            let held = donor.cells[i].current.load(Relaxed);
            let spare = theirs.load(Relaxed) - held;
            let take = if held == 0 { spare } else { spare.min(short) };
            if take > 0 {
                theirs.store(theirs.load(Relaxed) - take, Relaxed);
            }
            take
        })
    }

    /// For each statistic of `wanted` short of what this shard wants (its `top` or its
    /// need), adds to its limit what `give(statistic, shortfall)` hands over (taken from
    /// elsewhere). Returns the statistics still short.
    #[inline(always)]
    fn take_headroom(&self, wanted: u32, mut give: impl FnMut(usize, i64) -> i64) -> u32 {
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
            let take = give(i, short);
            if take > 0 {
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
        self.need_in(self.over.load(Relaxed), index)
    }

    /// [`ShardStats::need`] with the overdraft mask `over` already read.
    #[inline(always)]
    fn need_in(&self, over: u32, index: usize) -> i64 {
        let current = self.cells[index].current.load(Relaxed);
        if over & (1 << index) != 0 {
            current.max(self.high[index].load(Relaxed))
        } else {
            current
        }
    }
}

/// Settles every shard's overdrafts. The caller holds the settle lock and the lock of every
/// engaged shard; `shards()` yields those shards (the others hold no headroom and are at
/// zero). `raised` already recorded its needs in its tops in this settle.
pub(crate) fn settle<'a, I>(
    counters: &DeviceCounters,
    unowned: &mut Unowned,
    raised: &ShardStats,
    shards: impl Fn() -> I,
) where
    I: Iterator<Item = &'a ShardStats>,
{
    for shard in shards() {
        let mut over = shard.over.load(Relaxed);
        if over == 0 {
            continue;
        }
        if !std::ptr::eq(shard, raised) {
            shard.raise_top_wanted();
        }
        while over != 0 {
            let i = over.trailing_zeros() as usize;
            over &= over - 1;
            let deficit = shard.need(i) - shard.cells[i].limit.load(Relaxed);
            if deficit <= 0 {
                continue;
            }
            let mut missing = deficit - unowned.take(i, deficit, false);
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
            counters.raise_peak(i, missing);
        }
        shard.over.store(0, Relaxed);
    }
}

/// Called by a thread that marked overdrafts before it tries the settle lock, once for all
/// of an operation's marks: pairs with the fence after the lock's holder releases it
/// (module documentation).
#[inline]
pub(crate) fn before_settle_try() {
    fence(SeqCst);
}

/// Called after the settle lock is released: pairs with the fence of a thread that marked
/// an overdraft and then failed to take the settle lock (module documentation).
pub(crate) fn after_settle_unlock() {
    fence(SeqCst);
}

/// Sets every limit to its statistic's current value and each peak to the current total.
/// The caller holds the settle lock and every shard's lock.
pub(crate) fn reset_peaks(
    counters: &DeviceCounters,
    unowned: &mut Unowned,
    shards: &[&ShardStats],
) {
    unowned.parcels.clear();
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
        let holds = s.cells.iter().any(|c| c.current.load(Relaxed) != 0);
        s.set_engaged(holds);
    }
}

/// Device-wide statistics state: peaks and the counters of rare events.
pub(crate) struct DeviceCounters {
    /// Each peak equals the sum of the shards' limits of its statistic and its unowned
    /// headroom.
    pub peak: [AtomicI64; TRACKED],
    /// How many shards are engaged ([`ShardStats::is_engaged`]); shared with every shard,
    /// which counts itself in when it first passes a limit.
    pub engaged_shards: Arc<AtomicUsize>,
    /// Taken before shard locks to settle or reset peaks (see the module documentation).
    pub settle: Mutex<SettleState>,
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
            engaged_shards: Arc::new(AtomicUsize::new(0)),
            settle: Mutex::new(SettleState::default()),
            num_alloc_retries: AtomicI64::new(0),
            num_ooms: AtomicI64::new(0),
            num_sync_all_streams: AtomicI64::new(0),
            num_device_alloc: AtomicI64::new(0),
            num_device_free: AtomicI64::new(0),
            num_invalid_frees: AtomicI64::new(0),
        }
    }
}

/// What the settle lock guards.
#[derive(Default)]
pub(crate) struct SettleState {
    /// Indices of the shards a settle holds locked (kept to be reused).
    pub held: Vec<u32>,
    pub unowned: Unowned,
}

/// Headroom no shard holds: what emptied shards gave up, one parcel (a value per statistic)
/// per shard.
#[derive(Default)]
pub(crate) struct Unowned {
    parcels: Vec<[i64; TRACKED]>,
}

impl Unowned {
    /// Takes up to `short` of statistic `i`, in the order the parcels were given up (shard
    /// creation order, so streams created in the same order as before take back what their
    /// predecessors held); with `whole`, a parcel's whole value of `i` at a time (so possibly
    /// more). Returns what it took.
    fn take(&mut self, i: usize, short: i64, whole: bool) -> i64 {
        let mut taken = 0;
        for parcel in self.parcels.iter_mut() {
            if taken >= short {
                break;
            }
            let take = if whole {
                parcel[i]
            } else {
                parcel[i].min(short - taken)
            };
            parcel[i] -= take;
            taken += take;
        }
        taken
    }

    /// Adds a parcel, dropping those that are used up.
    fn give(&mut self, parcel: [i64; TRACKED]) {
        self.parcels.retain(|p| p.iter().any(|&v| v != 0));
        if parcel.iter().any(|&v| v != 0) {
            self.parcels.push(parcel);
        }
    }
}

impl DeviceCounters {
    pub fn bump(counter: &AtomicI64) {
        counter.fetch_add(1, Relaxed);
    }

    /// Raises peak `i` by `by`. Peaks are written only under the settle lock, which the
    /// caller holds, so a load and a store do (readers see one value or the other).
    fn raise_peak(&self, i: usize, by: i64) {
        if by != 0 {
            let peak = &self.peak[i];
            peak.store(peak.load(Relaxed) + by, Relaxed);
        }
    }
}

//! The caching device allocator: PyTorch's CUDACachingAllocator semantics over any [`Driver`].
//!
//! - Requests are rounded to 512 bytes; up to 1 MiB they come from the small pool (2 MiB
//!   segments), above from the large pool (20 MiB segments under 10 MiB, else the request
//!   rounded to 2 MiB). Free blocks are found best fit by size, then address; a block is split
//!   when the rest is worth keeping; freed blocks merge with free neighbours.
//! - A block belongs to the stream it was allocated on. After `record_stream` on other
//!   streams, freeing it records an event on each, and it returns to its pool once they have
//!   all completed (polled on later calls; the caller is never blocked).
//! - When the driver is out of memory, every unused cached segment of the device is returned
//!   (after waiting for outstanding events) and the request is retried once.
//!
//! The device is sharded by stream ([`shard`]): each stream has its own lock ([`crate::lock`]:
//! one atomic operation per uncontended lock and unlock), pools and statistics, so threads
//! working on different streams do not contend.
//!
//! PyTorch's other allocator hooks live beside: graph private pools and capture awareness
//! ([`graph`]), the memory fraction ([`limit`]), base allocations ([`DeviceAllocator::base_allocation`]).

mod events;
mod expandable;
mod free_index;
mod gc;
pub mod graph;
pub mod history;
mod limit;
mod live;
mod policy;
pub mod shard;
pub mod size;
pub mod stats;
mod table;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::config::{roundup_interval, Config, Policy, ROUNDUP_INTERVALS};
use crate::driver::{Driver, Event, Stream};
use crate::error::{Error, Result};
use crate::lock::ShardGuard;
use events::EventPool;
use graph::GraphPools;
use history::Action;
use limit::MemoryLimit;
use shard::{ShardInner, ShardLock, StatSink, State};
use size::{format_bytes, round_size_with, segment_size, PoolKind, MAX_REQUEST};
use stats::{
    DeviceCounters, DeviceStats, SettleState, ShardStats, Stat, StatKind, Unowned, TRACKED,
};
use table::ShardTable;

pub use graph::{PoolId, StreamFilter};
pub use stats::Stat as DeviceStat;

/// The most streams a device serves at once. A new stream beyond them takes over the share of
/// a stream that holds no memory in use (its cached segments go back to the driver); when
/// every stream holds some, allocating on a new one fails.
pub const MAX_STREAMS: usize = table::MAX_SHARDS;

/// Whether `stream` may name a stream: its top bit is clear. Stream handles are user-space
/// addresses or small integers; the shard table keeps the values with the top bit set for
/// itself (moved shards, and graph pools' private shards, whose keys count down from the top).
fn names_a_stream(stream: Stream) -> bool {
    stream < table::VACATED
}

/// Refuses a stream handle that cannot name a stream ([`names_a_stream`]).
fn check_stream(stream: Stream) -> Result<()> {
    if !names_a_stream(stream) {
        return Err(Error::InvalidArgument(format!(
            "stream {stream:#x} is not a stream handle: its top bit is set (a kernel-space \
             address, which no CUDA stream has)"
        )));
    }
    Ok(())
}

/// One stream's share of a device.
#[repr(align(128))]
pub(crate) struct Shard {
    /// The stream served; changes only when the shard holds nothing and a new stream takes
    /// it over ([`DeviceAllocator::move_if_idle`]), under the shard's lock.
    stream: AtomicUsize,
    index: u32,
    /// A shard of a graph private pool ([`graph`]) rather than the stream's own.
    private: bool,
    /// Recordings of free events for this shard under way after its lock was released
    /// ([`graph::OutsideCapture`]).
    recordings: AtomicUsize,
    inner: ShardLock,
    stats: ShardStats,
}

impl Shard {
    /// The stream this shard serves. Read without the shard's lock, it may be one the shard
    /// no longer serves ([`DeviceAllocator::move_if_idle`]).
    pub(crate) fn stream(&self) -> Stream {
        self.stream.load(Relaxed)
    }
}

/// The caching allocator of one device.
pub struct DeviceAllocator {
    device: usize,
    driver: Arc<dyn Driver>,
    max_split_size: usize,
    /// `max_non_split_rounding_mb` (by default the large segment size).
    non_split_rounding: usize,
    /// `large_segment_size_mb`: segments for large requests under 10 MiB.
    large_segment_size: usize,
    gc_threshold: f64,
    gc_ages: gc::Ages,
    roundup_divisions: [usize; ROUNDUP_INTERVALS],
    shards: ShardTable<Shard>,
    /// Every segment of the device: start -> (size, shard index). Used to find the owner of a
    /// pointer when the caller's stream hint is missing or wrong.
    segments: RwLock<BTreeMap<usize, (usize, u32)>>,
    events: EventPool,
    counters: DeviceCounters,
    /// How expandable segments are laid out; `None` for ordinary segments.
    layout: Option<expandable::Layout>,
    policy: Policy,
    /// The most bytes this device has had reserved at once (`policy:compact`): a growth that
    /// stays under it takes no pages from other streams ([`policy`]).
    reserved_high: AtomicI64,
    history: history::History,
    graph: GraphPools,
    limit: MemoryLimit,
    /// Whether shards replay cached pairs ([`shard::Memo`]); off only to test that replaying
    /// changes nothing.
    pair_memo: bool,
}

/// Routes statistic changes of one shard to the device counters.
struct Sink<'a> {
    alloc: &'a DeviceAllocator,
    shard: &'a Shard,
}

impl StatSink for Sink<'_> {
    #[inline(always)]
    fn change(&mut self, index: usize, delta: i64) {
        if self.shard.stats.change(index, delta) {
            self.alloc.settle_peaks(self.shard);
        }
    }
}

/// A [`Sink`] for one block operation (an allocation, a free, a release, a new or returned
/// segment): statistics that pass their limits are only marked, and settled once when the
/// operation's sink is dropped, still under the shard's lock, rather than once per statistic.
/// Exact because in these operations a statistic that rises past its limit ends at its
/// highest value (each changes once, or decreases come first), so the settle sees the
/// operation's peak as the shard's current state.
struct OpSink<'a> {
    alloc: &'a DeviceAllocator,
    shard: &'a Shard,
    over: bool,
}

impl StatSink for OpSink<'_> {
    #[inline(always)]
    fn change(&mut self, index: usize, delta: i64) {
        if self.shard.stats.change(index, delta) {
            self.over = true;
        }
    }
}

impl Drop for OpSink<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.over {
            self.alloc.settle_peaks(self.shard);
        }
    }
}

/// Holds the locks of every engaged shard ([`ShardStats::is_engaged`]) but one, whose lock
/// the caller holds; a shard whose thread holds its lock and waits for the settle lock is
/// settled in that thread's place instead ([`DeviceAllocator::lock_or_proxy`]). The other
/// shards hold no headroom and count as holding nothing until they mark an overdraft, which
/// is settled after this settle (by its thread, or by the settle lock's holder once it has
/// released that lock). The caller holds the settle lock, whose list of held shards grows
/// only when more shards are engaged than ever before.
struct LockedShards<'a> {
    alloc: &'a DeviceAllocator,
    home: &'a Shard,
    /// Indices of the locked shards and the caller's (the settle lock's scratch list).
    held: &'a mut Vec<u32>,
}

impl<'a> LockedShards<'a> {
    fn lock(alloc: &'a DeviceAllocator, home: &'a Shard, held: &'a mut Vec<u32>) -> Self {
        held.clear();
        held.push(home.index);
        home.stats.held.store(true, Relaxed);
        if home.stats.engaged_alone() {
            return LockedShards { alloc, home, held };
        }
        // Settling touches statistics only: a held memo allocation stays held.
        loop {
            let before = held.len();
            for shard in alloc.shards.iter() {
                if !shard.stats.held.load(Relaxed) && shard.stats.is_engaged() {
                    alloc.lock_or_proxy(shard, std::mem::forget);
                    held.push(shard.index);
                }
            }
            if held.len() == before {
                return LockedShards { alloc, home, held };
            }
        }
    }

    /// Every locked shard and the caller's.
    fn shards(&self) -> impl Iterator<Item = &'a Shard> + '_ {
        let table = &self.alloc.shards;
        self.held.iter().filter_map(move |&i| table.by_index(i))
    }
}

impl Drop for LockedShards<'_> {
    fn drop(&mut self) {
        for shard in self.shards() {
            shard.stats.held.store(false, Relaxed);
            if shard.stats.proxied.swap(false, Relaxed) {
                // Settled on behalf of its thread, which holds its lock.
                continue;
            }
            if !std::ptr::eq(shard, self.home) {
                // SAFETY: `lock` locked this shard, forgot the guard and listed it once in
                // `held`, which is cleared below: this is its only unlock.
                unsafe { shard.inner.force_unlock() };
            }
        }
        self.held.clear();
    }
}

static WARNED_INVALID_FREE: AtomicBool = AtomicBool::new(false);

impl DeviceAllocator {
    /// An allocator for `device` of `driver`.
    pub fn new(driver: Arc<dyn Driver>, device: usize, config: &Config) -> Result<DeviceAllocator> {
        let count = driver.device_count()?;
        if device >= count {
            return Err(Error::InvalidArgument(format!(
                "device {device} does not exist: the {} driver has {count} device(s)",
                driver.name()
            )));
        }
        let layout = policy::layout(&*driver, device, config);
        let a = DeviceAllocator {
            layout,
            policy: config.policy,
            reserved_high: AtomicI64::new(0),
            device,
            driver,
            max_split_size: config.max_split_size,
            non_split_rounding: config.non_split_rounding(),
            large_segment_size: config.large_segment_size,
            gc_threshold: config.garbage_collection_threshold,
            gc_ages: gc::Ages::default(),
            roundup_divisions: config.roundup_power2_divisions,
            shards: ShardTable::new(),
            segments: RwLock::new(BTreeMap::new()),
            events: EventPool::new(device),
            counters: DeviceCounters::default(),
            history: history::History::default(),
            graph: GraphPools::default(),
            limit: MemoryLimit::default(),
            pair_memo: true,
        };
        if config.per_process_memory_fraction < 1.0 {
            a.set_memory_fraction(config.per_process_memory_fraction)?;
        }
        Ok(a)
    }

    /// Turns the replay of cached malloc+free pairs off or on (on by default). Replaying
    /// changes nothing observable; this exists so that tests can show it.
    #[doc(hidden)]
    pub fn set_pair_memo(&mut self, on: bool) {
        self.pair_memo = on;
    }

    /// Mallocs served by replaying a cached pair so far (counted in debug builds only, for
    /// tests; 0 otherwise).
    #[doc(hidden)]
    pub fn pair_memo_hits(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.inner.lock_memo().memo_hits())
            .sum()
    }

    /// The device index.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    #[inline(always)]
    fn shard(&self, stream: Stream) -> Result<&Shard> {
        // When the table is full: whether a capture blocks returning memory, looked up once
        // for all the shards offered (a shard that already holds nothing may still move).
        let mut capturing = None;
        let reuse = move |shard: &Shard| {
            let capturing = *capturing.get_or_insert_with(|| self.capture_blocks(stream));
            self.take_over_shard(shard, stream, !capturing)
        };
        let make = |index| Shard {
            stream: AtomicUsize::new(stream),
            index,
            private: false,
            recordings: AtomicUsize::new(0),
            inner: ShardLock::default(),
            stats: ShardStats::new(&self.counters),
        };
        // A shard the last emptying of the cache left holding nothing: its structures are
        // grown, and streams made and dropped over a process's life cost no more shards than
        // are in use at once.
        let adopt = |shard: &Shard| self.take_over_shard(shard, stream, false);
        self.shards.get_or_insert(stream, make, adopt, reuse)
    }

    fn sink<'a>(&'a self, shard: &'a Shard) -> Sink<'a> {
        Sink { alloc: self, shard }
    }

    /// The sink of one block operation on `shard`, whose lock the caller holds until the sink
    /// is dropped ([`OpSink`]).
    fn op_sink<'a>(&'a self, shard: &'a Shard) -> OpSink<'a> {
        OpSink {
            alloc: self,
            shard,
            over: false,
        }
    }

    /// Settles statistics of `home` (whose lock the caller holds) that passed their limits.
    /// When another thread is settling, waits for it holding `home`'s lock (that thread may
    /// settle `home` meanwhile, in this thread's place). Allocates only when more shards are
    /// engaged than at any earlier settle; see [`stats`] for the two ways of settling.
    #[cold]
    #[inline(never)]
    fn settle_peaks(&self, home: &Shard) {
        stats::before_settle_try();
        loop {
            let mut settle = match self.counters.settle.try_lock() {
                Some(settle) => settle,
                None if home.stats.is_over() => self.wait_to_settle(home),
                None => return,
            };
            if home.stats.engaged_alone() {
                home.stats.settle_alone(&self.counters, &mut settle.unowned);
            } else if !self.settle_from_donors(home, &mut settle.unowned) {
                self.settle_all(home, &mut settle);
            }
            drop(settle);
            stats::after_settle_unlock();
            if home.stats.engaged_alone() || !self.shards.iter().any(|s| s.stats.is_over()) {
                return;
            }
        }
    }

    /// Takes the settle lock for `home`, whose lock the caller holds and whose overdraft waits
    /// to be settled: marked *waiting* meanwhile, so that the lock's holders settle `home` in
    /// its place rather than wait for its lock ([`stats`]).
    #[cold]
    fn wait_to_settle(&self, home: &Shard) -> parking_lot::MutexGuard<'_, stats::SettleState> {
        // Publishes the statistics this thread changed to a holder that sees the mark.
        home.stats.waiting.store(true, SeqCst);
        let settle = self.counters.settle.lock();
        home.stats.waiting.store(false, Relaxed);
        settle
    }

    /// Runs `locked` with `shard`'s lock, or marks the shard settled in its thread's place
    /// when that thread holds the lock and waits for the settle lock, which the caller holds
    /// ([`stats`]). Never waits for a waiting shard.
    fn lock_or_proxy<'s>(&self, shard: &'s Shard, locked: impl FnOnce(ShardGuard<'s, ShardInner>)) {
        // Waits for the lock a little at a time (its holder may be in a driver call), looking
        // in between for the mark of a thread that waits for the settle lock.
        const GLANCE: std::time::Duration = std::time::Duration::from_micros(20);
        loop {
            // A waiting thread holds its lock until it has the settle lock, which the caller
            // holds: the mark cannot be stale.
            if shard.stats.waiting.load(SeqCst) {
                shard.stats.held.store(true, Relaxed);
                shard.stats.proxied.store(true, Relaxed);
                return;
            }
            if let Some(guard) = shard.inner.try_lock_memo_for(GLANCE) {
                shard.stats.held.store(true, Relaxed);
                return locked(guard);
            }
        }
    }

    /// Covers `home`'s overdrafts with other shards' unused headroom, locking one donor at a
    /// time and skipping donors whose lock is busy (`home` is not engaged alone: another
    /// shard may hold headroom). Returns false when that was not enough, or another shard has
    /// an overdraft waiting, so that every shard must be settled. The caller holds the settle
    /// lock and `home`'s lock.
    fn settle_from_donors(&self, home: &Shard, unowned: &mut Unowned) -> bool {
        let mut wanted = home.stats.take_unowned(unowned);
        for donor in self.shards.iter() {
            if wanted == 0 {
                break;
            }
            // A donor that shows no headroom of what is wanted is not locked, and only the
            // statistics it shows headroom of are taken. Its counters are read without its
            // lock, so the look may be stale: what is skipped wrongly only sends this settle
            // to `settle_all`, which is exact, and what is taken is checked again under its
            // lock.
            if std::ptr::eq(donor, home) || !donor.stats.is_engaged() {
                continue;
            }
            let offer = donor.stats.spare_of(wanted);
            if offer == 0 && !donor.stats.is_over() {
                continue;
            }
            let Some(_donor) = donor.inner.try_lock_memo() else {
                continue;
            };
            if donor.stats.is_over() {
                return false;
            }
            wanted = (wanted & !offer) | home.stats.take_spare(&donor.stats, offer);
        }
        home.stats.clear_covered();
        !home.stats.is_over() && !self.shards.iter().any(|s| s.stats.is_over())
    }

    /// Settles every engaged shard under their locks ([`LockedShards`]). The caller holds the
    /// settle lock (which guards `state`) and `home`'s lock, and has raised `home`'s tops
    /// ([`ShardStats::raise_top_wanted`]) in this settle.
    fn settle_all(&self, home: &Shard, state: &mut SettleState) {
        let all = LockedShards::lock(self, home, &mut state.held);
        stats::settle(&self.counters, &mut state.unowned, &home.stats, || {
            all.shards().map(|s| &s.stats)
        });
    }

    fn total_current(&self, index: usize) -> i64 {
        self.shards
            .iter()
            .map(|s| s.stats.cells[index].current.load(Relaxed))
            .sum()
    }

    /// Allocates `size` bytes for use on `stream`. Returns the address, or 0 for a size of 0.
    pub fn malloc(&self, size: usize, stream: Stream) -> Result<usize> {
        if size == 0 {
            return Ok(0);
        }
        check_stream(stream)?;
        if size > MAX_REQUEST {
            return Err(Error::InvalidArgument(if size > isize::MAX as usize {
                format!("size {size} is absurd (a negative number passed as size_t?)")
            } else {
                format!(
                    "size {size} ({}) is larger than any device",
                    format_bytes(size as u64)
                )
            }));
        }
        let rounded = round_size_with(size, self.roundup_divisions[roundup_interval(size)]);
        let pool = PoolKind::for_size(rounded);
        let (shard, pool_id) = if self.graph.flags() == 0 {
            (self.shard(stream)?, None)
        } else {
            self.flush_deferred()?;
            self.shard_for_pools(stream)?
        };
        let mut retried = false;
        // `policy:compact` looks for another stream's idle block once before growing.
        let mut may_lend = self.policy == Policy::Compact && !shard.private;
        let collecting = self.gc_note_request(pool);
        let mut first = shard.inner.lock_memo();
        if self.moved(shard, stream, pool_id) {
            // The shard moved to another stream or pool after the lookup.
            drop(first);
            return self.malloc(size, stream);
        }
        let replayed = if collecting {
            None
        } else {
            first.malloc_memo(
                pool,
                rounded,
                size,
                self.max_split_size,
                &mut self.op_sink(shard),
            )
        };
        if let Some(addr) = replayed {
            self.note(Action::Alloc, addr, size, stream);
            return Ok(addr);
        }
        // The full path goes on under the same lock (locking again would cost another atomic
        // compare-and-swap).
        first.settle_memo();
        let mut first = Some(first);
        loop {
            let mut inner = match first.take() {
                Some(inner) => inner,
                None => {
                    let inner = shard.inner.lock();
                    if self.moved(shard, stream, pool_id) {
                        // The shard moved while it was unlocked: it held nothing then, so
                        // this allocation starts again.
                        drop(inner);
                        return self.malloc(size, stream);
                    }
                    inner
                }
            };
            if !inner.pending.is_empty() && !self.capture_blocks(stream) {
                self.process_events(shard, &mut inner);
            }
            let found =
                inner.take_best_fit(pool, rounded, self.max_split_size, self.non_split_rounding);
            let from_index = found.is_some();
            if found.is_none() && may_lend && !self.capture_blocks(stream) {
                may_lend = false;
                drop(inner);
                if let Some(addr) = self.lend(shard, pool, rounded, size, stream) {
                    return Ok(addr);
                }
                continue;
            }
            let id = match found {
                Some(id) => id,
                None => match self
                    .new_memory_or_release(shard, &mut inner, pool, rounded, stream, retried)
                {
                    Ok(id) => id,
                    // While a capture is underway nothing may be returned to the driver, so
                    // there is no retry (PyTorch's rule).
                    Err(Error::OutOfMemory(_)) if !retried && !self.capture_blocks(stream) => {
                        drop(inner);
                        DeviceCounters::bump(&self.counters.num_alloc_retries);
                        self.release_cached()?;
                        retried = true;
                        continue;
                    }
                    Err(Error::OutOfMemory(reason)) => {
                        drop(inner);
                        DeviceCounters::bump(&self.counters.num_ooms);
                        if self.history.on() {
                            // PyTorch's out-of-memory event carries the device's free bytes.
                            let free = self.driver.mem_info(self.device).map_or(0, |i| i.free);
                            self.note(Action::Oom, free as usize, size, stream);
                        }
                        return Err(self.out_of_memory(size, &reason));
                    }
                    Err(e) => return Err(e),
                },
            };
            let mut sink = self.op_sink(shard);
            // A growth of an expandable segment leaves what it passed marked, for this one
            // settle of the growth and the allocation together.
            sink.over = !from_index && shard.stats.is_over();
            let addr = inner.allocate(
                id,
                rounded,
                size,
                self.max_split_size,
                from_index,
                &mut sink,
            );
            drop(sink);
            self.note(Action::Alloc, addr, size, stream);
            return Ok(addr);
        }
    }

    /// [`DeviceAllocator::new_memory`], collecting garbage first on the first attempt; when
    /// the driver is out of memory and `max_split_size` is set, first returns this stream's
    /// cached oversize segments that make room (PyTorch's `release_available_cached_blocks`)
    /// and tries once more, unless the driver says `stream` is capturing, where freeing device
    /// memory would invalidate the capture. (PyTorch makes this release while a private pool
    /// is active, and so does this: only a capture the driver reports skips it.) The caller's
    /// retry after returning every cached segment is `retried`.
    fn new_memory_or_release(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        pool: PoolKind,
        rounded: usize,
        stream: Stream,
        retried: bool,
    ) -> Result<u32> {
        let got = self.new_memory(shard, inner, pool, rounded, stream, !retried);
        if retried
            || !matches!(got, Err(Error::OutOfMemory(_)))
            || self.driver_capturing(stream)
            || !self.release_oversize(shard, inner, pool, rounded)
        {
            return got;
        }
        self.new_memory(shard, inner, pool, rounded, stream, false)
    }

    /// Returns cached oversize segments (at least `max_split_size`) of `shard`'s `pool` to
    /// make room for `rounded` bytes: the smallest one at least as large as both, else the
    /// largest ones down until as many bytes are returned. Returns whether that much went.
    fn release_oversize(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        pool: PoolKind,
        rounded: usize,
    ) -> bool {
        if self.max_split_size == usize::MAX || self.layout.is_some() {
            return false;
        }
        let want = rounded.max(self.max_split_size);
        let mut oversize: Vec<(usize, usize, u32)> = inner
            .whole_free_segments()
            .into_iter()
            .map(|id| (inner.block(id).size, inner.block(id).addr, id))
            .filter(|&(size, _, id)| inner.block(id).pool == pool && size >= self.max_split_size)
            .collect();
        oversize.sort_unstable();
        if let Some(&(_, _, id)) = oversize.iter().find(|&&(size, _, _)| size >= want) {
            return self.free_segment(shard, inner, id).is_ok();
        }
        let mut released = 0;
        for &(_, _, id) in oversize.iter().rev() {
            if released >= want {
                break;
            }
            released += self.free_segment(shard, inner, id).unwrap_or(0);
        }
        released >= want
    }

    /// A new block of at least `rounded` bytes for `shard`: a new segment from the driver, or
    /// memory mapped into an expandable segment. The block is out of its free index.
    fn new_memory(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        pool: PoolKind,
        rounded: usize,
        stream: Stream,
        collect: bool,
    ) -> Result<u32> {
        // Graph private pools keep ordinary segments, as in PyTorch: a graph replays on the
        // addresses of blocks its pool has freed, which must stay mapped.
        let layout = self.layout.as_ref().filter(|_| !shard.private);
        let seg = match layout {
            Some(_) => rounded,
            None => segment_size(rounded, self.large_segment_size),
        };
        if collect && self.gc_threshold > 0.0 && !self.capture_blocks(stream) {
            self.collect_garbage(shard, inner, seg);
        }
        // The claims are released when this returns: after the growth is counted. What a
        // growth maps is worked out only when a limit is set.
        if let Some(layout) = layout {
            let _claim = self.check_limit(|| inner.bytes_to_map(layout, pool, rounded))?;
            return self.grow(shard, inner, layout, pool, rounded);
        }
        let _claim = self.check_limit(|| seg)?;
        let addr = self.driver.mem_alloc(self.device, seg)?;
        DeviceCounters::bump(&self.counters.num_device_alloc);
        self.note(Action::SegmentAlloc, addr, seg, shard.stream());
        self.segments.write().insert(addr, (seg, shard.index));
        Ok(inner.add_segment(
            addr,
            seg,
            pool,
            self.max_split_size,
            &mut self.op_sink(shard),
        ))
    }

    fn out_of_memory(&self, size: usize, reason: &str) -> Error {
        let stats = self.stats();
        let allocated = stats.allocated_bytes[0].current.max(0) as u64;
        let reserved = stats.reserved_bytes[0].current.max(0) as u64;
        let device_text = match self.driver.mem_info(self.device) {
            Ok(info) => format!(
                "device {} has a total capacity of {} of which {} is free",
                self.device,
                format_bytes(info.total),
                format_bytes(info.free)
            ),
            Err(e) => format!("device {} (capacity unknown: {e})", self.device),
        };
        let allowed = match self.limit_text() {
            Some(limit) => format!(", with {limit};"),
            None => String::new(),
        };
        Error::OutOfMemory(format!(
            "tried to allocate {} on device {}; {device_text}. Of the memory in use, {} is allocated \
             by tensoralloc{allowed} and {} is reserved by tensoralloc but unallocated. If reserved but \
             unallocated memory is large, try max_split_size_mb in TENSORALLOC_CONF to reduce fragmentation. \
             (Driver: {reason})",
            format_bytes(size as u64),
            self.device,
            format_bytes(allocated),
            format_bytes(reserved.saturating_sub(allocated)),
        ))
    }

    /// Frees memory returned by [`DeviceAllocator::malloc`]. `stream_hint` is the stream it was
    /// allocated on, if known (it makes the lookup direct). Freeing 0 does nothing. An unknown
    /// or already freed pointer changes nothing and is reported (counted in
    /// `num_invalid_frees`, warned about once on stderr).
    pub fn free(&self, ptr: usize, stream_hint: Option<Stream>) -> Result<()> {
        if self.try_free(ptr, stream_hint)? {
            Ok(())
        } else {
            Err(self.invalid_free(ptr))
        }
    }

    /// Like [`DeviceAllocator::free`], but a pointer this device does not have allocated
    /// returns `Ok(false)` without being counted (the caller may try another device).
    pub fn try_free(&self, ptr: usize, stream_hint: Option<Stream>) -> Result<bool> {
        if ptr == 0 {
            return Ok(true);
        }
        let mut found = None;
        let hint = stream_hint.filter(|&s| names_a_stream(s));
        if let Some(shard) = hint.and_then(|s| self.shards.get(s)) {
            let mut inner = shard.inner.lock_memo();
            // The sink settles when this statement ends, under the shard's lock.
            let replayed = inner.free_memo(ptr, self.max_split_size, &mut self.op_sink(shard));
            if let Some(requested) = replayed {
                // The memo's allocation, freed as the full path would: noted under the lock,
                // so that the stream's events are recorded in the order they happened.
                if self.history.on() {
                    self.note(Action::FreeRequested, ptr, requested, shard.stream());
                    self.note(Action::FreeCompleted, ptr, requested, shard.stream());
                }
                drop(inner);
                return Ok(true);
            }
            inner.settle_memo();
            found = self.unallocate_from(shard, inner, ptr);
        }
        let found = found.or_else(|| self.unallocate_in(self.owner_of(ptr)?, ptr));
        let Some((shard, inner, id)) = found else {
            return Ok(false);
        };
        self.note_block(Action::FreeRequested, shard, &inner, id);
        self.finish_free(shard, inner, id)?;
        Ok(true)
    }

    /// Takes the allocation at `ptr` back from `shard`'s client, if `shard` has it allocated.
    fn unallocate_in<'a>(
        &'a self,
        shard: &'a Shard,
        ptr: usize,
    ) -> Option<(&'a Shard, ShardGuard<'a, ShardInner>, u32)> {
        self.unallocate_from(shard, shard.inner.lock(), ptr)
    }

    #[inline(always)]
    fn unallocate_from<'a>(
        &'a self,
        shard: &'a Shard,
        mut inner: ShardGuard<'a, ShardInner>,
        ptr: usize,
    ) -> Option<(&'a Shard, ShardGuard<'a, ShardInner>, u32)> {
        let id = inner.unallocate(ptr, self.max_split_size, &mut self.op_sink(shard))?;
        Some((shard, inner, id))
    }

    #[inline(always)]
    fn finish_free(
        &self,
        shard: &Shard,
        mut inner: ShardGuard<'_, ShardInner>,
        id: u32,
    ) -> Result<()> {
        if inner.block(id).stream_uses.is_empty() {
            let candidate = inner.memo_candidate(id);
            self.complete_free(shard, &mut inner, id);
            if let Some(c) = candidate.filter(|_| !shard.private && self.pair_memo) {
                inner.remember(c);
            }
            if shard.private && self.private_shard_unused(shard) {
                self.trim_private_shard(shard, &mut inner);
            }
            return Ok(());
        }
        if self.must_defer(&inner.block(id).stream_uses) {
            // A capture forbids these events now: recorded once it ends.
            self.defer_free(shard, id);
            return Ok(());
        }
        self.record_free_events(shard, inner, id)
    }

    /// Records an event on each stream that used freed block `id`; the block returns to its
    /// pool when they have all completed.
    fn record_free_events(
        &self,
        shard: &Shard,
        mut inner: ShardGuard<'_, ShardInner>,
        id: u32,
    ) -> Result<()> {
        // A pool begun since the caller looked waits for this recording, or this for it.
        let Some(_leave) = self.outside_capture(shard) else {
            self.defer_free(shard, id);
            return Ok(());
        };
        let uses = std::mem::take(&mut inner.block_mut(id).stream_uses);
        // Events are taken from the pool (perhaps created) and recorded without the lock.
        drop(inner);
        let mut recorded: Vec<Event> = Vec::with_capacity(uses.len());
        let mut failure = None;
        for s in uses {
            match self
                .events
                .get(&self.driver)
                .and_then(|e| self.driver.event_record(self.device, e, s).map(|()| e))
            {
                Ok(e) => recorded.push(e),
                Err(e) => failure = Some(e),
            }
        }
        let mut inner = shard.inner.lock();
        if let Some(e) = failure {
            // Without its events the block cannot be proven idle: wait for the ones recorded,
            // then keep it out of circulation only if even that is impossible.
            eprintln!("tensoralloc: device {}: could not record a stream event ({e}); waiting for the recorded ones", self.device);
            for ev in recorded.drain(..) {
                let _ = self.driver.event_synchronize(self.device, ev);
                self.events.put(ev);
            }
        }
        if recorded.is_empty() {
            self.complete_free(shard, &mut inner, id);
        } else {
            inner.block_mut(id).events_left = recorded.len() as u32;
            inner.pending.extend(recorded.into_iter().map(|e| (e, id)));
        }
        Ok(())
    }

    /// Counts and reports a free of a pointer that no device has allocated.
    pub fn invalid_free(&self, ptr: usize) -> Error {
        DeviceCounters::bump(&self.counters.num_invalid_frees);
        let message = format!(
            "free of {ptr:#x} on device {}: not a live allocation of tensoralloc (never allocated, already freed, or not the start of a block); nothing was changed",
            self.device
        );
        if !WARNED_INVALID_FREE.swap(true, Relaxed) {
            eprintln!("tensoralloc: warning: {message} (further invalid frees are counted in num_invalid_frees without this warning)");
        }
        Error::UnknownPointer(message)
    }

    /// The shard whose segment contains `ptr`.
    fn owner_of(&self, ptr: usize) -> Option<&Shard> {
        let index = {
            let segments = self.segments.read();
            let (&start, &(size, index)) = segments.range(..=ptr).next_back()?;
            if ptr >= start + size {
                return None;
            }
            index
        };
        self.shards.by_index(index)
    }

    /// Whether `ptr` lies inside a segment of this device.
    pub fn owns(&self, ptr: usize) -> bool {
        self.owner_of(ptr).is_some()
    }

    /// Marks the allocation at `ptr` as used by `stream`: when it is freed, it is not reused
    /// until the work queued on `stream` so far has completed.
    pub fn record_stream(&self, ptr: usize, stream: Stream) -> Result<()> {
        check_stream(stream)?;
        let unknown = || {
            Error::UnknownPointer(format!(
                "record_stream: {ptr:#x} is not a live allocation of tensoralloc on device {}",
                self.device
            ))
        };
        let shard = self.owner_of(ptr).ok_or_else(unknown)?;
        if stream == shard.stream() {
            // The allocation stream is always waited for implicitly.
            return shard
                .inner
                .lock()
                .live
                .contains_key(&ptr)
                .then_some(())
                .ok_or_else(unknown);
        }
        let mut inner = shard.inner.lock();
        let id = *inner.live.get(&ptr).ok_or_else(unknown)?;
        let uses = &mut inner.block_mut(id).stream_uses;
        if !uses.contains(&stream) {
            uses.push(stream);
        }
        Ok(())
    }

    /// Returns blocks whose events have completed to their pools.
    fn process_events(&self, shard: &Shard, inner: &mut ShardInner) {
        if self.graph.capturing() {
            return;
        }
        let mut i = 0;
        while i < inner.pending.len() {
            let (event, id) = inner.pending[i];
            let done = match self.driver.event_query(self.device, event) {
                Ok(done) => done,
                Err(e) => {
                    eprintln!(
                        "tensoralloc: device {}: event query failed ({e}); waiting for it",
                        self.device
                    );
                    self.driver.event_synchronize(self.device, event).is_ok()
                }
            };
            if !done {
                i += 1;
                continue;
            }
            inner.pending.swap_remove(i);
            self.events.put(event);
            self.event_done(shard, inner, id);
        }
    }

    fn event_done(&self, shard: &Shard, inner: &mut ShardInner, id: u32) {
        let b = inner.block_mut(id);
        b.events_left -= 1;
        if b.events_left == 0 {
            self.complete_free(shard, inner, id);
        }
    }

    /// Completes the free of block `id`, whose work on every stream is done: records it, returns
    /// the block to its pool (merged with free neighbours), and notes for garbage collection
    /// when a whole segment became free.
    #[inline(always)]
    fn complete_free(&self, shard: &Shard, inner: &mut ShardInner, id: u32) {
        self.note_block(Action::FreeCompleted, shard, inner, id);
        inner.release(id, &mut self.op_sink(shard));
        self.gc_note_free(inner, id);
    }

    /// Waits for every outstanding event of `shard`, then returns its unused segments to the
    /// driver. Returns the bytes released.
    fn release_shard(&self, shard: &Shard, inner: &mut ShardInner) -> Result<usize> {
        if self.graph.capturing() {
            return Ok(0);
        }
        for (event, id) in std::mem::take(&mut inner.pending) {
            self.driver.event_synchronize(self.device, event)?;
            self.events.put(event);
            self.event_done(shard, inner, id);
        }
        let released = self.release_segments(shard, inner, usize::MAX)?;
        Ok(released + self.release_expandable(shard, inner, usize::MAX)?)
    }

    /// Returns unused whole segments of `shard` to the driver until `goal` bytes are released.
    fn release_segments(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        goal: usize,
    ) -> Result<usize> {
        let mut released = 0;
        for id in inner.whole_free_segments() {
            if released >= goal {
                break;
            }
            released += self.free_segment(shard, inner, id)?;
        }
        Ok(released)
    }

    /// Returns the whole free segment `id` of `shard` to the driver; returns its size.
    fn free_segment(&self, shard: &Shard, inner: &mut ShardInner, id: u32) -> Result<usize> {
        let (addr, size) = (inner.block(id).addr, inner.block(id).size);
        self.unlisted_while(addr, size, shard, || {
            self.driver.mem_free(self.device, addr)
        })?;
        self.gc_forget(addr);
        inner.remove_segment(id, self.max_split_size, &mut self.op_sink(shard));
        DeviceCounters::bump(&self.counters.num_device_free);
        self.note(Action::SegmentFree, addr, size, shard.stream());
        Ok(size)
    }

    /// Returns the segment of `size` bytes at `addr` of `shard` (whose lock the caller holds)
    /// to the driver with `give_back`, taking it out of the segment map first: once the driver
    /// has it back, another stream may get the same addresses and list them as its own, and
    /// that entry must not be the one removed (its allocations could then never be freed). The
    /// entry comes back if the driver refuses.
    fn unlisted_while(
        &self,
        addr: usize,
        size: usize,
        shard: &Shard,
        give_back: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.segments.write().remove(&addr);
        give_back().inspect_err(|_| {
            self.segments.write().insert(addr, (size, shard.index));
        })
    }

    /// Waits for outstanding events and returns every unused cached segment to the driver,
    /// one stream at a time. Pools still in use keep theirs. Does nothing while a capture is
    /// underway (a driver forbids both then).
    fn release_cached(&self) -> Result<()> {
        if self.graph.capturing() {
            return Ok(());
        }
        DeviceCounters::bump(&self.counters.num_sync_all_streams);
        let mut idle = Vec::new();
        for shard in self.shards.iter().filter(|s| !s.private) {
            let mut inner = shard.inner.lock();
            self.release_shard(shard, &mut inner)?;
            if Self::is_idle(shard, &inner) {
                idle.push(shard.index);
            }
        }
        self.release_unused_pools()?;
        self.retire_idle_shards();
        // New streams take these before making shards of their own.
        self.shards.offer_idle(idle);
        Ok(())
    }

    /// Whether `shard` (whose lock the caller holds) holds nothing at all: no block, in use,
    /// cached or waiting for events, and no statistic of its own.
    fn is_idle(shard: &Shard, inner: &ShardInner) -> bool {
        inner.holds_nothing() && shard.stats.holds_nothing()
    }

    /// Makes `shard` (whose lock the caller holds) serve `stream` if it holds nothing at all
    /// ([`DeviceAllocator::is_idle`]). Returns the stream it served, if it moved.
    fn move_if_idle(shard: &Shard, inner: &mut ShardInner, stream: Stream) -> Option<Stream> {
        if !Self::is_idle(shard, inner) {
            return None;
        }
        inner.forget_memo();
        Some(shard.stream.swap(stream, Relaxed))
    }

    /// Moves the headroom of shards that hold nothing to the device's unowned headroom, so
    /// that settles take it without locking them and leave them alone ([`stats`]), unless
    /// a settle is under way. The caller holds no shard lock.
    fn retire_idle_shards(&self) {
        // Never waited for: an overdraft marked while the settle lock is held is settled only
        // after it is released, so it is held briefly, and busy shards are left engaged.
        let Some(mut settle) = self.counters.settle.try_lock() else {
            return;
        };
        for shard in self.shards.iter() {
            if shard.stats.is_engaged() {
                if let Some(_inner) = shard.inner.try_lock_memo() {
                    shard.stats.retire(&mut settle.unowned);
                }
            }
        }
        drop(settle);
        self.settle_left_overdrafts();
    }

    /// Makes `shard` serve the new stream `stream` if it holds nothing ([`table`]): a shard
    /// offered as idle when the cache was emptied (`may_release` false: it must still hold
    /// nothing), or, when the device has no room for a new shard, any shard of which no
    /// allocation is in use and no event outstanding (`may_release` true: its cached
    /// segments go back to the driver first, unless a capture of `stream` blocks that). Its
    /// accumulated statistics stay in the device's sums; its headroom of peaks goes with it.
    /// Returns the stream it served, if it moved. The caller holds the shard table's
    /// insertion lock and no shard lock.
    ///
    /// The shard's own stream may have been destroyed, so nothing here passes it to the
    /// driver: a shard with free pages of an expandable segment still mapped (unmapping waits
    /// for the work queued on its stream) stays until the cache is emptied.
    #[cold]
    fn take_over_shard(&self, shard: &Shard, stream: Stream, may_release: bool) -> Option<Stream> {
        if shard.private {
            return None;
        }
        // Never waited for: a shard in use is no candidate.
        let mut inner = shard.inner.try_lock()?;
        // A pool begun since the caller looked forbids releasing now: the shard may then only
        // move if it holds nothing.
        if may_release && !self.graph.capturing() {
            if !inner.pending.is_empty() {
                self.process_events(shard, &mut inner);
            }
            if !inner.live.is_empty() || !inner.pending.is_empty() {
                return None;
            }
            let released = self.release_segments(shard, &mut inner, usize::MAX).is_ok()
                && self.free_mapped(shard) == 0
                && self.release_expandable(shard, &mut inner, 0).is_ok();
            if !released {
                return None;
            }
        }
        Self::move_if_idle(shard, &mut inner, stream)
    }

    /// After a settle lock taken without settling is released: settles the overdrafts that
    /// threads marked meanwhile, as their try of the settle lock failed (the [`stats`]
    /// protocol). The caller holds no shard lock.
    fn settle_left_overdrafts(&self) {
        stats::after_settle_unlock();
        for shard in self.shards.iter() {
            if shard.stats.is_over() {
                let _inner = shard.inner.lock_memo();
                if shard.stats.is_over() {
                    self.settle_peaks(shard);
                }
            }
        }
    }

    /// Returns every unused cached segment to the driver (after waiting for outstanding
    /// events), except those of graph pools still in use. While a capture is underway this
    /// does nothing. The shares of streams left holding nothing go to the next new streams
    /// (a stream that comes back later is a new stream).
    pub fn empty_cache(&self) -> Result<()> {
        self.flush_deferred()?;
        self.release_cached()
    }

    /// Polls outstanding events of every stream, returning finished blocks to their pools.
    /// While a capture is underway this does nothing.
    pub fn poll_events(&self) {
        if self.graph.capturing() {
            return;
        }
        let _ = self.flush_deferred();
        for shard in self.shards.iter() {
            let mut inner = shard.inner.lock();
            if !inner.pending.is_empty() {
                self.process_events(shard, &mut inner);
            }
        }
    }

    /// Bytes allocated to clients and bytes reserved from the driver right now, summed over
    /// streams: two of [`DeviceAllocator::stats`]' values without collecting the rest.
    pub fn current_bytes(&self) -> (u64, u64) {
        let get = |kind| self.total_current(stats::aggregate(kind)).max(0) as u64;
        (get(StatKind::AllocatedBytes), get(StatKind::ReservedBytes))
    }

    /// The device's statistics. Never blocks allocation.
    pub fn stats(&self) -> DeviceStats {
        let mut out = DeviceStats::default();
        for i in 0..TRACKED {
            let mut s = Stat::default();
            for shard in self.shards.iter() {
                let c = &shard.stats.cells[i];
                s.current += c.current.load(Relaxed);
                s.allocated += c.allocated.load(Relaxed);
                s.freed += c.freed();
            }
            s.peak = self.counters.peak[i].load(Relaxed).max(s.current);
            out.set(i, s);
        }
        let c = &self.counters;
        out.num_alloc_retries = c.num_alloc_retries.load(Relaxed);
        out.num_ooms = c.num_ooms.load(Relaxed);
        out.num_sync_all_streams = c.num_sync_all_streams.load(Relaxed);
        out.num_device_alloc = c.num_device_alloc.load(Relaxed);
        out.num_device_free = c.num_device_free.load(Relaxed);
        out.num_invalid_frees = c.num_invalid_frees.load(Relaxed);
        out.max_split_size = if self.max_split_size == usize::MAX {
            -1
        } else {
            self.max_split_size as i64
        };
        out
    }

    /// Sets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        let mut settle = self.counters.settle.lock();
        let (shards, guards) = self.lock_all_or_proxy();
        let stats: Vec<&ShardStats> = shards.iter().map(|s| &s.stats).collect();
        stats::reset_peaks(&self.counters, &mut settle.unowned, &stats);
        self.unlock_all(&shards, guards);
        drop(settle);
        self.settle_left_overdrafts();
    }

    /// Zeroes the accumulated totals (`allocated`, `freed`) and the event counters
    /// (retries, OOMs, syncs, driver allocations and frees, invalid frees).
    pub fn reset_accumulated_stats(&self) {
        let settle = self.counters.settle.lock();
        let (shards, guards) = self.lock_all_or_proxy();
        for s in &shards {
            for c in &s.stats.cells {
                c.reset_accumulated();
            }
        }
        let c = &self.counters;
        for counter in [
            &c.num_alloc_retries,
            &c.num_ooms,
            &c.num_sync_all_streams,
            &c.num_device_alloc,
            &c.num_device_free,
            &c.num_invalid_frees,
        ] {
            counter.store(0, Relaxed);
        }
        self.unlock_all(&shards, guards);
        drop(settle);
        self.settle_left_overdrafts();
    }

    /// Every shard, locked (its held memo allocation settled) or, when its thread waits for
    /// the settle lock that the caller holds, proxied ([`DeviceAllocator::lock_or_proxy`]).
    fn lock_all_or_proxy(&self) -> (Vec<&Shard>, Vec<ShardGuard<'_, ShardInner>>) {
        let shards: Vec<&Shard> = self.shards.iter().collect();
        let mut guards = Vec::with_capacity(shards.len());
        for shard in &shards {
            self.lock_or_proxy(shard, |mut guard| {
                guard.settle_memo();
                guards.push(guard);
            });
        }
        (shards, guards)
    }

    /// Undoes [`DeviceAllocator::lock_all_or_proxy`].
    fn unlock_all(&self, shards: &[&Shard], guards: Vec<ShardGuard<'_, ShardInner>>) {
        for shard in shards {
            shard.stats.held.store(false, Relaxed);
            shard.stats.proxied.store(false, Relaxed);
        }
        drop(guards);
    }

    /// The segment that holds the live allocation containing `ptr` (its start or any byte
    /// inside it): the segment's base address and size, as the driver allocated it (PyTorch's
    /// `getBaseAllocation`, used to share memory between processes).
    pub fn base_allocation(&self, ptr: usize) -> Result<(usize, usize)> {
        let unknown = || {
            Error::UnknownPointer(format!(
                "base allocation: {ptr:#x} is not inside a live allocation of tensoralloc on device {}",
                self.device
            ))
        };
        let (base, size) = {
            let segments = self.segments.read();
            let (&start, &(size, _)) = segments.range(..=ptr).next_back().ok_or_else(unknown)?;
            if ptr >= start + size {
                return Err(unknown());
            }
            (start, size)
        };
        let shard = self.owner_of(ptr).ok_or_else(unknown)?;
        let inner = shard.inner.lock();
        let live = inner.live.contains_key(&ptr)
            || inner.live.values().any(|&id| {
                let b = inner.block(id);
                b.addr <= ptr && ptr < b.addr + b.size
            });
        if live {
            Ok((base, size))
        } else {
            Err(unknown())
        }
    }

    /// Whether a block at `ptr` is currently allocated (for tests and diagnostics).
    pub fn is_allocated(&self, ptr: usize) -> bool {
        self.owner_of(ptr).is_some_and(|s| {
            let inner = s.inner.lock();
            inner
                .live
                .get(&ptr)
                .is_some_and(|&id| inner.block(id).state == State::Allocated)
        })
    }
}

impl Drop for DeviceAllocator {
    fn drop(&mut self) {
        // The allocator owns its segments: return all of them, and every event.
        for shard in self.shards.iter() {
            let mut inner = shard.inner.lock();
            for (event, _) in std::mem::take(&mut inner.pending) {
                let _ = self.driver.event_destroy(self.device, event);
            }
            if let Some((event, _)) = inner.exp.batch.take() {
                let _ = self.driver.event_destroy(self.device, event);
            }
        }
        let mut ranges = std::collections::HashSet::new();
        for shard in self.shards.iter() {
            let mut inner = shard.inner.lock();
            ranges.extend(inner.exp.segments.iter().map(|s| s.base));
            inner.drop_all(&*self.driver, self.device);
        }
        for (&addr, _) in self.segments.read().iter() {
            if !ranges.contains(&addr) {
                let _ = self.driver.mem_free(self.device, addr);
            }
        }
        self.events.destroy_all(&self.driver);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;

    fn allocator() -> (Arc<SimDriver>, DeviceAllocator) {
        let sim = SimDriver::shared(1, 1 << 34).unwrap();
        let a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
        (sim, a)
    }

    fn shard_count(a: &DeviceAllocator) -> usize {
        a.shards.iter().count()
    }

    /// Streams used one round after another, the cache emptied between rounds: each new
    /// stream takes a shard that the emptying left holding nothing, in the order the shards
    /// were made, so no shards pile up; streams that come back later get shards of their own.
    #[test]
    fn new_streams_take_the_shards_an_emptied_cache_left_idle() {
        let (sim, a) = allocator();
        let round = |base: usize| (0..3).map(move |k| base + 0x10 * k).collect::<Vec<_>>();
        let first = round(0x7100_0000);
        for &s in &first {
            let p = a.malloc(3 << 20, s).unwrap();
            a.free(p, Some(s)).unwrap();
        }
        assert_eq!(shard_count(&a), 3);
        a.empty_cache().unwrap();
        assert_eq!(sim.used(0), 0);
        for base in [0x7200_0000, 0x7300_0000] {
            let streams = round(base);
            let held: Vec<_> = streams
                .iter()
                .map(|&s| (a.malloc(4096, s).unwrap(), s))
                .collect();
            assert_eq!(shard_count(&a), 3);
            for (k, &s) in streams.iter().enumerate() {
                let shard = a.shards.get(s).unwrap();
                assert_eq!(shard.index as usize, k);
                assert_eq!(shard.stream(), s);
            }
            for (p, s) in held {
                a.free(p, Some(s)).unwrap();
            }
            a.empty_cache().unwrap();
        }
        // The first round's streams lost their shards; one that comes back is a new stream
        // like any other.
        assert!(first.iter().all(|&s| a.shards.get(s).is_none()));
        let p = a.malloc(4096, first[0]).unwrap();
        assert_eq!(a.shards.get(first[0]).unwrap().index, 0);
        assert_eq!(shard_count(&a), 3);
        a.free(p, Some(first[0])).unwrap();
        let st = a.stats();
        assert_eq!(st.allocated_bytes[0].current, 0);
        assert_eq!(st.allocation[0].allocated, 10);
        assert_eq!(st.allocation[0].freed, 10);
        // The first round's three large segments, cached until the cache was emptied.
        assert_eq!(st.reserved_bytes[0].peak, 3 * (20 << 20));
        assert_eq!(st.reserved_bytes[0].current, 2 << 20);
    }

    /// A shard is taken only if it still holds nothing: one that held memory when the cache
    /// was emptied is not offered, and one offered whose stream allocated again since is
    /// passed over (and not offered again).
    #[test]
    fn a_new_stream_never_takes_a_shard_that_holds_memory() {
        let (_sim, a) = allocator();
        let (busy, back, idle) = (0x7400_0000, 0x7400_0010, 0x7400_0020);
        let kept = a.malloc(4096, busy).unwrap();
        for s in [back, idle] {
            let p = a.malloc(4096, s).unwrap();
            a.free(p, Some(s)).unwrap();
        }
        a.empty_cache().unwrap();
        // `back` was offered, and holds memory again.
        let again = a.malloc(4096, back).unwrap();
        let newcomer = 0x7500_0000;
        let p = a.malloc(4096, newcomer).unwrap();
        assert!(std::ptr::eq(
            a.shards.get(newcomer).unwrap(),
            a.shards.by_index(2).unwrap()
        ));
        assert_eq!(a.shards.get(busy).unwrap().stream(), busy);
        assert_eq!(a.shards.get(back).unwrap().stream(), back);
        assert!(a.shards.get(idle).is_none());
        // No idle shard is left: the next new stream makes one.
        let q = a.malloc(4096, newcomer + 0x10).unwrap();
        assert_eq!(shard_count(&a), 4);
        for (p, s) in [
            (kept, busy),
            (again, back),
            (p, newcomer),
            (q, newcomer + 0x10),
        ] {
            a.free(p, Some(s)).unwrap();
        }
        assert_eq!(a.stats().allocated_bytes[0].current, 0);
    }
}

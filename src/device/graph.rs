//! Graph private pools and capture awareness (PyTorch's `beginAllocateToPool`,
//! `endAllocateToPool`, `releasePool`).
//!
//! While allocation to a pool is underway (between begin and end), an allocation on a stream
//! that the pool's filter accepts comes from that pool: a set of shards of its own, one per
//! (pool, stream), kept in the device's shard table beside the ordinary per-stream shards. So
//! a private block is never handed to an allocation outside its pool, frees of its blocks
//! return to it (the segment map leads a free to the right shard), and the statistics count
//! it like any other memory. The ordinary path pays one atomic load ([`GraphPools::flags`])
//! while no pool is active and nothing is deferred.
//!
//! While a pool is active the device is taken to be capturing a CUDA graph, in which a driver
//! forbids querying or waiting for events and freeing memory. So, until the last active pool
//! ends: pending stream events are left alone, frees of blocks used by other streams
//! (`record_stream`) keep their events unrecorded ("deferred"), and no segment goes back to
//! the driver. The driver's own capture query ([`Driver::stream_capturing`]) covers captures
//! that nobody announced: it is asked on the slow paths (pending events, deferred frees,
//! freeing the cache on out-of-memory).
//!
//! A pool counts its uses: each begin adds one, [`DeviceAllocator::release_pool`] removes
//! one. When none remain, its cached segments go back to the driver as soon as nothing is
//! allocated in them (at release, at a later free, or at `empty_cache`), and once it holds no
//! segment its shards are retired, to be reused by a later pool on the same stream.
//!
//! Locking: the pool state is locked before a shard's lock is taken never; a shard's lock may
//! be held while the pool state is locked.
//!
//! [`Driver::stream_capturing`]: crate::driver::Driver::stream_capturing

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{
    AtomicUsize,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Arc;

use parking_lot::Mutex;

use super::shard::ShardInner;
use super::stats::{self, ShardStats, StatKind};
use super::{DeviceAllocator, Shard};
use crate::driver::Stream;
use crate::error::{Error, Result};

/// A pool id: PyTorch's `MempoolId_t`, a pair of integers. (0, 0) means "no pool".
pub type PoolId = (u64, u64);

/// Decides which streams allocate to a pool (true: this one does).
pub type StreamFilter = Arc<dyn Fn(Stream) -> bool + Send + Sync>;

/// Set in [`GraphPools::flags`] while some freed block waits for its events to be recorded.
const DEFERRED: usize = 1 << (usize::BITS - 1);

/// Shard-table keys of private shards count down from here: kernel-space addresses, which no
/// stream handle can equal (the device refuses handles with the top bit set).
const PRIVATE_KEY_BASE: usize = usize::MAX;

/// The graph pools of one device.
#[derive(Default)]
pub(crate) struct GraphPools {
    /// Active pools (begins not yet ended), plus [`DEFERRED`]. Zero on the ordinary path.
    flags: AtomicUsize,
    state: Mutex<PoolState>,
    /// Freed blocks whose stream events are not recorded yet: (shard index, block id).
    deferred: Mutex<Vec<(u32, u32)>>,
}

/// Leave to record a free's stream events for a shard after its lock is released, for as long
/// as it lives, counted in the shard's `recordings`: [`GraphPools::outside_capture`]
/// gives it only while no pool is active, and [`DeviceAllocator::begin_allocate_to_pool`]
/// returns only once no shard has one left, so a capture begun after that sees no such
/// recording.
pub(super) struct OutsideCapture<'a>(&'a AtomicUsize);

impl Drop for OutsideCapture<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[derive(Default)]
struct PoolState {
    pools: HashMap<PoolId, PrivatePool>,
    /// Allocation to pools underway, oldest first: the first whose filter accepts a stream wins.
    underway: Vec<(PoolId, Option<StreamFilter>)>,
    /// Pool of each private shard in use: shard index -> pool.
    owner: HashMap<u32, PoolId>,
    /// Private shards of pools that are gone, by stream, ready for reuse.
    retired: HashMap<Stream, Vec<u32>>,
    next_key: usize,
}

impl PoolState {
    /// Whether allocation to `pool` is underway (begun and not ended).
    fn is_underway(&self, pool: PoolId) -> bool {
        self.underway.iter().any(|(id, _)| *id == pool)
    }
}

#[derive(Default)]
struct PrivatePool {
    uses: usize,
    /// The pool's shard for each stream that allocated from it.
    shards: HashMap<Stream, u32>,
}

impl GraphPools {
    /// Whether the device needs the graph-aware path: a pool is active or a free is deferred.
    #[inline(always)]
    pub fn flags(&self) -> usize {
        self.flags.load(Relaxed)
    }

    /// Whether allocation to some pool is underway (the device is taken to be capturing), so
    /// that driver calls a capture forbids (freeing memory; querying, waiting for or recording
    /// events) must not be made now. Work for a shard asks it under that shard's lock, right
    /// before such calls and for all of them, however recently it looked:
    /// [`DeviceAllocator::begin_allocate_to_pool`] takes each shard's lock once the pool is
    /// active.
    #[inline]
    pub fn capturing(&self) -> bool {
        self.flags() & !DEFERRED != 0
    }

    /// Leave to record a free's events after unlocking its shard, counted in the shard's
    /// `recordings`, unless a pool is active. Counting the leave before looking at the pools,
    /// as a begin makes a pool active before looking at the counts (both sequentially
    /// consistent), means that either the begin waits for this leave or this sees the pool.
    fn outside_capture<'a>(&self, recordings: &'a AtomicUsize) -> Option<OutsideCapture<'a>> {
        recordings.fetch_add(1, SeqCst);
        let leave = OutsideCapture(recordings);
        (self.flags.load(SeqCst) & !DEFERRED == 0).then_some(leave)
    }

    /// Whether a use of `pool` remains.
    pub fn in_use(&self, pool: PoolId) -> bool {
        self.state
            .lock()
            .pools
            .get(&pool)
            .is_some_and(|p| p.uses > 0)
    }

    /// The pool that owns private shard `index`.
    pub(super) fn owner(&self, index: u32) -> Option<PoolId> {
        self.state.lock().owner.get(&index).copied()
    }

    /// Pools with no use left.
    fn unused(&self) -> HashSet<PoolId> {
        let st = self.state.lock();
        st.pools
            .iter()
            .filter(|(_, p)| p.uses == 0)
            .map(|(&id, _)| id)
            .collect()
    }
}

fn check_id(pool: PoolId) -> Result<()> {
    if pool == (0, 0) {
        return Err(Error::InvalidArgument(
            "pool id (0, 0) is not a pool (PyTorch's MempoolId_t {0, 0} means \"no pool\")".into(),
        ));
    }
    Ok(())
}

fn segments_of(shard: &Shard) -> i64 {
    shard.stats.cells[stats::aggregate(StatKind::Segment)]
        .current
        .load(Relaxed)
}

impl DeviceAllocator {
    /// Starts allocating to private pool `pool` for the streams `filter` accepts (every stream
    /// when `None`), creating the pool or adding a use to it. Several pools may be active at
    /// once; a stream goes to the first begun pool whose filter accepts it. The filter is
    /// called under the pool lock on allocations while the pool is active: it must be cheap
    /// and must not call into the allocator.
    ///
    /// Returns once no other thread is still returning memory to the driver or touching events
    /// for the allocator, so that a capture begun after this returns sees no such call: that
    /// work checks for an active pool under the lock of the shard it serves
    /// ([`GraphPools::capturing`]), which this takes once each after the pool is
    /// active, or holds a leave ([`OutsideCapture`]) for what it does after unlocking.
    pub fn begin_allocate_to_pool(&self, pool: PoolId, filter: Option<StreamFilter>) -> Result<()> {
        check_id(pool)?;
        {
            let mut st = self.graph.state.lock();
            st.pools.entry(pool).or_default().uses += 1;
            st.underway.push((pool, filter));
            self.graph.flags.fetch_add(1, SeqCst);
        }
        // Work that a capture forbids and that began before the pool became active: under a
        // shard's lock (taken once here; later holders see the pool), or recording events
        // after it (a leave). No other lock is held while waiting.
        for shard in self.shards.iter() {
            drop(shard.inner.lock_memo());
            while shard.recordings.load(SeqCst) != 0 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Stops allocating to `pool` (the oldest begin of it that has not ended). When no pool
    /// remains active, frees deferred during the capture record their events. The pool keeps
    /// its memory and its use until [`DeviceAllocator::release_pool`].
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<()> {
        check_id(pool)?;
        let now_idle = {
            let mut st = self.graph.state.lock();
            let at = st
                .underway
                .iter()
                .position(|(id, _)| *id == pool)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "end_allocate_to_pool: no allocation to pool ({}, {}) is underway on device {}",
                        pool.0, pool.1, self.device
                    ))
                })?;
            st.underway.remove(at);
            self.graph.flags.fetch_sub(1, Relaxed);
            st.underway.is_empty()
        };
        if now_idle {
            self.flush_deferred()?;
        }
        Ok(())
    }

    /// Drops one use of `pool`. When no use remains, its cached segments go back to the driver
    /// (now if no capture is underway and nothing in them is allocated, else as soon as that
    /// holds), and the pool disappears once it holds no memory.
    pub fn release_pool(&self, pool: PoolId) -> Result<()> {
        check_id(pool)?;
        {
            let mut st = self.graph.state.lock();
            let p = st
                .pools
                .get_mut(&pool)
                .filter(|p| p.uses > 0)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "release_pool: pool ({}, {}) has no use to release on device {}",
                        pool.0, pool.1, self.device
                    ))
                })?;
            p.uses -= 1;
            if p.uses > 0 {
                return Ok(());
            }
        }
        self.release_unused_pools()
    }

    /// The shard an allocation on `stream` comes from while pools are active, with its pool:
    /// the private shard of the first active pool that accepts `stream`, else the stream's
    /// own (and no pool). The pool may be released and its shard retired before the caller
    /// locks the shard: [`DeviceAllocator::moved`] tells.
    pub(super) fn shard_for_pools(&self, stream: Stream) -> Result<(&Shard, Option<PoolId>)> {
        let mut st = self.graph.state.lock();
        let chosen = st
            .underway
            .iter()
            .find(|(_, filter)| filter.as_ref().is_none_or(|f| f(stream)))
            .map(|(id, _)| *id);
        let Some(pool) = chosen else {
            drop(st);
            return Ok((self.shard(stream)?, None));
        };
        if let Some(&index) = st.pools.get(&pool).and_then(|p| p.shards.get(&stream)) {
            if let Some(shard) = self.shards.by_index(index) {
                return Ok((shard, Some(pool)));
            }
        }
        let reused = st.retired.get_mut(&stream).and_then(Vec::pop);
        let shard = match reused.and_then(|i| self.shards.by_index(i)) {
            Some(shard) => shard,
            None => {
                let key = PRIVATE_KEY_BASE - st.next_key;
                st.next_key += 1;
                // A stream's shard never becomes a private one.
                self.shards.get_or_insert(
                    key,
                    |index| Shard {
                        stream: AtomicUsize::new(stream),
                        index,
                        private: true,
                        recordings: AtomicUsize::new(0),
                        inner: super::shard::ShardLock::default(),
                        stats: ShardStats::new(&self.counters),
                    },
                    |_| None,
                    |_| None,
                )?
            }
        };
        st.owner.insert(shard.index, pool);
        // An active pool exists (begun, and not forgotten while active), so its shard is
        // found again by the release of the pool.
        let p = st.pools.entry(pool).or_default();
        p.shards.insert(stream, shard.index);
        Ok((shard, Some(pool)))
    }

    /// Whether `shard`, chosen for an allocation on `stream` from `pool` and now locked by the
    /// caller, serves something else: another stream (a stream's shard taken over, [`table`])
    /// or no longer that pool (a private shard retired once its pool was released).
    ///
    /// [`table`]: super::table
    #[inline(always)]
    pub(super) fn moved(&self, shard: &Shard, stream: Stream, pool: Option<PoolId>) -> bool {
        shard.stream() != stream || pool.is_some_and(|pool| self.left_pool(shard, pool))
    }

    /// Whether private shard `shard` no longer belongs to `pool` ([`DeviceAllocator::moved`]).
    #[cold]
    #[inline(never)]
    fn left_pool(&self, shard: &Shard, pool: PoolId) -> bool {
        self.graph.owner(shard.index) != Some(pool)
    }

    /// Leave to record a free's events for `shard` after unlocking it, while no pool is active
    /// ([`OutsideCapture`]).
    #[inline]
    pub(super) fn outside_capture<'a>(&self, shard: &'a Shard) -> Option<OutsideCapture<'a>> {
        self.graph.outside_capture(&shard.recordings)
    }

    /// Whether nothing may touch events or free memory now on behalf of `stream`: a pool is
    /// active, or the driver says `stream` is capturing.
    pub(super) fn capture_blocks(&self, stream: Stream) -> bool {
        self.graph.capturing() || self.driver_capturing(stream)
    }

    /// Whether the driver says `stream` is being captured (a driver that cannot tell says no).
    pub(super) fn driver_capturing(&self, stream: Stream) -> bool {
        self.driver.stream_capturing(stream).unwrap_or(false)
    }

    /// Whether the events of a free with `uses` must wait for a capture to end.
    pub(super) fn must_defer(&self, uses: &[Stream]) -> bool {
        self.graph.capturing() || uses.iter().any(|&s| self.driver_capturing(s))
    }

    /// Keeps block `id` of `shard` (freed, its stream uses still on it) until no capture
    /// forbids recording its events.
    pub(super) fn defer_free(&self, shard: &Shard, id: u32) {
        self.graph.deferred.lock().push((shard.index, id));
        self.graph.flags.fetch_or(DEFERRED, Relaxed);
    }

    /// Records the events of deferred frees whose streams no longer capture (nothing while a
    /// pool is active).
    pub(super) fn flush_deferred(&self) -> Result<()> {
        if self.graph.flags() & DEFERRED == 0 || self.graph.capturing() {
            return Ok(());
        }
        let waiting = {
            let mut d = self.graph.deferred.lock();
            self.graph.flags.fetch_and(!DEFERRED, Relaxed);
            std::mem::take(&mut *d)
        };
        let mut first_error = None;
        for (index, id) in waiting {
            let Some(shard) = self.shards.by_index(index) else {
                continue;
            };
            let inner = shard.inner.lock();
            if self.must_defer(&inner.block(id).stream_uses) {
                drop(inner);
                self.defer_free(shard, id);
                continue;
            }
            if let Err(e) = self.record_free_events(shard, inner, id) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Whether the segments of private shard `shard` should go back to the driver as soon as
    /// they are free: its pool has no use left and no capture is underway.
    pub(super) fn private_shard_unused(&self, shard: &Shard) -> bool {
        shard.private
            && !self.graph.capturing()
            && self
                .graph
                .owner(shard.index)
                .is_none_or(|pool| !self.graph.in_use(pool))
    }

    /// After a free in a private shard whose pool is unused and while no capture forbids it
    /// ([`DeviceAllocator::private_shard_unused`], asked under the same hold of the shard's
    /// lock): returns the shard's free segments and retires the pool once it is empty.
    pub(super) fn trim_private_shard(&self, shard: &Shard, inner: &mut ShardInner) {
        if let Err(e) = self.release_segments(shard, inner, usize::MAX) {
            eprintln!(
                "tensoralloc: device {}: could not return a released pool's segment ({e})",
                self.device
            );
        }
        if segments_of(shard) == 0 {
            self.retire_if_empty(shard);
        }
    }

    /// Returns the cached segments of every pool without uses to the driver and forgets the
    /// pools left empty. Does nothing while a capture is underway.
    pub(super) fn release_unused_pools(&self) -> Result<()> {
        if self.graph.capturing() {
            return Ok(());
        }
        let unused = self.graph.unused();
        if unused.is_empty() {
            return Ok(());
        }
        let shards: Vec<u32> = {
            let st = self.graph.state.lock();
            unused
                .iter()
                .filter_map(|id| st.pools.get(id))
                .flat_map(|p| p.shards.values().copied())
                .collect()
        };
        for index in shards {
            let Some(shard) = self.shards.by_index(index) else {
                continue;
            };
            let mut inner = shard.inner.lock();
            self.release_shard(shard, &mut inner)?;
            if segments_of(shard) == 0 {
                self.retire_if_empty(shard);
            }
        }
        // Pools that never allocated have no shard to retire.
        let mut st = self.graph.state.lock();
        let gone: Vec<PoolId> = st
            .pools
            .iter()
            .filter(|(&id, p)| p.uses == 0 && p.shards.is_empty() && !st.is_underway(id))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            st.pools.remove(&id);
        }
        Ok(())
    }

    /// Retires private shard `shard` (whose lock the caller holds, so no allocation goes on in
    /// it meanwhile) if it holds no segment; forgets its pool when the pool has no use and no
    /// shard left. An allocation that chose the shard before and locks it after sees that it
    /// moved ([`DeviceAllocator::moved`]), so a retired shard never holds memory.
    fn retire_if_empty(&self, shard: &Shard) {
        let index = shard.index;
        let mut st = self.graph.state.lock();
        let Some(pool) = st.owner.get(&index).copied() else {
            return;
        };
        // A pool being allocated to keeps its shards even without uses (released before its
        // end), so that it exists for as long as an allocation can choose it.
        if st.is_underway(pool)
            || st.pools.get(&pool).is_none_or(|p| p.uses > 0)
            || segments_of(shard) != 0
        {
            return;
        }
        st.owner.remove(&index);
        st.retired.entry(shard.stream()).or_default().push(index);
        let gone = st.pools.get_mut(&pool).is_some_and(|p| {
            p.shards.retain(|_, &mut i| i != index);
            p.shards.is_empty()
        });
        if gone {
            st.pools.remove(&pool);
        }
    }

    /// Number of live pools of this device (created and not yet gone), for tests.
    pub fn pool_count(&self) -> usize {
        self.graph.state.lock().pools.len()
    }
}

//! The seam where policies differ: which kind of segment a device grows with, and whether a
//! stream about to grow may take idle memory from other streams.
//!
//! - PyTorch's rules (`policy:pytorch`, the default) with ordinary segments: one driver
//!   allocation per segment, byte-exact with PyTorch's CUDACachingAllocator.
//! - PyTorch's rules with `expandable_segments:True`: one reserved range per stream and pool,
//!   2 MiB pages for the small pool and 20 MiB pages for the large one, each growth mapped as
//!   one physical allocation; free pages go back at `empty_cache` and on the out-of-memory
//!   retry.
//! - `policy:compact`: expandable segments with pages of the driver's granularity (one
//!   physical allocation per page, so that any free page can be given back). A stream about
//!   to grow first borrows an idle free block of another stream that fits ([`lend`], marked
//!   as used by the borrower so that it returns to its owner only after the borrower's work);
//!   failing that, a growth past the most the device has reserved first unmaps idle free
//!   pages of every stream so that it reuses their memory instead of adding to it: their
//!   physical allocations are kept and mapped again into the growing range (no
//!   `cuMemRelease` and `cuMemCreate` in between), and any the growth does not need are
//!   released. Memory is idle when an event recorded on its stream after it was freed has
//!   completed; the event is recorded lazily, once per batch of frees, when some stream is
//!   about to grow, and only queried (never waited for).
//!
//! [`lend`]: DeviceAllocator::lend

use super::expandable::{Layout, Reclaim, Report};
use super::history::Action;
use super::limit::LimitClaim;
use super::shard::{ShardInner, StatSink, State, NONE};
use super::size::{PoolKind, SMALL_BUFFER};
use super::stats::{self, ShardStats, StatKind};
use super::{DeviceAllocator, Shard};
use crate::config::{Config, Policy};
use crate::driver::{Driver, PhysHandle, Stream};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering::Relaxed;

/// The expandable layout `config` asks for on `device`, or `None` for ordinary segments
/// (also when the driver cannot map memory: then a one-line notice says so).
pub(super) fn layout(driver: &dyn Driver, device: usize, config: &Config) -> Option<Layout> {
    let compact = config.policy == Policy::Compact;
    if !config.expandable_segments && !compact {
        return None;
    }
    let granularity = match driver.vmm_granularity(device) {
        Ok(g) => g,
        Err(e) => {
            eprintln!(
                "tensoralloc: device {device}: expandable segments need virtual memory management, which the {} driver lacks ({}); using ordinary segments",
                driver.name(),
                e.message()
            );
            return None;
        }
    };
    let total = driver.mem_info(device).map(|i| i.total).unwrap_or(0) as usize;
    let page = |want: usize| want.max(granularity).next_multiple_of(granularity);
    let pages = if compact {
        [granularity, granularity]
    } else {
        [page(SMALL_BUFFER), page(config.large_segment_size)]
    };
    // Room for 1 1/8 of the device, as PyTorch reserves: pages unmapped early in a range can
    // be mapped again at its end.
    let room = total.saturating_add(total / 8).max(1);
    Some(Layout {
        page: pages,
        reserve: pages.map(|p| room.next_multiple_of(p)),
        max_handle_pages: if compact { 1 } else { usize::MAX },
        prefer_settled: !compact,
    })
}

/// Streams with less free mapped memory than this are not asked for any.
const MIN_RECLAIM: i64 = 2 << 20;

impl DeviceAllocator {
    /// Bytes of `shard` that are mapped but hold no active block.
    pub(super) fn free_mapped(&self, shard: &Shard) -> i64 {
        let cell = |kind| {
            shard.stats.cells[stats::aggregate(kind)]
                .current
                .load(Relaxed)
        };
        cell(StatKind::ReservedBytes) - cell(StatKind::ActiveBytes)
    }

    /// Maps memory into `shard`'s expandable segment of `pool` for `rounded` bytes.
    pub(super) fn grow(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        layout: &Layout,
        pool: PoolKind,
        rounded: usize,
    ) -> Result<u32> {
        let compact = self.policy == Policy::Compact;
        // Reclaiming costs a walk of free blocks and driver calls, and keeps nothing the peak
        // needs while the device stays under its most reserved: only a growth past that
        // takes idle pages first, or one that fails without them.
        let reclaim = compact && !self.under_high(rounded);
        let grown = self.grow_once(shard, inner, layout, pool, rounded, reclaim);
        let grown = match grown {
            Err(Error::OutOfMemory(_)) if compact && !reclaim => {
                self.grow_once(shard, inner, layout, pool, rounded, true)
            }
            other => other,
        };
        if compact && grown.is_ok() {
            let reserved = self.total_current(stats::aggregate(StatKind::ReservedBytes));
            self.reserved_high.fetch_max(reserved, Relaxed);
        }
        grown
    }

    /// Whether mapping `need` more bytes keeps the device within the most it has reserved.
    /// (A growth past the memory limit never gets here: `check_limit` refuses it first.)
    fn under_high(&self, need: usize) -> bool {
        let after = self
            .total_current(stats::aggregate(StatKind::ReservedBytes))
            .saturating_add(need as i64);
        after <= self.reserved_high.load(Relaxed)
    }

    /// One try of [`Self::grow`], taking idle pages of every stream first when `reclaim`.
    fn grow_once(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        layout: &Layout,
        pool: PoolKind,
        rounded: usize,
        reclaim: bool,
    ) -> Result<u32> {
        let mut report = Report::new(self.history().on());
        report.spare = std::mem::take(&mut inner.exp.spare);
        // Pages unmapped to be mapped again are claimed under the memory limit until the end
        // of this growth, after what it did not map has gone back to the driver.
        let mut kept = self.no_claim();
        let start = if reclaim {
            self.reclaim_idle(shard, inner, rounded, pool, &mut report.spare, &mut kept)
        } else {
            None
        };
        // A growth changes several statistics, each of which may pass its limit (reserved
        // bytes above all when they come from other streams' pages): they are only marked
        // here, and settled once with the allocation the growth is for (exact: a marked
        // statistic keeps its highest value until settled), or below if the growth fails.
        let grown = inner.grow(
            &*self.driver,
            self.device,
            layout,
            pool,
            rounded,
            start,
            &mut MarkOnly(&shard.stats),
            &mut report,
        );
        if let Some((base, size)) = report.reserved {
            self.segments.write().insert(base, (size, shard.index));
        }
        self.count(shard, &report);
        // Kept allocations the growth did not need go back to the driver, newest first.
        for (_, handle) in report.spare.drain(..).rev() {
            if let Err(e) = self.driver.vmm_release(self.device, handle) {
                eprintln!(
                    "tensoralloc: device {}: could not release an unmapped page ({e})",
                    self.device
                );
            }
        }
        inner.exp.spare = report.spare;
        drop(kept);
        if grown.is_err() {
            self.settle_marked(shard);
        }
        grown
    }

    /// Before `shard`'s stream grows for `size` bytes (`rounded` in `pool`): allocates the
    /// best-fitting idle free block of the other streams instead, marked as used by `stream`
    /// (as `record_stream` would), so that when it is freed it returns to its own stream's
    /// pool only after the work queued on `stream` completes. Never waits: a busy shard is
    /// skipped. The caller holds no shard lock. Returns the address.
    pub(super) fn lend(
        &self,
        shard: &Shard,
        pool: PoolKind,
        rounded: usize,
        size: usize,
        stream: Stream,
    ) -> Option<usize> {
        if self.graph.capturing() {
            return None;
        }
        // The best fit over all streams: each looked at under its own lock alone (completing
        // its events may settle statistics, which locks shards), then the best taken.
        let mut best: Option<(usize, &Shard)> = None;
        for other in self.shards.iter() {
            // Read without the other shard's lock: a stale look only skips a shard or locks
            // one for nothing.
            if other.index == shard.index
                || other.private
                || self.free_mapped(other) < rounded as i64
            {
                continue;
            }
            let Some(mut inner) = other.inner.try_lock() else {
                continue;
            };
            if !self.tracks_idle(other, &inner) {
                continue;
            }
            if !inner.pending.is_empty() {
                self.process_events(other, &mut inner);
            }
            self.refresh_idle(other, &mut inner);
            if let Some((size, _)) =
                inner.idle_fit(pool, rounded, self.max_split_size, self.non_split_rounding)
            {
                if best.is_none_or(|(b, _)| size < b) {
                    best = Some((size, other));
                }
                if size == rounded {
                    break;
                }
            }
        }
        let other = best?.1;
        let mut inner = other.inner.try_lock()?;
        let (_, id) =
            inner.idle_fit(pool, rounded, self.max_split_size, self.non_split_rounding)?;
        inner.remove_free(id);
        let addr = inner.allocate(
            id,
            rounded,
            size,
            self.max_split_size,
            false,
            &mut self.op_sink(other),
        );
        inner.block_mut(id).stream_uses.push(stream);
        // Recorded under the lender's lock, with the block's stream, as its free will be.
        self.note(Action::Alloc, addr, size, other.stream());
        Some(addr)
    }

    /// Settles the overdrafts that shards only marked, under `shard`'s lock.
    fn settle_marked(&self, shard: &Shard) {
        if self.shards.iter().any(|s| s.stats.is_over()) {
            self.settle_peaks(shard);
        }
    }

    /// Counts what `report` mapped and unmapped for `shard`, and records it in the memory
    /// history (PyTorch's `segment_map` and `segment_unmap`).
    fn count(&self, shard: &Shard, report: &Report) {
        self.counters
            .num_device_alloc
            .fetch_add(report.maps as i64, Relaxed);
        self.counters
            .num_device_free
            .fetch_add(report.unmaps as i64, Relaxed);
        if self.history().on() {
            for &(mapped, addr, bytes) in &report.ranges {
                let action = if mapped {
                    Action::SegmentMap
                } else {
                    Action::SegmentUnmap
                };
                self.note(action, addr, bytes, shard.stream());
            }
        }
    }

    /// Unmaps free pages of `shard` (its events were waited for), smallest free block first,
    /// until `goal` bytes are unmapped, and returns ranges with nothing mapped. Returns the
    /// bytes unmapped.
    pub(super) fn release_expandable(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        goal: usize,
    ) -> Result<usize> {
        if inner.exp.segments.is_empty() || self.graph.capturing() {
            return Ok(0);
        }
        if self.free_mapped(shard) > 0 {
            self.wait_for_stream(shard)?;
        }
        let mut report = Report::new(self.history().on());
        let unmapped = inner.unmap_free(
            &*self.driver,
            self.device,
            Reclaim::All,
            goal,
            &mut self.sink(shard),
            &mut report,
        );
        self.count(shard, &report);
        unmapped?;
        inner.free_empty_ranges(|base, size| {
            self.unlisted_while(base, size, shard, || {
                self.driver.vmm_free_range(self.device, base, size)
            })
        })?;
        Ok(report.bytes)
    }

    /// Waits for the work queued on `shard`'s stream: unlike freeing a segment, unmapping
    /// memory does not wait for the kernels that may still use it.
    fn wait_for_stream(&self, shard: &Shard) -> Result<()> {
        let event = self.events.get(&self.driver)?;
        let waited = self
            .driver
            .event_record(self.device, event, shard.stream())
            .and_then(|()| self.driver.event_synchronize(self.device, event));
        self.events.put(event);
        waited
    }

    /// Before `shard` grows by `need` bytes of `pool`: unmaps idle free pages of this and
    /// other streams, up to `need` bytes, sparing the free block the growth will extend, and
    /// keeps their physical allocations in `spare` for the growth to map. Never waits:
    /// another stream whose lock is busy, or whose batch event has not completed, is skipped.
    /// Returns where `shard` grows ([`ShardInner::find_space`]) when nothing of it was
    /// unmapped, so that the growth need not look again.
    fn reclaim_idle(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        need: usize,
        pool: PoolKind,
        spare: &mut Vec<(usize, PhysHandle)>,
        kept: &mut LimitClaim,
    ) -> Option<u32> {
        if self.graph.capturing() {
            // No event may be recorded or queried while a graph is captured.
            return None;
        }
        let start = inner.find_space(pool, need);
        let keep = start
            .filter(|&id| inner.block(id).state == State::Free)
            .unwrap_or(NONE);
        let mut got = self.reclaim_from(shard, inner, need, keep, spare, kept);
        // Other shards' pages leave this shard's blocks as they are.
        let start = start.filter(|_| got == 0);
        for other in self.shards.iter() {
            if got >= need {
                break;
            }
            // Read without the other shard's lock: a stale look only skips a shard or
            // locks one for nothing (checked again under its lock).
            if other.index == shard.index || self.free_mapped(other) < MIN_RECLAIM {
                continue;
            }
            if let Some(mut o) = other.inner.try_lock() {
                got += self.reclaim_from(other, &mut o, need - got, NONE, spare, kept);
            }
        }
        // Overdrafts are settled by the caller, after the growth.
        start
    }

    /// Unmaps idle free pages of `shard` (but block `keep`), up to `goal` bytes, keeping
    /// their physical allocations in `spare` and their bytes in `kept`. Returns the bytes
    /// unmapped.
    fn reclaim_from(
        &self,
        shard: &Shard,
        inner: &mut ShardInner,
        goal: usize,
        keep: u32,
        spare: &mut Vec<(usize, PhysHandle)>,
        kept: &mut LimitClaim,
    ) -> usize {
        if self.free_mapped(shard) < MIN_RECLAIM || !self.tracks_idle(shard, inner) {
            return 0;
        }
        self.refresh_idle(shard, inner);
        // The last idle reclaim left nothing idle to unmap, and nothing became idle since.
        if inner.exp.idle_reclaimed {
            return 0;
        }
        // Settling peaks now would lock every shard, the growing one included when this is
        // another stream's: overdrafts are only marked, and settled after the growth.
        let mut marks = Keeping {
            marks: MarkOnly(&shard.stats),
            kept,
        };
        let mut report = Report::new(self.history().on());
        report.keep = true;
        report.spare = std::mem::take(spare);
        let unmapped = inner.unmap_free(
            &*self.driver,
            self.device,
            Reclaim::Idle { keep },
            goal,
            &mut marks,
            &mut report,
        );
        // What was unmapped before an error stays unmapped: count it either way.
        self.count(shard, &report);
        *spare = std::mem::take(&mut report.spare);
        if let Err(e) = unmapped {
            eprintln!(
                "tensoralloc: device {}: could not unmap idle pages ({e}); keeping them",
                self.device
            );
        }
        report.bytes
    }

    /// Whether idle memory of `shard` may be looked for: it has expandable segments, and its
    /// stream is not being captured (no event may be recorded on it then).
    fn tracks_idle(&self, shard: &Shard, inner: &ShardInner) -> bool {
        !inner.exp.segments.is_empty() && !self.driver_capturing(shard.stream())
    }

    /// Advances what is known idle on `shard`'s stream: collects its batch event if it has
    /// completed, and records one for the frees since, if there are any.
    fn refresh_idle(&self, shard: &Shard, inner: &mut ShardInner) {
        if self.graph.capturing() {
            return;
        }
        let exp = &mut inner.exp;
        if let Some((event, upto)) = exp.batch {
            match self.driver.event_query(self.device, event) {
                Ok(false) => return,
                Ok(true) => {
                    exp.idle_reclaimed &= upto <= exp.idle_upto;
                    exp.idle_upto = exp.idle_upto.max(upto);
                }
                Err(_) => {}
            }
            exp.batch = None;
            self.events.put(event);
        }
        if exp.frees <= exp.idle_upto {
            return;
        }
        let Ok(event) = self.events.get(&self.driver) else {
            return;
        };
        if self
            .driver
            .event_record(self.device, event, shard.stream())
            .is_err()
        {
            self.events.put(event);
            return;
        }
        let upto = exp.frees;
        // On an idle stream the event has completed already.
        if matches!(self.driver.event_query(self.device, event), Ok(true)) {
            exp.idle_reclaimed = false;
            exp.idle_upto = upto;
            self.events.put(event);
        } else {
            exp.batch = Some((event, upto));
        }
    }
}

/// Records statistic changes of a shard without settling peaks: a statistic that passes its
/// limit stays marked on the shard until the next settle.
struct MarkOnly<'a>(&'a ShardStats);

impl StatSink for MarkOnly<'_> {
    fn change(&mut self, index: usize, delta: i64) {
        self.0.change(index, delta);
    }
}

/// [`MarkOnly`] for unmapping pages whose physical allocations are kept: the reserved bytes
/// they stop counting for are claimed under the memory limit first ([`LimitClaim::add`]).
struct Keeping<'a, 'l> {
    marks: MarkOnly<'a>,
    kept: &'a mut LimitClaim<'l>,
}

impl StatSink for Keeping<'_, '_> {
    fn change(&mut self, index: usize, delta: i64) {
        if index == stats::aggregate(StatKind::ReservedBytes) && delta < 0 {
            self.kept.add(delta.unsigned_abs());
        }
        self.marks.change(index, delta);
    }
}

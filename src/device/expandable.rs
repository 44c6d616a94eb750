//! Expandable segments: one reserved virtual range per stream and pool, grown by mapping
//! physical memory at the lowest address where a request fits, shrunk by unmapping pages that
//! hold no live block.
//!
//! Inside a range, blocks tile the address space as in an ordinary segment; address space with
//! nothing mapped behind it is a block in [`State::Unmapped`], never in a free index. A free
//! block always has memory mapped behind every byte. Memory is mapped in runs of whole pages
//! (2 MiB for the small pool, 20 MiB for the large pool under PyTorch's rules; the driver's
//! granularity under `policy:compact`), each run one physical allocation of at most
//! `max_handle_pages` pages; a run is unmapped only when no live block touches it.
//!
//! Mapped bytes count as reserved bytes; each growth counts one device allocation and each
//! unmapped free block one device free (`num_device_alloc` / `num_device_free` count
//! `cuMemMap` and `cuMemUnmap` calls as PyTorch's do). A range counts as a segment while
//! anything is mapped in it.

use super::shard::{Block, ShardInner, StatSink, State, NONE};
use super::size::{block_fits, PoolKind};
use super::stats::StatKind;
use crate::driver::{Driver, Event, PhysHandle};
use crate::error::{Error, Result};

/// How expandable segments are laid out on a device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Page size of the small and the large pool.
    pub page: [usize; 2],
    /// Bytes of address space reserved per range.
    pub reserve: [usize; 2],
    /// Largest physical allocation, in pages.
    pub max_handle_pages: usize,
    /// Whether best fit passes over blocks that could grow (PyTorch's rule).
    pub prefer_settled: bool,
}

impl Layout {
    fn pool_index(pool: PoolKind) -> usize {
        match pool {
            PoolKind::Small => 0,
            PoolKind::Large => 1,
        }
    }
}

/// One reserved range.
pub(crate) struct ExpSegment {
    pub base: usize,
    pub size: usize,
    pub page: usize,
    pub pool: PoolKind,
    /// Physical allocations mapped in the range, by page from `base`: the first page of each
    /// holds its bytes and handle (a slot per page, so that mapping and unmapping a page
    /// costs no search).
    pub handles: Vec<Option<(usize, PhysHandle)>>,
    /// Bytes mapped.
    pub mapped: usize,
    /// False once the range went back to the driver.
    pub live: bool,
}

/// The expandable segments of one shard.
#[derive(Default)]
pub(crate) struct ExpState {
    pub segments: Vec<ExpSegment>,
    /// Unmapped blocks of the small and the large pool, by address.
    unmapped: [Unmapped; 2],
    /// Frees so far (each returned block takes the next count as its `freed_at`).
    pub frees: u64,
    /// Blocks freed at or before this count are idle on the GPU.
    pub idle_upto: u64,
    /// The event recorded for the latest batch of frees, and the count it covers.
    pub batch: Option<(Event, u64)>,
    /// Whether no free block known idle holds a whole page, but maybe the one an idle reclaim
    /// spared: set when an idle reclaim went through every free block, cleared by a growth
    /// (which maps idle pages) and when more frees become idle. Blocks freed since are not
    /// idle, and allocating from a block leaves a part of it, so another idle reclaim would
    /// find nothing until then.
    pub idle_reclaimed: bool,
    /// [`Layout::prefer_settled`], once the shard has a range.
    pub prefer_settled: bool,
    /// Reused buffers for the handles of one mapping and the mappings of one unmapping, so
    /// that growing and unmapping allocate nothing once warm.
    made: Vec<PhysHandle>,
    unmaps: Vec<(usize, usize, PhysHandle)>,
    /// Reused buffer of [`Report::spare`].
    pub spare: Vec<(usize, PhysHandle)>,
}

/// A pool's unmapped blocks as (address, block), sorted by address. A shard has a few dozen
/// at most (the holes and ends of its ranges), and [`ShardInner::find_space`] walks them on
/// every growth: a sorted vector walks and updates faster than a B-tree at that size.
#[derive(Default)]
struct Unmapped(Vec<(usize, u32)>);

impl Unmapped {
    fn insert(&mut self, addr: usize, id: u32) {
        let at = self.0.partition_point(|&(a, _)| a < addr);
        self.0.insert(at, (addr, id));
    }

    fn remove(&mut self, addr: &usize) -> Option<u32> {
        let at = self.0.binary_search_by_key(addr, |&(a, _)| a).ok()?;
        Some(self.0.remove(at).1)
    }

    fn values(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().map(|&(_, id)| id)
    }
}

/// What a change of mappings did, for the device counters and the memory history.
#[derive(Debug, Default, Clone)]
pub(crate) struct Report {
    pub maps: u64,
    pub unmaps: u64,
    pub bytes: usize,
    /// Ranges reserved (address, size) or returned.
    pub reserved: Option<(usize, usize)>,
    /// Each range mapped or unmapped, in order: (whether mapped, address, bytes); only
    /// when `record` is set (for the memory history).
    pub ranges: Vec<(bool, usize, usize)>,
    pub record: bool,
    /// Whether unmapping keeps the physical allocations, in `spare`, rather than releasing
    /// them.
    pub keep: bool,
    /// Physical allocations unmapped and kept, as (bytes, handle): a growth maps these before
    /// creating any; the caller releases what is left.
    pub spare: Vec<(usize, PhysHandle)>,
}

impl Report {
    /// An empty report that lists ranges when `record` is set.
    pub fn new(record: bool) -> Report {
        Report {
            record,
            ..Report::default()
        }
    }

    fn range(&mut self, mapped: bool, addr: usize, bytes: usize) {
        if mapped {
            self.maps += 1;
        } else {
            self.unmaps += 1;
        }
        self.bytes += bytes;
        if self.record {
            self.ranges.push((mapped, addr, bytes));
        }
    }
}

/// Where unmapping may take memory from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reclaim {
    /// Every free block (after the shard's outstanding events were waited for).
    All,
    /// Free blocks whose frees are known idle, except block `keep` (where the shard is about
    /// to grow; [`NONE`] for none).
    Idle { keep: u32 },
}

/// How many free blocks a lending shard looks at, best fit first, for one whose free is idle.
const LEND_CANDIDATES: usize = 32;

/// What a growth still needing `left` bytes maps of an unmapped block of `size` bytes in
/// pages of `page` bytes: what it needs in whole pages, at most the block
/// ([`ShardInner::grow`], and [`ShardInner::bytes_to_map`] which counts it ahead).
fn to_map(left: usize, page: usize, size: usize) -> usize {
    left.next_multiple_of(page).min(size)
}

impl ShardInner {
    /// The best-fitting free block of `pool` for `rounded` bytes, at most twice as large,
    /// whose memory is idle (an event recorded on this shard's stream after its free has
    /// completed), with its size: a block another stream may use (`policy:compact`). It stays
    /// in its free index. Looks at a few candidates only.
    pub fn idle_fit(
        &self,
        pool: PoolKind,
        rounded: usize,
        max_split_size: usize,
        non_split_rounding: usize,
    ) -> Option<(usize, u32)> {
        let upto = self.exp.idle_upto;
        let index = self.free_index(pool);
        let mut from = (rounded, 0, 0);
        for _ in 0..LEND_CANDIDATES {
            let (size, addr, id) = index.first_at_least(from)?;
            // Larger blocks break the oversize rules too once one does; a block more than
            // twice the request stays whole for its own stream (lending it would leave a
            // large remainder of one stream split off for another).
            if !block_fits(size, rounded, max_split_size, non_split_rounding)
                || size > rounded.saturating_mul(2)
            {
                return None;
            }
            if self.blocks[id as usize].freed_at <= upto {
                return Some((size, id));
            }
            from = (size, addr + 1, 0);
        }
        None
    }

    fn unmapped_index(&mut self, pool: PoolKind) -> &mut Unmapped {
        &mut self.exp.unmapped[Layout::pool_index(pool)]
    }

    /// The block's size plus the address space it could grow into.
    fn expandable_size(&self, id: u32) -> usize {
        let b = &self.blocks[id as usize];
        match b.next {
            n if n != NONE && self.blocks[n as usize].state == State::Unmapped => {
                b.size + self.blocks[n as usize].size
            }
            _ => b.size,
        }
    }

    /// PyTorch's best fit among expandable blocks: a block that could grow counts as large
    /// as it could grow, so blocks that cannot are used first.
    pub(super) fn prefer_settled(&self, pool: PoolKind, size: usize, id: u32) -> (usize, u32) {
        let index = self.free_index(pool);
        let (mut size, mut id) = (size, id);
        let mut key = (size, self.blocks[id as usize].addr, id);
        while let Some(next) = index.first_at_least((key.0, key.1, key.2 + 1)) {
            if self.blocks[id as usize].exp == NONE
                || self.expandable_size(next.2) >= self.expandable_size(id)
            {
                break;
            }
            key = next;
            (size, id) = (next.0, next.2);
        }
        (size, id)
    }

    /// Splits `[addr, addr + size)` off the front of block `id` as a new block in `state`,
    /// placed before it. Returns the new block.
    fn split_front(&mut self, id: u32, size: usize, state: State) -> u32 {
        let (addr, prev, pool, exp, freed_at) = {
            let b = &self.blocks[id as usize];
            (b.addr, b.prev, b.pool, b.exp, b.freed_at)
        };
        let front = self.new_block(Block {
            addr,
            size,
            requested: 0,
            prev,
            next: id,
            state,
            pool,
            events_left: 0,
            stream_uses: Vec::new(),
            exp,
            freed_at,
        });
        if prev != NONE {
            self.blocks[prev as usize].next = front;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = front;
        b.addr += size;
        b.size -= size;
        front
    }

    /// Merges block `b` into its predecessor `a` (both in the same state, out of any index).
    fn absorb_next(&mut self, a: u32, b: u32) {
        let (bsize, bnext) = {
            let x = &self.blocks[b as usize];
            (x.size, x.next)
        };
        let freed_at = self.blocks[b as usize]
            .freed_at
            .max(self.blocks[a as usize].freed_at);
        let x = &mut self.blocks[a as usize];
        x.size += bsize;
        x.next = bnext;
        x.freed_at = freed_at;
        if bnext != NONE {
            self.blocks[bnext as usize].prev = a;
        }
        self.drop_block(b);
    }

    /// The lowest-addressed run of free and unmapped blocks of `pool` that holds `size` bytes
    /// and contains unmapped space; returns its first block.
    pub(super) fn find_space(&self, pool: PoolKind, size: usize) -> Option<u32> {
        let allocatable = |id: u32| {
            id != NONE
                && matches!(
                    self.blocks[id as usize].state,
                    State::Free | State::Unmapped
                )
        };
        for u in self.exp.unmapped[Layout::pool_index(pool)].values() {
            let prev = self.blocks[u as usize].prev;
            let start = if prev != NONE && self.blocks[prev as usize].state == State::Free {
                prev
            } else {
                u
            };
            let (mut bytes, mut b) = (0, start);
            while bytes < size && allocatable(b) {
                bytes += self.blocks[b as usize].size;
                b = self.blocks[b as usize].next;
            }
            if bytes >= size {
                return Some(start);
            }
        }
        None
    }

    /// Bytes a growth for `rounded` bytes of `pool` maps ([`ShardInner::grow`] where it does
    /// not take idle pages first): the unmapped part of the space [`ShardInner::find_space`]
    /// finds, in whole pages, or `rounded` in whole pages when a new range is needed.
    pub(super) fn bytes_to_map(&self, layout: &Layout, pool: PoolKind, rounded: usize) -> usize {
        let page = layout.page[Layout::pool_index(pool)];
        let Some(start) = self.find_space(pool, rounded) else {
            return rounded.next_multiple_of(page);
        };
        let (mut left, mut cur, mut mapped) = (rounded, start, 0);
        while left > 0 && cur != NONE {
            let b = &self.blocks[cur as usize];
            let piece = if b.state == State::Free {
                b.size
            } else {
                let want = to_map(left, page, b.size);
                mapped += want;
                want
            };
            left -= left.min(piece);
            cur = b.next;
        }
        mapped
    }

    /// Reserves a new range for `pool` on `driver`: one unmapped block spanning it.
    fn reserve_range(
        &mut self,
        driver: &dyn Driver,
        device: usize,
        layout: &Layout,
        pool: PoolKind,
    ) -> Result<(usize, usize)> {
        let p = Layout::pool_index(pool);
        let size = layout.reserve[p];
        let base = driver.vmm_reserve(device, size)?;
        self.exp.prefer_settled = layout.prefer_settled;
        let index = self.exp.segments.len() as u32;
        self.exp.segments.push(ExpSegment {
            base,
            size,
            page: layout.page[p],
            pool,
            handles: Vec::new(),
            mapped: 0,
            live: true,
        });
        let id = self.new_block(Block {
            addr: base,
            size,
            requested: 0,
            prev: NONE,
            next: NONE,
            state: State::Unmapped,
            pool,
            events_left: 0,
            stream_uses: Vec::new(),
            exp: index,
            freed_at: 0,
        });
        self.unmapped_index(pool).insert(base, id);
        Ok((base, size))
    }

    /// Maps memory so that a free block of at least `rounded` bytes exists in an expandable
    /// segment of `pool`, reserving a range first when none has room; `start` is what
    /// [`ShardInner::find_space`] returns, when the caller knows. Returns that block (out
    /// of its free index, still counted as inactive split when it is split, like a block
    /// taken by best fit). Out of memory leaves everything as it was.
    #[allow(clippy::too_many_arguments)]
    pub fn grow(
        &mut self,
        driver: &dyn Driver,
        device: usize,
        layout: &Layout,
        pool: PoolKind,
        rounded: usize,
        start: Option<u32>,
        stats: &mut impl StatSink,
        report: &mut Report,
    ) -> Result<u32> {
        let p = Layout::pool_index(pool);
        if rounded > layout.reserve[p] {
            return Err(Error::OutOfMemory(format!(
                "{rounded} bytes are more than the {} bytes of address space an expandable segment reserves",
                layout.reserve[p]
            )));
        }
        self.exp.idle_reclaimed = false;
        let start = match start.or_else(|| self.find_space(pool, rounded)) {
            Some(s) => s,
            None => {
                report.reserved = Some(self.reserve_range(driver, device, layout, pool)?);
                self.find_space(pool, rounded)
                    .ok_or_else(|| Error::Internal("a fresh range has no room".into()))?
            }
        };
        // Map what is missing, block by block, merging the run into its first block.
        let mut left = rounded;
        let mut cur = start;
        let mut first = NONE;
        while left > 0 {
            let (state, size) = {
                let b = &self.blocks[cur as usize];
                (b.state, b.size)
            };
            let piece = if state == State::Free {
                self.remove_free(cur);
                left -= left.min(size);
                cur
            } else {
                let page = self.exp.segments[self.blocks[cur as usize].exp as usize].page;
                let want = to_map(left, page, size);
                if let Err(e) = self.map_run(driver, device, layout, cur, want, stats, report) {
                    self.restore_free(first);
                    return Err(e);
                }
                left -= left.min(want);
                let addr = self.blocks[cur as usize].addr;
                self.unmapped_index(pool).remove(&addr);
                let mapped = if want == size {
                    self.blocks[cur as usize].state = State::Free;
                    cur
                } else {
                    let front = self.split_front(cur, want, State::Free);
                    self.unmapped_index(pool).insert(addr + want, cur);
                    front
                };
                self.blocks[mapped as usize].freed_at = 0;
                mapped
            };
            let after = self.blocks[piece as usize].next;
            if first == NONE {
                first = piece;
            } else {
                self.absorb_next(first, piece);
            }
            cur = after;
        }
        // `first` spans the run now; merge a free block that follows it.
        let next = self.blocks[first as usize].next;
        if next != NONE && self.blocks[next as usize].state == State::Free {
            self.remove_free(next);
            self.absorb_next(first, next);
        }
        Ok(first)
    }

    /// Puts the run merged so far back in its free index after a failed growth.
    fn restore_free(&mut self, first: u32) {
        if first != NONE {
            self.insert_free(first);
        }
    }

    /// Maps the first `want` bytes of the unmapped block `id`.
    #[allow(clippy::too_many_arguments)]
    fn map_run(
        &mut self,
        driver: &dyn Driver,
        device: usize,
        layout: &Layout,
        id: u32,
        want: usize,
        stats: &mut impl StatSink,
        report: &mut Report,
    ) -> Result<()> {
        let (addr, exp, pool) = {
            let b = &self.blocks[id as usize];
            (b.addr, b.exp as usize, b.pool)
        };
        let page = self.exp.segments[exp].page;
        let chunk = page
            .saturating_mul(layout.max_handle_pages.max(1))
            .min(want);
        // Kept allocations of the chunk size go first, new ones fill the rest.
        let kept = if report.spare.first().is_some_and(|&(l, _)| l == chunk) {
            report
                .spare
                .iter()
                .rev()
                .take_while(|&&(l, _)| l == chunk)
                .count()
                .min(want / chunk)
        } else {
            0
        };
        let head = kept * chunk;
        let mut made = std::mem::take(&mut self.exp.made);
        made.clear();
        if head < want {
            let mut mapped =
                driver.vmm_map_many(device, addr + head, want - head, chunk, &mut made);
            let surplus = report.spare.len() - kept;
            if matches!(mapped, Err(Error::OutOfMemory(_))) && surplus > 0 {
                // Kept allocations this growth cannot use still hold device memory: give
                // them back and try again.
                for (_, h) in report.spare.drain(..surplus).rev() {
                    let _ = driver.vmm_release(device, h);
                }
                mapped = driver.vmm_map_many(device, addr + head, want - head, chunk, &mut made);
            }
            if let Err(e) = mapped {
                self.exp.made = made;
                return Err(e);
            }
        }
        let from = report.spare.len() - kept;
        let moved = kept > 0
            && driver
                .vmm_map_kept(device, addr, &report.spare[from..])
                .is_ok();
        if kept > 0 && !moved {
            // The kept allocations stay spare; create the head's instead.
            let mut fresh = Vec::with_capacity(kept);
            if let Err(e) = driver.vmm_map_many(device, addr, head, chunk, &mut fresh) {
                let tail: Vec<_> = made
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| {
                        let at = addr + head + i * chunk;
                        (at, chunk.min(addr + want - at), h)
                    })
                    .collect();
                let _ = driver.vmm_unmap_many(device, &tail);
                self.exp.made = made;
                return Err(e);
            }
            made.splice(0..0, fresh);
        }
        let seg = &mut self.exp.segments[exp];
        let first = (addr - seg.base) / page;
        let end = first + want / page;
        if seg.handles.len() < end {
            seg.handles.resize(end, None);
        }
        let mut at = addr;
        if moved {
            for (len, h) in report.spare.drain(from..) {
                seg.handles[(at - seg.base) / page] = Some((len, h));
                at += len;
            }
        }
        for &h in &made {
            let len = chunk.min(addr + want - at);
            seg.handles[(at - seg.base) / page] = Some((len, h));
            at += len;
        }
        self.exp.made = made;
        seg.mapped += want;
        stats.both(StatKind::ReservedBytes, pool, want as i64);
        report.range(true, addr, want);
        Ok(())
    }

    /// Unmaps whole physical allocations inside free blocks of expandable segments, smallest
    /// block first, until `goal` bytes are unmapped, adding what it did to `report` (which
    /// counts only what this call unmaps toward `goal`). An idle reclaim that leaves no idle
    /// page to unmap sets [`ExpState::idle_reclaimed`], for its caller to skip the next ones.
    pub fn unmap_free(
        &mut self,
        driver: &dyn Driver,
        device: usize,
        reclaim: Reclaim,
        goal: usize,
        stats: &mut impl StatSink,
        report: &mut Report,
    ) -> Result<()> {
        // A block smaller than a page holds no whole physical allocation.
        let Some(floor) = self.exp.segments.iter().map(|s| s.page).min() else {
            return Ok(());
        };
        let idle = matches!(reclaim, Reclaim::Idle { .. });
        let goal = report.bytes.saturating_add(goal);
        // Whether every idle free block holding a page is unmapped at the end.
        let mut complete = true;
        for pool in [PoolKind::Small, PoolKind::Large] {
            // Walks the index by key: unmapping a block only adds smaller ones (its ends).
            let mut key = (floor, 0, 0);
            while report.bytes < goal {
                let Some(k) = self.free_index(pool).first_at_least(key) else {
                    break;
                };
                key = (k.0, k.1, k.2 + 1);
                let b = &self.blocks[k.2 as usize];
                let eligible = b.exp != NONE
                    && match reclaim {
                        Reclaim::All => true,
                        Reclaim::Idle { .. } => b.freed_at <= self.exp.idle_upto,
                    };
                if !eligible || !self.holds_a_page(k.2) {
                    continue;
                }
                if reclaim == (Reclaim::Idle { keep: k.2 }) {
                    complete = false;
                    continue;
                }
                self.unmap_block(driver, device, k.2, stats, report)?;
            }
            complete &= report.bytes < goal;
        }
        if idle && complete {
            self.exp.idle_reclaimed = true;
        }
        Ok(())
    }

    /// Whether block `id` of an expandable segment covers a whole page (else it holds no
    /// whole physical allocation, and [`ShardInner::unmap_block`] has nothing to do).
    fn holds_a_page(&self, id: u32) -> bool {
        let b = &self.blocks[id as usize];
        let seg = &self.exp.segments[b.exp as usize];
        let first = seg.base + (b.addr - seg.base).next_multiple_of(seg.page);
        first + seg.page <= b.addr + b.size
    }

    /// Unmaps the physical allocations that lie wholly inside free block `id`.
    fn unmap_block(
        &mut self,
        driver: &dyn Driver,
        device: usize,
        id: u32,
        stats: &mut impl StatSink,
        report: &mut Report,
    ) -> Result<()> {
        let (addr, size, exp, pool) = {
            let b = &self.blocks[id as usize];
            (b.addr, b.size, b.exp as usize, b.pool)
        };
        let end = addr + size;
        let seg = &self.exp.segments[exp];
        let pages = (addr - seg.base).div_ceil(seg.page)..(end - seg.base) / seg.page;
        let mut inside = std::mem::take(&mut self.exp.unmaps);
        inside.clear();
        inside.extend(
            seg.handles
                .get(pages.start..pages.end.min(seg.handles.len()))
                .unwrap_or_default()
                .iter()
                .zip(pages.clone())
                .filter_map(|(slot, p)| {
                    let (l, h) = (*slot)?;
                    let a = seg.base + p * seg.page;
                    (a + l <= end).then_some((a, l, h))
                }),
        );
        let (Some(&(lo, _, _)), Some(&(last, last_len, _))) = (inside.first(), inside.last())
        else {
            self.exp.unmaps = inside;
            return Ok(());
        };
        let hi = last + last_len;
        let unmapped = if report.keep {
            driver.vmm_unmap_keep(device, &inside)
        } else {
            driver.vmm_unmap_many(device, &inside)
        };
        if unmapped.is_ok() {
            if report.keep {
                report.spare.extend(inside.iter().map(|&(_, l, h)| (l, h)));
            }
            let seg = &mut self.exp.segments[exp];
            for &(a, _, _) in &inside {
                seg.handles[(a - seg.base) / seg.page] = None;
            }
        }
        self.exp.unmaps = inside;
        unmapped?;
        let bytes = hi - lo;
        self.remove_free(id);
        // Cut the block into [addr, lo) free, [lo, hi) unmapped, [hi, end) free.
        if lo > addr {
            let front = self.split_front(id, lo - addr, State::Free);
            self.insert_free(front);
        }
        let middle = if hi < end {
            let m = self.split_front(id, hi - lo, State::Unmapped);
            self.insert_free(id);
            m
        } else {
            self.blocks[id as usize].state = State::Unmapped;
            id
        };
        // Merge with unmapped neighbours.
        let mut m = middle;
        let prev = self.blocks[m as usize].prev;
        if prev != NONE && self.blocks[prev as usize].state == State::Unmapped {
            let pa = self.blocks[prev as usize].addr;
            self.unmapped_index(pool).remove(&pa);
            self.absorb_next(prev, m);
            m = prev;
        }
        let next = self.blocks[m as usize].next;
        if next != NONE && self.blocks[next as usize].state == State::Unmapped {
            let na = self.blocks[next as usize].addr;
            self.unmapped_index(pool).remove(&na);
            self.absorb_next(m, next);
        }
        let ma = self.blocks[m as usize].addr;
        self.unmapped_index(pool).insert(ma, m);
        let seg = &mut self.exp.segments[exp];
        seg.mapped -= bytes;
        stats.both(StatKind::ReservedBytes, pool, -(bytes as i64));
        report.range(false, lo, bytes);
        Ok(())
    }

    /// Returns the address space of ranges with nothing mapped to the driver, each through
    /// `free_range(base, size)`. On its first error the range stays as it was, and the error
    /// is returned.
    pub fn free_empty_ranges(
        &mut self,
        mut free_range: impl FnMut(usize, usize) -> Result<()>,
    ) -> Result<()> {
        for i in 0..self.exp.segments.len() {
            let seg = &self.exp.segments[i];
            if !seg.live || seg.mapped != 0 {
                continue;
            }
            let (base, size, pool) = (seg.base, seg.size, seg.pool);
            let Some(id) = self.unmapped_index(pool).remove(&base) else {
                continue;
            };
            if let Err(e) = free_range(base, size) {
                self.unmapped_index(pool).insert(base, id);
                return Err(e);
            }
            self.drop_block(id);
            self.exp.segments[i].live = false;
        }
        Ok(())
    }

    /// Unmaps everything and returns every range (when the allocator goes away).
    pub fn drop_all(&mut self, driver: &dyn Driver, device: usize) {
        for seg in &mut self.exp.segments {
            if !seg.live {
                continue;
            }
            let maps: Vec<_> = seg
                .handles
                .iter()
                .enumerate()
                .filter_map(|(p, slot)| slot.map(|(l, h)| (seg.base + p * seg.page, l, h)))
                .collect();
            let _ = driver.vmm_unmap_many(device, &maps);
            seg.handles.clear();
            let _ = driver.vmm_free_range(device, seg.base, seg.size);
            seg.live = false;
        }
    }
}

//! One stream's share of a device: its segments, blocks and free pools.
//!
//! A block belongs to the stream it was allocated on and is reused only for that stream, and
//! every block of a segment shares the segment's stream, so each stream's blocks form an
//! independent allocator. That is why the device is sharded by stream: allocation on one stream
//! never waits for another.
//!
//! Blocks live in an arena and refer to their segment neighbours by index. Invariants:
//! - a segment's blocks tile it: `prev`/`next` link address-adjacent blocks of one segment;
//! - two free neighbours never coexist (freeing merges them);
//! - a block is in its pool's free index exactly when its state is [`State::Free`];
//! - `live` maps the address of every allocated block (state [`State::Allocated`]) to its id.

use crate::lock::{ShardGuard, ShardMutex};

use super::free_index::FreeIndex;
use super::live::LiveTable;
use super::size::{should_split, PoolKind};
use super::stats::{aggregate, of_pool, StatKind, OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS};
use crate::driver::{Event, Stream};

/// "No neighbour".
pub(crate) const NONE: u32 = u32::MAX;

/// Life of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// In the pool, ready for reuse.
    Free,
    /// Handed to a client.
    Allocated,
    /// Freed by the client, waiting for events on the streams that used it.
    AwaitingEvents,
    /// Address space of an expandable segment with no memory mapped behind it (never in a
    /// free index; see [`super::expandable`]).
    Unmapped,
}

pub(crate) struct Block {
    pub addr: usize,
    pub size: usize,
    pub requested: usize,
    pub prev: u32,
    pub next: u32,
    pub state: State,
    pub pool: PoolKind,
    /// Events still pending before the block may return to its pool.
    pub events_left: u32,
    /// Other streams that used the block (`record_stream`).
    pub stream_uses: Vec<Stream>,
    /// The expandable segment of the shard the block lies in, or [`NONE`] for an ordinary
    /// segment.
    pub exp: u32,
    /// The shard's free counter when the block was last freed (see
    /// [`super::expandable::ExpState::frees`]): its memory is idle once an event recorded at
    /// or after that count has completed.
    pub freed_at: u64,
}

impl Block {
    pub(crate) fn is_split(&self) -> bool {
        self.prev != NONE || self.next != NONE
    }
}

/// Records a change of a statistic: `(index, delta)`.
pub(crate) trait StatSink {
    fn change(&mut self, index: usize, delta: i64);

    #[inline(always)]
    fn both(&mut self, kind: StatKind, pool: PoolKind, delta: i64) {
        self.change(aggregate(kind), delta);
        self.change(of_pool(kind, pool), delta);
    }
}

/// How a block taken from a free index was (or will be) handed out: the block as it was in
/// the index, and the request it served.
///
/// A cached malloc+free of one size leaves a shard as it found it: the malloc takes the
/// best-fitting block and splits off the rest, the free merges the rest back. When a full
/// malloc+free did exactly that (the block came back with the same address, size and
/// neighbours, and its pool's free index changed only by the pair's own insertions and
/// removals), the index holds the same blocks as before the malloc, so the next malloc of
/// the same rounded size would take the same block and split it the same way. The shard
/// keeps that pair as its memo and replays it: the malloc makes the pair's statistic
/// changes and hands out the address, leaving the block in the index (the allocation is
/// *held*); a free of that address makes the free's statistic changes. Anything else that
/// locks the shard first carries out the held allocation ([`ShardLock::lock`]), so every
/// other path sees exactly the state the full malloc would have made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Memo {
    pub id: u32,
    pub addr: usize,
    pub size: usize,
    pub prev: u32,
    pub next: u32,
    pub pool: PoolKind,
    pub exp: u32,
    /// The rounded request.
    pub rounded: usize,
    /// Whether the rest of the block is split off.
    pub split: bool,
    /// Whether the block was part of a split segment (it had neighbours).
    pub was_split: bool,
    /// The pool's free-index generation after the malloc (candidates) or the free (memos).
    pub generation: u64,
}

impl Memo {
    /// The size of the allocated block.
    fn given(&self) -> usize {
        if self.split {
            self.rounded
        } else {
            self.size
        }
    }

    /// The statistic changes of handing the block out (in the full path's order).
    #[inline(always)]
    fn allocation_stats(&self, requested: usize, max_split_size: usize, stats: &mut impl StatSink) {
        let pool = self.pool;
        let rest = (self.size - self.rounded) as i64;
        // Expandable blocks stay out of the inactive-split statistics, as in PyTorch: their
        // free pages can always be returned.
        let counted = self.exp == NONE;
        match (self.was_split && counted, self.split && counted) {
            // An inactive split block shrinks by what is handed out; it stays one block.
            (true, true) => stats.both(StatKind::InactiveSplitBytes, pool, -(self.rounded as i64)),
            (true, false) => {
                stats.both(StatKind::InactiveSplit, pool, -1);
                stats.both(StatKind::InactiveSplitBytes, pool, -(self.size as i64));
            }
            (false, true) => {
                stats.both(StatKind::InactiveSplit, pool, 1);
                stats.both(StatKind::InactiveSplitBytes, pool, rest);
            }
            (false, false) => {}
        }
        let given = self.given();
        stats.both(StatKind::Allocation, pool, 1);
        stats.both(StatKind::AllocatedBytes, pool, given as i64);
        stats.both(StatKind::Active, pool, 1);
        stats.both(StatKind::ActiveBytes, pool, given as i64);
        stats.both(StatKind::RequestedBytes, pool, requested as i64);
        if given >= max_split_size {
            stats.change(OVERSIZE_ALLOCATIONS, 1);
        }
    }

    /// The statistic changes of freeing the block and merging it back as it was, in the
    /// order [`ShardInner::unallocate`] and [`ShardInner::release`] make them.
    #[inline(always)]
    fn free_stats(&self, requested: usize, max_split_size: usize, stats: &mut impl StatSink) {
        let pool = self.pool;
        let given = self.given();
        unallocation_stats(pool, given, max_split_size, stats);
        deactivation_stats(pool, given, requested, stats);
        let rest = (self.size - self.rounded) as i64;
        let counted = self.exp == NONE;
        match (self.split && counted, self.was_split && counted) {
            // Merging the rest back: one inactive split block before and after, grown by
            // the block (the net change, as `release` makes it).
            (true, true) => stats.both(StatKind::InactiveSplitBytes, pool, self.rounded as i64),
            (true, false) => {
                stats.both(StatKind::InactiveSplit, pool, -1);
                stats.both(StatKind::InactiveSplitBytes, pool, -rest);
            }
            (false, true) => {
                stats.both(StatKind::InactiveSplit, pool, 1);
                stats.both(StatKind::InactiveSplitBytes, pool, self.size as i64);
            }
            (false, false) => {}
        }
    }
}

/// The statistic changes of a client freeing an allocated block of `size` bytes
/// ([`ShardInner::unallocate`], and a replayed free through [`Memo`]).
#[inline(always)]
fn unallocation_stats(
    pool: PoolKind,
    size: usize,
    max_split_size: usize,
    stats: &mut impl StatSink,
) {
    stats.both(StatKind::Allocation, pool, -1);
    stats.both(StatKind::AllocatedBytes, pool, -(size as i64));
    if size >= max_split_size {
        stats.change(OVERSIZE_ALLOCATIONS, -1);
    }
}

/// The statistic changes of a freed block of `size` bytes, `requested` of them asked for,
/// leaving the active ones ([`ShardInner::release`], and a replayed free through [`Memo`]).
/// Requested bytes count until then, as in PyTorch: a block freed while other streams use it
/// stays requested until their work is done.
#[inline(always)]
fn deactivation_stats(pool: PoolKind, size: usize, requested: usize, stats: &mut impl StatSink) {
    stats.both(StatKind::Active, pool, -1);
    stats.both(StatKind::ActiveBytes, pool, -(size as i64));
    stats.both(StatKind::RequestedBytes, pool, -(requested as i64));
}

/// A shard's lock ([`crate::lock`]). Locking carries out a held memo allocation first
/// ([`Memo`]), so callers see only real blocks; the cached fast paths use
/// [`ShardLock::lock_memo`].
#[derive(Default)]
pub(crate) struct ShardLock(ShardMutex<ShardInner>);

impl ShardLock {
    #[inline]
    pub fn lock(&self) -> ShardGuard<'_, ShardInner> {
        let mut inner = self.0.lock();
        inner.settle_memo();
        inner
    }

    #[inline]
    pub fn try_lock(&self) -> Option<ShardGuard<'_, ShardInner>> {
        let mut inner = self.0.try_lock()?;
        inner.settle_memo();
        Some(inner)
    }

    /// Locks without carrying out a held memo allocation: the caller replays the memo or
    /// calls [`ShardInner::settle_memo`] before anything else, or touches only the shard's
    /// statistics (a settle of peaks).
    #[inline]
    pub fn lock_memo(&self) -> ShardGuard<'_, ShardInner> {
        self.0.lock()
    }

    /// [`ShardLock::lock_memo`] if the lock is free.
    #[inline]
    pub fn try_lock_memo(&self) -> Option<ShardGuard<'_, ShardInner>> {
        self.0.try_lock()
    }

    /// [`ShardLock::lock_memo`] if the lock becomes free within `timeout`.
    pub fn try_lock_memo_for(
        &self,
        timeout: std::time::Duration,
    ) -> Option<ShardGuard<'_, ShardInner>> {
        self.0.try_lock_for(timeout)
    }

    /// Unlocks a lock whose guard was forgotten.
    ///
    /// # Safety
    /// The current thread holds the lock through a forgotten guard.
    pub unsafe fn force_unlock(&self) {
        // SAFETY: the caller's contract.
        unsafe { self.0.force_unlock() }
    }
}

/// The mutable state of a shard, behind its lock.
#[derive(Default)]
pub(crate) struct ShardInner {
    pub blocks: Vec<Block>,
    spare: Vec<u32>,
    /// Free blocks by (size, address): best fit, then lowest address.
    small: FreeIndex,
    large: FreeIndex,
    /// Allocated blocks by address.
    pub live: LiveTable,
    /// Events recorded for blocks in [`State::AwaitingEvents`].
    pub pending: Vec<(Event, u32)>,
    /// Expandable segments of the shard.
    pub exp: super::expandable::ExpState,
    /// The cached pair this shard replays ([`Memo`]), valid while its pool's free index is at
    /// its generation.
    memo: Option<Memo>,
    /// The requested size of the memo's allocation while a client holds it.
    held: Option<usize>,
    /// The block the last full malloc took from a free index, while it may become a memo.
    candidate: Option<Memo>,
    #[cfg(debug_assertions)]
    memo_hits: u64,
}

impl ShardInner {
    #[inline(always)]
    pub(super) fn new_block(&mut self, block: Block) -> u32 {
        match self.spare.pop() {
            Some(id) => {
                self.blocks[id as usize] = block;
                id
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    #[inline(always)]
    pub(super) fn drop_block(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        b.prev = NONE;
        b.next = NONE;
        b.stream_uses = Vec::new();
        self.spare.push(id);
    }

    pub fn block(&self, id: u32) -> &Block {
        &self.blocks[id as usize]
    }

    pub fn block_mut(&mut self, id: u32) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    pub(super) fn free_index(&self, pool: PoolKind) -> &FreeIndex {
        match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    pub(super) fn index_of(&mut self, pool: PoolKind) -> &mut FreeIndex {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    #[inline(always)]
    pub(super) fn insert_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let key = (b.size, b.addr, id);
        let pool = b.pool;
        self.index_of(pool).insert(key);
    }

    #[inline(always)]
    pub(super) fn remove_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let key = (b.size, b.addr, id);
        let pool = b.pool;
        self.index_of(pool).remove(&key);
    }

    /// Takes the best-fitting free block for `rounded` bytes out of `pool`, if one may serve it.
    ///
    /// Kept out of line: inlined into `malloc`, the masks of both its bin search and its class
    /// search were computed ahead of `malloc`'s retry loop, whichever search a request needs
    /// (about 20 instructions per call more on the replayed traces, counted with callgrind).
    #[inline(never)]
    pub fn take_best_fit(
        &mut self,
        pool: PoolKind,
        rounded: usize,
        max_split_size: usize,
        non_split_rounding: usize,
    ) -> Option<u32> {
        let found = self.free_index(pool).find((rounded, 0, 0))?;
        let (mut size, _, mut id) = found.key;
        if self.blocks[id as usize].exp != NONE && self.exp.prefer_settled {
            (size, id) = self.prefer_settled(pool, size, id);
        }
        // Larger candidates would break the oversize rules too, so the first one decides.
        if !super::size::block_fits(size, rounded, max_split_size, non_split_rounding) {
            return None;
        }
        if id == found.key.2 {
            self.index_of(pool).remove_found(&found);
        } else {
            self.remove_free(id);
        }
        Some(id)
    }

    /// Adds a new segment as one block (not in any pool yet) and counts it.
    pub fn add_segment(
        &mut self,
        addr: usize,
        size: usize,
        pool: PoolKind,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> u32 {
        stats.both(StatKind::Segment, pool, 1);
        stats.both(StatKind::ReservedBytes, pool, size as i64);
        if size >= max_split_size {
            stats.change(OVERSIZE_SEGMENTS, 1);
        }
        self.new_block(Block {
            addr,
            size,
            requested: 0,
            prev: NONE,
            next: NONE,
            state: State::Free,
            pool,
            events_left: 0,
            stream_uses: Vec::new(),
            exp: NONE,
            freed_at: 0,
        })
    }

    /// How block `id` (out of the pools) serves `rounded` bytes.
    #[inline(always)]
    fn plan(&self, id: u32, rounded: usize, max_split_size: usize) -> Memo {
        let b = &self.blocks[id as usize];
        let split = if b.exp == NONE {
            should_split(b.pool, b.size, rounded, max_split_size)
        } else {
            // Expandable segments split any worthwhile rest, whatever the pool (PyTorch does).
            b.size - rounded >= super::size::MIN_BLOCK_SIZE
        };
        Memo {
            id,
            addr: b.addr,
            size: b.size,
            prev: b.prev,
            next: b.next,
            pool: b.pool,
            exp: b.exp,
            rounded,
            split,
            was_split: b.prev != NONE || b.next != NONE,
            generation: 0,
        }
    }

    /// Hands block `id` (out of the pools) to a client for `requested` bytes rounded to
    /// `rounded`, splitting off the rest when it is worth keeping. `from_index`: the block was
    /// just taken from its free index by [`ShardInner::take_best_fit`] (it may become the memo).
    #[inline(always)]
    pub fn allocate(
        &mut self,
        id: u32,
        rounded: usize,
        requested: usize,
        max_split_size: usize,
        from_index: bool,
        stats: &mut impl StatSink,
    ) -> usize {
        let plan = self.plan(id, rounded, max_split_size);
        plan.allocation_stats(requested, max_split_size, stats);
        let addr = self.carve(&plan, requested);
        self.candidate = (from_index && plan.exp == NONE).then(|| Memo {
            generation: self.free_index(plan.pool).generation(),
            ..plan
        });
        addr
    }

    /// The block changes of handing out a block as `plan` says (no statistics).
    #[inline(always)]
    fn carve(&mut self, plan: &Memo, requested: usize) -> usize {
        let id = plan.id;
        if plan.split {
            let freed_at = self.blocks[id as usize].freed_at;
            let rest = self.new_block(Block {
                addr: plan.addr + plan.rounded,
                size: plan.size - plan.rounded,
                requested: 0,
                prev: id,
                next: plan.next,
                state: State::Free,
                pool: plan.pool,
                events_left: 0,
                stream_uses: Vec::new(),
                exp: plan.exp,
                freed_at,
            });
            if plan.next != NONE {
                self.blocks[plan.next as usize].prev = rest;
            }
            let b = &mut self.blocks[id as usize];
            b.next = rest;
            b.size = plan.rounded;
            self.insert_free(rest);
        }
        let b = &mut self.blocks[id as usize];
        b.state = State::Allocated;
        b.requested = requested;
        self.live.insert(plan.addr, id);
        plan.addr
    }

    /// Replays the memo for a malloc of `requested` bytes rounded to `rounded` from `pool`:
    /// makes the full malloc's statistic changes and returns the address it would return, or
    /// `None` when the memo does not apply (the caller then takes the full path). The caller
    /// has processed nothing: a shard with pending events takes the full path.
    #[inline]
    pub fn malloc_memo(
        &mut self,
        pool: PoolKind,
        rounded: usize,
        requested: usize,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> Option<usize> {
        let m = self.memo?;
        if m.rounded != rounded
            || m.pool != pool
            || self.held.is_some()
            || !self.pending.is_empty()
            || self.free_index(pool).generation() != m.generation
        {
            return None;
        }
        m.allocation_stats(requested, max_split_size, stats);
        self.held = Some(requested);
        #[cfg(debug_assertions)]
        {
            self.memo_hits += 1;
        }
        Some(m.addr)
    }

    /// Mallocs served by [`ShardInner::malloc_memo`] (debug builds; 0 otherwise).
    pub fn memo_hits(&self) -> u64 {
        #[cfg(debug_assertions)]
        return self.memo_hits;
        #[cfg(not(debug_assertions))]
        0
    }

    /// Frees the held memo allocation if it is at `addr`: makes the full free's statistic
    /// changes. Returns its requested size, or `None` when `addr` is not held.
    #[inline]
    pub fn free_memo(
        &mut self,
        addr: usize,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> Option<usize> {
        let requested = self.held?;
        let m = self.memo?;
        if m.addr != addr {
            return None;
        }
        self.held = None;
        m.free_stats(requested, max_split_size, stats);
        self.exp.frees += 1;
        self.blocks[m.id as usize].freed_at = self.exp.frees;
        Some(requested)
    }

    /// Carries out a held memo allocation: the block leaves the free index and is split as
    /// the full malloc would have done (its statistics were counted when it was handed out).
    #[inline]
    pub fn settle_memo(&mut self) {
        if self.held.is_some() {
            self.carry_out_memo();
        }
    }

    /// Whether the shard holds no block (no segment, cached or in use, so no event pending
    /// and no held memo allocation either) and no expandable range still reserved.
    pub fn holds_nothing(&self) -> bool {
        self.blocks.len() == self.spare.len() && self.exp.segments.iter().all(|s| !s.live)
    }

    /// Forgets the memo and its candidate, before the shard serves another stream.
    pub fn forget_memo(&mut self) {
        self.memo = None;
        self.candidate = None;
    }

    #[cold]
    #[inline(never)]
    fn carry_out_memo(&mut self) {
        let (Some(requested), Some(m)) = (self.held.take(), self.memo.take()) else {
            return;
        };
        self.remove_free(m.id);
        self.carve(&m, requested);
        self.candidate = Some(Memo {
            generation: self.free_index(m.pool).generation(),
            ..m
        });
    }

    /// Before the full path releases block `id`: the candidate memo, if `id` is the block the
    /// last full malloc took and its pool's free index has not changed since.
    pub fn memo_candidate(&mut self, id: u32) -> Option<Memo> {
        let c = self.candidate.take()?;
        (c.id == id && self.free_index(c.pool).generation() == c.generation).then_some(c)
    }

    /// After the full path released the block of `candidate`: it becomes the memo if the
    /// block came back exactly as it was taken.
    pub fn remember(&mut self, candidate: Memo) {
        let b = &self.blocks[candidate.id as usize];
        if b.state == State::Free
            && (b.addr, b.size, b.prev, b.next)
                == (
                    candidate.addr,
                    candidate.size,
                    candidate.prev,
                    candidate.next,
                )
        {
            self.memo = Some(Memo {
                generation: self.free_index(candidate.pool).generation(),
                ..candidate
            });
        }
    }

    /// The client frees the allocated block at `addr`. Returns its id, or `None` if no block
    /// of this shard is allocated there. The block stays active until [`ShardInner::release`].
    #[inline(always)]
    pub fn unallocate(
        &mut self,
        addr: usize,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> Option<u32> {
        let id = self.live.remove(&addr)?;
        let b = &mut self.blocks[id as usize];
        b.state = State::AwaitingEvents;
        let (pool, size) = (b.pool, b.size);
        unallocation_stats(pool, size, max_split_size, stats);
        Some(id)
    }

    /// Returns a freed block to its pool, merging it with free neighbours.
    #[inline(always)]
    pub fn release(&mut self, id: u32, stats: &mut impl StatSink) {
        let (pool, size, requested) = {
            let b = &mut self.blocks[id as usize];
            b.state = State::Free;
            b.events_left = 0;
            b.stream_uses.clear();
            (b.pool, b.size, b.requested)
        };
        self.exp.frees += 1;
        let freed_at = self.exp.frees;
        self.blocks[id as usize].freed_at = freed_at;
        deactivation_stats(pool, size, requested, stats);

        let (mut merged, mut merged_bytes) = (0i64, 0i64);
        let prev = self.blocks[id as usize].prev;
        if prev != NONE && self.blocks[prev as usize].state == State::Free {
            self.remove_free(prev);
            let (paddr, psize, pprev) = {
                let p = &self.blocks[prev as usize];
                (p.addr, p.size, p.prev)
            };
            merged += 1;
            merged_bytes += psize as i64;
            let b = &mut self.blocks[id as usize];
            b.addr = paddr;
            b.size += psize;
            b.prev = pprev;
            if pprev != NONE {
                self.blocks[pprev as usize].next = id;
            }
            self.drop_block(prev);
        }
        let next = self.blocks[id as usize].next;
        if next != NONE && self.blocks[next as usize].state == State::Free {
            self.remove_free(next);
            let (nsize, nnext) = {
                let n = &self.blocks[next as usize];
                (n.size, n.next)
            };
            merged += 1;
            merged_bytes += nsize as i64;
            let b = &mut self.blocks[id as usize];
            b.size += nsize;
            b.next = nnext;
            if nnext != NONE {
                self.blocks[nnext as usize].prev = id;
            }
            self.drop_block(next);
        }
        // The inactive-split statistics change by the net effect of the free, as PyTorch's
        // do: merged neighbours leave, the merged block joins if it is still split. The
        // current values would be the same either way; the counters of bytes and blocks
        // allocated and freed are not.
        let b = &self.blocks[id as usize];
        // Expandable blocks stay out of the inactive-split statistics, as in PyTorch.
        if b.exp == NONE {
            let (joins, join_bytes) = if b.is_split() {
                (1, b.size as i64)
            } else {
                (0, 0)
            };
            if joins != merged {
                stats.both(StatKind::InactiveSplit, pool, joins - merged);
            }
            if join_bytes != merged_bytes {
                stats.both(
                    StatKind::InactiveSplitBytes,
                    pool,
                    join_bytes - merged_bytes,
                );
            }
        }
        self.insert_free(id);
    }

    /// Ids of free blocks that span a whole segment (returnable to the driver).
    pub fn whole_free_segments(&self) -> Vec<u32> {
        self.small
            .iter()
            .chain(self.large.iter())
            .map(|(_, _, id)| id)
            .filter(|&id| {
                let b = &self.blocks[id as usize];
                !b.is_split() && b.exp == NONE
            })
            .collect()
    }

    /// Removes a whole free segment; returns its address and size.
    pub fn remove_segment(
        &mut self,
        id: u32,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> (usize, usize) {
        self.remove_free(id);
        let b = &self.blocks[id as usize];
        debug_assert!(!b.is_split() && b.state == State::Free);
        let (addr, size, pool) = (b.addr, b.size, b.pool);
        stats.both(StatKind::Segment, pool, -1);
        stats.both(StatKind::ReservedBytes, pool, -(size as i64));
        if size >= max_split_size {
            stats.change(OVERSIZE_SEGMENTS, -1);
        }
        self.drop_block(id);
        (addr, size)
    }
}

impl ShardInner {
    /// The blocks of every segment of the shard, each segment in address order (for snapshots).
    pub fn segments(&self) -> Vec<Vec<&Block>> {
        let spare: std::collections::HashSet<u32> = self.spare.iter().copied().collect();
        let mut out = Vec::new();
        for (id, b) in self.blocks.iter().enumerate() {
            if b.prev != NONE || spare.contains(&(id as u32)) {
                continue;
            }
            // An expandable segment shows as one segment per run of mapped blocks.
            let mut segment = Vec::new();
            let mut cur = id as u32;
            while cur != NONE {
                let b = &self.blocks[cur as usize];
                if b.state == State::Unmapped {
                    if !segment.is_empty() {
                        out.push(std::mem::take(&mut segment));
                    }
                } else {
                    segment.push(b);
                }
                cur = b.next;
            }
            if !segment.is_empty() {
                out.push(segment);
            }
        }
        out
    }
}

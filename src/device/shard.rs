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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::free_index::FreeIndex;
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

/// Hasher for block addresses: addresses are 512-byte aligned and distinct, so one
/// multiply spreads them well; SipHash would cost more than the rest of a lookup.
#[derive(Default)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        let m = (n as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = (m as u64) ^ ((m >> 64) as u64);
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

/// The mutable state of a shard, behind its lock.
#[derive(Default)]
pub(crate) struct ShardInner {
    pub blocks: Vec<Block>,
    spare: Vec<u32>,
    /// Free blocks by (size, address): best fit, then lowest address.
    small: FreeIndex,
    large: FreeIndex,
    /// Allocated blocks by address.
    pub live: HashMap<usize, u32, BuildHasherDefault<AddrHasher>>,
    /// Events recorded for blocks in [`State::AwaitingEvents`].
    pub pending: Vec<(Event, u32)>,
    /// Expandable segments of the shard.
    pub exp: super::expandable::ExpState,
}

impl ShardInner {
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

    pub(super) fn small_index(&self) -> &FreeIndex {
        &self.small
    }

    pub(super) fn large_index(&self) -> &FreeIndex {
        &self.large
    }

    pub(super) fn index_of(&mut self, pool: PoolKind) -> &mut FreeIndex {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    pub(super) fn insert_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let key = (b.size, b.addr, id);
        let pool = b.pool;
        self.index_of(pool).insert(key);
    }

    pub(super) fn remove_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let key = (b.size, b.addr, id);
        let pool = b.pool;
        self.index_of(pool).remove(&key);
    }

    /// Takes the best-fitting free block for `rounded` bytes out of `pool`, if one may serve it.
    pub fn take_best_fit(
        &mut self,
        pool: PoolKind,
        rounded: usize,
        max_split_size: usize,
    ) -> Option<u32> {
        let (mut size, _, mut id) = self.index_of(pool).first_at_least((rounded, 0, 0))?;
        if self.blocks[id as usize].exp != NONE && self.exp.prefer_settled {
            (size, id) = self.prefer_settled(pool, size, id);
        }
        // Larger candidates would break the oversize rules too, so the first one decides.
        if !super::size::block_fits(size, rounded, max_split_size) {
            return None;
        }
        self.remove_free(id);
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

    /// Hands block `id` (out of the pools) to a client for `requested` bytes rounded to
    /// `rounded`, splitting off the rest when it is worth keeping.
    pub fn allocate(
        &mut self,
        id: u32,
        rounded: usize,
        requested: usize,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> usize {
        let (pool, size, was_split) = {
            let b = &self.blocks[id as usize];
            (b.pool, b.size, b.is_split())
        };
        if was_split {
            stats.both(StatKind::InactiveSplit, pool, -1);
            stats.both(StatKind::InactiveSplitBytes, pool, -(size as i64));
        }
        let exp = self.blocks[id as usize].exp;
        let split = if exp == NONE {
            should_split(pool, size, rounded, max_split_size)
        } else {
            // Expandable segments split any worthwhile rest, whatever the pool (PyTorch does).
            size - rounded >= super::size::MIN_BLOCK_SIZE
        };
        if split {
            let (addr, next, freed_at) = {
                let b = &self.blocks[id as usize];
                (b.addr, b.next, b.freed_at)
            };
            let rest = self.new_block(Block {
                addr: addr + rounded,
                size: size - rounded,
                requested: 0,
                prev: id,
                next,
                state: State::Free,
                pool,
                events_left: 0,
                stream_uses: Vec::new(),
                exp,
                freed_at,
            });
            if next != NONE {
                self.blocks[next as usize].prev = rest;
            }
            let b = &mut self.blocks[id as usize];
            b.next = rest;
            b.size = rounded;
            self.insert_free(rest);
            stats.both(StatKind::InactiveSplit, pool, 1);
            stats.both(StatKind::InactiveSplitBytes, pool, (size - rounded) as i64);
        }
        let b = &mut self.blocks[id as usize];
        b.state = State::Allocated;
        b.requested = requested;
        let (addr, size) = (b.addr, b.size);
        self.live.insert(addr, id);
        stats.both(StatKind::Allocation, pool, 1);
        stats.both(StatKind::AllocatedBytes, pool, size as i64);
        stats.both(StatKind::Active, pool, 1);
        stats.both(StatKind::ActiveBytes, pool, size as i64);
        stats.both(StatKind::RequestedBytes, pool, requested as i64);
        if size >= max_split_size {
            stats.change(OVERSIZE_ALLOCATIONS, 1);
        }
        addr
    }

    /// The client frees the allocated block at `addr`. Returns its id, or `None` if no block
    /// of this shard is allocated there. The block stays active until [`ShardInner::release`].
    pub fn unallocate(
        &mut self,
        addr: usize,
        max_split_size: usize,
        stats: &mut impl StatSink,
    ) -> Option<u32> {
        let id = self.live.remove(&addr)?;
        let b = &mut self.blocks[id as usize];
        b.state = State::AwaitingEvents;
        let (pool, size, requested) = (b.pool, b.size, b.requested);
        stats.both(StatKind::Allocation, pool, -1);
        stats.both(StatKind::AllocatedBytes, pool, -(size as i64));
        stats.both(StatKind::RequestedBytes, pool, -(requested as i64));
        if size >= max_split_size {
            stats.change(OVERSIZE_ALLOCATIONS, -1);
        }
        Some(id)
    }

    /// Returns a freed block to its pool, merging it with free neighbours.
    pub fn release(&mut self, id: u32, stats: &mut impl StatSink) {
        let (pool, size) = {
            let b = &mut self.blocks[id as usize];
            b.state = State::Free;
            b.events_left = 0;
            b.stream_uses.clear();
            (b.pool, b.size)
        };
        self.exp.frees += 1;
        let freed_at = self.exp.frees;
        self.blocks[id as usize].freed_at = freed_at;
        stats.both(StatKind::Active, pool, -1);
        stats.both(StatKind::ActiveBytes, pool, -(size as i64));

        let prev = self.blocks[id as usize].prev;
        if prev != NONE && self.blocks[prev as usize].state == State::Free {
            self.remove_free(prev);
            let (paddr, psize, pprev) = {
                let p = &self.blocks[prev as usize];
                (p.addr, p.size, p.prev)
            };
            stats.both(StatKind::InactiveSplit, pool, -1);
            stats.both(StatKind::InactiveSplitBytes, pool, -(psize as i64));
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
            stats.both(StatKind::InactiveSplit, pool, -1);
            stats.both(StatKind::InactiveSplitBytes, pool, -(nsize as i64));
            let b = &mut self.blocks[id as usize];
            b.size += nsize;
            b.next = nnext;
            if nnext != NONE {
                self.blocks[nnext as usize].prev = id;
            }
            self.drop_block(next);
        }
        let b = &self.blocks[id as usize];
        if b.is_split() {
            let size = b.size as i64;
            stats.both(StatKind::InactiveSplit, pool, 1);
            stats.both(StatKind::InactiveSplitBytes, pool, size);
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

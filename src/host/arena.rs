//! Blocks and the arena that holds them.
//!
//! A block is one pinned range obtained from the driver (blocks are never split). Blocks are
//! named by a small integer id; the arena hands out `&Block` for an id without a lock, because
//! block storage is allocated in fixed chunks that never move and are only freed when the
//! arena is dropped. Ids of released blocks are recycled by the allocator.

use std::sync::atomic::{AtomicPtr, AtomicU16, AtomicU32, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::driver::Stream;

/// The id was never handed out or the block went back to the driver.
pub(crate) const UNUSED: u32 = 0;
/// Handed to a caller.
pub(crate) const ALLOCATED: u32 = 1;
/// Handed to a caller, and `record_event` has named at least one stream.
pub(crate) const ALLOCATED_WITH_STREAMS: u32 = 2;
/// Freed by the caller; waiting for events on the streams that used it.
pub(crate) const PENDING: u32 = 3;
/// In a shard's free list (or being moved into one).
pub(crate) const FREE: u32 = 4;

/// Blocks per chunk of the arena.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;
/// Most chunks (and so most blocks: about a million) an arena can hold.
const MAX_CHUNKS: usize = 1024;
/// The largest block id plus one.
pub(crate) const MAX_BLOCKS: usize = CHUNK * MAX_CHUNKS;

/// One pinned block. Aligned to two cache lines so blocks used by different threads never
/// share a line, nor a pair of lines that the hardware prefetches together.
#[repr(align(128))]
pub(crate) struct Block {
    /// Address of the pinned range; 0 while unused.
    pub(crate) ptr: AtomicUsize,
    /// Bytes in the pinned range.
    pub(crate) size: AtomicUsize,
    /// One of the state constants above.
    pub(crate) state: AtomicU32,
    /// Events still to complete before a pending block is free again.
    pub(crate) events_left: AtomicU32,
    /// Shard whose free list and counters the block belongs to.
    pub(crate) home: AtomicU16,
    /// Streams named by `record_event` since the block was handed out.
    pub(crate) streams: Mutex<Vec<Stream>>,
}

impl Block {
    fn new() -> Block {
        Block {
            ptr: AtomicUsize::new(0),
            size: AtomicUsize::new(0),
            state: AtomicU32::new(UNUSED),
            events_left: AtomicU32::new(0),
            home: AtomicU16::new(0),
            streams: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn ptr(&self) -> usize {
        self.ptr.load(Ordering::Acquire)
    }

    pub(crate) fn size(&self) -> usize {
        self.size.load(Ordering::Relaxed)
    }

    pub(crate) fn home(&self) -> usize {
        self.home.load(Ordering::Relaxed) as usize
    }
}

/// Chunked storage of blocks.
pub(crate) struct Arena {
    chunks: Box<[AtomicPtr<Block>]>,
    /// Ids below this are backed by a chunk.
    limit: AtomicUsize,
}

impl Arena {
    pub(crate) fn new() -> Arena {
        Arena {
            chunks: (0..MAX_CHUNKS)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            limit: AtomicUsize::new(0),
        }
    }

    /// The block `id`, or `None` if no chunk backs that id (an id from a forged context).
    pub(crate) fn get(&self, id: u32) -> Option<&Block> {
        let id = id as usize;
        if id >= self.limit.load(Ordering::Acquire) {
            return None;
        }
        let chunk = self.chunks[id >> CHUNK_BITS].load(Ordering::Acquire);
        // SAFETY: ids below `limit` lie in a published chunk of CHUNK blocks, which stays
        // allocated until the arena is dropped.
        Some(unsafe { &*chunk.add(id & (CHUNK - 1)) })
    }

    /// Makes sure `id` is backed by a chunk. Called with the allocator's global lock held,
    /// so chunks are published by one thread at a time.
    pub(crate) fn ensure(&self, id: u32) -> bool {
        let id = id as usize;
        if id >= MAX_BLOCKS {
            return false;
        }
        while self.limit.load(Ordering::Relaxed) <= id {
            let index = self.limit.load(Ordering::Relaxed) >> CHUNK_BITS;
            let chunk: Box<[Block]> = (0..CHUNK).map(|_| Block::new()).collect();
            self.chunks[index].store(Box::into_raw(chunk) as *mut Block, Ordering::Release);
            self.limit
                .store((index + 1) << CHUNK_BITS, Ordering::Release);
        }
        true
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        for c in self.chunks.iter() {
            let p = c.load(Ordering::Relaxed);
            if !p.is_null() {
                // SAFETY: made by Box::into_raw of a CHUNK-long boxed slice in `ensure`, freed
                // once here; no reader exists while the arena drops.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, CHUNK)) });
            }
        }
    }
}

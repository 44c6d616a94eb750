//! Returning cached blocks to the driver.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::arena::UNUSED;
use super::shard::FreeBlock;
use super::HostAllocator;
use crate::error::Result;

impl HostAllocator {
    /// Returns every free block to the driver, after moving blocks whose events have
    /// completed back to the cache. Blocks in use, and freed blocks whose streams are still
    /// running, are kept.
    ///
    /// Errors: the first driver error; the other blocks are still released, and a block the
    /// driver refused to unpin is forgotten (its pages stay pinned rather than be reused).
    pub fn empty_cache(&self) -> Result<()> {
        self.poll_events(true);
        let mut blocks = Vec::new();
        for s in self.shards.iter() {
            s.inner.lock().drain(|b| blocks.push(b));
        }
        let mut first_error = None;
        for b in blocks {
            if let Err(e) = self.release(b) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Unpins free block `b`, which no list holds any more, and retires its id.
    fn release(&self, free: FreeBlock) -> Result<()> {
        let b = self
            .arena
            .get(free.id)
            .expect("free lists hold only ids of live blocks");
        b.state.store(UNUSED, Ordering::Release);
        {
            // The index has one writer at a time: whoever holds the global lock.
            let _g = self.global.lock();
            self.index.remove(free.address);
        }
        b.ptr.store(0, Ordering::Release);
        let result = self.unpin(free.address, free.size);
        self.global.lock().free_ids.push(free.id);
        result
    }

    /// Unpins `[ptr, ptr + size)`, timing the driver call.
    pub(super) fn unpin(&self, ptr: usize, size: usize) -> Result<()> {
        let start = Instant::now();
        let result = self.pinner.unpin(ptr, size);
        self.global.lock().acc.unpinned(size, start.elapsed());
        result
    }
}

//! `malloc`: the cached path (the calling thread's shard), the best fit over every shard, and
//! new pinned memory from the driver.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::arena::{ALLOCATED, FREE};
use super::events::POLL_BATCH;
use super::shard::FreeBlock;
use super::{HostAllocator, HostBlock, MAX_REQUEST, UNROUNDED_GRANULE};
use crate::error::{Error, Result};

impl HostAllocator {
    /// Returns a pinned block of at least `size` bytes (rounded up to a power of two). A
    /// 0-byte request returns `ptr == 0` and `ctx == 0` and is not an error.
    ///
    /// Errors: `InvalidArgument` for a size no block can have, `OutOfMemory` when the driver
    /// cannot pin more even after the cache has been emptied, `Driver` for other driver
    /// failures.
    pub fn malloc(&self, size: usize) -> Result<HostBlock> {
        if size == 0 {
            return Ok(HostBlock { ptr: 0, ctx: 0 });
        }
        let need = self.round(size)?;
        if self.events.any() {
            self.poll_events(false);
        }
        let home = self.home_shard();
        let taken = {
            let mut g = self.shards[home].inner.lock();
            let b = g.take_best(need, self.round_power2);
            match b {
                Some(b) if g.fits(&[1, b.size as i64, 1]) => {
                    g.apply(&[1, b.size as i64, 1]);
                    // Under the home lock, like every change of a block's state.
                    let handed = self.hand_out(b.id, home);
                    drop(g);
                    return Ok(handed);
                }
                other => other,
            }
        };
        if let Some(b) = taken {
            // The block is ours; only the peak needs checking.
            self.account(home, &[1, b.size as i64, 1]);
            return Ok(self.hand_out(b.id, home));
        }
        self.malloc_slow(need, home)
    }

    /// The size of the block that serves a request of `size` bytes.
    pub(super) fn round(&self, size: usize) -> Result<usize> {
        if size > MAX_REQUEST {
            return Err(Error::InvalidArgument(format!(
                "cannot pin {size} bytes: the largest request is {MAX_REQUEST} bytes"
            )));
        }
        Ok(if self.round_power2 {
            size.next_power_of_two()
        } else {
            size.checked_next_multiple_of(UNROUNDED_GRANULE)
                .unwrap_or(MAX_REQUEST)
        })
    }

    /// Marks block `id`, which no free list holds, as handed out by shard `home`.
    fn hand_out(&self, id: u32, home: usize) -> HostBlock {
        let b = self
            .arena
            .get(id)
            .expect("free lists hold only ids of live blocks");
        b.home.store(home as u16, Ordering::Relaxed);
        b.state.store(ALLOCATED, Ordering::Release);
        HostBlock {
            ptr: b.ptr(),
            ctx: id as usize + 1,
        }
    }

    fn malloc_slow(&self, need: usize, home: usize) -> Result<HostBlock> {
        if let Some(b) = self.take_best_fit(need) {
            self.account(home, &[1, b.size as i64, 1]);
            return Ok(self.hand_out(b.id, home));
        }
        let ptr = match self.pin(need) {
            Err(Error::OutOfMemory(_)) => {
                // Cached blocks of other sizes may be what the driver is missing.
                let _ = self.empty_cache();
                self.pin(need)?
            }
            other => other?,
        };
        let id = match self.register(ptr, need, home) {
            Ok(id) => id,
            Err(e) => {
                let _ = self.unpin(ptr, need);
                return Err(e);
            }
        };
        self.account(home, &[1, need as i64, 1]);
        Ok(HostBlock {
            ptr,
            ctx: id as usize + 1,
        })
    }

    /// Takes the best free block for `need` bytes from any shard: the smallest, then the
    /// lowest address.
    fn take_best_fit(&self, need: usize) -> Option<FreeBlock> {
        // Another thread may take the chosen block between the search and the removal.
        for _ in 0..4 {
            let mut best: Option<(usize, FreeBlock)> = None;
            for (i, s) in self.shards.iter().enumerate() {
                if let Some(b) = s.inner.lock().best_fit(need, self.round_power2) {
                    if best.is_none_or(|(_, c)| (b.size, b.address) < (c.size, c.address)) {
                        best = Some((i, b));
                    }
                }
            }
            let (shard, b) = best?;
            if self.shards[shard].inner.lock().remove(&b) {
                return Some(b);
            }
        }
        None
    }

    /// Pins `size` bytes, timing the driver call.
    fn pin(&self, size: usize) -> Result<usize> {
        let start = Instant::now();
        let result = self.pinner.pin(size);
        let took = start.elapsed();
        let mut g = self.global.lock();
        match result {
            Ok(_) => g.acc.pinned(size, took),
            Err(_) => g.acc.pin_failed(took),
        }
        result
    }

    /// Gives the newly pinned `[ptr, ptr + size)` an id, handed out by shard `home`.
    fn register(&self, ptr: usize, size: usize, home: usize) -> Result<u32> {
        let mut g = self.global.lock();
        let id = match g.free_ids.pop() {
            Some(id) => id,
            None => {
                let id = g.next_id;
                if !self.arena.ensure(id) {
                    return Err(Error::OutOfMemory(format!(
                        "the pinned-host allocator holds {id} blocks, its most; free some or call empty_cache"
                    )));
                }
                g.next_id += 1;
                id
            }
        };
        let b = self.arena.get(id).expect("ensure backed this id");
        b.size.store(size, Ordering::Relaxed);
        b.home.store(home as u16, Ordering::Relaxed);
        b.state.store(ALLOCATED, Ordering::Relaxed);
        b.ptr.store(ptr, Ordering::Release);
        self.index.insert(ptr, id);
        Ok(id)
    }

    /// Polls the events guarding freed blocks and moves the blocks whose last event completed
    /// back to their shards. With `wait`, waits for the queue lock and goes on until no
    /// completed event is left; otherwise does one bounded batch, or nothing if another thread
    /// is polling.
    pub(super) fn poll_events(&self, wait: bool) {
        let mut freed = [0u32; POLL_BATCH];
        loop {
            let n = self
                .events
                .poll(&*self.pinner.driver, &self.pool, wait, &mut freed, |id| {
                    self.arena
                        .get(id)
                        .is_some_and(|b| b.events_left.fetch_sub(1, Ordering::AcqRel) == 1)
                });
            for &id in &freed[..n] {
                self.make_free(id, &[0, 0, -1]);
            }
            if n < POLL_BATCH || !wait {
                return;
            }
        }
    }

    /// Puts pending block `id` on its home shard's free list and applies `delta` there.
    pub(super) fn make_free(&self, id: u32, delta: &[i64; 3]) {
        let b = self.arena.get(id).expect("only live blocks are freed");
        let free = FreeBlock {
            address: b.ptr(),
            size: b.size(),
            id,
        };
        // A pending block's home does not change until it is handed out again.
        let mut g = self.shards[b.home()].inner.lock();
        b.state.store(FREE, Ordering::Release);
        g.push(free);
        g.apply(delta);
    }
}

//! `free` and `record_event`: finding a block from a pointer (and optional context), stream
//! use, and the deferral of blocks that streams may still read.

use std::sync::atomic::Ordering;

use super::arena::{Block, ALLOCATED, ALLOCATED_WITH_STREAMS, FREE, PENDING};
use super::events::Guard;
use super::shard::{FreeBlock, ShardInner};
use super::HostAllocator;
use crate::driver::{Event, Stream};
use crate::error::{Error, Result};
use crate::lock::ShardGuard;

impl HostAllocator {
    /// The block at `ptr`. A `ctx` from `malloc` avoids the lookup; a context that does not
    /// belong to `ptr` is ignored and the block is looked up by address.
    fn find(&self, ptr: usize, ctx: Option<usize>) -> Option<(u32, &Block)> {
        if let Some(id) = ctx
            .and_then(|c| c.checked_sub(1))
            .and_then(|c| u32::try_from(c).ok())
        {
            if let Some(b) = self.arena.get(id) {
                if b.ptr() == ptr {
                    return Some((id, b));
                }
            }
        }
        let id = self.index.get(ptr)?;
        let b = self.arena.get(id)?;
        (b.ptr() == ptr).then_some((id, b))
    }

    /// Frees a block returned by [`HostAllocator::malloc`]. `ctx` is the context `malloc`
    /// returned, or `None` to find the block by address. Freeing 0 does nothing.
    ///
    /// If streams used the block ([`HostAllocator::record_event`]), an event is recorded on
    /// each and the block is reused only once all have completed; the call never waits.
    ///
    /// Errors: `UnknownPointer` for an address that is not a block of this allocator or a
    /// block already freed (nothing changes); `Driver` when an event cannot be recorded (the
    /// block is then never reused, since a stream may still be reading it).
    pub fn free(&self, ptr: usize, ctx: Option<usize>) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let Some((id, b)) = self.find(ptr, ctx) else {
            return Err(Error::UnknownPointer(format!(
                "{ptr:#x} is not a block of the pinned-host allocator"
            )));
        };
        let mut g = self.lock_home(b);
        match b.state.load(Ordering::Acquire) {
            ALLOCATED => {
                b.state.store(FREE, Ordering::Release);
                let size = b.size();
                g.push(FreeBlock {
                    address: ptr,
                    size,
                    id,
                });
                g.apply(&[-1, -(size as i64), -1]);
                Ok(())
            }
            ALLOCATED_WITH_STREAMS => {
                // Active until the streams' events complete.
                b.state.store(PENDING, Ordering::Release);
                g.apply(&[-1, -(b.size() as i64), 0]);
                drop(g);
                self.free_after_streams(id, b)
            }
            _ => Err(Error::UnknownPointer(format!(
                "{ptr:#x} was already freed (double free); nothing was changed"
            ))),
        }
    }

    /// Locks the home shard of `b`. Every change of a handed-out block's state happens under
    /// this lock, which is what makes a double free detectable without a compare-and-swap.
    fn lock_home(&self, b: &Block) -> ShardGuard<'_, ShardInner> {
        loop {
            let home = b.home();
            let g = self.shards[home].inner.lock();
            // The block may have been freed and handed out by another shard meanwhile.
            if b.home() == home {
                return g;
            }
        }
    }

    /// Guards the block freed by `free`, which streams used: records an event on each stream
    /// and queues them. The block is already PENDING and off the counters of allocations.
    fn free_after_streams(&self, id: u32, b: &Block) -> Result<()> {
        // PENDING: record_event no longer touches the list.
        let mut streams = std::mem::take(&mut *b.streams.lock());
        // One extra count for this call, so the block cannot become free before every event
        // is queued.
        b.events_left
            .store(streams.len() as u32 + 1, Ordering::Release);
        let mut first_error = None;
        for &stream in &streams {
            match self.record_on(stream) {
                Ok((device, event)) => self.events.push(
                    stream,
                    Guard {
                        event,
                        device,
                        block: id,
                    },
                ),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // Hand the (empty) stream list back so its capacity is reused.
        streams.clear();
        *b.streams.lock() = streams;
        if let Some(e) = first_error {
            return Err(Error::Driver(format!(
                "{:#x} could not be guarded by a stream event ({}); it is kept out of the cache",
                b.ptr(),
                e.message()
            )));
        }
        if b.events_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.make_free(id, &[0, 0, -1]);
        }
        Ok(())
    }

    /// Records a pooled event on `stream`.
    fn record_on(&self, stream: Stream) -> Result<(usize, Event)> {
        let driver = &*self.pinner.driver;
        let device = driver.stream_device(stream)?;
        let event = self.pool.take(driver, device)?;
        match driver.event_record(device, event, stream) {
            Ok(()) => Ok((device, event)),
            Err(e) => {
                self.pool.put(device, event);
                Err(e)
            }
        }
    }

    /// Notes that `stream` uses the block at `ptr` (with `ctx` from `malloc`, or `None`), so
    /// that freeing it waits for the work queued on `stream` so far. Returns true if `ptr` is
    /// a block handed out by this allocator; for any other pointer (not ours, or already
    /// freed) returns false and changes nothing.
    pub fn record_event(&self, ptr: usize, ctx: Option<usize>, stream: Stream) -> bool {
        if ptr == 0 {
            return false;
        }
        let Some((_, b)) = self.find(ptr, ctx) else {
            return false;
        };
        let _home = self.lock_home(b);
        match b.state.load(Ordering::Acquire) {
            ALLOCATED => b.state.store(ALLOCATED_WITH_STREAMS, Ordering::Release),
            ALLOCATED_WITH_STREAMS => {}
            _ => return false,
        }
        let mut streams = b.streams.lock();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        true
    }
}

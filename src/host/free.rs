//! `free` and `record_event`: finding a block from a pointer (and optional context), stream
//! use, and the deferral of blocks that streams may still read.

use std::sync::atomic::Ordering;

use super::arena::{Block, ALLOCATED, ALLOCATED_WITH_STREAMS, PENDING};
use super::events::Guard;
use super::HostAllocator;
use crate::driver::{Event, Stream};
use crate::error::{Error, Result};

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
        match b
            .state
            .compare_exchange(ALLOCATED, PENDING, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                let size = b.size() as i64;
                self.make_free(id, &[-1, -size, -1]);
                Ok(())
            }
            Err(ALLOCATED_WITH_STREAMS) => self.free_after_streams(id, b),
            Err(_) => Err(Error::UnknownPointer(format!(
                "{ptr:#x} was already freed (double free); nothing was changed"
            ))),
        }
    }

    /// Frees a block that streams used: records an event on each stream and queues them.
    fn free_after_streams(&self, id: u32, b: &Block) -> Result<()> {
        let mut streams = {
            let mut s = b.streams.lock();
            // Under the stream lock, so record_event cannot add a stream after this.
            if b.state
                .compare_exchange(
                    ALLOCATED_WITH_STREAMS,
                    PENDING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
            {
                return Err(Error::UnknownPointer(format!(
                    "{:#x} was already freed (double free); nothing was changed",
                    b.ptr()
                )));
            }
            std::mem::take(&mut *s)
        };
        // One extra count for this call, so the block cannot become free before every event
        // is queued.
        b.events_left
            .store(streams.len() as u32 + 1, Ordering::Release);
        let size = b.size() as i64;
        let home = b.home();
        self.account(home, &[-1, -size, 0]);
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
        let mut streams = b.streams.lock();
        loop {
            match b.state.load(Ordering::Acquire) {
                ALLOCATED_WITH_STREAMS => break,
                ALLOCATED => {
                    if b.state
                        .compare_exchange(
                            ALLOCATED,
                            ALLOCATED_WITH_STREAMS,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        )
                        .is_ok()
                    {
                        break;
                    }
                }
                _ => return false,
            }
        }
        if !streams.contains(&stream) {
            streams.push(stream);
        }
        true
    }
}

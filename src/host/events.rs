//! Stream-use events: a pool of reusable driver events and the queue of events that guard
//! freed blocks.
//!
//! Events are created and destroyed only through [`EventPool::take`] (no lock held while the
//! driver creates one) and at teardown, never while a lock that allocation needs is held.
//! The queues are polled from the allocation path with `try_lock`, so a thread that finds
//! another one polling goes on without waiting, and no lock is held across an event query,
//! so a free that queues events never waits for one either.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::driver::{Driver, Event, Stream};
use crate::error::Result;

/// Blocks that polling may make free in one call; bounds the work a caller does for others.
pub(crate) const POLL_BATCH: usize = 32;

/// An event recorded on a stream that used a freed block.
#[derive(Clone, Copy)]
pub(crate) struct Guard {
    pub(crate) event: Event,
    pub(crate) device: usize,
    pub(crate) block: u32,
}

/// Idle events, per device.
pub(crate) struct EventPool {
    idle: Mutex<Vec<(usize, Event)>>,
}

impl EventPool {
    pub(crate) fn new() -> EventPool {
        EventPool {
            idle: Mutex::new(Vec::new()),
        }
    }

    /// An idle event of `device`, or a new one (created with no lock held).
    pub(crate) fn take(&self, driver: &dyn Driver, device: usize) -> Result<Event> {
        {
            let mut idle = self.idle.lock();
            if let Some(i) = idle.iter().rposition(|&(d, _)| d == device) {
                return Ok(idle.swap_remove(i).1);
            }
        }
        driver.event_create(device)
    }

    /// Returns an event for reuse.
    pub(crate) fn put(&self, device: usize, event: Event) {
        self.idle.lock().push((device, event));
    }

    /// Destroys every idle event.
    pub(crate) fn destroy_all(&self, driver: &dyn Driver) {
        let idle = std::mem::take(&mut *self.idle.lock());
        for (device, event) in idle {
            // Teardown: a failure leaves the event to the driver, nothing to recover.
            let _ = driver.event_destroy(device, event);
        }
    }
}

/// Events that guard pending blocks: one queue per stream, oldest first. Work on a stream
/// completes in order, so only the oldest event of each stream needs asking.
pub(crate) struct EventQueue {
    queues: Mutex<Vec<(Stream, VecDeque<Guard>)>>,
    /// Held by the thread that polls.
    poller: Mutex<()>,
    /// Events in the queues: the allocation path reads this before touching the lock.
    count: AtomicUsize,
}

/// Streams whose queues are kept once empty (their storage is reused); past this, empty
/// queues are dropped.
const KEEP_STREAMS: usize = 64;

impl EventQueue {
    pub(crate) fn new() -> EventQueue {
        EventQueue {
            queues: Mutex::new(Vec::new()),
            poller: Mutex::new(()),
            count: AtomicUsize::new(0),
        }
    }

    /// Whether any event is waiting. A plain load of a rarely written word.
    pub(crate) fn any(&self) -> bool {
        self.count.load(Ordering::Relaxed) != 0
    }

    /// Queues `guard`, recorded on `stream`.
    pub(crate) fn push(&self, stream: Stream, guard: Guard) {
        let mut queues = self.queues.lock();
        match queues.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, q)) => q.push_back(guard),
            None => queues.push((stream, VecDeque::from([guard]))),
        }
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Asks each stream's oldest events whether they completed. Each completed event goes
    /// back to `pool` and is reported to `complete`, which returns true when it was the
    /// block's last event; those block ids are written to `freed`, at most `freed.len()`, which
    /// bounds the work of one call. With `wait == false` the call returns at once when another
    /// thread is polling. Returns the number of ids written.
    pub(crate) fn poll(
        &self,
        driver: &dyn Driver,
        pool: &EventPool,
        wait: bool,
        freed: &mut [u32],
        mut complete: impl FnMut(u32) -> bool,
    ) -> usize {
        // One poller at a time: it alone removes entries, so the oldest event it copied out
        // is still first when it comes back to remove it.
        let _poller = if wait {
            self.poller.lock()
        } else {
            match self.poller.try_lock() {
                Some(p) => p,
                None => return 0,
            }
        };
        let mut n = 0;
        let mut stream = 0;
        while n < freed.len() {
            // The queue lock is held only to look and to remove, never across a driver call,
            // so a free that queues an event never waits for a query.
            let oldest = {
                let queues = self.queues.lock();
                let Some((_, queue)) = queues.get(stream) else {
                    break;
                };
                queue.front().copied()
            };
            let Some(guard) = oldest else {
                stream += 1;
                continue;
            };
            // Still running, or the driver cannot say: the block stays guarded.
            if !matches!(driver.event_query(guard.device, guard.event), Ok(true)) {
                stream += 1;
                continue;
            }
            self.queues.lock()[stream].1.pop_front();
            self.count.fetch_sub(1, Ordering::Relaxed);
            pool.put(guard.device, guard.event);
            if complete(guard.block) {
                freed[n] = guard.block;
                n += 1;
            }
        }
        let mut queues = self.queues.lock();
        if queues.len() > KEEP_STREAMS {
            queues.retain(|(_, q)| !q.is_empty());
        }
        n
    }

    /// Destroys every queued event (teardown only).
    pub(crate) fn destroy_all(&self, driver: &dyn Driver) {
        let queues = std::mem::take(&mut *self.queues.lock());
        self.count.store(0, Ordering::Relaxed);
        for g in queues.into_iter().flat_map(|(_, q)| q) {
            let _ = driver.event_destroy(g.device, g.event);
        }
    }
}

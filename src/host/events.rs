//! Stream-use events: a pool of reusable driver events and the queue of events that guard
//! freed blocks.
//!
//! Events are created and destroyed only through [`EventPool::take`] (no lock held while the
//! driver creates one) and at teardown, never while a lock that allocation needs is held.
//! The queue is polled from the allocation path with `try_lock`, so a thread that finds
//! another one polling goes on without waiting.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::driver::{Driver, Event};
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

/// Events that guard pending blocks, oldest first.
pub(crate) struct EventQueue {
    queue: Mutex<VecDeque<Guard>>,
    /// Events in the queue: the allocation path reads this before touching the lock.
    count: AtomicUsize,
}

impl EventQueue {
    pub(crate) fn new() -> EventQueue {
        EventQueue {
            queue: Mutex::new(VecDeque::new()),
            count: AtomicUsize::new(0),
        }
    }

    /// Whether any event is waiting. A plain load of a rarely written word.
    pub(crate) fn any(&self) -> bool {
        self.count.load(Ordering::Relaxed) != 0
    }

    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    pub(crate) fn push(&self, guard: Guard) {
        self.queue.lock().push_back(guard);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Queries events oldest first. Each completed event goes back to `pool` and is reported
    /// to `complete`, which returns the block id when that was the block's last event; those
    /// ids are written to `freed` (at most `freed.len()`). Stops at the first event still
    /// running after moving it to the back of the queue, so every event gets its turn over
    /// successive calls without any call doing unbounded work. With `wait == false` a busy
    /// queue is skipped. Returns the number of ids written.
    pub(crate) fn poll(
        &self,
        driver: &dyn Driver,
        pool: &EventPool,
        wait: bool,
        freed: &mut [u32],
        mut complete: impl FnMut(u32) -> bool,
    ) -> usize {
        let mut queue = if wait {
            self.queue.lock()
        } else {
            match self.queue.try_lock() {
                Some(q) => q,
                None => return 0,
            }
        };
        let mut n = 0;
        while n < freed.len() {
            let Some(guard) = queue.pop_front() else {
                break;
            };
            match driver.event_query(guard.device, guard.event) {
                Ok(true) => {
                    self.count.fetch_sub(1, Ordering::Relaxed);
                    pool.put(guard.device, guard.event);
                    if complete(guard.block) {
                        freed[n] = guard.block;
                        n += 1;
                    }
                }
                // Still running, or the driver cannot say: the block stays guarded.
                Ok(false) | Err(_) => {
                    queue.push_back(guard);
                    break;
                }
            }
        }
        n
    }

    /// Destroys every queued event (teardown only).
    pub(crate) fn destroy_all(&self, driver: &dyn Driver) {
        let queue = std::mem::take(&mut *self.queue.lock());
        self.count.store(0, Ordering::Relaxed);
        for g in queue {
            let _ = driver.event_destroy(g.device, g.event);
        }
    }
}

//! A per-device pool of driver events. Creating an event is expensive on a real driver, so
//! events are made once and reused; the pool's own short lock is never held across a driver
//! call, and the allocator's locks are never held while an event is created.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::driver::{Driver, Event};
use crate::error::Result;

pub(crate) struct EventPool {
    device: usize,
    free: Mutex<Vec<Event>>,
}

impl EventPool {
    pub fn new(device: usize) -> EventPool {
        EventPool {
            device,
            free: Mutex::new(Vec::new()),
        }
    }

    /// An event from the pool, or a new one from the driver.
    pub fn get(&self, driver: &Arc<dyn Driver>) -> Result<Event> {
        if let Some(e) = self.free.lock().pop() {
            return Ok(e);
        }
        driver.event_create(self.device)
    }

    /// Returns an event whose work has completed.
    pub fn put(&self, event: Event) {
        self.free.lock().push(event);
    }

    /// Destroys every pooled event (on teardown).
    pub fn destroy_all(&self, driver: &Arc<dyn Driver>) {
        let events = std::mem::take(&mut *self.free.lock());
        for e in events {
            let _ = driver.event_destroy(self.device, e);
        }
    }
}

//! A driver for tests that forwards every call to the simulated driver, letting a [`Hook`]
//! look at each call before it runs (and fail it) and after it succeeded. Included by the
//! tests that need it as `#[path = "support/hooked.rs"] mod hooked;`.

#![allow(dead_code)]

use std::sync::Arc;

use tensoralloc::driver::sim::SimDriver;
use tensoralloc::driver::{Driver, Event, MemInfo, Stream};
use tensoralloc::Result;

/// A driver call, with the arguments hooks look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    MemAlloc { size: usize },
    MemFree { ptr: usize },
    EventCreate,
    EventDestroy,
    EventRecord { stream: Stream },
    EventQuery,
    EventSynchronize,
    StreamDevice { stream: Stream },
    HostAlloc { size: usize },
    HostFree { ptr: usize },
    HostRegister { ptr: usize, size: usize },
    HostUnregister { ptr: usize },
}

impl Call {
    /// The call's name in the [`Driver`] trait.
    pub fn name(&self) -> &'static str {
        match self {
            Call::MemAlloc { .. } => "mem_alloc",
            Call::MemFree { .. } => "mem_free",
            Call::EventCreate => "event_create",
            Call::EventDestroy => "event_destroy",
            Call::EventRecord { .. } => "event_record",
            Call::EventQuery => "event_query",
            Call::EventSynchronize => "event_synchronize",
            Call::StreamDevice { .. } => "stream_device",
            Call::HostAlloc { .. } => "host_alloc",
            Call::HostFree { .. } => "host_free",
            Call::HostRegister { .. } => "host_register",
            Call::HostUnregister { .. } => "host_unregister",
        }
    }
}

/// What a test does around driver calls.
pub trait Hook: Send + Sync {
    /// Before `call` runs: an error fails the call without running it.
    fn before(&self, _call: Call) -> Result<()> {
        Ok(())
    }

    /// After `call` ran and succeeded.
    fn after(&self, _call: Call) {}
}

/// The simulated driver `sim` with `hook` around each call.
pub struct Hooked<H> {
    pub sim: Arc<SimDriver>,
    pub hook: H,
}

impl<H: Hook> Hooked<H> {
    /// Runs `call` (`run`) between the hook's two looks.
    fn around<T>(&self, call: Call, run: impl FnOnce(&SimDriver) -> Result<T>) -> Result<T> {
        self.hook.before(call)?;
        let out = run(&self.sim)?;
        self.hook.after(call);
        Ok(out)
    }
}

impl<H: Hook> Driver for Hooked<H> {
    fn name(&self) -> &'static str {
        "hooked"
    }
    fn device_count(&self) -> Result<usize> {
        self.sim.device_count()
    }
    fn mem_alloc(&self, device: usize, size: usize) -> Result<usize> {
        self.around(Call::MemAlloc { size }, |d| d.mem_alloc(device, size))
    }
    fn mem_free(&self, device: usize, ptr: usize) -> Result<()> {
        self.around(Call::MemFree { ptr }, |d| d.mem_free(device, ptr))
    }
    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.sim.mem_info(device)
    }
    fn event_create(&self, device: usize) -> Result<Event> {
        self.around(Call::EventCreate, |d| d.event_create(device))
    }
    fn event_destroy(&self, device: usize, event: Event) -> Result<()> {
        self.around(Call::EventDestroy, |d| d.event_destroy(device, event))
    }
    fn event_record(&self, device: usize, event: Event, stream: Stream) -> Result<()> {
        self.around(Call::EventRecord { stream }, |d| {
            d.event_record(device, event, stream)
        })
    }
    fn event_query(&self, device: usize, event: Event) -> Result<bool> {
        self.around(Call::EventQuery, |d| d.event_query(device, event))
    }
    fn event_synchronize(&self, device: usize, event: Event) -> Result<()> {
        self.around(Call::EventSynchronize, |d| {
            d.event_synchronize(device, event)
        })
    }
    fn stream_device(&self, stream: Stream) -> Result<usize> {
        self.around(Call::StreamDevice { stream }, |d| d.stream_device(stream))
    }
    fn host_alloc(&self, size: usize) -> Result<usize> {
        self.around(Call::HostAlloc { size }, |d| d.host_alloc(size))
    }
    fn host_free(&self, ptr: usize) -> Result<()> {
        self.around(Call::HostFree { ptr }, |d| d.host_free(ptr))
    }
    fn host_register(&self, ptr: usize, size: usize) -> Result<()> {
        self.around(Call::HostRegister { ptr, size }, |d| {
            d.host_register(ptr, size)
        })
    }
    fn host_unregister(&self, ptr: usize) -> Result<()> {
        self.around(Call::HostUnregister { ptr }, |d| d.host_unregister(ptr))
    }
}

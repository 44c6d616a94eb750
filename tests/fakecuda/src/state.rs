//! The fake driver's state: the simulated device behind it, primary contexts and each thread's
//! context stack, events, streams, allocations, and call counters.
//!
//! Device memory, event completion and pinned host memory come from tensoralloc's own
//! [`SimDriver`], so the fake behaves exactly like the simulated backend that the rest of the
//! test suite runs on; this module adds what only a real driver has (initialization, contexts,
//! handles that can be invalid).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use tensoralloc::driver::sim::{SimConfig, SimDriver};
use tensoralloc::driver::Event;

use crate::types::*;
use crate::vmm::Vmm;

/// What the fake counts. Tests read the counters through `fakecuda_counter` (whole process) and
/// `fakecuda_thread_counter` (calling thread only, immune to other tests running alongside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    MemAlloc,
    MemFree,
    EventsCreated,
    EventsCreatedWithTiming,
    EventsDestroyed,
    EventRecords,
    EventQueries,
    EventSyncs,
    HostAlloc,
    HostFree,
    HostRegister,
    HostUnregister,
    CtxGetCurrent,
    CtxSetCurrent,
    CtxPush,
    CtxPop,
    PrimaryCtxRetain,
    PrimaryCtxRelease,
    StreamGetCtx,
}

/// Counter names as tests spell them.
pub const COUNTER_NAMES: &[(&str, Counter)] = &[
    ("mem_alloc", Counter::MemAlloc),
    ("mem_free", Counter::MemFree),
    ("events_created", Counter::EventsCreated),
    (
        "events_created_with_timing",
        Counter::EventsCreatedWithTiming,
    ),
    ("events_destroyed", Counter::EventsDestroyed),
    ("event_records", Counter::EventRecords),
    ("event_queries", Counter::EventQueries),
    ("event_syncs", Counter::EventSyncs),
    ("host_alloc", Counter::HostAlloc),
    ("host_free", Counter::HostFree),
    ("host_register", Counter::HostRegister),
    ("host_unregister", Counter::HostUnregister),
    ("ctx_get_current", Counter::CtxGetCurrent),
    ("ctx_set_current", Counter::CtxSetCurrent),
    ("ctx_push", Counter::CtxPush),
    ("ctx_pop", Counter::CtxPop),
    ("primary_ctx_retain", Counter::PrimaryCtxRetain),
    ("primary_ctx_release", Counter::PrimaryCtxRelease),
    ("stream_get_ctx", Counter::StreamGetCtx),
];

const COUNTERS: usize = 19;

static GLOBAL_COUNTS: [AtomicU64; COUNTERS] = [const { AtomicU64::new(0) }; COUNTERS];

thread_local! {
    static THREAD_COUNTS: [Cell<u64>; COUNTERS] = const { [const { Cell::new(0) }; COUNTERS] };
    /// The calling thread's context stack (indices of primary contexts); the top is current.
    static CONTEXT_STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Counts one call.
pub fn count(c: Counter) {
    GLOBAL_COUNTS[c as usize].fetch_add(1, Ordering::Relaxed);
    let _ = THREAD_COUNTS.try_with(|t| t[c as usize].set(t[c as usize].get() + 1));
}

/// A counter's value for the whole process.
pub fn global_count(c: Counter) -> u64 {
    GLOBAL_COUNTS[c as usize].load(Ordering::Relaxed)
}

/// A counter's value for the calling thread.
pub fn thread_count(c: Counter) -> u64 {
    THREAD_COUNTS.try_with(|t| t[c as usize].get()).unwrap_or(0)
}

/// A primary context. Its address is the `CUcontext` handle the fake hands out.
pub struct ContextRecord {
    pub device: usize,
    /// `cuDevicePrimaryCtxRetain` calls not yet balanced by a release; the context is usable
    /// only while this is positive, as on a real driver.
    pub retains: AtomicI64,
}

/// What the fake knows about an event.
#[derive(Clone, Copy)]
pub struct EventRecord {
    pub sim: Event,
    pub device: usize,
}

/// The fake driver, made by `cuInit`.
pub struct Fake {
    pub sim: SimDriver,
    pub contexts: Vec<Box<ContextRecord>>,
    pub events: Mutex<HashMap<usize, EventRecord>>,
    /// Streams made by `cuStreamCreate`: handle -> device.
    pub streams: Mutex<HashMap<usize, usize>>,
    pub next_stream: AtomicU64,
    /// `cuMemAlloc` allocations: address -> (device, size).
    pub allocations: Mutex<HashMap<u64, (usize, usize)>>,
    pub vmm: Vmm,
}

static FAKE: OnceCell<Fake> = OnceCell::new();

/// Handles of events start here, so they never look like small integers or host pointers.
const EVENT_HANDLE_BASE: usize = 0x7e00_0000_0000;
/// Handles of streams made by `cuStreamCreate`.
const STREAM_HANDLE_BASE: usize = 0x5e00_0000_0000;

impl Fake {
    /// Initializes the fake from `TENSORALLOC_SIM_DEVICES` / `TENSORALLOC_SIM_MEMORY`.
    pub fn init() -> Result<&'static Fake, CUresult> {
        FAKE.get_or_try_init(|| {
            let config = SimConfig::from_env().map_err(|e| {
                eprintln!("fakecuda: cuInit failed: {e}");
                CUDA_ERROR_INVALID_VALUE
            })?;
            let sim = SimDriver::new(config).map_err(|e| {
                eprintln!("fakecuda: cuInit failed: {e}");
                CUDA_ERROR_OUT_OF_MEMORY
            })?;
            let contexts = (0..config.devices)
                .map(|device| {
                    Box::new(ContextRecord {
                        device,
                        retains: AtomicI64::new(0),
                    })
                })
                .collect();
            Ok(Fake {
                sim,
                contexts,
                events: Mutex::new(HashMap::new()),
                streams: Mutex::new(HashMap::new()),
                next_stream: AtomicU64::new(1),
                allocations: Mutex::new(HashMap::new()),
                vmm: Vmm::default(),
            })
        })
    }

    /// The fake, or `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
    pub fn get() -> Result<&'static Fake, CUresult> {
        FAKE.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)
    }

    pub fn device_count(&self) -> usize {
        self.contexts.len()
    }

    /// Checks a device ordinal.
    pub fn device(&self, device: CUdevice) -> Result<usize, CUresult> {
        usize::try_from(device)
            .ok()
            .filter(|&d| d < self.device_count())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// The handle of device `d`'s primary context.
    pub fn context_handle(&self, d: usize) -> CUcontext {
        &*self.contexts[d] as *const ContextRecord as CUcontext
    }

    /// The primary context a handle names, if it names one.
    pub fn context_index(&self, ctx: CUcontext) -> Result<usize, CUresult> {
        self.contexts
            .iter()
            .position(|c| std::ptr::eq(&**c, ctx as *const ContextRecord))
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// The device of the calling thread's current context, which must exist and be retained.
    pub fn current_device(&self) -> Result<usize, CUresult> {
        let top = CONTEXT_STACK
            .with(|s| s.borrow().last().copied())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if self.contexts[top].retains.load(Ordering::Relaxed) <= 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        Ok(top)
    }

    /// The device a stream belongs to. Stream 0 and the special handles 1
    /// (`CU_STREAM_LEGACY`) and 2 (`CU_STREAM_PER_THREAD`) are the current context's; streams
    /// made by `cuStreamCreate` are their context's; any other handle is taken for a stream
    /// that some other library created in the current context (device 0's when the thread has
    /// none), so that tests may use made-up stream values as they do on the simulated device.
    pub fn stream_device(&self, stream: CUstream) -> Result<usize, CUresult> {
        let s = stream as usize;
        if s <= 2 {
            return self.current_device();
        }
        if let Some(&d) = self.streams.lock().get(&s) {
            return Ok(d);
        }
        match self.current_device() {
            Ok(d) => Ok(d),
            Err(_) => Ok(0),
        }
    }

    pub fn new_stream(&self, device: usize) -> CUstream {
        let n = self.next_stream.fetch_add(1, Ordering::Relaxed) as usize;
        let handle = STREAM_HANDLE_BASE + n * 16;
        self.streams.lock().insert(handle, device);
        handle as CUstream
    }

    pub fn event_handle(sim: Event) -> CUevent {
        (EVENT_HANDLE_BASE + sim.0 as usize * 16) as CUevent
    }

    pub fn event(&self, event: CUevent) -> Result<EventRecord, CUresult> {
        self.events
            .lock()
            .get(&(event as usize))
            .copied()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
}

/// The calling thread's context stack.
pub fn with_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> T {
    CONTEXT_STACK.with(|s| f(&mut s.borrow_mut()))
}

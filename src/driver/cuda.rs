//! The NVIDIA driver backend: the CUDA driver API through cudarc's raw bindings, loaded from
//! `libcuda.so.1` at run time so the library itself loads on machines without CUDA.
//!
//! This module owns:
//! - finding the driver library before cudarc does (cudarc panics when it cannot load it), and
//!   checking that it has every entry point used here;
//! - one primary context per device (the one the CUDA runtime and PyTorch use), retained on
//!   first use of that device and released when the driver is dropped;
//! - running each call in the right context: a call for device `d` works whatever context the
//!   calling thread has current and leaves that context current afterwards; when the right
//!   context is already current it costs one `cuCtxGetCurrent` (a thread-local read in the
//!   driver) and nothing else;
//! - turning driver status codes into [`Error`]s that carry the driver's error name.

use std::ffi::{c_void, CStr, CString};
use std::ptr;

use cudarc::driver::sys::{self, CUcontext, CUresult};
use once_cell::sync::OnceCell;

use super::{Driver, Event, MemInfo, PhysHandle, Stream};
use crate::error::{Error, Result};

/// The library name the message about a missing driver speaks of (cudarc tries this name and a
/// few others, in the order [`cudarc::get_lib_name_candidates`] gives).
const LIBCUDA: &str = "libcuda.so.1";

/// Every driver entry point this backend calls, checked once at load so that an old driver is
/// reported as such instead of making cudarc panic in the middle of an allocation.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamGetCtx",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
];

/// The virtual memory management entry points: optional. A driver without them still serves
/// ordinary segments; expandable segments then fall back to them.
const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
];

/// A context handle shared between threads.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Context(CUcontext);

// SAFETY: a CUcontext is an opaque handle that the driver lets any thread use; we never
// dereference it.
unsafe impl Send for Context {}
// SAFETY: as above; sharing the handle value is sharing an integer.
unsafe impl Sync for Context {}

/// One device as the driver numbers it, and its primary context once retained.
struct DeviceSlot {
    device: sys::CUdevice,
    primary: OnceCell<Context>,
}

/// The NVIDIA driver API, loaded at run time.
pub struct CudaDriver {
    devices: Vec<DeviceSlot>,
    /// Whether the driver has `cuStreamGetCaptureInfo_v3` (CUDA 12.3 and later), the capture
    /// query PyTorch uses; older drivers answer through `cuStreamIsCapturing`.
    capture_info_v3: bool,
    /// Our own `dlopen` reference to the library cudarc uses, so it stays loaded as long as we
    /// hold handles from it.
    library: LibraryHandle,
    /// Whether the library has every virtual memory management entry point.
    has_vmm: bool,
}

/// A `dlopen` handle, closed never: the driver must outlive every handle it gave out.
struct LibraryHandle(*mut c_void);

// SAFETY: a dlopen handle may be used from any thread; we only keep it.
unsafe impl Send for LibraryHandle {}
// SAFETY: as above.
unsafe impl Sync for LibraryHandle {}

/// The explanation every "no driver" error carries.
fn no_driver_help() -> String {
    format!(
        "the NVIDIA driver library {LIBCUDA} could not be loaded: install the NVIDIA driver, or add the \
         directory that holds {LIBCUDA} to LD_LIBRARY_PATH; to run without a GPU, set \
         TENSORALLOC_DRIVER=sim to use the simulated device"
    )
}

/// Opens the driver library the way cudarc will (same names, same order), so that when this
/// succeeds cudarc's own loading succeeds too and finds the same library.
fn open_driver_library() -> Result<LibraryHandle> {
    let mut tried = Vec::new();
    for name in cudarc::get_lib_name_candidates("cuda") {
        let Ok(cname) = CString::new(name.as_str()) else {
            continue;
        };
        // SAFETY: `cname` is a valid NUL-terminated string; dlopen has no other precondition.
        let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            return Ok(LibraryHandle(handle));
        }
        if !tried.contains(&name) {
            tried.push(name);
        }
    }
    Err(Error::NoDriver(format!(
        "{} (tried {})",
        no_driver_help(),
        tried.join(", ")
    )))
}

/// Whether the library exports `name`.
fn has_symbol(library: &LibraryHandle, name: &str) -> bool {
    let cname = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: the handle came from dlopen and is never closed; the name is NUL-terminated.
    !unsafe { libc::dlsym(library.0, cname.as_ptr()) }.is_null()
}

/// Checks that the library has every entry point this backend calls.
fn check_symbols(library: &LibraryHandle) -> Result<()> {
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        .filter(|name| !has_symbol(library, name))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::NoDriver(format!(
            "the NVIDIA driver library ({LIBCUDA}) lacks {}: the driver is too old for tensoralloc \
             (it needs a CUDA 12 driver); set TENSORALLOC_DRIVER=sim to use the simulated device",
            missing.join(", ")
        )))
    }
}

/// The driver's name for a status code (`CUDA_ERROR_OUT_OF_MEMORY`) and its description.
pub(crate) fn error_text(code: CUresult) -> String {
    let mut name: *const std::ffi::c_char = ptr::null();
    let mut text: *const std::ffi::c_char = ptr::null();
    // SAFETY: both out-pointers are valid; the driver stores pointers to static strings (or
    // leaves them alone when it does not know the code).
    let (rn, rt) = unsafe {
        (
            sys::cuGetErrorName(code, &mut name),
            sys::cuGetErrorString(code, &mut text),
        )
    };
    let read = |ok: CUresult, p: *const std::ffi::c_char| {
        // SAFETY: on success the driver returns a NUL-terminated static string.
        (ok == CUresult::CUDA_SUCCESS && !p.is_null())
            .then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (read(rn, name), read(rt, text)) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("CUDA driver error {}", code as u32),
    }
}

/// `Ok` for `CUDA_SUCCESS`, otherwise a driver error naming the call and the driver's error.
/// `call` is formatted only on error (pass `format_args!`), so that a successful driver call
/// allocates nothing.
fn check(code: CUresult, call: impl std::fmt::Display) -> Result<()> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(format!(
            "{call} failed: {}",
            error_text(code)
        )))
    }
}

/// Maps each `(size, handle)` of `maps` back to back from `addr`, then makes the whole range
/// readable and writable by `prop`'s device with one `cuMemSetAccess`. All or nothing: on
/// error what this call mapped is unmapped again; the allocations stay the caller's. The
/// caller runs in the device's context.
fn map_handles(
    prop: &sys::CUmemAllocationProp,
    addr: usize,
    maps: &[(usize, PhysHandle)],
) -> Result<()> {
    // Unmaps the mappings this call made below `upto`.
    let undo = |upto: usize, e: Error| {
        let mut at = addr;
        for &(len, _) in maps {
            if at >= upto {
                break;
            }
            // [at, at + len) was mapped by this call; an error leaves it mapped.
            let _ = unmap(at, len);
            at += len;
        }
        e
    };
    let mut at = addr;
    for &(len, h) in maps {
        // SAFETY: the handle holds `len` bytes; the driver validates the range.
        let mapped = check(
            unsafe {
                sys::cuMemMap(
                    at as sys::CUdeviceptr,
                    len,
                    0,
                    h.0 as sys::CUmemGenericAllocationHandle,
                    0,
                )
            },
            format_args!("cuMemMap({at:#x}, {len})"),
        );
        if let Err(e) = mapped {
            return Err(undo(at, e));
        }
        at += len;
    }
    set_access(prop, addr, at - addr).map_err(|e| undo(at, e))
}

/// Makes `[addr, addr + size)`, just mapped for `prop`'s device, readable and writable by
/// it with one `cuMemSetAccess`. The caller runs in the device's context.
fn set_access(prop: &sys::CUmemAllocationProp, addr: usize, size: usize) -> Result<()> {
    let desc = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid access descriptor; the driver validates the range.
    check(
        unsafe { sys::cuMemSetAccess(addr as sys::CUdeviceptr, size, &desc, 1) },
        format_args!("cuMemSetAccess({addr:#x}, {size})"),
    )
}

/// Unmaps `[addr, addr + size)` (`cuMemUnmap`), leaving its physical allocation alive. The
/// caller runs in the device's context.
fn unmap(addr: usize, size: usize) -> Result<()> {
    // SAFETY: the driver validates the range; VMM symbols exist (checked by `vmm_prop`).
    check(
        unsafe { sys::cuMemUnmap(addr as sys::CUdeviceptr, size) },
        format_args!("cuMemUnmap({addr:#x}, {size})"),
    )
}

/// Gives physical allocation `handle`, mapped nowhere, back to the driver (`cuMemRelease`).
/// The caller runs in the device's context.
fn release(handle: PhysHandle) -> Result<()> {
    // SAFETY: the driver validates the handle; VMM symbols exist (checked by `vmm_prop`).
    check(
        unsafe { sys::cuMemRelease(handle.0 as sys::CUmemGenericAllocationHandle) },
        "cuMemRelease",
    )
}

/// Pops the context that [`CudaDriver::in_context`] pushed, also when the body unwinds.
struct PopOnDrop;

impl Drop for PopOnDrop {
    fn drop(&mut self) {
        let mut popped: CUcontext = ptr::null_mut();
        // SAFETY: pops the context pushed just before this guard was made, on the same thread.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

impl CudaDriver {
    /// Loads the NVIDIA driver (`libcuda.so.1`, found through the usual library search path and
    /// `LD_LIBRARY_PATH`), initializes it and counts its devices. Contexts are made later, on
    /// first use of each device.
    ///
    /// Fails with [`Error::NoDriver`] when the library cannot be loaded, lacks an entry point
    /// this backend needs, or `cuInit` fails (no device, driver/kernel mismatch...).
    pub fn load() -> Result<CudaDriver> {
        let library = open_driver_library()?;
        check_symbols(&library)?;
        // SAFETY: the library is loaded and has this symbol (checked above), so cudarc's lazy
        // loader will not panic; cuInit takes flags 0.
        let r = unsafe { sys::cuInit(0) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::NoDriver(format!(
                "the NVIDIA driver ({LIBCUDA}) loaded but cuInit failed: {}; set TENSORALLOC_DRIVER=sim to \
                 use the simulated device",
                error_text(r)
            )));
        }
        let mut count = 0;
        // SAFETY: valid out-pointer; the driver is initialized.
        check(
            unsafe { sys::cuDeviceGetCount(&mut count) },
            "cuDeviceGetCount",
        )?;
        let mut devices = Vec::with_capacity(count.max(0) as usize);
        for ordinal in 0..count {
            let mut device = 0;
            // SAFETY: valid out-pointer, ordinal below the device count.
            check(
                unsafe { sys::cuDeviceGet(&mut device, ordinal) },
                "cuDeviceGet",
            )?;
            devices.push(DeviceSlot {
                device,
                primary: OnceCell::new(),
            });
        }
        let has_vmm = VMM_SYMBOLS.iter().all(|name| has_symbol(&library, name));
        let capture_info_v3 = has_symbol(&library, "cuStreamGetCaptureInfo_v3");
        Ok(CudaDriver {
            devices,
            capture_info_v3,
            library,
            has_vmm,
        })
    }

    /// The allocation properties of pinned device memory on `device`.
    fn vmm_prop(&self, device: usize) -> Result<sys::CUmemAllocationProp> {
        let slot = self.slot(device)?;
        if !self.has_vmm {
            return Err(Error::Driver(format!(
                "the NVIDIA driver library ({LIBCUDA}) has no virtual memory management entry points"
            )));
        }
        // SAFETY: a plain C struct for which all-zero bytes are a valid (empty) value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = slot.device;
        Ok(prop)
    }

    fn slot(&self, device: usize) -> Result<&DeviceSlot> {
        self.devices.get(device).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device {device} does not exist: the NVIDIA driver sees {} device(s)",
                self.devices.len()
            ))
        })
    }

    /// The primary context of `device`, retained on first use.
    fn primary_context(&self, device: usize) -> Result<Context> {
        let slot = self.slot(device)?;
        slot.primary
            .get_or_try_init(|| {
                let mut ctx: CUcontext = ptr::null_mut();
                // SAFETY: valid out-pointer and a device handle obtained from cuDeviceGet.
                check(
                    unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, slot.device) },
                    "cuDevicePrimaryCtxRetain",
                )
                .map_err(|e| Error::Driver(format!("device {device}: {}", e.message())))?;
                Ok(Context(ctx))
            })
            .copied()
    }

    /// The calling thread's current context (null when it has none).
    fn current_context() -> Result<Context> {
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
        Ok(Context(ctx))
    }

    /// Runs `f` with `ctx` current on this thread, then restores the thread's own context.
    /// When `ctx` already is current, this costs the one `cuCtxGetCurrent` query.
    fn in_context<T>(ctx: Context, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if Self::current_context()? == ctx {
            return f();
        }
        // SAFETY: `ctx` is a live context (a retained primary context or one the driver gave
        // us for a stream); PopOnDrop pops it on this thread before we return.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(ctx.0) },
            "cuCtxPushCurrent",
        )?;
        let _pop = PopOnDrop;
        f()
    }

    /// Runs `f` in the primary context of `device`.
    fn in_device<T>(&self, device: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let ctx = self.primary_context(device)?;
        Self::in_context(ctx, f).map_err(|e| match e {
            Error::Driver(m) => Error::Driver(format!("device {device}: {m}")),
            other => other,
        })
    }

    /// Runs `f` in the calling thread's context, or in device 0's primary context when the
    /// thread has none (host calls need some context; portable memory works with all).
    fn in_any_context<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if Self::current_context()?.0.is_null() {
            self.in_device(0, f)
        } else {
            f()
        }
    }

    /// The device index of a context: one of our primary contexts (no driver call), or
    /// whatever `cuCtxGetDevice` says with it current.
    fn context_device(&self, ctx: Context) -> Result<usize> {
        if let Some(i) = self
            .devices
            .iter()
            .position(|s| s.primary.get() == Some(&ctx))
        {
            return Ok(i);
        }
        let ordinal = Self::in_context(ctx, || {
            let mut device = 0;
            // SAFETY: valid out-pointer; `ctx` is current.
            check(
                unsafe { sys::cuCtxGetDevice(&mut device) },
                "cuCtxGetDevice",
            )?;
            Ok(device)
        })?;
        self.devices
            .iter()
            .position(|s| s.device == ordinal)
            .ok_or_else(|| {
                Error::Driver(format!("cuCtxGetDevice returned unknown device {ordinal}"))
            })
    }

    /// A test control exported by the fake driver library (`tests/fakecuda`), when the loaded
    /// `libcuda.so.1` is that fake; `None` with NVIDIA's driver.
    fn fake_control(&self, name: &str) -> Option<*mut c_void> {
        let cname = CString::new(name).ok()?;
        // SAFETY: the handle came from dlopen and is never closed; the name is NUL-terminated.
        let p = unsafe { libc::dlsym(self.library.0, cname.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    fn not_fake(what: &str) -> Error {
        Error::InvalidArgument(format!(
            "{what} needs the simulated device: the loaded libcuda.so.1 is a real NVIDIA driver \
             (use TENSORALLOC_DRIVER=sim, or the fake driver of the test suite)"
        ))
    }

    /// On the fake driver of the test suite: holds `stream`, so that events recorded on it stay
    /// pending until [`CudaDriver::fake_release_stream`]. Fails on a real driver.
    pub fn fake_hold_stream(&self, stream: Stream) -> Result<()> {
        let f = self
            .fake_control("fakecuda_hold_stream")
            .ok_or_else(|| Self::not_fake("holding a stream"))?;
        // SAFETY: the fake exports `void fakecuda_hold_stream(CUstream)`.
        let f: extern "C" fn(sys::CUstream) = unsafe { std::mem::transmute(f) };
        f(stream as sys::CUstream);
        Ok(())
    }

    /// On the fake driver of the test suite: completes the events recorded on a held stream.
    /// Fails on a real driver.
    pub fn fake_release_stream(&self, stream: Stream) -> Result<()> {
        let f = self
            .fake_control("fakecuda_release_stream")
            .ok_or_else(|| Self::not_fake("releasing a stream"))?;
        // SAFETY: the fake exports `void fakecuda_release_stream(CUstream)`.
        let f: extern "C" fn(sys::CUstream) = unsafe { std::mem::transmute(f) };
        f(stream as sys::CUstream);
        Ok(())
    }

    /// On the fake driver of the test suite: bytes of device memory handed out on `device`.
    /// Fails on a real driver.
    pub fn fake_device_used(&self, device: usize) -> Result<u64> {
        self.slot(device)?;
        let f = self
            .fake_control("fakecuda_device_used")
            .ok_or_else(|| Self::not_fake("device usage"))?;
        // SAFETY: the fake exports `uint64_t fakecuda_device_used(int)`.
        let f: extern "C" fn(std::ffi::c_int) -> u64 = unsafe { std::mem::transmute(f) };
        Ok(f(device as std::ffi::c_int))
    }

    /// Calls the fake driver's control `int name(CUstream)`. Fails on a real driver.
    fn fake_stream_control(&self, name: &str, stream: Stream) -> Result<std::ffi::c_int> {
        let f = self
            .fake_control(name)
            .ok_or_else(|| Self::not_fake("simulated graph capture"))?;
        // SAFETY: the fake exports the capture controls as `int name(CUstream)`.
        let f: extern "C" fn(sys::CUstream) -> std::ffi::c_int = unsafe { std::mem::transmute(f) };
        Ok(f(stream as sys::CUstream))
    }

    /// On the fake driver of the test suite: begins capturing `stream` into a graph for the
    /// calling thread. Fails on a real driver.
    pub fn fake_begin_capture(&self, stream: Stream) -> Result<()> {
        match self.fake_stream_control("fakecuda_begin_capture", stream)? {
            0 => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "stream {stream:#x} is already capturing"
            ))),
        }
    }

    /// On the fake driver of the test suite: ends the capture of `stream`; fails when it was
    /// not capturing or the capture was invalidated. Fails on a real driver.
    pub fn fake_end_capture(&self, stream: Stream) -> Result<()> {
        match self.fake_stream_control("fakecuda_end_capture", stream)? {
            0 => Ok(()),
            1 => Err(Error::Driver(format!(
                "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: the capture of stream {stream:#x} was invalidated"
            ))),
            _ => Err(Error::InvalidArgument(format!(
                "stream {stream:#x} is not capturing"
            ))),
        }
    }

    /// The primary context of `device` if it has been retained (for tests and diagnostics).
    pub fn retained_primary_context(&self, device: usize) -> Option<usize> {
        self.devices
            .get(device)?
            .primary
            .get()
            .map(|c| c.0 as usize)
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        for slot in &self.devices {
            if slot.primary.get().is_some() {
                // SAFETY: balances the one cuDevicePrimaryCtxRetain made for this device.
                unsafe { sys::cuDevicePrimaryCtxRelease_v2(slot.device) };
            }
        }
    }
}

/// The calling thread in relaxed stream-capture mode until dropped (then back in its own mode),
/// as PyTorch does around `cudaMalloc`.
struct RelaxedCapture(sys::CUstreamCaptureMode);

impl RelaxedCapture {
    fn enter() -> Result<RelaxedCapture> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer; the call swaps the thread's mode with `mode`.
        check(
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
            "cuThreadExchangeStreamCaptureMode",
        )?;
        Ok(RelaxedCapture(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.0;
        // SAFETY: a valid in/out pointer; restores the mode saved by `enter`.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

fn event_handle(event: Event) -> sys::CUevent {
    event.0 as usize as sys::CUevent
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.devices.len())
    }

    fn mem_alloc(&self, device: usize, size: usize) -> Result<usize> {
        self.in_device(device, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // In relaxed capture mode, so that an allocation while some stream of this thread
            // (or, in global mode, of any thread) captures a graph does not invalidate it.
            let r = {
                let _relaxed = RelaxedCapture::enter()?;
                // SAFETY: valid out-pointer; the device's context is current.
                unsafe { sys::cuMemAlloc_v2(&mut ptr, size) }
            };
            if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                let info = match self.mem_info(device) {
                    Ok(i) => format!("{} bytes free of {}", i.free, i.total),
                    Err(_) => "free memory unknown".into(),
                };
                return Err(Error::OutOfMemory(format!(
                    "device {device}: cuMemAlloc of {size} bytes failed: {} ({info})",
                    error_text(r)
                )));
            }
            check(r, format_args!("cuMemAlloc of {size} bytes"))?;
            Ok(ptr as usize)
        })
    }

    fn mem_free(&self, device: usize, ptr: usize) -> Result<()> {
        self.in_device(device, || {
            // SAFETY: the driver validates the address; the device's context is current.
            check(
                unsafe { sys::cuMemFree_v2(ptr as sys::CUdeviceptr) },
                format_args!("cuMemFree({ptr:#x})"),
            )
        })
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.in_device(device, || {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: valid out-pointers; the device's context is current.
            check(
                unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
                "cuMemGetInfo",
            )?;
            Ok(MemInfo {
                free: free as u64,
                total: total as u64,
            })
        })
    }

    fn event_create(&self, device: usize) -> Result<Event> {
        self.in_device(device, || {
            let mut event: sys::CUevent = ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            // SAFETY: valid out-pointer; the device's context is current.
            check(
                unsafe { sys::cuEventCreate(&mut event, flags) },
                "cuEventCreate",
            )?;
            Ok(Event(event as usize as u64))
        })
    }

    fn event_destroy(&self, device: usize, event: Event) -> Result<()> {
        self.in_device(device, || {
            // SAFETY: the driver validates the handle.
            check(
                unsafe { sys::cuEventDestroy_v2(event_handle(event)) },
                "cuEventDestroy",
            )
        })
    }

    fn event_record(&self, device: usize, event: Event, stream: Stream) -> Result<()> {
        // In the device's context: stream 0 means that context's legacy default stream.
        self.in_device(device, || {
            // SAFETY: the driver validates both handles.
            check(
                unsafe { sys::cuEventRecord(event_handle(event), stream as sys::CUstream) },
                "cuEventRecord",
            )
        })
    }

    fn event_query(&self, _device: usize, event: Event) -> Result<bool> {
        // An event carries its context: no switch needed, which keeps this polling call cheap.
        // SAFETY: the driver validates the handle.
        match unsafe { sys::cuEventQuery(event_handle(event)) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|()| false),
        }
    }

    fn event_synchronize(&self, _device: usize, event: Event) -> Result<()> {
        // SAFETY: the driver validates the handle.
        check(
            unsafe { sys::cuEventSynchronize(event_handle(event)) },
            "cuEventSynchronize",
        )
    }

    fn stream_device(&self, stream: Stream) -> Result<usize> {
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer; the driver validates the stream handle.
        let r = unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) };
        if stream == 0 && (r == CUresult::CUDA_ERROR_INVALID_CONTEXT || ctx.is_null()) {
            // The legacy stream of a thread with no current context: device 0.
            return Ok(0);
        }
        check(r, format_args!("cuStreamGetCtx({stream:#x})"))?;
        self.context_device(Context(ctx))
    }

    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let h = stream as sys::CUstream;
        let r = if self.capture_info_v3 {
            // SAFETY: the driver has this entry point (checked at load); a valid out-pointer
            // for the status, and every other output is optional (NULL). The driver validates
            // the stream handle.
            unsafe {
                sys::cuStreamGetCaptureInfo_v3(
                    h,
                    &mut status,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    ptr::null_mut(),
                    ptr::null_mut(),
                    ptr::null_mut(),
                )
            }
        } else {
            // SAFETY: a valid out-pointer; the driver validates the stream handle.
            unsafe { sys::cuStreamIsCapturing(h, &mut status) }
        };
        check(r, format_args!("cuStreamGetCaptureInfo({stream:#x})"))?;
        // An invalidated capture is still a capture until it ends: the same calls stay illegal.
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn host_alloc(&self, size: usize) -> Result<usize> {
        self.in_any_context(|| {
            let mut p: *mut c_void = ptr::null_mut();
            // SAFETY: valid out-pointer; a context is current.
            let r = unsafe { sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE) };
            if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(Error::OutOfMemory(format!(
                    "cuMemHostAlloc of {size} bytes of pinned host memory failed: {}",
                    error_text(r)
                )));
            }
            check(r, format_args!("cuMemHostAlloc of {size} bytes"))?;
            Ok(p as usize)
        })
    }

    fn host_free(&self, ptr: usize) -> Result<()> {
        self.in_any_context(|| {
            // SAFETY: the driver validates the pointer.
            check(
                unsafe { sys::cuMemFreeHost(ptr as *mut c_void) },
                format_args!("cuMemFreeHost({ptr:#x})"),
            )
        })
    }

    fn host_register(&self, ptr: usize, size: usize) -> Result<()> {
        self.in_any_context(|| {
            // SAFETY: the driver validates the range; the caller owns the pages.
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    ptr as *mut c_void,
                    size,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            };
            check(r, format_args!("cuMemHostRegister({ptr:#x}, {size})"))
        })
    }

    fn host_unregister(&self, ptr: usize) -> Result<()> {
        self.in_any_context(|| {
            // SAFETY: the driver validates the pointer.
            check(
                unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) },
                format_args!("cuMemHostUnregister({ptr:#x})"),
            )
        })
    }

    fn vmm_granularity(&self, device: usize) -> Result<usize> {
        let prop = self.vmm_prop(device)?;
        self.in_device(device, || {
            let mut granularity = 0usize;
            // SAFETY: valid out-pointer and property struct; the VMM symbols exist (checked at
            // load), so cudarc's loader does not panic.
            check(
                unsafe {
                    sys::cuMemGetAllocationGranularity(
                        &mut granularity,
                        &prop,
                        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                    )
                },
                "cuMemGetAllocationGranularity",
            )?;
            if granularity == 0 || !granularity.is_power_of_two() {
                return Err(Error::Driver(format!(
                    "cuMemGetAllocationGranularity returned {granularity}, not a power of two"
                )));
            }
            Ok(granularity)
        })
    }

    fn vmm_reserve(&self, device: usize, size: usize) -> Result<usize> {
        self.vmm_prop(device)?;
        self.in_device(device, || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: valid out-pointer; no fixed address, default alignment; VMM symbols exist.
            let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) };
            if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(Error::OutOfMemory(format!(
                    "device {device}: cuMemAddressReserve of {size} bytes failed: {} (virtual address space exhausted)",
                    error_text(r)
                )));
            }
            check(r, format_args!("cuMemAddressReserve of {size} bytes"))?;
            Ok(ptr as usize)
        })
    }

    fn vmm_free_range(&self, device: usize, addr: usize, size: usize) -> Result<()> {
        self.vmm_prop(device)?;
        self.in_device(device, || {
            // SAFETY: the driver validates the range; VMM symbols exist.
            check(
                unsafe { sys::cuMemAddressFree(addr as sys::CUdeviceptr, size) },
                format_args!("cuMemAddressFree({addr:#x}, {size})"),
            )
        })
    }

    fn vmm_map_many(
        &self,
        device: usize,
        addr: usize,
        size: usize,
        handle: usize,
        handles: &mut Vec<PhysHandle>,
    ) -> Result<()> {
        let prop = self.vmm_prop(device)?;
        if handle == 0 {
            return Err(Error::InvalidArgument(
                "physical allocations of 0 bytes".into(),
            ));
        }
        self.in_device(device, || {
            // Releases the allocations this call created, mapped nowhere (an error only leaks
            // one).
            let release_all = |made: &[(usize, PhysHandle)]| {
                for &(_, h) in made {
                    let _ = release(h);
                }
            };
            let mut made = Vec::with_capacity(size.div_ceil(handle));
            let mut at = addr;
            while at < addr + size {
                let len = handle.min(addr + size - at);
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: valid out-pointer and property struct; VMM symbols exist.
                let r = unsafe { sys::cuMemCreate(&mut h, len, &prop, 0) };
                let created = if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    Err(Error::OutOfMemory(format!(
                        "device {device}: cuMemCreate of {len} bytes failed: {}",
                        error_text(r)
                    )))
                } else {
                    check(r, format_args!("cuMemCreate of {len} bytes"))
                };
                if let Err(e) = created {
                    release_all(&made);
                    return Err(e);
                }
                made.push((len, PhysHandle(h)));
                at += len;
            }
            if let Err(e) = map_handles(&prop, addr, &made) {
                release_all(&made);
                return Err(e);
            }
            handles.extend(made.into_iter().map(|(_, h)| h));
            Ok(())
        })
    }

    fn vmm_unmap_keep(&self, device: usize, maps: &[(usize, usize, PhysHandle)]) -> Result<()> {
        self.vmm_prop(device)?;
        self.in_device(device, || {
            // The physical allocations stay alive (released only by `vmm_release`).
            maps.iter()
                .try_for_each(|&(addr, size, _)| unmap(addr, size))
        })
    }

    fn vmm_map_kept(&self, device: usize, addr: usize, maps: &[(usize, PhysHandle)]) -> Result<()> {
        let prop = self.vmm_prop(device)?;
        self.in_device(device, || map_handles(&prop, addr, maps))
    }

    fn vmm_release(&self, device: usize, handle: PhysHandle) -> Result<()> {
        self.vmm_prop(device)?;
        self.in_device(device, || release(handle))
    }

    fn vmm_unmap(&self, device: usize, addr: usize, size: usize, handle: PhysHandle) -> Result<()> {
        self.vmm_prop(device)?;
        // The handle's only mapping goes first, then the allocation.
        self.in_device(device, || unmap(addr, size).and_then(|()| release(handle)))
    }
}

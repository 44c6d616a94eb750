//! A fake NVIDIA driver library (`libcuda.so.1`) over tensoralloc's simulated device.
//!
//! It exports, with NVIDIA's prototypes, every driver function tensoralloc's CUDA backend calls
//! (and the virtual-memory, host-pinning and IPC functions later work will call), so the
//! production backend can be driven end to end on machines without a GPU. It behaves like a
//! driver where tensoralloc could get it wrong: `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`,
//! one context stack per thread and `CUDA_ERROR_INVALID_CONTEXT` for calls that need a current
//! context and have none, `CUDA_ERROR_INVALID_HANDLE` / `CUDA_ERROR_INVALID_VALUE` for unknown
//! handles and pointers, `CUDA_ERROR_NOT_READY` for pending events, `CUDA_ERROR_OUT_OF_MEMORY`
//! past the device's capacity. Device count and capacity come from `TENSORALLOC_SIM_DEVICES`
//! and `TENSORALLOC_SIM_MEMORY`, as for the simulated device.
//!
//! Test controls (`fakecuda_*`) are exported too: this library holds its own copy of the
//! simulator's globals, so tests reach them with `dlsym`.
//!
//! Every exported driver function is `unsafe`: its safety contract is NVIDIA's documentation
//! of that function (valid pointers where pointers are expected).

#![deny(unsafe_op_in_unsafe_fn)]
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::sync::atomic::Ordering;

use tensoralloc::driver::{sim, Driver};
use tensoralloc::Error;

pub mod state;
pub mod types;
pub mod vmm;

use state::{count, with_stack, Counter, EventRecord, Fake, COUNTER_NAMES};
use types::*;

/// Runs the body of an exported function: its error code, or `CUDA_ERROR_UNKNOWN` if it panicked.
fn guard(body: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Stores `value` through an out-pointer from the caller.
///
/// # Safety
/// `out` is NULL or valid for writes of a `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-NULL, and the caller promises it is valid for writes.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads a struct through a pointer from the caller.
///
/// # Safety
/// `p` is NULL or valid for reads of a `T`.
unsafe fn get<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-NULL, and the caller promises it is valid for reads.
    Ok(unsafe { p.read() })
}

/// Defines the exported driver functions and [`EXPORTS`], the list of their names and
/// parameter types that the prototype check compares with NVIDIA's `cuda.h`.
macro_rules! driver_api {
    ($(#[doc = $first:literal])* fn $($rest:tt)*) => {
        driver_api! { exports EXPORTS; $(#[doc = $first])* fn $($rest)* }
    };
    (exports $list:ident; $(
        $(#[doc = $doc:literal])*
        fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block
    )*) => {
        $(
            $(#[doc = $doc])*
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                guard(move || $body)
            }
        )*

        /// Every exported driver function: its name and the Rust spelling of its parameter
        /// types (each returns `CUresult`).
        pub const $list: &[(&str, &[&str])] = &[$((stringify!($name), &[$(stringify!($ty)),*])),*];
    };
}
pub(crate) use driver_api;

// Modules that define driver functions with `driver_api!` come after the macro (textual scope).
pub mod capture;
pub mod entry;
pub mod memops;

/// Every exported driver function of the crate, from each file that defines some.
pub fn all_exports() -> impl Iterator<Item = &'static (&'static str, &'static [&'static str])> {
    EXPORTS
        .iter()
        .chain(capture::CAPTURE_EXPORTS)
        .chain(memops::EXPORTS)
        .chain(entry::EXPORTS)
}

driver_api! {
    /// Initializes the fake driver. `Flags` must be 0.
    fn cuInit(Flags: c_uint) {
        if Flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Fake::init().map(|_| ())
    }

    /// The driver's CUDA version (12.6).
    fn cuDriverGetVersion(driverVersion: *mut c_int) {
        // SAFETY: the caller passes a valid out-pointer (NVIDIA's contract).
        unsafe { put(driverVersion, 12060) }
    }

    /// The number of simulated devices.
    fn cuDeviceGetCount(count: *mut c_int) {
        let fake = Fake::get()?;
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(count, fake.device_count() as c_int) }
    }

    /// The device handle of an ordinal (the ordinal itself).
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        let d = Fake::get()?.device(ordinal)?;
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(device, d as CUdevice) }
    }

    /// Retains a device's primary context; it stays usable while retained.
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        let fake = Fake::get()?;
        let d = fake.device(dev)?;
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(pctx, fake.context_handle(d)) }?;
        fake.contexts[d].retains.fetch_add(1, Ordering::Relaxed);
        count(Counter::PrimaryCtxRetain);
        Ok(())
    }

    /// Releases a retain of a device's primary context.
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        let fake = Fake::get()?;
        let d = fake.device(dev)?;
        let retains = &fake.contexts[d].retains;
        if retains.fetch_sub(1, Ordering::Relaxed) <= 0 {
            retains.fetch_add(1, Ordering::Relaxed);
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        count(Counter::PrimaryCtxRelease);
        Ok(())
    }

    /// The calling thread's current context, or NULL.
    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        let fake = Fake::get()?;
        count(Counter::CtxGetCurrent);
        let top = with_stack(|s| s.last().copied());
        let handle = top.map_or(std::ptr::null_mut(), |d| fake.context_handle(d));
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(pctx, handle) }
    }

    /// Makes `ctx` current (replacing the top of the stack); NULL unbinds the current context.
    fn cuCtxSetCurrent(ctx: CUcontext) {
        let fake = Fake::get()?;
        count(Counter::CtxSetCurrent);
        if ctx.is_null() {
            with_stack(|s| s.pop());
            return Ok(());
        }
        let d = fake.context_index(ctx)?;
        with_stack(|s| match s.last_mut() {
            Some(top) => *top = d,
            None => s.push(d),
        });
        Ok(())
    }

    /// Pushes `ctx` on the calling thread's context stack.
    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        let fake = Fake::get()?;
        count(Counter::CtxPush);
        let d = fake.context_index(ctx)?;
        with_stack(|s| s.push(d));
        Ok(())
    }

    /// Pops the calling thread's current context and returns it through `pctx` (may be NULL).
    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) {
        let fake = Fake::get()?;
        count(Counter::CtxPop);
        let d = with_stack(|s| s.pop()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: non-NULL out-pointer from the caller.
            unsafe { put(pctx, fake.context_handle(d)) }?;
        }
        Ok(())
    }

    /// The device of the current context.
    fn cuCtxGetDevice(device: *mut CUdevice) {
        let d = Fake::get()?.current_device()?;
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(device, d as CUdevice) }
    }

    /// The name of a status code (`CUDA_ERROR_OUT_OF_MEMORY`); `CUDA_ERROR_INVALID_VALUE` and
    /// NULL for codes it does not know. Works before `cuInit`, as NVIDIA's does.
    fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) {
        let text = ERROR_TEXT.iter().find(|(code, _, _)| *code == error).map(|(_, name, _)| *name);
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(pStr, text.map_or(std::ptr::null(), CStr::as_ptr)) }?;
        text.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// The description of a status code ("out of memory"); like `cuGetErrorName` otherwise.
    fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) {
        let text = ERROR_TEXT.iter().find(|(code, _, _)| *code == error).map(|(_, _, text)| *text);
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(pStr, text.map_or(std::ptr::null(), CStr::as_ptr)) }?;
        text.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Allocates device memory in the current context's device.
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) {
        let fake = Fake::get()?;
        let d = fake.current_device()?;
        if dptr.is_null() || bytesize == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        capture::check_alloc()?;
        let p = fake.sim.mem_alloc(d, bytesize).map_err(|e| match e {
            Error::OutOfMemory(_) => CUDA_ERROR_OUT_OF_MEMORY,
            _ => CUDA_ERROR_INVALID_VALUE,
        })?;
        fake.allocations.lock().insert(p as u64, (d, bytesize));
        count(Counter::MemAlloc);
        // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
        unsafe { put(dptr, p as CUdeviceptr) }
    }

    /// Frees memory from `cuMemAlloc`; needs a current context (any).
    fn cuMemFree_v2(dptr: CUdeviceptr) {
        let fake = Fake::get()?;
        fake.current_device()?;
        let (d, _) = fake.allocations.lock().remove(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        fake.sim.mem_free(d, dptr as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        count(Counter::MemFree);
        Ok(())
    }

    /// Free and total memory of the current context's device.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let fake = Fake::get()?;
        let d = fake.current_device()?;
        let info = fake.sim.mem_info(d).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        // SAFETY: the caller passes valid out-pointers.
        unsafe {
            put(free, info.free as usize)?;
            put(total, info.total as usize)
        }
    }

    /// Creates an event in the current context. Flags: `CU_EVENT_BLOCKING_SYNC` (1),
    /// `CU_EVENT_DISABLE_TIMING` (2), `CU_EVENT_INTERPROCESS` (4).
    fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) {
        let fake = Fake::get()?;
        let d = fake.current_device()?;
        if phEvent.is_null() || Flags & !7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let sim_event = fake.sim.event_create(d).map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        let handle = Fake::event_handle(sim_event);
        fake.events.lock().insert(handle as usize, EventRecord { sim: sim_event, device: d });
        count(Counter::EventsCreated);
        if Flags & 2 == 0 {
            count(Counter::EventsCreatedWithTiming);
        }
        // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
        unsafe { put(phEvent, handle) }
    }

    /// Destroys an event.
    fn cuEventDestroy_v2(hEvent: CUevent) {
        let fake = Fake::get()?;
        let ev = fake.events.lock().remove(&(hEvent as usize)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        fake.sim.event_destroy(ev.device, ev.sim).map_err(|_| CUDA_ERROR_INVALID_HANDLE)?;
        count(Counter::EventsDestroyed);
        Ok(())
    }

    /// Records an event on a stream of the event's own context (`CUDA_ERROR_INVALID_HANDLE`
    /// otherwise, as on a real driver).
    fn cuEventRecord(hEvent: CUevent, hStream: CUstream) {
        let fake = Fake::get()?;
        let ev = fake.event(hEvent)?;
        let stream_device = fake.stream_device(hStream)?;
        if stream_device != ev.device {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        fake.sim.event_record(ev.device, ev.sim, hStream as usize).map_err(|_| CUDA_ERROR_INVALID_HANDLE)?;
        count(Counter::EventRecords);
        Ok(())
    }

    /// `CUDA_SUCCESS` when the event's work is done, `CUDA_ERROR_NOT_READY` while it is pending.
    fn cuEventQuery(hEvent: CUevent) {
        let fake = Fake::get()?;
        let ev = fake.event(hEvent)?;
        count(Counter::EventQueries);
        match fake.sim.event_query(ev.device, ev.sim) {
            Ok(true) => Ok(()),
            Ok(false) => Err(CUDA_ERROR_NOT_READY),
            Err(_) => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }

    /// Waits for the event's work (which completes it, on the simulated device).
    fn cuEventSynchronize(hEvent: CUevent) {
        let fake = Fake::get()?;
        let ev = fake.event(hEvent)?;
        fake.sim.event_synchronize(ev.device, ev.sim).map_err(|_| CUDA_ERROR_INVALID_HANDLE)?;
        count(Counter::EventSyncs);
        Ok(())
    }

    /// The context a stream belongs to (see `Fake::stream_device` for made-up handles).
    fn cuStreamGetCtx(hStream: CUstream, pctx: *mut CUcontext) {
        let fake = Fake::get()?;
        count(Counter::StreamGetCtx);
        let d = fake.stream_device(hStream)?;
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(pctx, fake.context_handle(d)) }
    }

    /// Creates a stream in the current context. Flags: `CU_STREAM_NON_BLOCKING` (1).
    fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) {
        let fake = Fake::get()?;
        let d = fake.current_device()?;
        if phStream.is_null() || Flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = fake.new_stream(d);
        // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
        unsafe { put(phStream, s) }
    }

    /// Destroys a stream made by `cuStreamCreate`.
    fn cuStreamDestroy_v2(hStream: CUstream) {
        let fake = Fake::get()?;
        fake.streams.lock().remove(&(hStream as usize)).map(|_| ()).ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// Allocates page-locked host memory; needs a current context. Flags: portable (1),
    /// device-map (2), write-combined (4).
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, Flags: c_uint) {
        let fake = Fake::get()?;
        fake.current_device()?;
        if pp.is_null() || bytesize == 0 || Flags & !7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = fake.sim.host_alloc(bytesize).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        count(Counter::HostAlloc);
        // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
        unsafe { put(pp, p as *mut c_void) }
    }

    /// Frees memory from `cuMemHostAlloc`.
    fn cuMemFreeHost(p: *mut c_void) {
        let fake = Fake::get()?;
        fake.sim.host_free(p as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        count(Counter::HostFree);
        Ok(())
    }

    /// Page-locks the caller's memory; needs a current context. Flags: portable (1),
    /// device-map (2), I/O memory (4), read-only (8).
    fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, Flags: c_uint) {
        let fake = Fake::get()?;
        fake.current_device()?;
        if Flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        fake.sim.host_register(p as usize, bytesize).map_err(|e| {
            if e.message().starts_with("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED") {
                CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            } else {
                CUDA_ERROR_INVALID_VALUE
            }
        })?;
        count(Counter::HostRegister);
        Ok(())
    }

    /// Undoes `cuMemHostRegister`.
    fn cuMemHostUnregister(p: *mut c_void) {
        let fake = Fake::get()?;
        fake.sim.host_unregister(p as usize).map_err(|_| CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)?;
        count(Counter::HostUnregister);
        Ok(())
    }

    /// Reserves a range of addresses (a multiple of the 2 MiB granularity). `flags` must be 0;
    /// the address hint is ignored.
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: c_ulonglong) {
        let fake = Fake::get()?;
        let _ = addr;
        if ptr.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let start = fake.vmm.reserve(size, alignment)?;
        // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
        unsafe { put(ptr, start) }
    }

    /// Frees a whole reservation made by `cuMemAddressReserve`, once nothing is mapped in it.
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        Fake::get()?.vmm.address_free(ptr, size)
    }

    /// Creates a physical allocation on a device (pinned device memory only). `flags` must be 0.
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: c_ulonglong) {
        let fake = Fake::get()?;
        // SAFETY: the caller passes NULL or a valid property struct.
        let prop = unsafe { get(prop) }?;
        let device = vmm::prop_device(fake, &prop)?;
        if handle.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = fake.vmm.create(fake, size, device)?;
        // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
        unsafe { put(handle, h) }
    }

    /// Maps (part of) a physical allocation into a reserved range; access is off until
    /// `cuMemSetAccess`. `flags` must be 0.
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: c_ulonglong) {
        let fake = Fake::get()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        fake.vmm.map(ptr, size, offset, handle)
    }

    /// Sets the access of mapped ranges (which must tile `[ptr, ptr + size)` exactly).
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        let fake = Fake::get()?;
        if desc.is_null() || count == 0 || count > fake.device_count() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` descriptors at `desc` (NVIDIA's contract);
        // checked non-NULL and count bounded above.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        fake.vmm.set_access(fake, ptr, size, descs)
    }

    /// Unmaps whole mappings that tile `[ptr, ptr + size)`.
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        let fake = Fake::get()?;
        fake.vmm.unmap(fake, ptr, size)
    }

    /// Releases a physical allocation; its memory returns once it is no longer mapped.
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        let fake = Fake::get()?;
        fake.vmm.release(fake, handle)
    }

    /// The granularity of physical allocations (2 MiB, minimum and recommended alike).
    fn cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const CUmemAllocationProp, option: CUmemAllocationGranularity_flags) {
        let fake = Fake::get()?;
        // SAFETY: the caller passes NULL or a valid property struct.
        let prop = unsafe { get(prop) }?;
        vmm::prop_device(fake, &prop)?;
        if option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(granularity, vmm::GRANULARITY) }
    }

    /// An IPC handle for the start of a `cuMemAlloc` allocation.
    fn cuIpcGetMemHandle(pHandle: *mut CUipcMemHandle, dptr: CUdeviceptr) {
        let fake = Fake::get()?;
        let (device, size) = *fake.allocations.lock().get(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut handle = CUipcMemHandle { reserved: [0; 64] };
        let mut bytes = Vec::with_capacity(64);
        bytes.extend_from_slice(b"FAKECUDA");
        bytes.extend_from_slice(&std::process::id().to_le_bytes());
        bytes.extend_from_slice(&(device as u32).to_le_bytes());
        bytes.extend_from_slice(&dptr.to_le_bytes());
        bytes.extend_from_slice(&(size as u64).to_le_bytes());
        for (slot, b) in handle.reserved.iter_mut().zip(bytes) {
            *slot = b as c_char;
        }
        // SAFETY: the caller passes a valid out-pointer.
        unsafe { put(pHandle, handle) }
    }
}

/// Test control: events recorded on `stream` from now on stay pending (`cuEventQuery` answers
/// `CUDA_ERROR_NOT_READY`) until [`fakecuda_release_stream`] or `cuEventSynchronize`.
#[no_mangle]
pub extern "C" fn fakecuda_hold_stream(stream: CUstream) {
    let _ = std::panic::catch_unwind(|| sim::hold_stream(stream as usize));
}

/// Test control: completes every event recorded on `stream` while it was held.
#[no_mangle]
pub extern "C" fn fakecuda_release_stream(stream: CUstream) {
    let _ = std::panic::catch_unwind(|| sim::release_stream(stream as usize));
}

fn counter_named(name: *const c_char) -> Option<Counter> {
    if name.is_null() {
        return None;
    }
    // SAFETY: test code passes a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) }.to_str().ok()?;
    COUNTER_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| *c)
}

/// Test control: how many times the whole process made the counted call `name` (see
/// `state::COUNTER_NAMES`: `events_created`, `ctx_push`, `host_register`...), or `u64::MAX`
/// for an unknown name.
#[no_mangle]
pub unsafe extern "C" fn fakecuda_counter(name: *const c_char) -> u64 {
    std::panic::catch_unwind(|| counter_named(name).map_or(u64::MAX, state::global_count))
        .unwrap_or(u64::MAX)
}

/// Test control: like [`fakecuda_counter`], counting only the calling thread's calls.
#[no_mangle]
pub unsafe extern "C" fn fakecuda_thread_counter(name: *const c_char) -> u64 {
    std::panic::catch_unwind(|| counter_named(name).map_or(u64::MAX, state::thread_count))
        .unwrap_or(u64::MAX)
}

/// Test control: bytes of device memory in use on `device` (`cuMemAlloc` and `cuMemCreate`),
/// or `u64::MAX` before `cuInit` or for a bad device.
#[no_mangle]
pub extern "C" fn fakecuda_device_used(device: c_int) -> u64 {
    std::panic::catch_unwind(|| {
        let fake = Fake::get().ok()?;
        let d = fake.device(device).ok()?;
        Some(fake.sim.used(d))
    })
    .ok()
    .flatten()
    .unwrap_or(u64::MAX)
}

/// Test control: the device that owns a `cuMemAlloc` allocation starting at `ptr`, or -1.
#[no_mangle]
pub extern "C" fn fakecuda_pointer_device(ptr: CUdeviceptr) -> c_int {
    std::panic::catch_unwind(|| {
        let fake = Fake::get().ok()?;
        let (d, _) = *fake.allocations.lock().get(&ptr)?;
        Some(d as c_int)
    })
    .ok()
    .flatten()
    .unwrap_or(-1)
}

//! The exported CUDA functions. Each serves the call through tensoralloc when it can and
//! passes it to the real function unchanged otherwise: when the preload is off, before a
//! context exists, for a context that is not a device's primary context, for flags or sizes
//! tensoralloc does not serve, and for pointers it did not hand out. Errors come back as the
//! CUDA codes callers expect (`cudaErrorMemoryAllocation` / `CUDA_ERROR_OUT_OF_MEMORY` = 2,
//! `cudaErrorInvalidValue` / `CUDA_ERROR_INVALID_VALUE` = 1); nothing unwinds out of a hook.
//!
//! Every function here is `unsafe`: its safety contract is NVIDIA's for the function it
//! replaces (valid out-pointers, NUL-terminated names).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use tensoralloc::driver::Stream;
use tensoralloc::Error;

use crate::real::{self, CuStream, Status, INVALID_VALUE, OUT_OF_MEMORY, SUCCESS, UNKNOWN};
use crate::state::{Device, State, STREAM_LEGACY, STREAM_PER_THREAD};

const CUDA_ERROR_NOT_FOUND: Status = 500;
/// `cudaHostAllocPortable | cudaHostAllocMapped` (and the driver's equivalents): what the
/// pinned cache serves (its memory is portable, and mapped wherever addressing is unified).
const SERVED_HOST_FLAGS: c_uint = 1 | 2;
const STREAM_NON_BLOCKING: c_uint = 1;
const GET_PROC_ADDRESS_PER_THREAD: u64 = 2;

thread_local! {
    /// Non-zero while a hook runs a real runtime function: the driver calls the runtime makes
    /// inside it are its own and go to the driver unchanged.
    static BYPASS: Cell<u32> = const { Cell::new(0) };
}

/// Threads inside a real runtime function now: while there are none, no hook needs to look at
/// its thread's `BYPASS` (thread-local storage costs a call in a shared library).
static IN_REAL_RUNTIME: AtomicUsize = AtomicUsize::new(0);

#[inline]
fn bypassed() -> bool {
    IN_REAL_RUNTIME.load(Relaxed) != 0 && bypassed_here()
}

/// Out of line, so that the thread-local address is not computed ahead of the check above.
#[cold]
#[inline(never)]
fn bypassed_here() -> bool {
    BYPASS.with(|b| b.get() != 0)
}

/// Runs a real runtime function with the driver hooks out of the way.
fn through<T>(f: impl FnOnce() -> T) -> T {
    BYPASS.with(|b| b.set(b.get() + 1));
    IN_REAL_RUNTIME.fetch_add(1, Relaxed);
    let r = f();
    IN_REAL_RUNTIME.fetch_sub(1, Relaxed);
    BYPASS.with(|b| b.set(b.get() - 1));
    r
}

/// The state when this call should be served.
#[inline]
fn serving() -> Option<&'static State> {
    let s = State::serving()?;
    (!bypassed()).then_some(s)
}

/// The state when a free should be checked: also inside a real runtime call, since the
/// runtime may free there a block it got from the hooks earlier.
#[inline]
fn serving_frees() -> Option<&'static State> {
    State::serving()
}

/// Runs a hook body; a panic becomes `UNKNOWN` (999) instead of unwinding into C.
fn boundary(body: impl FnOnce() -> Status) -> Status {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(UNKNOWN)
}

/// The CUDA code of an allocator error (and one stderr line for the unexpected ones).
fn status_of(e: Error) -> Status {
    match e {
        Error::OutOfMemory(_) => OUT_OF_MEMORY,
        Error::InvalidArgument(_) | Error::UnknownPointer(_) | Error::Config(_) => INVALID_VALUE,
        other => {
            eprintln!("tensoralloc preload: {other}");
            UNKNOWN
        }
    }
}

static WARNED_INVALID_FREE: AtomicBool = AtomicBool::new(false);

/// Reports a free of memory tensoralloc owns but has not handed out (a double free, or a
/// pointer into the middle of a block): once on stderr, then only counted.
fn invalid_free(state: &State, call: &str, ptr: usize) -> Status {
    state.counters.invalid_frees.fetch_add(1, Relaxed);
    if !WARNED_INVALID_FREE.swap(true, Relaxed) {
        eprintln!(
            "tensoralloc preload: {call}({ptr:#x}): not a live allocation (freed twice, or not the start of one); nothing was freed, the call returns error 1 (invalid value). Further invalid frees are only counted."
        );
    }
    INVALID_VALUE
}

/// Writes a result through the caller's out-pointer.
///
/// # Safety
/// `out` is valid for writes (checked non-NULL by the caller).
unsafe fn put<T>(out: *mut T, value: T) {
    // SAFETY: the caller's promise.
    unsafe { out.write(value) }
}

macro_rules! real_or {
    ($f:ident($($a:expr),*), $missing:expr) => {
        match real::$f() {
            // SAFETY: the real function of the same prototype, with the caller's arguments.
            Some(f) => unsafe { f($($a),*) },
            None => $missing,
        }
    };
}

/// The runtime's current device, made on first use.
fn runtime_device(state: &State) -> Option<&Device> {
    let get = real::cudaGetDevice()?;
    let mut dev: c_int = -1;
    // SAFETY: a valid out-pointer.
    if unsafe { get(&mut dev) } != SUCCESS {
        return None;
    }
    state.device(usize::try_from(dev).ok()?)
}

/// Where a stream-ordered call on `stream` goes: the device, and the pool key (`None`: the
/// per-thread default stream, which several threads share under one handle, so its blocks
/// follow `cudaFree`'s rules instead).
fn stream_target(
    state: &State,
    stream: Stream,
    current: impl FnOnce(&State) -> Option<&Device>,
) -> Option<(&Device, Option<Stream>)> {
    let d = match stream {
        0 | STREAM_LEGACY | STREAM_PER_THREAD => current(state),
        s => state.stream_device(s),
    }?;
    Some((d, pool_key(stream)))
}

/// The pool key of a stream-ordered call on `stream` (see [`stream_target`]).
fn pool_key(stream: Stream) -> Option<Stream> {
    match stream {
        0 | STREAM_LEGACY => Some(0),
        STREAM_PER_THREAD => None,
        s => Some(s),
    }
}

fn alloc_sync(state: &State, d: &Device, out: *mut usize, size: usize) -> Status {
    alloc_async(state, d, None, out, size)
}

fn alloc_async(
    state: &State,
    d: &Device,
    key: Option<Stream>,
    out: *mut usize,
    size: usize,
) -> Status {
    let r = match key {
        Some(s) => state.malloc_async(d, size, s),
        None => state.malloc_sync(d, size),
    };
    match r {
        Ok(p) => {
            // SAFETY: checked non-NULL by the hook.
            unsafe { put(out, p) };
            SUCCESS
        }
        Err(e) => status_of(e),
    }
}

/// A free of ours with `cudaFree`'s meaning; `None` when the pointer is not ours.
fn free_sync(state: &State, call: &str, ptr: usize) -> Option<Status> {
    match state.take_live(ptr) {
        Some(live) => {
            state.free_sync(ptr, live);
            Some(SUCCESS)
        }
        None if state.owns(ptr) => Some(invalid_free(state, call, ptr)),
        None => None,
    }
}

/// A free of ours in `stream`'s order; `None` when the pointer is not ours.
fn free_async(state: &State, call: &str, ptr: usize, stream: Stream) -> Option<Status> {
    let Some(live) = state.take_live(ptr) else {
        return state.owns(ptr).then(|| invalid_free(state, call, ptr));
    };
    Some(match pool_key(stream) {
        None => {
            state.free_sync(ptr, live);
            SUCCESS
        }
        Some(s) => match state.free_async(ptr, live, s) {
            Ok(()) => SUCCESS,
            Err(e) => status_of(e),
        },
    })
}

/// Pinned host memory from the cache, for the flags it serves.
fn host_alloc(state: &State, out: *mut *mut c_void, size: usize, flags: c_uint) -> Option<Status> {
    if flags & !SERVED_HOST_FLAGS != 0 {
        return None;
    }
    // Blocks freed earlier wait in the devices' batches.
    state.reclaim_for_host(false);
    let r = match state.host().malloc(size) {
        Err(Error::OutOfMemory(_)) => {
            state.reclaim_for_host(true);
            state.host().malloc(size)
        }
        other => other,
    };
    Some(match r {
        Ok(b) => {
            state.host_handed_out(b.ptr, b.ctx, size);
            state.host_known.insert(b.ptr, ());
            state.counters.host_served.fetch_add(1, Relaxed);
            // SAFETY: checked non-NULL by the hook.
            unsafe { put(out, b.ptr as *mut c_void) };
            SUCCESS
        }
        Err(e) => status_of(e),
    })
}

/// Returns pinned memory to the cache once the work already queued on the current device's
/// legacy stream and non-blocking streams is done (it joins the device's batch of frees);
/// `None` when the pointer is not ours.
fn host_free(state: &State, call: &str, ptr: usize) -> Option<Status> {
    let Some(ctx) = state.take_host_live(ptr) else {
        return state
            .host_known
            .contains(ptr)
            .then(|| invalid_free(state, call, ptr));
    };
    if let Some(d) = state.current_device() {
        state.free_host_deferred(d, ptr, ctx);
        return Some(SUCCESS);
    }
    // No context on this thread: an event on the legacy stream guards the block alone.
    let host = state.host();
    host.record_event(ptr, Some(ctx), 0);
    Some(match host.free(ptr, Some(ctx)) {
        Ok(()) => SUCCESS,
        Err(e) => status_of(e),
    })
}

/// Adds the memory tensoralloc caches on `d` to a free-memory answer.
fn add_cached(state: &State, d: Option<&Device>, free: *mut usize, total: *mut usize) {
    if let Some(d) = d {
        if !free.is_null() && !total.is_null() {
            // SAFETY: the real call just wrote both.
            unsafe {
                let f = (*free)
                    .saturating_add(state.cached_free_bytes(d))
                    .min(*total);
                put(free, f);
            }
        }
    }
}

fn note_stream_created(state: &State, d: Option<&Device>, stream: CuStream, flags: c_uint) {
    if flags & STREAM_NON_BLOCKING != 0 {
        if let Some(d) = d {
            d.add_nonblocking_stream(stream as Stream);
        }
    }
    let _ = state;
}

fn note_stream_destroyed(stream: CuStream) {
    crate::state::stream_destroyed(stream as Stream);
    if let Some(state) = serving() {
        for d in state.devices() {
            d.remove_stream(stream as Stream);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Driver API

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytesize: usize) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !dptr.is_null() && bytesize != 0 {
                if let Some(d) = s.current_device() {
                    return alloc_sync(s, d, dptr.cast(), bytesize);
                }
            }
            s.passed();
        }
        real_or!(cuMemAlloc_v2(dptr, bytesize), UNKNOWN)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> Status {
    boundary(|| {
        if let Some(s) = serving_frees() {
            if dptr != 0 {
                if let Some(r) = free_sync(s, "cuMemFree", dptr as usize) {
                    return r;
                }
            }
            s.passed();
        }
        real_or!(cuMemFree_v2(dptr), UNKNOWN)
    })
}

/// A stream-ordered allocation (`current`: how the call finds its device for the special
/// streams); `None` when it passes through.
fn serve_alloc_async(
    out: *mut usize,
    size: usize,
    stream: Stream,
    current: impl FnOnce(&State) -> Option<&Device>,
) -> Option<Status> {
    let s = serving()?;
    if !out.is_null() && size != 0 {
        if let Some((d, key)) = stream_target(s, stream, current) {
            return Some(alloc_async(s, d, key, out, size));
        }
    }
    s.passed();
    None
}

/// A stream-ordered free; `None` when it passes through.
fn serve_free_async(
    state: Option<&State>,
    call: &str,
    ptr: usize,
    stream: Stream,
) -> Option<Status> {
    let s = state?;
    if ptr != 0 {
        if let Some(r) = free_async(s, call, ptr, stream) {
            return Some(r);
        }
    }
    s.passed();
    None
}

fn mem_alloc_async(dptr: *mut u64, bytesize: usize, stream: Stream) -> Option<Status> {
    serve_alloc_async(dptr.cast(), bytesize, stream, State::current_device)
}

fn mem_free_async(dptr: u64, stream: Stream) -> Option<Status> {
    serve_free_async(serving_frees(), "cuMemFreeAsync", dptr as usize, stream)
}

fn runtime_malloc_async(dev_ptr: *mut *mut c_void, size: usize, stream: Stream) -> Option<Status> {
    serve_alloc_async(dev_ptr.cast(), size, stream, runtime_device)
}

fn runtime_free_async(dev_ptr: *mut c_void, stream: Stream) -> Option<Status> {
    serve_free_async(serving(), "cudaFreeAsync", dev_ptr as usize, stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut u64,
    bytesize: usize,
    hStream: CuStream,
) -> Status {
    boundary(|| {
        mem_alloc_async(dptr, bytesize, hStream as Stream)
            .unwrap_or_else(|| real_or!(cuMemAllocAsync(dptr, bytesize, hStream), UNKNOWN))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: u64, hStream: CuStream) -> Status {
    boundary(|| {
        mem_free_async(dptr, hStream as Stream)
            .unwrap_or_else(|| real_or!(cuMemFreeAsync(dptr, hStream), UNKNOWN))
    })
}

/// The per-thread-default-stream variant: stream 0 is the calling thread's stream.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut u64,
    bytesize: usize,
    hStream: CuStream,
) -> Status {
    boundary(|| {
        mem_alloc_async(dptr, bytesize, per_thread(hStream))
            .unwrap_or_else(|| real_or!(cuMemAllocAsync_ptsz(dptr, bytesize, hStream), UNKNOWN))
    })
}

/// The per-thread-default-stream variant of `cuMemFreeAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: u64, hStream: CuStream) -> Status {
    boundary(|| {
        mem_free_async(dptr, per_thread(hStream))
            .unwrap_or_else(|| real_or!(cuMemFreeAsync_ptsz(dptr, hStream), UNKNOWN))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    Flags: c_uint,
) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            // The driver call needs a current context; without one the real call says so.
            if !pp.is_null() && bytesize != 0 && s.current_device().is_some() {
                if let Some(r) = host_alloc(s, pp, bytesize, Flags) {
                    return r;
                }
            }
            s.passed();
        }
        real_or!(cuMemHostAlloc(pp, bytesize, Flags), UNKNOWN)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !pp.is_null() && bytesize != 0 && s.current_device().is_some() {
                if let Some(r) = host_alloc(s, pp, bytesize, 0) {
                    return r;
                }
            }
            s.passed();
        }
        real_or!(cuMemAllocHost_v2(pp, bytesize), UNKNOWN)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> Status {
    boundary(|| {
        if let Some(s) = serving_frees() {
            if !p.is_null() {
                if let Some(r) = host_free(s, "cuMemFreeHost", p as usize) {
                    return r;
                }
            }
            s.passed();
        }
        real_or!(cuMemFreeHost(p), UNKNOWN)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> Status {
    boundary(|| {
        let r = real_or!(cuMemGetInfo_v2(free, total), UNKNOWN);
        if r == SUCCESS {
            if let Some(s) = serving() {
                add_cached(s, s.current_device(), free, total);
            }
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CuStream, Flags: c_uint) -> Status {
    boundary(|| {
        let r = real_or!(cuStreamCreate(phStream, Flags), UNKNOWN);
        if r == SUCCESS {
            if let Some(s) = serving() {
                // SAFETY: the real call succeeded, so the out-pointer was valid and written.
                note_stream_created(s, s.current_device(), unsafe { *phStream }, Flags);
            }
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    phStream: *mut CuStream,
    flags: c_uint,
    priority: c_int,
) -> Status {
    boundary(|| {
        let r = real_or!(
            cuStreamCreateWithPriority(phStream, flags, priority),
            UNKNOWN
        );
        if r == SUCCESS {
            if let Some(s) = serving() {
                // SAFETY: the real call succeeded, so the out-pointer was valid and written.
                note_stream_created(s, s.current_device(), unsafe { *phStream }, flags);
            }
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(hStream: CuStream) -> Status {
    boundary(|| {
        note_stream_destroyed(hStream);
        real_or!(cuStreamDestroy_v2(hStream), UNKNOWN)
    })
}

/// Our replacement for the driver function a runtime asks `cuGetProcAddress` for, by base
/// name and the version and stream mode it asks for.
fn replacement(name: &CStr, version: c_int, flags: u64) -> Option<*mut c_void> {
    let ptds = flags & GET_PROC_ADDRESS_PER_THREAD != 0;
    let f: *mut c_void = match name.to_bytes() {
        b"cuMemAlloc" if version >= 3020 => cuMemAlloc_v2 as *mut c_void,
        b"cuMemFree" if version >= 3020 => cuMemFree_v2 as *mut c_void,
        b"cuMemGetInfo" if version >= 3020 => cuMemGetInfo_v2 as *mut c_void,
        b"cuMemAllocHost" if version >= 3020 => cuMemAllocHost_v2 as *mut c_void,
        b"cuMemHostAlloc" => cuMemHostAlloc as *mut c_void,
        b"cuMemFreeHost" => cuMemFreeHost as *mut c_void,
        b"cuMemAllocAsync" if ptds => cuMemAllocAsync_ptsz as *mut c_void,
        b"cuMemAllocAsync" => cuMemAllocAsync as *mut c_void,
        b"cuMemFreeAsync" if ptds => cuMemFreeAsync_ptsz as *mut c_void,
        b"cuMemFreeAsync" => cuMemFreeAsync as *mut c_void,
        b"cuStreamCreate" => cuStreamCreate as *mut c_void,
        b"cuStreamCreateWithPriority" => cuStreamCreateWithPriority as *mut c_void,
        b"cuStreamDestroy" if version >= 4000 => cuStreamDestroy_v2 as *mut c_void,
        b"cuGetProcAddress" if version >= 12000 => cuGetProcAddress_v2 as *mut c_void,
        b"cuGetProcAddress" => cuGetProcAddress as *mut c_void,
        _ => return None,
    };
    Some(f)
}

/// After a successful lookup, hands out our function instead of the driver's.
fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    if symbol.is_null() || pfn.is_null() || !crate::enabled() {
        return;
    }
    // SAFETY: the real call succeeded, so the name is NUL-terminated and pfn was written.
    unsafe {
        if (*pfn).is_null() {
            return;
        }
        if let Some(f) = replacement(CStr::from_ptr(symbol), version, flags) {
            put(pfn, f);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
    symbolStatus: *mut c_int,
) -> Status {
    boundary(|| {
        let Some(real) = real::gpa_v2() else {
            return CUDA_ERROR_NOT_FOUND;
        };
        // SAFETY: the driver's function, with the caller's arguments.
        let r = unsafe { real(symbol, pfn, cudaVersion, flags, symbolStatus) };
        if r == SUCCESS {
            substitute(symbol, pfn, cudaVersion, flags);
        }
        r
    })
}

/// The CUDA 11 ABI of `cuGetProcAddress`.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: u64,
) -> Status {
    boundary(|| {
        let Some(real) = real::gpa() else {
            return CUDA_ERROR_NOT_FOUND;
        };
        // SAFETY: the driver's function, with the caller's arguments.
        let r = unsafe { real(symbol, pfn, cudaVersion, flags) };
        if r == SUCCESS {
            substitute(symbol, pfn, cudaVersion, flags);
        }
        r
    })
}

// ---------------------------------------------------------------------------------------
// Runtime API

#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(devPtr: *mut *mut c_void, size: usize) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !devPtr.is_null() && size != 0 {
                if let Some(d) = runtime_device(s) {
                    return alloc_sync(s, d, devPtr.cast(), size);
                }
            }
            s.passed();
        }
        through(|| real_or!(cudaMalloc(devPtr, size), UNKNOWN))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaFree(devPtr: *mut c_void) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !devPtr.is_null() {
                if let Some(r) = free_sync(s, "cudaFree", devPtr as usize) {
                    return r;
                }
            }
            s.passed();
        }
        through(|| real_or!(cudaFree(devPtr), UNKNOWN))
    })
}

/// The stream a `_ptsz` call means: its NULL stream is the calling thread's default stream.
fn per_thread(stream: CuStream) -> Stream {
    if stream.is_null() {
        STREAM_PER_THREAD
    } else {
        stream as Stream
    }
}

#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync(
    devPtr: *mut *mut c_void,
    size: usize,
    hStream: CuStream,
) -> Status {
    boundary(|| {
        runtime_malloc_async(devPtr, size, hStream as Stream).unwrap_or_else(|| {
            through(|| real_or!(cudaMallocAsync(devPtr, size, hStream), UNKNOWN))
        })
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync(devPtr: *mut c_void, hStream: CuStream) -> Status {
    boundary(|| {
        runtime_free_async(devPtr, hStream as Stream)
            .unwrap_or_else(|| through(|| real_or!(cudaFreeAsync(devPtr, hStream), UNKNOWN)))
    })
}

/// `cudaMallocAsync` of a program built with `--default-stream per-thread`
/// (`CUDA_API_PER_THREAD_DEFAULT_STREAM`).
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync_ptsz(
    devPtr: *mut *mut c_void,
    size: usize,
    hStream: CuStream,
) -> Status {
    boundary(|| {
        runtime_malloc_async(devPtr, size, per_thread(hStream)).unwrap_or_else(|| {
            through(|| real_or!(cudaMallocAsync_ptsz(devPtr, size, hStream), UNKNOWN))
        })
    })
}

/// `cudaFreeAsync` of a program built with `--default-stream per-thread`.
#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync_ptsz(devPtr: *mut c_void, hStream: CuStream) -> Status {
    boundary(|| {
        runtime_free_async(devPtr, per_thread(hStream))
            .unwrap_or_else(|| through(|| real_or!(cudaFreeAsync_ptsz(devPtr, hStream), UNKNOWN)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMallocHost(ptr: *mut *mut c_void, size: usize) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !ptr.is_null() && size != 0 {
                if let Some(r) = host_alloc(s, ptr, size, 0) {
                    return r;
                }
            }
            s.passed();
        }
        through(|| real_or!(cudaMallocHost(ptr, size), UNKNOWN))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaHostAlloc(
    pHost: *mut *mut c_void,
    size: usize,
    flags: c_uint,
) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !pHost.is_null() && size != 0 {
                if let Some(r) = host_alloc(s, pHost, size, flags) {
                    return r;
                }
            }
            s.passed();
        }
        through(|| real_or!(cudaHostAlloc(pHost, size, flags), UNKNOWN))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaFreeHost(ptr: *mut c_void) -> Status {
    boundary(|| {
        if let Some(s) = serving() {
            if !ptr.is_null() {
                if let Some(r) = host_free(s, "cudaFreeHost", ptr as usize) {
                    return r;
                }
            }
            s.passed();
        }
        through(|| real_or!(cudaFreeHost(ptr), UNKNOWN))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> Status {
    boundary(|| {
        let r = through(|| real_or!(cudaMemGetInfo(free, total), UNKNOWN));
        if r == SUCCESS {
            if let Some(s) = serving() {
                add_cached(s, runtime_device(s), free, total);
            }
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreateWithFlags(
    pStream: *mut CuStream,
    flags: c_uint,
) -> Status {
    boundary(|| {
        let r = through(|| real_or!(cudaStreamCreateWithFlags(pStream, flags), UNKNOWN));
        if r == SUCCESS {
            if let Some(s) = serving() {
                // SAFETY: the real call succeeded, so the out-pointer was valid and written.
                let stream = unsafe { *pStream };
                note_stream_created(s, s.stream_device(stream as Stream), stream, flags);
            }
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreateWithPriority(
    pStream: *mut CuStream,
    flags: c_uint,
    priority: c_int,
) -> Status {
    boundary(|| {
        let r = through(|| {
            real_or!(
                cudaStreamCreateWithPriority(pStream, flags, priority),
                UNKNOWN
            )
        });
        if r == SUCCESS {
            if let Some(s) = serving() {
                // SAFETY: the real call succeeded, so the out-pointer was valid and written.
                let stream = unsafe { *pStream };
                note_stream_created(s, s.stream_device(stream as Stream), stream, flags);
            }
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamDestroy(stream: CuStream) -> Status {
    boundary(|| {
        note_stream_destroyed(stream);
        through(|| real_or!(cudaStreamDestroy(stream), UNKNOWN))
    })
}

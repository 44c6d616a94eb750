//! The fake driver's stream capture: `cuStreamGetCaptureInfo_v3`, `cuStreamIsCapturing`,
//! `cuThreadExchangeStreamCaptureMode`, and test controls that begin and end captures.
//!
//! Capture state is the simulated device's ([`sim::capture`]): event queries and waits and
//! device frees made by a thread while it captures invalidate its capture, as on a real driver
//! in the default (global) capture mode. `cuMemAlloc` during the calling thread's capture is
//! refused with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates it unless the thread
//! switched to relaxed mode with `cuThreadExchangeStreamCaptureMode`.

use std::cell::Cell;
use std::ffi::{c_int, c_uint};

use tensoralloc::driver::sim;

use crate::state::Fake;
use crate::types::*;
use crate::{guard, put};

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`, the default mode of every thread.
const MODE_GLOBAL: c_uint = 0;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const MODE_RELAXED: c_uint = 2;
/// `CU_STREAM_CAPTURE_STATUS_NONE` / `_ACTIVE`.
const STATUS_NONE: c_uint = 0;
const STATUS_ACTIVE: c_uint = 1;
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;

/// Whether a stream (valid for the fake) is capturing.
fn capture_status(stream: CUstream) -> Result<bool, CUresult> {
    Fake::get()?.stream_device(stream)?;
    Ok(sim::capture::is_capturing(stream as usize))
}

thread_local! {
    static MODE: Cell<c_uint> = const { Cell::new(MODE_GLOBAL) };
}

/// Refuses a device allocation that a driver forbids: during the calling thread's capture in
/// global or thread-local mode. The refusal invalidates the capture.
pub fn check_alloc() -> Result<(), CUresult> {
    if MODE.with(Cell::get) != MODE_RELAXED && sim::capture::thread_is_capturing() {
        sim::capture::unsafe_call("cuMemAlloc outside relaxed capture mode");
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    Ok(())
}

crate::driver_api! {
    exports CAPTURE_EXPORTS;

    /// Whether `hStream` is capturing (`CU_STREAM_CAPTURE_STATUS_ACTIVE`) or not; a capture id
    /// (the stream handle) when asked. The graph, dependency and edge outputs are left alone
    /// (the fake builds no graph): they may be NULL.
    fn cuStreamGetCaptureInfo_v3(
        hStream: CUstream,
        captureStatus_out: *mut CUstreamCaptureStatus,
        id_out: *mut cuuint64_t,
        graph_out: *mut CUgraph,
        dependencies_out: *mut *const CUgraphNode,
        edgeData_out: *mut *const CUgraphEdgeData,
        numDependencies_out: *mut usize,
    ) {
        let _ = (graph_out, dependencies_out, edgeData_out, numDependencies_out);
        let capturing = capture_status(hStream)?;
        // SAFETY: the caller passes a valid out-pointer for the status (NVIDIA's contract).
        unsafe { put(captureStatus_out, if capturing { STATUS_ACTIVE } else { STATUS_NONE }) }?;
        if capturing && !id_out.is_null() {
            // SAFETY: non-NULL, and the caller passes a valid out-pointer.
            unsafe { put(id_out, hStream as usize as cuuint64_t) }?;
        }
        Ok(())
    }

    /// Whether `hStream` is capturing (the query of drivers before CUDA 12.3).
    fn cuStreamIsCapturing(hStream: CUstream, captureStatus: *mut CUstreamCaptureStatus) {
        let capturing = capture_status(hStream)?;
        // SAFETY: the caller passes a valid out-pointer (NVIDIA's contract).
        unsafe { put(captureStatus, if capturing { STATUS_ACTIVE } else { STATUS_NONE }) }
    }

    /// Swaps the calling thread's capture mode with `*mode`.
    fn cuThreadExchangeStreamCaptureMode(mode: *mut CUstreamCaptureMode) {
        if mode.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-NULL, and the caller passes a valid in/out pointer.
        let wanted = unsafe { mode.read() };
        if wanted > MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let old = MODE.with(|m| m.replace(wanted));
        // SAFETY: as above.
        unsafe { put(mode, old) }
    }
}

/// Test control: the calling thread begins capturing `stream`. 0, or -1 when it already
/// captures.
#[no_mangle]
pub extern "C" fn fakecuda_begin_capture(stream: CUstream) -> c_int {
    std::panic::catch_unwind(|| match sim::capture::begin_capture(stream as usize) {
        Ok(()) => 0,
        Err(_) => -1,
    })
    .unwrap_or(-1)
}

/// Test control: ends the capture of `stream`. 0, 1 when the capture was invalidated, -1 when
/// the stream was not capturing.
#[no_mangle]
pub extern "C" fn fakecuda_end_capture(stream: CUstream) -> c_int {
    std::panic::catch_unwind(|| {
        if !sim::capture::is_capturing(stream as usize) {
            return -1;
        }
        match sim::capture::end_capture(stream as usize) {
            Ok(()) => 0,
            Err(_) => 1,
        }
    })
    .unwrap_or(-1)
}

//! C controls of the simulated device, for tests and demos. They act on the simulated driver
//! (`TENSORALLOC_DRIVER=sim`), or, under the NVIDIA backend, on the test suite's fake
//! `libcuda.so.1`; with a real NVIDIA driver they fail with a message that says so.

use super::{fail, ffi_boundary, stream_id, tensoralloc_status, CUstream_st, TENSORALLOC_OK};
use crate::driver::{sim, Stream};
use crate::error::{Error, Result};
use crate::runtime::Runtime;

/// The simulated device behind the runtime: the sim backend, or the fake driver under cudarc.
enum Simulated {
    Sim,
    Fake(&'static crate::driver::cuda::CudaDriver),
}

fn simulated() -> Result<(&'static Runtime, Simulated)> {
    let rt = Runtime::get()?;
    if rt.sim().is_some() {
        return Ok((rt, Simulated::Sim));
    }
    match rt.cuda() {
        Some(cuda) => Ok((rt, Simulated::Fake(cuda))),
        None => Err(Error::InvalidArgument(
            "the simulated device is not in use: set TENSORALLOC_DRIVER=sim".into(),
        )),
    }
}

fn hold(stream: Stream, held: bool) -> Result<()> {
    match simulated()?.1 {
        Simulated::Sim if held => sim::hold_stream(stream),
        Simulated::Sim => sim::release_stream(stream),
        Simulated::Fake(cuda) if held => cuda.fake_hold_stream(stream)?,
        Simulated::Fake(cuda) => cuda.fake_release_stream(stream)?,
    }
    Ok(())
}

/// Holds `stream` on the simulated device: events recorded on it from now on stay pending (as
/// if a long kernel were running) until `tensoralloc_sim_release_stream`. Lets tests keep
/// deferred frees (`tensoralloc_record_stream`) waiting.
/// Returns `TENSORALLOC_OK`, or an error status with a last error when no simulated device is
/// in use (a real NVIDIA driver).
#[no_mangle]
pub extern "C" fn tensoralloc_sim_hold_stream(stream: *mut CUstream_st) -> tensoralloc_status {
    ffi_boundary! {
        match hold(stream_id(stream), true) {
            Ok(()) => TENSORALLOC_OK,
            Err(e) => fail(&e),
        }
    }
}

/// Releases a stream held by `tensoralloc_sim_hold_stream`: every event recorded on it
/// completes. Returns `TENSORALLOC_OK`, or an error status with a last error when no
/// simulated device is in use.
#[no_mangle]
pub extern "C" fn tensoralloc_sim_release_stream(stream: *mut CUstream_st) -> tensoralloc_status {
    ffi_boundary! {
        match hold(stream_id(stream), false) {
            Ok(()) => TENSORALLOC_OK,
            Err(e) => fail(&e),
        }
    }
}

/// Bytes of simulated device memory that the driver has handed out on `device` (segments
/// tensoralloc holds), written to `*out` (owned by the caller). Lets tests prove that nothing
/// leaks. Returns `TENSORALLOC_OK`, or an error status with a last error when `out` is NULL,
/// the device does not exist, or no simulated device is in use.
#[no_mangle]
pub extern "C" fn tensoralloc_sim_device_used(device: i32, out: *mut u64) -> tensoralloc_status {
    ffi_boundary! {
        if out.is_null() {
            return fail(&Error::InvalidArgument("tensoralloc_sim_device_used: out is NULL".into()));
        }
        let used = simulated().and_then(|(rt, simulated)| {
            rt.device_from_c(device)?;
            match simulated {
                Simulated::Sim => Ok(rt.sim().map_or(0, |s| s.used(device as usize))),
                Simulated::Fake(cuda) => cuda.fake_device_used(device as usize),
            }
        });
        match used {
            Ok(used) => {
                // SAFETY: `out` is non-NULL and the caller promises it points to a writable u64.
                unsafe { out.write(used) };
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

fn capture(stream: Stream, begin: bool) -> Result<()> {
    match simulated()?.1 {
        Simulated::Sim if begin => sim::capture::begin_capture(stream),
        Simulated::Sim => sim::capture::end_capture(stream),
        Simulated::Fake(cuda) if begin => cuda.fake_begin_capture(stream),
        Simulated::Fake(cuda) => cuda.fake_end_capture(stream),
    }
}

/// Begins capturing `stream` into a CUDA graph on the simulated device, for the calling
/// thread. Until `tensoralloc_sim_end_capture`, the driver reports the stream as capturing, and
/// the calls a real driver forbids during this thread's capture (querying or waiting for an
/// event, freeing device memory, allocating outside relaxed capture mode) invalidate it.
/// Lets tests check that tensoralloc behaves under `torch.cuda.graph`.
/// Returns `TENSORALLOC_OK`, or an error status with a last error when the stream already
/// captures or no simulated device is in use (a real NVIDIA driver).
#[no_mangle]
pub extern "C" fn tensoralloc_sim_begin_capture(stream: *mut CUstream_st) -> tensoralloc_status {
    ffi_boundary! {
        match capture(stream_id(stream), true) {
            Ok(()) => TENSORALLOC_OK,
            Err(e) => fail(&e),
        }
    }
}

/// Ends a capture begun by `tensoralloc_sim_begin_capture`. Returns `TENSORALLOC_OK` when the
/// capture stayed valid; `TENSORALLOC_ERR_DRIVER` with a last error naming
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` when a forbidden call invalidated it (as
/// `cuStreamEndCapture` would fail); another error status when the stream was not capturing
/// or no simulated device is in use.
#[no_mangle]
pub extern "C" fn tensoralloc_sim_end_capture(stream: *mut CUstream_st) -> tensoralloc_status {
    ffi_boundary! {
        match capture(stream_id(stream), false) {
            Ok(()) => TENSORALLOC_OK,
            Err(e) => fail(&e),
        }
    }
}

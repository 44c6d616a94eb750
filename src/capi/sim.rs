//! C controls of the simulated device (`TENSORALLOC_DRIVER=sim`), for tests and demos.

use super::{fail, ffi_boundary, stream_id, tensoralloc_status, CUstream_st, TENSORALLOC_OK};
use crate::driver::sim;
use crate::error::Error;
use crate::runtime::Runtime;

fn require_sim() -> crate::error::Result<&'static Runtime> {
    let rt = Runtime::get()?;
    if rt.sim().is_none() {
        return Err(Error::InvalidArgument(format!(
            "the simulated device is not in use (the {} driver is): set TENSORALLOC_DRIVER=sim",
            rt.driver().name()
        )));
    }
    Ok(rt)
}

/// Holds `stream` on the simulated device: events recorded on it from now on stay pending (as
/// if a long kernel were running) until `tensoralloc_sim_release_stream`. Lets tests keep
/// deferred frees (`tensoralloc_record_stream`) waiting.
/// Returns `TENSORALLOC_OK`, or an error status with a last error when the simulated device is
/// not in use.
#[no_mangle]
pub extern "C" fn tensoralloc_sim_hold_stream(stream: *mut CUstream_st) -> tensoralloc_status {
    ffi_boundary! {
        match require_sim() {
            Ok(_) => {
                sim::hold_stream(stream_id(stream));
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

/// Releases a stream held by `tensoralloc_sim_hold_stream`: every event recorded on it
/// completes. Returns `TENSORALLOC_OK`, or an error status with a last error when the
/// simulated device is not in use.
#[no_mangle]
pub extern "C" fn tensoralloc_sim_release_stream(stream: *mut CUstream_st) -> tensoralloc_status {
    ffi_boundary! {
        match require_sim() {
            Ok(_) => {
                sim::release_stream(stream_id(stream));
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

/// Bytes of simulated device memory that the driver has handed out on `device` (segments
/// tensoralloc holds), written to `*out` (owned by the caller). Lets tests prove that nothing
/// leaks. Returns `TENSORALLOC_OK`, or an error status with a last error when `out` is NULL,
/// the device does not exist, or the simulated device is not in use.
#[no_mangle]
pub extern "C" fn tensoralloc_sim_device_used(device: i32, out: *mut u64) -> tensoralloc_status {
    ffi_boundary! {
        if out.is_null() {
            return fail(&Error::InvalidArgument("tensoralloc_sim_device_used: out is NULL".into()));
        }
        match require_sim().and_then(|rt| rt.device_from_c(device).map(|_| rt)) {
            Ok(rt) => {
                let used = rt.sim().map_or(0, |s| s.used(device as usize));
                // SAFETY: `out` is non-NULL and the caller promises it points to a writable u64.
                unsafe { out.write(used) };
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

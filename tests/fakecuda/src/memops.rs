//! The fake driver's memory operations (`cuMemsetD8`, `cuMemcpyHtoD`, `cuMemcpyDtoH`, their
//! `Async` forms) and `cuStreamSynchronize`.
//!
//! Simulated device memory is host memory, so these copy and fill directly. Work runs at once
//! in the calling thread, so a stream has nothing left to wait for; streams held by the test
//! controls only keep their events pending. The device side of every operation must lie
//! inside one `cuMemAlloc` allocation (`CUDA_ERROR_INVALID_VALUE` otherwise), as on a GPU,
//! where touching memory no allocation covers faults.

use std::ffi::{c_uchar, c_void};

use crate::guard;
use crate::state::Fake;
use crate::types::*;

/// The host address of `[ptr, ptr + len)` after checking that one live `cuMemAlloc`
/// allocation covers it, and that a context is current (the driver needs one for copies).
fn device_range(ptr: CUdeviceptr, len: usize) -> Result<*mut u8, CUresult> {
    let fake = Fake::get()?;
    fake.current_device()?;
    let end = ptr
        .checked_add(len as u64)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let covered = fake
        .allocations
        .lock()
        .iter()
        .any(|(&start, &(_, size))| start <= ptr && end <= start + size as u64);
    if !covered {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(ptr as usize as *mut u8)
}

/// Checks that `stream` can take work (a known or foreign handle on a current context).
fn stream_ok(stream: CUstream) -> Result<(), CUresult> {
    Fake::get()?.stream_device(stream).map(|_| ())
}

/// Fills `n` bytes of device memory at `dst` with `value`.
fn fill(dst: CUdeviceptr, value: c_uchar, n: usize) -> Result<(), CUresult> {
    let p = device_range(dst, n)?;
    // SAFETY: `device_range` checked that a live simulated allocation (host memory owned by
    // the fake driver) covers the n bytes at p.
    unsafe { std::ptr::write_bytes(p, value, n) };
    Ok(())
}

/// Copies `n` bytes from the host at `src` to device memory at `dst`.
///
/// # Safety
/// `src` is valid for reads of `n` bytes (NVIDIA's contract).
unsafe fn to_device(dst: CUdeviceptr, src: *const c_void, n: usize) -> Result<(), CUresult> {
    let p = device_range(dst, n)?;
    if src.is_null() && n > 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the destination is covered by a live allocation (checked); the caller promises
    // the source; `copy` allows them to overlap.
    unsafe { std::ptr::copy(src.cast::<u8>(), p, n) };
    Ok(())
}

/// Copies `n` bytes from device memory at `src` to the host at `dst`.
///
/// # Safety
/// `dst` is valid for writes of `n` bytes (NVIDIA's contract).
unsafe fn to_host(dst: *mut c_void, src: CUdeviceptr, n: usize) -> Result<(), CUresult> {
    let p = device_range(src, n)?;
    if dst.is_null() && n > 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the source is covered by a live allocation (checked); the caller promises the
    // destination; `copy` allows them to overlap.
    unsafe { std::ptr::copy(p.cast_const(), dst.cast::<u8>(), n) };
    Ok(())
}

driver_api! {
    /// Sets `N` bytes of device memory at `dstDevice` to `uc`.
    fn cuMemsetD8_v2(dstDevice: CUdeviceptr, uc: c_uchar, N: usize) {
        fill(dstDevice, uc, N)
    }

    /// `cuMemsetD8` on a stream (done at once).
    fn cuMemsetD8Async(dstDevice: CUdeviceptr, uc: c_uchar, N: usize, hStream: CUstream) {
        stream_ok(hStream)?;
        fill(dstDevice, uc, N)
    }

    /// Copies `ByteCount` bytes from the host to device memory.
    fn cuMemcpyHtoD_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize) {
        // SAFETY: the caller passes a source valid for ByteCount bytes (NVIDIA's contract).
        unsafe { to_device(dstDevice, srcHost, ByteCount) }
    }

    /// `cuMemcpyHtoD` on a stream (done at once).
    fn cuMemcpyHtoDAsync_v2(dstDevice: CUdeviceptr, srcHost: *const c_void, ByteCount: usize, hStream: CUstream) {
        stream_ok(hStream)?;
        // SAFETY: the caller passes a source valid for ByteCount bytes (NVIDIA's contract).
        unsafe { to_device(dstDevice, srcHost, ByteCount) }
    }

    /// Copies `ByteCount` bytes from device memory to the host.
    fn cuMemcpyDtoH_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize) {
        // SAFETY: the caller passes a destination valid for ByteCount bytes (NVIDIA's contract).
        unsafe { to_host(dstHost, srcDevice, ByteCount) }
    }

    /// `cuMemcpyDtoH` on a stream (done at once).
    fn cuMemcpyDtoHAsync_v2(dstHost: *mut c_void, srcDevice: CUdeviceptr, ByteCount: usize, hStream: CUstream) {
        stream_ok(hStream)?;
        // SAFETY: the caller passes a destination valid for ByteCount bytes (NVIDIA's contract).
        unsafe { to_host(dstHost, srcDevice, ByteCount) }
    }

    /// Waits for a stream's work: there is none left, since the fake runs work at once.
    fn cuStreamSynchronize(hStream: CUstream) {
        Fake::get()?.current_device()?;
        stream_ok(hStream)
    }
}

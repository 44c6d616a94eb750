//! The fake driver's stream capture behaves like a driver's in global capture mode: the
//! capturing thread's forbidden calls invalidate its capture, and relaxed mode permits
//! allocation.

use std::ptr::null_mut;

use fakecuda::capture::{
    cuStreamGetCaptureInfo_v3, cuStreamIsCapturing, cuThreadExchangeStreamCaptureMode,
    fakecuda_begin_capture, fakecuda_end_capture, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
};
use fakecuda::types::*;
use fakecuda::*;

const RELAXED: CUstreamCaptureMode = 2;

/// Initializes the fake and makes device 0's primary context current on this thread.
fn setup() {
    let mut ctx = null_mut();
    // SAFETY: valid out-pointers, as NVIDIA's contract asks.
    unsafe {
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
    }
}

fn stream(n: usize) -> CUstream {
    (0x4400_0000 + n * 0x10) as CUstream
}

fn status(s: CUstream) -> (CUstreamCaptureStatus, CUstreamCaptureStatus) {
    let (mut v3, mut old) = (7, 7);
    // SAFETY: valid out-pointers; the other outputs are optional.
    unsafe {
        assert_eq!(
            cuStreamGetCaptureInfo_v3(
                s,
                &mut v3,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut()
            ),
            CUDA_SUCCESS
        );
        assert_eq!(cuStreamIsCapturing(s, &mut old), CUDA_SUCCESS);
    }
    (v3, old)
}

#[test]
fn both_capture_queries_report_a_capture_while_it_lasts() {
    setup();
    let s = stream(1);
    assert_eq!(status(s), (0, 0));
    assert_eq!(fakecuda_begin_capture(s), 0);
    assert_eq!(status(s), (1, 1));
    assert_eq!(fakecuda_end_capture(s), 0);
    assert_eq!(status(s), (0, 0));
    assert_eq!(fakecuda_end_capture(s), -1, "not capturing any more");
}

#[test]
fn allocating_in_global_mode_during_a_capture_fails_and_invalidates_it() {
    setup();
    let s = stream(2);
    assert_eq!(fakecuda_begin_capture(s), 0);
    let mut p = 0;
    // SAFETY: valid out-pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut p, 1 << 20) },
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(fakecuda_end_capture(s), 1, "invalidated");
}

#[test]
fn allocating_in_relaxed_mode_during_a_capture_keeps_it_valid() {
    setup();
    let s = stream(3);
    assert_eq!(fakecuda_begin_capture(s), 0);
    let mut mode = RELAXED;
    let mut p = 0;
    // SAFETY: valid in/out and out pointers.
    unsafe {
        assert_eq!(cuThreadExchangeStreamCaptureMode(&mut mode), CUDA_SUCCESS);
        assert_eq!(mode, 0, "threads start in global mode");
        assert_eq!(cuMemAlloc_v2(&mut p, 1 << 20), CUDA_SUCCESS);
        assert_eq!(cuThreadExchangeStreamCaptureMode(&mut mode), CUDA_SUCCESS);
        assert_eq!(mode, RELAXED);
    }
    assert_eq!(fakecuda_end_capture(s), 0);
    // SAFETY: the allocation made above.
    assert_eq!(unsafe { cuMemFree_v2(p) }, CUDA_SUCCESS);
}

#[test]
fn freeing_during_a_capture_invalidates_it() {
    setup();
    let s = stream(4);
    let mut p = 0;
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, 1 << 20) }, CUDA_SUCCESS);
    assert_eq!(fakecuda_begin_capture(s), 0);
    // SAFETY: the allocation made above.
    assert_eq!(unsafe { cuMemFree_v2(p) }, CUDA_SUCCESS);
    assert_eq!(fakecuda_end_capture(s), 1);
}

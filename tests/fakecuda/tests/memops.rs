//! The fake driver's memory operations act on simulated device memory, only inside live
//! allocations, and only with a current context.

use std::ffi::c_void;
use std::ptr::null_mut;

use fakecuda::memops::*;
use fakecuda::types::*;
use fakecuda::*;

/// The tests of this file run one at a time: one of them checks that a freed address is
/// invalid, which a parallel test's allocation at the same address would make valid again.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Makes device 0's primary context current on this thread and allocates `size` bytes.
fn allocation(size: usize) -> CUdeviceptr {
    let mut ctx = null_mut();
    let mut p = 0;
    // SAFETY: valid out-pointers, as NVIDIA's contract asks.
    unsafe {
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        assert_eq!(cuMemAlloc_v2(&mut p, size), CUDA_SUCCESS);
    }
    p
}

#[test]
fn memset_and_copies_round_trip_through_device_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p = allocation(4096);
    let mut stream = null_mut();
    let data: Vec<u8> = (0..=255).collect();
    let mut back = vec![0u8; 4096];
    // SAFETY: valid out-pointers and host buffers of the sizes passed.
    unsafe {
        assert_eq!(cuStreamCreate(&mut stream, 0), CUDA_SUCCESS);
        assert_eq!(cuMemsetD8Async(p, 0xab, 4096, stream), CUDA_SUCCESS);
        assert_eq!(
            cuMemcpyHtoDAsync_v2(p + 100, data.as_ptr().cast(), 256, stream),
            CUDA_SUCCESS
        );
        assert_eq!(cuStreamSynchronize(stream), CUDA_SUCCESS);
        assert_eq!(
            cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), p, 4096),
            CUDA_SUCCESS
        );
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
    }
    assert!(back[..100].iter().all(|&b| b == 0xab));
    assert_eq!(&back[100..356], &data[..]);
    assert!(back[356..].iter().all(|&b| b == 0xab));
}

#[test]
fn ranges_outside_a_live_allocation_are_invalid_values() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p = allocation(4096);
    let mut byte = 0u8;
    let host = (&mut byte as *mut u8).cast::<c_void>();
    // SAFETY: valid one-byte host buffer; the device ranges are what is under test.
    unsafe {
        assert_eq!(cuMemsetD8_v2(p + 4000, 1, 97), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cuMemcpyDtoH_v2(host, p + 4096, 1), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cuMemcpyDtoH_v2(host, p + 4095, 1), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        assert_eq!(cuMemsetD8_v2(p, 1, 1), CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn copies_need_a_current_context() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let p = allocation(64);
    std::thread::spawn(move || {
        let mut byte = 0u8;
        // SAFETY: valid one-byte host buffer.
        let r = unsafe { cuMemcpyDtoH_v2((&mut byte as *mut u8).cast(), p, 1) };
        assert_eq!(r, CUDA_ERROR_INVALID_CONTEXT);
    })
    .join()
    .unwrap();
}

//! Before `cuInit`, the fake driver refuses calls as NVIDIA's does. (Its own test binary:
//! `cuInit` is process-wide.)

use fakecuda::types::*;
use fakecuda::*;

#[test]
fn calls_before_cuinit_are_not_initialized_and_cuinit_fixes_that() {
    let mut count = 0;
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(cuDeviceGetCount(&mut count), CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(cuInit(1), CUDA_ERROR_INVALID_VALUE, "flags must be 0");
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        assert_eq!(cuDeviceGetCount(&mut count), CUDA_SUCCESS);
    }
    assert!(count >= 1);
}

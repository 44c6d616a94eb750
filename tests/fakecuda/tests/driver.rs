//! The fake driver behaves like a driver: per-thread contexts, error codes for bad handles,
//! pending events, capacity, virtual memory, IPC handles.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use fakecuda::types::*;
use fakecuda::*;

/// Initializes the fake (idempotent) and returns device `d`'s retained primary context.
fn primary(d: i32) -> CUcontext {
    static DEVICES: std::sync::Once = std::sync::Once::new();
    // Two devices unless the environment says otherwise; read by the first cuInit.
    DEVICES.call_once(|| {
        if std::env::var_os("TENSORALLOC_SIM_DEVICES").is_none() {
            std::env::set_var("TENSORALLOC_SIM_DEVICES", "2");
        }
    });
    let mut ctx = null_mut();
    // SAFETY: valid out-pointers, as NVIDIA's contract asks.
    unsafe {
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, d), CUDA_SUCCESS);
    }
    ctx
}

fn current() -> CUcontext {
    let mut ctx = null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { cuCtxGetCurrent(&mut ctx) }, CUDA_SUCCESS);
    ctx
}

fn device_prop(d: i32) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: 1,
        requested_handle_types: 0,
        location: CUmemLocation { type_: 1, id: d },
        win32_handle_meta_data: null_mut(),
        alloc_flags: CUmemAllocationPropFlags {
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

#[test]
fn allocation_without_a_current_context_is_invalid_context() {
    std::thread::spawn(|| {
        primary(0);
        let mut p = 0;
        // SAFETY: valid out-pointer.
        assert_eq!(
            unsafe { cuMemAlloc_v2(&mut p, 512) },
            CUDA_ERROR_INVALID_CONTEXT
        );
    })
    .join()
    .unwrap();
}

#[test]
fn each_thread_has_its_own_current_context() {
    let ctx = primary(0) as usize;
    std::thread::spawn(move || {
        let ctx = ctx as CUcontext;
        // SAFETY: a context handle from the driver.
        assert_eq!(unsafe { cuCtxSetCurrent(ctx) }, CUDA_SUCCESS);
        assert_eq!(current(), ctx);
    })
    .join()
    .unwrap();
    std::thread::spawn(|| assert!(current().is_null()))
        .join()
        .unwrap();
}

#[test]
fn push_and_pop_nest_contexts() {
    std::thread::spawn(|| {
        let (c0, c1) = (primary(0), primary(1));
        let mut popped = null_mut();
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            assert_eq!(cuCtxPushCurrent_v2(c0), CUDA_SUCCESS);
            assert_eq!(cuCtxPushCurrent_v2(c1), CUDA_SUCCESS);
            assert_eq!(cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
            assert_eq!(popped, c1);
            assert_eq!(current(), c0);
            assert_eq!(cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
            assert_eq!(cuCtxPopCurrent_v2(&mut popped), CUDA_ERROR_INVALID_CONTEXT);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn a_made_up_context_handle_is_invalid_context() {
    primary(0);
    // SAFETY: the driver must reject, not dereference, an unknown handle.
    assert_eq!(
        unsafe { cuCtxPushCurrent_v2(0x1234 as CUcontext) },
        CUDA_ERROR_INVALID_CONTEXT
    );
}

#[test]
fn an_out_of_range_device_is_invalid_device() {
    primary(0);
    let mut ctx = null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(
        unsafe { cuDevicePrimaryCtxRetain(&mut ctx, 64) },
        CUDA_ERROR_INVALID_DEVICE
    );
}

#[test]
fn an_event_is_not_ready_while_its_stream_is_held() {
    std::thread::spawn(|| {
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
            let mut ev = null_mut();
            assert_eq!(cuEventCreate(&mut ev, 2), CUDA_SUCCESS);
            let stream = 0x4242 as CUstream;
            fakecuda_hold_stream(stream);
            assert_eq!(cuEventRecord(ev, stream), CUDA_SUCCESS);
            assert_eq!(cuEventQuery(ev), CUDA_ERROR_NOT_READY);
            fakecuda_release_stream(stream);
            assert_eq!(cuEventQuery(ev), CUDA_SUCCESS);
            assert_eq!(cuEventDestroy_v2(ev), CUDA_SUCCESS);
            assert_eq!(
                cuEventQuery(ev),
                CUDA_ERROR_INVALID_HANDLE,
                "a destroyed event is gone"
            );
        }
    })
    .join()
    .unwrap();
}

#[test]
fn recording_on_a_stream_of_another_device_is_invalid_handle() {
    std::thread::spawn(|| {
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            assert_eq!(cuCtxSetCurrent(primary(1)), CUDA_SUCCESS);
            let mut stream = null_mut();
            assert_eq!(cuStreamCreate(&mut stream, 0), CUDA_SUCCESS);
            assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
            let mut ev = null_mut();
            assert_eq!(cuEventCreate(&mut ev, 2), CUDA_SUCCESS);
            assert_eq!(cuEventRecord(ev, stream), CUDA_ERROR_INVALID_HANDLE);
            assert_eq!(cuEventDestroy_v2(ev), CUDA_SUCCESS);
            assert_eq!(cuStreamDestroy_v2(stream), CUDA_SUCCESS);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn allocating_past_capacity_is_out_of_memory() {
    std::thread::spawn(|| {
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
            let (mut free, mut total) = (0, 0);
            assert_eq!(cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
            let mut p = 0;
            assert_eq!(cuMemAlloc_v2(&mut p, total + 1), CUDA_ERROR_OUT_OF_MEMORY);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn freeing_twice_is_invalid_value() {
    std::thread::spawn(|| {
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
            let mut p = 0;
            assert_eq!(cuMemAlloc_v2(&mut p, 4096), CUDA_SUCCESS);
            assert_eq!(fakecuda_pointer_device(p), 0);
            assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
            assert_eq!(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn error_names_and_strings_are_nvidias() {
    let (mut name, mut text) = (std::ptr::null(), std::ptr::null());
    // SAFETY: valid out-pointers; on success they point to static strings.
    unsafe {
        assert_eq!(
            cuGetErrorName(CUDA_ERROR_NOT_READY, &mut name),
            CUDA_SUCCESS
        );
        assert_eq!(
            cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &mut text),
            CUDA_SUCCESS
        );
        assert_eq!(
            CStr::from_ptr(name).to_str().unwrap(),
            "CUDA_ERROR_NOT_READY"
        );
        assert_eq!(CStr::from_ptr(text).to_str().unwrap(), "out of memory");
        assert_eq!(cuGetErrorName(123456, &mut name), CUDA_ERROR_INVALID_VALUE);
        assert!(name.is_null());
    }
}

#[test]
fn two_mappings_of_one_physical_allocation_share_bytes() {
    primary(0);
    let g = 2 << 20;
    let prop = device_prop(0);
    // SAFETY: valid out-pointers and properties; the mapped range is accessed only after
    // cuMemSetAccess made it read-write.
    unsafe {
        let mut gran = 0;
        assert_eq!(
            cuMemGetAllocationGranularity(&mut gran, &prop, 0),
            CUDA_SUCCESS
        );
        assert_eq!(gran, g);
        let used = fakecuda_device_used(0);
        let mut va = 0;
        assert_eq!(cuMemAddressReserve(&mut va, 2 * g, 0, 0, 0), CUDA_SUCCESS);
        let mut h = 0;
        assert_eq!(cuMemCreate(&mut h, g, &prop, 0), CUDA_SUCCESS);
        assert!(
            fakecuda_device_used(0) >= used + g as u64,
            "physical memory counts against capacity"
        );
        assert_eq!(cuMemMap(va, g, 0, h, 0), CUDA_SUCCESS);
        assert_eq!(cuMemMap(va + g as u64, g, 0, h, 0), CUDA_SUCCESS);
        assert_eq!(
            cuMemMap(va, g, 0, h, 0),
            CUDA_ERROR_INVALID_VALUE,
            "already mapped"
        );
        let access = CUmemAccessDesc {
            location: CUmemLocation { type_: 1, id: 0 },
            flags: 3,
        };
        assert_eq!(cuMemSetAccess(va, 2 * g, &access, 1), CUDA_SUCCESS);
        *(va as *mut u8) = 7;
        assert_eq!(*((va + g as u64) as *const u8), 7);
        assert_eq!(
            cuMemRelease(h),
            CUDA_SUCCESS,
            "release while mapped is deferred"
        );
        assert_eq!(
            cuMemAddressFree(va, 2 * g),
            CUDA_ERROR_INVALID_VALUE,
            "still mapped"
        );
        assert_eq!(cuMemUnmap(va, 2 * g), CUDA_SUCCESS);
        assert_eq!(cuMemAddressFree(va, 2 * g), CUDA_SUCCESS);
        assert_eq!(
            cuMemRelease(h),
            CUDA_ERROR_INVALID_HANDLE,
            "already released"
        );
    }
}

#[test]
fn a_physical_allocation_past_capacity_is_out_of_memory() {
    primary(0);
    let prop = device_prop(0);
    let mut total = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: a context handle from the driver and valid out-pointers.
            unsafe {
                assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
                let mut free = 0;
                assert_eq!(cuMemGetInfo_v2(&mut free, &mut total), CUDA_SUCCESS);
            }
        });
    });
    let size = (total + (2 << 20)).next_multiple_of(2 << 20);
    let mut h = 0;
    // SAFETY: valid out-pointer and properties.
    assert_eq!(
        unsafe { cuMemCreate(&mut h, size, &prop, 0) },
        CUDA_ERROR_OUT_OF_MEMORY
    );
}

#[test]
fn ipc_handles_exist_only_for_allocation_starts() {
    std::thread::spawn(|| {
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
            let mut p = 0;
            assert_eq!(cuMemAlloc_v2(&mut p, 4096), CUDA_SUCCESS);
            let mut h = CUipcMemHandle { reserved: [0; 64] };
            assert_eq!(cuIpcGetMemHandle(&mut h, p), CUDA_SUCCESS);
            assert_ne!(h.reserved, [0; 64]);
            assert_eq!(cuIpcGetMemHandle(&mut h, p + 512), CUDA_ERROR_INVALID_VALUE);
            assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn pinned_host_allocation_needs_a_context_and_is_counted() {
    std::thread::spawn(|| {
        let mut p: *mut c_void = null_mut();
        // SAFETY: handles from the driver and valid out-pointers.
        unsafe {
            primary(0);
            assert_eq!(cuMemHostAlloc(&mut p, 4096, 1), CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(cuCtxSetCurrent(primary(0)), CUDA_SUCCESS);
            assert_eq!(cuMemHostAlloc(&mut p, 4096, 1), CUDA_SUCCESS);
            assert_eq!(fakecuda_thread_counter(c"host_alloc".as_ptr()), 1);
            assert_eq!(cuMemFreeHost(p), CUDA_SUCCESS);
            assert_eq!(cuMemFreeHost(p), CUDA_ERROR_INVALID_VALUE);
        }
    })
    .join()
    .unwrap();
}

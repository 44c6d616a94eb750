//! The NVIDIA driver backend on a real GPU. Ignored by default: run on a machine with an NVIDIA
//! GPU and driver with `cargo test --test cuda_gpu -- --ignored` (or `tests/gpu/run-c-suite.sh`).

use std::sync::Arc;

use cudarc::driver::sys;
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::driver::Driver;

fn current_context() -> usize {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the driver was loaded and initialized by CudaDriver::load.
    assert_eq!(
        unsafe { sys::cuCtxGetCurrent(&mut ctx) },
        sys::CUresult::CUDA_SUCCESS
    );
    ctx as usize
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_real_driver_loads_and_has_a_device() {
    let d = CudaDriver::load().unwrap();
    assert!(d.device_count().unwrap() >= 1);
    let info = d.mem_info(0).unwrap();
    assert!(info.total > 0 && info.free <= info.total);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_memory_round_trips_and_leaves_no_context_current() {
    std::thread::spawn(|| {
        let d = CudaDriver::load().unwrap();
        let p = d.mem_alloc(0, 1 << 20).unwrap();
        assert_ne!(p, 0);
        assert_eq!(current_context(), 0);
        d.mem_free(0, p).unwrap();
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_event_recorded_on_the_legacy_stream_completes() {
    let d = CudaDriver::load().unwrap();
    let e = d.event_create(0).unwrap();
    d.event_record(0, e, 0).unwrap();
    d.event_synchronize(0, e).unwrap();
    assert!(d.event_query(0, e).unwrap());
    d.event_destroy(0, e).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn freeing_a_bad_pointer_names_the_driver_error() {
    let d = CudaDriver::load().unwrap();
    let err = d.mem_free(0, 0x10).unwrap_err();
    assert!(err.message().contains("CUDA_ERROR_"), "{err}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_host_memory_is_writable() {
    let d = CudaDriver::load().unwrap();
    let p = d.host_alloc(1 << 16).unwrap();
    // SAFETY: the driver just handed out 64 KiB of page-locked host memory at p.
    unsafe { std::ptr::write_bytes(p as *mut u8, 1, 1 << 16) };
    d.host_free(p).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    d.host_register(buf.as_mut_ptr() as usize, buf.len())
        .unwrap();
    d.host_unregister(buf.as_mut_ptr() as usize).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_allocator_caches_real_device_memory() {
    let a =
        DeviceAllocator::new(Arc::new(CudaDriver::load().unwrap()), 0, &Config::default()).unwrap();
    let p = a.malloc(1 << 20, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    let q = a.malloc(1 << 20, 0).unwrap();
    assert_eq!(p, q);
    a.free(q, Some(0)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().num_device_free, 1);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn allocating_to_a_pool_during_a_real_graph_capture_keeps_the_capture_valid() {
    let driver = Arc::new(CudaDriver::load().unwrap());
    let a = DeviceAllocator::new(driver.clone(), 0, &Config::default()).unwrap();
    // A stream of the primary context (allocating first retains and makes it usable).
    let warm = a.malloc(1 << 20, 0).unwrap();
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointers; device 0 exists (the allocation above succeeded).
    unsafe {
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, 0),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuStreamCreate(&mut stream, 1),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    let s = stream as usize;
    let side = a.malloc(1 << 20, s).unwrap();
    a.record_stream(side, 0).unwrap();
    // SAFETY: a stream we created; global mode, as torch.cuda.graph uses.
    let r = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert!(driver.stream_capturing(s).unwrap());
    a.begin_allocate_to_pool((1, 1), None).unwrap();
    let p = a
        .malloc(64 << 20, s)
        .expect("a new segment in relaxed capture mode");
    a.free(side, Some(s)).unwrap();
    a.free(p, Some(s)).unwrap();
    a.end_allocate_to_pool((1, 1)).unwrap();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; valid out-pointer.
    let r = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    assert_eq!(
        r,
        sys::CUresult::CUDA_SUCCESS,
        "the capture was invalidated"
    );
    assert!(!driver.stream_capturing(s).unwrap());
    a.release_pool((1, 1)).unwrap();
    a.free(warm, None).unwrap();
    // SAFETY: handles made above, destroyed once.
    unsafe {
        sys::cuGraphDestroy(graph);
        sys::cuStreamDestroy_v2(stream);
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        sys::cuCtxPopCurrent_v2(&mut popped);
        sys::cuDevicePrimaryCtxRelease_v2(0);
    }
}

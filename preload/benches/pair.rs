//! A cached allocation/free pair through the interposer's hooks, on the fake driver (built here
//! in release mode and loaded as `libcuda.so.1`): what a CUDA program pays per pair once the
//! cache is warm. The hooks are called directly (as a preloaded program's calls would land in
//! them), so their real calls go to the fake driver: `cuCtxGetCurrent` on each allocation, and
//! the marker events of `cuMemFree`'s batches.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tensoralloc_preload::hooks;

type CuContext = *mut c_void;

/// Builds the fake driver in release mode and loads it globally, so that the interposer's
/// `dlopen("libcuda.so.1")` (and the backend's) find it by its SONAME.
fn load_fake_driver() -> *mut c_void {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = std::process::Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "fakecuda"])
        .current_dir(&root)
        .status()
        .expect("run cargo to build the fake driver");
    assert!(status.success(), "building the fake driver failed");
    let lib = root.join("target/release/libfakecuda.so");
    let path = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; the library has no constructors that need anything.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!h.is_null(), "cannot load {}", lib.display());
    h
}

fn sym<T>(h: *mut c_void, name: &CStr) -> T {
    // SAFETY: the handle is the fake driver's; the name is NUL-terminated.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!p.is_null(), "{name:?} missing");
    // SAFETY: T is the function pointer type of that symbol (NVIDIA's prototype).
    unsafe { std::mem::transmute_copy(&p) }
}

fn pairs(c: &mut Criterion) {
    let h = load_fake_driver();
    let init: unsafe extern "C" fn(c_uint) -> c_int = sym(h, c"cuInit");
    let retain: unsafe extern "C" fn(*mut CuContext, c_int) -> c_int =
        sym(h, c"cuDevicePrimaryCtxRetain");
    let set: unsafe extern "C" fn(CuContext) -> c_int = sym(h, c"cuCtxSetCurrent");
    let stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int =
        sym(h, c"cuStreamCreate");
    let fake_alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int = sym(h, c"cuMemAlloc_v2");
    let fake_free: unsafe extern "C" fn(u64) -> c_int = sym(h, c"cuMemFree_v2");
    let mut ctx: CuContext = std::ptr::null_mut();
    let mut stream: *mut c_void = std::ptr::null_mut();
    // SAFETY: the fake driver's functions with valid arguments.
    unsafe {
        assert_eq!(init(0), 0);
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(set(ctx), 0);
        assert_eq!(stream_create(&mut stream, 1), 0);
    }

    let mut g = c.benchmark_group("preload_pair");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    g.bench_function("cuMemAllocAsync+cuMemFreeAsync 4KiB same stream", |b| {
        b.iter(|| {
            let mut p = 0u64;
            // SAFETY: hooks with valid out-pointers; the pointer is freed once.
            unsafe {
                assert_eq!(hooks::cuMemAllocAsync(&mut p, 4096, stream.cast()), 0);
                assert_eq!(hooks::cuMemFreeAsync(p, stream.cast()), 0);
            }
        })
    });
    g.bench_function("cuMemAlloc+cuMemFree 4KiB", |b| {
        b.iter(|| {
            let mut p = 0u64;
            // SAFETY: as above.
            unsafe {
                assert_eq!(hooks::cuMemAlloc_v2(&mut p, 4096), 0);
                assert_eq!(hooks::cuMemFree_v2(p), 0);
            }
        })
    });
    g.bench_function("cuMemAlloc+cuMemFree 1MiB", |b| {
        b.iter(|| {
            let mut p = 0u64;
            // SAFETY: as above.
            unsafe {
                assert_eq!(hooks::cuMemAlloc_v2(&mut p, 1 << 20), 0);
                assert_eq!(hooks::cuMemFree_v2(p), 0);
            }
        })
    });
    g.bench_function("cuMemHostAlloc+cuMemFreeHost 8KiB", |b| {
        b.iter(|| {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: as above.
            unsafe {
                assert_eq!(hooks::cuMemHostAlloc(&mut p, 8192, 0), 0);
                assert_eq!(hooks::cuMemFreeHost(p), 0);
            }
        })
    });
    let floor = tensoralloc::device::DeviceAllocator::new(
        std::sync::Arc::new(tensoralloc::driver::cuda::CudaDriver::load().unwrap()),
        0,
        &tensoralloc::config::Config::default(),
    )
    .unwrap();
    g.bench_function(
        "DeviceAllocator malloc+free 4KiB, no interposer (the floor)",
        |b| {
            b.iter(|| {
                let p = floor.malloc(4096, stream as usize).unwrap();
                floor.free(p, Some(stream as usize)).unwrap();
            })
        },
    );
    g.bench_function(
        "fake driver cuMemAlloc+cuMemFree 4KiB, no interposer",
        |b| {
            b.iter(|| {
                let mut p = 0u64;
                // SAFETY: the fake driver's functions with a valid out-pointer.
                unsafe {
                    assert_eq!(fake_alloc(&mut p, 4096), 0);
                    assert_eq!(fake_free(p), 0);
                }
            })
        },
    );
    g.finish();
}

criterion_group!(benches, pairs);
criterion_main!(benches);

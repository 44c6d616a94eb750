//! Shared by the `cuda_*` integration tests: loads the fake NVIDIA driver built by
//! `cargo build -p fakecuda` into the test process and reaches its driver entry points and
//! test controls with `dlsym`.
//!
//! The fake's SONAME is `libcuda.so.1`, so once it is loaded by path, the backend's own search
//! for `libcuda.so.1` finds this same copy whether or not `LD_LIBRARY_PATH` names it.

#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tensoralloc::driver::cuda::CudaDriver;

/// Where the fake driver library is: `$FAKECUDA_LIB`, or `libfakecuda.so` next to the
/// test's own profile directory (`target/debug/libfakecuda.so` for `target/debug/deps/...`).
pub fn fake_library_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAKECUDA_LIB") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>
    let profile = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("test executable lives in target/<profile>/deps");
    let candidates = [
        profile.join("libfakecuda.so"),
        profile.with_file_name("debug").join("libfakecuda.so"),
    ];
    candidates.iter().find(|p| p.exists()).cloned().unwrap_or_else(|| {
        panic!(
            "the fake NVIDIA driver is not built: run `cargo build -p fakecuda` first (looked for {}; \
             or set FAKECUDA_LIB to the path of libfakecuda.so)",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        )
    })
}

static HANDLE: OnceLock<usize> = OnceLock::new();

/// Loads the fake driver once per process, with two simulated devices unless the environment
/// asks for more, and returns its `dlopen` handle.
pub fn load_fake() -> *mut c_void {
    *HANDLE.get_or_init(|| {
        let enough = std::env::var("TENSORALLOC_SIM_DEVICES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .is_some_and(|n| n >= 2);
        if !enough {
            // Read by the fake's cuInit; set before any test thread initializes it.
            std::env::set_var("TENSORALLOC_SIM_DEVICES", "2");
        }
        let path = fake_library_path();
        let c = CString::new(path.to_str().expect("UTF-8 path")).expect("no NUL");
        // SAFETY: a valid path string; the library's initializers have no preconditions.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(
            !h.is_null(),
            "cannot load the fake driver {}",
            path.display()
        );
        h as usize
    }) as *mut c_void
}

/// A symbol of the fake driver, as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the function's true type.
pub unsafe fn sym<F: Copy>(name: &str) -> F {
    let h = load_fake();
    let c = CString::new(name).expect("no NUL");
    // SAFETY: a handle from dlopen and a NUL-terminated name.
    let p = unsafe { libc::dlsym(h, c.as_ptr()) };
    assert!(!p.is_null(), "the fake driver does not export {name}");
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller promises F is the symbol's function type, a pointer-sized value.
    unsafe { std::mem::transmute_copy(&p) }
}

type Counter = unsafe extern "C" fn(*const c_char) -> u64;

/// A process-wide call counter of the fake driver (`events_created`, `ctx_push`...).
pub fn counter(name: &str) -> u64 {
    let c = CString::new(name).expect("no NUL");
    // SAFETY: the fake exports fakecuda_counter with this type.
    let v = unsafe { sym::<Counter>("fakecuda_counter")(c.as_ptr()) };
    assert_ne!(v, u64::MAX, "the fake driver has no counter {name}");
    v
}

/// The calling thread's count of a call of the fake driver.
pub fn thread_counter(name: &str) -> u64 {
    let c = CString::new(name).expect("no NUL");
    // SAFETY: the fake exports fakecuda_thread_counter with this type.
    let v = unsafe { sym::<Counter>("fakecuda_thread_counter")(c.as_ptr()) };
    assert_ne!(v, u64::MAX, "the fake driver has no counter {name}");
    v
}

/// Holds a stream of the fake driver: events recorded on it stay pending.
pub fn hold_stream(stream: usize) {
    // SAFETY: the fake exports fakecuda_hold_stream with this type.
    unsafe { sym::<extern "C" fn(*mut c_void)>("fakecuda_hold_stream")(stream as *mut c_void) }
}

/// Releases a held stream of the fake driver.
pub fn release_stream(stream: usize) {
    // SAFETY: the fake exports fakecuda_release_stream with this type.
    unsafe { sym::<extern "C" fn(*mut c_void)>("fakecuda_release_stream")(stream as *mut c_void) }
}

/// The device that owns a `cuMemAlloc` allocation, or -1.
pub fn pointer_device(ptr: usize) -> c_int {
    // SAFETY: the fake exports fakecuda_pointer_device with this type.
    unsafe { sym::<extern "C" fn(u64) -> c_int>("fakecuda_pointer_device")(ptr as u64) }
}

/// Driver calls that tests make themselves (status codes as plain integers).
pub mod cu {
    use super::sym;
    use std::ffi::c_void;

    pub const SUCCESS: u32 = 0;

    /// The calling thread's current context (0 for none).
    pub fn ctx_get_current() -> usize {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: NVIDIA's prototype: CUresult cuCtxGetCurrent(CUcontext *).
        let r = unsafe {
            sym::<unsafe extern "C" fn(*mut *mut c_void) -> u32>("cuCtxGetCurrent")(&mut ctx)
        };
        assert_eq!(r, SUCCESS, "cuCtxGetCurrent");
        ctx as usize
    }

    /// Retains device `d`'s primary context and returns it.
    pub fn primary_ctx_retain(d: i32) -> usize {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: NVIDIA's prototype: CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice).
        let r = unsafe {
            sym::<unsafe extern "C" fn(*mut *mut c_void, i32) -> u32>("cuDevicePrimaryCtxRetain")(
                &mut ctx, d,
            )
        };
        assert_eq!(r, SUCCESS, "cuDevicePrimaryCtxRetain");
        ctx as usize
    }

    /// Makes `ctx` current on the calling thread (0 unbinds).
    pub fn ctx_set_current(ctx: usize) {
        // SAFETY: NVIDIA's prototype: CUresult cuCtxSetCurrent(CUcontext).
        let r = unsafe {
            sym::<unsafe extern "C" fn(*mut c_void) -> u32>("cuCtxSetCurrent")(ctx as *mut c_void)
        };
        assert_eq!(r, SUCCESS, "cuCtxSetCurrent");
    }

    /// Pops the current context; returns the status code.
    pub fn ctx_pop_current() -> u32 {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: NVIDIA's prototype: CUresult cuCtxPopCurrent(CUcontext *).
        unsafe {
            sym::<unsafe extern "C" fn(*mut *mut c_void) -> u32>("cuCtxPopCurrent_v2")(&mut ctx)
        }
    }

    /// Creates a stream in the current context.
    pub fn stream_create() -> usize {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: NVIDIA's prototype: CUresult cuStreamCreate(CUstream *, unsigned int).
        let r = unsafe {
            sym::<unsafe extern "C" fn(*mut *mut c_void, u32) -> u32>("cuStreamCreate")(&mut s, 0)
        };
        assert_eq!(r, SUCCESS, "cuStreamCreate");
        s as usize
    }
}

/// The NVIDIA backend loaded over the fake driver, shared by the tests of one process.
pub fn cuda_driver() -> Arc<CudaDriver> {
    static DRIVER: OnceLock<Arc<CudaDriver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            load_fake();
            Arc::new(CudaDriver::load().expect("the backend loads the fake driver"))
        })
        .clone()
}

/// Runs `f` on a fresh thread, whose call counters (`thread_counter`) start at zero.
pub fn on_new_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().expect("test thread")
}

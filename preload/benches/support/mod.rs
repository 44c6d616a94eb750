//! Loads the fake driver and the preload library as a preloaded program would see them: the
//! fake driver (release build) globally under its SONAME `libcuda.so.1`, and the hooks from the
//! built `libtensoralloc_preload.so` itself, so that what is measured is the shared library's
//! code (its thread-local storage and symbol lookups included), not the rlib's.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};

pub type CuContext = *mut c_void;
pub type CuStream = *mut c_void;

/// The hooks of `libtensoralloc_preload.so`, and the fake driver's own functions.
pub struct Loaded {
    pub alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int,
    pub free: unsafe extern "C" fn(u64) -> c_int,
    pub alloc_async: unsafe extern "C" fn(*mut u64, usize, CuStream) -> c_int,
    pub free_async: unsafe extern "C" fn(u64, CuStream) -> c_int,
    pub host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int,
    pub free_host: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub fake_alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int,
    pub fake_free: unsafe extern "C" fn(u64) -> c_int,
    /// A non-blocking stream of the primary context of device 0, current on this thread.
    pub stream: CuStream,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Builds both libraries in release mode.
fn build() -> PathBuf {
    let status = std::process::Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "-p",
            "fakecuda",
            "-p",
            "tensoralloc_preload",
        ])
        .current_dir(root())
        .status()
        .expect("run cargo to build the fake driver and the preload library");
    assert!(status.success(), "building the libraries failed");
    root().join("target/release")
}

fn open(lib: &Path, flags: c_int) -> *mut c_void {
    let path = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; neither library needs anything from its constructors.
    let h = unsafe { libc::dlopen(path.as_ptr(), flags) };
    assert!(!h.is_null(), "cannot load {}", lib.display());
    h
}

fn sym<T>(h: *mut c_void, name: &CStr) -> T {
    // SAFETY: a handle from dlopen; the name is NUL-terminated.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!p.is_null(), "{name:?} missing");
    // SAFETY: T is the function pointer type of that symbol (NVIDIA's prototype).
    unsafe { std::mem::transmute_copy(&p) }
}

/// Loads both, makes device 0's primary context current and creates a non-blocking stream.
pub fn load() -> Loaded {
    let dir = build();
    let fake = open(
        &dir.join("libfakecuda.so"),
        libc::RTLD_NOW | libc::RTLD_GLOBAL,
    );
    let preload = open(
        &dir.join("libtensoralloc_preload.so"),
        libc::RTLD_NOW | libc::RTLD_LOCAL,
    );
    let init: unsafe extern "C" fn(c_uint) -> c_int = sym(fake, c"cuInit");
    let retain: unsafe extern "C" fn(*mut CuContext, c_int) -> c_int =
        sym(fake, c"cuDevicePrimaryCtxRetain");
    let set: unsafe extern "C" fn(CuContext) -> c_int = sym(fake, c"cuCtxSetCurrent");
    let stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> c_int =
        sym(preload, c"cuStreamCreate");
    let mut ctx: CuContext = std::ptr::null_mut();
    let mut stream: CuStream = std::ptr::null_mut();
    // SAFETY: the fake driver's functions (and the preload's stream hook) with valid arguments.
    unsafe {
        assert_eq!(init(0), 0);
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(set(ctx), 0);
        assert_eq!(stream_create(&mut stream, 1), 0);
    }
    Loaded {
        alloc: sym(preload, c"cuMemAlloc_v2"),
        free: sym(preload, c"cuMemFree_v2"),
        alloc_async: sym(preload, c"cuMemAllocAsync"),
        free_async: sym(preload, c"cuMemFreeAsync"),
        host_alloc: sym(preload, c"cuMemHostAlloc"),
        free_host: sym(preload, c"cuMemFreeHost"),
        fake_alloc: sym(fake, c"cuMemAlloc_v2"),
        fake_free: sym(fake, c"cuMemFree_v2"),
        stream,
    }
}

impl Loaded {
    /// One `cuMemAllocAsync` + `cuMemFreeAsync` of `size` bytes on the stream.
    #[inline(always)]
    pub fn async_pair(&self, size: usize) {
        let mut p = 0u64;
        // SAFETY: hooks with a valid out-pointer; the pointer is freed once.
        unsafe {
            assert_eq!((self.alloc_async)(&mut p, size, self.stream), 0);
            assert_eq!((self.free_async)(p, self.stream), 0);
        }
    }

    /// One `cuMemAlloc` + `cuMemFree` of `size` bytes.
    #[inline(always)]
    pub fn sync_pair(&self, size: usize) {
        let mut p = 0u64;
        // SAFETY: as above.
        unsafe {
            assert_eq!((self.alloc)(&mut p, size), 0);
            assert_eq!((self.free)(p), 0);
        }
    }

    /// One `cuMemHostAlloc` + `cuMemFreeHost` of `size` bytes.
    #[inline(always)]
    pub fn host_pair(&self, size: usize) {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above.
        unsafe {
            assert_eq!((self.host_alloc)(&mut p, size, 0), 0);
            assert_eq!((self.free_host)(p), 0);
        }
    }
}

//! The real functions behind the hooks, and the interposed `dlsym`.
//!
//! - Driver functions come from our own `dlopen("libcuda.so.1")` handle: a handle lookup
//!   searches the driver library, never the preloaded hooks, so these calls reach the driver.
//! - Runtime functions come from `dlsym(RTLD_NEXT, ...)`: the `libcudart.so` the program linked.
//! - A CUDA runtime (static `libcudart`, PyTorch's) finds the driver with
//!   `dlopen` + `dlsym(handle, "cuGetProcAddress_v2")` and reaches every other driver function
//!   through it; a handle lookup bypasses `LD_PRELOAD`, so `dlsym` itself is interposed, for
//!   those two names only. Every other lookup is a tail jump to the real `dlsym`, so the real
//!   one sees the caller's own return address (what `RTLD_NEXT` is relative to).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use once_cell::sync::OnceCell;

/// `CUresult` / `cudaError_t`.
pub type Status = c_int;
pub type CuStream = *mut c_void;
pub type CuContext = *mut c_void;

pub const SUCCESS: Status = 0;
pub const INVALID_VALUE: Status = 1;
pub const OUT_OF_MEMORY: Status = 2;
pub const UNKNOWN: Status = 999;

/// The real `dlsym`, found with `dlvsym` (which is not interposed).
static TENSORALLOC_PRELOAD_REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

fn real_dlsym_fn() -> usize {
    let cur = TENSORALLOC_PRELOAD_REAL_DLSYM.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    let mut found = 0usize;
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: both strings are NUL-terminated; dlvsym has no other precondition.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !p.is_null() {
            found = p as usize;
            break;
        }
    }
    TENSORALLOC_PRELOAD_REAL_DLSYM.store(found, Ordering::Release);
    found
}

/// Looks `name` up with the real `dlsym` (for handles; `RTLD_NEXT` here means after this library).
pub fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let f = real_dlsym_fn();
    if f == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: `f` is glibc's dlsym, whose prototype this is.
    let f: unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void =
        unsafe { std::mem::transmute(f) };
    // SAFETY: `name` is NUL-terminated; the handle is the caller's.
    unsafe { f(handle, name.as_ptr()) }
}

/// The driver's own `cuGetProcAddress` entry points, as `dlsym` returned them to a runtime.
pub static DRIVER_GPA: AtomicUsize = AtomicUsize::new(0);
pub static DRIVER_GPA_V2: AtomicUsize = AtomicUsize::new(0);

/// Decides a `dlsym` call: a replacement for the driver's `cuGetProcAddress*`, or NULL to let
/// the real `dlsym` answer.
extern "C" fn dlsym_decide(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    if real_dlsym_fn() == 0 || name.is_null() || !crate::enabled() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's caller passes a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name) };
    let (ours, slot): (*mut c_void, &AtomicUsize) = match name.to_bytes() {
        b"cuGetProcAddress_v2" => (
            crate::hooks::cuGetProcAddress_v2 as *mut c_void,
            &DRIVER_GPA_V2,
        ),
        b"cuGetProcAddress" => (crate::hooks::cuGetProcAddress as *mut c_void, &DRIVER_GPA),
        _ => return std::ptr::null_mut(),
    };
    if handle == libc::RTLD_NEXT || handle == libc::RTLD_DEFAULT {
        // The global scope already finds our hook first.
        return std::ptr::null_mut();
    }
    let real = lookup(handle, name);
    if real.is_null() || real == ours {
        return std::ptr::null_mut();
    }
    let _ = slot.compare_exchange(0, real as usize, Ordering::AcqRel, Ordering::Acquire);
    ours
}

/// The interposed `dlsym`: `dlsym_decide`, then either its answer or a tail jump to the real
/// `dlsym` with the caller's stack untouched.
///
/// # Safety
/// `dlsym`'s contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(no_mangle)]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // Entry: rsp = 8 mod 16. Save the arguments (plus 8 bytes to realign), ask, restore.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "jmp qword ptr [rip + {real}]",
        "2:",
        "ret",
        decide = sym dlsym_decide,
        real = sym TENSORALLOC_PRELOAD_REAL_DLSYM,
    )
}

/// Our handle of the driver library, opened on first need (never at load time).
fn driver_handle() -> *mut c_void {
    static HANDLE: OnceCell<usize> = OnceCell::new();
    *HANDLE.get_or_init(|| {
        // SAFETY: a NUL-terminated name; a program that calls the driver has it loaded already.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        h as usize
    }) as *mut c_void
}

/// A driver function by name, from the driver's own handle.
pub fn driver_fn(name: &CStr) -> *mut c_void {
    let h = driver_handle();
    if h.is_null() {
        return std::ptr::null_mut();
    }
    lookup(h, name)
}

/// A runtime function by name: the next definition after this library.
pub fn runtime_fn(name: &CStr) -> *mut c_void {
    lookup(libc::RTLD_NEXT, name)
}

/// Declares lazily resolved real functions: `real::NAME()` returns `Option<fn>`.
macro_rules! real_fns {
    ($($kind:ident $name:ident : fn($($arg:ty),*) -> $ret:ty;)*) => {
        $(
            #[allow(non_snake_case, clippy::type_complexity)]
            pub fn $name() -> Option<unsafe extern "C" fn($($arg),*) -> $ret> {
                static CELL: OnceCell<usize> = OnceCell::new();
                let p = *CELL.get_or_init(|| $kind(&std::ffi::CString::new(stringify!($name)).unwrap()) as usize);
                // SAFETY: the symbol of this name has this prototype in NVIDIA's headers.
                (p != 0).then(|| unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(p) })
            }
        )*
    };
}

real_fns! {
    driver_fn cuCtxGetCurrent: fn(*mut CuContext) -> Status;
    driver_fn cuCtxGetDevice: fn(*mut c_int) -> Status;
    driver_fn cuCtxPushCurrent_v2: fn(CuContext) -> Status;
    driver_fn cuCtxPopCurrent_v2: fn(*mut CuContext) -> Status;
    driver_fn cuCtxSynchronize: fn() -> Status;
    driver_fn cuDeviceGet: fn(*mut c_int, c_int) -> Status;
    driver_fn cuDevicePrimaryCtxRetain: fn(*mut CuContext, c_int) -> Status;
    driver_fn cuStreamGetCtx: fn(CuStream, *mut CuContext) -> Status;
    driver_fn cuMemAlloc_v2: fn(*mut u64, usize) -> Status;
    driver_fn cuMemFree_v2: fn(u64) -> Status;
    driver_fn cuMemAllocAsync: fn(*mut u64, usize, CuStream) -> Status;
    driver_fn cuMemFreeAsync: fn(u64, CuStream) -> Status;
    driver_fn cuMemAllocAsync_ptsz: fn(*mut u64, usize, CuStream) -> Status;
    driver_fn cuMemFreeAsync_ptsz: fn(u64, CuStream) -> Status;
    driver_fn cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint) -> Status;
    driver_fn cuMemAllocHost_v2: fn(*mut *mut c_void, usize) -> Status;
    driver_fn cuMemFreeHost: fn(*mut c_void) -> Status;
    driver_fn cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> Status;
    driver_fn cuStreamCreate: fn(*mut CuStream, c_uint) -> Status;
    driver_fn cuStreamCreateWithPriority: fn(*mut CuStream, c_uint, c_int) -> Status;
    driver_fn cuStreamDestroy_v2: fn(CuStream) -> Status;
    runtime_fn cudaMalloc: fn(*mut *mut c_void, usize) -> Status;
    runtime_fn cudaFree: fn(*mut c_void) -> Status;
    runtime_fn cudaMallocAsync: fn(*mut *mut c_void, usize, CuStream) -> Status;
    runtime_fn cudaFreeAsync: fn(*mut c_void, CuStream) -> Status;
    runtime_fn cudaMallocAsync_ptsz: fn(*mut *mut c_void, usize, CuStream) -> Status;
    runtime_fn cudaFreeAsync_ptsz: fn(*mut c_void, CuStream) -> Status;
    runtime_fn cudaMallocHost: fn(*mut *mut c_void, usize) -> Status;
    runtime_fn cudaHostAlloc: fn(*mut *mut c_void, usize, c_uint) -> Status;
    runtime_fn cudaFreeHost: fn(*mut c_void) -> Status;
    runtime_fn cudaMemGetInfo: fn(*mut usize, *mut usize) -> Status;
    runtime_fn cudaGetDevice: fn(*mut c_int) -> Status;
    runtime_fn cudaStreamCreateWithFlags: fn(*mut CuStream, c_uint) -> Status;
    runtime_fn cudaStreamCreateWithPriority: fn(*mut CuStream, c_uint, c_int) -> Status;
    runtime_fn cudaStreamDestroy: fn(CuStream) -> Status;
}

/// The driver's `cuGetProcAddress_v2`: the one a runtime's `dlsym` got, else our handle's.
#[allow(clippy::type_complexity)]
pub fn gpa_v2(
) -> Option<unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> Status>
{
    let mut p = DRIVER_GPA_V2.load(Ordering::Acquire);
    if p == 0 {
        p = driver_fn(c"cuGetProcAddress_v2") as usize;
    }
    // SAFETY: NVIDIA's prototype of cuGetProcAddress_v2.
    (p != 0).then(|| unsafe { std::mem::transmute(p) })
}

/// The driver's CUDA 11 `cuGetProcAddress` (no status parameter).
#[allow(clippy::type_complexity)]
pub fn gpa() -> Option<unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> Status>
{
    let mut p = DRIVER_GPA.load(Ordering::Acquire);
    if p == 0 {
        p = driver_fn(c"cuGetProcAddress") as usize;
    }
    // SAFETY: NVIDIA's prototype of the CUDA 11 cuGetProcAddress.
    (p != 0).then(|| unsafe { std::mem::transmute(p) })
}

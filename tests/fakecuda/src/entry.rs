//! Entry points that CUDA runtimes reach the driver through: `cuGetProcAddress` (both ABIs),
//! the stream-ordered allocation calls, `cuMemAllocHost`, `cuCtxSynchronize` and
//! `cuStreamCreateWithPriority`.
//!
//! `cuGetProcAddress` answers with this library's own definitions (looked up through its own
//! `dlopen` handle, never the global scope), so a library that interposes on the driver sees
//! exactly what a real driver would hand out.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use once_cell::sync::OnceCell;
use tensoralloc::driver::{sim, Driver};

use crate::state::{count, with_stack, Counter, Fake};
use crate::types::*;
use crate::{guard, put};

/// `cuuint64_t`.
#[allow(non_camel_case_types)]
pub type cuuint64_t = u64;
/// `CUdriverProcAddressQueryResult` (an enumeration).
pub type CUdriverProcAddressQueryResult = c_uint;

const CU_GET_PROC_ADDRESS_SUCCESS: CUdriverProcAddressQueryResult = 0;
const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: CUdriverProcAddressQueryResult = 1;
const CUDA_ERROR_NOT_FOUND: CUresult = 500;

/// This library's own `dlopen` handle, so that lookups never see an interposer.
fn own_handle() -> Option<usize> {
    static HANDLE: OnceCell<Option<usize>> = OnceCell::new();
    *HANDLE.get_or_init(|| {
        // SAFETY: an all-zero Dl_info is a valid out-value for dladdr.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr only reads the address; `info` is valid for writes.
        let found = unsafe { libc::dladdr(crate::cuInit as *const c_void, &mut info) };
        if found == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dli_fname names this (loaded) library; RTLD_NOLOAD only takes a reference.
        let h = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        (!h.is_null()).then_some(h as usize)
    })
}

/// The newest version of the driver function `symbol` this library defines (`name_v2`, else
/// `name`), as a real driver resolves a base name for a recent CUDA version.
fn resolve(symbol: &str) -> Option<*mut c_void> {
    let handle = own_handle()? as *mut c_void;
    [format!("{symbol}_v2"), symbol.to_string()]
        .into_iter()
        .find_map(|name| {
            let name = CString::new(name).ok()?;
            // SAFETY: the handle is this loaded library's; the name is NUL-terminated.
            let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
            (!p.is_null()).then_some(p)
        })
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    status: *mut CUdriverProcAddressQueryResult,
) -> Result<(), CUresult> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes a NUL-terminated name (NVIDIA's contract).
    let name = unsafe { CStr::from_ptr(symbol) }
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let found = resolve(name).filter(|_| name.starts_with("cu"));
    let code = if found.is_some() {
        CU_GET_PROC_ADDRESS_SUCCESS
    } else {
        CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    };
    // SAFETY: checked non-NULL; the caller passes a valid out-pointer.
    unsafe { put(pfn, found.unwrap_or(std::ptr::null_mut())) }?;
    if !status.is_null() {
        // SAFETY: non-NULL out-pointer from the caller.
        unsafe { put(status, code) }?;
    }
    found.map(|_| ()).ok_or(CUDA_ERROR_NOT_FOUND)
}

/// Allocates like `cuMemAlloc`, on the device of a stream of the current context.
fn alloc_on(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> Result<(), CUresult> {
    let fake = Fake::get()?;
    fake.current_device()?;
    let d = fake.stream_device(stream)?;
    // The stream's context is current for the allocation, as on the driver.
    with_stack(|s| s.push(d));
    // SAFETY: the caller's contract is the same as for cuMemAlloc.
    let r = unsafe { crate::cuMemAlloc_v2(dptr, bytesize) };
    with_stack(|s| s.pop());
    match r {
        CUDA_SUCCESS => Ok(()),
        code => Err(code),
    }
}

driver_api! {
    /// Finds a driver function by its base name (`cuMemAlloc` gives `cuMemAlloc_v2`).
    /// `CUDA_ERROR_NOT_FOUND`, a NULL function and status 1 for names it does not define.
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cudaVersion: c_int, flags: cuuint64_t, symbolStatus: *mut CUdriverProcAddressQueryResult) {
        let _ = (cudaVersion, flags);
        get_proc_address(symbol, pfn, symbolStatus)
    }

    /// Allocates device memory for use on `hStream` (counted as `mem_alloc`).
    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, hStream: CUstream) {
        alloc_on(dptr, bytesize, hStream)
    }

    /// Frees memory from `cuMemAllocAsync` or `cuMemAlloc` (counted as `mem_free`).
    fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) {
        let fake = Fake::get()?;
        fake.stream_device(hStream)?;
        let (d, _) = fake.allocations.lock().remove(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        fake.sim.mem_free(d, dptr as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        count(Counter::MemFree);
        Ok(())
    }

    /// Allocates page-locked host memory (`cuMemHostAlloc` with no flags).
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) {
        // SAFETY: the caller's contract is the same as for cuMemHostAlloc.
        match unsafe { crate::cuMemHostAlloc(pp, bytesize, 0) } {
            CUDA_SUCCESS => Ok(()),
            code => Err(code),
        }
    }

    /// Waits for all work of the current context: completes every event of every held stream.
    fn cuCtxSynchronize() {
        Fake::get()?.current_device()?;
        sim::release_all_streams();
        Ok(())
    }

    /// Creates a stream in the current context (the priority is ignored).
    fn cuStreamCreateWithPriority(phStream: *mut CUstream, flags: c_uint, priority: c_int) {
        let _ = priority;
        // SAFETY: the caller's contract is the same as for cuStreamCreate.
        match unsafe { crate::cuStreamCreate(phStream, flags) } {
            CUDA_SUCCESS => Ok(()),
            code => Err(code),
        }
    }
}

/// The CUDA 11 ABI of `cuGetProcAddress` (no status out-parameter), which `cuda.h` declares
/// only for `__CUDA_API_VERSION_INTERNAL`; still exported by NVIDIA's drivers for old callers.
///
/// # Safety
/// NVIDIA's contract: `symbol` is NUL-terminated, `pfn` is valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cudaVersion: c_int,
    flags: cuuint64_t,
) -> CUresult {
    let _ = (cudaVersion, flags);
    guard(move || get_proc_address(symbol, pfn, std::ptr::null_mut()))
}

/// Exports whose prototypes `cuda.h` declares only under `__CUDA_API_VERSION_INTERNAL`.
pub const LEGACY_EXPORTS: &[(&str, &[&str])] = &[(
    "cuGetProcAddress",
    &["*const c_char", "*mut *mut c_void", "c_int", "cuuint64_t"],
)];

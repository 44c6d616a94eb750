//! The C boundary: thin wrappers that validate arguments, catch panics, set the calling
//! thread's last error and convert types. No allocator logic lives here.
//!
//! Every exported body runs inside [`ffi_boundary!`], so nothing unwinds into C.
//!
//! Exported functions take raw pointers from C and are safe Rust functions: C cannot see
//! Rust's `unsafe`, so each one checks its pointers for NULL and documents what the caller
//! must provide, instead of being marked `unsafe`.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use crate::error::Error;

pub mod device;
pub mod host;
pub mod plan;
pub mod pools;
pub mod sim;
pub mod snapshot;
pub mod version;

/// A CUDA stream (`cudaStream_t`, `CUstream`). Opaque: tensoralloc only passes it to the driver
/// and uses its address to tell streams apart. NULL is the legacy default stream.
#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}

/// The stream handle as an integer.
pub(crate) fn stream_id(stream: *mut CUstream_st) -> crate::driver::Stream {
    stream as usize
}

/// Status returned by tensoralloc functions that do not return a pointer: 0 on success, and
/// otherwise one of the `TENSORALLOC_ERR_*` values; `tensoralloc_last_error()` says why.
#[allow(non_camel_case_types)]
pub type tensoralloc_status = c_int;

/// The call succeeded.
pub const TENSORALLOC_OK: tensoralloc_status = 0;
/// An argument was rejected (bad size, device index, NULL pointer, unknown name...).
pub const TENSORALLOC_ERR_INVALID_ARGUMENT: tensoralloc_status = 1;
/// Out of memory, after freeing the cache and retrying.
pub const TENSORALLOC_ERR_OUT_OF_MEMORY: tensoralloc_status = 2;
/// The driver reported an error; the last error names it.
pub const TENSORALLOC_ERR_DRIVER: tensoralloc_status = 3;
/// No usable driver (no `libcuda.so.1`, or a simulated device that was not configured).
pub const TENSORALLOC_ERR_NO_DRIVER: tensoralloc_status = 4;
/// A pointer that tensoralloc does not own, or owns no longer.
pub const TENSORALLOC_ERR_UNKNOWN_POINTER: tensoralloc_status = 5;
/// The configuration string (`TENSORALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF`) is malformed.
pub const TENSORALLOC_ERR_CONFIG: tensoralloc_status = 6;
/// An internal error or a caught panic; the operation was abandoned.
pub const TENSORALLOC_ERR_INTERNAL: tensoralloc_status = 7;

/// The status code of an error.
pub(crate) fn status_of(e: &Error) -> tensoralloc_status {
    match e {
        Error::InvalidArgument(_) => TENSORALLOC_ERR_INVALID_ARGUMENT,
        Error::OutOfMemory(_) => TENSORALLOC_ERR_OUT_OF_MEMORY,
        Error::Driver(_) => TENSORALLOC_ERR_DRIVER,
        Error::NoDriver(_) => TENSORALLOC_ERR_NO_DRIVER,
        Error::UnknownPointer(_) => TENSORALLOC_ERR_UNKNOWN_POINTER,
        Error::Config(_) => TENSORALLOC_ERR_CONFIG,
        Error::Internal(_) => TENSORALLOC_ERR_INTERNAL,
    }
}

struct LastError {
    message: CString,
    set: bool,
}

/// Threads whose last error is set. While it is 0, clearing the last error needs no
/// thread-local lookup (a call through the dynamic TLS model in a shared library).
static ERRORS_SET: AtomicUsize = AtomicUsize::new(0);

impl Drop for LastError {
    fn drop(&mut self) {
        if self.set {
            ERRORS_SET.fetch_sub(1, Relaxed);
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<LastError> = RefCell::new(LastError {
        message: CString::default(),
        set: false,
    });
}

/// Clears this thread's last error. Cheap when there is none (the usual case on hot paths).
#[inline]
pub(crate) fn clear_last_error() {
    // A thread that set its error counts itself here, so it always sees a nonzero count.
    if ERRORS_SET.load(Relaxed) == 0 {
        return;
    }
    let _ = LAST_ERROR.try_with(|cell| {
        if let Ok(mut last) = cell.try_borrow_mut() {
            if last.set {
                last.message = CString::default();
                last.set = false;
                ERRORS_SET.fetch_sub(1, Relaxed);
            }
        }
    });
}

/// Sets this thread's last error to `text` (interior NUL bytes are replaced).
pub(crate) fn set_last_error_text(text: &str) {
    let message = CString::new(text.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|cell| {
        if let Ok(mut last) = cell.try_borrow_mut() {
            last.message = message;
            if !last.set {
                ERRORS_SET.fetch_add(1, Relaxed);
            }
            last.set = true;
        }
    });
}

/// Records `e` as this thread's last error and returns its status code.
pub(crate) fn fail(e: &Error) -> tensoralloc_status {
    set_last_error_text(&e.to_string());
    status_of(e)
}

/// Converts a result into a status, recording the error.
pub(crate) fn status(r: crate::error::Result<()>) -> tensoralloc_status {
    match r {
        Ok(()) => TENSORALLOC_OK,
        Err(e) => fail(&e),
    }
}

/// The value an exported function returns when its body panicked.
pub(crate) trait PanicValue {
    fn panic_value() -> Self;
}

impl PanicValue for *const c_char {
    fn panic_value() -> Self {
        c"".as_ptr()
    }
}
impl PanicValue for c_int {
    fn panic_value() -> Self {
        TENSORALLOC_ERR_INTERNAL
    }
}
impl PanicValue for bool {
    fn panic_value() -> Self {
        false
    }
}
impl PanicValue for () {
    fn panic_value() -> Self {}
}
impl<T> PanicValue for *mut T {
    fn panic_value() -> Self {
        std::ptr::null_mut()
    }
}

/// Records a caught panic as the last error.
pub(crate) fn record_panic(payload: Box<dyn std::any::Any + Send>) {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    set_last_error_text(&format!("internal error: {what} (the call was abandoned)"));
}

/// Wraps the body of every exported function: clears the last error, runs the body, and turns
/// a panic into the function's failure value (NULL, `TENSORALLOC_ERR_INTERNAL`, false, nothing)
/// with a last error.
macro_rules! ffi_boundary {
    ($($body:tt)*) => {{
        $crate::capi::clear_last_error();
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| { $($body)* })) {
            Ok(value) => value,
            Err(payload) => {
                $crate::capi::record_panic(payload);
                $crate::capi::PanicValue::panic_value()
            }
        }
    }};
}
pub(crate) use ffi_boundary;

/// Reads an optional C string argument. NULL gives `None`; invalid UTF-8 is an error.
///
/// # Safety
/// `s` must be NULL or point to a NUL-terminated string.
pub(crate) unsafe fn opt_str<'a>(
    s: *const c_char,
    what: &str,
) -> crate::error::Result<Option<&'a str>> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller promises a NUL-terminated string when not NULL.
    let c = unsafe { CStr::from_ptr(s) };
    c.to_str()
        .map(Some)
        .map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8")))
}

/// The calling thread's last error: a NUL-terminated message explaining why the most recent
/// failing tensoralloc call on this thread failed, or an empty string ("") if the most recent
/// call succeeded. Never NULL. The string is owned by tensoralloc and stays valid until this
/// thread's next tensoralloc call; copy it to keep it.
#[no_mangle]
pub extern "C" fn tensoralloc_last_error() -> *const c_char {
    match std::panic::catch_unwind(|| {
        LAST_ERROR
            .try_with(|cell| match cell.try_borrow() {
                Ok(last) => last.message.as_ptr(),
                Err(_) => c"".as_ptr(),
            })
            .unwrap_or(c"".as_ptr())
    }) {
        Ok(p) => p,
        Err(_) => c"".as_ptr(),
    }
}

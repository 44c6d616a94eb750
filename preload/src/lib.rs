//! `libtensoralloc_preload.so`: an `LD_PRELOAD` interposer that serves an unmodified CUDA
//! program's device and pinned-host allocations through tensoralloc's caching allocators.
//!
//! - [`hooks`]: the exported CUDA runtime and driver functions (and `cuGetProcAddress`);
//! - `real`: the real functions behind them, and the interposed `dlsym` through which a CUDA
//!   runtime finds the driver's `cuGetProcAddress`;
//! - `state`: the allocators, the deferred frees that give `cudaFree` its synchronous meaning,
//!   the pointers handed out, and the statistics.
//!
//! Nothing happens at load time: the first CUDA call builds the state (and with it loads the
//! driver), so a program that never calls CUDA runs as if the library were not there.
//! `TENSORALLOC_PRELOAD=off` passes every call through; after `fork` the child passes every
//! call through when the parent had already used the allocators (the CUDA driver cannot be
//! used in such a child anyway, and the parent's allocator state is not the child's).

#![deny(unsafe_op_in_unsafe_fn)]

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

pub mod hooks;
mod real;
mod state;

const MODE_UNKNOWN: u8 = 0;
const MODE_ON: u8 = 1;
const MODE_OFF: u8 = 2;

static MODE: AtomicU8 = AtomicU8::new(MODE_UNKNOWN);
/// Set in a child process forked after the allocators were built.
static FORKED_CHILD: AtomicBool = AtomicBool::new(false);

/// Whether the hooks serve allocations (`TENSORALLOC_PRELOAD` is not `off`, and this is not a
/// child forked from a process that used them). Allocation-free: `dlsym` asks it too.
pub fn enabled() -> bool {
    let mode = match MODE.load(Ordering::Relaxed) {
        MODE_UNKNOWN => {
            let mode = if setting_is_off() { MODE_OFF } else { MODE_ON };
            MODE.store(mode, Ordering::Relaxed);
            mode
        }
        m => m,
    };
    mode == MODE_ON && !FORKED_CHILD.load(Ordering::Relaxed)
}

fn setting_is_off() -> bool {
    // SAFETY: a NUL-terminated name; getenv returns NULL or a NUL-terminated value that we only
    // read here (no allocation, so it is safe inside dlsym and early in the process).
    let value = unsafe { libc::getenv(c"TENSORALLOC_PRELOAD".as_ptr()) };
    if value.is_null() {
        return false;
    }
    // SAFETY: see above.
    let value = unsafe { std::ffi::CStr::from_ptr(value) }.to_bytes();
    [&b"off"[..], b"0", b"false", b"no", b"disable", b"disabled"]
        .iter()
        .any(|v| value.eq_ignore_ascii_case(v))
}

extern "C" fn in_forked_child() {
    FORKED_CHILD.store(true, Ordering::Relaxed);
}

/// Makes a child forked from now on pass everything through.
fn register_fork_handler() {
    // SAFETY: registers a handler that only stores an atomic, which is async-signal-safe.
    unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
}

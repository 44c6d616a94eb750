//! `libtensoralloc_preload.so`: an `LD_PRELOAD` interposer that serves an unmodified CUDA
//! program's device and pinned-host allocations through tensoralloc's caching allocators.
//!
//! - [`hooks`]: the exported CUDA runtime and driver functions (and `cuGetProcAddress`);
//! - `real`: the real functions behind them, and the interposed `dlsym` through which a CUDA
//!   runtime finds the driver's `cuGetProcAddress`;
//! - `state`: the allocators, the deferred frees that give `cudaFree` its synchronous meaning,
//!   and the statistics;
//! - `front`: blocks freed in stream order, kept for the next allocation on their stream;
//! - `live`: the pointers handed out.
//!
//! Nothing happens at load time: the first CUDA call builds the state (and with it loads the
//! driver), so a program that never calls CUDA runs as if the library were not there.
//! `TENSORALLOC_PRELOAD=off` passes every call through; after `fork` the child passes every
//! call through when the parent had already used the allocators (the CUDA driver cannot be
//! used in such a child anyway, and the parent's allocator state is not the child's).

#![deny(unsafe_op_in_unsafe_fn)]

use std::sync::atomic::{AtomicU8, Ordering};

mod front;
pub mod hooks;
mod live;
mod real;
mod state;

const MODE_UNKNOWN: u8 = 0;
const MODE_ON: u8 = 1;
/// `TENSORALLOC_PRELOAD=off`, or a child forked after the allocators were built.
const MODE_OFF: u8 = 2;

static MODE: AtomicU8 = AtomicU8::new(MODE_UNKNOWN);

/// Whether the hooks serve allocations (`TENSORALLOC_PRELOAD` is not `off`, and this is not a
/// child forked from a process that used them). Allocation-free: `dlsym` asks it too.
pub fn enabled() -> bool {
    match MODE.load(Ordering::Relaxed) {
        MODE_ON => true,
        MODE_OFF => false,
        _ => {
            let mode = if setting_is_off() { MODE_OFF } else { MODE_ON };
            // A fork handler's OFF wins over a first look racing with it.
            let _ = MODE.compare_exchange(MODE_UNKNOWN, mode, Ordering::Relaxed, Ordering::Relaxed);
            MODE.load(Ordering::Relaxed) == MODE_ON
        }
    }
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
    switch(value) == Some(false)
}

/// A setting's value read as a switch, around spaces: `Some(false)` for `off`, `0`, `false`,
/// `no`, `disable` and `disabled`, `Some(true)` for `on`, `1`, `true`, `yes`, `enable` and
/// `enabled` (any case), `None` for anything else. Allocates nothing.
pub(crate) fn switch(value: &[u8]) -> Option<bool> {
    let value = value.trim_ascii();
    let is = |words: &[&[u8]]| words.iter().any(|w| value.eq_ignore_ascii_case(w));
    if is(&[b"off", b"0", b"false", b"no", b"disable", b"disabled"]) {
        Some(false)
    } else if is(&[b"on", b"1", b"true", b"yes", b"enable", b"enabled"]) {
        Some(true)
    } else {
        None
    }
}

extern "C" fn in_forked_child() {
    MODE.store(MODE_OFF, Ordering::Relaxed);
    state::stop_serving();
}

/// Makes a child forked from now on pass everything through.
fn register_fork_handler() {
    // SAFETY: registers a handler that only stores atomics, which is async-signal-safe.
    unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
}

#[cfg(test)]
mod tests {
    use super::switch;

    #[test]
    fn switch_words_read_in_any_case_and_anything_else_is_neither() {
        for w in ["off", "OFF", "0", "false", "No", "disable", "disabled"] {
            assert_eq!(switch(w.as_bytes()), Some(false), "{w}");
        }
        for w in ["on", "1", "TRUE", "yes", "enable", "Enabled"] {
            assert_eq!(switch(w.as_bytes()), Some(true), "{w}");
        }
        for w in ["maybe", "", "2", "offf"] {
            assert_eq!(switch(w.as_bytes()), None, "{w}");
        }
    }
}

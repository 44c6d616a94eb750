//! The C functions of the pinned-host allocator, called as C would call them, on the
//! process-wide allocator over the simulated device. Tests share that allocator, so they
//! assert on their own blocks only.

use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

use tensoralloc::capi::host::*;
use tensoralloc::capi::{
    tensoralloc_last_error, CUstream_st, TENSORALLOC_ERR_INVALID_ARGUMENT, TENSORALLOC_OK,
};

fn sim() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // Set before the runtime is first built, and never changed.
    ONCE.call_once(|| std::env::set_var("TENSORALLOC_DRIVER", "sim"));
}

fn last_error() -> String {
    // SAFETY: tensoralloc_last_error never returns NULL and the string lives until this
    // thread's next call.
    unsafe { CStr::from_ptr(tensoralloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn stream(n: usize) -> *mut CUstream_st {
    (0x4000 + n) as *mut CUstream_st
}

#[test]
fn malloc_fills_the_context_and_free_accepts_it_or_null() {
    sim();
    let mut ctx: *mut c_void = null_mut();
    let p = tensoralloc_host_malloc(4096, &mut ctx);
    assert!(!p.is_null() && !ctx.is_null(), "{}", last_error());
    tensoralloc_host_free(p, ctx);
    assert_eq!(last_error(), "");
    let q = tensoralloc_host_malloc(4096, null_mut());
    assert!(!q.is_null());
    tensoralloc_host_free(q, null_mut());
    assert_eq!(last_error(), "");
}

#[test]
fn record_event_is_true_for_our_blocks_and_false_for_others() {
    sim();
    let mut ctx: *mut c_void = null_mut();
    let p = tensoralloc_host_malloc(100, &mut ctx);
    assert!(tensoralloc_host_record_event(p, ctx, stream(1)));
    assert!(tensoralloc_host_record_event(p, null_mut(), stream(1)));
    let mut local = 0u64;
    assert!(!tensoralloc_host_record_event(
        &mut local as *mut u64 as *mut c_void,
        ctx,
        stream(1)
    ));
    assert_eq!(last_error(), "");
    tensoralloc_host_free(p, ctx);
    assert!(!tensoralloc_host_record_event(p, ctx, stream(1)));
}

#[test]
fn bad_frees_set_the_last_error_and_change_nothing() {
    sim();
    let mut ctx: *mut c_void = null_mut();
    let p = tensoralloc_host_malloc(8192, &mut ctx);
    let mut local = 0u64;
    tensoralloc_host_free(&mut local as *mut u64 as *mut c_void, null_mut());
    assert!(last_error().contains("not a block"), "{}", last_error());
    tensoralloc_host_free(null_mut(), null_mut());
    assert_eq!(last_error(), "");
    tensoralloc_host_free(p, ctx);
    tensoralloc_host_free(p, ctx);
    assert!(last_error().contains("double free"), "{}", last_error());
}

#[test]
fn stats_need_somewhere_to_go_and_count_live_blocks() {
    sim();
    assert_eq!(
        tensoralloc_host_get_stats(null_mut()),
        TENSORALLOC_ERR_INVALID_ARGUMENT
    );
    assert!(!last_error().is_empty());
    let p = tensoralloc_host_malloc(1 << 20, null_mut());
    let mut s = tensoralloc_host_stats::default();
    assert_eq!(tensoralloc_host_get_stats(&mut s), TENSORALLOC_OK);
    assert!(s.allocations_current >= 1 && s.allocated_bytes_current >= 1 << 20);
    assert!(s.reserved_bytes_peak >= s.reserved_bytes_current);
    tensoralloc_host_free(p, null_mut());
    tensoralloc_host_reset_peak_stats();
    tensoralloc_host_reset_accumulated_stats();
    assert_eq!(last_error(), "");
}

#[test]
fn zero_bytes_return_null_without_an_error() {
    sim();
    let mut ctx: *mut c_void = std::ptr::dangling_mut();
    assert!(tensoralloc_host_malloc(0, &mut ctx).is_null());
    assert!(ctx.is_null());
    assert_eq!(last_error(), "");
    assert!(tensoralloc_host_malloc(usize::MAX, &mut ctx).is_null());
    assert!(last_error().contains("largest request"), "{}", last_error());
}

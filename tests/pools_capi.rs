//! Graph private pools through the C ABI, on the device the environment selects (the
//! simulated device, or the NVIDIA backend over the fake driver), with a simulated capture
//! that a forbidden driver call would invalidate.

use std::ffi::{c_int, c_void, CStr};

use tensoralloc::capi::device::{
    tensoralloc_device_stats, tensoralloc_free, tensoralloc_get_device_stats, tensoralloc_malloc,
    tensoralloc_record_stream,
};
use tensoralloc::capi::pools::{
    tensoralloc_begin_allocate_to_pool, tensoralloc_end_allocate_to_pool, tensoralloc_release_pool,
};
use tensoralloc::capi::sim::{
    tensoralloc_sim_begin_capture, tensoralloc_sim_end_capture, tensoralloc_sim_hold_stream,
    tensoralloc_sim_release_stream,
};
use tensoralloc::capi::{tensoralloc_last_error, CUstream_st};

const MIB: usize = 1 << 20;

fn last_error() -> String {
    // SAFETY: tensoralloc_last_error never returns NULL; the string lives until the next call.
    unsafe { CStr::from_ptr(tensoralloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn stream(n: usize) -> *mut CUstream_st {
    (0x6600_0000 + n * 0x10) as *mut CUstream_st
}

fn stats() -> tensoralloc_device_stats {
    let mut s = tensoralloc_device_stats::default();
    assert_eq!(
        tensoralloc_get_device_stats(0, &mut s),
        0,
        "{}",
        last_error()
    );
    s
}

/// Accepts the stream `*ctx` points to.
extern "C" fn accept_only(ctx: *mut c_void, stream: *mut CUstream_st) -> c_int {
    // SAFETY: the test passes a pointer to a live stream handle as ctx.
    let wanted = unsafe { *(ctx as *const *mut CUstream_st) };
    (stream == wanted) as c_int
}

#[test]
fn a_captured_stream_allocates_from_its_pool_without_invalidating_the_capture() {
    let (captured, other, side) = (stream(1), stream(2), stream(3));
    let mut wanted = captured;
    let ctx = &mut wanted as *mut *mut CUstream_st as *mut c_void;
    let pool = (42u64, 1u64);

    // Before the capture: a cached block on the captured stream, one still used by `side`.
    let cached = tensoralloc_malloc(MIB, 0, captured);
    let used = tensoralloc_malloc(MIB, 0, captured);
    tensoralloc_record_stream(used, side);
    assert_eq!(tensoralloc_sim_hold_stream(side), 0, "{}", last_error());
    tensoralloc_free(cached, MIB, 0, captured);
    tensoralloc_free(used, MIB, 0, captured);
    let reserved_before = stats().reserved_bytes[0].current;

    assert_eq!(
        tensoralloc_sim_begin_capture(captured),
        0,
        "{}",
        last_error()
    );
    assert_eq!(
        tensoralloc_begin_allocate_to_pool(0, pool.0, pool.1, Some(accept_only), ctx),
        0,
        "{}",
        last_error()
    );
    let in_pool = tensoralloc_malloc(MIB, 0, captured);
    assert!(!in_pool.is_null(), "{}", last_error());
    assert_ne!(in_pool, cached, "the ordinary cache is not the pool's");
    let on_other = tensoralloc_malloc(MIB, 0, other);
    assert!(!on_other.is_null(), "{}", last_error());
    tensoralloc_free(in_pool, MIB, 0, captured);
    let again = tensoralloc_malloc(MIB, 0, captured);
    assert_eq!(
        again, in_pool,
        "a pool block freed during capture serves the pool again"
    );
    assert_eq!(
        tensoralloc_end_allocate_to_pool(0, pool.0, pool.1),
        0,
        "{}",
        last_error()
    );
    assert_eq!(
        tensoralloc_sim_end_capture(captured),
        0,
        "the capture was invalidated: {}",
        last_error()
    );
    assert_eq!(
        stats().reserved_bytes[0].current,
        reserved_before + 2 * MIB as i64 * 2,
        "one new small segment for the pool, one for the other stream"
    );

    tensoralloc_free(again, MIB, 0, captured);
    tensoralloc_free(on_other, MIB, 0, other);
    let outside = tensoralloc_malloc(MIB, 0, captured);
    assert_ne!(
        outside, in_pool,
        "the pool's block is not handed out outside it"
    );
    tensoralloc_free(outside, MIB, 0, captured);

    let before_release = stats();
    assert_eq!(
        tensoralloc_release_pool(0, pool.0, pool.1),
        0,
        "{}",
        last_error()
    );
    let after_release = stats();
    assert_eq!(
        after_release.reserved_bytes[0].current,
        before_release.reserved_bytes[0].current - 2 * MIB as i64,
        "the released pool's segment went back to the driver"
    );
    assert_ne!(tensoralloc_release_pool(0, pool.0, pool.1), 0);
    assert!(last_error().contains("no use"), "{}", last_error());
    assert_ne!(tensoralloc_end_allocate_to_pool(0, pool.0, pool.1), 0);
    assert_ne!(
        tensoralloc_begin_allocate_to_pool(0, 0, 0, None, std::ptr::null_mut()),
        0
    );
    assert!(last_error().contains("(0, 0)"), "{}", last_error());
    assert_ne!(
        tensoralloc_begin_allocate_to_pool(7, 1, 1, None, std::ptr::null_mut()),
        0
    );
    assert!(last_error().contains("device 7"), "{}", last_error());
    assert_eq!(tensoralloc_sim_release_stream(side), 0);
}

#[test]
fn ending_a_capture_that_was_not_begun_is_an_error() {
    assert_ne!(tensoralloc_sim_end_capture(stream(9)), 0);
    assert!(last_error().contains("not capturing"), "{}", last_error());
}

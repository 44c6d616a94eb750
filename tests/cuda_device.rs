//! The caching device allocator running on the NVIDIA driver backend (cudarc) against the fake
//! `libcuda.so.1`: the same allocator as on the simulated device, now through real driver
//! calls, contexts and event handles.
//!
//! Needs `cargo build -p fakecuda` first. Only the out-of-memory test makes large allocations
//! on device 1, so that its capacity arithmetic holds while the other tests run alongside.

mod cuda_support;

use std::sync::Arc;

use cuda_support::{
    cu, cuda_driver, hold_stream, on_new_thread, pointer_device, release_stream, thread_counter,
};
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::driver::Driver;
use tensoralloc::Error;

const MIB: usize = 1 << 20;

fn driver() -> Arc<CudaDriver> {
    cuda_driver()
}

/// A fresh allocator for `device` on the CUDA backend.
fn allocator(device: usize) -> DeviceAllocator {
    DeviceAllocator::new(driver(), device, &Config::default()).unwrap()
}

/// Every driver call the fake counts, on the calling thread.
fn driver_calls() -> Vec<u64> {
    [
        "mem_alloc",
        "mem_free",
        "events_created",
        "event_records",
        "event_queries",
        "event_syncs",
        "ctx_get_current",
        "ctx_push",
        "ctx_pop",
        "stream_get_ctx",
    ]
    .iter()
    .map(|n| thread_counter(n))
    .collect()
}

#[test]
fn a_cached_malloc_and_free_make_no_driver_call() {
    on_new_thread(|| {
        let a = allocator(0);
        let s = 0x100;
        let p = a.malloc(MIB, s).unwrap();
        a.free(p, Some(s)).unwrap();
        let before = driver_calls();
        for _ in 0..100 {
            let q = a.malloc(MIB, s).unwrap();
            assert_eq!(q, p, "the cached block is reused");
            a.free(q, Some(s)).unwrap();
        }
        assert_eq!(driver_calls(), before, "the hot path stays off the driver");
        a.empty_cache().unwrap();
    });
}

#[test]
fn segments_come_from_the_driver_on_the_allocators_device() {
    let a = allocator(0);
    let p = a.malloc(3 * MIB, 0).unwrap();
    let segment = p; // a fresh allocator's first block starts its segment
    assert_eq!(pointer_device(segment), 0);
    a.free(p, Some(0)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        pointer_device(segment),
        -1,
        "empty_cache returned the segment with cuMemFree"
    );
}

#[test]
fn a_block_used_on_a_held_side_stream_waits_for_its_event() {
    on_new_thread(|| {
        let a = allocator(0);
        let (s, side) = (0x200, 0x201);
        hold_stream(side);
        let p = a.malloc(MIB, s).unwrap();
        a.record_stream(p, side).unwrap();
        a.free(p, Some(s)).unwrap();
        assert_eq!(
            thread_counter("event_records"),
            1,
            "one event recorded on the side stream"
        );
        let q = a.malloc(MIB, s).unwrap();
        assert_ne!(q, p, "not reused while the side stream's work is pending");
        release_stream(side);
        let r = a.malloc(MIB, s).unwrap();
        assert_eq!(r, p, "reused once the event completed");
        for x in [q, r] {
            a.free(x, Some(s)).unwrap();
        }
        a.empty_cache().unwrap();
    });
}

#[test]
fn events_are_reused_across_record_stream_cycles() {
    on_new_thread(|| {
        let a = allocator(0);
        let (s, side) = (0x300, 0x301);
        for _ in 0..10 {
            let p = a.malloc(MIB, s).unwrap();
            a.record_stream(p, side).unwrap();
            a.free(p, Some(s)).unwrap();
            a.poll_events();
        }
        assert_eq!(thread_counter("event_records"), 10);
        assert_eq!(
            thread_counter("events_created"),
            1,
            "one event made, then reused from the pool"
        );
        assert_eq!(thread_counter("events_created_with_timing"), 0);
        a.empty_cache().unwrap();
    });
}

#[test]
fn empty_cache_waits_for_pending_events_before_freeing_segments() {
    on_new_thread(|| {
        let a = allocator(0);
        let (s, side) = (0x400, 0x401);
        hold_stream(side);
        let p = a.malloc(MIB, s).unwrap();
        a.record_stream(p, side).unwrap();
        a.free(p, Some(s)).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            thread_counter("event_syncs"),
            1,
            "waited for the side stream's event"
        );
        assert_eq!(thread_counter("mem_free"), 1, "then returned the segment");
        assert_eq!(a.stats().num_sync_all_streams, 1);
        release_stream(side);
    });
}

#[test]
fn out_of_memory_returns_the_cache_to_the_driver_and_retries() {
    on_new_thread(|| {
        let d = driver();
        let a = allocator(1);
        let total = d.mem_info(1).unwrap().total as usize;
        let big = (total / 10 * 6).next_multiple_of(2 * MIB);
        let p = a.malloc(big, 0x500).unwrap();
        a.free(p, Some(0x500)).unwrap(); // cached on stream 0x500
        let q = a.malloc(big, 0x501).unwrap(); // only fits once the cache is returned
        let stats = a.stats();
        assert_eq!(stats.num_alloc_retries, 1);
        assert_eq!(stats.num_ooms, 0);
        assert_eq!(thread_counter("mem_free"), 1);
        a.free(q, Some(0x501)).unwrap();
        let err = a.malloc(total + 2 * MIB, 0x501).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
        assert!(
            err.message().contains("device 1 has a total capacity of"),
            "{err}"
        );
        a.empty_cache().unwrap();
    });
}

#[test]
fn an_allocator_for_another_device_leaves_the_callers_context_current() {
    on_new_thread(|| {
        let mine = cu::primary_ctx_retain(0);
        cu::ctx_set_current(mine);
        let a = allocator(1);
        let (s, side) = (0x600, 0x601);
        let p = a.malloc(MIB, s).unwrap();
        assert_eq!(pointer_device(p), 1);
        a.record_stream(p, side).unwrap();
        a.free(p, Some(s)).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(cu::ctx_get_current(), mine);
    });
}

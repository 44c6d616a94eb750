//! The caching pinned-host allocator on the NVIDIA driver backend (cudarc) against the fake
//! `libcuda.so.1`: the fake counts its pinning calls, which proves the caching.
//!
//! Needs `cargo build -p fakecuda` first.

mod cuda_support;

use std::sync::Arc;

use cuda_support::{cuda_driver, hold_stream, on_new_thread, release_stream, thread_counter};
use tensoralloc::config::Config;
use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::host::HostAllocator;

fn driver() -> Arc<CudaDriver> {
    cuda_driver()
}

#[test]
fn pinned_blocks_are_pinned_once_and_then_reused() {
    on_new_thread(|| {
        let host = HostAllocator::new(driver(), &Config::default());
        for _ in 0..10 {
            let b = host.malloc(5000).unwrap();
            // SAFETY: the block is at least 5000 bytes of page-locked host memory.
            unsafe { std::ptr::write_bytes(b.ptr as *mut u8, 7, 5000) };
            host.free(b.ptr, Some(b.ctx)).unwrap();
        }
        assert_eq!(
            thread_counter("host_alloc"),
            1,
            "one cuMemHostAlloc for ten pairs"
        );
        host.empty_cache().unwrap();
        assert_eq!(
            thread_counter("host_free"),
            1,
            "empty_cache returns it with cuMemFreeHost"
        );
    });
}

#[test]
fn registration_mode_registers_ordinary_pages_once() {
    on_new_thread(|| {
        let config =
            Config::parse("pinned_use_cuda_host_register:True,pinned_num_register_threads:1")
                .unwrap();
        let host = HostAllocator::new(driver(), &config);
        for _ in 0..5 {
            let b = host.malloc(1 << 20).unwrap();
            host.free(b.ptr, None).unwrap();
        }
        assert_eq!(
            thread_counter("host_alloc"),
            0,
            "no driver allocation in registration mode"
        );
        assert_eq!(thread_counter("host_register"), 1);
        host.empty_cache().unwrap();
        assert_eq!(thread_counter("host_unregister"), 1);
    });
}

#[test]
fn a_block_used_on_a_held_stream_waits_for_the_drivers_event() {
    on_new_thread(|| {
        let host = HostAllocator::new(driver(), &Config::default());
        let stream = 0xc0de_0000usize;
        hold_stream(stream);
        let b = host.malloc(4096).unwrap();
        assert!(host.record_event(b.ptr, Some(b.ctx), stream));
        host.free(b.ptr, Some(b.ctx)).unwrap();
        let c = host.malloc(4096).unwrap();
        assert_ne!(
            c.ptr, b.ptr,
            "not reused while the driver's event is pending"
        );
        assert_eq!(thread_counter("event_records"), 1);
        release_stream(stream);
        host.free(c.ptr, Some(c.ctx)).unwrap();
        let d = host.malloc(4096).unwrap();
        let e = host.malloc(4096).unwrap();
        assert!(
            d.ptr == b.ptr || e.ptr == b.ptr,
            "reused once the event completed"
        );
        assert_eq!(thread_counter("host_alloc"), 2);
    });
}

//! Capture awareness on the NVIDIA driver backend (cudarc) against the fake `libcuda.so.1`,
//! whose captures are invalidated by the calls a real driver forbids during capture.
//!
//! Needs `cargo build -p fakecuda` first.

mod cuda_support;

use cuda_support::{cuda_driver, hold_stream, on_new_thread, release_stream, thread_counter};
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::Driver;

const MIB: usize = 1 << 20;

fn stream(n: usize) -> usize {
    0x3300_0000 + n * 0x10
}

#[test]
fn the_backend_sees_a_stream_capture() {
    on_new_thread(|| {
        let d = cuda_driver();
        let s = stream(1);
        assert!(!d.stream_capturing(s).unwrap());
        d.fake_begin_capture(s).unwrap();
        assert!(d.stream_capturing(s).unwrap());
        d.fake_end_capture(s).unwrap();
        assert!(!d.stream_capturing(s).unwrap());
    });
}

#[test]
fn the_backend_allocates_in_relaxed_mode_during_a_capture() {
    on_new_thread(|| {
        let d = cuda_driver();
        let s = stream(2);
        d.fake_begin_capture(s).unwrap();
        let p = d.mem_alloc(0, 2 * MIB).expect("allowed in relaxed mode");
        d.fake_end_capture(s).expect("the capture stayed valid");
        d.mem_free(0, p).unwrap();
    });
}

#[test]
fn an_event_query_during_a_capture_invalidates_it() {
    on_new_thread(|| {
        let d = cuda_driver();
        let s = stream(3);
        let e = d.event_create(0).unwrap();
        d.fake_begin_capture(s).unwrap();
        d.event_query(0, e).unwrap();
        let err = d.fake_end_capture(s).unwrap_err();
        assert!(err.to_string().contains("INVALIDATED"), "{err}");
        d.event_destroy(0, e).unwrap();
    });
}

#[test]
fn the_allocator_queries_no_event_on_a_capturing_stream_nobody_announced() {
    on_new_thread(|| {
        let a = DeviceAllocator::new(cuda_driver(), 0, &Config::default()).unwrap();
        let (s, side) = (stream(4), stream(5));
        hold_stream(side);
        let p = a.malloc(MIB, s).unwrap();
        a.record_stream(p, side).unwrap();
        a.free(p, Some(s)).unwrap();
        let queries = thread_counter("event_queries");
        let cuda = cuda_driver();
        cuda.fake_begin_capture(s).unwrap();
        let q = a.malloc(MIB, s).unwrap();
        assert_ne!(q, p, "still waiting for `side`");
        cuda.fake_end_capture(s).expect("the capture stayed valid");
        assert_eq!(thread_counter("event_queries"), queries);
        release_stream(side);
        let r = a.malloc(MIB, s).unwrap();
        assert!(
            thread_counter("event_queries") > queries,
            "polled after the capture"
        );
        assert_eq!(r, p);
        a.free(q, Some(s)).unwrap();
        a.free(r, Some(s)).unwrap();
    });
}

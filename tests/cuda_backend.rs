//! The NVIDIA driver backend (`CudaDriver`) driven through cudarc against the fake
//! `libcuda.so.1`: what only the real path has — contexts, driver handles, driver error text.
//!
//! Needs `cargo build -p fakecuda` first.

mod cuda_support;

use std::sync::OnceLock;

use cuda_support::{
    counter, cu, hold_stream, load_fake, pointer_device, release_stream, thread_counter,
};
use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::driver::{Driver, Event};
use tensoralloc::Error;

/// One driver shared by the tests, as the process-wide runtime shares one.
fn driver() -> &'static CudaDriver {
    static DRIVER: OnceLock<CudaDriver> = OnceLock::new();
    DRIVER.get_or_init(|| {
        load_fake();
        CudaDriver::load().expect("the backend loads the fake driver")
    })
}

/// Runs `f` on a fresh thread (which starts with no current context) and returns its result.
fn on_new_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().expect("test thread")
}

#[test]
fn loads_the_fake_driver_and_sees_its_devices() {
    let d = driver();
    assert_eq!(d.name(), "cuda");
    assert!(
        d.device_count().unwrap() >= 2,
        "TENSORALLOC_SIM_DEVICES is at least 2 for these tests"
    );
}

#[test]
fn allocation_lands_on_the_requested_device() {
    let d = driver();
    let p0 = d.mem_alloc(0, 1 << 20).unwrap();
    let p1 = d.mem_alloc(1, 1 << 20).unwrap();
    assert_eq!(pointer_device(p0), 0);
    assert_eq!(pointer_device(p1), 1);
    d.mem_free(0, p0).unwrap();
    d.mem_free(1, p1).unwrap();
}

#[test]
fn a_thread_without_context_can_allocate_and_is_left_without_one() {
    on_new_thread(|| {
        let d = driver();
        assert_eq!(cu::ctx_get_current(), 0);
        let p = d.mem_alloc(1, 4096).unwrap();
        assert_eq!(
            cu::ctx_get_current(),
            0,
            "the backend must not leave its context current"
        );
        d.mem_free(1, p).unwrap();
        assert_eq!(cu::ctx_get_current(), 0);
    });
}

#[test]
fn a_call_for_another_device_restores_the_callers_context() {
    on_new_thread(|| {
        let d = driver();
        let mine = cu::primary_ctx_retain(0);
        cu::ctx_set_current(mine);
        let p = d.mem_alloc(1, 4096).unwrap();
        let e = d.event_create(1).unwrap();
        d.event_record(1, e, 0).unwrap();
        assert_eq!(cu::ctx_get_current(), mine);
        assert_eq!(pointer_device(p), 1);
        d.event_destroy(1, e).unwrap();
        d.mem_free(1, p).unwrap();
        // Exactly one context on the stack: ours; the backend left no extra entry behind.
        assert_eq!(cu::ctx_pop_current(), cu::SUCCESS);
        assert_eq!(cu::ctx_get_current(), 0);
    });
}

#[test]
fn a_call_for_the_current_device_switches_no_context() {
    on_new_thread(|| {
        let d = driver();
        let p = d.mem_alloc(0, 4096).unwrap(); // retains device 0's primary context
        cu::ctx_set_current(d.retained_primary_context(0).unwrap());
        let pushes = thread_counter("ctx_push");
        let queries = thread_counter("ctx_get_current");
        let q = d.mem_alloc(0, 4096).unwrap();
        assert_eq!(
            thread_counter("ctx_push"),
            pushes,
            "no context push when the right one is current"
        );
        assert_eq!(
            thread_counter("ctx_get_current"),
            queries + 1,
            "one cheap query per call"
        );
        d.mem_free(0, q).unwrap();
        d.mem_free(0, p).unwrap();
    });
}

#[test]
fn threads_keep_their_own_current_contexts_while_sharing_the_driver() {
    let workers: Vec<_> = (0..2)
        .map(|me: usize| {
            std::thread::spawn(move || {
                let d = driver();
                let mine = cu::primary_ctx_retain(me as i32);
                cu::ctx_set_current(mine);
                for i in 0..200 {
                    let other = (me + i) % 2;
                    let p = d.mem_alloc(other, 512).unwrap();
                    assert_eq!(pointer_device(p), other as i32);
                    assert_eq!(cu::ctx_get_current(), mine);
                    d.mem_free(other, p).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
}

#[test]
fn events_are_created_without_timing() {
    on_new_thread(|| {
        let d = driver();
        let e = d.event_create(0).unwrap();
        assert_eq!(thread_counter("events_created"), 1);
        assert_eq!(thread_counter("events_created_with_timing"), 0);
        d.event_destroy(0, e).unwrap();
    });
}

#[test]
fn an_event_on_a_held_stream_is_pending_until_the_stream_is_released() {
    let d = driver();
    let stream = 0x7171;
    let e = d.event_create(1).unwrap();
    hold_stream(stream);
    d.event_record(1, e, stream).unwrap();
    assert!(
        !d.event_query(1, e).unwrap(),
        "CUDA_ERROR_NOT_READY reads as not done"
    );
    release_stream(stream);
    assert!(d.event_query(1, e).unwrap());
    d.event_destroy(1, e).unwrap();
}

#[test]
fn event_synchronize_waits_for_a_pending_event() {
    let d = driver();
    let stream = 0x7272;
    let e = d.event_create(0).unwrap();
    hold_stream(stream);
    d.event_record(0, e, stream).unwrap();
    d.event_synchronize(0, e).unwrap();
    assert!(d.event_query(0, e).unwrap());
    release_stream(stream);
    d.event_destroy(0, e).unwrap();
}

#[test]
fn an_unknown_event_is_a_driver_error_naming_invalid_handle() {
    let err = driver().event_query(0, Event(0x1234_5670)).unwrap_err();
    assert!(matches!(err, Error::Driver(_)), "{err}");
    assert!(err.message().contains("cuEventQuery"), "{err}");
    assert!(err.message().contains("CUDA_ERROR_INVALID_HANDLE"), "{err}");
}

#[test]
fn freeing_an_unknown_pointer_reports_the_driver_error_name_and_device() {
    let err = driver().mem_free(1, 0xdead_0000).unwrap_err();
    let m = err.message();
    assert!(matches!(err, Error::Driver(_)), "{err}");
    assert!(m.contains("device 1"), "{m}");
    assert!(m.contains("cuMemFree(0xdead0000)"), "{m}");
    assert!(
        m.contains("CUDA_ERROR_INVALID_VALUE (invalid argument)"),
        "{m}"
    );
}

#[test]
fn allocating_past_capacity_is_out_of_memory_with_the_free_memory() {
    let d = driver();
    let info = d.mem_info(0).unwrap();
    let err = d.mem_alloc(0, info.total as usize + 4096).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
    assert!(err.message().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
    assert!(err.message().contains("bytes free of"), "{err}");
}

#[test]
fn mem_info_reports_the_simulated_capacity() {
    let info = driver().mem_info(1).unwrap();
    assert!(info.total > 0);
    assert!(info.free <= info.total);
}

#[test]
fn a_device_past_the_count_is_an_invalid_argument() {
    let d = driver();
    let n = d.device_count().unwrap();
    let err = d.mem_alloc(n, 512).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.message()
            .contains(&format!("device {n} does not exist")),
        "{err}"
    );
}

#[test]
fn a_stream_belongs_to_the_device_it_was_created_on() {
    let stream = on_new_thread(|| {
        let ctx = cu::primary_ctx_retain(1);
        cu::ctx_set_current(ctx);
        cu::stream_create()
    });
    // Asked from a thread with no context, and from one with device 0 current.
    assert_eq!(
        on_new_thread(move || driver().stream_device(stream).unwrap()),
        1
    );
    on_new_thread(move || {
        cu::ctx_set_current(cu::primary_ctx_retain(0));
        assert_eq!(driver().stream_device(stream).unwrap(), 1);
        assert_eq!(cu::ctx_get_current(), cu::primary_ctx_retain(0));
    });
}

#[test]
fn the_legacy_stream_belongs_to_the_current_device_or_device_0() {
    on_new_thread(|| {
        let d = driver();
        assert_eq!(
            d.stream_device(0).unwrap(),
            0,
            "no current context: device 0"
        );
        cu::ctx_set_current(cu::primary_ctx_retain(1));
        assert_eq!(d.stream_device(0).unwrap(), 1);
    });
}

#[test]
fn the_primary_context_is_retained_once_per_device() {
    on_new_thread(|| {
        load_fake();
        let d = CudaDriver::load().unwrap();
        for _ in 0..3 {
            let p = d.mem_alloc(0, 512).unwrap();
            d.mem_free(0, p).unwrap();
        }
        assert_eq!(thread_counter("primary_ctx_retain"), 1);
        drop(d);
        assert_eq!(
            thread_counter("primary_ctx_release"),
            1,
            "dropping the driver releases it"
        );
    });
}

#[test]
fn pinned_host_memory_is_writable_and_freed_through_the_driver() {
    on_new_thread(|| {
        let d = driver();
        let p = d.host_alloc(1 << 16).unwrap();
        // SAFETY: the driver just handed out 64 KiB of host memory at p.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0xab, 1 << 16) };
        d.host_free(p).unwrap();
        assert_eq!(thread_counter("host_alloc"), 1);
        assert_eq!(thread_counter("host_free"), 1);
        assert_eq!(
            cu::ctx_get_current(),
            0,
            "host calls leave no context current"
        );
    });
}

#[test]
fn unregistering_memory_twice_names_host_memory_not_registered() {
    let d = driver();
    let mut buf = vec![0u8; 8192];
    let p = buf.as_mut_ptr() as usize;
    d.host_register(p, buf.len()).unwrap();
    d.host_unregister(p).unwrap();
    let err = d.host_unregister(p).unwrap_err();
    assert!(
        err.message()
            .contains("CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"),
        "{err}"
    );
}

#[test]
fn registering_memory_twice_names_host_memory_already_registered() {
    let d = driver();
    let mut buf = vec![0u8; 8192];
    let p = buf.as_mut_ptr() as usize;
    d.host_register(p, buf.len()).unwrap();
    let err = d.host_register(p, buf.len()).unwrap_err();
    assert!(
        err.message()
            .contains("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"),
        "{err}"
    );
    d.host_unregister(p).unwrap();
}

#[test]
fn allocations_reach_the_loaded_fake_driver() {
    let d = driver();
    let before = counter("mem_alloc");
    let p = d.mem_alloc(0, 512).unwrap();
    assert!(counter("mem_alloc") > before);
    d.mem_free(0, p).unwrap();
}

#[test]
fn the_fake_drivers_stream_holds_are_reachable_through_the_backend() {
    let d = driver();
    let stream = 0x7373;
    let e = d.event_create(0).unwrap();
    d.fake_hold_stream(stream).unwrap();
    d.event_record(0, e, stream).unwrap();
    assert!(!d.event_query(0, e).unwrap());
    d.fake_release_stream(stream).unwrap();
    assert!(d.event_query(0, e).unwrap());
    d.event_destroy(0, e).unwrap();
}

#[test]
fn the_fake_drivers_device_usage_is_reachable_through_the_backend() {
    let d = driver();
    let before = d.fake_device_used(0).unwrap();
    let p = d.mem_alloc(0, 1 << 20).unwrap();
    assert!(d.fake_device_used(0).unwrap() >= before + (1 << 20));
    d.mem_free(0, p).unwrap();
}

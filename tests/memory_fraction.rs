//! The per-device memory fraction (PyTorch's `set_per_process_memory_fraction`) and base
//! allocations (`getBaseAllocation`), through the Rust API on the simulated device and through
//! the C ABI on whatever device the environment selects.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use tensoralloc::capi::device::{tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::pools::{
    tensoralloc_get_base_allocation, tensoralloc_get_memory_fraction,
    tensoralloc_set_memory_fraction,
};
use tensoralloc::capi::tensoralloc_last_error;
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::Error;

const MIB: usize = 1 << 20;

fn alloc(capacity: usize) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = SimDriver::shared(1, capacity as u64).unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
    (sim, a)
}

fn last_error() -> String {
    // SAFETY: tensoralloc_last_error never returns NULL; the string lives until the next call.
    unsafe { CStr::from_ptr(tensoralloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn the_fraction_is_one_until_set() {
    let (_sim, a) = alloc(64 * MIB);
    assert_eq!(a.memory_fraction(), 1.0);
    a.set_memory_fraction(0.25).unwrap();
    assert_eq!(a.memory_fraction(), 0.25);
}

#[test]
fn growth_past_the_fraction_fails_as_out_of_memory_with_the_limit() {
    let (sim, a) = alloc(1024 * MIB);
    a.set_memory_fraction(0.5).unwrap();
    let p = a.malloc(400 * MIB, 0).unwrap();
    let e = a.malloc(200 * MIB, 0).unwrap_err();
    let Error::OutOfMemory(m) = &e else {
        panic!("{e:?}")
    };
    assert!(m.contains("200.00 MiB"), "requested size: {m}");
    assert!(m.contains("512.00 MiB allowed"), "the limit: {m}");
    assert!(m.contains("400.00 MiB is allocated"), "{m}");
    let s = a.stats();
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(sim.used(0), 400 * MIB as u64, "the device itself had room");
    a.free(p, None).unwrap();
}

#[test]
fn the_cache_is_freed_before_the_fraction_refuses() {
    let (sim, a) = alloc(1024 * MIB);
    a.set_memory_fraction(0.5).unwrap();
    let (s1, s2) = (0x7100, 0x7110);
    let p = a.malloc(400 * MIB, s1).unwrap();
    a.free(p, None).unwrap();
    let q = a
        .malloc(400 * MIB, s2)
        .expect("fits once s1's cached segment is returned");
    let s = a.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(sim.used(0), 400 * MIB as u64);
    a.free(q, None).unwrap();
}

#[test]
fn a_fraction_of_zero_refuses_every_new_segment_but_not_the_cache() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(MIB, 0).unwrap();
    a.free(p, None).unwrap();
    a.set_memory_fraction(0.0).unwrap();
    assert_eq!(
        a.malloc(MIB, 0).unwrap(),
        p,
        "cached memory is still handed out"
    );
    assert!(matches!(a.malloc(10 * MIB, 0), Err(Error::OutOfMemory(_))));
}

#[test]
fn fractions_outside_zero_to_one_are_rejected() {
    let (_sim, a) = alloc(64 * MIB);
    for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
        let e = a.set_memory_fraction(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e:?}");
        assert!(e.to_string().contains("[0, 1]"), "{e}");
    }
    assert_eq!(a.memory_fraction(), 1.0, "unchanged");
}

#[test]
fn the_base_allocation_is_the_segment_of_any_byte_of_a_live_allocation() {
    let (_sim, a) = alloc(256 * MIB);
    let first = a.malloc(MIB, 0).unwrap();
    let second = a.malloc(MIB, 0).unwrap();
    assert_eq!(second, first + MIB, "one small-pool segment");
    assert_eq!(a.base_allocation(first).unwrap(), (first, 2 * MIB));
    assert_eq!(a.base_allocation(second).unwrap(), (first, 2 * MIB));
    assert_eq!(a.base_allocation(second + 1000).unwrap(), (first, 2 * MIB));
    a.free(second, None).unwrap();
    assert!(matches!(
        a.base_allocation(second),
        Err(Error::UnknownPointer(_))
    ));
    assert!(matches!(
        a.base_allocation(0x10),
        Err(Error::UnknownPointer(_))
    ));
    a.free(first, None).unwrap();
}

#[test]
fn memory_fraction_through_the_c_abi() {
    // The only test of this file that uses the process-wide runtime: the fraction it sets
    // would limit any other.
    let mut f = 0.0;
    assert_eq!(tensoralloc_get_memory_fraction(0, &mut f), 0);
    assert_eq!(f, 1.0);
    tensoralloc_set_memory_fraction(1.5, 0);
    assert!(last_error().contains("[0, 1]"), "{}", last_error());
    tensoralloc_set_memory_fraction(0.5, 99);
    assert!(last_error().contains("device 99"), "{}", last_error());
    assert_ne!(tensoralloc_get_memory_fraction(0, std::ptr::null_mut()), 0);
    assert_ne!(tensoralloc_get_memory_fraction(-1, &mut f), 0);

    tensoralloc_set_memory_fraction(0.0, 0);
    assert_eq!(last_error(), "");
    assert_eq!(tensoralloc_get_memory_fraction(0, &mut f), 0);
    assert_eq!(f, 0.0);
    let p = tensoralloc_malloc(3 * MIB, 0, std::ptr::null_mut());
    assert!(p.is_null());
    let m = last_error();
    assert!(m.contains("0 B allowed"), "{m}");
    tensoralloc_set_memory_fraction(1.0, 0);
    let p = tensoralloc_malloc(3 * MIB, 0, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());

    let mut size = 0usize;
    let inside = (p as usize + 4096) as *mut c_void;
    let base = tensoralloc_get_base_allocation(inside, &mut size);
    assert_eq!(base, p, "the first block starts its segment");
    assert_eq!(size, 20 * MIB);
    assert!(tensoralloc_get_base_allocation(p, std::ptr::null_mut()).is_null());
    assert!(last_error().contains("NULL"), "{}", last_error());
    tensoralloc_free(p, 3 * MIB, 0, std::ptr::null_mut());
    let mut untouched = 7usize;
    assert!(tensoralloc_get_base_allocation(p, &mut untouched).is_null());
    assert!(last_error().contains("live allocation"), "{}", last_error());
    assert_eq!(untouched, 7);
}

#[test]
fn threads_growing_at_once_never_take_the_device_past_the_fraction() {
    threads_growing_at_once("");
}

#[test]
fn expandable_segments_never_map_past_the_fraction() {
    // Large pages are 20 MiB: a growth for 5 MiB maps a whole page, which the check counts.
    threads_growing_at_once("expandable_segments:True");
}

#[test]
fn compact_never_maps_past_the_fraction() {
    threads_growing_at_once("policy:compact");
}

/// Eight 20 MiB segments fit under the limit. Four threads on streams of their own each ask
/// for 180 MiB at a time (more than the limit, so requests fail whatever the timing) and
/// empty the cache now and then, so memory is asked for at the same moment on several
/// streams; the device must never hold more than the limit, not even for an instant, and the
/// reserved peak must say so.
fn threads_growing_at_once(conf: &str) {
    let sim = SimDriver::shared(1, (1024 * MIB) as u64).unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &Config::parse(conf).unwrap()).unwrap();
    let limit = 8 * 20 * MIB;
    a.set_memory_fraction(limit as f64 / (1024 * MIB) as f64)
        .unwrap();
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let stream = 0x5000 + t;
                for round in 0..600 {
                    // 5 MiB requests: a new segment for every fourth. Some fail once the
                    // limit is reached, as they should.
                    let held: Vec<usize> = (0..36)
                        .filter_map(|_| a.malloc(5 * MIB - 512 * (round % 7), stream).ok())
                        .collect();
                    for p in held {
                        a.free(p, Some(stream)).unwrap();
                    }
                    if round % 3 == t % 3 {
                        a.empty_cache().unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let most = sim.most_used(0);
    assert!(
        most <= limit as u64,
        "the device held {most} bytes at once, past the limit of {limit}"
    );
    assert!(
        most > 4 * 20 * MIB as u64,
        "the threads did not reach the limit together"
    );
    assert!(a.stats().num_ooms > 0, "no request met the limit");
    // Reserved bytes never passed the limit either, and their peak says so exactly.
    let peak = a.stats().reserved_bytes[0].peak;
    assert!(
        peak <= limit as i64,
        "the reserved bytes peaked at {peak}, past the limit of {limit}"
    );
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
    assert_eq!(a.stats().reserved_bytes[0].current, 0);
}

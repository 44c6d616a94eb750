//! Expandable segments and the compact policy on the NVIDIA driver backend (cudarc) against
//! the fake `libcuda.so.1`: reserved ranges, physical allocations, mappings and access rights
//! through real driver calls. Needs `cargo build -p fakecuda` first.

mod cuda_support;

use cuda_support::{cuda_driver, hold_stream, release_stream};
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::Driver;

const MIB: usize = 1 << 20;

fn allocator(conf: &str) -> DeviceAllocator {
    DeviceAllocator::new(cuda_driver(), 0, &Config::parse(conf).unwrap()).unwrap()
}

#[test]
fn the_fake_driver_reports_its_2mib_granularity() {
    assert_eq!(cuda_driver().vmm_granularity(0).unwrap(), 2 * MIB);
}

#[test]
fn expandable_memory_is_mapped_readable_and_writable() {
    let a = allocator("expandable_segments:True");
    let p = a.malloc(30 * MIB, 0).unwrap();
    let q = a.malloc(5 * MIB, 0).unwrap();
    assert_eq!(q, p + 30 * MIB, "one range, grown at its end");
    assert_eq!(a.stats().reserved_bytes[0].current, 40 << 20);
    // SAFETY: the fake maps device memory into this process; [p, p + 35 MiB) was allocated
    // above and is read-write after cuMemSetAccess.
    unsafe {
        let bytes = std::slice::from_raw_parts_mut(p as *mut u8, 35 * MIB);
        bytes[0] = 7;
        bytes[35 * MIB - 1] = 9;
        assert_eq!((bytes[0], bytes[35 * MIB - 1]), (7, 9));
    }
    a.free(p, Some(0)).unwrap();
    a.free(q, Some(0)).unwrap();
}

#[test]
fn empty_cache_unmaps_and_releases_through_the_driver() {
    let a = allocator("expandable_segments:True");
    let p = a.malloc(50 * MIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    assert_eq!(a.stats().reserved_bytes[0].current, 60 << 20);
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes[0].current, 0);
    assert!(!a.owns(p), "the empty range was freed");
}

#[test]
fn compact_moves_idle_pages_between_streams_once_their_event_completed() {
    let a = allocator("policy:compact");
    let (s1, s2) = (0x7100usize, 0x7200usize);
    let p = a.malloc(8 * MIB, s1).unwrap();
    hold_stream(s1);
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(8 * MIB, s2).unwrap();
    assert_eq!(
        a.stats().reserved_bytes[0].current,
        16 << 20,
        "s1's work is pending: its pages stay"
    );
    release_stream(s1);
    a.free(q, Some(s2)).unwrap();
    let r = a.malloc(16 * MIB, 0x7300).unwrap();
    assert_eq!(
        a.stats().reserved_bytes[0].current,
        16 << 20,
        "both moved to the third stream"
    );
    a.free(r, None).unwrap();
}

#[test]
fn compact_maps_another_streams_idle_pages_again_with_their_contents() {
    let a = allocator("policy:compact");
    let (s1, s2) = (0x7400usize, 0x7500usize);
    // Two idle 2 MiB blocks of s1 kept apart by a live one: none is large enough to lend
    // for 4 MiB, so s2 takes their pages.
    let p1 = a.malloc(2 * MIB, s1).unwrap();
    let x = a.malloc(2 * MIB, s1).unwrap();
    let p2 = a.malloc(2 * MIB, s1).unwrap();
    for p in [p1, p2] {
        // SAFETY: the fake maps device memory into this process; [p, p + 2 MiB) was
        // allocated above and is read-write.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0x5a, 2 * MIB) };
        a.free(p, Some(s1)).unwrap();
    }
    let q = a.malloc(4 * MIB, s2).unwrap();
    assert!(
        q + 4 * MIB <= p1 || q >= p2 + 2 * MIB,
        "another stream's range"
    );
    assert_eq!(a.stats().reserved_bytes[0].current, 6 << 20);
    // SAFETY: [q, q + 4 MiB) was allocated above and is read-write.
    let bytes = unsafe { std::slice::from_raw_parts(q as *const u8, 4 * MIB) };
    assert!(
        bytes.iter().all(|&b| b == 0x5a),
        "the same physical pages, mapped again rather than released and created anew"
    );
    a.free(q, Some(s2)).unwrap();
    a.free(x, Some(s1)).unwrap();
}

#[test]
fn a_growth_the_device_cannot_hold_fails_cleanly_through_the_driver() {
    // Compact maps one physical allocation per 2 MiB page, so the growth fails part way.
    let driver = cuda_driver();
    let a =
        DeviceAllocator::new(driver.clone(), 0, &Config::parse("policy:compact").unwrap()).unwrap();
    let total = driver.mem_info(0).unwrap().total as usize;
    let p = a.malloc(total / 2, 0).unwrap();
    let held = a.stats().reserved_bytes[0].current;
    // Physical allocations run out part of the way through this growth: the request fails
    // as out of memory and what it mapped is unmapped.
    let e = a.malloc(total / 2 + 64 * MIB, 0).unwrap_err();
    assert!(matches!(e, tensoralloc::Error::OutOfMemory(_)), "{e}");
    assert_eq!(a.stats().reserved_bytes[0].current, held);
    // Had the failed growth kept its physical allocations, the device could not hold the
    // same request once `p` is gone. (Other tests share the fake device, so its free bytes
    // are not compared directly.)
    a.free(p, Some(0)).unwrap();
    let q = a.malloc(total / 2 + 64 * MIB, 0).unwrap();
    a.free(q, Some(0)).unwrap();
}

//! The caching device allocator's rules, one behaviour per test, on the simulated device.

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::stats::DeviceStats;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::{self, SimConfig, SimDriver};
use tensoralloc::driver::Driver;
use tensoralloc::Error;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const AGG: usize = 0;
const SMALL: usize = 1;
const LARGE: usize = 2;

fn sim_with(devices: usize, capacity: usize) -> Arc<SimDriver> {
    SimDriver::shared(devices, capacity as u64).unwrap()
}

fn alloc_with(capacity: usize, config: &Config) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = sim_with(1, capacity);
    let a = DeviceAllocator::new(sim.clone(), 0, config).unwrap();
    (sim, a)
}

fn alloc(capacity: usize) -> (Arc<SimDriver>, DeviceAllocator) {
    alloc_with(capacity, &Config::default())
}

/// A stream handle no other test uses (the simulated streams are process-wide).
fn unique_stream() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0x5000);
    NEXT.fetch_add(0x10, Ordering::Relaxed)
}

fn stats(a: &DeviceAllocator) -> DeviceStats {
    a.stats()
}

#[test]
fn requests_are_rounded_up_to_512_bytes() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(1, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.allocated_bytes[AGG].current, 512);
    assert_eq!(s.requested_bytes[AGG].current, 1);
    let q = a.malloc(513, 0).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].current, 512 + 1024);
    a.free(p, Some(0)).unwrap();
    a.free(q, Some(0)).unwrap();
}

#[test]
fn size_zero_returns_null_without_error() {
    let (sim, a) = alloc(64 * MIB);
    assert_eq!(a.malloc(0, 0).unwrap(), 0);
    assert_eq!(sim.used(0), 0);
    assert_eq!(stats(&a).allocation[AGG].allocated, 0);
}

#[test]
fn small_requests_come_from_2mib_small_pool_segments() {
    let (sim, a) = alloc(64 * MIB);
    let p = a.malloc(MIB, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.reserved_bytes[SMALL].current, 2 * MIB as i64);
    assert_eq!(s.reserved_bytes[LARGE].current, 0);
    assert_eq!(s.segment[SMALL].current, 1);
    assert_eq!(sim.used(0), 2 * MIB as u64);
    a.free(p, Some(0)).unwrap();
}

#[test]
fn large_requests_under_10mib_get_20mib_segments() {
    let (_sim, a) = alloc(256 * MIB);
    let p = a.malloc(MIB + 1, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.reserved_bytes[LARGE].current, 20 * MIB as i64);
    assert_eq!(s.allocated_bytes[LARGE].current, (MIB + 512) as i64);
    a.free(p, Some(0)).unwrap();
}

#[test]
fn requests_from_10mib_get_their_own_segment_rounded_to_2mib() {
    let (_sim, a) = alloc(256 * MIB);
    let p = a.malloc(11 * MIB + 1, 0).unwrap();
    assert_eq!(stats(&a).reserved_bytes[LARGE].current, 12 * MIB as i64);
    a.free(p, Some(0)).unwrap();
}

#[test]
fn blocks_of_a_segment_are_split_and_adjacent() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(4 * KIB, 0).unwrap();
    let q = a.malloc(4 * KIB, 0).unwrap();
    assert_eq!(
        q,
        p + 4 * KIB,
        "the second block comes from the rest of the first segment"
    );
    let s = stats(&a);
    assert_eq!(s.segment[AGG].current, 1);
    assert_eq!(s.inactive_split[AGG].current, 1);
    assert_eq!(
        s.inactive_split_bytes[AGG].current,
        (2 * MIB - 8 * KIB) as i64
    );
    a.free(p, Some(0)).unwrap();
    a.free(q, Some(0)).unwrap();
}

#[test]
fn freed_neighbours_merge_back_into_one_block() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(4 * KIB, 0).unwrap();
    let q = a.malloc(4 * KIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    assert_eq!(
        stats(&a).inactive_split[AGG].current,
        2,
        "two free pieces around q"
    );
    a.free(q, Some(0)).unwrap();
    let s = stats(&a);
    assert_eq!(
        s.inactive_split[AGG].current, 0,
        "the whole segment is one free block again"
    );
    assert_eq!(s.inactive_split_bytes[AGG].current, 0);
    // The merged block serves a request as large as the segment.
    let r = a.malloc(MIB, 0).unwrap();
    assert_eq!(r, p);
    assert_eq!(stats(&a).segment[AGG].current, 1);
    a.free(r, Some(0)).unwrap();
}

/// PyTorch counts a split block that shrinks as the same inactive block, and a free by its
/// net effect, so `inactive_split.*.allocated`/`freed` count blocks that appeared and went.
#[test]
fn inactive_split_counters_count_net_changes_as_pytorch_does() {
    let (_sim, a) = alloc(64 * MIB);
    // The first request splits the segment: one inactive split block appears.
    let p = a.malloc(4 * KIB, 0).unwrap();
    // The second shrinks that block; it stays one block, 4 KiB smaller.
    let q = a.malloc(4 * KIB, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.inactive_split[AGG].allocated, 1);
    assert_eq!(s.inactive_split[AGG].freed, 0);
    assert_eq!(
        s.inactive_split_bytes[AGG].allocated,
        (2 * MIB - 4 * KIB) as i64
    );
    assert_eq!(s.inactive_split_bytes[AGG].freed, 4 * KIB as i64);
    // Freeing q merges it into the free rest: still one inactive block, 4 KiB larger.
    a.free(q, Some(0)).unwrap();
    let s = stats(&a);
    assert_eq!(s.inactive_split[AGG].allocated, 1);
    assert_eq!(s.inactive_split[AGG].freed, 0);
    assert_eq!(s.inactive_split_bytes[AGG].allocated, (2 * MIB) as i64);
    // Freeing p merges everything into one unsplit block: the inactive block goes.
    a.free(p, Some(0)).unwrap();
    let s = stats(&a);
    assert_eq!(s.inactive_split[AGG].freed, 1);
    assert_eq!(s.inactive_split_bytes[AGG].freed, (2 * MIB) as i64);
    assert_eq!(s.inactive_split_bytes[AGG].current, 0);
}

#[test]
fn large_pool_keeps_a_remainder_only_when_over_1mib() {
    let (_sim, a) = alloc(256 * MIB);
    // 19 MiB from a 20 MiB segment leaves exactly 1 MiB: not split.
    let p = a.malloc(19 * MIB, 0).unwrap();
    let s = stats(&a);
    assert_eq!(
        s.allocated_bytes[LARGE].current,
        20 * MIB as i64,
        "unsplit: the client holds the whole block"
    );
    assert_eq!(s.inactive_split[LARGE].current, 0);
    a.free(p, Some(0)).unwrap();
    // 18 MiB leaves 2 MiB: split.
    let q = a.malloc(18 * MIB, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.allocated_bytes[LARGE].current, 18 * MIB as i64);
    assert_eq!(s.inactive_split_bytes[LARGE].current, 2 * MIB as i64);
    a.free(q, Some(0)).unwrap();
}

#[test]
fn best_fit_picks_the_smallest_free_block_that_fits() {
    let (_sim, a) = alloc(64 * MIB);
    let s = 0;
    let p8 = a.malloc(8 * KIB, s).unwrap();
    let sep1 = a.malloc(512, s).unwrap();
    let p2 = a.malloc(2 * KIB, s).unwrap();
    let sep2 = a.malloc(512, s).unwrap();
    let p4 = a.malloc(4 * KIB, s).unwrap();
    let sep3 = a.malloc(512, s).unwrap();
    for p in [p8, p2, p4] {
        a.free(p, Some(s)).unwrap();
    }
    assert_eq!(
        a.malloc(3 * KIB, s).unwrap(),
        p4,
        "4 KiB is the best fit for 3 KiB"
    );
    assert_eq!(a.malloc(2 * KIB, s).unwrap(), p2);
    assert_eq!(a.malloc(5 * KIB, s).unwrap(), p8);
    let _ = (sep1, sep2, sep3);
}

#[test]
fn a_block_is_reused_only_on_its_own_stream() {
    let (_sim, a) = alloc(64 * MIB);
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(4 * KIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(4 * KIB, s2).unwrap();
    assert_ne!(q, p);
    assert_eq!(
        stats(&a).segment[AGG].current,
        2,
        "stream 2 got a segment of its own"
    );
    assert_eq!(
        a.malloc(4 * KIB, s1).unwrap(),
        p,
        "stream 1 gets its cached block back"
    );
}

#[test]
fn record_stream_defers_reuse_until_the_other_stream_completes() {
    let (sim, a) = alloc(64 * MIB);
    let (s1, side) = (unique_stream(), unique_stream());
    sim::hold_stream(side);
    let p = a.malloc(4 * KIB, s1).unwrap();
    a.record_stream(p, side).unwrap();
    a.free(p, Some(s1)).unwrap();
    let s = stats(&a);
    assert_eq!(s.allocated_bytes[AGG].current, 0, "freed by the client");
    assert_eq!(s.active[AGG].current, 1, "still in use by the side stream");
    // As in PyTorch, the bytes asked for count until the block is no longer active.
    assert_eq!(s.requested_bytes[AGG].current, 4 * KIB as i64);
    let q = a.malloc(4 * KIB, s1).unwrap();
    assert_ne!(q, p, "not reused while the side stream's work is pending");
    sim::release_stream(side);
    a.free(q, Some(s1)).unwrap();
    let r = a.malloc(4 * KIB, s1).unwrap();
    assert_eq!(r, p, "reused once the side stream's event completed");
    assert_eq!(
        stats(&a).requested_bytes[AGG].current,
        4 * KIB as i64,
        "r's alone"
    );
    assert_eq!(
        sim.counters
            .events_created
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    a.free(r, Some(s1)).unwrap();
}

#[test]
fn deferred_frees_reuse_pooled_events() {
    let (sim, a) = alloc(64 * MIB);
    let (s1, side) = (unique_stream(), unique_stream());
    for _ in 0..10 {
        let p = a.malloc(4 * KIB, s1).unwrap();
        a.record_stream(p, side).unwrap();
        a.free(p, Some(s1)).unwrap();
        a.poll_events();
    }
    assert_eq!(
        sim.counters
            .events_created
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(
        sim.counters
            .event_records
            .load(std::sync::atomic::Ordering::Relaxed),
        10
    );
}

#[test]
fn record_stream_on_the_allocation_stream_records_no_event() {
    let (sim, a) = alloc(64 * MIB);
    let s1 = unique_stream();
    let p = a.malloc(4 * KIB, s1).unwrap();
    a.record_stream(p, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    assert_eq!(
        sim.counters
            .event_records
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(stats(&a).active[AGG].current, 0);
}

#[test]
fn record_stream_of_an_unknown_pointer_is_an_error() {
    let (_sim, a) = alloc(64 * MIB);
    assert!(matches!(
        a.record_stream(0x1234, 1),
        Err(Error::UnknownPointer(_))
    ));
    let p = a.malloc(4 * KIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    assert!(
        matches!(a.record_stream(p, 1), Err(Error::UnknownPointer(_))),
        "freed"
    );
}

#[test]
fn out_of_memory_returns_an_error_that_explains_it() {
    let (_sim, a) = alloc(64 * MIB);
    let keep = a.malloc(30 * MIB, 0).unwrap();
    let e = a.malloc(40 * MIB, 0).unwrap_err();
    let Error::OutOfMemory(m) = &e else {
        panic!("{e:?}")
    };
    assert!(m.contains("40.00 MiB"), "requested size: {m}");
    assert!(m.contains("device 0"), "{m}");
    assert!(m.contains("64.00 MiB"), "capacity: {m}");
    assert!(m.contains("34.00 MiB is free"), "free memory: {m}");
    assert!(m.contains("30.00 MiB is allocated"), "allocated: {m}");
    assert!(m.contains("reserved by tensoralloc but unallocated"), "{m}");
    let s = stats(&a);
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 1);
    a.free(keep, Some(0)).unwrap();
}

#[test]
fn out_of_memory_frees_the_cache_and_retries_once() {
    let (sim, a) = alloc(64 * MIB);
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(40 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    assert_eq!(sim.used(0), 40 * MIB as u64, "cached, not returned");
    let q = a.malloc(40 * MIB, s2).unwrap();
    let s = stats(&a);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(
        s.num_device_free, 1,
        "stream 1's cached segment went back to the driver"
    );
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(sim.used(0), 40 * MIB as u64);
    a.free(q, Some(s2)).unwrap();
}

#[test]
fn out_of_memory_retry_waits_for_pending_events_first() {
    let (sim, a) = alloc(64 * MIB);
    let (s1, side) = (unique_stream(), unique_stream());
    sim::hold_stream(side);
    let p = a.malloc(40 * MIB, s1).unwrap();
    a.record_stream(p, side).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(40 * MIB, unique_stream()).unwrap();
    assert!(
        sim.counters
            .event_syncs
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    assert_eq!(stats(&a).num_ooms, 0);
    sim::release_stream(side);
    a.free(q, None).unwrap();
}

#[test]
fn the_allocator_recovers_after_out_of_memory() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(60 * MIB, 0).unwrap();
    assert!(a.malloc(10 * MIB, 0).is_err());
    a.free(p, Some(0)).unwrap();
    let q = a.malloc(10 * MIB, 0).unwrap();
    assert_ne!(q, 0);
    a.free(q, Some(0)).unwrap();
}

#[test]
fn empty_cache_returns_every_unused_segment() {
    let (sim, a) = alloc(256 * MIB);
    let keep = a.malloc(4 * KIB, 0).unwrap();
    let ps: Vec<_> = [MIB, 5 * MIB, 30 * MIB]
        .iter()
        .map(|&n| a.malloc(n, unique_stream()).unwrap())
        .collect();
    for p in ps {
        a.free(p, None).unwrap();
    }
    a.empty_cache().unwrap();
    let s = stats(&a);
    assert_eq!(
        s.segment[AGG].current, 1,
        "only the segment holding `keep` is left"
    );
    assert_eq!(s.reserved_bytes[AGG].current, 2 * MIB as i64);
    assert_eq!(sim.used(0), 2 * MIB as u64);
    a.free(keep, Some(0)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
    assert_eq!(stats(&a).reserved_bytes[AGG].current, 0);
}

#[test]
fn statistics_count_allocations_and_bytes_per_pool() {
    let (_sim, a) = alloc(256 * MIB);
    let small = a.malloc(1000, 0).unwrap();
    let large = a.malloc(3 * MIB, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.allocation[AGG].current, 2);
    assert_eq!(s.allocation[SMALL].current, 1);
    assert_eq!(s.allocation[LARGE].current, 1);
    assert_eq!(s.allocated_bytes[SMALL].current, 1024);
    assert_eq!(s.allocated_bytes[LARGE].current, 3 * MIB as i64);
    assert_eq!(s.requested_bytes[SMALL].current, 1000);
    assert_eq!(s.active[AGG].current, 2);
    assert_eq!(s.active_bytes[AGG].current, 1024 + 3 * MIB as i64);
    assert_eq!(s.segment[AGG].current, 2);
    assert_eq!(s.reserved_bytes[AGG].current, 22 * MIB as i64);
    assert_eq!(s.num_device_alloc, 2);
    a.free(small, Some(0)).unwrap();
    a.free(large, Some(0)).unwrap();
    let s = stats(&a);
    assert_eq!(s.allocation[AGG].current, 0);
    assert_eq!(s.allocation[AGG].allocated, 2);
    assert_eq!(s.allocation[AGG].freed, 2);
    assert_eq!(s.allocated_bytes[AGG].peak, 1024 + 3 * MIB as i64);
    assert_eq!(s.requested_bytes[AGG].freed, 1000 + 3 * MIB as i64);
    assert_eq!(s.active[AGG].current, 0);
    assert_eq!(s.max_split_size, -1);
}

#[test]
fn peak_is_the_highest_total_across_streams() {
    let (_sim, a) = alloc(256 * MIB);
    let (s1, s2) = (unique_stream(), unique_stream());
    // Stream 1 peaks at 2 MiB alone; later 1 MiB on stream 1 with 1.5 MiB on stream 2 is a new
    // device peak (2.5 MiB) although neither stream reaches a new peak of its own.
    let p = a.malloc(2 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(MIB + MIB / 2, s2).unwrap();
    a.free(q, Some(s2)).unwrap();
    let q = a.malloc(MIB + MIB / 2, s2).unwrap();
    let p = a.malloc(MIB, s1).unwrap();
    assert_eq!(
        stats(&a).allocated_bytes[AGG].peak,
        (2 * MIB + MIB / 2) as i64
    );
    a.free(p, Some(s1)).unwrap();
    a.free(q, Some(s2)).unwrap();
    // Sequential use of two streams is not a simultaneous peak.
    a.reset_peak_stats();
    let p = a.malloc(3 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(2 * MIB, s2).unwrap();
    a.free(q, Some(s2)).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, 3 * MIB as i64);
}

#[test]
fn peaks_stay_exact_when_emptied_streams_give_up_their_headroom() {
    let (_sim, a) = alloc(256 * MIB);
    let (s1, s2, s3) = (unique_stream(), unique_stream(), unique_stream());
    let p = a.malloc(8 * MIB, s1).unwrap();
    let q = a.malloc(2 * MIB, s2).unwrap();
    a.free(p, Some(s1)).unwrap();
    // Stream 1 holds nothing once its segment is returned; stream 2 still holds 2 MiB.
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, (10 * MIB) as i64);
    // A new stream uses the headroom stream 1 gave up: no new peak below 10 MiB.
    let r = a.malloc(7 * MIB, s3).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, (10 * MIB) as i64);
    // Stream 1 comes back: 2 + 7 + 4 MiB is a new peak.
    let p = a.malloc(4 * MIB, s1).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, (13 * MIB) as i64);
    for (ptr, s) in [(p, s1), (q, s2), (r, s3)] {
        a.free(ptr, Some(s)).unwrap();
    }
    a.empty_cache().unwrap();
    let p = a.malloc(12 * MIB, s2).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, (13 * MIB) as i64);
    let q = a.malloc(2 * MIB, s3).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, (14 * MIB) as i64);
    a.free(p, Some(s2)).unwrap();
    a.free(q, Some(s3)).unwrap();
    a.reset_peak_stats();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, 0);
    let p = a.malloc(MIB, s1).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, MIB as i64);
    a.free(p, Some(s1)).unwrap();
}

#[test]
fn reset_peak_stats_sets_peaks_to_current_values() {
    let (_sim, a) = alloc(256 * MIB);
    let p = a.malloc(8 * MIB, 0).unwrap();
    let q = a.malloc(MIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    assert_eq!(stats(&a).allocated_bytes[AGG].peak, 9 * MIB as i64);
    a.reset_peak_stats();
    let s = stats(&a);
    assert_eq!(s.allocated_bytes[AGG].peak, MIB as i64);
    assert_eq!(s.allocation[AGG].peak, 1);
    assert_eq!(
        s.allocation[AGG].allocated, 2,
        "accumulated totals are kept"
    );
    a.free(q, Some(0)).unwrap();
}

#[test]
fn reset_accumulated_stats_zeroes_totals_and_counters() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(MIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    let _ = a.free(p, Some(0));
    let _ = a.malloc(100 * MIB, 0);
    a.reset_accumulated_stats();
    let s = stats(&a);
    assert_eq!(s.allocation[AGG].allocated, 0);
    assert_eq!(s.allocation[AGG].freed, 0);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(s.num_device_alloc, 0);
    assert_eq!(s.num_device_free, 0);
    assert_eq!(s.num_sync_all_streams, 0);
    assert_eq!(s.num_invalid_frees, 0);
    assert_eq!(s.segment[AGG].peak, 1, "peaks are kept");
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let config = Config::parse("max_split_size_mb:32").unwrap();
    let (_sim, a) = alloc_with(512 * MIB, &config);
    let p = a.malloc(40 * MIB, 0).unwrap();
    let s = stats(&a);
    assert_eq!(s.max_split_size, 32 * MIB as i64);
    assert_eq!(s.oversize_allocations.current, 1);
    assert_eq!(s.oversize_segments.current, 1);
    a.free(p, Some(0)).unwrap();
    // A small request never takes the oversize block.
    let q = a.malloc(4 * MIB, 0).unwrap();
    assert!(q < p || q >= p + 40 * MIB);
    // An oversize request takes it only if the waste stays under 20 MiB.
    let r = a.malloc(36 * MIB, 0).unwrap();
    assert_eq!(r, p, "reused whole, not split");
    assert_eq!(
        stats(&a).allocated_bytes[LARGE].current,
        (4 + 40) * MIB as i64
    );
    a.free(r, Some(0)).unwrap();
    let t = a.malloc(33 * MIB, 0).unwrap();
    assert_eq!(t, p);
    a.free(t, Some(0)).unwrap();
    a.free(q, Some(0)).unwrap();
}

#[test]
fn absurd_sizes_are_rejected_with_a_reason() {
    let (sim, a) = alloc(64 * MIB);
    let e = a.malloc(usize::MAX - 7, 0).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("negative")),
        "{e}"
    );
    let e = a.malloc(1 << 51, 0).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("larger than any device")),
        "{e}"
    );
    assert_eq!(sim.used(0), 0);
    assert_eq!(stats(&a).num_ooms, 0);
}

#[test]
fn freeing_an_unknown_pointer_changes_nothing_and_is_counted() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(4 * KIB, 0).unwrap();
    let before = stats(&a);
    let e = a.free(0xdead_0000, Some(0)).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer(_)));
    let e = a.free(p + 512, Some(0)).unwrap_err();
    assert!(
        matches!(e, Error::UnknownPointer(_)),
        "a pointer inside a block is not a block"
    );
    let mut after = stats(&a);
    assert_eq!(after.num_invalid_frees, 2);
    after.num_invalid_frees = 0;
    assert_eq!(after, before);
    assert!(a.is_allocated(p));
    a.free(p, Some(0)).unwrap();
}

#[test]
fn a_double_free_is_reported_and_does_not_corrupt() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(4 * KIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    let q = a.malloc(4 * KIB, 0).unwrap();
    assert_eq!(q, p);
    // q is live; a stale second free of p would free q: it is p's second free only if p was
    // not reallocated, so free a different stale pointer instead.
    let r = a.malloc(8 * KIB, 0).unwrap();
    a.free(r, Some(0)).unwrap();
    assert!(matches!(a.free(r, Some(0)), Err(Error::UnknownPointer(_))));
    assert_eq!(stats(&a).num_invalid_frees, 1);
    assert_eq!(stats(&a).allocation[AGG].current, 1);
    a.free(q, Some(0)).unwrap();
}

#[test]
fn free_finds_the_block_when_the_stream_hint_is_wrong_or_missing() {
    let (_sim, a) = alloc(64 * MIB);
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(4 * KIB, s1).unwrap();
    let _q = a.malloc(4 * KIB, s2).unwrap();
    a.free(p, Some(s2)).unwrap();
    let r = a.malloc(4 * KIB, s1).unwrap();
    assert_eq!(r, p);
    a.free(r, None).unwrap();
    assert_eq!(stats(&a).allocation[AGG].current, 1);
}

#[test]
fn devices_have_separate_memory_and_statistics() {
    let sim = sim_with(2, 64 * MIB);
    let d0 = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
    let d1 = DeviceAllocator::new(sim.clone(), 1, &Config::default()).unwrap();
    let p = d0.malloc(3 * MIB, 0).unwrap();
    let q = d1.malloc(5 * MIB, 0).unwrap();
    assert_eq!(d0.stats().allocated_bytes[AGG].current, 3 * MIB as i64);
    assert_eq!(d1.stats().allocated_bytes[AGG].current, 5 * MIB as i64);
    assert!(d0.owns(p) && !d0.owns(q));
    assert!(d1.owns(q) && !d1.owns(p));
    assert_eq!(sim.used(0), 20 * MIB as u64);
    assert_eq!(sim.used(1), 20 * MIB as u64);
    assert!(matches!(d0.free(q, None), Err(Error::UnknownPointer(_))));
    d0.free(p, None).unwrap();
    d1.free(q, None).unwrap();
}

#[test]
fn a_device_index_past_the_driver_is_rejected() {
    let sim = sim_with(2, 64 * MIB);
    let e = DeviceAllocator::new(sim, 2, &Config::default())
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("device 2")),
        "{e}"
    );
}

#[test]
fn allocations_are_writable_device_memory() {
    let (_sim, a) = alloc(64 * MIB);
    let p = a.malloc(MIB, 0).unwrap();
    // SAFETY: the simulated device backs allocations with host memory; p spans 1 MiB.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, MIB) };
    bytes.fill(0xab);
    assert!(bytes.iter().all(|&b| b == 0xab));
    a.free(p, Some(0)).unwrap();
}

#[test]
fn dropping_the_allocator_returns_all_memory_to_the_driver() {
    let sim = sim_with(1, 64 * MIB);
    {
        let a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
        let _live = a.malloc(3 * MIB, 0).unwrap();
        let p = a.malloc(MIB, 1).unwrap();
        a.free(p, Some(1)).unwrap();
        assert!(sim.used(0) > 0);
    }
    assert_eq!(sim.used(0), 0);
}

#[test]
fn many_threads_on_many_streams_never_overlap_and_leave_nothing() {
    let (sim, a) = alloc(1 << 30);
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut rng = 0x9e3779b9u64 ^ t;
                let mut live: Vec<(usize, usize, u8, usize)> = Vec::new();
                for i in 0..4000 {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let stream = 0x100 * (1 + (rng % 4) as usize);
                    if live.len() < 64 && !rng.is_multiple_of(3) {
                        let size = [512, 4096, 100_000, MIB + 7, 3 * MIB][(rng >> 8) as usize % 5];
                        let p = a.malloc(size, stream).unwrap();
                        let tag = (i % 251) as u8;
                        // SAFETY: p is a fresh allocation of `size` bytes of host-backed memory.
                        unsafe { std::ptr::write_bytes(p as *mut u8, tag, size) };
                        live.push((p, size, tag, stream));
                    } else if !live.is_empty() {
                        let (p, size, tag, stream) =
                            live.swap_remove((rng >> 16) as usize % live.len());
                        // SAFETY: p is still allocated to this thread with `size` bytes.
                        let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, size) };
                        assert!(
                            bytes.iter().all(|&b| b == tag),
                            "another allocation overwrote this one"
                        );
                        a.free(p, Some(stream)).unwrap();
                    }
                }
                for (p, _, _, stream) in live {
                    a.free(p, Some(stream)).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = a.stats();
    assert_eq!(s.allocation[AGG].current, 0);
    assert_eq!(s.allocated_bytes[AGG].current, 0);
    assert_eq!(s.active_bytes[AGG].current, 0);
    assert_eq!(
        s.inactive_split[AGG].current, 0,
        "every freed segment merged whole"
    );
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
    assert_eq!(a.stats().reserved_bytes[AGG].current, 0);
}

/// Threads whose streams take turns (and whose overdrafts meet a busy settle lock) still end
/// with exact device-wide peaks: once every thread holds a large block at the same time, the
/// peak is exactly their sum, far above anything the churn before could reach.
#[test]
fn peaks_are_exact_after_threads_churn_on_alternating_streams() {
    churn_then_hold_together(false);
}

/// The same while another thread keeps emptying the cache, so that streams that hold nothing
/// give up their headroom in the middle of other streams' settles.
#[test]
fn peaks_are_exact_when_the_cache_is_emptied_while_threads_churn() {
    churn_then_hold_together(true);
}

fn churn_then_hold_together(empty_cache_meanwhile: bool) {
    const THREADS: usize = 4;
    const HOLD: usize = 8 * MIB;
    let (_sim, a) = alloc(1 << 30);
    let a = Arc::new(a);
    let barrier = Arc::new(std::sync::Barrier::new(THREADS + 1));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let emptier = empty_cache_meanwhile.then(|| {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.empty_cache().unwrap();
                std::thread::yield_now();
            }
        })
    });
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                let streams = [0x7000 + 0x100 * t, 0x7080 + 0x100 * t];
                let mut live = Vec::new();
                for turn in 0..500 {
                    let stream = streams[turn % 2];
                    for i in 0..8 {
                        live.push(a.malloc(512 << (i % 4), stream).unwrap());
                    }
                    for p in live.drain(..) {
                        a.free(p, Some(stream)).unwrap();
                    }
                }
                let held = a.malloc(HOLD, streams[t % 2]).unwrap();
                barrier.wait();
                barrier.wait();
                a.free(held, Some(streams[t % 2])).unwrap();
            })
        })
        .collect();
    barrier.wait();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(t) = emptier {
        t.join().unwrap();
    }
    let s = a.stats();
    assert_eq!(s.allocated_bytes[AGG].peak, (THREADS * HOLD) as i64);
    assert_eq!(s.requested_bytes[AGG].peak, (THREADS * HOLD) as i64);
    assert_eq!(s.active_bytes[LARGE].peak, (THREADS * HOLD) as i64);
    barrier.wait();
    for t in threads {
        t.join().unwrap();
    }
    let s = a.stats();
    assert_eq!(s.allocated_bytes[AGG].current, 0);
    assert_eq!(s.allocated_bytes[AGG].peak, (THREADS * HOLD) as i64);
}

#[test]
fn the_simulated_driver_reports_out_of_memory_past_capacity() {
    let sim = SimDriver::new(SimConfig {
        devices: 1,
        capacity: 8 * MIB as u64,
        backed: false,
    })
    .unwrap();
    let p = sim.mem_alloc(0, 6 * MIB).unwrap();
    assert!(matches!(
        sim.mem_alloc(0, 4 * MIB),
        Err(Error::OutOfMemory(_))
    ));
    sim.mem_free(0, p).unwrap();
    assert!(sim.mem_alloc(0, 8 * MIB).is_ok());
}

#[test]
fn roundup_power2_divisions_round_requests_to_shared_sizes() {
    let config = Config::parse("roundup_power2_divisions:4").unwrap();
    let (_sim, a) = alloc_with(64 * MIB, &config);
    let p = a.malloc(1_300_000, 0).unwrap();
    let s = stats(&a);
    assert_eq!(
        s.allocated_bytes[AGG].current,
        5 << 18,
        "1.25 MiB: the next quarter step"
    );
    assert_eq!(s.requested_bytes[AGG].current, 1_300_000);
    a.free(p, Some(0)).unwrap();
    // A slightly different size lands on the same block.
    assert_eq!(a.malloc(1_250_000, 0).unwrap(), p);
}

#[test]
fn garbage_collection_returns_cached_segments_before_growing_past_the_threshold() {
    let config = Config::parse("garbage_collection_threshold:0.5").unwrap();
    let (sim, a) = alloc_with(256 * MIB, &config);
    a.set_memory_fraction(0.5).unwrap(); // 128 MiB allowed: collection past 64 MiB
    let p = a.malloc(70 * MIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    // 70 MiB reserved is past the threshold: before asking the driver for more, the cached
    // segment goes back (no out-of-memory retry needed).
    let q = a.malloc(74 * MIB, 0).unwrap();
    let st = stats(&a);
    assert_eq!(st.num_device_free, 1);
    assert_eq!(st.num_alloc_retries, 0);
    assert_eq!(sim.used(0), 74 * MIB as u64);
    a.free(q, Some(0)).unwrap();
}

/// With `max_split_size_mb` set, a request the driver cannot serve first returns this
/// stream's cached oversize segments: the smallest one that makes room, without counting a
/// retry or returning anything else.
#[test]
fn out_of_memory_first_returns_the_smallest_oversize_segment_that_makes_room() {
    let config = Config::parse("max_split_size_mb:40").unwrap();
    let (sim, a) = alloc_with(200 * MIB, &config);
    let s = unique_stream();
    let small = a.malloc(50 * MIB, s).unwrap();
    // Too large to serve 70 MiB from the cache (20 MiB or more would be wasted).
    let large = a.malloc(100 * MIB, s).unwrap();
    a.free(small, Some(s)).unwrap();
    a.free(large, Some(s)).unwrap();
    let _p = a.malloc(70 * MIB, s).unwrap();
    let st = stats(&a);
    assert_eq!(st.num_alloc_retries, 0);
    assert_eq!(st.num_device_free, 1, "only the 100 MiB segment went");
    assert_eq!(sim.used(0), 120 * MIB as u64);
    assert_eq!(
        a.malloc(50 * MIB, s).unwrap(),
        small,
        "the 50 MiB one is still cached"
    );
}

/// When no single oversize segment is large enough, the largest go until enough is returned.
#[test]
fn out_of_memory_returns_the_largest_oversize_segments_until_there_is_room() {
    let config = Config::parse("max_split_size_mb:40").unwrap();
    let (sim, a) = alloc_with(128 * MIB, &config);
    let s = unique_stream();
    let x = a.malloc(50 * MIB, s).unwrap();
    let y = a.malloc(60 * MIB, s).unwrap();
    a.free(x, Some(s)).unwrap();
    a.free(y, Some(s)).unwrap();
    let _p = a.malloc(70 * MIB, s).unwrap();
    let st = stats(&a);
    assert_eq!(st.num_alloc_retries, 0);
    assert_eq!(st.num_device_free, 2);
    assert_eq!(sim.used(0), 70 * MIB as u64);
}

/// As in PyTorch, the threshold is a share of what a memory fraction allows: without one,
/// nothing is collected.
#[test]
fn garbage_collection_needs_a_memory_fraction() {
    let config = Config::parse("garbage_collection_threshold:0.5").unwrap();
    let (sim, a) = alloc_with(256 * MIB, &config);
    let p = a.malloc(70 * MIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    let q = a.malloc(74 * MIB, 0).unwrap();
    assert_eq!(stats(&a).num_device_free, 0);
    assert_eq!(sim.used(0), 144 * MIB as u64);
    a.free(q, Some(0)).unwrap();
}

/// A pass frees the segments at least as old as the average (counted in large requests
/// since they became free), in size order, and stops once the excess is returned.
#[test]
fn garbage_collection_frees_the_oldest_segments_first() {
    let config = Config::parse("garbage_collection_threshold:0.5").unwrap();
    let (sim, a) = alloc_with(256 * MIB, &config);
    a.set_memory_fraction(0.5).unwrap(); // collection past 64 MiB
    let s = unique_stream();
    let old = a.malloc(20 * MIB, s).unwrap();
    let young = a.malloc(22 * MIB, s).unwrap();
    a.free(old, Some(s)).unwrap();
    // 42 MiB reserved: no collection for this one.
    let c = a.malloc(24 * MIB, s).unwrap();
    a.free(young, Some(s)).unwrap();
    // 66 MiB reserved: `old` has waited 2 requests, `young` 1, so only `old` goes.
    let d = a.malloc(26 * MIB, s).unwrap();
    assert_eq!(stats(&a).num_device_free, 1);
    assert_eq!(sim.used(0), (22 + 24 + 26) * MIB as u64);
    assert_eq!(
        a.malloc(22 * MIB, s).unwrap(),
        young,
        "the younger segment is still cached"
    );
    for p in [c, d, young] {
        a.free(p, Some(s)).unwrap();
    }
}

#[test]
fn freeing_a_simulated_allocation_keeps_the_bytes_of_its_neighbour() {
    // A free hands back only the pages wholly inside it: the page it shares with the next
    // allocation keeps that allocation's bytes.
    let sim = SimDriver::shared(1, 64 * MIB as u64).unwrap();
    let first = sim.mem_alloc(0, 6487).unwrap();
    let second = sim.mem_alloc(0, 4096).unwrap();
    assert!(
        second > first && second < first + 8192,
        "{first:#x} {second:#x}"
    );
    // SAFETY: the simulated device is backed by host memory; both ranges are allocated.
    unsafe { std::ptr::write_bytes(second as *mut u8, 0xab, 4096) };
    sim.mem_free(0, first).unwrap();
    // SAFETY: `second` is still allocated.
    let bytes = unsafe { std::slice::from_raw_parts(second as *const u8, 4096) };
    assert!(bytes.iter().all(|&b| b == 0xab));
    sim.mem_free(0, second).unwrap();
}

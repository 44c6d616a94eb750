//! Expandable segments (`expandable_segments:True`) and the compact policy (`policy:compact`)
//! on the simulated device, one behaviour per test.

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::history::Action;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::Error;

const MIB: usize = 1 << 20;
const AGG: usize = 0;
const SMALL: usize = 1;
const LARGE: usize = 2;

fn setup(capacity: usize, conf: &str) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = SimDriver::shared(1, capacity as u64).unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &Config::parse(conf).unwrap()).unwrap();
    (sim, a)
}

fn expandable(capacity: usize) -> (Arc<SimDriver>, DeviceAllocator) {
    setup(capacity, "expandable_segments:True")
}

/// A stream handle no other test uses (the simulated streams are process-wide).
fn unique_stream() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0x9000);
    NEXT.fetch_add(0x10, Ordering::Relaxed)
}

fn reserved(a: &DeviceAllocator) -> i64 {
    a.stats().reserved_bytes[AGG].current
}

#[test]
fn growth_maps_whole_large_pages_at_the_end_of_one_range() {
    let (sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(30 * MIB, s).unwrap();
    assert_eq!(reserved(&a), 40 << 20, "two 20 MiB pages");
    assert_eq!(sim.mapped(0), 40 << 20);
    let q = a.malloc(30 * MIB, s).unwrap();
    assert_eq!(
        q,
        p + 30 * MIB,
        "the second block follows the first in the same range"
    );
    assert_eq!(reserved(&a), 60 << 20, "only the missing page is mapped");
    let st = a.stats();
    assert_eq!(
        st.segment[AGG].peak, 0,
        "expandable ranges are not counted as segments (PyTorch's statistics)"
    );
    assert_eq!(st.num_device_alloc, 2, "one mapping per growth");
    assert_eq!(
        sim.counters
            .vmm_reserve
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    a.free(p, Some(s)).unwrap();
    a.free(q, Some(s)).unwrap();
}

#[test]
fn small_requests_grow_the_small_pool_range_by_2mib_pages() {
    let (_sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(1000, s).unwrap();
    let st = a.stats();
    assert_eq!(st.reserved_bytes[SMALL].current, 2 << 20);
    assert_eq!(st.reserved_bytes[LARGE].current, 0);
    a.free(p, Some(s)).unwrap();
}

#[test]
fn mapped_bytes_count_as_reserved_and_free_pages_stay_mapped_until_empty_cache() {
    let (sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(50 * MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    assert_eq!(reserved(&a), 60 << 20, "free pages are cached");
    assert_eq!(a.stats().allocated_bytes[AGG].current, 0);
    a.empty_cache().unwrap();
    assert_eq!(reserved(&a), 0);
    assert_eq!(sim.mapped(0), 0);
    assert_eq!(sim.used(0), 0);
    let st = a.stats();
    assert_eq!(st.segment[AGG].current, 0);
    assert_eq!(st.num_device_free, 1);
    assert!(!a.owns(p), "the empty range went back to the driver");
}

#[test]
fn empty_cache_unmaps_only_physical_allocations_without_live_blocks() {
    let (sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(40 * MIB, s).unwrap();
    let q = a.malloc(20 * MIB, s).unwrap();
    let r = a.malloc(10 * MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    a.free(r, Some(s)).unwrap();
    a.empty_cache().unwrap();
    // Three growths: p's 40 MiB, q's 20 MiB and r's 20 MiB; only q's holds a live block.
    assert_eq!(reserved(&a), 20 << 20);
    assert_eq!(sim.mapped(0), 20 << 20);
    let p2 = a.malloc(40 * MIB, s).unwrap();
    assert_eq!(p2, p, "the lowest hole is mapped again first");
    assert_eq!(reserved(&a), 60 << 20);
    a.free(p2, Some(s)).unwrap();
    a.free(q, Some(s)).unwrap();
}

#[test]
fn a_physical_allocation_with_a_live_block_stays_mapped() {
    let (sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(30 * MIB, s).unwrap();
    let q = a.malloc(30 * MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    a.empty_cache().unwrap();
    // p's growth mapped [0, 40 MiB) as one allocation, and q lives in [30, 60).
    assert_eq!(reserved(&a), 60 << 20);
    assert_eq!(sim.mapped(0), 60 << 20);
    a.free(q, Some(s)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(reserved(&a), 0);
}

#[test]
fn blocks_in_expandable_segments_split_whatever_the_rest() {
    let (_sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(19 * MIB, s).unwrap();
    let q = a.malloc(512 * 1024 + 1, s).unwrap();
    assert_eq!(
        a.stats().allocated_bytes[SMALL].current,
        512 * 1024 + 512,
        "small requests use the small pool"
    );
    let r = a.malloc(2 * MIB, s).unwrap();
    assert_eq!(
        r,
        p + 19 * MIB,
        "the 1 MiB rest of the page was split off and grown"
    );
    a.free(p, Some(s)).unwrap();
    a.free(q, Some(s)).unwrap();
    a.free(r, Some(s)).unwrap();
}

#[test]
fn out_of_memory_retry_unmaps_cached_pages_of_other_streams() {
    let (sim, a) = expandable(100 << 20);
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(60 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(60 * MIB, s2).unwrap();
    let st = a.stats();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(reserved(&a), 60 << 20);
    assert_eq!(sim.mapped(0), 60 << 20);
    a.free(q, Some(s2)).unwrap();
}

#[test]
fn a_request_above_capacity_is_a_pytorch_style_out_of_memory_error() {
    let (sim, a) = expandable(100 << 20);
    let e = a.malloc(200 * MIB, 0).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert!(e.message().contains("tried to allocate 200.00 MiB"), "{e}");
    assert_eq!(sim.mapped(0), 0);
    assert_eq!(a.stats().num_ooms, 1);
    // Still usable.
    let p = a.malloc(10 * MIB, 0).unwrap();
    a.free(p, Some(0)).unwrap();
}

#[test]
fn exhausted_address_space_is_an_out_of_memory_error() {
    let (sim, a) = expandable(1 << 30);
    sim.set_address_space(1 << 30);
    let e = a.malloc(10 * MIB, unique_stream()).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert!(e.message().contains("address space"), "{e}");
}

#[test]
fn without_vmm_expandable_segments_fall_back_to_ordinary_segments() {
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    sim.set_vmm_supported(false);
    let config = Config::parse("expandable_segments:True").unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &config).unwrap();
    let p = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(
        reserved(&a),
        30 << 20,
        "an ordinary segment of the rounded size"
    );
    assert_eq!(sim.mapped(0), 0);
    a.free(p, Some(0)).unwrap();
}

#[test]
fn dropping_the_allocator_unmaps_and_returns_every_range() {
    let (sim, a) = expandable(1 << 30);
    let p = a.malloc(30 * MIB, unique_stream()).unwrap();
    let _ = p;
    drop(a);
    assert_eq!(sim.mapped(0), 0);
    assert_eq!(sim.used(0), 0);
}

#[test]
fn compact_maps_pages_of_the_driver_granularity() {
    let (_sim, a) = setup(1 << 30, "policy:compact");
    let p = a.malloc(3 * MIB, unique_stream()).unwrap();
    assert_eq!(reserved(&a), 4 << 20);
    let _ = p;
}

/// Stream `s` holds `pieces` free blocks of `piece` bytes each, kept apart by live blocks
/// (returned) so that no free block is larger than `piece`.
fn free_pieces(a: &DeviceAllocator, s: usize, pieces: usize, piece: usize) -> Vec<usize> {
    let mut live = Vec::new();
    let mut freed = Vec::new();
    for _ in 0..pieces {
        freed.push(a.malloc(piece, s).unwrap());
        live.push(a.malloc(piece, s).unwrap());
    }
    for p in freed {
        a.free(p, Some(s)).unwrap();
    }
    live
}

#[test]
fn compact_lends_an_idle_free_block_of_another_stream_instead_of_growing() {
    use std::sync::atomic::Ordering::Relaxed;
    let (sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(40 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let maps = (
        sim.counters.vmm_map.load(Relaxed),
        sim.counters.vmm_map_kept.load(Relaxed),
    );
    a.history().set(true, 100).unwrap();
    let q = a.malloc(40 * MIB, s2).unwrap();
    assert_eq!(q, p, "s2 uses s1's idle block where it lies");
    assert_eq!(reserved(&a), 40 << 20);
    assert_eq!(
        (
            sim.counters.vmm_map.load(Relaxed),
            sim.counters.vmm_map_kept.load(Relaxed)
        ),
        maps,
        "nothing mapped"
    );
    a.free(q, Some(s2)).unwrap();
    assert_eq!(a.stats().allocated_bytes[AGG].current, 0);
    // The block's events name its stream (s1), the alloc as its free, as PyTorch's do.
    let events: Vec<(Action, usize)> = a
        .history()
        .entries()
        .iter()
        .filter(|e| e.addr == q as u64)
        .map(|e| (e.action, e.stream as usize))
        .collect();
    assert_eq!(
        events[..2],
        [(Action::Alloc, s1), (Action::FreeRequested, s1)]
    );
}

#[test]
fn compact_lends_the_best_fitting_idle_block_of_all_streams() {
    let (_sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2, s3) = (unique_stream(), unique_stream(), unique_stream());
    let loose = a.malloc(30 * MIB, s1).unwrap();
    let snug = a.malloc(20 * MIB, s2).unwrap();
    a.free(loose, Some(s1)).unwrap();
    a.free(snug, Some(s2)).unwrap();
    let q = a.malloc(20 * MIB, s3).unwrap();
    assert_eq!(q, snug, "s2's 20 MiB block, not s1's 30 MiB one");
    a.free(q, Some(s3)).unwrap();
}

#[test]
fn compact_does_not_lend_a_block_much_larger_than_the_request() {
    let (_sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(40 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(10 * MIB, s2).unwrap();
    assert!(
        q < p || q >= p + 40 * MIB,
        "s1's 40 MiB block is not split for 10 MiB of s2"
    );
    a.free(q, Some(s2)).unwrap();
}

#[test]
fn a_lent_block_returns_to_its_stream_only_after_the_borrowers_work_completes() {
    let (_sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(40 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(40 * MIB, s2).unwrap();
    assert_eq!(q, p);
    sim::hold_stream(s2);
    // Freed on the borrowing stream, or with no stream at all: either way s2's work counts.
    a.free(q, None).unwrap();
    let r = a.malloc(40 * MIB, s1).unwrap();
    assert!(
        r + 40 * MIB <= p || r >= p + 40 * MIB,
        "s2's work may still use the block: s1 gets other memory"
    );
    sim::release_stream(s2);
    a.free(r, Some(s1)).unwrap();
    let again = [
        a.malloc(40 * MIB, s1).unwrap(),
        a.malloc(40 * MIB, s1).unwrap(),
    ];
    assert!(again.contains(&p), "back in s1's pool: {again:x?}");
    for x in again {
        a.free(x, Some(s1)).unwrap();
    }
}

#[test]
fn compact_reuses_idle_free_pages_of_another_stream_instead_of_growing() {
    use std::sync::atomic::Ordering::Relaxed;
    let (sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    // Two idle 10 MiB blocks of s1, none large enough to lend for 20 MiB.
    let live = free_pieces(&a, s1, 2, 10 * MIB);
    let created = sim.counters.vmm_map.load(Relaxed);
    let q = a.malloc(20 * MIB, s2).unwrap();
    assert_eq!(reserved(&a), 40 << 20, "s1's idle pages moved to s2");
    assert_eq!(sim.mapped(0), 40 << 20);
    assert_eq!(
        sim.counters.vmm_map_kept.load(Relaxed),
        10,
        "the same 10 physical pages, mapped again"
    );
    assert_eq!(sim.counters.vmm_map.load(Relaxed), created, "none created");
    assert_eq!(sim.counters.vmm_unmap.load(Relaxed), 0, "none released");
    assert_eq!(
        a.stats().num_alloc_retries,
        0,
        "no out-of-memory retry was needed"
    );
    a.free(q, Some(s2)).unwrap();
    for p in live {
        a.free(p, Some(s1)).unwrap();
    }
}

#[test]
fn compact_grows_without_taking_pages_while_under_its_most_reserved() {
    use std::sync::atomic::Ordering::Relaxed;
    let (sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let big = a.malloc(100 * MIB, s1).unwrap();
    a.free(big, Some(s1)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(reserved(&a), 0);
    let live = free_pieces(&a, s1, 2, 10 * MIB);
    let kept = sim.counters.vmm_map_kept.load(Relaxed);
    // 40 MiB mapped and 20 MiB more stay under the 100 MiB reserved before.
    let q = a.malloc(20 * MIB, s2).unwrap();
    assert_eq!(
        reserved(&a),
        60 << 20,
        "s1's idle pages stay where they are"
    );
    assert_eq!(sim.counters.vmm_map_kept.load(Relaxed), kept);
    // Past the most reserved, idle pages go first.
    let r = a.malloc(60 * MIB, s2).unwrap();
    assert_eq!(reserved(&a), 100 << 20, "{}", reserved(&a));
    for p in live {
        a.free(p, Some(s1)).unwrap();
    }
    a.free(q, Some(s2)).unwrap();
    a.free(r, Some(s2)).unwrap();
}

#[test]
fn compact_leaves_pages_alone_until_the_event_after_their_free_completed() {
    let (sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(40 * MIB, s1).unwrap();
    sim::hold_stream(s1);
    a.free(p, Some(s1)).unwrap();
    let q = a.malloc(40 * MIB, s2).unwrap();
    assert_eq!(
        reserved(&a),
        80 << 20,
        "s1's work may still use its pages: s2 grows"
    );
    let records = sim
        .counters
        .event_records
        .load(std::sync::atomic::Ordering::Relaxed);
    a.free(q, Some(s2)).unwrap();
    let r = a.malloc(80 * MIB, unique_stream()).unwrap();
    assert_eq!(
        sim.counters
            .event_records
            .load(std::sync::atomic::Ordering::Relaxed),
        records + 1,
        "s1's pending batch event is queried, not recorded again (s2's batch gets one)"
    );
    assert!(reserved(&a) >= 120 << 20, "s1 still held: its pages stay");
    sim::release_stream(s1);
    a.free(r, None).unwrap();
    let t = a.malloc(100 * MIB, unique_stream()).unwrap();
    assert!(
        reserved(&a) <= 120 << 20,
        "after s1's work completed its pages are reused: {}",
        reserved(&a)
    );
    a.free(t, None).unwrap();
}

#[test]
fn compact_never_waits_for_a_held_stream() {
    let (sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(10 * MIB, s1).unwrap();
    sim::hold_stream(s1);
    a.free(p, Some(s1)).unwrap();
    let syncs = sim
        .counters
        .event_syncs
        .load(std::sync::atomic::Ordering::Relaxed);
    let q = a.malloc(10 * MIB, s2).unwrap();
    assert_eq!(
        sim.counters
            .event_syncs
            .load(std::sync::atomic::Ordering::Relaxed),
        syncs
    );
    sim::release_stream(s1);
    a.free(q, Some(s2)).unwrap();
}

#[test]
fn the_default_policy_is_unchanged_by_the_new_options() {
    let (sim, a) = setup(1 << 30, "");
    let p = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(reserved(&a), 30 << 20);
    assert_eq!(sim.mapped(0), 0);
    assert_eq!(
        sim.counters
            .vmm_reserve
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    a.free(p, Some(0)).unwrap();
}

/// Random mallocs and frees on several streams: the statistics always agree with what the
/// driver has mapped, and after everything is freed and the cache emptied nothing is left.
fn random_workload_keeps_the_books(conf: &str) {
    let (sim, a) = setup(2 << 30, conf);
    let streams = [unique_stream(), unique_stream(), unique_stream()];
    let mut live: Vec<(usize, usize, usize)> = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for step in 0..4000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let s = streams[(x % 3) as usize];
        if live.len() < 40 && !(x >> 8).is_multiple_of(3) {
            let size = match (x >> 12) % 4 {
                0 => (x >> 20) as usize % (1 << 20) + 1,
                1 => (x >> 20) as usize % (12 << 20) + 1,
                _ => (x >> 20) as usize % (40 << 20) + 1,
            };
            let p = a.malloc(size, s).unwrap();
            // Blocks lent across streams included, no two live allocations overlap.
            for &(q, _, n) in &live {
                assert!(
                    p + size <= q || q + n <= p,
                    "step {step}: {p:#x} overlaps {q:#x}"
                );
            }
            live.push((p, s, size));
        } else if !live.is_empty() {
            let (p, s, _) = live.swap_remove((x >> 30) as usize % live.len());
            a.free(p, Some(s)).unwrap();
        }
        if step % 500 == 0 {
            a.empty_cache().unwrap();
        }
        let st = a.stats();
        assert_eq!(
            st.reserved_bytes[AGG].current as u64,
            sim.mapped(0),
            "step {step}"
        );
        assert!(st.allocated_bytes[AGG].current <= st.reserved_bytes[AGG].current);
    }
    for (p, s, _) in live {
        a.free(p, Some(s)).unwrap();
    }
    a.empty_cache().unwrap();
    let st = a.stats();
    assert_eq!(st.reserved_bytes[AGG].current, 0);
    assert_eq!(st.allocated_bytes[AGG].current, 0);
    assert_eq!(st.inactive_split[AGG].current, 0);
    assert_eq!(st.inactive_split_bytes[AGG].current, 0);
    assert_eq!(st.segment[AGG].current, 0);
    assert_eq!(sim.used(0), 0);
}

#[test]
fn expandable_segments_keep_the_books_under_a_random_workload() {
    random_workload_keeps_the_books("expandable_segments:True");
}

#[test]
fn the_compact_policy_keeps_the_books_under_a_random_workload() {
    random_workload_keeps_the_books("policy:compact");
}

#[test]
fn compact_records_no_event_while_a_graph_pool_is_active() {
    let (sim, a) = setup(1 << 30, "policy:compact");
    let (s1, s2) = (unique_stream(), unique_stream());
    let p = a.malloc(10 * MIB, s1).unwrap();
    a.free(p, Some(s1)).unwrap();
    let records = sim
        .counters
        .event_records
        .load(std::sync::atomic::Ordering::Relaxed);
    let pool = (1, 0);
    a.begin_allocate_to_pool(pool, None).unwrap();
    let q = a.malloc(10 * MIB, s2).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    assert_eq!(
        sim.counters
            .event_records
            .load(std::sync::atomic::Ordering::Relaxed),
        records,
        "a capture forbids recording events: s1's pages stay where they are"
    );
    a.free(q, Some(s2)).unwrap();
    a.release_pool(pool).unwrap();
}

#[test]
fn the_simulated_driver_unmaps_single_allocations_of_one_mapping_call() {
    use tensoralloc::driver::Driver;
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let base = sim.vmm_reserve(0, 64 * MIB).unwrap();
    let mut h = Vec::new();
    sim.vmm_map_many(0, base, 14 * MIB, 4 * MIB, &mut h)
        .unwrap();
    assert_eq!(h.len(), 4, "4 + 4 + 4 + 2 MiB");
    assert_eq!(sim.mapped(0), 14 << 20);
    let at = |i: usize| base + i * 4 * MIB;
    assert!(
        sim.vmm_unmap(0, at(1), 4 * MIB, h[0]).is_err(),
        "another allocation's handle"
    );
    assert!(
        sim.vmm_unmap(0, at(1), 2 * MIB, h[1]).is_err(),
        "part of an allocation"
    );
    sim.vmm_unmap_many(0, &[(at(1), 4 * MIB, h[1]), (at(2), 4 * MIB, h[2])])
        .unwrap();
    assert_eq!(sim.mapped(0), 6 << 20, "the allocations around them stay");
    assert!(
        sim.vmm_map_many(0, at(3), 2 * MIB, 2 * MIB, &mut Vec::new())
            .is_err(),
        "the last allocation still covers its range"
    );
    assert!(
        sim.vmm_unmap(0, at(1), 4 * MIB, h[1]).is_err(),
        "unmapped already"
    );
    sim.vmm_unmap_many(0, &[(at(3), 2 * MIB, h[3]), (base, 4 * MIB, h[0])])
        .unwrap();
    assert_eq!(sim.mapped(0), 0);
    sim.vmm_free_range(0, base, 64 * MIB).unwrap();
}

#[test]
fn the_simulated_driver_refuses_to_map_over_or_unmap_inside_an_allocation() {
    use tensoralloc::driver::Driver;
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let base = sim.vmm_reserve(0, 64 * MIB).unwrap();
    let mut h = Vec::new();
    sim.vmm_map_many(0, base + 4 * MIB, 6 * MIB, 6 * MIB, &mut h)
        .unwrap();
    let mut more = Vec::new();
    assert!(
        sim.vmm_map_many(0, base, 6 * MIB, 2 * MIB, &mut more)
            .is_err(),
        "the last page overlaps the allocation"
    );
    assert!(
        sim.vmm_map_many(0, base + 8 * MIB, 2 * MIB, 2 * MIB, &mut more)
            .is_err(),
        "inside the allocation"
    );
    assert!(
        sim.vmm_unmap(0, base + 6 * MIB, 4 * MIB, h[0]).is_err(),
        "from a page inside the allocation"
    );
    assert!(
        sim.vmm_free_range(0, base, 64 * MIB).is_err(),
        "the range still has a mapping"
    );
    assert!(more.is_empty(), "a refused mapping creates nothing");
    assert_eq!(sim.mapped(0), 6 << 20);
    sim.vmm_map_many(0, base, 4 * MIB, 2 * MIB, &mut more)
        .unwrap();
    sim.vmm_unmap(0, base + 4 * MIB, 6 * MIB, h[0]).unwrap();
    assert_eq!(sim.mapped(0), 4 << 20);
    sim.vmm_unmap_many(
        0,
        &[(base, 2 * MIB, more[0]), (base + 2 * MIB, 2 * MIB, more[1])],
    )
    .unwrap();
    sim.vmm_free_range(0, base, 64 * MIB).unwrap();
}

#[test]
fn the_simulated_driver_maps_kept_allocations_again_elsewhere_and_releases_them() {
    use tensoralloc::driver::Driver;
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let used = |sim: &SimDriver| {
        let info = sim.mem_info(0).unwrap();
        info.total - info.free
    };
    let base = sim.vmm_reserve(0, 64 * MIB).unwrap();
    let mut h = Vec::new();
    sim.vmm_map_many(0, base, 6 * MIB, 2 * MIB, &mut h).unwrap();
    let pages = |i: usize| (base + i * 2 * MIB, 2 * MIB, h[i]);
    sim.vmm_unmap_keep(0, &[pages(0), pages(1)]).unwrap();
    assert_eq!(sim.mapped(0), 2 << 20);
    assert_eq!(used(&sim), 6 << 20, "kept allocations still hold memory");
    let elsewhere = base + 20 * MIB;
    sim.vmm_map_kept(0, elsewhere, &[(2 * MIB, h[0]), (2 * MIB, h[1])])
        .unwrap();
    assert_eq!(sim.mapped(0), 6 << 20);
    assert_eq!(used(&sim), 6 << 20, "nothing was created");
    assert!(
        sim.vmm_map_kept(0, base, &[(2 * MIB, h[0])]).is_err(),
        "mapped again already: no longer kept"
    );
    assert!(
        sim.vmm_map_kept(0, base + 4 * MIB, &[(2 * MIB, h[2])])
            .is_err(),
        "never kept"
    );
    sim.vmm_unmap_keep(0, &[(elsewhere, 2 * MIB, h[0])])
        .unwrap();
    sim.vmm_release(0, h[0]).unwrap();
    assert_eq!(used(&sim), 4 << 20);
    assert!(sim.vmm_release(0, h[0]).is_err(), "released already");
    sim.vmm_unmap_many(0, &[(elsewhere + 2 * MIB, 2 * MIB, h[1]), pages(2)])
        .unwrap();
    assert_eq!(used(&sim), 0);
    sim.vmm_free_range(0, base, 64 * MIB).unwrap();
}

/// The mapping events of the memory history, as (action, address, bytes, stream).
fn mapping_events(a: &DeviceAllocator) -> Vec<(Action, usize, usize, usize)> {
    a.history()
        .entries()
        .into_iter()
        .filter(|e| matches!(e.action, Action::SegmentMap | Action::SegmentUnmap))
        .map(|e| {
            (
                e.action,
                e.addr as usize,
                e.size as usize,
                e.stream as usize,
            )
        })
        .collect()
}

#[test]
fn the_memory_history_records_each_mapping_and_unmapping() {
    let (_sim, a) = expandable(1 << 30);
    let s = unique_stream();
    a.history().set(true, 100).unwrap();
    let p = a.malloc(30 * MIB, s).unwrap();
    let q = a.malloc(30 * MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    a.empty_cache().unwrap();
    let maps = [
        (Action::SegmentMap, p, 40 * MIB, s),
        (Action::SegmentMap, p + 40 * MIB, 20 * MIB, s),
    ];
    assert_eq!(
        mapping_events(&a),
        maps,
        "p's physical allocation holds the start of q too"
    );
    a.free(q, Some(s)).unwrap();
    a.empty_cache().unwrap();
    let unmap = (Action::SegmentUnmap, p, 60 * MIB, s);
    assert_eq!(mapping_events(&a), [maps[0], maps[1], unmap]);
}

#[test]
fn the_memory_history_records_pages_compact_takes_from_another_stream() {
    let (_sim, a) = setup(1 << 30, "policy:compact");
    let (s, t) = (unique_stream(), unique_stream());
    let live = free_pieces(&a, s, 2, 4 * MIB);
    let p = live[0] - 4 * MIB;
    a.history().set(true, 100).unwrap();
    let q = a.malloc(8 * MIB, t).unwrap();
    let events = mapping_events(&a);
    assert!(
        events.contains(&(Action::SegmentUnmap, p, 4 * MIB, s)),
        "{events:?}"
    );
    assert!(
        events.contains(&(Action::SegmentMap, q, 8 * MIB, t)),
        "{events:?}"
    );
    a.free(q, Some(t)).unwrap();
    for p in live {
        a.free(p, Some(s)).unwrap();
    }
}

#[test]
fn a_snapshot_says_segments_are_expandable_and_carries_the_mapping_events() {
    let conf = "expandable_segments:True";
    let (_sim, a) = setup(1 << 30, conf);
    let s = unique_stream();
    a.history().set(true, 100).unwrap();
    let p = a.malloc(30 * MIB, s).unwrap();
    let mut out = Vec::new();
    let config = Config::parse(conf).unwrap();
    tensoralloc::device::history::write_snapshot(&mut out, std::iter::once(&a), &config, conf)
        .unwrap();
    let value: serde_pickle::Value =
        serde_pickle::from_slice(&out, serde_pickle::DeOptions::new()).unwrap();
    let text = format!("{value:?}");
    assert!(
        text.contains(r#"String("expandable_segments"): Bool(true)"#),
        "{text}"
    );
    assert!(text.contains(r#"String("segment_map")"#), "{text}");
    let trace = tensoralloc::replay::snapshot::parse(&out, 0).unwrap();
    let actions: Vec<_> = trace.events.iter().map(|e| e.action).collect();
    assert_eq!(actions, [Action::SegmentMap, Action::Alloc]);
    a.free(p, Some(s)).unwrap();
}

#[test]
fn empty_cache_waits_for_the_stream_before_unmapping() {
    let (sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let p = a.malloc(20 * MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    let waits = || {
        sim.counters
            .event_syncs
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = waits();
    a.empty_cache().unwrap();
    assert_eq!(
        waits(),
        before + 1,
        "kernels queued before the free may still use the page"
    );
    assert_eq!(sim.mapped(0), 0);
}

#[test]
fn the_garbage_collection_threshold_unmaps_free_pages_before_growing_past_it() {
    let (sim, a) = setup(
        1 << 30,
        "expandable_segments:True,garbage_collection_threshold:0.5",
    );
    a.set_memory_fraction(1.0).unwrap();
    let s = unique_stream();
    let p = a.malloc(300 * MIB, s).unwrap();
    let q = a.malloc(20 * MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    let r = a.malloc(400 * MIB, s).unwrap();
    assert!(
        r > q,
        "p's free pages are too few for r, which goes after q"
    );
    assert_eq!(
        reserved(&a),
        420 << 20,
        "720 MiB would pass half of the device: p's pages went back first"
    );
    assert_eq!(sim.mapped(0), 420 << 20);
    a.free(q, Some(s)).unwrap();
    a.free(r, Some(s)).unwrap();
}

#[test]
fn graph_private_pools_keep_ordinary_segments() {
    let (sim, a) = expandable(1 << 30);
    let s = unique_stream();
    let pool = (2, 0);
    a.begin_allocate_to_pool(pool, None).unwrap();
    let p = a.malloc(30 * MIB, s).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    assert_eq!(sim.mapped(0), 0, "nothing mapped");
    assert_eq!(reserved(&a), 30 << 20, "one ordinary 30 MiB segment");
    a.free(p, Some(s)).unwrap();
    a.release_pool(pool).unwrap();
    assert_eq!(reserved(&a), 0, "the released pool's segment went back");
}

#[test]
fn compact_never_hands_out_memory_twice_while_threads_on_streams_borrow_from_each_other() {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let (sim, a) = setup(4 << 30, "policy:compact");
    let live: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (a, live) = (&a, &live);
            scope.spawn(move || {
                let s = unique_stream();
                let mut mine: Vec<(usize, usize)> = Vec::new();
                let mut x = 0x2545_f491_4f6c_dd1du64 ^ (t << 32);
                for step in 0..3000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Phases of small and large requests make streams miss their own
                    // cache while others hold idle blocks.
                    let phase = (step / 200 + t as usize) % 3;
                    if mine.len() < 12 && !x.is_multiple_of(3) {
                        let size = [3, 5, 9, 17][(x >> 16) as usize % (2 + phase)] << 20;
                        let p = a.malloc(size, s).unwrap();
                        let mut l = live.lock().unwrap();
                        if let Some((&q, &n)) = l.range(..p + size).next_back() {
                            assert!(q + n <= p, "{p:#x}+{size} overlaps {q:#x}+{n}");
                        }
                        l.insert(p, size);
                        drop(l);
                        mine.push((p, size));
                    } else if !mine.is_empty() {
                        let (p, _) = mine.swap_remove((x >> 40) as usize % mine.len());
                        live.lock().unwrap().remove(&p);
                        // Every other free names no stream: the owner is found by address.
                        let hint = (x >> 8).is_multiple_of(2);
                        a.free(p, hint.then_some(s)).unwrap();
                    }
                }
                for (p, _) in mine {
                    live.lock().unwrap().remove(&p);
                    a.free(p, Some(s)).unwrap();
                }
            });
        }
    });
    a.empty_cache().unwrap();
    let st = a.stats();
    assert_eq!(st.allocated_bytes[AGG].current, 0);
    assert_eq!(st.reserved_bytes[AGG].current, 0);
    assert_eq!(sim.used(0), 0);
}

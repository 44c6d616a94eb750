//! Graph private pools and capture awareness of the device allocator (PyTorch's
//! `beginAllocateToPool` / `endAllocateToPool` / `releasePool`), on the simulated device.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::{DeviceAllocator, StreamFilter};
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::Error;

const MIB: usize = 1 << 20;
const POOL: (u64, u64) = (1, 7);
const OTHER_POOL: (u64, u64) = (2, 9);

fn alloc(capacity: usize) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = SimDriver::shared(1, capacity as u64).unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
    (sim, a)
}

/// A stream handle no other test uses (simulated streams and captures are process-wide).
fn unique_stream() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0x9000_0000);
    NEXT.fetch_add(0x10, Relaxed)
}

fn only(stream: usize) -> Option<StreamFilter> {
    Some(Arc::new(move |s| s == stream))
}

fn reserved(a: &DeviceAllocator) -> i64 {
    a.stats().reserved_bytes[0].current
}

#[test]
fn a_block_freed_in_a_pool_is_not_reused_outside_it() {
    let (_sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let inside = a.malloc(MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(inside, Some(s)).unwrap();
    let outside = a.malloc(MIB, s).unwrap();
    assert_ne!(
        outside, inside,
        "the pool's cached block went to an ordinary allocation"
    );
    assert_eq!(
        a.stats().segment[0].current,
        2,
        "a segment for the pool and one outside"
    );
    a.free(outside, Some(s)).unwrap();
}

#[test]
fn a_block_freed_outside_is_not_reused_in_a_pool() {
    let (_sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    let outside = a.malloc(MIB, s).unwrap();
    a.free(outside, Some(s)).unwrap();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let inside = a.malloc(MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_ne!(
        inside, outside,
        "a cached ordinary block went into the pool"
    );
    a.free(inside, Some(s)).unwrap();
}

#[test]
fn blocks_freed_in_a_pool_are_reused_by_the_pool() {
    let (_sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let first = a.malloc(MIB, s).unwrap();
    a.free(first, None).unwrap();
    let again = a.malloc(MIB, s).unwrap();
    assert_eq!(again, first);
    a.end_allocate_to_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    a.free(again, Some(s)).unwrap();
    let third = a.malloc(MIB, s).unwrap();
    assert_eq!(
        third, first,
        "a later begin of the same pool finds its cache"
    );
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(third, Some(s)).unwrap();
}

#[test]
fn only_streams_the_filter_accepts_allocate_to_the_pool() {
    let (_sim, a) = alloc(256 * MIB);
    let (captured, other) = (unique_stream(), unique_stream());
    let ordinary = a.malloc(MIB, other).unwrap();
    a.free(ordinary, Some(other)).unwrap();
    a.begin_allocate_to_pool(POOL, only(captured)).unwrap();
    let on_other = a.malloc(MIB, other).unwrap();
    let on_captured = a.malloc(MIB, captured).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_eq!(
        on_other, ordinary,
        "a stream the filter rejects keeps its own cache"
    );
    a.free(on_captured, Some(captured)).unwrap();
    let after = a.malloc(MIB, captured).unwrap();
    assert_ne!(
        after, on_captured,
        "the captured stream's block stayed in the pool"
    );
    a.free(on_other, Some(other)).unwrap();
    a.free(after, Some(captured)).unwrap();
}

#[test]
fn pools_active_at_once_each_serve_their_own_streams() {
    let (_sim, a) = alloc(256 * MIB);
    let (s1, s2) = (unique_stream(), unique_stream());
    a.begin_allocate_to_pool(POOL, only(s1)).unwrap();
    a.begin_allocate_to_pool(OTHER_POOL, only(s2)).unwrap();
    let p1 = a.malloc(MIB, s1).unwrap();
    let p2 = a.malloc(MIB, s2).unwrap();
    a.end_allocate_to_pool(OTHER_POOL).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_eq!(a.pool_count(), 2);
    a.free(p2, None).unwrap();
    a.release_pool(OTHER_POOL).unwrap();
    assert_eq!(
        a.pool_count(),
        1,
        "the released pool is gone, the other stays"
    );
    assert!(a.is_allocated(p1));
    a.free(p1, None).unwrap();
    a.release_pool(POOL).unwrap();
    assert_eq!(a.pool_count(), 0);
}

#[test]
fn releasing_an_unused_pool_returns_its_memory_to_the_driver() {
    let (sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let p = a.malloc(3 * MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(p, Some(s)).unwrap();
    assert_eq!(sim.used(0), 20 * MIB as u64, "cached in the pool");
    a.release_pool(POOL).unwrap();
    assert_eq!(sim.used(0), 0);
    assert_eq!(reserved(&a), 0);
    assert_eq!(a.pool_count(), 0);
}

#[test]
fn a_released_pool_returns_its_memory_when_its_last_block_is_freed() {
    let (sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let p = a.malloc(3 * MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    assert_eq!(sim.used(0), 20 * MIB as u64, "still allocated");
    assert_eq!(a.pool_count(), 1);
    a.free(p, Some(s)).unwrap();
    assert_eq!(sim.used(0), 0);
    assert_eq!(a.pool_count(), 0);
}

#[test]
fn a_pool_lives_until_its_last_use_is_released() {
    let (sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    for _ in 0..2 {
        a.begin_allocate_to_pool(POOL, None).unwrap();
        let p = a.malloc(MIB, s).unwrap();
        a.free(p, None).unwrap();
        a.end_allocate_to_pool(POOL).unwrap();
    }
    a.release_pool(POOL).unwrap();
    assert_eq!(sim.used(0), 2 * MIB as u64, "one use remains");
    a.release_pool(POOL).unwrap();
    assert_eq!(sim.used(0), 0);
}

#[test]
fn empty_cache_keeps_pools_in_use_and_frees_unused_ones() {
    let (sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let p = a.malloc(MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(p, None).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        sim.used(0),
        2 * MIB as u64,
        "the pool is in use: its cache stays"
    );
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
}

#[test]
fn pools_created_and_released_in_turn_reuse_their_stream_slots() {
    // More pools than a device has stream slots (4096): each vanished pool's shard serves
    // the next pool on the same stream.
    let (sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    for round in 0..5000u64 {
        let pool = (100 + round, 0);
        a.begin_allocate_to_pool(pool, None).unwrap();
        let p = a.malloc(MIB, s).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        a.free(p, None).unwrap();
        a.release_pool(pool).unwrap();
    }
    assert_eq!(sim.used(0), 0);
    assert_eq!(a.pool_count(), 0);
    assert_eq!(a.stats().num_device_alloc, 5000);
}

#[test]
fn pool_memory_counts_in_the_device_statistics() {
    let (_sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let p = a.malloc(MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let st = a.stats();
    assert_eq!(st.allocated_bytes[0].current, MIB as i64);
    assert_eq!(st.reserved_bytes[0].current, 2 * MIB as i64);
    a.free(p, None).unwrap();
    assert_eq!(a.stats().allocated_bytes[0].current, 0);
    a.release_pool(POOL).unwrap();
}

#[test]
fn pool_calls_with_bad_ids_or_states_are_errors() {
    let (_sim, a) = alloc(64 * MIB);
    let bad = |r: tensoralloc::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(
        bad(a.begin_allocate_to_pool((0, 0), None)),
        "(0, 0) is no pool"
    );
    assert!(bad(a.end_allocate_to_pool(POOL)), "nothing underway");
    assert!(bad(a.release_pool(POOL)), "no use to release");
    a.begin_allocate_to_pool(POOL, None).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert!(bad(a.end_allocate_to_pool(POOL)), "ended twice");
    a.release_pool(POOL).unwrap();
    assert!(bad(a.release_pool(POOL)), "released twice");
}

#[test]
fn stream_events_of_frees_during_capture_wait_until_the_capture_ends() {
    let (sim, a) = alloc(256 * MIB);
    let (s, side) = (unique_stream(), unique_stream());
    let p = a.malloc(MIB, s).unwrap();
    a.record_stream(p, side).unwrap();
    sim::capture::begin_capture(s).unwrap();
    a.begin_allocate_to_pool(POOL, only(s)).unwrap();
    a.free(p, Some(s)).unwrap();
    assert_eq!(sim.counters.event_records.load(Relaxed), 0, "deferred");
    let q = a.malloc(MIB, side).unwrap();
    assert_ne!(q, p, "the freed block is still in use by `side`");
    a.end_allocate_to_pool(POOL).unwrap();
    sim::capture::end_capture(s).expect("the capture stayed valid");
    assert_eq!(
        sim.counters.event_records.load(Relaxed),
        1,
        "recorded at the end"
    );
    assert!(a.stats().active_bytes[0].current >= 2 * MIB as i64);
    a.poll_events();
    assert_eq!(a.stats().active_bytes[0].current, MIB as i64, "q only");
    a.free(q, Some(side)).unwrap();
    a.release_pool(POOL).unwrap();
}

#[test]
fn no_event_is_queried_or_waited_for_while_a_pool_is_active() {
    let (sim, a) = alloc(64 * MIB);
    let (s, side) = (unique_stream(), unique_stream());
    sim::hold_stream(side);
    let p = a.malloc(40 * MIB, s).unwrap();
    a.record_stream(p, side).unwrap();
    a.free(p, Some(s)).unwrap();
    let queries = sim.counters.event_queries.load(Relaxed);
    sim::capture::begin_capture(s).unwrap();
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let small = a.malloc(MIB, s).unwrap();
    // Too big while the cached block waits for its event: fails without waiting or freeing.
    let e = a.malloc(40 * MIB, s).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e:?}");
    a.empty_cache().unwrap();
    a.free(small, None).unwrap();
    assert_eq!(sim.counters.event_queries.load(Relaxed), queries);
    assert_eq!(sim.counters.event_syncs.load(Relaxed), 0);
    assert_eq!(sim.counters.mem_free.load(Relaxed), 0);
    a.end_allocate_to_pool(POOL).unwrap();
    sim::capture::end_capture(s).expect("the capture stayed valid");
    sim::release_stream(side);
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
}

#[test]
fn a_capture_nobody_announced_still_defers_stream_events() {
    let (sim, a) = alloc(256 * MIB);
    let (s, side) = (unique_stream(), unique_stream());
    let p = a.malloc(MIB, s).unwrap();
    a.record_stream(p, side).unwrap();
    sim::capture::begin_capture(side).unwrap();
    a.free(p, Some(s)).unwrap();
    assert_eq!(sim.counters.event_records.load(Relaxed), 0);
    sim::capture::end_capture(side).unwrap();
    a.poll_events();
    assert_eq!(sim.counters.event_records.load(Relaxed), 1);
    let q = a.malloc(MIB, s).unwrap();
    assert_eq!(q, p, "the block came back once its event completed");
    a.free(q, Some(s)).unwrap();
}

#[test]
fn the_simulated_driver_invalidates_a_capture_on_an_event_query() {
    let (sim, a) = alloc(64 * MIB);
    let s = unique_stream();
    let _ = a;
    let e = {
        use tensoralloc::driver::Driver;
        let ev = sim.event_create(0).unwrap();
        sim::capture::begin_capture(s).unwrap();
        assert!(sim.stream_capturing(s).unwrap());
        sim.event_query(0, ev).unwrap();
        sim::capture::end_capture(s).unwrap_err()
    };
    assert!(
        e.to_string()
            .contains("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
        "{e}"
    );
}

/// Threads begin, end and release two pools (a pool may be released before it ends), allocate,
/// free and empty the cache at once, in any order. Once every pool is ended and released and
/// every block freed, the device holds nothing and no pool remains: a pool released while it
/// is still being allocated to is not forgotten with shards of it left holding memory.
#[test]
fn pools_begun_released_and_ended_by_racing_threads_leave_nothing_behind() {
    let (_sim, a) = alloc(1 << 34);
    let a = Arc::new(a);
    let pools = [POOL, OTHER_POOL];
    let start = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, start) = (a.clone(), start.clone());
            let stream = unique_stream();
            std::thread::spawn(move || {
                start.wait();
                let mut r = (t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut live = Vec::new();
                for _ in 0..20_000 {
                    r ^= r << 13;
                    r ^= r >> 7;
                    r ^= r << 17;
                    let pool = pools[(r >> 8) as usize % 2];
                    match r % 8 {
                        0 => a.begin_allocate_to_pool(pool, None).unwrap(),
                        1 => drop(a.end_allocate_to_pool(pool)),
                        2 => drop(a.release_pool(pool)),
                        3 => a.empty_cache().unwrap(),
                        4 | 5 => live.push(
                            a.malloc(((r >> 20) as usize % 4 + 1) * MIB, stream)
                                .unwrap(),
                        ),
                        _ => {
                            if let Some(p) = live.pop() {
                                a.free(p, None).unwrap();
                            }
                        }
                    }
                }
                for p in live {
                    a.free(p, None).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for pool in pools {
        while a.end_allocate_to_pool(pool).is_ok() {}
        while a.release_pool(pool).is_ok() {}
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().allocated_bytes[0].current, 0);
    assert_eq!(reserved(&a), 0, "segments left behind");
    assert_eq!(a.pool_count(), 0);
}

#[test]
fn a_pool_that_never_allocated_is_forgotten_when_released() {
    let (_sim, a) = alloc(256 * MIB);
    a.begin_allocate_to_pool(POOL, None).unwrap();
    // Released before its end: it stays while it is being allocated to.
    a.release_pool(POOL).unwrap();
    assert_eq!(a.pool_count(), 1);
    a.end_allocate_to_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.pool_count(), 0);
    a.begin_allocate_to_pool(OTHER_POOL, None).unwrap();
    a.end_allocate_to_pool(OTHER_POOL).unwrap();
    a.release_pool(OTHER_POOL).unwrap();
    assert_eq!(a.pool_count(), 0);
}

#[test]
fn stream_handles_with_the_top_bit_set_are_refused_in_and_out_of_pools() {
    // Private shards' table keys count down from the top of the address space: a stream
    // handle there would find a private shard (or give its key to one) and never be served.
    let (_sim, a) = alloc(256 * MIB);
    let s = unique_stream();
    let odd = [usize::MAX, usize::MAX - 1, 1 << 63];
    for &h in &odd {
        let e = a.malloc(MIB, h).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{h:#x}: {e}");
        assert!(e.to_string().contains("not a stream handle"), "{e}");
    }
    a.begin_allocate_to_pool(POOL, None).unwrap();
    let inside = a.malloc(MIB, s).unwrap();
    for &h in &odd {
        let e = a.malloc(MIB, h).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)),
            "{h:#x} in a pool: {e}"
        );
        let e = a.record_stream(inside, h).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)),
            "record_stream {h:#x}: {e}"
        );
    }
    a.end_allocate_to_pool(POOL).unwrap();
    // A bad hint is ignored: the pointer alone decides what is freed.
    a.free(inside, Some(usize::MAX)).unwrap();
    a.release_pool(POOL).unwrap();
    let p = a.malloc(MIB, s).unwrap();
    a.free(p, Some(s)).unwrap();
    assert_eq!(a.stats().allocated_bytes[0].current, 0);
}

#[test]
fn an_oversize_release_on_out_of_memory_skips_a_capturing_stream() {
    // With max_split_size set, running out of memory first returns a cached oversize segment
    // that makes room (PyTorch's release_available_cached_blocks, which it makes while a pool
    // is active too): never on a stream the driver says is capturing, where freeing device
    // memory would invalidate the capture.
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let config = Config::parse("max_split_size_mb:64").unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &config).unwrap();
    let (s, outside) = (unique_stream(), unique_stream());
    a.begin_allocate_to_pool(POOL, only(s)).unwrap();
    let cached = a.malloc(512 * MIB, s).unwrap();
    a.free(cached, Some(s)).unwrap();
    let held = a.malloc(400 * MIB, outside).unwrap();
    // 112 MiB free: 300 MiB needs the cached 512 MiB segment back (too large to split).
    sim::capture::begin_capture(s).unwrap();
    let e = a.malloc(300 * MIB, s).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(
        a.stats().num_device_free,
        0,
        "a segment went back during the capture"
    );
    sim::capture::end_capture(s).expect("the capture stayed valid");
    // The pool still active, no capture: the segment goes back and the request is served.
    let p = a.malloc(300 * MIB, s).unwrap();
    assert_eq!(a.stats().num_device_free, 1);
    a.free(p, Some(s)).unwrap();
    a.free(held, Some(outside)).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
}

#[test]
fn a_snapshot_names_the_pool_of_each_private_segment() {
    let (_sim, a) = alloc(256 * MIB);
    let (s, t) = (unique_stream(), unique_stream());
    let outside = a.malloc(MIB, t).unwrap();
    a.begin_allocate_to_pool(POOL, only(s)).unwrap();
    let inside = a.malloc(MIB, s).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let pool_of = |p: usize| {
        a.snapshot_segments()
            .into_iter()
            .find(|g| g.blocks.iter().any(|b| b.address == p as u64))
            .map(|g| g.segment_pool_id)
    };
    assert_eq!(pool_of(inside), Some(POOL));
    assert_eq!(pool_of(outside), Some((0, 0)));
    a.free(inside, Some(s)).unwrap();
    a.free(outside, Some(t)).unwrap();
    a.release_pool(POOL).unwrap();
}

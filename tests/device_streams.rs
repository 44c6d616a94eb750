//! Streams beyond the device's shards ([`MAX_STREAMS`]): a new stream takes over the shard of
//! a stream that holds no memory in use, never one that does, on the simulated device.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tensoralloc::config::Config;
use tensoralloc::device::{DeviceAllocator, MAX_STREAMS};
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::Error;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const AGG: usize = 0;

fn alloc(capacity: usize) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = SimDriver::shared(1, capacity as u64).unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
    (sim, a)
}

/// `n` stream handles no other test uses (the simulated streams are process-wide).
fn streams(n: usize) -> Vec<usize> {
    static NEXT: AtomicUsize = AtomicUsize::new(0x1000_0000);
    let first = NEXT.fetch_add(n * 0x10, Ordering::Relaxed);
    (0..n).map(|i| first + i * 0x10).collect()
}

fn too_many_streams(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument(m) if m.contains("too many streams"))
}

#[test]
fn a_device_serves_any_number_of_streams_over_time() {
    let (sim, a) = alloc(64 * GIB);
    let all = streams(MAX_STREAMS + 1500);
    for &s in &all {
        let p = a.malloc(4 * KIB, s).unwrap();
        a.free(p, Some(s)).unwrap();
    }
    let st = a.stats();
    assert_eq!(st.allocated_bytes[AGG].current, 0);
    // Each stream cached one small segment; the streams that took over a shard had its
    // segment returned first, so no more than one segment per shard is left.
    assert_eq!(st.num_device_alloc, all.len() as i64);
    assert_eq!(st.num_device_free, 1500);
    assert_eq!(st.segment[AGG].current, MAX_STREAMS as i64);
    assert_eq!(
        st.reserved_bytes[AGG].current,
        (MAX_STREAMS * 2 * MIB) as i64
    );
    assert_eq!(sim.used(0), (MAX_STREAMS * 2 * MIB) as u64);
    // Accumulated and peak statistics count every stream, moved shards included.
    assert_eq!(st.allocation[AGG].allocated, all.len() as i64);
    assert_eq!(st.allocation[AGG].freed, all.len() as i64);
    assert_eq!(st.allocated_bytes[AGG].peak, (4 * KIB) as i64);
    // An early stream comes back: it lost its shard, and takes another one over.
    let p = a.malloc(4 * KIB, all[0]).unwrap();
    assert_eq!(a.stats().allocated_bytes[AGG].current, (4 * KIB) as i64);
    a.free(p, Some(all[0])).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
}

#[test]
fn streams_that_hold_memory_keep_their_shards() {
    let (sim, a) = alloc(64 * GIB);
    let held = streams(MAX_STREAMS);
    let live: Vec<usize> = held
        .iter()
        .map(|&s| a.malloc(4 * KIB, s).unwrap())
        .collect();
    // A busy stream's whole free segments stay cached too.
    let big = a.malloc(3 * MIB, held[1]).unwrap();
    a.free(big, Some(held[1])).unwrap();
    let newcomer = streams(1)[0];
    let e = a.malloc(4 * KIB, newcomer).unwrap_err();
    assert!(too_many_streams(&e), "{e}");
    assert!(e.to_string().contains("4096"), "{e}");
    // The refusal changed nothing.
    assert_eq!(a.stats().allocation[AGG].current, MAX_STREAMS as i64);
    assert_eq!(a.stats().num_device_free, 0);
    assert_eq!(a.stats().segment[AGG].current, MAX_STREAMS as i64 + 1);

    // One stream frees its allocation: its block stays cached on it until a new stream
    // needs its shard, and then goes back to the driver, not to the new stream.
    a.free(live[7], Some(held[7])).unwrap();
    let used = sim.used(0);
    let q = a.malloc(4 * KIB, newcomer).unwrap();
    assert_ne!(q, 0);
    assert_eq!(a.stats().num_device_free, 1);
    assert_eq!(sim.used(0), used, "one segment returned, one taken");
    // The stream that gave its shard up now finds none free.
    let e = a.malloc(4 * KIB, held[7]).unwrap_err();
    assert!(too_many_streams(&e), "{e}");
    // Every other stream still allocates from its own cache.
    let before = a.stats().num_device_alloc;
    let r = a.malloc(4 * KIB, held[8]).unwrap();
    assert_eq!(a.stats().num_device_alloc, before);
    a.free(r, Some(held[8])).unwrap();

    a.free(q, Some(newcomer)).unwrap();
    for (i, (&p, &s)) in live.iter().zip(&held).enumerate() {
        if i != 7 {
            a.free(p, Some(s)).unwrap();
        }
    }
    assert_eq!(a.stats().allocated_bytes[AGG].current, 0);
}

#[test]
fn a_stream_whose_frees_wait_for_other_work_keeps_its_shard_until_that_work_completes() {
    let (_sim, a) = alloc(64 * GIB);
    let held = streams(MAX_STREAMS);
    let side = streams(1)[0];
    let live: Vec<usize> = held
        .iter()
        .map(|&s| a.malloc(4 * KIB, s).unwrap())
        .collect();
    // Stream 0's allocation is used by work queued on `side`, which has not completed.
    sim::hold_stream(side);
    a.record_stream(live[0], side).unwrap();
    a.free(live[0], Some(held[0])).unwrap();
    let newcomer = streams(1)[0];
    let e = a.malloc(4 * KIB, newcomer).unwrap_err();
    assert!(too_many_streams(&e), "{e}");
    // Once that work completes, stream 0 holds nothing the GPU uses and gives its shard up.
    sim::release_stream(side);
    let q = a.malloc(4 * KIB, newcomer).unwrap();
    a.free(q, Some(newcomer)).unwrap();
    for (&p, &s) in live.iter().zip(&held).skip(1) {
        a.free(p, Some(s)).unwrap();
    }
    assert_eq!(a.stats().allocated_bytes[AGG].current, 0);
}

#[test]
fn the_vacated_key_is_no_stream() {
    let (_sim, a) = alloc(GIB);
    let e = a.malloc(4 * KIB, 1 << (usize::BITS - 1)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(a.stats().allocation[AGG].allocated, 0);
}

/// Threads that each use fresh streams while shards move between streams: no two live
/// allocations ever overlap, and every byte is accounted for at the end.
#[test]
fn shards_move_between_streams_safely_under_threads() {
    let (sim, a) = alloc(256 * GIB);
    let a = Arc::new(a);
    // Fill the table with streams that hold nothing, so that from now on every new stream
    // takes a shard over.
    for s in streams(MAX_STREAMS) {
        let p = a.malloc(512, s).unwrap();
        a.free(p, Some(s)).unwrap();
    }
    let live: Arc<Mutex<BTreeMap<usize, usize>>> = Arc::default();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (a, live) = (Arc::clone(&a), Arc::clone(&live));
            let mine = streams(600);
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for (i, &s) in mine.iter().enumerate() {
                    // A few streams are used again later, after their shard may have moved.
                    let s = if i % 7 == 6 { mine[i / 2] } else { s };
                    let size = [512, 3 * KIB, 300 * KIB, 5 * MIB][(i + t) % 4];
                    let p = a.malloc(size, s).unwrap();
                    {
                        let mut live = live.lock().unwrap();
                        if let Some((&q, &qs)) = live.range(..p + size).next_back() {
                            assert!(q + qs <= p, "{p:#x} overlaps {q:#x}");
                        }
                        live.insert(p, size);
                    }
                    held.push((p, s));
                    if held.len() > 3 {
                        let (p, s) = held.remove(0);
                        live.lock().unwrap().remove(&p);
                        a.free(p, Some(s)).unwrap();
                    }
                }
                for (p, s) in held {
                    live.lock().unwrap().remove(&p);
                    a.free(p, Some(s)).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let st = a.stats();
    assert_eq!(st.allocated_bytes[AGG].current, 0);
    assert_eq!(st.allocation[AGG].allocated, st.allocation[AGG].freed);
    assert_eq!(sim.used(0) as i64, st.reserved_bytes[AGG].current);
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
}

/// Under expandable segments a stream's free pages stay mapped until the cache is emptied
/// (unmapping them would wait for its stream, which may be gone): its shard moves after that.
#[test]
fn streams_with_mapped_pages_give_their_shards_up_after_empty_cache() {
    let config = Config::parse("expandable_segments:True").unwrap();
    // Room for a page of every stream, and address space for every stream's range (each
    // 1 1/8 of the device): no growth runs out of either, which would empty the cache.
    let sim = SimDriver::shared(1, 10 * GIB as u64).unwrap();
    let a = DeviceAllocator::new(sim.clone(), 0, &config).unwrap();
    for s in streams(MAX_STREAMS) {
        let p = a.malloc(4 * KIB, s).unwrap();
        a.free(p, Some(s)).unwrap();
    }
    let newcomer = streams(1)[0];
    let e = a.malloc(4 * KIB, newcomer).unwrap_err();
    assert!(too_many_streams(&e), "{e}");
    assert!(e.to_string().contains("empty_cache"), "{e}");
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
    let p = a.malloc(4 * KIB, newcomer).unwrap();
    a.free(p, Some(newcomer)).unwrap();
    assert_eq!(a.stats().allocated_bytes[AGG].current, 0);
}

/// New streams take shards that emptying the cache left idle while other threads allocate,
/// free and empty the cache: no memory is handed out twice, and statistics stay exact.
#[test]
fn idle_shards_move_to_new_streams_safely_under_threads() {
    let (sim, a) = alloc(256 * GIB);
    let a = Arc::new(a);
    let live: Arc<Mutex<BTreeMap<usize, usize>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let emptier = {
        let (a, stop) = (Arc::clone(&a), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                a.empty_cache().unwrap();
                n += 1;
                std::thread::yield_now();
            }
            n
        })
    };
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let (a, live) = (Arc::clone(&a), Arc::clone(&live));
            let mine = streams(400);
            std::thread::spawn(move || {
                for (i, &s) in mine.iter().enumerate() {
                    // Some streams come back after their shard may have moved.
                    let s = if i % 5 == 4 { mine[i / 3] } else { s };
                    let mut held = Vec::new();
                    for k in 0..4 {
                        let size = [512, 3 * KIB, 300 * KIB, 5 * MIB][(i + k + t) % 4];
                        let p = a.malloc(size, s).unwrap();
                        let mut live = live.lock().unwrap();
                        if let Some((&q, &qs)) = live.range(..p + size).next_back() {
                            assert!(q + qs <= p, "{p:#x} overlaps {q:#x}");
                        }
                        live.insert(p, size);
                        held.push(p);
                    }
                    for p in held {
                        live.lock().unwrap().remove(&p);
                        a.free(p, Some(s)).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(emptier.join().unwrap() > 0);
    let st = a.stats();
    assert_eq!(st.allocated_bytes[AGG].current, 0);
    assert_eq!(st.allocation[AGG].allocated, 3 * 400 * 4);
    assert_eq!(st.allocation[AGG].allocated, st.allocation[AGG].freed);
    assert_eq!(sim.used(0) as i64, st.reserved_bytes[AGG].current);
    a.empty_cache().unwrap();
    assert_eq!(sim.used(0), 0);
    assert_eq!(a.stats().reserved_bytes[AGG].current, 0);
}

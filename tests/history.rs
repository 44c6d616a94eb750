//! Memory history and snapshots: what is recorded, the snapshot layout, and the round trip
//! record -> snapshot -> replay.

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::history::{self, Action};
use tensoralloc::device::stats::DeviceStats;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::replay::{self, snapshot, Report, Trace, UNLIMITED_MEMORY};

const MIB: usize = 1 << 20;

fn allocator() -> DeviceAllocator {
    let sim: Arc<SimDriver> = SimDriver::shared(1, 4 << 30).unwrap();
    DeviceAllocator::new(sim, 0, &Config::default()).unwrap()
}

/// A stream handle no other test uses (the simulated streams are process-wide).
fn unique_stream() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0x9000);
    NEXT.fetch_add(0x10, Ordering::Relaxed)
}

fn snapshot_bytes(a: &DeviceAllocator) -> Vec<u8> {
    let mut out = Vec::new();
    history::write_snapshot(&mut out, std::iter::once(a), &Config::default(), "").unwrap();
    out
}

/// A mixed workload: small and large blocks, splits and merges, a block used on another
/// stream, and (with `flush`) a cache flush.
fn workload(a: &DeviceAllocator, stream: usize, other: usize, flush: bool) {
    let mut live = Vec::new();
    for i in 0..200usize {
        let size = match i % 5 {
            0 => 700,
            1 => 300 * 1024,
            2 => 3 * MIB + i * 4096,
            3 => 12 * MIB,
            _ => 64 * MIB + (i % 7) * MIB,
        };
        live.push(a.malloc(size, stream).unwrap());
        if i % 3 == 2 {
            let p = live.remove(i % live.len());
            a.free(p, Some(stream)).unwrap();
        }
    }
    let shared = a.malloc(8 * MIB, stream).unwrap();
    sim::hold_stream(other);
    a.record_stream(shared, other).unwrap();
    a.free(shared, Some(stream)).unwrap();
    sim::release_stream(other);
    for p in live.drain(..).step_by(2) {
        a.free(p, Some(stream)).unwrap();
    }
    if flush {
        a.empty_cache().unwrap();
    }
    for i in 0..50 {
        live.push(a.malloc(MIB + i * 8192, stream).unwrap());
    }
}

/// Replays `trace` under the default configuration and checks that the replayed reserved
/// bytes equal the recorded ones (initial segments plus segment events) after every
/// allocation and free. (The recording's own `segment_alloc` comes just before its `alloc`;
/// a trace with cache flushes cannot be followed this way, since replay leaves releasing
/// segments to the replayed allocator.)
fn replay_following_the_recording(trace: &Trace) -> Report {
    let options = replay::Options {
        memory: UNLIMITED_MEMORY,
        series: true,
    };
    let report = replay::run_with(trace, &Config::default(), &options, &mut |_| {}).unwrap();
    let mut recorded = trace.initial_reserved();
    for (e, sample) in trace.events.iter().zip(&report.series) {
        match e.action {
            Action::SegmentAlloc => recorded += e.size,
            Action::SegmentFree => recorded -= e.size,
            Action::Alloc | Action::FreeRequested | Action::FreeCompleted => assert_eq!(
                sample.reserved_bytes, recorded,
                "after event {}: {e:?}",
                sample.index
            ),
            _ => {}
        }
    }
    report
}

/// The replay peaked where the recorded allocator did.
fn assert_same_peaks(report: &Report, recorded: &DeviceStats) {
    assert_eq!(
        report.peak_reserved_bytes,
        recorded.reserved_bytes[0].peak as u64
    );
    assert_eq!(
        report.peak_allocated_bytes,
        recorded.allocated_bytes[0].peak as u64
    );
}

#[test]
fn nothing_is_recorded_until_recording_starts() {
    let a = allocator();
    let p = a.malloc(MIB, 0).unwrap();
    a.free(p, None).unwrap();
    assert!(a.history().entries().is_empty());
}

#[test]
fn an_allocation_and_its_free_record_pytorchs_events() {
    let a = allocator();
    let s = unique_stream();
    a.history().set(true, 100).unwrap();
    let p = a.malloc(5000, s).unwrap();
    a.free(p, Some(s)).unwrap();
    let e = a.history().entries();
    let actions: Vec<Action> = e.iter().map(|e| e.action).collect();
    assert_eq!(
        actions,
        [
            Action::SegmentAlloc,
            Action::Alloc,
            Action::FreeRequested,
            Action::FreeCompleted
        ]
    );
    assert_eq!((e[0].size, e[0].stream), (2 << 20, s as u64));
    assert_eq!((e[1].addr, e[1].size), (p as u64, 5000));
    assert_eq!((e[3].addr, e[3].size), (p as u64, 5000));
}

#[test]
fn a_block_used_on_another_stream_completes_its_free_when_that_stream_finishes() {
    let a = allocator();
    let (s, other) = (unique_stream(), unique_stream());
    let p = a.malloc(4 * MIB, s).unwrap();
    a.history().set(true, 100).unwrap();
    sim::hold_stream(other);
    a.record_stream(p, other).unwrap();
    a.free(p, Some(s)).unwrap();
    let pending: Vec<Action> = a.history().entries().iter().map(|e| e.action).collect();
    assert_eq!(pending, [Action::FreeRequested]);
    let bytes = snapshot_bytes(&a);
    sim::release_stream(other);
    let _ = a.malloc(512, s).unwrap(); // polls the events
    assert!(a
        .history()
        .entries()
        .iter()
        .any(|e| e.action == Action::FreeCompleted && e.addr == p as u64));
    // While it waited, the snapshot showed the block as pending free.
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("active_pending_free"));
}

#[test]
fn the_ring_keeps_only_the_last_max_entries_events() {
    let a = allocator();
    a.history().set(true, 10).unwrap();
    for _ in 0..20 {
        let p = a.malloc(4096, 0).unwrap();
        a.free(p, Some(0)).unwrap();
    }
    // One segment_alloc, then 20 times alloc, free_requested, free_completed: 61 events.
    let e = a.history().entries();
    assert_eq!(e.len(), 10);
    assert_eq!(e[0].action, Action::FreeCompleted);
    assert_eq!(e.iter().filter(|e| e.action == Action::Alloc).count(), 3);
    assert_eq!(e[9].action, Action::FreeCompleted);
}

#[test]
fn max_entries_out_of_range_is_refused() {
    let a = allocator();
    assert!(a.history().set(true, 0).is_err());
    assert!(a.history().set(true, history::MAX_ENTRIES + 1).is_err());
    assert!(!a.history().on());
}

#[test]
fn stopping_keeps_the_recorded_events_and_records_no_more() {
    let a = allocator();
    a.history().set(true, 100).unwrap();
    let p = a.malloc(4096, 0).unwrap();
    a.history().set(false, 0).unwrap();
    a.free(p, Some(0)).unwrap();
    let e = a.history().entries();
    assert_eq!(e.last().unwrap().action, Action::Alloc);
}

#[test]
fn a_snapshot_lists_segments_with_their_blocks_and_states() {
    let a = allocator();
    let s = unique_stream();
    let p = a.malloc(3 * MIB, s).unwrap();
    let q = a.malloc(1000, s).unwrap();
    let trace = snapshot::parse(&snapshot_bytes(&a), 0).unwrap();
    // No events were recorded, so the state at the start is the state now.
    assert!(trace.events.is_empty());
    assert_eq!(trace.initial.len(), 2);
    let large = trace.initial.iter().find(|g| !g.small).unwrap();
    assert_eq!((large.size, large.stream), (20 << 20, s as u64));
    assert_eq!(large.live.len(), 1);
    assert_eq!(
        (large.live[0].addr, large.live[0].size),
        (p as u64, 3 << 20)
    );
    let small = trace.initial.iter().find(|g| g.small).unwrap();
    assert_eq!(small.size, 2 << 20);
    assert_eq!((small.live[0].addr, small.live[0].size), (q as u64, 1024));
}

#[test]
fn a_recorded_workload_replays_to_the_same_peaks() {
    let a = allocator();
    let (s, other) = (unique_stream(), unique_stream());
    a.history().set(true, 1 << 20).unwrap();
    workload(&a, s, other, true);
    let stats = a.stats();
    let trace = snapshot::parse(&snapshot_bytes(&a), 0).unwrap();
    assert!(trace.initial.is_empty());
    assert!(trace.count(Action::SegmentFree) > 0);
    let report = replay::run(&trace, &Config::default(), UNLIMITED_MEMORY).unwrap();
    assert_same_peaks(&report, &stats);
}

#[test]
fn recording_started_after_warm_up_replays_from_the_state_at_its_start() {
    let a = allocator();
    let (s, other) = (unique_stream(), unique_stream());
    workload(&a, s, other, false);
    let held: Vec<usize> = (0..30)
        .map(|i| a.malloc(2 * MIB + i * 65536, s).unwrap())
        .collect();
    a.reset_peak_stats();
    let at_start = a.stats();
    a.history().set(true, 1 << 20).unwrap();
    for p in held.iter().step_by(3) {
        a.free(*p, Some(s)).unwrap();
    }
    workload(&a, s, other, false);
    let stats = a.stats();
    let trace = snapshot::parse(&snapshot_bytes(&a), 0).unwrap();
    assert!(!trace.initial.is_empty());
    assert_eq!(
        trace.initial_reserved(),
        at_start.reserved_bytes[0].current as u64
    );
    let report = replay_following_the_recording(&trace);
    assert_eq!(
        report.initial_reserved_bytes,
        at_start.reserved_bytes[0].current as u64
    );
    assert_same_peaks(&report, &stats);
}

#[test]
fn a_gzip_snapshot_file_replays_like_the_plain_one() {
    let a = allocator();
    let (s, other) = (unique_stream(), unique_stream());
    a.history().set(true, 1 << 20).unwrap();
    workload(&a, s, other, true);
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let (plain, gz) = (dir.join("history.pickle"), dir.join("history.pickle.gz"));
    history::dump_snapshot(&plain, std::iter::once(&a), &Config::default()).unwrap();
    history::dump_snapshot(&gz, std::iter::once(&a), &Config::default()).unwrap();
    assert_eq!(std::fs::read(&gz).unwrap()[..2], [0x1f, 0x8b]);
    let (p, g) = (
        snapshot::load(&plain, 0).unwrap(),
        snapshot::load(&gz, 0).unwrap(),
    );
    assert_eq!(p, g);
    assert!(!p.events.is_empty());
}

#[test]
fn an_out_of_memory_event_carries_the_free_device_bytes_as_pytorchs_does() {
    let a = allocator();
    let s = unique_stream();
    a.history().set(true, 100).unwrap();
    let p = a.malloc(3 << 30, s).unwrap();
    assert!(a.malloc(2 << 30, s).is_err());
    let oom = *a.history().entries().last().unwrap();
    assert_eq!(oom.action, Action::Oom);
    assert_eq!(
        (oom.addr, oom.size),
        (1 << 30, 2 << 30),
        "1 GiB of 4 was free"
    );
    // In the snapshot the free bytes are `device_free`, and there is no `addr` (PyTorch's
    // memory viewer reads `device_free` of every `oom` event).
    let value: serde_pickle::Value =
        serde_pickle::from_slice(&snapshot_bytes(&a), Default::default()).unwrap();
    let text = format!("{value:?}");
    let at = text.find("\"oom\"").expect("an oom event");
    let event = &text[at..text[at..].find('}').map_or(text.len(), |e| at + e)];
    assert!(
        event.contains("device_free") && event.contains("1073741824"),
        "{event}"
    );
    assert!(!event.contains("\"addr\""), "{event}");
    a.free(p, Some(s)).unwrap();
}

#[test]
fn a_dump_replaces_a_file_whole_writes_through_links_and_leaves_no_temporary_behind() {
    let a = allocator();
    let s = unique_stream();
    let p = a.malloc(3 * MIB, s).unwrap();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dump-files");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dump = |path: &std::path::Path| {
        history::dump_snapshot(path, std::iter::once(&a), &Config::default())
    };
    let file = dir.join("snap.pickle");
    std::fs::write(&file, b"an older file").unwrap();
    dump(&file).unwrap();
    let trace = snapshot::parse(&std::fs::read(&file).unwrap(), 0).unwrap();
    assert_eq!(trace.initial.len(), 1);
    // Through a link: the link stays, its file gets the snapshot.
    let link = dir.join("link.pickle");
    std::os::unix::fs::symlink(&file, &link).unwrap();
    std::fs::write(&file, b"older again").unwrap();
    dump(&link).unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert!(snapshot::parse(&std::fs::read(&file).unwrap(), 0).is_ok());
    // A directory cannot be replaced: an error, and nothing is left beside it.
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("x"), b"x").unwrap();
    let e = dump(&sub).unwrap_err();
    assert!(e.to_string().contains("cannot write snapshot"), "{e}");
    // A device is written in place, not replaced.
    dump(std::path::Path::new("/dev/null")).unwrap();
    assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["link.pickle", "snap.pickle", "sub"]);
    a.free(p, Some(s)).unwrap();
}

#[test]
fn an_expandable_trace_walks_back_its_mappings_to_the_state_at_its_start() {
    // Expandable segments show as their mapped ranges; segment_map and segment_unmap events
    // change them. Recorded from the start, the trace starts from an empty allocator.
    let sim: Arc<SimDriver> = SimDriver::shared(1, 4 << 30).unwrap();
    let config = Config::parse("expandable_segments:True").unwrap();
    let a = DeviceAllocator::new(sim, 0, &config).unwrap();
    let (s, other) = (unique_stream(), unique_stream());
    a.history().set(true, 1 << 20).unwrap();
    workload(&a, s, other, false);
    let stats = a.stats();
    let trace = snapshot::parse(&snapshot_bytes(&a), 0).unwrap();
    assert!(trace.count(Action::SegmentMap) > 0);
    assert!(trace.initial.is_empty(), "{:?}", trace.initial);
    assert_eq!(
        trace.recorded_peak_reserved(),
        stats.reserved_bytes[0].peak as u64
    );
    let report = replay::run(&trace, &config, UNLIMITED_MEMORY).unwrap();
    assert_same_peaks(&report, &stats);
    // Recording started after warm-up: the mapped ranges at its start are recreated.
    a.reset_peak_stats();
    let at_start = a.stats().reserved_bytes[0].current as u64;
    a.history().set(true, 1 << 20).unwrap();
    workload(&a, s, other, false);
    let trace = snapshot::parse(&snapshot_bytes(&a), 0).unwrap();
    assert_eq!(trace.initial_reserved(), at_start);
    assert_eq!(
        trace.recorded_peak_reserved(),
        a.stats().reserved_bytes[0].peak as u64
    );
}

#[test]
fn threads_sharing_a_stream_record_its_events_in_the_order_they_happened() {
    // Cached pairs on one stream from several threads: each free is recorded before its
    // block can go to another thread's allocation, and times never go back.
    let a = Arc::new(allocator());
    let s = unique_stream();
    a.history().set(true, 1 << 20).unwrap();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..20_000usize {
                    let p = a.malloc(512 + (i + t) % 3 * 512, s).unwrap();
                    a.free(p, Some(s)).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let entries = a.history().entries();
    let allocs = entries.iter().filter(|e| e.action == Action::Alloc).count();
    assert_eq!(allocs, 4 * 20_000);
    let mut live = std::collections::HashSet::new();
    for (i, e) in entries.iter().enumerate() {
        match e.action {
            Action::Alloc => assert!(live.insert(e.addr), "event {i}: {e:?} while live"),
            Action::FreeCompleted => assert!(live.remove(&e.addr), "event {i}: {e:?}"),
            _ => {}
        }
    }
    assert!(entries.windows(2).all(|w| w[0].time_us <= w[1].time_us));
}

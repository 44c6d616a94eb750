//! Stream use of pinned blocks: `record_event`, deferral of freed blocks until the streams'
//! events complete, event pooling, and foreign pointers.
//!
//! Simulated streams are process-wide, so every test uses its own stream numbers.

mod host_support;

use host_support::setup;

use std::sync::atomic::Ordering;

use tensoralloc::driver::sim::{self, SimDriver};

fn events_created(sim: &SimDriver) -> u64 {
    sim.counters.events_created.load(Ordering::Relaxed)
}

#[test]
fn a_block_used_by_a_held_stream_is_not_reused_until_the_stream_finishes() {
    for (register, stream) in [(false, 0x1001), (true, 0x1002)] {
        let (_sim, host) = setup(register);
        let a = host.malloc(4096).unwrap();
        assert!(host.record_event(a.ptr, Some(a.ctx), stream));
        sim::hold_stream(stream);
        host.free(a.ptr, Some(a.ctx)).unwrap();
        let s = host.stats();
        assert_eq!(s.allocations.current, 0);
        assert_eq!(s.active_blocks.current, 1);
        assert_eq!(s.cached_blocks, 0);
        // While the stream runs, the same request gets a different block.
        let b = host.malloc(4096).unwrap();
        assert_ne!(b.ptr, a.ptr);
        host.free(b.ptr, Some(b.ctx)).unwrap();
        sim::release_stream(stream);
        // The next call polls the event and the block is free again.
        let c = host.malloc(4096).unwrap();
        let d = host.malloc(4096).unwrap();
        assert!([c.ptr, d.ptr].contains(&a.ptr));
        assert_eq!(host.stats().driver_allocations, 2);
        assert_eq!(host.stats().active_blocks.current, 2);
        host.free(c.ptr, None).unwrap();
        host.free(d.ptr, None).unwrap();
    }
}

#[test]
fn free_with_a_held_stream_returns_without_waiting() {
    let (sim, host) = setup(false);
    let stream = 0x1101;
    let a = host.malloc(4096).unwrap();
    host.record_event(a.ptr, None, stream);
    sim::hold_stream(stream);
    host.free(a.ptr, None).unwrap();
    host.malloc(64)
        .map(|b| host.free(b.ptr, None))
        .unwrap()
        .unwrap();
    // Nobody waited on the event: it is still pending.
    assert_eq!(sim.counters.event_syncs.load(Ordering::Relaxed), 0);
    assert_eq!(host.stats().active_blocks.current, 1);
    sim::release_stream(stream);
}

#[test]
fn a_block_waits_for_every_stream_that_used_it() {
    let (_sim, host) = setup(false);
    let (s1, s2) = (0x1201, 0x1202);
    let a = host.malloc(4096).unwrap();
    assert!(host.record_event(a.ptr, Some(a.ctx), s1));
    assert!(host.record_event(a.ptr, Some(a.ctx), s2));
    sim::hold_stream(s1);
    sim::hold_stream(s2);
    host.free(a.ptr, Some(a.ctx)).unwrap();
    sim::release_stream(s1);
    host.empty_cache().unwrap();
    assert_eq!(
        host.stats().reserved_bytes.current,
        4096,
        "s2 still runs: the block stays"
    );
    sim::release_stream(s2);
    host.empty_cache().unwrap();
    assert_eq!(host.stats().reserved_bytes.current, 0);
    assert_eq!(host.stats().active_blocks.current, 0);
}

#[test]
fn empty_cache_keeps_blocks_whose_streams_still_run() {
    let (sim, host) = setup(true);
    let stream = 0x1301;
    let a = host.malloc(1 << 16).unwrap();
    host.record_event(a.ptr, None, stream);
    sim::hold_stream(stream);
    host.free(a.ptr, None).unwrap();
    host.empty_cache().unwrap();
    assert_eq!(sim.counters.host_unregister.load(Ordering::Relaxed), 0);
    sim::release_stream(stream);
    host.empty_cache().unwrap();
    assert_eq!(sim.counters.host_unregister.load(Ordering::Relaxed), 1);
}

#[test]
fn events_are_pooled_and_reused() {
    let (sim, host) = setup(false);
    let stream = 0x1401;
    for _ in 0..50 {
        let a = host.malloc(4096).unwrap();
        host.record_event(a.ptr, Some(a.ctx), stream);
        host.free(a.ptr, Some(a.ctx)).unwrap();
    }
    assert_eq!(events_created(&sim), 1);
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 50);
    assert_eq!(sim.counters.events_destroyed.load(Ordering::Relaxed), 0);
}

#[test]
fn recording_the_same_stream_twice_records_one_event() {
    let (sim, host) = setup(false);
    let stream = 0x1501;
    let a = host.malloc(4096).unwrap();
    assert!(host.record_event(a.ptr, None, stream));
    assert!(host.record_event(a.ptr, None, stream));
    host.free(a.ptr, None).unwrap();
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 1);
}

#[test]
fn a_block_without_recorded_streams_needs_no_event() {
    let (sim, host) = setup(false);
    let a = host.malloc(4096).unwrap();
    host.free(a.ptr, None).unwrap();
    assert_eq!(events_created(&sim), 0);
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 0);
}

#[test]
fn a_reused_block_forgets_the_streams_of_its_previous_use() {
    let (sim, host) = setup(false);
    let stream = 0x1601;
    let a = host.malloc(4096).unwrap();
    host.record_event(a.ptr, None, stream);
    host.free(a.ptr, None).unwrap();
    let b = host.malloc(4096).unwrap();
    assert_eq!(b.ptr, a.ptr);
    host.free(b.ptr, None).unwrap();
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 1);
}

#[test]
fn record_event_on_a_foreign_pointer_returns_false_and_changes_nothing() {
    let (sim, host) = setup(false);
    let a = host.malloc(4096).unwrap();
    let before = host.stats();
    let mut local = [0u8; 64];
    assert!(!host.record_event(local.as_mut_ptr() as usize, None, 0x1701));
    assert!(!host.record_event(0, None, 0x1701));
    // Inside a block is not a block.
    assert!(!host.record_event(a.ptr + 64, None, 0x1701));
    // A context that is not ours does not fool the lookup.
    assert!(!host.record_event(local.as_mut_ptr() as usize, Some(a.ctx), 0x1701));
    assert!(!host.record_event(local.as_mut_ptr() as usize, Some(usize::MAX), 0x1701));
    assert_eq!(host.stats(), before);
    host.free(a.ptr, None).unwrap();
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 0);
}

#[test]
fn record_event_finds_the_block_by_address_when_the_context_is_wrong() {
    let (sim, host) = setup(false);
    let a = host.malloc(4096).unwrap();
    let b = host.malloc(4096).unwrap();
    assert!(host.record_event(a.ptr, Some(b.ctx), 0x1801));
    assert!(host.record_event(a.ptr, Some(0xdead_beef), 0x1801));
    host.free(a.ptr, None).unwrap();
    host.free(b.ptr, None).unwrap();
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 1);
}

#[test]
fn record_event_on_a_freed_block_returns_false() {
    let (sim, host) = setup(false);
    let a = host.malloc(4096).unwrap();
    host.free(a.ptr, None).unwrap();
    assert!(!host.record_event(a.ptr, Some(a.ctx), 0x1901));
    let b = host.malloc(4096).unwrap();
    host.free(b.ptr, None).unwrap();
    assert_eq!(sim.counters.event_records.load(Ordering::Relaxed), 0);
}

#[test]
fn pending_blocks_are_reclaimed_by_calls_on_other_threads() {
    let (_sim, host) = setup(false);
    let stream = 0x1a01;
    let a = host.malloc(4096).unwrap();
    host.record_event(a.ptr, None, stream);
    sim::hold_stream(stream);
    host.free(a.ptr, None).unwrap();
    sim::release_stream(stream);
    std::thread::scope(|s| {
        s.spawn(|| {
            let b = host.malloc(4096).unwrap();
            assert_eq!(b.ptr, a.ptr);
            host.free(b.ptr, None).unwrap();
        });
    });
    assert_eq!(host.stats().driver_allocations, 1);
}

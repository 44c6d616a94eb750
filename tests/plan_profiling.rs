//! The profiling allocator: records, plans, validates and serves iterations from one blob,
//! and stays correct (falling back, counted) when an iteration strays from its plan.

use std::collections::HashMap;

use proptest::prelude::*;
use tensoralloc::plan::memory::HostMemory;
use tensoralloc::plan::profiling::{ProfilePlan, Profiler};
use tensoralloc::plan::Algorithm;
use tensoralloc::Error;

/// One step of an iteration: allocate `size` bytes under a name, or free a name.
#[derive(Debug, Clone, Copy)]
enum Step {
    Malloc(usize, u64),
    Free(usize),
}
use Step::{Free, Malloc};

fn profiler() -> Profiler {
    Profiler::new(Box::new(HostMemory), 64).unwrap()
}

/// Runs `steps`, filling each allocation with its name's byte and checking every live
/// allocation still holds its pattern before it is freed; returns the addresses in order.
fn run(p: &mut Profiler, steps: &[Step]) -> Vec<usize> {
    let mut live: HashMap<usize, (usize, u64)> = HashMap::new();
    let mut addresses = Vec::new();
    for &step in steps {
        match step {
            Malloc(name, size) => {
                let addr = p.malloc(size).unwrap();
                if size > 0 {
                    // SAFETY: the allocator returned `size` writable bytes at `addr`.
                    unsafe { std::ptr::write_bytes(addr as *mut u8, name as u8, size as usize) };
                }
                addresses.push(addr);
                live.insert(name, (addr, size));
            }
            Free(name) => {
                let (addr, size) = live.remove(&name).unwrap();
                // SAFETY: `addr` holds `size` bytes this test wrote and has not freed.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, size as usize) };
                assert!(
                    bytes.iter().all(|&b| b == name as u8),
                    "allocation {name} was overwritten"
                );
                p.free(addr).unwrap();
            }
        }
    }
    for (name, (addr, _)) in live {
        let _ = name;
        p.free(addr).unwrap();
    }
    addresses
}

const ITERATION: [Step; 8] = [
    Malloc(1, 1000),
    Malloc(2, 4000),
    Free(1),
    Malloc(3, 1000),
    Malloc(4, 64),
    Free(3),
    Free(2),
    Free(4),
];

/// [`ITERATION`] with allocation 1 freed only after allocation 3 is made.
const LATE_FREE: [Step; 8] = [
    Malloc(1, 1000),
    Malloc(2, 4000),
    Malloc(3, 1000),
    Free(1),
    Malloc(4, 64),
    Free(3),
    Free(2),
    Free(4),
];

fn planned() -> Profiler {
    let mut p = profiler();
    p.begin_recording().unwrap();
    run(&mut p, &ITERATION);
    p.end_recording().unwrap();
    p.formulate(Algorithm::Best).unwrap();
    p
}

#[test]
fn recording_notes_sizes_and_when_each_allocation_was_freed() {
    let p = planned();
    let plan = p.plan().unwrap();
    assert_eq!(plan.sizes, vec![1000, 4000, 1000, 64]);
    // Allocation 0 was freed after 2 allocations, 1 after all 4, 2 and 3 after all 4.
    assert_eq!(plan.frees, vec![Some(2), Some(4), Some(4), Some(4)]);
}

#[test]
fn the_plan_reuses_the_bytes_of_freed_allocations() {
    let p = planned();
    let plan = p.plan().unwrap();
    assert_eq!(
        plan.offsets[0], plan.offsets[2],
        "the third allocation takes the first one's bytes"
    );
    assert_eq!(plan.blob_size, 1024 + 4032 + 64);
}

#[test]
fn the_same_iteration_validates() {
    let mut p = planned();
    p.begin_validating().unwrap();
    run(&mut p, &ITERATION);
    assert!(p.end_validating().unwrap());
}

#[test]
fn another_size_fails_validation() {
    let mut p = planned();
    p.begin_validating().unwrap();
    let mut changed = ITERATION;
    changed[3] = Malloc(3, 1001);
    run(&mut p, &changed);
    assert!(!p.end_validating().unwrap());
}

#[test]
fn a_free_at_another_point_fails_validation() {
    let mut p = planned();
    p.begin_validating().unwrap();
    run(&mut p, &LATE_FREE);
    assert!(!p.end_validating().unwrap());
}

#[test]
fn serving_the_planned_iteration_takes_everything_from_the_blob() {
    let mut p = planned();
    for _ in 0..3 {
        p.begin_serving().unwrap();
        let addrs = run(&mut p, &ITERATION);
        p.end_serving().unwrap();
        assert_eq!(addrs[0], addrs[2], "planned reuse");
    }
    let s = p.stats();
    assert_eq!(s.served_from_blob, 12);
    assert_eq!(s.mismatches, 0);
    assert_eq!(s.lifetime_mismatches, 0);
    assert_eq!(s.live_allocations, 0);
}

#[test]
fn an_extra_allocation_is_served_by_the_ordinary_allocator_and_counted() {
    let mut p = planned();
    p.begin_serving().unwrap();
    let changed = [
        Malloc(1, 1000),
        Malloc(9, 3),
        Malloc(2, 4000),
        Free(1),
        Malloc(3, 1000),
        Free(3),
        Free(2),
        Free(9),
    ];
    run(&mut p, &changed);
    p.end_serving().unwrap();
    assert!(p.stats().mismatches >= 1);
}

#[test]
fn a_late_free_does_not_let_a_planned_allocation_overlap_a_live_one() {
    // Allocation 1 is freed after allocation 3 is made, but 3 is planned into 1's bytes:
    // it must come from elsewhere while 1 still holds them.
    let mut p = planned();
    p.begin_serving().unwrap();
    let addrs = run(&mut p, &LATE_FREE);
    p.end_serving().unwrap();
    assert_ne!(addrs[0], addrs[2]);
    let s = p.stats();
    assert_eq!(s.mismatches, 1);
    assert!(s.lifetime_mismatches >= 1);
}

#[test]
fn allocations_never_freed_while_recording_are_left_out_of_the_blob() {
    let mut p = profiler();
    p.begin_recording().unwrap();
    let kept = p.malloc(100).unwrap();
    let gone = p.malloc(100).unwrap();
    p.free(gone).unwrap();
    p.end_recording().unwrap();
    p.free(kept).unwrap();
    p.formulate(Algorithm::Best).unwrap();
    assert!(!p.plan().unwrap().planned(0));
    assert!(p.plan().unwrap().planned(1));
    p.begin_serving().unwrap();
    let a = p.malloc(100).unwrap();
    let b = p.malloc(100).unwrap();
    p.free(b).unwrap();
    p.end_serving().unwrap();
    p.free(a).unwrap();
    assert_eq!(p.stats().served_unplanned, 1);
    assert_eq!(p.stats().served_from_blob, 1);
}

#[test]
fn a_plan_survives_a_json_round_trip_and_serves_another_allocator() {
    let p = planned();
    let text = p.plan().unwrap().to_json();
    let loaded = ProfilePlan::from_json(&text).unwrap();
    assert_eq!(&loaded, p.plan().unwrap());
    let mut q = profiler();
    q.set_plan(loaded).unwrap();
    q.begin_serving().unwrap();
    run(&mut q, &ITERATION);
    q.end_serving().unwrap();
    assert_eq!(q.stats().served_from_blob, 4);
}

#[test]
fn a_loaded_plan_with_overlapping_offsets_is_refused() {
    let mut plan = planned().plan().unwrap().clone();
    plan.offsets[1] = plan.offsets[0];
    let err = ProfilePlan::from_json(&plan.to_json()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(ProfilePlan::from_json("{}").is_err());
}

#[test]
fn freeing_an_unknown_pointer_is_an_error_that_changes_nothing() {
    let mut p = planned();
    let x = 0u64;
    assert!(matches!(
        p.free(&x as *const u64 as usize),
        Err(Error::UnknownPointer(_))
    ));
    assert_eq!(p.stats().live_allocations, 0);
}

#[test]
fn phases_must_be_begun_before_they_end_and_not_nested() {
    let mut p = profiler();
    assert!(p.end_recording().is_err());
    assert!(p.begin_serving().is_err(), "no plan yet");
    assert!(p.formulate(Algorithm::Best).is_err(), "nothing recorded");
    p.begin_recording().unwrap();
    assert!(p.begin_validating().is_err());
    assert!(p.begin_recording().is_err());
    p.end_recording().unwrap();
}

/// An iteration: allocation `i` has `size` bytes and is freed `delay` allocations later (or
/// never, for a large delay).
fn steps(allocs: &[(u64, usize)]) -> Vec<Step> {
    let mut events: Vec<(usize, Step)> = Vec::new();
    for (name, &(size, delay)) in allocs.iter().enumerate() {
        events.push((2 * name, Malloc(name + 1, size)));
        if delay < 25 {
            events.push((2 * name + 2 * delay + 1, Free(name + 1)));
        }
    }
    events.sort_by_key(|&(t, _)| t);
    events.into_iter().map(|(_, s)| s).collect()
}

fn sequence() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec((1u64..3000, 0usize..30), 1..24).prop_map(|allocs| steps(&allocs))
}

/// A recorded iteration and a served one with the same sizes but frees moved (so planned
/// bytes may still be held), and now and then another size.
fn recorded_and_changed() -> impl Strategy<Value = (Vec<Step>, Vec<Step>)> {
    prop::collection::vec((1u64..3000, 0usize..30, 0usize..30, 0u8..8), 1..24).prop_map(|allocs| {
        let recorded: Vec<(u64, usize)> = allocs.iter().map(|&(s, d, _, _)| (s, d)).collect();
        let changed: Vec<(u64, usize)> = allocs
            .iter()
            .map(|&(s, _, d, k)| (if k == 0 { s + 100 } else { s }, d))
            .collect();
        (steps(&recorded), steps(&changed))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Serving an iteration unlike the one recorded never hands out bytes that a live
    /// allocation holds (`run` checks every allocation's contents before freeing it).
    #[test]
    fn serving_a_different_iteration_stays_correct((recorded, served) in recorded_and_changed()) {
        let mut p = profiler();
        p.begin_recording().unwrap();
        run(&mut p, &recorded);
        p.end_recording().unwrap();
        p.formulate(Algorithm::Best).unwrap();
        p.begin_serving().unwrap();
        run(&mut p, &served);
        p.end_serving().unwrap();
        prop_assert_eq!(p.stats().live_allocations, 0);
    }

    /// Serving the recorded iteration itself takes every planned allocation from the blob.
    #[test]
    fn serving_the_recorded_iteration_never_falls_back(recorded in sequence()) {
        let mut p = profiler();
        p.begin_recording().unwrap();
        run(&mut p, &recorded);
        p.end_recording().unwrap();
        p.formulate(Algorithm::Best).unwrap();
        p.begin_validating().unwrap();
        run(&mut p, &recorded);
        prop_assert!(p.end_validating().unwrap());
        p.begin_serving().unwrap();
        run(&mut p, &recorded);
        p.end_serving().unwrap();
        prop_assert_eq!(p.stats().mismatches, 0);
    }
}

#[test]
fn a_loaded_plan_aligned_to_less_than_the_allocator_is_refused() {
    // The allocator promises its alignment; a plan made for a smaller one may place
    // allocations at offsets that break the promise.
    let plan = planned().plan().unwrap().clone();
    assert_eq!(plan.alignment, 64);
    let text = plan.to_json();
    let mut strict = Profiler::new(Box::new(HostMemory), 256).unwrap();
    let err = strict
        .set_plan(ProfilePlan::from_json(&text).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("alignment (64)"), "{err}");
    assert!(strict.plan().is_none(), "the refused plan was kept");
    // An allocator of a smaller alignment takes it: 64-byte offsets keep an 8-byte promise.
    let mut loose = Profiler::new(Box::new(HostMemory), 8).unwrap();
    loose
        .set_plan(ProfilePlan::from_json(&text).unwrap())
        .unwrap();
}

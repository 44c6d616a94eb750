//! The storage-group planner: groups are shared by values that never live together, reused
//! across iterations, and grow to the largest value they held; outputs are kept apart.

use tensoralloc::plan::memory::HostMemory;
use tensoralloc::plan::storage::{StoragePlanner, StorageValue};

fn value(first_use: u64, last_use: u64) -> StorageValue {
    StorageValue {
        first_use,
        last_use,
        output: false,
    }
}

fn output(first_use: u64, last_use: u64) -> StorageValue {
    StorageValue {
        first_use,
        last_use,
        output: true,
    }
}

fn planner(values: &[StorageValue]) -> StoragePlanner {
    StoragePlanner::new(values, Box::new(HostMemory)).unwrap()
}

/// One iteration placing every value with the given sizes; returns where each went.
fn iteration(p: &mut StoragePlanner, sizes: &[u64]) -> Vec<Option<usize>> {
    p.allocate().unwrap();
    let placed = sizes
        .iter()
        .enumerate()
        .map(|(v, &s)| p.place(v, s).unwrap())
        .collect();
    p.deallocate().unwrap();
    placed
}

#[test]
fn a_value_takes_the_group_of_one_that_died_before_it_started() {
    let p = planner(&[value(0, 1), value(1, 2), value(2, 3)]);
    assert_eq!(p.group_of(0), p.group_of(2));
    assert_ne!(p.group_of(0), p.group_of(1));
    assert_eq!(p.stats().groups, 2);
}

#[test]
fn a_group_freed_at_a_step_is_not_reused_by_values_made_at_that_step() {
    // Value 0's last use is step 1, where value 1 is made: they are live together.
    let p = planner(&[value(0, 1), value(1, 1)]);
    assert_ne!(p.group_of(0), p.group_of(1));
}

#[test]
fn the_most_recently_freed_group_is_reused_first() {
    let p = planner(&[value(0, 0), value(0, 1), value(2, 2)]);
    assert_eq!(p.group_of(2), p.group_of(1));
}

#[test]
fn the_first_iteration_places_nothing_and_the_second_places_everything() {
    let mut p = planner(&[value(0, 1), value(1, 2), value(2, 3)]);
    let first = iteration(&mut p, &[100, 200, 300]);
    assert!(first.iter().all(Option::is_none));
    let second = iteration(&mut p, &[100, 200, 300]);
    assert!(second.iter().all(Option::is_some));
    assert_eq!(
        second[0], second[2],
        "values 0 and 2 share their group's bytes"
    );
    assert_eq!(
        p.stats().managed_bytes,
        320 + 256,
        "each group sized by its largest value, aligned to 64"
    );
    assert_eq!(p.stats().reused_values, 1);
    assert_eq!(p.stats().managed_values, 3);
}

#[test]
fn groups_grow_to_the_largest_value_seen_and_do_not_shrink() {
    let mut p = planner(&[value(0, 1), value(1, 2), value(2, 3)]);
    iteration(&mut p, &[100, 200, 300]);
    let grown = iteration(&mut p, &[1000, 200, 300]);
    assert_eq!(grown[0], None, "too large for its group this time");
    assert_eq!(p.stats().managed_bytes, 1024 + 256);
    let placed = iteration(&mut p, &[10, 10, 10]);
    assert!(placed.iter().all(Option::is_some));
    assert_eq!(p.stats().managed_bytes, 1024 + 256);
}

#[test]
fn placed_values_of_different_groups_do_not_overlap() {
    let mut p = planner(&[value(0, 3), value(1, 3), value(2, 3)]);
    let sizes = [500u64, 700, 900];
    iteration(&mut p, &sizes);
    let placed: Vec<usize> = iteration(&mut p, &sizes)
        .into_iter()
        .map(Option::unwrap)
        .collect();
    for i in 0..3 {
        for j in 0..i {
            let (a, b) = (placed[i], placed[j]);
            assert!(
                a + sizes[i] as usize <= b || b + sizes[j] as usize <= a,
                "values {i} and {j} overlap"
            );
        }
    }
}

#[test]
fn outputs_have_their_own_buffer_and_are_never_shared() {
    let mut p = planner(&[value(0, 0), output(1, 1), value(2, 2)]);
    assert_eq!(p.group_of(1), None);
    assert_eq!(p.stats().outputs, 1);
    iteration(&mut p, &[64, 64, 64]);
    p.release_outputs().unwrap();
    let placed = iteration(&mut p, &[64, 64, 64]);
    assert_eq!(placed[0], placed[2]);
    assert!(placed[1].is_some());
    assert_ne!(placed[1], placed[0]);
    assert_eq!(p.stats().output_buffer_bytes, 64);
}

#[test]
fn the_next_iteration_waits_for_the_outputs_to_be_released() {
    let mut p = planner(&[value(0, 0), output(1, 1)]);
    iteration(&mut p, &[64, 64]);
    assert!(p.allocate().is_err());
    p.release_outputs().unwrap();
    p.allocate().unwrap();
}

#[test]
fn placing_outside_an_iteration_or_an_unknown_value_is_an_error() {
    let mut p = planner(&[value(0, 0)]);
    assert!(p.place(0, 10).is_err());
    p.allocate().unwrap();
    assert!(p.place(5, 10).is_err());
    assert!(p.allocate().is_err(), "already running");
    p.deallocate().unwrap();
    assert!(p.deallocate().is_err(), "not running");
}

#[test]
fn a_value_that_ends_before_it_starts_is_rejected() {
    assert!(StoragePlanner::new(&[value(3, 2)], Box::new(HostMemory)).is_err());
}

#[test]
fn absurd_sizes_are_refused_and_totals_past_2_64_bytes_fail_the_next_iteration() {
    // Two values live one after the other share nothing: two groups.
    let mut p = planner(&[value(0, 1), value(1, 2)]);
    p.allocate().unwrap();
    for absurd in [u64::MAX, u64::MAX - 4095, (1 << 50) + 1] {
        let e = p.place(0, absurd).unwrap_err().to_string();
        assert!(e.contains("absurd"), "{e}");
    }
    assert_eq!(p.place(1, 1 << 50).unwrap(), None, "1 PiB is a size");
    p.deallocate().unwrap();
    // 16,385 values live at once, of 1 PiB each: their groups add up past 2^64 bytes. The
    // iteration is refused; nothing is laid out on a wrapped total.
    let many = vec![value(0, 0); (1 << 14) + 1];
    let mut p = planner(&many);
    p.allocate().unwrap();
    for v in 0..many.len() {
        assert_eq!(p.place(v, 1 << 50).unwrap(), None);
    }
    p.deallocate().unwrap();
    assert_eq!(p.stats().managed_bytes, u64::MAX);
    let e = p.allocate().unwrap_err().to_string();
    assert!(e.contains("2^64"), "{e}");
    assert!(
        p.place(0, 8).is_err(),
        "no iteration runs after the refusal"
    );
}

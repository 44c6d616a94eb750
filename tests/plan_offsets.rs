//! Offset planning: every algorithm's plan is valid, the default is never worse than the
//! `pytorch` baseline, and small hand-made cases come out exactly as worked out by hand.

use proptest::prelude::*;
use tensoralloc::plan::{
    lower_bound, plan_offsets, plan_offsets_with, traces, validate, Algorithm, Allocation,
    OffsetPlan, PlanOptions,
};
use tensoralloc::Error;

fn a(size: u64, first: u64, last: u64) -> Allocation {
    Allocation::new(size, first, last)
}

fn plan(allocs: &[Allocation], algorithm: &str) -> OffsetPlan {
    let p = plan_offsets(allocs, 64, Algorithm::from_name(algorithm).unwrap()).unwrap();
    validate(allocs, &p, 64).unwrap();
    p
}

/// Greedy by size, as specified: by decreasing size, then decreasing lifetime, then first use
/// and index, each allocation goes into the smallest gap (the lowest among equals) between the
/// already placed allocations it is live with, or on top of them; with `lowest` (first fit by
/// size), and for a tiny one (at most a 2^-20th of the lower bound), into the lowest gap that
/// holds it.
fn greedy_by_size_one_by_one(allocs: &[Allocation], alignment: u64, lowest: bool) -> Vec<u64> {
    let tiny = lower_bound(allocs, alignment).unwrap() >> 20;
    let size = |i: usize| allocs[i].size.div_ceil(alignment) * alignment;
    let mut order: Vec<usize> = (0..allocs.len()).filter(|&i| size(i) > 0).collect();
    order.sort_by_key(|&i| {
        let x = allocs[i];
        (
            std::cmp::Reverse((size(i), x.last_use - x.first_use)),
            x.first_use,
            i,
        )
    });
    let mut offsets = vec![0u64; allocs.len()];
    let mut placed: Vec<usize> = Vec::new();
    for i in order {
        let mut neighbours: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&j| allocs[j].overlaps_in_time(&allocs[i]))
            .map(|&j| (offsets[j], offsets[j] + size(j)))
            .collect();
        neighbours.sort_unstable();
        let (mut top, mut best) = (0u64, None::<(u64, u64)>);
        for (start, end) in neighbours {
            if start >= top + size(i) && best.is_none_or(|(gap, _)| start - top < gap) {
                best = Some((start - top, top));
                if lowest || size(i) <= tiny {
                    break;
                }
            }
            top = top.max(end);
        }
        offsets[i] = best.map_or(top, |(_, at)| at);
        placed.push(i);
    }
    offsets
}

fn allocations(max_len: usize) -> impl Strategy<Value = Vec<Allocation>> {
    prop::collection::vec((0u64..5000, 0u64..40, 0u64..15), 0..max_len).prop_map(|v| {
        v.into_iter()
            .map(|(size, first, len)| a(size, first, first + len))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_algorithm_gives_a_valid_plan_at_or_above_the_lower_bound(allocs in allocations(60)) {
        let bound = lower_bound(&allocs, 64).unwrap();
        // The exact search has its own property below, on inputs it can finish.
        for algorithm in Algorithm::all().into_iter().filter(|&a| a != Algorithm::Exact) {
            let p = plan_offsets(&allocs, 64, algorithm).unwrap();
            prop_assert!(validate(&allocs, &p, 64).is_ok(), "{}: {:?}", algorithm.name(), validate(&allocs, &p, 64));
            prop_assert!(p.arena_size >= bound);
        }
    }

    /// Hundreds of allocations: the greedy pass's bitmaps span many words.
    #[test]
    fn greedy_plans_of_large_inputs_are_valid(allocs in prop::collection::vec((1u64..100_000, 0u64..400, 0u64..60), 200..400)
        .prop_map(|v| v.into_iter().map(|(size, first, len)| a(size, first, first + len)).collect::<Vec<_>>())) {
        // The default's search is held to 2·10^5 work units: a plan's validity does not depend
        // on the budget, and the default's would take seconds per case in a debug build.
        let options = PlanOptions { work_budget: Some(200_000), time_limit: None };
        for algorithm in [Algorithm::GreedyBySize, Algorithm::GreedyByBreadth, Algorithm::GreedyByTime, Algorithm::Best] {
            let p = plan_offsets_with(&allocs, 64, algorithm, &options).unwrap().plan;
            prop_assert!(validate(&allocs, &p, 64).is_ok(), "{}: {:?}", algorithm.name(), validate(&allocs, &p, 64));
        }
    }

    #[test]
    fn the_default_plan_is_never_larger_than_pytorch_or_any_greedy_order(allocs in allocations(60)) {
        let best = plan_offsets(&allocs, 64, Algorithm::Best).unwrap().arena_size;
        for algorithm in Algorithm::all() {
            if algorithm != Algorithm::Exact {
                prop_assert!(best <= plan_offsets(&allocs, 64, algorithm).unwrap().arena_size, "{}", algorithm.name());
            }
        }
    }

    #[test]
    fn exact_search_is_valid_and_never_larger_than_the_default(allocs in allocations(12)) {
        let exact = plan_offsets(&allocs, 64, Algorithm::Exact).unwrap();
        prop_assert!(validate(&allocs, &exact, 64).is_ok());
        prop_assert!(exact.arena_size <= plan_offsets(&allocs, 64, Algorithm::Best).unwrap().arena_size);
    }

    /// The greedy pass finds gaps through unions of byte ranges kept in a tree over time;
    /// here each allocation's live neighbours are compared one by one instead.
    #[test]
    fn greedy_by_size_takes_the_smallest_gap_among_live_neighbours(allocs in prop::collection::vec((1u64..3000, 0u64..200, 0u64..40), 0..250)
        .prop_map(|v| v.into_iter().map(|(size, first, len)| a(size, first, first + len)).collect::<Vec<_>>())) {
        let expected = greedy_by_size_one_by_one(&allocs, 64, false);
        prop_assert_eq!(plan(&allocs, "greedy-by-size").offsets, expected);
    }

    /// First fit by size finds the lowest gap through the same tree, merging its lists.
    #[test]
    fn first_fit_by_size_takes_the_lowest_gap_among_live_neighbours(allocs in prop::collection::vec((prop_oneof![1u64..3000, (1u64 << 20)..(1u64 << 24)], 0u64..200, 0u64..40), 0..250)
        .prop_map(|v| v.into_iter().map(|(size, first, len)| a(size, first, first + len)).collect::<Vec<_>>())) {
        let expected = greedy_by_size_one_by_one(&allocs, 64, true);
        prop_assert_eq!(plan(&allocs, "first-fit-by-size").offsets, expected);
    }

    /// Large allocations and tiny ones, which come last in size order and take the lowest
    /// gap that holds them.
    #[test]
    fn greedy_by_size_places_tiny_allocations_in_the_lowest_gap_that_holds_them(
        allocs in prop::collection::vec((prop_oneof![1u64..200, (1u64 << 26)..(1u64 << 28)], 0u64..200, 0u64..40), 0..250)
            .prop_map(|v| v.into_iter().map(|(size, first, len)| a(size, first, first + len)).collect::<Vec<_>>())
    ) {
        let expected = greedy_by_size_one_by_one(&allocs, 1, false);
        let p = plan_offsets(&allocs, 1, Algorithm::GreedyBySize).unwrap();
        prop_assert!(validate(&allocs, &p, 1).is_ok());
        prop_assert_eq!(p.offsets, expected);
        let best = plan_offsets_with(&allocs, 1, Algorithm::Best, &PlanOptions { work_budget: Some(200_000), time_limit: None }).unwrap();
        prop_assert!(validate(&allocs, &best.plan, 1).is_ok());
        // Every order places its tiny allocations last, in the default's passes too.
        for algorithm in Algorithm::all().into_iter().filter(|&a| a != Algorithm::Exact && a != Algorithm::Best) {
            let p = plan_offsets(&allocs, 1, algorithm).unwrap();
            prop_assert!(validate(&allocs, &p, 1).is_ok());
            prop_assert!(best.plan.arena_size <= p.arena_size, "{}", algorithm.name());
        }
    }

    #[test]
    fn plans_are_valid_at_every_alignment(allocs in allocations(30), shift in 0u32..13) {
        let alignment = 1u64 << shift;
        for algorithm in Algorithm::all().into_iter().filter(|&a| a != Algorithm::Exact) {
            let p = plan_offsets(&allocs, alignment, algorithm).unwrap();
            prop_assert!(validate(&allocs, &p, alignment).is_ok());
            prop_assert!(p.offsets.iter().all(|o| o % alignment == 0));
        }
    }
}

/// The smallest arena of any layout of `allocs` (sizes multiples of 64, offsets multiples of
/// 64), by trying every offset of every allocation in turn.
fn smallest_arena_by_brute_force(allocs: &[Allocation]) -> u64 {
    fn visit(k: usize, allocs: &[Allocation], offsets: &mut Vec<u64>, top: u64, best: &mut u64) {
        if top >= *best {
            return;
        }
        if k == allocs.len() {
            *best = top;
            return;
        }
        let size = allocs[k].size / 64;
        let mut o = 0;
        while o + size < *best {
            let free = (0..k).all(|j| {
                let other = allocs[j].size / 64;
                !allocs[j].overlaps_in_time(&allocs[k])
                    || o + size <= offsets[j]
                    || offsets[j] + other <= o
            });
            if free {
                offsets[k] = o;
                visit(k + 1, allocs, offsets, top.max(o + size), best);
            }
            o += 1;
        }
    }
    let mut best = allocs.iter().map(|x| x.size / 64).sum::<u64>() + 1;
    visit(0, allocs, &mut vec![0; allocs.len()], 0, &mut best);
    best * 64
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// What the search prunes (section capacity, dominance, canonical order, hatless
    /// choices) never hides a smaller layout: a plan it proves optimal is as small as any.
    #[test]
    fn a_plan_exact_proves_optimal_is_as_small_as_any_layout(
        allocs in prop::collection::vec((1u64..=4, 0u64..6, 0u64..4), 1..=6)
            .prop_map(|v| v.into_iter().map(|(units, first, len)| a(64 * units, first, first + len)).collect::<Vec<_>>())
    ) {
        let out = plan_offsets_with(&allocs, 64, Algorithm::Exact, &PlanOptions::default()).unwrap();
        prop_assert!(validate(&allocs, &out.plan, 64).is_ok());
        prop_assert!(out.proven_optimal);
        prop_assert_eq!(out.plan.arena_size, smallest_arena_by_brute_force(&allocs));
    }

    /// Copies of one allocation are interchangeable, and the search places them in one order
    /// only: that never hides a smaller layout either.
    #[test]
    fn a_plan_exact_proves_optimal_with_copies_of_allocations_is_as_small_as_any_layout(
        kinds in prop::collection::vec((1u64..=4, 0u64..5, 0u64..4), 1..=3),
        picks in prop::collection::vec(0usize..3, 2..=7)
    ) {
        let allocs: Vec<Allocation> = picks
            .iter()
            .map(|&k| {
                let (units, first, len) = kinds[k % kinds.len()];
                a(64 * units, first, first + len)
            })
            .collect();
        let out = plan_offsets_with(&allocs, 64, Algorithm::Exact, &PlanOptions::default()).unwrap();
        prop_assert!(validate(&allocs, &out.plan, 64).is_ok());
        prop_assert!(out.proven_optimal);
        prop_assert_eq!(out.plan.arena_size, smallest_arena_by_brute_force(&allocs));
    }
}

#[test]
fn pytorch_grows_the_arena_where_the_default_reaches_the_bound() {
    // B lives through C's step; A's gap is too small for C.
    let allocs = [a(64, 0, 0), a(64, 0, 2), a(128, 1, 1)];
    assert_eq!(lower_bound(&allocs, 64).unwrap(), 192);
    let p = plan(&allocs, "pytorch");
    assert_eq!(p.offsets, vec![0, 64, 128]);
    assert_eq!(p.arena_size, 256);
    assert_eq!(plan(&allocs, "default").arena_size, 192);
}

#[test]
fn pytorch_keeps_two_free_gaps_of_the_same_size() {
    // A and C die at step 0 leaving two 64-byte gaps; E and F fill both (a size-keyed map
    // without duplicates would lose one gap and grow the arena).
    let allocs = [
        a(64, 0, 0),
        a(64, 0, 3),
        a(64, 0, 0),
        a(64, 0, 3),
        a(64, 1, 3),
        a(64, 1, 3),
    ];
    let p = plan(&allocs, "pytorch");
    assert_eq!(p.offsets, vec![0, 64, 128, 192, 0, 128]);
    assert_eq!(p.arena_size, 256);
}

#[test]
fn pytorch_coalesces_freed_neighbours_into_one_gap() {
    // A and B are freed side by side; C needs both of their bytes.
    let allocs = [a(64, 0, 0), a(64, 0, 0), a(64, 0, 2), a(128, 1, 2)];
    let p = plan(&allocs, "pytorch");
    assert_eq!(p.offsets, vec![0, 64, 128, 0]);
    assert_eq!(p.arena_size, 192);
}

#[test]
fn pytorch_places_an_allocation_too_large_for_every_gap_past_the_end() {
    // The baseline grows the arena by the whole size even when the last gap touches its end.
    let allocs = [a(1000, 0, 1), a(3000, 2, 3), a(2000, 4, 4)];
    let p = plan(&allocs, "pytorch");
    assert_eq!(p.offsets, vec![0, 1024, 0]);
    assert_eq!(p.arena_size, 1024 + 3008);
}

#[test]
fn allocations_live_at_different_times_share_the_arena() {
    let allocs = [a(1000, 0, 1), a(3000, 2, 3), a(2000, 4, 4)];
    for algorithm in Algorithm::all()
        .into_iter()
        .filter(|&a| a != Algorithm::Pytorch)
    {
        let p = plan(&allocs, algorithm.name());
        assert_eq!(p.offsets, vec![0, 0, 0], "{}", algorithm.name());
        assert_eq!(p.arena_size, 3008);
    }
}

#[test]
fn allocations_live_at_the_same_time_are_stacked() {
    let allocs = [a(100, 0, 5), a(200, 3, 3), a(300, 3, 9)];
    for algorithm in Algorithm::all() {
        assert_eq!(
            plan(&allocs, algorithm.name()).arena_size,
            128 + 256 + 320,
            "{}",
            algorithm.name()
        );
    }
}

#[test]
fn greedy_by_size_places_the_largest_first_then_the_longest_lived() {
    let allocs = [a(256, 0, 2), a(256, 0, 5), a(128, 0, 5)];
    assert_eq!(plan(&allocs, "greedy-by-size").offsets, [256, 0, 512]);
}

#[test]
fn greedy_by_size_orders_sizes_and_times_too_large_to_pack_in_one_key() {
    // Sizes of 2^57..2^58 bytes first used at 2^63: the order's key needs more than 128 bits.
    let t = 1u64 << 63;
    let allocs = [
        a(1 << 58, t, t + 2),
        a(1 << 58, t, t + 1000),
        a(1 << 57, t, t + 1000),
    ];
    assert_eq!(
        plan(&allocs, "greedy-by-size").offsets,
        [1 << 58, 0, 1 << 59]
    );
}

#[test]
fn lifetimes_are_inclusive() {
    // Last use at 3 and first use at 3: live together, so they cannot share bytes.
    let together = [a(64, 0, 3), a(64, 3, 5)];
    assert_eq!(plan(&together, "default").arena_size, 128);
    let apart = [a(64, 0, 2), a(64, 3, 5)];
    assert_eq!(plan(&apart, "default").arena_size, 64);
}

#[test]
fn zero_byte_allocations_take_no_space() {
    let allocs = [a(0, 0, 9), a(64, 0, 9), a(0, 2, 2)];
    let p = plan(&allocs, "default");
    assert_eq!(p.offsets[0], 0);
    assert_eq!(p.offsets[2], 0);
    assert_eq!(p.arena_size, 64);
}

#[test]
fn sizes_are_rounded_up_to_the_alignment() {
    let allocs = [a(1, 0, 1), a(1, 0, 1)];
    let p = plan_offsets(&allocs, 4096, Algorithm::Best).unwrap();
    assert_eq!(p.arena_size, 8192);
    assert!(p.offsets.iter().all(|o| o % 4096 == 0));
}

#[test]
fn exact_search_reaches_the_lower_bound_on_a_small_tight_case() {
    // Packed by hand into 4 units, which is also the lower bound.
    let u = 64;
    let allocs = [
        a(2 * u, 0, 1),
        a(u, 1, 2),
        a(u, 0, 0),
        a(2 * u, 2, 3),
        a(u, 3, 3),
        a(u, 1, 3),
    ];
    let bound = lower_bound(&allocs, 64).unwrap();
    let exact = plan(&allocs, "exact");
    assert_eq!(exact.arena_size, bound);
    assert!(exact.arena_size <= plan(&allocs, "greedy-by-size").arena_size);
}

#[test]
fn a_lifetime_spanning_every_time_step_is_planned_by_every_algorithm() {
    // One allocation lives from step 0 to the last representable one (its length does not
    // fit in the type), among others that the greedy orders do not pack to the bound, so
    // the search runs too.
    let allocs: Vec<Allocation> = [
        (4943, 3, 9),
        (75, 7, 8),
        (3559, 1, 8),
        (2526, 4, 12),
        (472, 6, 9),
        (2879, 9, 17),
        (3461, 8, 8),
        (4312, 7, 14),
        (4458, 0, u64::MAX),
        (3222, 9, 10),
        (4876, 7, 15),
        (4742, 8, 12),
        (4689, 5, 5),
        (2710, 8, 15),
        (2758, 0, 5),
        (1936, 9, 9),
        (2036, 9, 14),
        (1792, 3, 10),
        (1328, 3, 8),
        (3371, 2, 3),
        (2387, 7, 12),
        (1759, 4, 12),
        (2984, 1, 8),
        (1088, 4, 4),
        (4068, 2, 7),
        (2192, 8, 10),
        (1590, 6, 7),
        (1463, 5, 8),
        (118, 9, 14),
        (3802, 9, 9),
        (822, 1, 2),
        (3530, 5, 7),
        (1803, 2, 9),
        (553, 8, 9),
        (699, 8, 11),
        (2223, 3, 7),
        (119, 1, 4),
    ]
    .into_iter()
    .map(|(size, first, last)| a(size, first, last))
    .collect();
    let bound = lower_bound(&allocs, 1).unwrap();
    for algorithm in [Algorithm::Best, Algorithm::Pytorch, Algorithm::Exact] {
        let p = plan_offsets(&allocs, 1, algorithm).unwrap();
        validate(&allocs, &p, 1).unwrap();
        assert!(p.arena_size >= bound, "{algorithm:?}");
    }
}

#[test]
fn the_validator_names_two_overlapping_live_allocations() {
    let allocs = [a(64, 0, 3), a(64, 2, 5)];
    let bad = OffsetPlan {
        offsets: vec![0, 32],
        arena_size: 128,
    };
    let err = validate(&allocs, &bad, 32).unwrap_err();
    assert!(err.message().contains("allocations 0 and 1"), "{err}");
}

#[test]
fn the_validator_rejects_misaligned_offsets_and_a_short_arena() {
    let allocs = [a(64, 0, 3)];
    assert!(validate(
        &allocs,
        &OffsetPlan {
            offsets: vec![8],
            arena_size: 128
        },
        64
    )
    .is_err());
    assert!(validate(
        &allocs,
        &OffsetPlan {
            offsets: vec![64],
            arena_size: 64
        },
        64
    )
    .is_err());
    assert!(validate(
        &allocs,
        &OffsetPlan {
            offsets: vec![],
            arena_size: 64
        },
        64
    )
    .is_err());
}

#[test]
fn bad_input_is_rejected() {
    let bad_lifetime = [a(64, 5, 4)];
    assert!(matches!(
        plan_offsets(&bad_lifetime, 64, Algorithm::Best),
        Err(Error::InvalidArgument(_))
    ));
    let ok = [a(64, 0, 1)];
    assert!(plan_offsets(&ok, 0, Algorithm::Best).is_err());
    assert!(plan_offsets(&ok, 96, Algorithm::Best).is_err());
    assert!(Algorithm::from_name("nonsense").is_err());
    assert_eq!(Algorithm::from_name("default").unwrap(), Algorithm::Best);
    let huge = [a(u64::MAX - 10, 0, 1)];
    assert!(plan_offsets(&huge, 64, Algorithm::Best).is_err());
    let overflowing = [
        a(u64::MAX / 2, 0, 1),
        a(u64::MAX / 2, 0, 1),
        a(u64::MAX / 2, 0, 1),
    ];
    assert!(plan_offsets(&overflowing, 64, Algorithm::Pytorch).is_err());
}

/// Allocations adding up to exactly `u64::MAX` bytes are accepted, and every algorithm plans
/// them into an arena of that size.
#[test]
fn an_arena_of_u64_max_bytes_is_planned_by_every_algorithm() {
    let whole = [a(u64::MAX, 0, 1)];
    let halves = [a(u64::MAX / 2, 0, 3), a(u64::MAX / 2 + 1, 2, 5)];
    for allocs in [&whole[..], &halves[..]] {
        for algorithm in Algorithm::all() {
            let plan = plan_offsets(allocs, 1, algorithm)
                .unwrap_or_else(|e| panic!("{}: {e}", algorithm.name()));
            assert_eq!(plan.arena_size, u64::MAX, "{}", algorithm.name());
        }
    }
}

#[test]
fn every_algorithm_has_a_name_that_parses_back() {
    for algorithm in Algorithm::all() {
        assert_eq!(Algorithm::from_name(algorithm.name()).unwrap(), algorithm);
    }
}

/// The quality target on realistic traces, at sizes a debug build plans quickly (the
/// benchmark reports the large ones).
#[test]
fn the_default_plan_is_within_two_percent_of_the_bound_on_model_traces() {
    let cases = [
        (
            "transformer training",
            traces::transformer_training(4, 2, 4, 512, 768, 12, 7),
        ),
        ("cnn training", traces::cnn_training(16, 224, 1, 8)),
        (
            "transformer inference",
            traces::transformer_inference(6, 8, 1, 1024, 1024, 16, 9),
        ),
    ];
    for (name, allocs) in cases {
        let bound = lower_bound(&allocs, 64).unwrap();
        let best = plan(&allocs, "default").arena_size;
        let pytorch = plan(&allocs, "pytorch").arena_size;
        assert!(best <= pytorch, "{name}");
        assert!(
            best as f64 <= 1.02 * bound as f64,
            "{name}: {best} vs bound {bound}"
        );
    }
}

/// PyTorch's plan, made on a second thread for large inputs, still wins where it is the best:
/// a small case where it meets the lower bound and no greedy order does, repeated 700 times
/// one after another (4,200 allocations).
#[test]
fn the_default_takes_pytorchs_plan_of_a_large_input_where_it_is_the_best() {
    let case = [
        (4, 1, 1),
        (6, 1, 4),
        (1, 1, 3),
        (1, 0, 0),
        (7, 0, 1),
        (8, 3, 6),
    ];
    let allocs: Vec<Allocation> = (0..700u64)
        .flat_map(|k| case.map(|(size, first, last)| a(size, first + 7 * k, last + 7 * k)))
        .collect();
    assert_eq!(lower_bound(&allocs, 1).unwrap(), 18);
    let pytorch = plan_offsets(&allocs, 1, Algorithm::Pytorch).unwrap();
    assert_eq!(pytorch.arena_size, 18);
    let greedy = plan_offsets(&allocs, 1, Algorithm::GreedyBySize).unwrap();
    assert!(greedy.arena_size > 18);
    let best = plan_offsets(&allocs, 1, Algorithm::Best).unwrap();
    validate(&allocs, &best, 1).unwrap();
    assert_eq!(best.arena_size, 18);
}

/// On an input so dense that the default would stop after size order, it still tries the
/// next orders while its plan is far above the lower bound: five allocations that size order
/// packs 6% above their bound and breadth order at it (PyTorch's plan misses it too), under
/// 6,000 of 16 KiB live throughout (18 million pairs live together).
#[test]
fn the_default_tries_more_orders_on_a_dense_input_while_far_from_the_bound() {
    let mib = 1u64 << 20;
    let case = [(11, 3, 7), (8, 5, 9), (8, 4, 6), (5, 5, 5), (10, 7, 7)];
    let mut allocs: Vec<Allocation> = case
        .iter()
        .map(|&(size, first, last)| a(size * mib, first, last))
        .collect();
    allocs.extend((0..6000).map(|_| a(16 << 10, 0, 9)));
    let bound = lower_bound(&allocs, 1).unwrap();
    let by_size = plan_offsets(&allocs, 1, Algorithm::GreedyBySize).unwrap();
    assert!(by_size.arena_size - bound > bound / 64);
    let pytorch = plan_offsets(&allocs, 1, Algorithm::Pytorch).unwrap();
    assert!(pytorch.arena_size > bound);
    let best = plan_offsets(&allocs, 1, Algorithm::Best).unwrap();
    validate(&allocs, &best, 1).unwrap();
    assert_eq!(best.arena_size, bound);
}

#[test]
fn thousands_of_allocations_live_together_are_stacked_without_gaps() {
    let allocs: Vec<Allocation> = (0..3000u64)
        .map(|i| a(64 * (1 + i % 7), i / 1000, 10))
        .collect();
    let p = plan(&allocs, "default");
    assert_eq!(p.arena_size, allocs.iter().map(|x| x.size).sum::<u64>());
}

/// A dense input with sizes of every magnitude, as in graphs of sharded models
/// ([`traces::sharded_graph`], 2,000 allocations). Best fit in size order leaves slivers that
/// nothing later fills (4.9% above the bound on this input); first fit by size comes within
/// 0.91%, and the default starts from it.
#[test]
fn the_default_packs_a_dense_input_of_mixed_magnitudes_by_first_fit() {
    let allocs = traces::sharded_graph(2000, 2);
    let bound = lower_bound(&allocs, 1).unwrap();
    let above = |p: &OffsetPlan| (p.arena_size - bound) as f64 / bound as f64;
    let by_size = plan_offsets(&allocs, 1, Algorithm::GreedyBySize).unwrap();
    let first_fit = plan_offsets(&allocs, 1, Algorithm::FirstFitBySize).unwrap();
    let best = plan_offsets(&allocs, 1, Algorithm::Best).unwrap();
    validate(&allocs, &first_fit, 1).unwrap();
    validate(&allocs, &best, 1).unwrap();
    assert!(
        above(&by_size) > 0.02,
        "best fit by size: {}",
        above(&by_size)
    );
    assert!(
        above(&first_fit) < 0.01,
        "first fit by size: {}",
        above(&first_fit)
    );
    assert!(best.arena_size <= first_fit.arena_size);
    // The other greedy strategies come to 1.01% at best (size classes, longest lifetime
    // first); the promoting passes that follow lower first fit's plan to 0.90%.
    assert!(above(&best) < 0.01, "default: {}", above(&best));
}

/// A dense input of 1,500 allocations ([`traces::sharded_graph`]), too many for the search:
/// every greedy order ends at least 2.3% above the bound (first fit by size), and the default
/// then runs first-fit passes that place earlier the allocations the last plan put above the
/// bound, which come lower, within its budget.
#[test]
fn promoting_passes_lower_a_dense_input_too_large_for_the_search() {
    let allocs = traces::sharded_graph(1500, 3);
    let named: Vec<OffsetPlan> = Algorithm::all()
        .into_iter()
        .filter(|&alg| alg != Algorithm::Best && alg != Algorithm::Exact)
        .map(|alg| plan_offsets(&allocs, 1, alg).unwrap())
        .collect();
    let greedy_best = named.iter().map(|p| p.arena_size).min().unwrap();
    let first_fit = plan_offsets(&allocs, 1, Algorithm::FirstFitBySize).unwrap();
    assert_eq!(first_fit.arena_size, greedy_best);

    let default = plan_offsets_with(&allocs, 1, Algorithm::Best, &PlanOptions::default()).unwrap();
    validate(&allocs, &default.plan, 1).unwrap();
    assert!(
        default.plan.arena_size < greedy_best,
        "{} against {greedy_best}",
        default.plan.arena_size
    );
    assert!(
        default.work > 0 && default.work <= 20_000_000,
        "{}",
        default.work
    );
    assert!(!default.proven_optimal);
    // The same again: the passes' order depends only on the input.
    let again = plan_offsets_with(&allocs, 1, Algorithm::Best, &PlanOptions::default()).unwrap();
    assert_eq!(again, default);

    // A budget below one pass keeps the greedy plan.
    let tight = PlanOptions {
        work_budget: Some(1_000),
        ..PlanOptions::default()
    };
    let kept = plan_offsets_with(&allocs, 1, Algorithm::Best, &tight).unwrap();
    assert_eq!(kept.plan.arena_size, greedy_best);
    assert_eq!(kept.work, 0);
}

/// A dense input of 2,500 allocations ([`traces::sharded_graph`]) where first fit in size
/// classes, longest lifetime first, packs tighter than strict size order: every named greedy
/// algorithm ends at least 0.6% above the bound, the default within 0.3%.
#[test]
fn first_fit_by_size_class_packs_a_dense_input_tighter_than_size_order() {
    let allocs = traces::sharded_graph(2500, 2);
    let bound = lower_bound(&allocs, 1).unwrap();
    let above = |p: &OffsetPlan| (p.arena_size - bound) as f64 / bound as f64;
    for alg in Algorithm::all() {
        if alg != Algorithm::Best && alg != Algorithm::Exact {
            let p = plan_offsets(&allocs, 1, alg).unwrap();
            assert!(above(&p) > 0.006, "{}: {}", alg.name(), above(&p));
        }
    }
    let best = plan_offsets(&allocs, 1, Algorithm::Best).unwrap();
    validate(&allocs, &best, 1).unwrap();
    assert!(above(&best) < 0.003, "default: {}", above(&best));
}

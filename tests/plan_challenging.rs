//! Offset planning on hard inputs: MiniMalloc's "challenging" instances
//! (`tests/data/planner/`, half-open lifetimes `[lower, upper)` read as inclusive last uses
//! `upper - 1`), budgets, proof flags and determinism. `cargo bench --bench plan` with
//! `TENSORALLOC_BENCH_EXACT=1` times the exact search on all eleven.

use std::path::PathBuf;
use std::sync::OnceLock;

use tensoralloc::plan::{
    lower_bound, plan_offsets, plan_offsets_with, traces, validate, Algorithm, Allocation,
    PlanOptions, PlanOutcome,
};

const NAMES: [&str; 11] = ["A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K"];

fn instance(name: &str) -> Vec<Allocation> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/planner")
        .join(format!("{name}.1048576.csv"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    traces::minimalloc_csv(&text).unwrap()
}

fn budget(work: u64) -> PlanOptions {
    PlanOptions {
        work_budget: Some(work),
        time_limit: None,
    }
}

/// The instances whose lower bound is a reachable arena (MiniMalloc's capacity for all but
/// C, D and J; C's optimum is its bound too).
const AT_THE_BOUND: [&str; 9] = ["A", "B", "C", "E", "F", "G", "H", "I", "K"];

/// Work enough for `exact` to prove each of [`AT_THE_BOUND`] optimal: 4.6·10^7 to 6.2·10^7
/// units for A, B and E, less for the others (B needs the pruning of states that failed
/// before: without it, 9.4·10^7).
const PROOF_WORK: u64 = 70_000_000;

#[test]
fn exact_proves_the_lower_bound_optimal_on_every_instance_where_it_is_reachable() {
    for name in AT_THE_BOUND {
        let allocs = instance(name);
        let bound = lower_bound(&allocs, 1).unwrap();
        let out = plan_offsets_with(&allocs, 1, Algorithm::Exact, &budget(PROOF_WORK)).unwrap();
        validate(&allocs, &out.plan, 1).unwrap();
        assert_eq!(out.plan.arena_size, bound, "{name}");
        assert!(out.proven_optimal, "{name}");
    }
}

/// The default refines a plan with a share of its budget in proportion to how far the plan
/// is above the lower bound: instance A under a block live throughout, a thousand times A's
/// bound, keeps A's excess in bytes, which is then a few hundred-thousandths of the bound.
#[test]
fn the_default_spends_little_refining_a_plan_close_to_the_lower_bound() {
    let work = 20_000_000;
    let alone = plan_offsets_with(&instance("A"), 1, Algorithm::Best, &budget(work)).unwrap();
    assert!(alone.work > work / 2, "A alone: {} units", alone.work);
    let mut allocs = instance("A");
    let end = allocs.iter().map(|a| a.last_use).max().unwrap();
    allocs.push(Allocation::new(
        1000 * lower_bound(&allocs, 1).unwrap(),
        0,
        end,
    ));
    let bound = lower_bound(&allocs, 1).unwrap();
    let out = plan_offsets_with(&allocs, 1, Algorithm::Best, &budget(work)).unwrap();
    validate(&allocs, &out.plan, 1).unwrap();
    assert!(out.work < work / 100, "{} units", out.work);
    assert!(out.plan.arena_size - bound < bound / 1000);
    // `exact` still spends what it is given.
    let exact = plan_offsets_with(&allocs, 1, Algorithm::Exact, &budget(work)).unwrap();
    assert!(exact.work > work / 2, "exact: {} units", exact.work);
}

/// The default plan of every instance, computed once for the tests that read it.
fn default_plans() -> &'static [PlanOutcome] {
    static PLANS: OnceLock<Vec<PlanOutcome>> = OnceLock::new();
    PLANS.get_or_init(|| {
        NAMES
            .iter()
            .map(|name| {
                plan_offsets_with(&instance(name), 1, Algorithm::Best, &PlanOptions::default())
                    .unwrap()
            })
            .collect()
    })
}

#[test]
fn the_default_plan_of_every_challenging_instance_is_valid_and_never_larger_than_pytorch() {
    for (name, out) in NAMES.into_iter().zip(default_plans()) {
        let allocs = instance(name);
        validate(&allocs, &out.plan, 1).unwrap();
        let pytorch = plan_offsets(&allocs, 1, Algorithm::Pytorch).unwrap();
        assert!(out.plan.arena_size <= pytorch.arena_size, "{name}");
        assert!(
            out.plan.arena_size >= lower_bound(&allocs, 1).unwrap(),
            "{name}"
        );
    }
}

/// Asserts that the default plan of each of `names` is at most `num / den` × its lower bound.
fn assert_default_within(names: &[&str], num: u64, den: u64) {
    for (name, out) in NAMES.into_iter().zip(default_plans()) {
        if !names.contains(&name) {
            continue;
        }
        let bound = lower_bound(&instance(name), 1).unwrap();
        assert!(
            out.plan.arena_size * den <= bound * num,
            "{name}: {} / {bound}",
            out.plan.arena_size
        );
    }
}

#[test]
fn the_default_plan_is_within_a_tenth_of_the_lower_bound_on_every_instance() {
    assert_default_within(&NAMES, 11, 10);
}

#[test]
fn the_default_plan_is_proven_optimal_on_instances_c_g_h_i_and_k() {
    for (name, out) in NAMES.into_iter().zip(default_plans()) {
        if ["C", "G", "H", "I", "K"].contains(&name) {
            assert!(out.proven_optimal, "{name}");
            assert_eq!(
                out.plan.arena_size,
                lower_bound(&instance(name), 1).unwrap(),
                "{name}"
            );
        }
    }
}

#[test]
fn an_exhausted_budget_returns_a_valid_plan_not_proven_optimal() {
    let allocs = instance("D");
    let out = plan_offsets_with(&allocs, 1, Algorithm::Exact, &budget(200_000)).unwrap();
    validate(&allocs, &out.plan, 1).unwrap();
    assert!(!out.proven_optimal);
    assert!(out.work <= 200_000, "spent {}", out.work);
    for baseline in [
        Algorithm::Pytorch,
        Algorithm::GreedyBySize,
        Algorithm::GreedyByBreadth,
    ] {
        assert!(out.plan.arena_size <= plan_offsets(&allocs, 1, baseline).unwrap().arena_size);
    }
}

#[test]
fn the_work_spent_never_exceeds_the_budget() {
    for work in [1, 1_000, 50_000, 400_000] {
        let allocs = instance("A");
        for algorithm in [Algorithm::Best, Algorithm::Exact] {
            let out = plan_offsets_with(&allocs, 1, algorithm, &budget(work)).unwrap();
            assert!(
                out.work <= work,
                "{}: {} > {work}",
                algorithm.name(),
                out.work
            );
            validate(&allocs, &out.plan, 1).unwrap();
        }
    }
}

#[test]
fn a_budget_gives_the_same_plan_every_time() {
    let allocs = instance("B");
    let first = plan_offsets_with(&allocs, 1, Algorithm::Exact, &budget(300_000)).unwrap();
    let second = plan_offsets_with(&allocs, 1, Algorithm::Exact, &budget(300_000)).unwrap();
    assert_eq!(first, second);
}

#[test]
fn plans_do_not_depend_on_which_threads_run_them() {
    let allocs = instance("F");
    let here = plan_offsets_with(&allocs, 1, Algorithm::Best, &PlanOptions::default()).unwrap();
    let elsewhere: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    plan_offsets_with(&allocs, 1, Algorithm::Best, &PlanOptions::default()).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for out in elsewhere {
        assert_eq!(out, here);
    }
}

#[test]
fn a_plan_at_the_lower_bound_is_proven_optimal_without_search() {
    let allocs = vec![
        Allocation::new(100, 0, 3),
        Allocation::new(50, 2, 5),
        Allocation::new(70, 4, 6),
    ];
    for algorithm in Algorithm::all() {
        let out = plan_offsets_with(&allocs, 1, algorithm, &PlanOptions::default()).unwrap();
        assert_eq!(out.plan.arena_size, 150);
        assert!(out.proven_optimal, "{}", algorithm.name());
        assert_eq!(out.work, 0);
    }
}

#[test]
fn exact_proves_a_plan_above_the_lower_bound_optimal() {
    // Three allocations pairwise live together in a cycle of time steps cannot all be
    // stacked two at a time: a and b overlap, b and c, and c and a, with at most two live
    // at once, so the bound (two) is not reachable when the sizes differ.
    let allocs = vec![
        Allocation::new(64, 0, 1),
        Allocation::new(128, 1, 2),
        Allocation::new(192, 2, 3),
        Allocation::new(128, 3, 4),
        Allocation::new(64, 0, 4),
    ];
    let bound = lower_bound(&allocs, 64).unwrap();
    let out = plan_offsets_with(&allocs, 64, Algorithm::Exact, &PlanOptions::default()).unwrap();
    validate(&allocs, &out.plan, 64).unwrap();
    assert!(out.proven_optimal);
    assert!(out.plan.arena_size >= bound);
    // Every layout: brute force over the offsets the exact search could choose.
    let mut smallest = u64::MAX;
    let step = 64;
    let mut offsets = vec![0u64; allocs.len()];
    fn visit(k: usize, offsets: &mut Vec<u64>, allocs: &[Allocation], step: u64, best: &mut u64) {
        if k == allocs.len() {
            let plan = tensoralloc::plan::OffsetPlan {
                offsets: offsets.clone(),
                arena_size: (0..allocs.len())
                    .map(|i| offsets[i] + allocs[i].size)
                    .max()
                    .unwrap(),
            };
            if validate(allocs, &plan, 64).is_ok() {
                *best = (*best).min(plan.arena_size);
            }
            return;
        }
        for o in 0..8 {
            offsets[k] = o * step;
            visit(k + 1, offsets, allocs, step, best);
        }
    }
    visit(0, &mut offsets, &allocs, step, &mut smallest);
    assert_eq!(out.plan.arena_size, smallest);
}

/// Sixteen allocations (sizes in units of 64 bytes, first and last use) whose lower bound,
/// 17 units, is out of reach: the smallest arena is 18 units.
const ABOVE_THE_BOUND: [(u64, u64, u64); 16] = include!("data/above_the_bound.rs");

fn above_the_bound() -> Vec<Allocation> {
    ABOVE_THE_BOUND
        .iter()
        .map(|&(units, first, last)| Allocation::new(64 * units, first, last))
        .collect()
}

#[test]
fn exact_proves_an_arena_above_the_lower_bound_optimal() {
    let allocs = above_the_bound();
    let out = plan_offsets_with(&allocs, 64, Algorithm::Exact, &PlanOptions::default()).unwrap();
    validate(&allocs, &out.plan, 64).unwrap();
    assert!(out.proven_optimal);
    assert_eq!(lower_bound(&allocs, 64).unwrap(), 17 * 64);
    assert_eq!(out.plan.arena_size, 18 * 64);
}

#[test]
fn copies_of_an_allocation_do_not_multiply_the_search() {
    // Proving the optimum means ruling out the arena one unit smaller; placing the copies
    // in every order (8! of them) before failing each time would multiply that work.
    let mut allocs = above_the_bound();
    allocs.extend(std::iter::repeat_n(Allocation::new(64, 0, 11), 8));
    let out = plan_offsets_with(&allocs, 64, Algorithm::Exact, &budget(10_000_000)).unwrap();
    validate(&allocs, &out.plan, 64).unwrap();
    assert!(out.proven_optimal, "spent {}", out.work);
    assert_eq!(out.plan.arena_size, (18 + 8) * 64);
}

mod capi {
    use std::ffi::CStr;
    use std::ptr::{null, null_mut};

    use tensoralloc::capi::plan::{
        tensoralloc_plan_offsets, tensoralloc_plan_offsets_ex, tensoralloc_plan_options,
        tensoralloc_plan_result,
    };
    use tensoralloc::capi::{
        tensoralloc_last_error, TENSORALLOC_ERR_INVALID_ARGUMENT, TENSORALLOC_OK,
    };

    fn last_error() -> String {
        // SAFETY: never NULL; lives until this thread's next call.
        unsafe { CStr::from_ptr(tensoralloc_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    const SIZES: [u64; 3] = [100, 50, 70];
    const FIRST: [u64; 3] = [0, 2, 4];
    const LAST: [u64; 3] = [3, 5, 6];

    fn call(
        algorithm: &CStr,
        options: Option<&tensoralloc_plan_options>,
        first: &[u64; 3],
        alignment: u64,
        offsets: &mut [u64; 3],
        result: *mut tensoralloc_plan_result,
    ) -> i32 {
        tensoralloc_plan_offsets_ex(
            3,
            SIZES.as_ptr(),
            first.as_ptr(),
            LAST.as_ptr(),
            alignment,
            algorithm.as_ptr(),
            options.map_or(null(), |o| o as *const _),
            offsets.as_mut_ptr(),
            result,
        )
    }

    #[test]
    fn the_extended_function_reports_the_bound_and_the_proof() {
        let mut offsets = [u64::MAX; 3];
        let mut result = tensoralloc_plan_result::default();
        assert_eq!(
            call(c"exact", None, &FIRST, 1, &mut offsets, &mut result),
            TENSORALLOC_OK
        );
        assert_eq!(result.arena_size, 150);
        assert_eq!(result.lower_bound, 150);
        assert_eq!(result.proven_optimal, 1);
        // The same offsets as the original function.
        let mut plain = [0u64; 3];
        let mut arena = 0;
        let status = tensoralloc_plan_offsets(
            3,
            SIZES.as_ptr(),
            FIRST.as_ptr(),
            LAST.as_ptr(),
            1,
            c"exact".as_ptr(),
            plain.as_mut_ptr(),
            &mut arena,
        );
        assert_eq!(status, TENSORALLOC_OK);
        assert_eq!((plain, arena), (offsets, 150));
    }

    #[test]
    fn the_extended_function_takes_a_budget() {
        let options = tensoralloc_plan_options {
            work_budget: 10,
            time_limit_ms: 1000,
        };
        let mut offsets = [u64::MAX; 3];
        let mut result = tensoralloc_plan_result::default();
        assert_eq!(
            call(
                c"default",
                Some(&options),
                &FIRST,
                1,
                &mut offsets,
                &mut result
            ),
            TENSORALLOC_OK
        );
        assert!(result.work <= 10);
    }

    #[test]
    fn bad_input_to_the_extended_function_writes_nothing() {
        let mut offsets = [7u64; 3];
        let mut result = tensoralloc_plan_result {
            arena_size: 9,
            ..Default::default()
        };
        let bad = |code: i32, what: &str| {
            assert_eq!(code, TENSORALLOC_ERR_INVALID_ARGUMENT, "{what}");
            assert!(!last_error().is_empty(), "{what}");
        };
        bad(
            call(c"no-such", None, &FIRST, 1, &mut offsets, &mut result),
            "unknown algorithm",
        );
        assert!(last_error().contains("no-such"));
        bad(
            call(c"exact", None, &[9, 2, 4], 1, &mut offsets, &mut result),
            "first > last",
        );
        bad(
            call(c"exact", None, &FIRST, 48, &mut offsets, &mut result),
            "alignment 48",
        );
        assert_eq!(offsets, [7; 3]);
        assert_eq!(result.arena_size, 9);
        bad(
            call(c"exact", None, &FIRST, 1, &mut offsets, null_mut()),
            "NULL result",
        );
        assert!(last_error().contains("result"));
        assert_eq!(offsets, [7; 3]);
    }
}

#[test]
fn minimalloc_csv_rows_become_inclusive_lifetimes_and_bad_rows_are_named() {
    let allocs = traces::minimalloc_csv("id,lower,upper,size\n0,5,9,100\n1,0,1,7\n").unwrap();
    assert_eq!(
        allocs,
        vec![Allocation::new(100, 5, 8), Allocation::new(7, 0, 0)]
    );
    let err = traces::minimalloc_csv("id,lower,upper,size\n0,5,5,100\n").unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");
    assert!(traces::minimalloc_csv("h\n0,1,x,3\n").is_err());
    assert!(traces::minimalloc_csv("h\n0,1,2\n").is_err());
}

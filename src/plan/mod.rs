//! Memory planners for static workloads: when the sizes and lifetimes of a workload's
//! allocations are known in advance, all of them can come from one arena laid out beforehand.
//!
//! - [`plan_offsets`] lays out allocations with known lifetimes in one arena (the `pytorch`
//!   baseline and better algorithms, see [`Algorithm`]); [`lower_bound`] and [`validate`]
//!   measure and prove a layout;
//! - [`profiling`]: an allocator that records one iteration, plans it, and serves later
//!   iterations from one blob (PyTorch's CPU profiling allocator, with a fallback instead of
//!   an exception when an iteration differs);
//! - [`storage`]: Static Runtime's storage-group planner (values that never live at the same
//!   time share a storage group; one buffer per iteration sized by what each group held);
//! - [`memory`]: where the planners' blobs and fallback allocations come from (host or device).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod canonical;
mod check;
mod greedy;
pub mod memory;
mod offsets;
pub mod profiling;
pub mod storage;
pub mod traces;

pub use check::{lower_bound, validate};

/// One allocation to place: its size in bytes and its lifetime, the inclusive range of time
/// steps during which it is live. Two allocations are live together when their ranges meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Allocation {
    /// Bytes requested (rounded up to the plan's alignment when placed).
    pub size: u64,
    /// First time step at which the allocation is live.
    pub first_use: u64,
    /// Last time step at which the allocation is live (inclusive).
    pub last_use: u64,
}

impl Allocation {
    /// An allocation of `size` bytes live from `first_use` to `last_use` inclusive.
    pub fn new(size: u64, first_use: u64, last_use: u64) -> Allocation {
        Allocation {
            size,
            first_use,
            last_use,
        }
    }

    /// Whether `self` and `other` are live at some common time step.
    pub fn overlaps_in_time(&self, other: &Allocation) -> bool {
        self.first_use <= other.last_use && other.first_use <= self.last_use
    }
}

/// A layout: the offset of each allocation in the arena, and the arena's size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetPlan {
    /// Offset of allocation `i` from the start of the arena; a multiple of the alignment.
    pub offsets: Vec<u64>,
    /// Bytes the arena needs: the largest `offset + aligned size`.
    pub arena_size: u64,
}

/// The offset-planning algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// The smallest of the greedy placements below and first fit by size class (the power of
    /// two at or below the size; longest lifetime first, or earliest first use first), first
    /// fit by size first (all of them, stopping at the lower bound; fewer on inputs so dense
    /// that they would be slow) and, when none reaches the bound, [`Algorithm::Pytorch`];
    /// then, still above the bound, within 20,000,000 (`DEFAULT_BEST_WORK`) work units unless
    /// [`PlanOptions::work_budget`] says otherwise: on inputs of up to 1,024 nonzero
    /// allocations, greedy passes in perturbed size orders and a canonical search (see
    /// `Exact`); on larger ones, first-fit passes that each place earlier the allocations the
    /// last plan put above the lower bound. Never larger than `Pytorch` on any input.
    Best,
    /// PyTorch's profiling-allocator plan: allocations and frees in time order, best fit among
    /// free gaps, coalescing on free, growing the arena at its end.
    Pytorch,
    /// Largest allocation first, each placed in the smallest gap among the already placed
    /// allocations it is live with (Pisarchyk & Lee 2020; TFLite's arena planner). In every
    /// greedy order, tiny allocations (at most a 2^-20th of the lower bound: thousands of
    /// 4-byte ones in real models) come after all the others, each in the lowest gap that
    /// holds it, or on top of its neighbours when more than 64 busy ranges lie between its
    /// lowest free byte and that gap. A first-fit placement whose larger allocations found
    /// their gaps above 64 busy ranges each on average instead puts every allocation of at most
    /// a 2^-19th of the bound in a region of its own above all the others, in time order,
    /// unless such allocations have more than a 256th of the bound live at once.
    GreedyBySize,
    /// Time steps with the most live bytes first; within one, largest allocation first
    /// (Pisarchyk & Lee 2020, "greedy by breadth"), placed as in `GreedyBySize`.
    GreedyByBreadth,
    /// Largest size × lifetime first, placed as in `GreedyBySize`.
    GreedyByArea,
    /// Longest lifetime first, then largest, placed as in `GreedyBySize`.
    GreedyByLifetime,
    /// Allocation order (first use), each placed in the smallest gap among the live ones.
    GreedyByTime,
    /// Largest allocation first, as in `GreedyBySize`, each placed in the lowest gap that
    /// holds it among the already placed allocations it is live with (first fit decreasing).
    /// The fastest greedy pass on dense inputs, and the tightest where sizes span many
    /// magnitudes.
    FirstFitBySize,
    /// Every greedy order, then a search over canonical layouts (each allocation at offset 0
    /// or on top of one it is live with, placed in offset order; pruned by section capacity,
    /// dominance and symmetry, split where time decomposes) for inputs of up to 4,096 nonzero
    /// allocations, within 10,000,000,000 (`DEFAULT_EXACT_WORK`) work units unless
    /// [`PlanOptions::work_budget`] says otherwise. [`plan_offsets_with`] says whether the
    /// plan is proven optimal.
    Exact,
}

impl Algorithm {
    /// Every algorithm, in the order their names are listed.
    pub fn all() -> [Algorithm; 9] {
        [
            Algorithm::Best,
            Algorithm::Pytorch,
            Algorithm::GreedyBySize,
            Algorithm::GreedyByBreadth,
            Algorithm::GreedyByArea,
            Algorithm::GreedyByLifetime,
            Algorithm::GreedyByTime,
            Algorithm::FirstFitBySize,
            Algorithm::Exact,
        ]
    }

    /// The name the C API and the JSON plans use.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Best => "best",
            Algorithm::Pytorch => "pytorch",
            Algorithm::GreedyBySize => "greedy-by-size",
            Algorithm::GreedyByBreadth => "greedy-by-breadth",
            Algorithm::GreedyByArea => "greedy-by-area",
            Algorithm::GreedyByLifetime => "greedy-by-lifetime",
            Algorithm::GreedyByTime => "greedy-by-time",
            Algorithm::FirstFitBySize => "first-fit-by-size",
            Algorithm::Exact => "exact",
        }
    }

    /// The algorithm called `name` (`"default"` is [`Algorithm::Best`]).
    pub fn from_name(name: &str) -> Result<Algorithm> {
        if name == "default" {
            return Ok(Algorithm::Best);
        }
        Algorithm::all()
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Algorithm::all().iter().map(|a| a.name()).collect();
                Error::InvalidArgument(format!(
                    "unknown planning algorithm \"{name}\" (known: default, {})",
                    names.join(", ")
                ))
            })
    }
}

/// Alignment of every offset when the caller has no other need: 64 bytes, a cache line and
/// enough for any vector load.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 64;

/// Lays out `allocs` in one arena with `algorithm`: every offset is a multiple of `alignment`
/// (a power of two), and allocations live at the same time never share a byte. Sizes are
/// rounded up to the alignment. Zero-byte allocations get offset 0.
///
/// Fails when the alignment is not a power of two, a lifetime ends before it starts, or the
/// aligned sizes add up to more than `u64::MAX` bytes.
pub fn plan_offsets(
    allocs: &[Allocation],
    alignment: u64,
    algorithm: Algorithm,
) -> Result<OffsetPlan> {
    Ok(plan_offsets_with(allocs, alignment, algorithm, &PlanOptions::default())?.plan)
}

/// Limits on the search of [`Algorithm::Best`] and [`Algorithm::Exact`] (the other algorithms
/// do not search and ignore them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanOptions {
    /// Work units the search may spend (allocations scanned, sections checked, neighbours
    /// updated; roughly 6·10^8 to 9·10^8 a second of search on one core), and with it the
    /// greedy passes that refine `Best`'s plan, each costing its pairs of allocations live
    /// together plus its allocations. `None`: 20,000,000 (`DEFAULT_BEST_WORK`)
    /// for `Best`, 10,000,000,000 (`DEFAULT_EXACT_WORK`) for `Exact`. `Best` spends all of it
    /// only on a plan at least 1/16 above the lower bound, and a share in proportion to the
    /// excess below that. The plan depends only on the input and this budget, never on the
    /// machine.
    pub work_budget: Option<u64>,
    /// Wall-clock cap: the search stops early when it passes, so a plan under a time limit
    /// may differ between runs; leave `None` for reproducible plans.
    pub time_limit: Option<Duration>,
}

/// Work budget of the default algorithm's search when the greedy orders miss the lower
/// bound (tens of milliseconds at most).
pub(crate) const DEFAULT_BEST_WORK: u64 = 20_000_000;
/// Work budget of [`Algorithm::Exact`] when the caller gives none: 12–17 s on MiniMalloc's
/// challenging instances D and J, where it runs out (one core of a 2-core cloud machine), well
/// within a minute. On J it finds a layout 1.0352 times the lower bound, where 4·10^9 found
/// 1.0487 and 6·10^9–8·10^9 found 1.0476.
pub(crate) const DEFAULT_EXACT_WORK: u64 = 10_000_000_000;

/// A plan and what is known about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanOutcome {
    /// The layout.
    pub plan: OffsetPlan,
    /// No layout of the input has a smaller arena (the plan meets the lower bound, or a
    /// search finished).
    pub proven_optimal: bool,
    /// Work units the search spent (0 when none ran).
    pub work: u64,
}

/// [`plan_offsets`] with a budget, saying whether the plan is proven optimal.
pub fn plan_offsets_with(
    allocs: &[Allocation],
    alignment: u64,
    algorithm: Algorithm,
    options: &PlanOptions,
) -> Result<PlanOutcome> {
    let problem = Problem::new(allocs, alignment)?;
    let deadline = options
        .time_limit
        .and_then(|t| Instant::now().checked_add(t));
    let outcome = match algorithm {
        Algorithm::Best => problem.best(
            false,
            options.work_budget.unwrap_or(DEFAULT_BEST_WORK),
            deadline,
        ),
        Algorithm::Exact => problem.best(
            true,
            options.work_budget.unwrap_or(DEFAULT_EXACT_WORK),
            deadline,
        ),
        Algorithm::Pytorch => problem.known(problem.pytorch()),
        greedy => problem.known(problem.greedy(offsets::Order::of(greedy))),
    };
    debug_assert!(validate(allocs, &outcome.plan, alignment).is_ok());
    Ok(outcome)
}

/// The checked input of a planner: sizes rounded up to the alignment, lifetimes verified.
pub(crate) struct Problem {
    /// Aligned sizes.
    pub(crate) sizes: Vec<u64>,
    pub(crate) first: Vec<u64>,
    pub(crate) last: Vec<u64>,
}

impl Problem {
    pub(crate) fn new(allocs: &[Allocation], alignment: u64) -> Result<Problem> {
        check_alignment(alignment)?;
        // Planners index allocations with 32-bit integers.
        if allocs.len() >= u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "{} allocations are more than a plan can hold ({} at most)",
                allocs.len(),
                u32::MAX - 1
            )));
        }
        let mut total: u128 = 0;
        let mut sizes = Vec::with_capacity(allocs.len());
        for (i, a) in allocs.iter().enumerate() {
            if a.first_use > a.last_use {
                return Err(Error::InvalidArgument(format!(
                    "allocation {i} ends (last use {}) before it starts (first use {})",
                    a.last_use, a.first_use
                )));
            }
            let aligned = align_up(a.size, alignment).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "allocation {i} has an absurd size ({} bytes)",
                    a.size
                ))
            })?;
            total += u128::from(aligned);
            sizes.push(aligned);
        }
        if total > u128::from(u64::MAX) {
            return Err(Error::InvalidArgument(format!(
                "the allocations add up to {total} bytes, more than any arena can hold"
            )));
        }
        Ok(Problem {
            sizes,
            first: allocs.iter().map(|a| a.first_use).collect(),
            last: allocs.iter().map(|a| a.last_use).collect(),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.sizes.len()
    }
}

/// Rejects alignments that are zero or not a power of two.
pub(crate) fn check_alignment(alignment: u64) -> Result<()> {
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(Error::InvalidArgument(format!(
            "alignment must be a nonzero power of two, not {alignment}"
        )));
    }
    Ok(())
}

/// `size` rounded up to a multiple of `alignment` (a power of two); `None` on overflow.
pub(crate) fn align_up(size: u64, alignment: u64) -> Option<u64> {
    Some(size.checked_add(alignment - 1)? & !(alignment - 1))
}

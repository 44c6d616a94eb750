//! Heuristic offset planners: PyTorch's event-order best fit (the baseline), and greedy
//! placement among the already placed allocations one is live with, under several orderings;
//! [`Problem::best`] keeps the smallest of them all.

use std::collections::{BTreeMap, BTreeSet};

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Instant;

use super::canonical::Schedule;
use super::greedy::{Fit, Greedy};
use super::{Algorithm, OffsetPlan, PlanOutcome, Problem};

/// Inputs with more nonzero allocations than this are left to the heuristics (the search
/// keeps an order of the unplaced allocations for each allocation placed, and its tables grow
/// with the allocations live at once).
pub(crate) const SEARCH_LIMIT: usize = 4096;
/// The default searches canonical layouts only for inputs of up to this many nonzero
/// allocations, and refines larger ones with promoting passes ([`Problem::promoting_passes`]).
/// On dense graphs of sharded models (`traces::sharded_graph`) the search brings 500–700
/// allocations from 1.03 to 1.000–1.007 of the bound where promoting passes stay near 1.03;
/// from 900 on it found nothing within the budget there, nor on MindSpore's ResNet-50
/// lifetimes (1,042), while promoting passes did better in half the time.
const SEARCH_PAYS: usize = 1024;
/// Most greedy passes in perturbed orders before the search (half the budget at most).
const PERTURBED_PASSES: u64 = 64;
/// A promoting pass multiplies the priority of an allocation it promotes by 2 to this power.
const PROMOTION_SHIFT: u32 = 2;
/// Work `Best` spends on greedy strategies ([`STRATEGIES`]) after the first, counted as pairs
/// of allocations live together (plus allocations) per pass: dense inputs, where a layout's
/// free gaps are many and a pass slower, get fewer extra strategies and stay fast.
const BEST_GREEDY_WORK: usize = 4_000_000;
/// A plan more than this fraction of the lower bound above it (1/64) is far from it: the
/// default then tries the first [`BEST_FAR_STRATEGIES`] greedy strategies however dense the
/// input. On MindSpore's PanGu-2.6B lifetimes read half-open (18,692 allocations), size order
/// comes to 1.033 times the bound (first fit or best fit) and breadth order to 1.008; the
/// search cannot run on inputs that large, and perturbed passes would cost more than the
/// budget.
const BEST_FAR_EXCESS: u64 = 64;
/// How many greedy strategies the default tries on a dense input while its plan is far above
/// the lower bound ([`BEST_FAR_EXCESS`]).
const BEST_FAR_STRATEGIES: usize = 3;
/// Inputs with at least this many nonzero allocations have PyTorch's plan made on a second
/// thread while the greedy passes run (about 3 ms of the 13 ms that 12,000 allocations of a
/// real model take).
const PYTORCH_ALONGSIDE: usize = 4096;
/// `Best` spends its whole budget refining a plan at least this fraction of the lower bound
/// above it (1/16), and a share in proportion to the excess below that: refining can gain at
/// most the excess, and on real models, whose greedy plans come within a fraction of a
/// percent, the whole budget would cost a hundred milliseconds or more for hundredths of a
/// percent, if anything.
const BEST_FULL_EXCESS: u64 = 16;

/// What [`Problem::in_event_order`] does with a free gap that reaches the top of the busy
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Top {
    /// It stays a gap, and the top stays where it is (PyTorch's plan: its arena only grows).
    Kept,
    /// The top comes down to the gap's start: a later allocation too large for every gap
    /// starts there rather than above it.
    Lowered,
}

/// Which allocation the greedy planner places first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    Size,
    Breadth,
    Area,
    Lifetime,
    Time,
    /// Decreasing size class (the power of two at or below the size), then decreasing
    /// lifetime, then decreasing size.
    ClassByLifetime,
    /// Decreasing size class, then first use, then decreasing size.
    ClassByTime,
}

impl Order {
    /// The greedy strategy of a named greedy algorithm: its order and the gap it takes.
    pub(crate) fn of(algorithm: Algorithm) -> (Order, Fit) {
        match algorithm {
            Algorithm::FirstFitBySize => (Order::Size, Fit::Lowest),
            Algorithm::GreedyByBreadth => (Order::Breadth, Fit::Smallest),
            Algorithm::GreedyByArea => (Order::Area, Fit::Smallest),
            Algorithm::GreedyByLifetime => (Order::Lifetime, Fit::Smallest),
            Algorithm::GreedyByTime => (Order::Time, Fit::Smallest),
            _ => (Order::Size, Fit::Smallest),
        }
    }
}

/// The greedy strategies `Best` tries, in turn. First fit by decreasing size comes first: it
/// is the cheapest pass on dense inputs (it stops at the first gap that holds an allocation,
/// where best fit reads every busy range of the allocation's lifetime), and on dense inputs
/// with sizes of every magnitude it packs far tighter than best fit, which leaves slivers too
/// small for anything later. Breadth order comes second: first fit and best fit by size
/// mostly agree, so a different order is the likelier gain when the work allows only two
/// passes (MindSpore's BERT-base lifetimes, where breadth order meets the bound). It goes by
/// first fit, then by best fit: on every real input measured the two breadth passes give the
/// same plan, and first fit takes half the time (MindSpore's PanGu-2.6B lifetimes read
/// half-open: 1.0076 times the bound either way, the default in 19 ms instead of 31). First fit
/// by size class, longest lifetime first, comes third: allocations of about one size placed
/// longest first tile time where strict size order leaves holes between them (a synthetic
/// mix of model traces, 2,000 allocations: 1.0063 times the bound by every other order, 1.0000
/// by this one; a dense graph of 4,000: 1.0213 by size, 1.0076). Size classes in time order come
/// last (MindSpore's ResNet-50 lifetimes read half-open: 1.0030 times the bound by every other
/// order, 1.0017 by this one).
pub(crate) const STRATEGIES: [(Order, Fit); 9] = [
    (Order::Size, Fit::Lowest),
    (Order::Breadth, Fit::Lowest),
    (Order::ClassByLifetime, Fit::Lowest),
    (Order::Breadth, Fit::Smallest),
    (Order::Size, Fit::Smallest),
    (Order::Area, Fit::Smallest),
    (Order::Lifetime, Fit::Smallest),
    (Order::Time, Fit::Smallest),
    (Order::ClassByTime, Fit::Lowest),
];

/// The conflict graph over the nonzero allocations, for the exact search. With the allocations
/// ranked by first use,
/// the neighbours of `i` that start at or after it are a run of ranks (those starting before
/// its last use), and the ones that start before it are the allocations still live when it
/// starts: only the latter are stored, in one sweep, half the graph and written in order.
pub(crate) struct Conflicts {
    /// Nonzero allocations by (first use, index).
    by_first: Vec<u32>,
    /// Rank of each allocation in `by_first` (unused for zero-sized ones).
    rank: Vec<u32>,
    /// `by_first[rank + 1..later_end[rank]]` start during the allocation's lifetime.
    later_end: Vec<u32>,
    /// `earlier[earlier_start[rank]..earlier_start[rank + 1]]` started before it and are live
    /// when it starts.
    earlier_start: Vec<usize>,
    earlier: Vec<u32>,
    /// Indices of the allocations with a nonzero size, ascending.
    pub(crate) nonzero: Vec<u32>,
}

impl Conflicts {
    pub(crate) fn of(p: &Problem) -> Conflicts {
        let nonzero: Vec<u32> = (0..p.len() as u32)
            .filter(|&i| p.sizes[i as usize] > 0)
            .collect();
        let mut by_first = nonzero.clone();
        by_first.sort_unstable_by_key(|&i| (p.first[i as usize], i));
        let mut rank = vec![u32::MAX; p.len()];
        for (r, &i) in by_first.iter().enumerate() {
            rank[i as usize] = r as u32;
        }
        let firsts: Vec<u64> = by_first.iter().map(|&i| p.first[i as usize]).collect();
        let later_end = by_first
            .iter()
            .map(|&i| firsts.partition_point(|&f| f <= p.last[i as usize]) as u32)
            .collect();
        let mut earlier_start = Vec::with_capacity(by_first.len() + 1);
        let mut earlier = Vec::new();
        let mut active: Vec<u32> = Vec::new();
        for &i in &by_first {
            let first = p.first[i as usize];
            active.retain(|&j| p.last[j as usize] >= first);
            earlier_start.push(earlier.len());
            earlier.extend_from_slice(&active);
            active.push(i);
        }
        earlier_start.push(earlier.len());
        Conflicts {
            by_first,
            rank,
            later_end,
            earlier_start,
            earlier,
            nonzero,
        }
    }

    /// The allocations live at some time step together with nonzero allocation `i`.
    pub(crate) fn of_alloc(&self, i: usize) -> impl Iterator<Item = u32> + '_ {
        let r = self.rank[i] as usize;
        let earlier = &self.earlier[self.earlier_start[r]..self.earlier_start[r + 1]];
        let later = &self.by_first[r + 1..self.later_end[r] as usize];
        earlier.iter().chain(later).copied()
    }
}

impl Problem {
    /// PyTorch's plan (seed `CPUProfilingAllocator.cpp`), as it was meant to work: events in
    /// time order (at one time step, allocations before frees, since lifetimes are inclusive),
    /// each allocation in the smallest free gap that holds it (lowest offset among equals), or
    /// else at the end of the arena, which then grows; a free merges with the gaps on both
    /// sides. Unlike the original, equal-sized gaps do not replace each other and no entry is
    /// read after it is erased.
    pub(crate) fn pytorch(&self) -> OffsetPlan {
        self.pytorch_unless(&AtomicBool::new(false))
            .expect("never stopped")
    }

    /// [`Problem::pytorch`], or `None` once `stop` is set (looked at every few thousand
    /// events).
    fn pytorch_unless(&self, stop: &AtomicBool) -> Option<OffsetPlan> {
        let mut offsets = vec![0u64; self.len()];
        let nonzero = (0..self.len() as u32).filter(|&i| self.sizes[i as usize] > 0);
        let arena = self.in_event_order(nonzero, Top::Kept, &mut offsets, stop)?;
        Some(OffsetPlan {
            offsets,
            arena_size: arena,
        })
    }

    /// Places the allocations `which` (nonzero ones) in time order, as a running allocator
    /// would: each in the smallest free gap that holds it (the lowest among equals), or else
    /// at the top of the busy bytes, which then rise; a free merges with the gaps on both
    /// sides, and `top` says whether one that reaches the top lowers it. Writes their offsets
    /// to `offsets` and returns the highest the top rose, or `None` once `stop` is set
    /// (looked at every few thousand events).
    pub(crate) fn in_event_order(
        &self,
        which: impl Iterator<Item = u32>,
        top: Top,
        offsets: &mut [u64],
        stop: &AtomicBool,
    ) -> Option<u64> {
        // At one time step allocations come before frees: lifetimes are inclusive.
        let mut events: Vec<(u64, bool, u32)> = Vec::with_capacity(2 * self.len());
        for i in which {
            events.push((self.first[i as usize], false, i));
            events.push((self.last[i as usize], true, i));
        }
        events.sort_unstable();
        let mut by_size: BTreeSet<(u64, u64)> = BTreeSet::new();
        let mut by_start: BTreeMap<u64, u64> = BTreeMap::new();
        let (mut busy, mut peak) = (0u64, 0u64);
        for (k, (_, free, i)) in events.into_iter().enumerate() {
            if k % 4096 == 0 && stop.load(Relaxed) {
                return None;
            }
            let i = i as usize;
            let size = self.sizes[i];
            if !free {
                let fit = by_size.range((size, 0)..).next().copied();
                offsets[i] = match fit {
                    Some((gap, start)) => {
                        by_size.remove(&(gap, start));
                        by_start.remove(&start);
                        if gap > size {
                            by_size.insert((gap - size, start + size));
                            by_start.insert(start + size, gap - size);
                        }
                        start
                    }
                    None => {
                        busy += size;
                        peak = peak.max(busy);
                        busy - size
                    }
                };
            } else {
                let (mut start, mut len) = (offsets[i], size);
                if let Some(after) = by_start.remove(&(start + len)) {
                    by_size.remove(&(after, start + len));
                    len += after;
                }
                let before = by_start.range(..start).next_back().map(|(&s, &l)| (s, l));
                if let Some((s, l)) = before {
                    if s + l == start {
                        by_start.remove(&s);
                        by_size.remove(&(l, s));
                        start = s;
                        len += l;
                    }
                }
                if top == Top::Lowered && start + len == busy {
                    busy = start;
                } else {
                    by_start.insert(start, len);
                    by_size.insert((len, start));
                }
            }
        }
        Some(peak)
    }

    /// One greedy pass in the given order, each allocation in the gap `fit` picks.
    pub(crate) fn greedy(&self, (order, fit): (Order, Fit)) -> OffsetPlan {
        let nonzero = self.nonzero();
        let sequence = self.sequence(order, &nonzero);
        Greedy::new(self).pass(self, &sequence, fit)
    }

    /// Indices of the allocations with a nonzero size, ascending.
    pub(crate) fn nonzero(&self) -> Vec<u32> {
        (0..self.len() as u32)
            .filter(|&i| self.sizes[i as usize] > 0)
            .collect()
    }

    /// The nonzero allocations in the order `order` places them.
    fn sequence(&self, order: Order, nonzero: &[u32]) -> Vec<u32> {
        use std::cmp::Reverse;
        let len = |i: usize| self.last[i] - self.first[i];
        let keyed = |key: &dyn Fn(usize) -> (u128, u64, u64)| -> Vec<u32> {
            sorted(nonzero.iter().map(|&i| (key(i as usize), i)).collect())
        };
        match order {
            // The first order tried, so its sort matters: keys are packed into one word when
            // they fit (they do for any realistic trace), else into two.
            Order::Size => self.size_order(nonzero),
            Order::Area => keyed(&|i| {
                let area = u128::from(self.sizes[i]) * (u128::from(len(i)) + 1);
                (!area, !self.sizes[i], self.first[i])
            }),
            Order::Lifetime => keyed(&|i| {
                let key = (u128::from(len(i)) << 64) | u128::from(self.sizes[i]);
                (!key, self.first[i], 0)
            }),
            Order::Time => keyed(&|i| (u128::from(self.first[i]), !self.sizes[i], 0)),
            Order::ClassByLifetime => keyed(&|i| {
                let class = u128::from(self.sizes[i].ilog2());
                (
                    !((class << 64) | u128::from(len(i))),
                    !self.sizes[i],
                    self.first[i],
                )
            }),
            Order::ClassByTime => keyed(&|i| {
                let class = u128::from(self.sizes[i].ilog2());
                (!class, self.first[i], !self.sizes[i])
            }),
            Order::Breadth => {
                let key = self.breadth_keys(nonzero);
                sorted(
                    nonzero
                        .iter()
                        .map(|&i| {
                            let (breadth, step) = key[i as usize];
                            ((Reverse(breadth), step, Reverse(self.sizes[i as usize])), i)
                        })
                        .collect(),
                )
            }
        }
    }

    /// The nonzero allocations by decreasing size, then decreasing lifetime, then first use
    /// and index.
    fn size_order(&self, nonzero: &[u32]) -> Vec<u32> {
        let len = |i: usize| self.last[i] - self.first[i];
        let bits = |x: u64| u64::BITS - x.leading_zeros();
        // Sizes share their alignment's low zero bits.
        let shift = nonzero
            .iter()
            .map(|&i| self.sizes[i as usize].trailing_zeros())
            .min()
            .unwrap_or(0);
        let max = |f: &dyn Fn(usize) -> u64| nonzero.iter().map(|&i| f(i as usize)).max();
        let max_size = max(&|i| self.sizes[i] >> shift).unwrap_or(0);
        let max_len = max(&len).unwrap_or(0);
        let max_first = max(&|i| self.first[i]).unwrap_or(0);
        let (sb, lb, fb, ib) = (
            bits(max_size),
            bits(max_len),
            bits(max_first),
            bits(self.len() as u64),
        );
        if sb + lb + fb + ib <= u128::BITS {
            let mut keys: Vec<u128> = nonzero
                .iter()
                .map(|&i| {
                    let k = i as usize;
                    let size = u128::from(max_size - (self.sizes[k] >> shift));
                    let len = u128::from(max_len - len(k));
                    (((size << lb | len) << fb | u128::from(self.first[k])) << ib) | u128::from(i)
                })
                .collect();
            keys.sort_unstable();
            let index_mask = (1u128 << ib) - 1;
            return keys.into_iter().map(|k| (k & index_mask) as u32).collect();
        }
        let mut keyed: Vec<(u128, u128)> = nonzero
            .iter()
            .map(|&i| {
                let i = i as usize;
                let key = (u128::from(self.sizes[i]) << 64) | u128::from(len(i));
                (!key, (u128::from(self.first[i]) << 32) | i as u128)
            })
            .collect();
        keyed.sort_unstable();
        keyed.into_iter().map(|(_, k)| k as u32).collect()
    }

    /// For each allocation, the most bytes live at one time step of its lifetime, and the
    /// first such step (as an index into the sorted distinct first uses).
    fn breadth_keys(&self, nonzero: &[u32]) -> Vec<(u64, usize)> {
        // Live bytes only grow where an allocation starts, so the maximum over a lifetime is
        // reached at a first use inside it.
        let mut steps: Vec<u64> = nonzero.iter().map(|&i| self.first[i as usize]).collect();
        steps.sort_unstable();
        steps.dedup();
        let mut delta_start = vec![0u64; steps.len()];
        let mut delta_end = vec![0u64; steps.len() + 1];
        for &i in nonzero {
            let i = i as usize;
            let s = steps.partition_point(|&t| t < self.first[i]);
            let e = steps.partition_point(|&t| t <= self.last[i]);
            delta_start[s] += self.sizes[i];
            delta_end[e] += self.sizes[i];
        }
        let mut breadth = Vec::with_capacity(steps.len());
        let mut live = 0u64;
        for k in 0..steps.len() {
            live = live + delta_start[k] - delta_end[k];
            breadth.push(live);
        }
        let table = SparseMax::new(&breadth);
        let mut keys = vec![(0, 0); self.len()];
        for &i in nonzero {
            let i = i as usize;
            let s = steps.partition_point(|&t| t < self.first[i]);
            let e = steps.partition_point(|&t| t <= self.last[i]);
            keys[i] = table.max(s, e);
        }
        keys
    }

    /// A plan from an algorithm that does not search: proven optimal when it meets the
    /// lower bound.
    pub(crate) fn known(&self, plan: OffsetPlan) -> PlanOutcome {
        bounded(plan, self.lower_bound(), 0)
    }

    /// The smallest plan among PyTorch's and the greedy strategies (all of them unless the
    /// input is so dense that they would be slow; stopping early at the lower bound; every
    /// one with `exhaustive`), then, when none meets the lower bound, greedy passes in
    /// perturbed orders and a canonical search within `work` units (inputs of up to
    /// [`SEARCH_LIMIT`] nonzero allocations). Without `exhaustive`: within a share of `work`
    /// when the plan is close to the bound ([`BEST_FULL_EXCESS`]), and on inputs of more than
    /// [`SEARCH_PAYS`] nonzero allocations promoting passes instead.
    pub(crate) fn best(
        &self,
        exhaustive: bool,
        work: u64,
        deadline: Option<Instant>,
    ) -> PlanOutcome {
        let nonzero = self.nonzero();
        let mut sequences = Sequences::new(self, &nonzero);
        let mut greedy = Greedy::new(self);
        let bound = greedy.lower_bound();
        debug_assert_eq!(bound, self.lower_bound());
        let ((mut best, tried), pytorch) = if nonzero.len() >= PYTORCH_ALONGSIDE {
            // PyTorch's plan on a second thread while the greedy passes run: a few
            // milliseconds on large inputs, stopped when a greedy plan meets the bound. (On
            // one thread when none can be started.)
            let stop = AtomicBool::new(false);
            std::thread::scope(|scope| {
                let pytorch = std::thread::Builder::new()
                    .name("tensoralloc-plan".into())
                    .spawn_scoped(scope, || self.pytorch_unless(&stop))
                    .ok();
                let best = self.greedy_strategies(&mut greedy, &mut sequences, exhaustive, work);
                stop.store(best.0.arena_size == bound, Relaxed);
                let pytorch = pytorch.and_then(|t| {
                    t.join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                });
                (best, pytorch)
            })
        } else {
            (
                self.greedy_strategies(&mut greedy, &mut sequences, exhaustive, work),
                None,
            )
        };
        // PyTorch's plan can only win when the greedy ones missed the bound.
        if best.arena_size > bound {
            let pytorch = pytorch.unwrap_or_else(|| self.pytorch());
            if pytorch.arena_size < best.arena_size {
                best = pytorch;
            }
        }
        let work = if exhaustive {
            work
        } else {
            refining_share(work, best.arena_size - bound, bound)
        };
        if best.arena_size == bound || work == 0 {
            return bounded(best, bound, 0);
        }
        if !exhaustive && nonzero.len() > SEARCH_PAYS {
            let untried = &STRATEGIES[tried..];
            let (plan, spent) =
                self.promoting_passes(&mut greedy, &mut sequences, best, untried, work);
            return bounded(plan, bound, spent);
        }
        // Perturbed size orders: cheap, and often closer than any fixed order.
        let mut spent = 0u64;
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let pass_cost = greedy.work() as u64;
        let greedy_work = (work / 2).min(PERTURBED_PASSES * pass_cost);
        while best.arena_size > bound && spent + pass_cost <= greedy_work {
            spent += pass_cost;
            let sequence = sorted(
                nonzero
                    .iter()
                    .map(|&i| {
                        rng = splitmix(rng);
                        // Size scaled by a factor in [1/2, 1).
                        let noise = (rng >> 33) | (1 << 31);
                        let size = self.sizes[i as usize];
                        let key = ((u128::from(size) * u128::from(noise)) >> 32) as u64;
                        (!key, i)
                    })
                    .collect(),
            );
            let cap = Some(best.arena_size);
            if let Some(plan) = greedy.pass_under(self, &sequence, Fit::Smallest, cap) {
                best = plan;
            }
        }
        if best.arena_size == bound || nonzero.len() > SEARCH_LIMIT {
            return bounded(best, bound, spent);
        }
        let schedule = if exhaustive {
            Schedule::EXACT
        } else {
            Schedule::DEFAULT
        };
        let searched = self.canonical_search(best, bound, work - spent, schedule, deadline);
        PlanOutcome {
            plan: searched.plan,
            proven_optimal: searched.proven,
            work: spent + searched.work,
        }
    }

    /// Improves `best` with first-fit passes within `work` units (a pass costs the greedy
    /// planner's [`Greedy::work`]), stopping at the lower bound: first the first-fit strategies
    /// of `untried` (those the greedy phase left out), then promoting passes. In those,
    /// allocations go by decreasing priority, at first their size (ties as in size order);
    /// before each pass, every allocation that the last plan put above the lower bound (the
    /// best plan before the first pass) is promoted: its priority is multiplied by
    /// 2^[`PROMOTION_SHIFT`], so that it is placed before the allocations that squeezed it up.
    /// Returns the smallest plan and the work spent.
    fn promoting_passes(
        &self,
        greedy: &mut Greedy,
        sequences: &mut Sequences,
        mut best: OffsetPlan,
        untried: &[(Order, Fit)],
        work: u64,
    ) -> (OffsetPlan, u64) {
        use std::cmp::Reverse;
        let bound = greedy.lower_bound();
        let pass_cost = greedy.work() as u64;
        let mut spent = 0;
        for &(order, _) in untried.iter().filter(|(_, fit)| *fit == Fit::Lowest) {
            if best.arena_size == bound || spent + pass_cost > work {
                return (best, spent);
            }
            spent += pass_cost;
            let cap = Some(best.arena_size);
            if let Some(plan) = greedy.pass_under(self, sequences.get(order), Fit::Lowest, cap) {
                best = plan;
            }
        }
        let by_size = sequences.get(Order::Size);
        let mut rank = vec![0u32; self.len()];
        for (r, &i) in by_size.iter().enumerate() {
            rank[i as usize] = r as u32;
        }
        let mut shift = vec![0u32; self.len()];
        let mut last = best.clone();
        while best.arena_size > bound && spent + pass_cost <= work {
            spent += pass_cost;
            let sequence = sorted(
                sequences
                    .nonzero
                    .iter()
                    .map(|&i| {
                        let a = i as usize;
                        if last.offsets[a] + self.sizes[a] > bound {
                            // A size (below 2^64) shifted by at most 63 bits fits in 128.
                            shift[a] = (shift[a] + PROMOTION_SHIFT).min(63);
                        }
                        ((Reverse(u128::from(self.sizes[a]) << shift[a]), rank[a]), i)
                    })
                    .collect(),
            );
            last = greedy.pass(self, &sequence, Fit::Lowest);
            if last.arena_size < best.arena_size {
                best = last.clone();
            }
        }
        (best, spent)
    }

    /// The smallest plan of the greedy strategies ([`STRATEGIES`]), in turn until one meets
    /// the lower bound. All of them with `exhaustive`; otherwise fewer on dense inputs, where a
    /// pass's work is large: strategies after the first while their passes add up to
    /// [`BEST_GREEDY_WORK`], or to the share of `work` that refining the best plan so far would
    /// get ([`refining_share`]), and the first [`BEST_FAR_STRATEGIES`] while the best plan is far
    /// above the bound ([`BEST_FAR_EXCESS`]).
    fn greedy_strategies(
        &self,
        greedy: &mut Greedy,
        sequences: &mut Sequences,
        exhaustive: bool,
        work: u64,
    ) -> (OffsetPlan, usize) {
        let bound = greedy.lower_bound();
        let pass_work = greedy.work();
        let mut best: Option<OffsetPlan> = None;
        let mut tried = 0;
        for (k, (order, fit)) in STRATEGIES.into_iter().enumerate() {
            if let Some(b) = best.as_ref().filter(|_| !exhaustive) {
                let excess = b.arena_size - bound;
                let share = refining_share(work, excess, bound);
                let allowed = usize::try_from(share).unwrap_or(usize::MAX);
                let far = excess > bound / BEST_FAR_EXCESS && k < BEST_FAR_STRATEGIES;
                if k * pass_work > BEST_GREEDY_WORK.max(allowed) && !far {
                    break;
                }
            }
            // Strategies of one order share its sequence. A pass that reaches the best plan's
            // arena could not replace it: it is given up there.
            let cap = best.as_ref().map(|b| b.arena_size);
            tried += 1;
            if let Some(plan) = greedy.pass_under(self, sequences.get(order), fit, cap) {
                best = Some(plan);
            }
            if best.as_ref().is_some_and(|b| b.arena_size == bound) {
                break;
            }
        }
        (best.expect("at least one greedy pass runs"), tried)
    }
}

/// The work `Best` spends refining a plan `excess` bytes above the lower bound `bound`: all
/// of `work` from an excess of `bound / BEST_FULL_EXCESS` up, in proportion below.
fn refining_share(work: u64, excess: u64, bound: u64) -> u64 {
    let full = u128::from(bound / BEST_FULL_EXCESS).max(1);
    let share = u128::from(work) * u128::from(excess) / full;
    share.min(u128::from(work)) as u64
}

/// The indices of `keyed` in the order of their keys. Keys are computed once and sorted with
/// their index: cheaper than looking them up in every comparison.
fn sorted<K: Ord>(mut keyed: Vec<(K, u32)>) -> Vec<u32> {
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, i)| i).collect()
}

/// The placing sequences of the orders one call of [`Problem::best`] uses, each sorted once.
struct Sequences<'p> {
    problem: &'p Problem,
    nonzero: &'p [u32],
    known: Vec<(Order, Vec<u32>)>,
}

impl<'p> Sequences<'p> {
    fn new(problem: &'p Problem, nonzero: &'p [u32]) -> Self {
        Sequences {
            problem,
            nonzero,
            known: Vec::new(),
        }
    }

    /// The nonzero allocations in the order `order` places them.
    fn get(&mut self, order: Order) -> &[u32] {
        let at = match self.known.iter().position(|(of, _)| *of == order) {
            Some(at) => at,
            None => {
                let sequence = self.problem.sequence(order, self.nonzero);
                self.known.push((order, sequence));
                self.known.len() - 1
            }
        };
        &self.known[at].1
    }
}

/// A plan for an input whose lower bound is `bound`, found with `work` units of search.
fn bounded(plan: OffsetPlan, bound: u64, work: u64) -> PlanOutcome {
    PlanOutcome {
        proven_optimal: plan.arena_size == bound,
        plan,
        work,
    }
}

/// The next state of a splitmix64 generator (a fixed sequence: plans stay deterministic).
pub(crate) fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Range-maximum queries over a fixed array, answering with the value and its first index.
struct SparseMax {
    levels: Vec<Vec<(u64, usize)>>,
}

impl SparseMax {
    fn new(values: &[u64]) -> SparseMax {
        let mut levels = vec![values
            .iter()
            .enumerate()
            .map(|(k, &v)| (v, k))
            .collect::<Vec<_>>()];
        let better = |a: (u64, usize), b: (u64, usize)| if b.0 > a.0 { b } else { a };
        let mut width = 1;
        while 2 * width <= values.len() {
            let prev = levels.last().expect("one level at least");
            let next = (0..=values.len() - 2 * width)
                .map(|k| better(prev[k], prev[k + width]))
                .collect();
            levels.push(next);
            width *= 2;
        }
        SparseMax { levels }
    }

    /// Maximum over `values[s..e]` (`s < e`).
    fn max(&self, s: usize, e: usize) -> (u64, usize) {
        let level = (usize::BITS - 1 - (e - s).leading_zeros()) as usize;
        let a = self.levels[level][s];
        let b = self.levels[level][e - (1 << level)];
        if b.0 > a.0 {
            b
        } else {
            a
        }
    }
}

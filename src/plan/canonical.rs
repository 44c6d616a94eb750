//! Exact offset planning: a depth-first search over canonical layouts, after the ideas of
//! MiniMalloc (Moffitt, ASPLOS'23), answering "does a layout fit in `capacity` bytes?".
//!
//! Any layout can be pushed down until every allocation rests at offset 0 or on the end of an
//! allocation it is live with. Placing allocations in increasing (offset, rank) order, each at
//! the lowest offset its already placed neighbours allow, reaches every such layout, so the
//! search only branches on which allocation comes next. Time is cut into sections (one per
//! distinct first use: the allocations live then); the search prunes a branch when
//!
//! - the unplaced bytes of a section, stacked on the lowest offset any of them can still take
//!   (or on the offset of the next placement, below which nothing more goes), pass the
//!   capacity;
//! - the next allocation would leave room below it where another unplaced one fits whole
//!   (the layout with that one moved down is as good: dominance);
//! - it breaks the canonical order (symmetric orders of the same layout).
//!
//! A placement changes the sections of the allocation placed and of the neighbours it raises:
//! one run of sections, each checked against one remembered low allocation before its
//! members are scanned; the order of the unplaced allocations is kept sorted by merging in
//! the raised ones, not sorted anew.
//! When no unplaced allocation spans the boundary between two sections, the two sides are
//! solved apart (temporal decomposition). Work is counted (allocations scanned, sections
//! checked, neighbours updated), never timed, so a budget gives the same answer on any
//! machine; a deadline can only stop a search early.

use std::time::Instant;

use super::offsets::Conflicts;
use super::{OffsetPlan, Problem};

/// Static orders tried in turn (each by decreasing keys, then index), with a doubling budget:
/// different inputs fall fastest to different ones.
const PREORDERS: [[Key; 3]; 3] = [
    [Key::Length, Key::Area, Key::Total],
    [Key::Total, Key::Area, Key::Length],
    [Key::Total, Key::Length, Key::Area],
];

#[derive(Clone, Copy)]
enum Key {
    /// Time steps the allocation is live.
    Length,
    /// Size × length.
    Area,
    /// The most bytes live in one of its sections.
    Total,
}

const NONE: u64 = u64::MAX;

/// Where the optimising search probes between the largest capacity known to be too small
/// and the best plan: the lower end itself (a layout there is optimal), then a half and
/// three quarters of the way up (a looser capacity is usually quicker to fill).
const PROBES: [(u64, u64); 3] = [(0, 1), (1, 2), (3, 4)];

/// How the optimising search shares its work between the probe at the lower end and the
/// probes for a smaller layout.
#[derive(Clone, Copy)]
pub(crate) struct Schedule {
    /// The work of each probe for a smaller layout, as a fraction (numerator, denominator)
    /// of the work of the probe at the lower end.
    improve_share: (u64, u64),
    /// Each probe for a smaller layout is one depth-first search, in a static order that
    /// changes every other round, rather than the restarting portfolio of
    /// [`Decider::decide`] (whose restarts cost several times the work of the search that
    /// succeeds; the rounds' doubling work already restarts).
    one_order: bool,
}

impl Schedule {
    /// The default wants a small plan more than a proof: its probes for smaller layouts get
    /// twice the work of the probe at the lower bound, each spent on one search.
    pub(crate) const DEFAULT: Schedule = Schedule {
        improve_share: (2, 1),
        one_order: true,
    };
    /// `Exact` gives them an eighth, so that proving the bound costs little more than
    /// probing it alone.
    pub(crate) const EXACT: Schedule = Schedule {
        improve_share: (1, 8),
        one_order: false,
    };
}

/// The nonzero allocations of a problem as the search sees them.
struct Instance {
    /// Problem index of each local allocation.
    ids: Vec<u32>,
    size: Vec<u64>,
    length: Vec<u64>,
    /// Sections `lo[b]..hi[b]` are those the allocation is live in.
    lo: Vec<u32>,
    hi: Vec<u32>,
    /// Allocations live together with `b`: `adj[adj_start[b]..adj_start[b + 1]]`.
    adj_start: Vec<usize>,
    adj: Vec<u32>,
    /// Allocations live in section `s`: `members[members_start[s]..members_start[s + 1]]`.
    members_start: Vec<usize>,
    members: Vec<u32>,
    /// Bytes live in each section.
    total: Vec<u64>,
    /// Allocations live in both section `s` and `s + 1`.
    cuts: Vec<u32>,
}

impl Instance {
    fn of(p: &Problem) -> Instance {
        let conflicts = Conflicts::of(p);
        let ids = conflicts.nonzero.clone();
        let mut local = vec![u32::MAX; p.len()];
        for (k, &i) in ids.iter().enumerate() {
            local[i as usize] = k as u32;
        }
        let mut steps: Vec<u64> = ids.iter().map(|&i| p.first[i as usize]).collect();
        steps.sort_unstable();
        steps.dedup();
        let sections = steps.len();
        let (mut lo, mut hi) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        let mut count = vec![0usize; sections + 1];
        for &i in &ids {
            let i = i as usize;
            let l = steps.partition_point(|&t| t < p.first[i]);
            let h = steps.partition_point(|&t| t <= p.last[i]);
            lo.push(l as u32);
            hi.push(h as u32);
            for c in &mut count[l..h] {
                *c += 1;
            }
        }
        let mut members_start = vec![0usize; sections + 1];
        for s in 0..sections {
            members_start[s + 1] = members_start[s] + count[s];
        }
        let mut fill = members_start.clone();
        let mut members = vec![0u32; members_start[sections]];
        let mut total = vec![0u64; sections];
        let mut cuts = vec![0u32; sections.saturating_sub(1)];
        for b in 0..ids.len() {
            let size = p.sizes[ids[b] as usize];
            for s in lo[b] as usize..hi[b] as usize {
                members[fill[s]] = b as u32;
                fill[s] += 1;
                total[s] += size;
                if s + 1 < hi[b] as usize {
                    cuts[s] += 1;
                }
            }
        }
        let mut adj_start = Vec::with_capacity(ids.len() + 1);
        let mut adj = Vec::new();
        adj_start.push(0);
        for &i in &ids {
            adj.extend(conflicts.of_alloc(i as usize).map(|j| local[j as usize]));
            adj_start.push(adj.len());
        }
        Instance {
            size: ids.iter().map(|&i| p.sizes[i as usize]).collect(),
            length: ids
                .iter()
                .map(|&i| p.last[i as usize] - p.first[i as usize] + 1)
                .collect(),
            ids,
            lo,
            hi,
            adj_start,
            adj,
            members_start,
            members,
            total,
            cuts,
        }
    }

    /// Nonzero allocations.
    fn len(&self) -> usize {
        self.ids.len()
    }

    /// Problem index of local allocation `b`.
    fn id(&self, b: usize) -> usize {
        self.ids[b] as usize
    }

    fn neighbours(&self, b: usize) -> &[u32] {
        &self.adj[self.adj_start[b]..self.adj_start[b + 1]]
    }

    fn members(&self, s: usize) -> &[u32] {
        &self.members[self.members_start[s]..self.members_start[s + 1]]
    }
}

/// How a decision search ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// A layout within the capacity: [`Decider::solution`].
    Found,
    /// Proven: no layout fits in the capacity.
    Infeasible,
    /// The work budget ran out or the deadline passed first.
    Stopped,
}

/// Internal result of one (sub)search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Found,
    NotFound,
    Stopped,
}

/// A set of allocations and the sections they live in, searched on its own.
struct Partition {
    buffers: Vec<u32>,
    sections: (u32, u32),
}

/// Decision searches over one instance.
struct Decider<'a> {
    inst: &'a Instance,
    capacity: u64,
    offset: Vec<u64>,
    min_offset: Vec<u64>,
    total: Vec<u64>,
    cuts: Vec<u32>,
    solution: Vec<u64>,
    /// Work left to the current heuristic's round and to the whole search.
    round_left: u64,
    work_left: u64,
    deadline: Option<Instant>,
    ticks: u32,
    out_of_time: bool,
    /// Allocations whose lowest offset a placement raised, with the offset before (a
    /// stack undone as the search backtracks).
    raised: Vec<(u32, u64)>,
    /// Scratch space of [`Decider::search`].
    moved: Vec<(u64, u32)>,
    /// Per section: an unplaced allocation that was low enough in the section last time it
    /// was checked (a hint only).
    witness: Vec<u32>,
}

impl<'a> Decider<'a> {
    fn new(inst: &'a Instance, deadline: Option<Instant>) -> Decider<'a> {
        let n = inst.len();
        let sections = inst.total.len();
        Decider {
            inst,
            capacity: 0,
            offset: vec![NONE; n],
            min_offset: vec![0; n],
            total: inst.total.clone(),
            cuts: inst.cuts.clone(),
            solution: vec![0; n],
            round_left: 0,
            work_left: 0,
            deadline,
            ticks: 0,
            out_of_time: false,
            raised: Vec::new(),
            moved: Vec::new(),
            witness: inst.members_start[..sections]
                .iter()
                .map(|&k| inst.members.get(k).copied().unwrap_or(0))
                .collect(),
        }
    }

    /// Offsets of the last layout found, by local allocation.
    fn solution(&self) -> &[u64] {
        &self.solution
    }

    /// Looks for a layout within `capacity` bytes, spending at most `*work` units (the rest
    /// is left in `*work`): by all static orders in turn with a doubling budget, or, given
    /// `order`, by one depth-first search in that order with the whole budget.
    fn decide(&mut self, capacity: u64, work: &mut u64, order: Option<usize>) -> Outcome {
        self.capacity = capacity;
        self.work_left = *work;
        let n = self.inst.len() as u64;
        if self.inst.size.iter().any(|&s| s > capacity) {
            return Outcome::Infeasible;
        }
        let whole = Partition {
            buffers: (0..n as u32).collect(),
            sections: (0, self.inst.total.len() as u32),
        };
        // Round robin over the static orders with a doubling budget, as a portfolio: a
        // complete search under any of them is a proof.
        let (mut limit, orders) = match order {
            Some(h) => (u64::MAX, h..h + 1),
            None => ((16 * n).max(1024), 0..PREORDERS.len()),
        };
        let outcome = 'rounds: loop {
            for h in orders.clone() {
                self.reset();
                self.round_left = limit.min(self.work_left);
                let before = self.round_left;
                let step = self.split(&whole, h, None);
                self.work_left -= before - self.round_left;
                match step {
                    Step::Found => break 'rounds Outcome::Found,
                    Step::NotFound => break 'rounds Outcome::Infeasible,
                    Step::Stopped if self.out_of_time || self.work_left == 0 => {
                        break 'rounds Outcome::Stopped
                    }
                    Step::Stopped => {}
                }
            }
            limit = limit.saturating_mul(2);
        };
        *work = self.work_left;
        outcome
    }

    fn reset(&mut self) {
        self.offset.iter_mut().for_each(|o| *o = NONE);
        self.min_offset.iter_mut().for_each(|o| *o = 0);
        self.total.copy_from_slice(&self.inst.total);
        self.cuts.copy_from_slice(&self.inst.cuts);
    }

    /// Spends `units` of work; false when the budget or the deadline is spent.
    fn spend(&mut self, units: u64) -> bool {
        if self.round_left < units {
            self.round_left = 0;
            return false;
        }
        self.round_left -= units;
        self.ticks += 1;
        if self.ticks >= 256 {
            self.ticks = 0;
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.out_of_time = true;
            }
        }
        !self.out_of_time
    }

    /// Solves `part`, split at the section boundaries no unplaced allocation crosses
    /// (`placed`: the allocation just placed, whose crossings no longer count).
    fn split(&mut self, part: &Partition, h: usize, placed: Option<usize>) -> Step {
        let (first, end) = part.sections;
        let mut cutpoints = vec![first];
        match placed {
            Some(b) => {
                let (l, e) = (self.inst.lo[b] as usize, self.inst.hi[b] as usize);
                for s in l..e - 1 {
                    if self.cuts[s] == 0 {
                        cutpoints.push(s as u32 + 1);
                    }
                }
            }
            None => {
                for s in first..end.saturating_sub(1) {
                    if self.cuts[s as usize] == 0 {
                        cutpoints.push(s + 1);
                    }
                }
            }
        }
        cutpoints.push(end);
        for w in cutpoints.windows(2) {
            let (l, e) = (w[0], w[1]);
            let buffers: Vec<u32> = part
                .buffers
                .iter()
                .copied()
                .filter(|&b| {
                    let b = b as usize;
                    self.offset[b] == NONE && self.inst.lo[b] < e && l < self.inst.hi[b]
                })
                .collect();
            if buffers.is_empty() {
                continue;
            }
            let sub = Partition {
                buffers,
                sections: (l, e),
            };
            let step = self.solve(&sub, h);
            if step != Step::Found {
                return step;
            }
        }
        Step::Found
    }

    /// Orders `part` by the static order `h`, then searches it.
    fn solve(&mut self, part: &Partition, h: usize) -> Step {
        let inst = self.inst;
        let key = |b: usize, k: Key| -> u128 {
            match k {
                Key::Length => u128::from(inst.length[b]),
                Key::Area => u128::from(inst.length[b]) * u128::from(inst.size[b]),
                Key::Total => u128::from(
                    (inst.lo[b]..inst.hi[b])
                        .map(|s| self.total[s as usize])
                        .max()
                        .unwrap_or(0),
                ),
            }
        };
        let mut keyed: Vec<([u128; 3], u32)> = part
            .buffers
            .iter()
            .map(|&b| {
                let k = PREORDERS[h].map(|k| u128::MAX - key(b as usize, k));
                (k, b)
            })
            .collect();
        keyed.sort_unstable();
        let preorder: Vec<u32> = keyed.into_iter().map(|(_, b)| b).collect();
        let ordering: Vec<(u64, u32)> = (0..preorder.len() as u32).map(|r| (0, r)).collect();
        self.search(part, &preorder, &ordering, 0, 0, h)
    }

    /// Places the next allocation of `part`: one of the unplaced ones at its lowest offset,
    /// not before (`min_offset`, `min_rank`) in (offset, rank) order.
    fn search(
        &mut self,
        part: &Partition,
        preorder: &[u32],
        previous: &[(u64, u32)],
        min_offset: u64,
        min_rank: u32,
        h: usize,
    ) -> Step {
        let units = (previous.len() + (part.sections.1 - part.sections.0) as usize) as u64;
        if !self.spend(units) {
            return Step::Stopped;
        }
        // The parent's order less what was placed, merged with the allocations raised since
        // (few, and usually all to one offset): cheaper than sorting anew.
        let mut ordering: Vec<(u64, u32)> = Vec::with_capacity(previous.len());
        let mut moved = std::mem::take(&mut self.moved);
        moved.clear();
        for &(o, r) in previous {
            let b = preorder[r as usize] as usize;
            if self.offset[b] != NONE {
                continue;
            }
            let m = self.min_offset[b];
            if m == o {
                ordering.push((o, r));
            } else {
                moved.push((m, r));
            }
        }
        if ordering.is_empty() && moved.is_empty() {
            self.moved = moved;
            return Step::Found;
        }
        if !moved.is_empty() {
            moved.sort_unstable();
            let stay = ordering.len();
            ordering.extend_from_slice(&moved);
            merge_sorted(&mut ordering, stay, &mut moved);
        }
        self.moved = moved;
        let min_height = ordering
            .iter()
            .map(|&(o, r)| o + self.inst.size[preorder[r as usize] as usize])
            .min()
            .expect("not empty");
        // Every allocation from here on goes at or above the one placed next, so each
        // section's unplaced bytes must fit above that offset.
        let (l, e) = (part.sections.0 as usize, part.sections.1 as usize);
        let highest = self.total[l..e].iter().copied().max().unwrap_or(0);
        let Some(ceiling) = self.capacity.checked_sub(highest) else {
            return Step::NotFound;
        };
        for k in 0..ordering.len() {
            let (offset, rank) = ordering[k];
            if (offset, rank) < (min_offset, min_rank) {
                continue;
            }
            if offset > ceiling {
                break;
            }
            // Something unplaced fits whole below: leaving that room empty is dominated.
            if offset >= min_height {
                break;
            }
            let b = preorder[rank as usize] as usize;
            let (step, hatless) = self.place(part, preorder, &ordering, b, offset, rank, h);
            if step != Step::NotFound {
                return step;
            }
            // Nothing unplaced is live with `b`: any layout of the rest that some other
            // choice here leads to also completes with `b` placed first (MiniMalloc's
            // "hatless" pruning).
            if hatless {
                break;
            }
        }
        Step::NotFound
    }

    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        part: &Partition,
        preorder: &[u32],
        ordering: &[(u64, u32)],
        b: usize,
        offset: u64,
        rank: u32,
        h: usize,
    ) -> (Step, bool) {
        let inst = self.inst;
        let size = inst.size[b];
        let height = offset + size;
        let (l, e) = (inst.lo[b] as usize, inst.hi[b] as usize);
        self.offset[b] = offset;
        self.solution[b] = offset;
        // Neighbours now rest at least on this allocation. The sections whose unplaced
        // allocations changed are this one's and those of the neighbours raised, all of which
        // meet this one's: one run of sections.
        let mut hatless = true;
        let (mut first, mut end) = (l, e);
        let mark = self.raised.len();
        for &o in inst.neighbours(b) {
            let o = o as usize;
            if self.offset[o] != NONE {
                continue;
            }
            hatless = false;
            if self.min_offset[o] < height {
                self.raised.push((o as u32, self.min_offset[o]));
                self.min_offset[o] = height;
                first = first.min(inst.lo[o] as usize);
                end = end.max(inst.hi[o] as usize);
            }
        }
        for s in l..e {
            self.total[s] -= size;
        }
        let mut scanned = (inst.neighbours(b).len() + (end - first)) as u64;
        let fits = self.sections_fit(first, end, &mut scanned);
        let mut step = Step::NotFound;
        if !self.spend(scanned) {
            step = Step::Stopped;
        } else if fits {
            for s in l..e.saturating_sub(1) {
                self.cuts[s] -= 1;
            }
            let splits = (l..e.saturating_sub(1)).any(|s| self.cuts[s] == 0);
            step = if splits {
                self.split(part, h, Some(b))
            } else {
                self.search(part, preorder, ordering, offset, rank, h)
            };
            for s in l..e.saturating_sub(1) {
                self.cuts[s] += 1;
            }
        }
        for s in l..e {
            self.total[s] += size;
        }
        for &(o, m) in self.raised[mark..].iter().rev() {
            self.min_offset[o as usize] = m;
        }
        self.raised.truncate(mark);
        self.offset[b] = NONE;
        (step, hatless)
    }

    /// Whether sections `first..end` can still hold their unplaced bytes: each needs one
    /// unplaced allocation low enough that all of them fit above it (the lowest any of them
    /// can go). The allocation last found is tried first, so that most checks look at one
    /// allocation rather than the section's. Adds the allocations scanned to `scanned`.
    fn sections_fit(&mut self, first: usize, end: usize, scanned: &mut u64) -> bool {
        let inst = self.inst;
        for s in first..end {
            let total = self.total[s];
            if total == 0 {
                continue;
            }
            let Some(room) = self.capacity.checked_sub(total) else {
                return false;
            };
            let w = self.witness[s] as usize;
            if self.offset[w] == NONE && self.min_offset[w] <= room {
                continue;
            }
            let members = inst.members(s);
            *scanned += members.len() as u64;
            let lowest = members
                .iter()
                .filter(|&&o| self.offset[o as usize] == NONE)
                .min_by_key(|&&o| self.min_offset[o as usize]);
            match lowest {
                Some(&o) if self.min_offset[o as usize] <= room => self.witness[s] = o,
                _ => return false,
            }
        }
        true
    }
}

/// Merges the sorted runs `items[..mid]` and `items[mid..]` in place, with `scratch` as
/// room for the second run.
fn merge_sorted<T: Copy + Ord>(items: &mut [T], mid: usize, scratch: &mut Vec<T>) {
    scratch.clear();
    scratch.extend_from_slice(&items[mid..]);
    // Fill from the back: the larger of the two runs' last items goes last.
    let (mut i, mut j, mut k) = (mid, scratch.len(), items.len());
    while j > 0 {
        if i > 0 && items[i - 1] > scratch[j - 1] {
            items[k - 1] = items[i - 1];
            i -= 1;
        } else {
            items[k - 1] = scratch[j - 1];
            j -= 1;
        }
        k -= 1;
    }
}

/// What an exact search ended with.
pub(crate) struct Searched {
    pub(crate) plan: OffsetPlan,
    /// No layout is smaller than `plan`.
    pub(crate) proven: bool,
    /// Work units spent.
    pub(crate) work: u64,
}

impl Problem {
    /// `incumbent` with the offsets of the search's `solution`.
    fn plan_of(&self, inst: &Instance, incumbent: &OffsetPlan, solution: &[u64]) -> OffsetPlan {
        let mut offsets = incumbent.offsets.clone();
        let mut arena = 0;
        for (b, &o) in solution.iter().enumerate() {
            offsets[inst.id(b)] = o;
            arena = arena.max(o + inst.size[b]);
        }
        OffsetPlan {
            offsets,
            arena_size: arena,
        }
    }

    /// Improves `incumbent` (a valid layout) by canonical search within `work` units (and
    /// `deadline`): layouts at the lower bound `bound` (optimal) and smaller than the
    /// incumbent, probed as `schedule` says. `proven` when the result is known optimal.
    pub(crate) fn canonical_search(
        &self,
        incumbent: OffsetPlan,
        bound: u64,
        alignment: u64,
        work: u64,
        schedule: Schedule,
        deadline: Option<Instant>,
    ) -> Searched {
        let mut best = incumbent;
        let mut left = work;
        if best.arena_size <= bound {
            return Searched {
                plan: best,
                proven: true,
                work: 0,
            };
        }
        let inst = Instance::of(self);
        let mut decider = Decider::new(&inst, deadline);
        // The optimum lies in lo..=best. Each round probes the capacities of `PROBES`, with
        // the work of each probe doubling from round to round, until lo meets the plan or
        // the budget is spent.
        let mut lo = bound;
        let mut slice = (64 * inst.len() as u64).max(4096);
        let mut round = 0;
        let proven = 'search: loop {
            for (k, &(num, den)) in PROBES.iter().enumerate() {
                if lo >= best.arena_size {
                    break 'search true;
                }
                if left == 0 || decider.out_of_time {
                    break 'search false;
                }
                let gap = (best.arena_size - lo) / alignment;
                let capacity = lo + gap * num / den * alignment;
                if k > 0 && capacity == lo {
                    continue;
                }
                let share = if k == 0 {
                    slice
                } else {
                    let (num, den) = schedule.improve_share;
                    slice.saturating_mul(num) / den
                };
                let mut probe = share.max(1).min(left);
                let before = probe;
                let order =
                    (schedule.one_order && k > 0).then_some((round / 2 + k) % PREORDERS.len());
                let outcome = decider.decide(capacity, &mut probe, order);
                left -= before - probe;
                match outcome {
                    Outcome::Found => best = self.plan_of(&inst, &best, decider.solution()),
                    Outcome::Infeasible => lo = capacity + alignment,
                    Outcome::Stopped => {}
                }
            }
            slice = slice.saturating_mul(2);
            round += 1;
        };
        Searched {
            plan: best,
            proven,
            work: work - left,
        }
    }
}

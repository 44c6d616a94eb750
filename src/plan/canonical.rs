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
//! - it breaks the canonical order (symmetric orders of the same layout);
//! - it places a copy of an allocation (same size, same sections) before the copies of
//!   smaller index (swapping copies gives the same layout);
//! - another choice follows one that had nothing unplaced live with it, and the rest did
//!   not fit after that one (they fit after no other: MiniMalloc's "hatless" pruning);
//! - (once a search has run for a while) it reaches a state a failed node had: the same
//!   unplaced allocations at the same lowest offsets, in the same part under the same order
//!   constraint, by another path (other allocations below them). Searches at capacities
//!   near the optimum revisit such states often, since many arrangements of what lies below
//!   leave the same tops behind.
//!
//! A placement changes the sections of the allocation placed and of the neighbours it raises:
//! one run of sections, each checked against one remembered low allocation before its
//! members are scanned; the order of the unplaced allocations is kept sorted by merging in
//! the raised ones, not sorted anew.
//!
//! When no unplaced allocation spans the boundary between two sections, the two sides are
//! solved apart (temporal decomposition). Capacities are probed in steps of the greatest
//! common divisor of the sizes (every canonical arena is a multiple of it), by a portfolio of
//! searches in fixed orders and, for `Exact`, restarts in perturbed orders. Work is counted
//! (allocations scanned, sections checked, neighbours updated), never timed, so a budget
//! gives the same answer on any machine; a deadline can only stop a search early.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Instant;

use super::offsets::{splitmix, Conflicts};
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

/// How the optimising search probes between the largest capacity known to be too small and
/// the best plan, and how it shares its work between the probes.
#[derive(Clone, Copy)]
pub(crate) struct Schedule {
    /// The capacities probed, as fractions (numerator, denominator) of the way up from the
    /// lower end to the best plan: the lower end itself first (a layout there is optimal).
    probes: &'static [(u64, u64)],
    /// The work of each probe for a smaller layout, as a fraction (numerator, denominator)
    /// of the work of the probe at the lower end.
    improve_share: (u64, u64),
    /// Whether probes spend a share on searches in perturbed orders ([`Probe`]).
    restarts: bool,
}

impl Schedule {
    /// The default wants a small plan more than a proof: it probes a half and three quarters
    /// of the way up (a layout there improves the plan by much more than one just below it
    /// would), each with twice the work of the probe at the lower bound.
    pub(crate) const DEFAULT: Schedule = Schedule {
        probes: &[(0, 1), (1, 2), (3, 4)],
        improve_share: (2, 1),
        restarts: false,
    };
    /// `Exact` also probes just below the best plan (a search there is quick when the plan
    /// is close to the optimum, as it is once the others have improved it), each probe with
    /// the work of the one at the lower end: proofs cost about four times the work of
    /// asking at the lower end alone, and where the bound cannot be reached (or not be
    /// ruled out) the plan gets closer to it.
    pub(crate) const EXACT: Schedule = Schedule {
        probes: &[(0, 1), (1, 2), (3, 4), (63, 64)],
        improve_share: (1, 1),
        restarts: true,
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
    /// The allocation of the same size and sections just before `b` (by index), or
    /// `u32::MAX`: interchangeable allocations are placed in index order.
    twin: Vec<u32>,
    /// Random factor and term of each allocation in [`Dfs::state`] (fixed seeds: the same
    /// on every run).
    zobrist: Vec<(u128, u128)>,
    /// The largest number all sizes are multiples of: so are all canonical offsets and
    /// arenas.
    step: u64,
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
        let size: Vec<u64> = ids.iter().map(|&i| p.sizes[i as usize]).collect();
        let mut twin = vec![u32::MAX; ids.len()];
        let mut last_of = std::collections::HashMap::new();
        for b in 0..ids.len() {
            if let Some(prev) = last_of.insert((size[b], lo[b], hi[b]), b as u32) {
                twin[b] = prev;
            }
        }
        let step = size.iter().fold(0, |g, &s| gcd(g, s)).max(1);
        let zobrist = (0..ids.len() as u64)
            .map(|b| {
                let words = [1, 2, 3, 4].map(|k| splitmix(b.wrapping_mul(4) + k));
                let wide = |hi: u64, lo: u64| u128::from(hi) << 64 | u128::from(lo);
                (wide(words[0], words[1]), wide(words[2], words[3]))
            })
            .collect();
        Instance {
            size,
            length: ids
                .iter()
                .map(|&i| (p.last[i as usize] - p.first[i as usize]).saturating_add(1))
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
            twin,
            zobrist,
            step,
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

    /// The share of unplaced allocation `b` at lowest offset `min_offset` in [`Dfs::state`].
    fn state_term(&self, b: usize, min_offset: u64) -> u128 {
        let (factor, term) = self.zobrist[b];
        factor
            .wrapping_mul(u128::from(min_offset))
            .wrapping_add(term)
    }

    fn neighbours(&self, b: usize) -> &[u32] {
        &self.adj[self.adj_start[b]..self.adj_start[b + 1]]
    }

    fn members(&self, s: usize) -> &[u32] {
        &self.members[self.members_start[s]..self.members_start[s + 1]]
    }

    /// The boundaries `b` is live across: `s` for each pair of sections `s`, `s + 1` it is
    /// live in (the `cuts` it counts in).
    fn crossings(&self, b: usize) -> std::ops::Range<usize> {
        self.lo[b] as usize..self.hi[b] as usize - 1
    }
}

/// How a decision search ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// A layout within the capacity: [`Dfs::solution`].
    Found,
    /// Proven: no layout fits in the capacity.
    Infeasible,
    /// The work given ran out or the deadline passed first; the search can go on.
    Stopped,
}

/// A set of allocations and the sections they live in, searched on its own.
struct Partition {
    buffers: Vec<u32>,
    sections: (u32, u32),
    /// Names the sections and the static order of the part's search in [`Dfs::failed`].
    key: u64,
}

/// The wall clock of one call: a deadline can only stop searches early.
struct Clock {
    deadline: Option<Instant>,
    ticks: u32,
    out_of_time: bool,
}

impl Clock {
    /// Whether the deadline has passed, looking at the time once in 256 calls.
    fn expired(&mut self) -> bool {
        self.ticks += 1;
        if self.ticks >= 256 {
            self.ticks = 0;
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.out_of_time = true;
            }
        }
        self.out_of_time
    }
}

/// A step of the depth-first search still under way.
enum Frame {
    /// Solving the independent parts of `part` one after the other: those of `windows` from
    /// `next` on are left.
    Split {
        part: Rc<Partition>,
        windows: Vec<(u32, u32)>,
        next: usize,
    },
    /// Choosing the next allocation of `part` to place: candidates of `ordering` from
    /// `next` on are left, none before (`min_offset`, `min_rank`) and none at or above
    /// `limit`. Until the node is entered, `limit` is `None` and `ordering` the parent's.
    Node {
        part: Rc<Partition>,
        preorder: Rc<[u32]>,
        ordering: Vec<(u64, u32)>,
        limit: Option<u64>,
        min_offset: u64,
        min_rank: u32,
        next: usize,
    },
    /// Allocation `b` placed, its raised neighbours from `raised` on in [`Dfs::raised`].
    Placed {
        b: u32,
        raised: usize,
        hatless: bool,
    },
}

/// One depth-first search for a layout within `capacity` bytes in one static order, which
/// stops when the work it is given runs out and goes on from there when given more.
struct Dfs<'a> {
    inst: &'a Instance,
    capacity: u64,
    order: usize,
    /// Nonzero: the static order's first key is scaled by a factor in [0.8, 1.2) drawn
    /// from this and the allocation (a restart that looks elsewhere first).
    seed: u64,
    offset: Vec<u64>,
    min_offset: Vec<u64>,
    total: Vec<u64>,
    cuts: Vec<u32>,
    solution: Vec<u64>,
    /// Allocations whose lowest offset a placement raised, with the offset before (a
    /// stack undone as the search backtracks).
    raised: Vec<(u32, u64)>,
    /// Scratch space of [`Dfs::enter`].
    moved: Vec<(u64, u32)>,
    /// Per section: an unplaced allocation that was low enough in the section last time it
    /// was checked (a hint only).
    witness: Vec<u32>,
    stack: Vec<Frame>,
    /// Orders of finished nodes, kept for new ones (no allocation per node).
    spare: Vec<Vec<(u64, u32)>>,
    /// What the frame last finished said to the one below: found, and whether the
    /// allocation it placed had nothing unplaced live with it.
    ret: Option<(bool, bool)>,
    /// Work left in the current run.
    left: u64,
    outcome: Option<Outcome>,
    /// Sum of `zobrist[b].0 × min_offset[b] + zobrist[b].1` over the unplaced allocations `b`
    /// (all computed modulo 2^128): with the part searched and the order constraint, what a
    /// node's search depends on. A linear hash with random factors: two different states
    /// share a sum with a chance around 2^-100 (factors of 2 in the offsets' differences
    /// cost a bit each), far too small to make a proof doubtful.
    state: u128,
    /// Keys ([`Dfs::node_key`]) of nodes whose search failed: a node reached again by
    /// another path (other allocations below, the same lowest offsets for the rest) fails
    /// again, and is not searched twice.
    failed: HashSet<u128, KeyHasher>,
    /// One bit per key of [`Dfs::failed`], at bits 20 to 38 of the key: most nodes were never
    /// met before, and this small table tells so without a look in the large one.
    failed_bits: Vec<u64>,
    /// Whether failed nodes are remembered and looked up: only once the search has spent
    /// [`MEMO_AFTER`] units (most searches that succeed do so before, and need not pay for
    /// the hashing; the ones that run long revisit states).
    memo: bool,
    /// Work units spent over all runs.
    spent: u64,
}

impl<'a> Dfs<'a> {
    /// A search in static order `order`, its first key scaled by factors drawn from `seed`
    /// when that is not zero.
    fn new(inst: &'a Instance, capacity: u64, order: usize, seed: u64) -> Dfs<'a> {
        let n = inst.len();
        let sections = inst.total.len();
        let whole = Rc::new(Partition {
            buffers: (0..n as u32).collect(),
            sections: (0, sections as u32),
            key: 0,
        });
        let mut dfs = Dfs {
            inst,
            capacity,
            order,
            seed,
            offset: vec![NONE; n],
            min_offset: vec![0; n],
            total: inst.total.clone(),
            cuts: inst.cuts.clone(),
            solution: vec![0; n],
            raised: Vec::new(),
            moved: Vec::new(),
            witness: inst.members_start[..sections]
                .iter()
                .map(|&k| inst.members.get(k).copied().unwrap_or(0))
                .collect(),
            stack: Vec::new(),
            spare: Vec::new(),
            ret: None,
            left: 0,
            outcome: None,
            state: 0,
            failed: HashSet::default(),
            failed_bits: Vec::new(),
            memo: false,
            spent: 0,
        };
        if inst.size.iter().any(|&s| s > capacity) {
            dfs.outcome = Some(Outcome::Infeasible);
        } else {
            let split = dfs.split(whole, None);
            dfs.stack.push(split);
        }
        dfs
    }

    /// Offsets of the layout found, by local allocation.
    fn solution(&self) -> &[u64] {
        &self.solution
    }

    /// Spends `units` of work, or none and false when fewer are left or the deadline passed.
    fn spend(&mut self, units: u64, clock: &mut Clock) -> bool {
        if self.left < units || clock.expired() {
            return false;
        }
        self.left -= units;
        true
    }

    /// Searches on with at most `work` units; returns how it ended and the units spent.
    fn run(&mut self, work: u64, clock: &mut Clock) -> (Outcome, u64) {
        if let Some(outcome) = self.outcome {
            return (outcome, 0);
        }
        self.left = work;
        let outcome = self.resume(clock);
        if outcome != Outcome::Stopped {
            self.outcome = Some(outcome);
        }
        self.spent += work - self.left;
        if !self.memo && self.spent >= MEMO_AFTER {
            self.remember_failures();
        }
        (outcome, work - self.left)
    }

    /// From now on, remembers failed nodes and prunes the states they had.
    fn remember_failures(&mut self) {
        self.memo = true;
        self.state = (0..self.inst.len())
            .filter(|&b| self.offset[b] == NONE)
            .fold(0, |h: u128, b| {
                h.wrapping_add(self.inst.state_term(b, self.min_offset[b]))
            });
    }

    fn resume(&mut self, clock: &mut Clock) -> Outcome {
        loop {
            let Some(frame) = self.stack.pop() else {
                return match self.ret {
                    Some((true, _)) => Outcome::Found,
                    _ => Outcome::Infeasible,
                };
            };
            match frame {
                Frame::Split {
                    part,
                    windows,
                    next,
                } => {
                    if self.ret.take().is_some_and(|(found, _)| !found) {
                        self.ret = Some((false, false));
                        continue;
                    }
                    self.next_part(part, windows, next);
                }
                Frame::Placed { b, raised, hatless } => {
                    let (found, _) = self.ret.take().expect("a frame above returned");
                    let b = b as usize;
                    for s in self.inst.crossings(b) {
                        self.cuts[s] += 1;
                    }
                    self.unplace(b, raised);
                    self.ret = Some((found, hatless));
                }
                Frame::Node {
                    part,
                    preorder,
                    mut ordering,
                    mut limit,
                    min_offset,
                    min_rank,
                    mut next,
                } => {
                    if limit.is_none() {
                        let units =
                            (ordering.len() + (part.sections.1 - part.sections.0) as usize) as u64;
                        if !self.spend(units, clock) {
                            self.stack.push(Frame::Node {
                                part,
                                preorder,
                                ordering,
                                limit,
                                min_offset,
                                min_rank,
                                next,
                            });
                            return Outcome::Stopped;
                        }
                        if self.memo
                            && self.failed_before(self.node_key(&part, min_offset, min_rank))
                        {
                            self.spare.push(ordering);
                            self.ret = Some((false, false));
                            continue;
                        }
                        self.enter(&preorder, &mut ordering);
                        if ordering.is_empty() {
                            self.spare.push(ordering);
                            self.ret = Some((true, false));
                            continue;
                        }
                        limit = Some(self.limit(&part, &preorder, &ordering));
                    } else if let Some((found, hatless)) = self.ret.take() {
                        // Nothing unplaced is live with the allocation just tried: any layout
                        // of the rest that some other choice here leads to also completes
                        // with it placed first (MiniMalloc's "hatless" pruning).
                        if found || hatless {
                            if !found {
                                self.fail(&part, min_offset, min_rank);
                            }
                            self.spare.push(ordering);
                            self.ret = Some((found, false));
                            continue;
                        }
                        next += 1;
                    }
                    // Where this node goes on from, and what it placed there.
                    let limit = limit.expect("an entered node");
                    let (k, above) = match self.choose(
                        &part, &preorder, &ordering, min_offset, min_rank, limit, next, clock,
                    ) {
                        Choice::None => {
                            self.fail(&part, min_offset, min_rank);
                            self.spare.push(ordering);
                            self.ret = Some((false, false));
                            continue;
                        }
                        Choice::Stopped(k) => (k, None),
                        Choice::Placed(k, placed, child) => {
                            let (offset, rank) = ordering[k];
                            let child = child.unwrap_or_else(|| {
                                let mut copy = self.spare.pop().unwrap_or_default();
                                copy.clear();
                                copy.extend_from_slice(&ordering);
                                Frame::Node {
                                    part: part.clone(),
                                    preorder: preorder.clone(),
                                    ordering: copy,
                                    limit: None,
                                    min_offset: offset,
                                    min_rank: rank,
                                    next: 0,
                                }
                            });
                            (k, Some((placed, child)))
                        }
                    };
                    self.stack.push(Frame::Node {
                        part,
                        preorder,
                        ordering,
                        limit: Some(limit),
                        min_offset,
                        min_rank,
                        next: k,
                    });
                    let Some((placed, child)) = above else {
                        return Outcome::Stopped;
                    };
                    self.stack.push(placed);
                    self.stack.push(child);
                }
            }
        }
    }

    /// What the search of a node depends on: the lowest offsets of the unplaced allocations
    /// (which also say which are placed), the part searched (its sections and static order)
    /// and the node's order constraint.
    fn node_key(&self, part: &Partition, min_offset: u64, min_rank: u32) -> u128 {
        let constraint = splitmix(part.key ^ splitmix(min_offset ^ u64::from(min_rank) << 48));
        self.state.wrapping_add(u128::from(constraint))
    }

    /// Remembers that the node of this state failed (forgetting all the others first when
    /// [`FAILED_LIMIT`] are remembered: memory stays bounded, and what is forgotten depends
    /// only on the work done).
    fn fail(&mut self, part: &Partition, min_offset: u64, min_rank: u32) {
        if !self.memo {
            return;
        }
        if self.failed.len() >= FAILED_LIMIT {
            self.failed.clear();
            self.failed_bits.fill(0);
        }
        if self.failed_bits.is_empty() {
            self.failed_bits = vec![0; FAILED_BITS / 64];
        }
        let key = self.node_key(part, min_offset, min_rank);
        let bit = filter_bit(key);
        self.failed_bits[bit / 64] |= 1 << (bit % 64);
        self.failed.insert(key);
    }

    /// Whether a node of key `key` failed before.
    fn failed_before(&self, key: u128) -> bool {
        let bit = filter_bit(key);
        self.failed_bits
            .get(bit / 64)
            .is_some_and(|w| w & 1 << (bit % 64) != 0)
            && self.failed.contains(&key)
    }

    /// Pushes the search of the next nonempty window of a split, or says the split is solved.
    fn next_part(&mut self, part: Rc<Partition>, windows: Vec<(u32, u32)>, next: usize) {
        for k in next..windows.len() {
            let (l, e) = windows[k];
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
            let mut sub = Partition {
                buffers,
                sections: (l, e),
                key: 0,
            };
            let preorder = self.preorder(&sub);
            sub.key = preorder
                .iter()
                .fold(splitmix(u64::from(l) << 32 | u64::from(e)), |h, &b| {
                    splitmix(h ^ u64::from(b))
                });
            let mut ordering = self.spare.pop().unwrap_or_default();
            ordering.clear();
            ordering.extend((0..preorder.len() as u32).map(|r| (0, r)));
            self.stack.push(Frame::Split {
                part,
                windows,
                next: k + 1,
            });
            self.stack.push(Frame::Node {
                part: Rc::new(sub),
                preorder,
                ordering,
                limit: None,
                min_offset: 0,
                min_rank: 0,
                next: 0,
            });
            return;
        }
        self.ret = Some((true, false));
    }

    /// The split of `part` at the section boundaries no unplaced allocation crosses
    /// (`placed`: the allocation just placed, whose crossings no longer count).
    fn split(&self, part: Rc<Partition>, placed: Option<usize>) -> Frame {
        let (first, end) = part.sections;
        let range = match placed {
            Some(b) => self.inst.crossings(b),
            None => first as usize..(end as usize).saturating_sub(1),
        };
        let mut windows = Vec::new();
        let mut start = first;
        for s in range.filter(|&s| self.cuts[s] == 0) {
            windows.push((start, s as u32 + 1));
            start = s as u32 + 1;
        }
        windows.push((start, end));
        Frame::Split {
            part,
            windows,
            next: 0,
        }
    }

    /// The allocations of `part` in the static order of this search.
    fn preorder(&self, part: &Partition) -> Rc<[u32]> {
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
                let mut k = PREORDERS[self.order].map(|k| key(b as usize, k));
                if self.seed != 0 {
                    let r = splitmix(self.seed ^ u64::from(b).wrapping_mul(0x9E37_79B9));
                    k[0] = k[0].saturating_mul(800 + u128::from(r % 400)) / 1000;
                }
                let k = k.map(|k| u128::MAX - k);
                (k, b)
            })
            .collect();
        keyed.sort_unstable();
        keyed.into_iter().map(|(_, b)| b).collect()
    }

    /// Turns the parent's order into this node's: the unplaced allocations by (lowest
    /// offset, rank), the parent's order less what was placed merged with the allocations
    /// raised since (few, and usually all to one offset): cheaper than sorting anew.
    fn enter(&mut self, preorder: &[u32], ordering: &mut Vec<(u64, u32)>) {
        let mut moved = std::mem::take(&mut self.moved);
        moved.clear();
        let mut kept = 0;
        for k in 0..ordering.len() {
            let (o, r) = ordering[k];
            let b = preorder[r as usize] as usize;
            if self.offset[b] != NONE {
                continue;
            }
            let m = self.min_offset[b];
            if m == o {
                ordering[kept] = (o, r);
                kept += 1;
            } else {
                moved.push((m, r));
            }
        }
        ordering.truncate(kept);
        moved.sort_unstable();
        merge_sorted(ordering, &moved);
        self.moved = moved;
    }

    /// The offset at and above which no allocation of a node goes next (the same for all
    /// its candidates: what they change is undone before the next is tried).
    fn limit(&self, part: &Partition, preorder: &[u32], ordering: &[(u64, u32)]) -> u64 {
        let inst = self.inst;
        // At or above the top of an unplaced allocation, that one fits whole below: leaving
        // the room empty is dominated.
        let min_height = ordering
            .iter()
            .map(|&(o, r)| o + inst.size[preorder[r as usize] as usize])
            .min()
            .unwrap_or(u64::MAX);
        // Every allocation from here on goes at or above the one placed next, so each
        // section's unplaced bytes must fit above that offset.
        let (l, e) = (part.sections.0 as usize, part.sections.1 as usize);
        let highest = self.total[l..e].iter().copied().max().unwrap_or(0);
        match self.capacity.checked_sub(highest) {
            Some(ceiling) => min_height.min(ceiling.saturating_add(1)),
            None => 0,
        }
    }

    /// Places the first candidate of `ordering` from `next` on that passes the checks: one
    /// of the unplaced allocations at its lowest offset, not before (`min_offset`,
    /// `min_rank`) in (offset, rank) order and below `limit`.
    #[allow(clippy::too_many_arguments)]
    fn choose(
        &mut self,
        part: &Rc<Partition>,
        preorder: &[u32],
        ordering: &[(u64, u32)],
        min_offset: u64,
        min_rank: u32,
        limit: u64,
        next: usize,
        clock: &mut Clock,
    ) -> Choice {
        let inst = self.inst;
        for (k, &(offset, rank)) in ordering.iter().enumerate().skip(next) {
            if (offset, rank) < (min_offset, min_rank) {
                continue;
            }
            if offset >= limit {
                break;
            }
            let b = preorder[rank as usize] as usize;
            // Swapping two interchangeable allocations gives the same layout: the one with
            // the smaller index goes lower.
            let twin = inst.twin[b];
            if twin != u32::MAX && self.offset[twin as usize] == NONE {
                continue;
            }
            let (fits, scanned, mark, hatless) = self.place(b, offset);
            if !self.spend(scanned, clock) {
                self.unplace(b, mark);
                return Choice::Stopped(k);
            }
            if !fits {
                self.unplace(b, mark);
                if hatless {
                    break;
                }
                continue;
            }
            for s in inst.crossings(b) {
                self.cuts[s] -= 1;
            }
            let splits = inst.crossings(b).any(|s| self.cuts[s] == 0);
            let child = splits.then(|| self.split(part.clone(), Some(b)));
            let placed = Frame::Placed {
                b: b as u32,
                raised: mark,
                hatless,
            };
            return Choice::Placed(k, placed, child);
        }
        Choice::None
    }

    /// Places `b` at `offset`: returns whether the sections it changes still fit, the work
    /// spent, where its raised neighbours start in [`Dfs::raised`], and whether nothing
    /// unplaced is live with it.
    fn place(&mut self, b: usize, offset: u64) -> (bool, u64, usize, bool) {
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
        if self.memo {
            self.state = self.state.wrapping_sub(self.moves(b, mark));
        }
        let mut scanned = (inst.neighbours(b).len() + (end - first)) as u64;
        let fits = self.sections_fit(first, end, &mut scanned);
        (fits, scanned, mark, hatless)
    }

    /// What placing `b` took from [`Dfs::state`], its raised neighbours from `mark` on:
    /// its own term, less the rise of theirs.
    fn moves(&self, b: usize, mark: usize) -> u128 {
        let inst = self.inst;
        let own = inst.state_term(b, self.min_offset[b]);
        self.raised[mark..].iter().fold(own, |d, &(o, m)| {
            let o = o as usize;
            let rise = u128::from(self.min_offset[o] - m);
            d.wrapping_sub(inst.zobrist[o].0.wrapping_mul(rise))
        })
    }

    /// Undoes [`Dfs::place`] of `b` (its raised neighbours from `mark` on).
    fn unplace(&mut self, b: usize, mark: usize) {
        let inst = self.inst;
        for s in inst.lo[b] as usize..inst.hi[b] as usize {
            self.total[s] += inst.size[b];
        }
        if self.memo {
            self.state = self.state.wrapping_add(self.moves(b, mark));
        }
        for &(o, m) in self.raised[mark..].iter().rev() {
            self.min_offset[o as usize] = m;
        }
        self.raised.truncate(mark);
        self.offset[b] = NONE;
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

/// Most failed nodes one search remembers (16 bytes each, plus the table's spare room).
const FAILED_LIMIT: usize = 1 << 16;
/// Work a search spends before it remembers failed nodes ([`Dfs::memo`]).
const MEMO_AFTER: u64 = 1 << 21;
/// Bits of [`Dfs::failed_bits`]: eight per key remembered at most (64 KiB).
const FAILED_BITS: usize = 1 << 19;

/// The bit of `key` in [`Dfs::failed_bits`] (other bits than the table's hash uses).
fn filter_bit(key: u128) -> usize {
    (key >> 20) as usize % FAILED_BITS
}

/// Hashes the keys of [`Dfs::failed`], already uniform, by keeping their low bits.
#[derive(Default, Clone, Copy)]
struct KeyHasher;

impl BuildHasher for KeyHasher {
    type Hasher = LowBits;
    fn build_hasher(&self) -> LowBits {
        LowBits(0)
    }
}

/// The [`Hasher`] of [`KeyHasher`].
struct LowBits(u64);

impl Hasher for LowBits {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

/// What [`Dfs::choose`] did.
enum Choice {
    /// Candidate `k` placed: its undo record and, when it split the part, the split.
    Placed(usize, Frame, Option<Frame>),
    /// No candidate left.
    None,
    /// The work ran out before candidate `k` was placed.
    Stopped(usize),
}

/// Searches at one capacity: one [`Dfs`] per static order, run in turn, each for as much
/// work as the others before it (doubling from turn to turn), as a portfolio: different
/// inputs fall fastest to different orders, and a complete search under any is a proof.
/// With restarts, one more turn goes to searches in perturbed orders, each given work by
/// the Luby sequence and then replaced by the next: a search that went wrong near its root
/// stays wrong for long, while a layout is often found quickly from another start.
struct Probe<'a> {
    inst: &'a Instance,
    capacity: u64,
    searches: Vec<Dfs<'a>>,
    slice: u64,
    turn: usize,
    /// The search that found a layout (`searches.len()`: the restart).
    found: Option<usize>,
    restarts: Option<Restarts<'a>>,
}

/// The searches in perturbed orders of a [`Probe`].
struct Restarts<'a> {
    /// The current one (`None` before the first).
    search: Option<Dfs<'a>>,
    /// Searches started so far.
    count: u64,
    /// Work the current one may still spend.
    left: u64,
    /// Work of a search at Luby value 1.
    unit: u64,
}

impl<'a> Probe<'a> {
    fn new(inst: &'a Instance, capacity: u64, restarts: bool) -> Probe<'a> {
        let slice = (16 * inst.len() as u64).max(1024);
        Probe {
            inst,
            capacity,
            searches: (0..PREORDERS.len())
                .map(|h| Dfs::new(inst, capacity, h, 0))
                .collect(),
            slice,
            turn: 0,
            found: None,
            restarts: restarts.then_some(Restarts {
                search: None,
                count: 0,
                left: 0,
                unit: 256 * slice,
            }),
        }
    }

    /// Searches on with at most `work` units; returns how it ended and the units spent.
    fn run(&mut self, work: u64, clock: &mut Clock) -> (Outcome, u64) {
        let mut spent = 0;
        let turns = self.searches.len() + usize::from(self.restarts.is_some());
        loop {
            if spent == work || clock.out_of_time {
                return (Outcome::Stopped, spent);
            }
            let given = self.slice.min(work - spent);
            let (outcome, used) = match self.searches.get_mut(self.turn) {
                Some(search) => search.run(given, clock),
                None => self.restart(given, clock),
            };
            spent += used;
            match outcome {
                Outcome::Found => {
                    self.found = Some(self.turn);
                    return (outcome, spent);
                }
                Outcome::Infeasible => return (outcome, spent),
                // The rest of `work` was too little for the search's next step.
                Outcome::Stopped if given < self.slice => return (outcome, spent),
                Outcome::Stopped => {}
            }
            self.turn += 1;
            if self.turn == turns {
                self.turn = 0;
                self.slice = self.slice.saturating_mul(2);
            }
        }
    }

    /// The restarts' turn: at most `work` units over as many of them as it takes.
    fn restart(&mut self, work: u64, clock: &mut Clock) -> (Outcome, u64) {
        let (inst, capacity) = (self.inst, self.capacity);
        let r = self.restarts.as_mut().expect("a probe with restarts");
        let mut spent = 0;
        loop {
            if r.left == 0 || r.search.is_none() {
                r.count += 1;
                let order = (r.count % PREORDERS.len() as u64) as usize;
                r.search = Some(Dfs::new(inst, capacity, order, r.count));
                r.left = r.unit.saturating_mul(luby(r.count));
            }
            let search = r.search.as_mut().expect("a restart search");
            let own = r.left < work - spent;
            let given = (work - spent).min(r.left);
            let (outcome, used) = search.run(given, clock);
            spent += used;
            r.left -= used;
            if outcome != Outcome::Stopped || clock.out_of_time || spent == work {
                return (outcome, spent);
            }
            if used < given {
                // Too little left for the next step: of `work`, or of its own share (then
                // on to the next, whose share may be larger, in a later turn if this one
                // spent nothing).
                if !own {
                    return (outcome, spent);
                }
                r.left = 0;
                if used == 0 {
                    return (outcome, spent);
                }
            }
        }
    }

    fn solution(&self) -> &[u64] {
        let k = self.found.expect("a layout was found");
        match self.searches.get(k) {
            Some(search) => search.solution(),
            None => self
                .restarts
                .as_ref()
                .and_then(|r| r.search.as_ref())
                .expect("the restart found it")
                .solution(),
        }
    }
}

/// The `i`-th term (from 1) of the Luby sequence 1, 1, 2, 1, 1, 2, 4, 1, ...: restart
/// lengths within a log factor of the best fixed one on any input.
fn luby(i: u64) -> u64 {
    let mut i = i;
    loop {
        // The smallest k with i <= 2^k - 1.
        let k = 64 - i.leading_zeros();
        if i == (1u64 << k) - 1 {
            return 1 << (k - 1);
        }
        i -= (1u64 << (k - 1)) - 1;
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Merges the sorted `tail` into the sorted `items`.
fn merge_sorted<T: Copy + Ord>(items: &mut Vec<T>, tail: &[T]) {
    let (mut i, mut j) = (items.len(), tail.len());
    items.extend_from_slice(tail);
    // Fill from the back: the larger of the two runs' last items goes last.
    let mut k = items.len();
    while j > 0 {
        if i > 0 && items[i - 1] > tail[j - 1] {
            items[k - 1] = items[i - 1];
            i -= 1;
        } else {
            items[k - 1] = tail[j - 1];
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
        // Every layout pushed down is canonical, with an arena a multiple of the step: the
        // optimum is one, and capacities in between need no probe.
        let step = inst.step;
        let mut clock = Clock {
            deadline,
            ticks: 0,
            out_of_time: false,
        };
        // The optimum lies in lo..=best. Each round gives the probes at the capacities of
        // the schedule more work (doubling from round to round), each going on where it stopped
        // unless its capacity changed, until lo meets the plan or the budget is spent.
        let mut lo = bound.div_ceil(step) * step;
        let mut probes: Vec<Option<Probe>> = schedule.probes.iter().map(|_| None).collect();
        let mut slice = (64 * inst.len() as u64).max(4096);
        let proven = 'search: loop {
            for (k, &(num, den)) in schedule.probes.iter().enumerate() {
                if lo >= best.arena_size {
                    break 'search true;
                }
                if left == 0 || clock.out_of_time {
                    break 'search false;
                }
                let gap = (best.arena_size - lo) / step;
                let capacity = lo + gap * num / den * step;
                if k > 0 && capacity == lo {
                    continue;
                }
                let probe = match &mut probes[k] {
                    Some(p) if p.capacity == capacity => p,
                    slot => slot.insert(Probe::new(&inst, capacity, schedule.restarts)),
                };
                let share = if k == 0 {
                    slice
                } else {
                    let (num, den) = schedule.improve_share;
                    slice.saturating_mul(num) / den
                };
                let given = share.max(1).min(left);
                let (outcome, used) = probe.run(given, &mut clock);
                // Given all that was left, the probe stopped short of it: too little for its
                // next step.
                let starved = outcome == Outcome::Stopped && given == left && used < given;
                left -= used;
                if starved {
                    break 'search false;
                }
                match outcome {
                    Outcome::Found => best = self.plan_of(&inst, &best, probe.solution()),
                    Outcome::Infeasible => lo = capacity + step,
                    Outcome::Stopped => {}
                }
            }
            slice = slice.saturating_mul(2);
        };
        Searched {
            plan: best,
            proven,
            work: work - left,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sixteen allocations (size, first use, last use) whose most bytes live at once, 17,
    /// is no arena: the smallest is 18.
    const ABOVE_THE_BOUND: [(u64, u64, u64); 16] = include!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/above_the_bound.rs"
    ));

    /// [`ABOVE_THE_BOUND`] with `extra` more allocations of 1 to 3 units drawn from `seed`,
    /// each live across a few steps.
    fn problem(seed: u64, extra: usize) -> Problem {
        let mut rng = seed;
        let mut next = |m: u64| {
            rng = splitmix(rng);
            rng % m
        };
        let mut allocs = ABOVE_THE_BOUND.to_vec();
        for _ in 0..extra {
            let first = next(12);
            allocs.push((1 + next(3), first, (first + next(6)).min(11)));
        }
        for _ in 0..next(9) {
            allocs.push((1, 0, 11));
        }
        Problem {
            sizes: allocs.iter().map(|a| a.0).collect(),
            first: allocs.iter().map(|a| a.1).collect(),
            last: allocs.iter().map(|a| a.2).collect(),
        }
    }

    /// Runs one search in static order 0 to its end: how it ended and the work it spent.
    fn decide(inst: &Instance, capacity: u64, memo: bool) -> (Outcome, u64) {
        let mut clock = Clock {
            deadline: None,
            ticks: 0,
            out_of_time: false,
        };
        let mut dfs = Dfs::new(inst, capacity, 0, 0);
        if memo {
            dfs.remember_failures();
        }
        dfs.run(u64::MAX / 2, &mut clock)
    }

    #[test]
    fn remembering_failed_nodes_never_changes_whether_a_layout_fits() {
        let mut saved = 0;
        for seed in 0..40 {
            let inst = Instance::of(&problem(seed, (seed % 3) as usize));
            let bound = inst.total.iter().copied().max().unwrap_or(0);
            for capacity in bound..bound + 3 {
                let (plain, plain_work) = decide(&inst, capacity, false);
                let (memo, memo_work) = decide(&inst, capacity, true);
                assert_eq!(memo, plain, "seed {seed} capacity {capacity}");
                assert!(memo_work <= plain_work, "seed {seed} capacity {capacity}");
                saved += plain_work - memo_work;
            }
        }
        // The check means something only if remembered failures pruned some searches.
        assert!(saved > 0, "{saved}");
    }
}

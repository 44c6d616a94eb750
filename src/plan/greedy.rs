//! The greedy placement pass behind every greedy strategy: allocations, in a given order, each
//! go into the smallest gap (the lowest among equals; best fit) or the lowest gap (first fit)
//! left by the already placed allocations they are live with, or on top of them; tiny ones (at
//! most a 2^-20th of the lower bound) after every larger one, into the lowest gap that holds
//! them unless it lies far up ([`TINY_MERGES`]). Where finding the larger ones' gaps reads
//! long lists, a pass instead puts the tiny and the small ones (at most a 2^-19th) in a region
//! of their own above all the others ([`STACK_MERGES`]).
//!
//! Only the union of the placed neighbours' byte ranges matters, not the neighbours one by
//! one, and greedy layouts of model traces pack tightly, so such unions are a few intervals
//! where the neighbours are hundreds (on dense inputs with sizes of every magnitude, where
//! layouts keep many small gaps, they are thousands: first fit then reads only those below
//! the gap it takes). Lifetimes become ranges of leaves (the distinct first uses) of a
//! segment tree; each node keeps, as a sorted list of disjoint byte intervals, the union of
//! the placed allocations that cover it whole (`cover`) and the union of those that start at
//! one of its leaves (`starts`). The placed neighbours of an allocation are those live when it
//! starts (`cover` of the nodes above its first leaf) and those starting later in its life
//! (`starts` of the nodes its range splits into): two logarithms' worth of short lists,
//! whatever the number of neighbours.
//!
//! Most of those lists' ranges lie low, where the union has no free byte left, and first fit
//! would merge its way through all of them. A second tree ([`Floors`]) keeps, per range of
//! leaves, a height below which every byte is taken at one of its leaves; first fit starts
//! at the highest such floor among the nodes an allocation's range splits into. On
//! MindSpore's PanGu-13B lifetimes that skips about two thirds of the ranges merged; inputs
//! whose allocations have few live neighbours, where merges are short, go without. On dense
//! graphs every time step's busy bytes are full of holes that other steps fill, so no range
//! of steps within a lifetime shows the union solid: a pass whose merges grow long keeps floors
//! per lifetime instead ([`LifetimeFloors`]), the lowest free byte each placement found for
//! its own lifetime, and starts at the highest of those recorded within the allocation's.

use std::sync::atomic::AtomicBool;

use super::offsets::Top;
use super::{OffsetPlan, Problem};

/// Which free gap the greedy pass puts an allocation in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    /// The smallest gap that holds it, the lowest among equals (best fit).
    Smallest,
    /// The lowest gap that holds it (first fit).
    Lowest,
}

/// Leaf ranges of one problem and the scratch space of its passes.
pub(crate) struct Greedy {
    /// Leaves `span[i].0 .. span[i].1` are the distinct first uses during allocation `i`'s
    /// lifetime (unused for zero-sized ones).
    span: Vec<(u32, u32)>,
    /// Nonzero allocations.
    count: usize,
    /// Pairs of allocations live together.
    pairs: usize,
    lower_bound: u64,
    /// Leaves of the segment tree: one per distinct first use. Leaf `k` is node `leaves + k`.
    leaves: usize,
    /// Per node: union of the byte ranges of placed allocations covering the node's leaves
    /// (list `2 * node`) and of those starting at one of them (list `2 * node + 1`).
    lists: Lists,
    /// Gathered intervals of the allocation being placed.
    gathered: Vec<(u64, u64)>,
    /// The gathered lists of an allocation placed by first fit, as ranges of `lists.pool`.
    runs: Vec<(usize, usize)>,
    /// Scratch space of [`first_fit`].
    heads: Vec<u64>,
    /// Allocations of at most this many bytes are placed after every larger one, in the
    /// lowest gap that holds them rather than the smallest ([`TINY_SHIFT`], [`TINY_MERGES`]).
    tiny: u64,
    /// Where the placed allocations leave no free byte below, per range of leaves: first fit
    /// starts there instead of at byte 0. Kept only on inputs whose allocations are each live
    /// with many others ([`FLOOR_PAIRS`]), until lifetime floors replace them.
    floors: Option<Floors>,
    /// Floors per lifetime ([`LifetimeFloors`]), made once first fit is seen to merge long
    /// lists ([`LONG_MERGE`]); from then on they replace `floors`.
    lifetime_floors: Option<LifetimeFloors>,
    /// Allocations of at most this many bytes go above all the others in a pass that stacks
    /// ([`SMALL_SHIFT`], [`Greedy::stack`]).
    small: u64,
    /// Whether the small allocations need little enough room to be stacked
    /// ([`STACK_ROOM_SHIFT`]), once a pass has asked.
    stack_room: Option<bool>,
    /// Whether a pass may make [`LifetimeFloors`] when its merges are long.
    judge_merges: bool,
    /// First-fit placements in this pass, and the ranges their merges read and skipped.
    fitted: usize,
    reads: Reads,
    offsets: Vec<u64>,
}

impl Greedy {
    pub(crate) fn new(p: &Problem) -> Greedy {
        let nonzero = p.nonzero();
        let mut steps: Vec<u64> = nonzero.iter().map(|&i| p.first[i as usize]).collect();
        steps.sort_unstable();
        steps.dedup();
        let mut span = vec![(0, 0); p.len()];
        // Per leaf: allocations starting there, and allocations ending just before it.
        let mut starting = vec![0usize; steps.len() + 1];
        let mut ending = vec![0usize; steps.len() + 1];
        for &i in &nonzero {
            let i = i as usize;
            let lo = steps.partition_point(|&t| t < p.first[i]);
            let hi = steps.partition_point(|&t| t <= p.last[i]);
            span[i] = (lo as u32, hi as u32);
            starting[lo] += 1;
            ending[hi] += 1;
        }
        // Allocations live at leaf k that started before it: each pairs with all the ones
        // starting at k, which also pair among themselves.
        let (mut pairs, mut earlier) = (0usize, 0usize);
        for k in 0..steps.len() {
            earlier -= ending[k];
            pairs += starting[k] * earlier + starting[k] * starting[k].saturating_sub(1) / 2;
            earlier += starting[k];
        }
        // Any number of leaves makes a tree when nodes are numbered from 1 and node k's
        // children are 2k and 2k + 1: every node then holds its descendant leaves, and the
        // bottom-up walk splits a range of leaves into disjoint nodes.
        let leaves = steps.len().max(1);
        // The bytes live at a leaf peak at the lower bound.
        let peak = live_peak(p, &span, leaves, u64::MAX);
        Greedy {
            span,
            count: nonzero.len(),
            pairs,
            lower_bound: peak,
            leaves,
            lists: Lists::new(4 * leaves),
            gathered: Vec::new(),
            runs: Vec::new(),
            heads: Vec::new(),
            tiny: peak >> TINY_SHIFT,
            small: peak >> SMALL_SHIFT,
            stack_room: None,
            floors: (pairs >= FLOOR_PAIRS.saturating_mul(nonzero.len()))
                .then(|| Floors::new(leaves)),
            lifetime_floors: None,
            judge_merges: true,
            fitted: 0,
            reads: Reads::default(),
            offsets: vec![0; p.len()],
        }
    }

    /// The most bytes live at one time step: [`Problem::lower_bound`], found on the way.
    pub(crate) fn lower_bound(&self) -> u64 {
        self.lower_bound
    }

    /// The work of one pass measured as in a pairwise planner: pairs of allocations live
    /// together, plus allocations.
    pub(crate) fn work(&self) -> usize {
        self.pairs + self.count
    }

    /// Places the allocations of `sequence` (the nonzero ones of `p`, in placing order), each
    /// in the gap `fit` picks: the tiny ones ([`TINY_SHIFT`]) after all the others, each group
    /// in the sequence's order, and always in the lowest gap that holds them unless it lies
    /// far up ([`TINY_MERGES`]); or, in a pass that stacks ([`STACK_MERGES`]), the tiny and
    /// small ones ([`SMALL_SHIFT`]) above all the others ([`Greedy::stack`]).
    pub(crate) fn pass(&mut self, p: &Problem, sequence: &[u32], fit: Fit) -> OffsetPlan {
        self.pass_under(p, sequence, fit, None)
            .expect("a pass without a cap is never given up")
    }

    /// [`Greedy::pass`], given up (`None`) once its arena reaches `cap` bytes, if there is a
    /// cap: a pass's arena only grows as it places allocations, so its plan would be at least
    /// that large.
    pub(crate) fn pass_under(
        &mut self,
        p: &Problem,
        sequence: &[u32],
        fit: Fit,
        cap: Option<u64>,
    ) -> Option<OffsetPlan> {
        self.lists.clear();
        if let Some(floors) = &mut self.floors {
            floors.clear();
        }
        if let Some(floors) = &mut self.lifetime_floors {
            floors.clear();
        }
        (self.fitted, self.reads) = (0, Reads::default());
        self.offsets.iter_mut().for_each(|o| *o = 0);
        let (tiny, small) = (self.tiny, self.small);
        let larger = sequence.iter().filter(|&&i| p.sizes[i as usize] > tiny);
        let tiny_ones = sequence.iter().filter(|&&i| p.sizes[i as usize] <= tiny);
        let mut arena = 0u64;
        let over = |arena| cap.is_some_and(|cap| arena >= cap);
        // Whether the pass stacks, judged at its first small allocation (or its end).
        let mut stacks = None;
        let mut stacked = Vec::new();
        for &i in larger {
            if p.sizes[i as usize] <= small && *stacks.get_or_insert_with(|| self.stacks(p)) {
                stacked.push(i);
                continue;
            }
            arena = arena.max(self.place(p, i as usize, fit, usize::MAX));
            if over(arena) {
                return None;
            }
        }
        if stacks.unwrap_or_else(|| self.stacks(p)) {
            stacked.extend(tiny_ones);
            arena = self.stack(p, &stacked, arena);
            if over(arena) {
                return None;
            }
        } else {
            for &i in tiny_ones {
                arena = arena.max(self.place(p, i as usize, Fit::Lowest, TINY_MERGES));
                if over(arena) {
                    return None;
                }
            }
        }
        Some(OffsetPlan {
            offsets: self.offsets.clone(),
            arena_size: arena,
        })
    }

    /// Places allocation `i` in the gap `fit` picks (for first fit, among the first `limit`
    /// ranges above the lowest free byte, see [`first_fit`]). Returns where it ends.
    #[inline(always)]
    fn place(&mut self, p: &Problem, i: usize, fit: Fit, limit: usize) -> u64 {
        let size = p.sizes[i];
        let span = (self.span[i].0 as usize, self.span[i].1 as usize);
        let (lo, hi) = (span.0 + self.leaves, span.1 + self.leaves);
        let offset = match fit {
            Fit::Lowest => {
                self.gather_lists(lo, hi);
                let floor = self.floors.as_ref().map_or(0, |f| f.under(span));
                let floor = floor.max(self.lifetime_floors.as_ref().map_or(0, |f| f.under(span)));
                let (offset, hole) = first_fit(
                    &self.lists.pool,
                    &mut self.runs,
                    &mut self.heads,
                    size,
                    floor,
                    limit,
                    &mut self.reads,
                );
                if let Some(floors) = &mut self.floors {
                    floors.raise(span, hole, (offset, offset + size));
                }
                if let Some(floors) = &mut self.lifetime_floors {
                    // Busy up to the hole, and past the allocation when it went there; a
                    // height no higher than a floor within the lifetime tells nothing new.
                    let height = if offset == hole { offset + size } else { hole };
                    if height > floor {
                        floors.raise(span, height);
                    }
                }
                self.fitted += 1;
                if self.judge_merges
                    && self.lifetime_floors.is_none()
                    && self.fitted >= LONG_MERGE_AFTER
                    && self.reads.merged >= LONG_MERGE * self.fitted
                {
                    let spans = self.span.iter().copied().filter(|&(lo, hi)| lo < hi);
                    self.lifetime_floors = Some(LifetimeFloors::new(self.leaves, spans));
                    self.floors = None;
                }
                offset
            }
            // Floors stay where they are: they only serve first fit, and what best fit
            // places can only leave them lower than the truth.
            Fit::Smallest => {
                self.gather(lo, hi);
                best_fit(&mut self.gathered, size)
            }
        };
        self.offsets[i] = offset;
        self.record(lo, hi, (offset, offset + size));
        offset + size
    }

    /// Places `stacked`, the small and tiny allocations of a pass that stacks them
    /// ([`STACK_MERGES`]), above `base`, the top of all the others, in a region of their own,
    /// in time order ([`Problem::in_event_order`]); returns the arena's new top. Such
    /// allocations can only take slivers that the larger ones left free, and on dense graphs
    /// first fit reads hundreds of ranges to find each sliver (long-lived ones mostly find none
    /// and land on top of their neighbours anyway). Placed apart they merge nothing, and the
    /// region's peak is 0.02–0.15% of the lower bound on those graphs. On
    /// `traces::sharded_graph` the default then takes about a quarter less time at 10,000
    /// allocations (10.3–10.5 to 7.7–8.3 ms) and half at 60,000 (150–160 to 80 ms), and its
    /// arena is smaller (193.83 to 193.79 GB at 60,000; 34.8374 to 34.8372 GB at 10,000):
    /// small ones first fit into the slivers also land where the arena peaks, and those put
    /// on top of their neighbours raise it.
    fn stack(&mut self, p: &Problem, stacked: &[u32], base: u64) -> u64 {
        let never = AtomicBool::new(false);
        let peak = p
            .in_event_order(
                stacked.iter().copied(),
                Top::Lowered,
                &mut self.offsets,
                &never,
            )
            .expect("never stopped");
        for &i in stacked {
            self.offsets[i as usize] += base;
        }
        base + peak
    }

    /// Whether this pass stacks: the first-fit placements of this pass so far (at least
    /// [`LONG_MERGE_AFTER`]) found their gaps above [`STACK_MERGES`] ranges each on average,
    /// and the small allocations need little room ([`STACK_ROOM_SHIFT`]).
    fn stacks(&mut self, p: &Problem) -> bool {
        self.fitted >= LONG_MERGE_AFTER
            && self.reads.below_gaps() >= STACK_MERGES * self.fitted
            && *self.stack_room.get_or_insert_with(|| {
                let small_peak = live_peak(p, &self.span, self.leaves, self.small);
                small_peak <= self.lower_bound >> STACK_ROOM_SHIFT
            })
    }

    /// Collects into `gathered` the byte ranges of the placed allocations live at some leaf of
    /// `lo..hi` (tree indices), from the lists [`lists_of`] names.
    fn gather(&mut self, lo: usize, hi: usize) {
        self.gathered.clear();
        let (lists, gathered) = (&self.lists, &mut self.gathered);
        lists_of(lo, hi, |list| gathered.extend_from_slice(lists.get(list)));
    }

    /// Collects into `runs` where in the pool the nonempty lists that [`Greedy::gather`]
    /// reads lie.
    fn gather_lists(&mut self, lo: usize, hi: usize) {
        self.runs.clear();
        let (lists, runs) = (&self.lists, &mut self.runs);
        lists_of(lo, hi, |list| runs.extend(lists.range(list)));
    }

    /// Records an allocation placed at bytes `range`, live at leaf nodes `lo..hi`: in `cover`
    /// of the nodes that range splits into, and in `starts` of the nodes above leaf `lo`.
    fn record(&mut self, lo: usize, hi: usize, range: (u64, u64)) {
        split(lo, hi, |node| {
            self.lists.add(cover(node), range);
        });
        // A node's `starts` holds its children's: once one already holds `range`, so do the
        // rest of the path.
        let mut a = lo;
        while a >= 1 && self.lists.add(starts(a), range) {
            a >>= 1;
        }
    }
}

/// Allocations of at most the lower bound's 2^-20th are tiny: every pass places them after all
/// larger ones, each in the lowest gap that holds it ([`first_fit`], within [`TINY_MERGES`]).
/// Real models have thousands of them (5,612 of the 10,744 allocations of MindSpore's
/// BERT-large lifetimes hold 4 bytes), each of which best fit would compare against every busy
/// range of its lifetime, most of a pass's time, while the lowest gap that holds one is usually
/// among the first few ranges. Placed last, they can only crowd each other, and their bytes are
/// too few to move the arena by more than a hair; placed among larger ones, they could take the
/// gap a larger one later needs.
const TINY_SHIFT: u32 = 20;

/// Allocations of at most the lower bound's 2^-19th are small: a pass that stacks
/// ([`STACK_MERGES`]) places them above all the others, with the tiny ones
/// ([`Greedy::stack`]). It judges whether it stacks at its first small allocation, or at its
/// end if it has none: in size order, once every larger allocation is placed.
const SMALL_SHIFT: u32 = 19;

/// Passes stack only inputs whose small allocations ([`SMALL_SHIFT`]) have at most the lower
/// bound's 2^-8th live at once: stacked, they need at least that much room above the others,
/// where first fit might have found them gaps. On `traces::sharded_graph` of 7,000–62,200
/// allocations they have 0.017–0.15% of the bound live at once, and the region they take is
/// 1.5–5% larger than that.
const STACK_ROOM_SHIFT: u32 = 8;

/// The most bytes that the nonzero allocations of at most `most` bytes have live at one of the
/// `leaves` (allocation `i` live at leaves `span[i].0 .. span[i].1`).
fn live_peak(p: &Problem, span: &[(u32, u32)], leaves: usize, most: u64) -> u64 {
    // Per leaf, the bytes starting there and those ending just before it (zero-sized
    // allocations add nothing).
    let mut change = vec![(0u64, 0u64); leaves + 1];
    for (&(lo, hi), &size) in span.iter().zip(&p.sizes) {
        if size <= most {
            change[lo as usize].0 += size;
            change[hi as usize].1 += size;
        }
    }
    let live = change.iter().scan(0u64, |live, &(start, end)| {
        *live = *live - end + start;
        Some(*live)
    });
    live.max().unwrap_or(0)
}

/// A tiny allocation goes in the lowest gap that holds it among the first this many busy
/// ranges above the lowest free byte of its lifetime, else on top of the busy ranges
/// ([`first_fit`]'s `limit`). On dense graphs, long-lived tiny allocations find no gap wide
/// enough in the union of their neighbours, whose free bytes are slivers, and land on top of
/// it anyway, after merging their way through every sliver: on `traces::sharded_graph` of
/// 60,000 allocations they read 533 ranges each, more than half of a first-fit pass's merges,
/// and the limit took a fifth off the default (about 210 to 175 ms). Passes that long now
/// stack their tiny allocations instead ([`STACK_MERGES`]); the limit serves the passes that
/// do not stack, such as those over dense graphs of a few thousand allocations.
/// The tiny allocations of real models (MindSpore's lifetimes of BERT, PanGu and ResNet-50,
/// an IREE buffer plan) all find their gap within the limit: their plans do not change.
const TINY_MERGES: usize = 64;

/// The offset at which the greedy pass places `size` bytes among the busy byte ranges of
/// `gathered` (possibly overlapping): the start of the smallest free gap that holds it (the
/// lowest among equals), else the top of the busy ranges. Sorts `gathered`.
fn best_fit(gathered: &mut [(u64, u64)], size: u64) -> u64 {
    gathered.sort_unstable_by_key(|&(start, _)| start);
    let mut top = 0u64;
    let mut best: Option<(u64, u64)> = None;
    for &(start, end) in gathered.iter() {
        if start >= top + size {
            let gap = start - top;
            if best.is_none_or(|(g, _)| gap < g) {
                best = Some((gap, top));
            }
        }
        top = top.max(end);
    }
    best.map_or(top, |(_, at)| at)
}

/// The offset at which the greedy pass places `size` bytes in the lowest gap that holds them
/// among the busy byte ranges of the lists at `pool[start..end]` for each of `runs` (each list
/// sorted and disjoint; ranges of different lists may overlap), else the top of the busy
/// ranges; and the lowest free byte. Every byte below `floor` is known to be busy: each list
/// starts at its first range that reaches above it. Merges the lists lowest head first from
/// there and stops at the first gap that fits, so it reads only the ranges between the floor
/// and that gap. Once past the lowest free byte, it reads at most `limit` more ranges: if the
/// gap lies higher, it answers the top of the busy ranges instead. Which ranges lie above the
/// lowest free byte does not depend on the floor, so neither does the answer. Consumes `runs`.
fn first_fit(
    pool: &[(u64, u64)],
    runs: &mut Vec<(usize, usize)>,
    heads: &mut Vec<u64>,
    size: u64,
    floor: u64,
    limit: usize,
    reads: &mut Reads,
) -> (u64, u64) {
    if floor > 0 {
        // A list whose last range ends at the floor has nothing above it; one whose first
        // range reaches above it starts there.
        runs.retain_mut(|(at, end)| {
            if pool[*end - 1].1 <= floor {
                reads.skipped += *end - *at;
                return false;
            }
            if pool[*at].1 <= floor {
                let below = pool[*at..*end].partition_point(|&(_, e)| e <= floor);
                reads.skipped += below;
                *at += below;
            }
            true
        });
    }
    // The start of each list's next range, side by side: finding the lowest is a scan of
    // one short array.
    heads.clear();
    heads.extend(runs.iter().map(|&(at, _)| pool[at].0));
    let mut top = floor;
    let mut hole = None;
    let mut left = limit;
    while !heads.is_empty() {
        let k = lowest(heads);
        let start = heads[k];
        if start > top {
            let hole = *hole.get_or_insert(top);
            if start >= top + size {
                return (top, hole);
            }
        }
        if let Some(hole) = hole {
            if left == 0 {
                let busy_top = runs.iter().fold(top, |t, &(_, end)| t.max(pool[end - 1].1));
                return (busy_top, hole);
            }
            left -= 1;
        }
        let (at, end) = &mut runs[k];
        top = top.max(pool[*at].1);
        reads.merged += 1;
        *at += 1;
        if *at == *end {
            runs.swap_remove(k);
            heads.swap_remove(k);
        } else {
            heads[k] = pool[*at].0;
        }
    }
    (top, hole.unwrap_or(top))
}

/// The ranges that first fit merged, and those it skipped as lying under its floor.
#[derive(Debug, Clone, Copy, Default)]
struct Reads {
    merged: usize,
    skipped: usize,
}

impl Reads {
    /// Ranges that start at or below the gaps found, with or without floors: a merge without
    /// a floor reads every range that starts at or below the gap it finds, and a floor lies
    /// under the gap and skips only ranges that end at or below it. (So for merges without a
    /// limit: a limited one may stop short of the gap.)
    fn below_gaps(&self) -> usize {
        self.merged + self.skipped
    }
}

/// The index of the lowest of `heads` (not empty), or of any one of equal lowest ones: where
/// several lists' next ranges start at the same byte, [`first_fit`] finds the same gap
/// whichever it merges first. Two chains of minimums, one from each end, without branches:
/// the lowest head is a different list's from one step of the merge to the next, so a branch
/// on each comparison would be mispredicted often, and one chain would wait on each
/// comparison in turn (on dense sharded graphs the merge compares 17 heads per step).
#[inline(always)]
fn lowest(heads: &[u64]) -> usize {
    use std::hint::select_unpredictable as select;
    let n = heads.len();
    let (mut ka, mut a) = (0, heads[0]);
    let (mut kb, mut b) = (n - 1, heads[n - 1]);
    let mut j = 1;
    while j + 1 < n {
        let (x, y) = (heads[j], heads[j + 1]);
        let (x_lower, y_lower) = (x < a, y < b);
        (a, ka) = (select(x_lower, x, a), select(x_lower, j, ka));
        (b, kb) = (select(y_lower, y, b), select(y_lower, j + 1, kb));
        j += 2;
    }
    select(b < a, kb, ka)
}

/// Calls `visit` with each list that holds the byte ranges of placed allocations live at some
/// leaf of `lo..hi` (tree indices): those live at leaf `lo` (`cover` of the nodes above it),
/// and those starting at a leaf of the range (`starts` of the nodes the range splits into).
#[inline(always)]
fn lists_of(lo: usize, hi: usize, mut visit: impl FnMut(usize)) {
    let mut a = lo;
    while a >= 1 {
        visit(cover(a));
        a >>= 1;
    }
    split(lo + 1, hi, |node| visit(starts(node)));
}

/// Calls `visit` with the nodes that leaves `lo..hi` (tree indices) split into, each holding
/// only leaves of the range, together holding all of them.
#[inline(always)]
fn split(lo: usize, hi: usize, mut visit: impl FnMut(usize)) {
    let (mut l, mut h) = (lo, hi);
    while l < h {
        if l & 1 == 1 {
            visit(l);
            l += 1;
        }
        if h & 1 == 1 {
            h -= 1;
            visit(h);
        }
        l >>= 1;
        h >>= 1;
    }
}

fn cover(node: usize) -> usize {
    2 * node
}

fn starts(node: usize) -> usize {
    2 * node + 1
}

/// Lists longer than this many intervals are searched by bisection and shifted by memmove when
/// an interval goes in: on dense sharded graphs (`traces::sharded_graph`), whose lists run to
/// hundreds of intervals, that takes about a tenth off a first-fit pass of 62,200 allocations.
const LONG_LIST: usize = 32;

/// Room for this many intervals in each list before it moves.
const SLOT: usize = 4;

/// Many short lists of sorted, disjoint, non-touching half-open byte intervals, kept in one
/// buffer so that a pass allocates nothing once the buffer has grown: each list has a slot
/// in the buffer, moved to the buffer's end with twice the room when it fills.
struct Lists {
    /// Per list: where its slot starts in `pool`, its length and its slot's capacity. A list
    /// holds at most one interval per allocation, so lengths fit 32 bits.
    heads: Vec<(usize, u32, u32)>,
    pool: Vec<(u64, u64)>,
}

impl Lists {
    fn new(count: usize) -> Lists {
        Lists {
            heads: vec![(0, 0, 0); count],
            pool: Vec::new(),
        }
    }

    /// Empties every list, each into a slot of its own of `SLOT` intervals.
    fn clear(&mut self) {
        for (k, h) in self.heads.iter_mut().enumerate() {
            *h = (k * SLOT, 0, SLOT as u32);
        }
        self.pool.truncate(self.heads.len() * SLOT);
        self.pool.resize(self.heads.len() * SLOT, (0, 0));
    }

    /// Where `list` lies in the pool (start and end), if it holds anything.
    #[inline]
    fn range(&self, list: usize) -> Option<(usize, usize)> {
        let (at, len, _) = self.heads[list];
        (len > 0).then_some((at, at + len as usize))
    }

    #[inline]
    fn get(&self, list: usize) -> &[(u64, u64)] {
        let (at, len, _) = self.heads[list];
        &self.pool[at..at + len as usize]
    }

    /// Adds `range` to the union `list`, merging it with the intervals it overlaps or touches
    /// (a zero-byte gap holds nothing, so touching intervals may merge). Returns whether the
    /// list changed (false when it already held `range`).
    #[inline(always)]
    fn add(&mut self, list: usize, (start, end): (u64, u64)) -> bool {
        let (at, len, cap) = self.heads[list];
        let len = len as usize;
        // Lists of model traces are short (a few intervals), where linear scans beat binary
        // searches and memmove; those of dense inputs run to hundreds.
        let items = &mut self.pool[at..at + len];
        let first = if len > LONG_LIST {
            items.partition_point(|&(_, e)| e < start)
        } else {
            items.iter().position(|&(_, e)| e >= start).unwrap_or(len)
        };
        let past = first
            + items[first..]
                .iter()
                .position(|&(s, _)| s > end)
                .unwrap_or(len - first);
        if first < past {
            let held = items[first];
            if past == first + 1 && held.0 <= start && end <= held.1 {
                return false;
            }
            items[first] = (start.min(held.0), end.max(items[past - 1].1));
            if past > first + 1 {
                items.copy_within(past.., first + 1);
                self.heads[list].1 = (len - (past - first - 1)) as u32;
            }
            return true;
        }
        let at = if len as u32 == cap {
            // Move the list to the end of the pool with twice the room; its old slot is
            // abandoned until the next pass.
            let moved = self.pool.len();
            let cap = cap.saturating_mul(2);
            self.pool.extend_from_within(at..at + len);
            self.pool.resize(moved + cap as usize, (0, 0));
            self.heads[list].0 = moved;
            self.heads[list].2 = cap;
            moved
        } else {
            at
        };
        let items = &mut self.pool[at..at + len + 1];
        if len - first > LONG_LIST {
            items.copy_within(first..len, first + 1);
        } else {
            for k in (first..len).rev() {
                items[k + 1] = items[k];
            }
        }
        items[first] = (start, end);
        self.heads[list].1 = (len + 1) as u32;
        true
    }
}

/// Inputs with at least this many pairs of allocations live together per allocation keep
/// [`Floors`]. Looking up and raising the floors costs two walks of the tree per placement,
/// which pays only where first fit merges many ranges: on MindSpore's lifetimes of BERT and
/// PanGu (500–1,000 pairs per allocation) a first-fit pass takes 10–25% less time with them,
/// on the synthetic model traces of `cargo bench --bench plan` (2–200) 5–8% more.
const FLOOR_PAIRS: usize = 256;

/// A pass keeps [`LifetimeFloors`] from the moment its first-fit placements (at least
/// [`LONG_MERGE_AFTER`] of them) have merged this many ranges each on average, and so do the
/// later passes over the same input; they replace [`Floors`], which then save less than they
/// cost (dense graphs of sharded models, `traces::sharded_graph`: 5–8% of a pass). Looking up
/// and raising them costs about a microsecond per placement, which pays where merges grow long
/// as a pass goes on (dense graphs without them: an average of 30 ranges after 1,500 placements
/// of 10,000, 130 by the end), not where they stay at a few to a dozen each (synthetic
/// transformer training traces of 60,000 allocations, where they doubled a pass's time;
/// MindSpore's lifetimes of BERT, PanGu and ResNet-50 average at most 20). On dense graphs of
/// 5,000–10,000 allocations, taking them on at an average of 32 rather than 64 takes 10–20% off
/// a pass.
const LONG_MERGE: usize = 32;
/// A pass stacks its small and tiny allocations ([`Greedy::stack`]) when its first-fit
/// placements of larger ones (at least [`LONG_MERGE_AFTER`] of them) found their gaps above
/// this many ranges each on average ([`Reads::below_gaps`], the same with floors or without,
/// so that a pass's plan depends only on its input and order). Dense graphs of sharded models
/// (`traces::sharded_graph`) average 36–56 at 3,000–5,000 allocations, 111 at 10,000 and 484
/// at 60,000; MindSpore's lifetimes of BERT, PanGu and ResNet-50 8–26, the synthetic model
/// traces of `cargo bench --bench plan` less.
const STACK_MERGES: usize = 64;
/// First-fit placements a pass makes before it judges its merges ([`LONG_MERGE`]).
const LONG_MERGE_AFTER: usize = 256;

/// Busy floors of ranges of leaves, each a lower bound on the lowest byte that no placed
/// allocation live at one of the range's leaves takes, over a perfect binary tree (node 1 the
/// root, node `n`'s children `2n` and `2n + 1`, leaf `k` at `width + k` for the `width` leaves,
/// half the nodes; the leaves past the last first use are padding). The placed allocations only
/// grow during a pass, so a floor once true stays true: they are raised, never lowered, and a
/// floor left behind the truth only costs the merge some ranges. Placing an allocation raises
/// the floors of the nodes that hold its whole lifetime: each is busy at least up to the lowest
/// free byte of that lifetime, found while placing it, and once the allocation is placed at
/// bytes `a..b`, a floor in `a..b` rises to `b`. (Lifting the nodes the lifetime splits into
/// as well, by the rule for `a..b`, skipped no more ranges on real models' lifetimes.)
struct Floors {
    floors: Vec<u64>,
}

impl Floors {
    fn new(leaves: usize) -> Floors {
        Floors {
            floors: vec![0; 2 * leaves.next_power_of_two()],
        }
    }

    /// Index of the first leaf.
    #[inline]
    fn width(&self) -> usize {
        self.floors.len() / 2
    }

    fn clear(&mut self) {
        self.floors.fill(0);
    }

    /// The highest floor among the nodes that leaves `lo..hi` split into: no gap of an
    /// allocation live at those leaves lies lower.
    #[inline]
    fn under(&self, (lo, hi): (usize, usize)) -> u64 {
        let mut floor = 0;
        split(self.width() + lo, self.width() + hi, |n| {
            floor = floor.max(self.floors[n]);
        });
        floor
    }

    /// Raises the floors after an allocation live at leaves `lo..hi`, whose lowest free byte
    /// was `hole` before, was placed at bytes `a..b`: those of the nodes holding all of the
    /// leaves, lowest first, up to one already at `b` or above.
    #[inline]
    fn raise(&mut self, (lo, hi): (usize, usize), hole: u64, (a, b): (u64, u64)) {
        let (first, last) = (self.width() + lo, self.width() + hi - 1);
        // The lowest node holding both the first and the last leaf.
        let mut n = first >> (usize::BITS - (first ^ last).leading_zeros());
        // The hole lies at or below `a`: a floor that reaches `a` is now busy up to `b`.
        while n >= 1 && self.floors[n] < b {
            let floor = self.floors[n].max(hole);
            self.floors[n] = if floor >= a { b } else { floor };
            n >>= 1;
        }
    }
}

/// Busy floors: for each lifetime of the input (a range of leaves), a lower bound on the
/// lowest byte that the union of the placed allocations live during it leaves free. Every
/// first-fit placement finds that byte for its own lifetime (the hole below its gap), and
/// the placed allocations only grow during a pass, so a floor once true stays true. A lifetime
/// within another has a union within the other's, so an allocation's floor is the highest
/// recorded for a lifetime within its own: a query of the lifetimes that start at or after
/// its first leaf and end at or before its last, answered by a two-dimensional Fenwick tree of
/// maxima (first leaf, descending, outside; end inside, over the ends that occur): a lookup or
/// a raise walks a logarithm of inner trees, a logarithm of nodes each.
///
/// Dense layouts leave the busy bytes of any one time step full of small holes, which other
/// steps fill: an allocation's neighbours then reach solid well above what any single step,
/// or any tree node within its lifetime, shows. On `traces::sharded_graph` of 62,200
/// allocations a first-fit pass reads about 830 ranges per placement with [`Floors`] alone and
/// 130 with these as well.
struct LifetimeFloors {
    /// Blocks of leaves ([`BLOCK_SHIFT`]).
    blocks: usize,
    /// Outer node `k` (1-based) holds the ranges whose reversed first block `blocks - lo` lies
    /// in its Fenwick span: their end blocks, sorted and distinct, at `ends[at[k]..at[k + 1]]`,
    /// and the inner Fenwick tree of maxima over them at the same places of `best`.
    at: Vec<usize>,
    ends: Vec<u32>,
    best: Vec<u64>,
}

impl LifetimeFloors {
    /// Floors for the lifetimes `spans` (ranges of leaves `lo..hi`, `lo < hi <= leaves`), all
    /// at 0, kept by blocks of leaves.
    fn new(leaves: usize, spans: impl Iterator<Item = (u32, u32)>) -> LifetimeFloors {
        let blocks = leaves.div_ceil(1 << BLOCK_SHIFT);
        let mut members: Vec<Vec<u32>> = vec![Vec::new(); blocks + 1];
        for span in spans {
            let (lo, hi) = outward(span);
            outer_path(blocks, lo as usize).for_each(|k| members[k].push(hi));
        }
        let mut at = Vec::with_capacity(blocks + 2);
        let mut ends = Vec::new();
        at.push(0);
        for list in &mut members {
            list.sort_unstable();
            list.dedup();
            ends.extend_from_slice(list);
            at.push(ends.len());
        }
        let best = vec![0; ends.len()];
        LifetimeFloors {
            blocks,
            at,
            ends,
            best,
        }
    }

    fn clear(&mut self) {
        self.best.fill(0);
    }

    /// The highest floor recorded for a lifetime within leaves `lo..hi`: no gap of an
    /// allocation live at all of them lies lower.
    #[inline]
    fn under(&self, (lo, hi): (usize, usize)) -> u64 {
        let (lo, hi) = inward((lo as u32, hi as u32));
        if lo >= hi {
            return 0;
        }
        let lo = lo as usize;
        let mut floor = 0;
        let mut k = self.blocks - lo;
        while k > 0 {
            let (from, to) = (self.at[k], self.at[k + 1]);
            let mut j = self.ends[from..to].partition_point(|&e| e <= hi);
            while j > 0 {
                floor = floor.max(self.best[from + j - 1]);
                j &= j - 1;
            }
            k &= k - 1;
        }
        floor
    }

    /// Records that the placed allocations live during leaves `lo..hi`, one of the lifetimes
    /// it was made for, leave no free byte below `height`.
    #[inline]
    fn raise(&mut self, (lo, hi): (usize, usize), height: u64) {
        let (lo, hi) = outward((lo as u32, hi as u32));
        for k in outer_path(self.blocks, lo as usize) {
            let (from, to) = (self.at[k], self.at[k + 1]);
            let ends = &self.ends[from..to];
            let mut j = ends.partition_point(|&e| e < hi) + 1;
            debug_assert!(j <= ends.len() && ends[j - 1] == hi);
            while j <= ends.len() && self.best[from + j - 1] < height {
                self.best[from + j - 1] = height;
                j += j & j.wrapping_neg();
            }
        }
    }
}

/// [`LifetimeFloors`] keep lifetimes by blocks of 2^this many leaves: each recorded with its
/// ends rounded outward to whole blocks (a floor of a lifetime holds for any lifetime around
/// it), each looked up rounded inward. On dense graphs of sharded models
/// (`traces::sharded_graph`, 28,500 and 62,200 allocations) the floors then fit in a sixteenth
/// of the memory, and a first-fit pass takes 10–13% less time, though its merges read 3–6% more
/// ranges (lifetimes within one block, or those ending in a block the lookup's ends cut, tell
/// it nothing).
const BLOCK_SHIFT: u32 = 4;

/// The blocks of leaves ([`BLOCK_SHIFT`]) that hold leaves `lo..hi`, as a range.
fn outward((lo, hi): (u32, u32)) -> (u32, u32) {
    (lo >> BLOCK_SHIFT, hi.div_ceil(1 << BLOCK_SHIFT))
}

/// The blocks of leaves ([`BLOCK_SHIFT`]) that leaves `lo..hi` hold whole, as a range (empty
/// when there are none).
fn inward((lo, hi): (u32, u32)) -> (u32, u32) {
    (lo.div_ceil(1 << BLOCK_SHIFT), hi >> BLOCK_SHIFT)
}

/// The outer nodes of [`LifetimeFloors`] that hold lifetimes starting at block `lo`.
fn outer_path(blocks: usize, lo: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(blocks - lo), move |&k| {
        Some(k + (k & k.wrapping_neg())).filter(|&next| next <= blocks)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::offsets::splitmix;
    use proptest::prelude::*;

    /// `lowest` names a lowest head for every number of heads a merge sees (odd and even
    /// counts, both chains, the last head alone), with ties and without.
    #[test]
    fn lowest_names_a_lowest_head() {
        let mut rng = 7u64;
        for n in 1..=40 {
            for round in 0..200 {
                let heads: Vec<u64> = (0..n)
                    .map(|_| {
                        rng = splitmix(rng);
                        // Few distinct values in half the rounds, so that ties are common.
                        if round % 2 == 0 {
                            rng % 4
                        } else {
                            rng
                        }
                    })
                    .collect();
                let k = lowest(&heads);
                assert!(k < n, "{n} heads: index {k}");
                assert_eq!(heads[k], *heads.iter().min().unwrap(), "{heads:?}");
            }
        }
    }

    proptest! {
        /// First fit answers the lowest gap of the union that holds the size, as a scan of
        /// the sorted ranges says, and the union's lowest free byte at or above a floor under
        /// it, whatever that floor; with a limit, the same gap when at most that many ranges
        /// start between the lowest free byte and the gap, else the union's top.
        #[test]
        fn first_fit_finds_the_lowest_gap_within_its_limit(
            lists in prop::collection::vec(
                prop::collection::vec((0u64..400, 1u64..30), 0..40), 1..12),
            size in 1u64..40,
            pick in 0usize..40,
            floor_share in 0u64..=100,
        ) {
            // Each list the union of its own ranges, held as a pass holds a node's.
            let mut held = Lists::new(lists.len());
            held.clear();
            for (k, list) in lists.iter().enumerate() {
                for &(start, len) in list {
                    held.add(k, (start, start + len));
                }
            }
            let runs: Vec<_> = (0..lists.len()).filter_map(|k| held.range(k)).collect();
            let mut all: Vec<(u64, u64)> =
                (0..lists.len()).flat_map(|k| held.get(k).iter().copied()).collect();
            all.sort_unstable();
            let union_top = all.iter().map(|&(_, e)| e).max().unwrap_or(0);
            // The lowest free byte, and the lowest gap of `size` bytes, by a plain scan.
            let mut hole = None;
            let mut top = 0;
            let mut gap = None;
            for &(s, e) in &all {
                if s > top {
                    hole.get_or_insert(top);
                    if s >= top + size {
                        gap = Some(top);
                        break;
                    }
                }
                top = top.max(e);
            }
            let hole = hole.unwrap_or(top);
            let gap = gap.unwrap_or(top);
            let between = all.iter().filter(|&&(s, _)| hole < s && s < gap).count();
            // A limit just below, at or just above that count in a third of the cases.
            let limit = if pick < 12 { (between + pick % 3).saturating_sub(1) } else { pick - 12 };
            let floor = hole * floor_share / 100;
            let mut heads = Vec::new();
            let mut reads = Reads::default();
            let pool = &held.pool;
            let mut fit = |limit| {
                first_fit(pool, &mut runs.clone(), &mut heads, size, floor, limit, &mut reads)
            };
            prop_assert_eq!(fit(usize::MAX), (gap, hole));
            let limited = fit(limit);
            let offset = if between <= limit { gap } else { union_top };
            prop_assert_eq!(limited, (offset, hole), "{} ranges between", between);
        }
    }

    /// The nonzero allocations of `p` by decreasing size, then index.
    fn by_size(p: &Problem) -> Vec<u32> {
        let mut by_size = p.nonzero();
        by_size.sort_by_key(|&i| (std::cmp::Reverse(p.sizes[i as usize]), i));
        by_size
    }

    /// Which floors a test pass keeps, whatever the input's density.
    #[derive(Clone, Copy, Debug)]
    enum Kept {
        None,
        Nodes,
        Lifetimes,
        Both,
    }

    /// A pass keeping the floors `kept` says, and no others.
    fn pass(p: &Problem, sequence: &[u32], fit: Fit, kept: Kept) -> OffsetPlan {
        let mut greedy = Greedy::new(p);
        let (nodes, lifetimes) = match kept {
            Kept::None => (false, false),
            Kept::Nodes => (true, false),
            Kept::Lifetimes => (false, true),
            Kept::Both => (true, true),
        };
        greedy.judge_merges = false;
        greedy.floors = nodes.then(|| Floors::new(greedy.leaves));
        let spans = p.nonzero().into_iter().map(|i| greedy.span[i as usize]);
        greedy.lifetime_floors = lifetimes.then(|| LifetimeFloors::new(greedy.leaves, spans));
        greedy.pass(p, sequence, fit)
    }

    /// A dense graph's first-fit pass merges long lists and takes on lifetime floors by
    /// itself, and they move nothing: the plan is the one made without any floors, tiny
    /// allocations that go on top of their neighbours past [`TINY_MERGES`] ranges included,
    /// and no two allocations live together overlap. Its larger allocations find their gaps
    /// too low for it to stack the tiny ones ([`STACK_MERGES`]): most of those go into gaps
    /// among the larger ones.
    #[test]
    fn a_dense_pass_takes_on_lifetime_floors_that_move_nothing() {
        let allocs = crate::plan::traces::sharded_graph(3000, 2);
        let p = Problem::new(&allocs, 1).unwrap();
        let by_size = by_size(&p);
        let mut greedy = Greedy::new(&p);
        assert!(greedy.lifetime_floors.is_none());
        assert!(greedy.floors.is_some());
        let plan = greedy.pass(&p, &by_size, Fit::Lowest);
        assert!(greedy.lifetime_floors.is_some());
        assert!(greedy.floors.is_none());
        assert!(greedy.reads.merged >= LONG_MERGE * LONG_MERGE_AFTER);
        assert_eq!(plan, pass(&p, &by_size, Fit::Lowest, Kept::None));
        crate::plan::validate(&allocs, &plan, 1).unwrap();

        assert!(greedy.reads.below_gaps() < STACK_MERGES * greedy.fitted);
        let (tiny, top) = under_and_top(&p, &plan, greedy.tiny);
        assert!(tiny.len() > 500);
        let within = tiny.iter().filter(|&&i| plan.offsets[i] < top).count();
        assert!(within > tiny.len() / 2, "{within} of {} within", tiny.len());
    }

    /// The nonzero allocations of `p` of at most `most` bytes, and the top of the others in
    /// `plan`.
    fn under_and_top(p: &Problem, plan: &OffsetPlan, most: u64) -> (Vec<usize>, u64) {
        let under = |i: &usize| p.sizes[*i] > 0 && p.sizes[*i] <= most;
        let (small, larger): (Vec<usize>, Vec<usize>) = (0..p.len()).partition(under);
        let top = larger.iter().map(|&i| plan.offsets[i] + p.sizes[i]).max();
        (small, top.unwrap_or(0))
    }

    /// A first-fit pass over a larger dense graph finds its larger allocations' gaps above
    /// long lists, with floors or without, and stacks its small and tiny allocations: all lie
    /// above the others, and their peak there takes at most a third more room than the most of
    /// their bytes live at once. Floors still move nothing, and no two allocations live
    /// together overlap; nor in a shuffled order, which judges whether to stack early. Told
    /// that the small allocations need too much room, the pass places them among the others.
    #[test]
    fn a_long_pass_stacks_its_small_allocations_above_the_others() {
        let allocs = crate::plan::traces::sharded_graph(10_000, 9);
        let p = Problem::new(&allocs, 1).unwrap();
        let by_size = by_size(&p);
        let mut greedy = Greedy::new(&p);
        let plan = greedy.pass(&p, &by_size, Fit::Lowest);
        assert!(greedy.reads.below_gaps() >= STACK_MERGES * greedy.fitted);
        assert_eq!(plan, pass(&p, &by_size, Fit::Lowest, Kept::None));
        crate::plan::validate(&allocs, &plan, 1).unwrap();

        let (small, top) = under_and_top(&p, &plan, greedy.small);
        assert!(small.len() > 1000);
        assert!(small.iter().all(|&i| plan.offsets[i] >= top));
        let only_small: Vec<_> = small.iter().map(|&i| allocs[i]).collect();
        let need = crate::plan::lower_bound(&only_small, 1).unwrap();
        let height = plan.arena_size - top;
        assert!(
            need <= height && height <= need + need / 3,
            "{height} for {need}"
        );

        assert_eq!(
            need,
            live_peak(&p, &greedy.span, greedy.leaves, greedy.small)
        );
        assert_eq!(greedy.stack_room, Some(true));

        let mut shuffled = p.nonzero();
        shuffled.sort_by_key(|&i| splitmix(u64::from(i)));
        let plan = greedy.pass(&p, &shuffled, Fit::Lowest);
        assert_eq!(plan, pass(&p, &shuffled, Fit::Lowest, Kept::None));
        crate::plan::validate(&allocs, &plan, 1).unwrap();

        // Where the small allocations would need too much room, the pass does not stack.
        greedy.stack_room = Some(false);
        let plan = greedy.pass(&p, &by_size, Fit::Lowest);
        crate::plan::validate(&allocs, &plan, 1).unwrap();
        let (small, top) = under_and_top(&p, &plan, greedy.small);
        assert!(small.iter().any(|&i| plan.offsets[i] < top));
    }

    proptest! {
        /// Placing in time order gives no two allocations live together overlapping bytes,
        /// none above the peak it answers, and that peak at least the most bytes live at once;
        /// whether a free gap at the top lowers the top or not, and over any subset.
        #[test]
        fn placing_in_time_order_makes_a_valid_layout(
            allocs in prop::collection::vec((1u64..1000, 0u64..50, 0u64..20, any::<bool>()), 1..200),
        ) {
            let p = Problem {
                sizes: allocs.iter().map(|a| a.0).collect(),
                first: allocs.iter().map(|a| a.1).collect(),
                last: allocs.iter().map(|a| a.1 + a.2).collect(),
            };
            let which: Vec<u32> = (0..allocs.len() as u32).filter(|&i| allocs[i as usize].3).collect();
            let chosen: Vec<_> = which
                .iter()
                .map(|&i| crate::plan::Allocation::new(p.sizes[i as usize], p.first[i as usize], p.last[i as usize]))
                .collect();
            let need = crate::plan::lower_bound(&chosen, 1).unwrap();
            for top in [Top::Kept, Top::Lowered] {
                let mut offsets = vec![0; allocs.len()];
                let never = AtomicBool::new(false);
                let peak = p.in_event_order(which.iter().copied(), top, &mut offsets, &never);
                let peak = peak.unwrap();
                let plan = OffsetPlan {
                    offsets: which.iter().map(|&i| offsets[i as usize]).collect(),
                    arena_size: peak,
                };
                prop_assert!(crate::plan::validate(&chosen, &plan, 1).is_ok(), "{:?}", top);
                prop_assert!(peak >= need);
            }
        }
    }

    proptest! {
        /// Floors only let first fit skip ranges that it would merge past anyway: with either
        /// kind, both or none, a pass puts every allocation at the same offset, placing by
        /// size or in a shuffled order, by first fit or by best fit (whose tiny allocations go
        /// by first fit). Sizes span six magnitudes and lifetimes overlap heavily, so merges
        /// are long.
        #[test]
        fn floors_never_move_an_allocation(
            allocs in prop::collection::vec((0u32..6, 1u64..64, 0u64..60, 0u64..40), 1..300),
            seed in any::<u64>(),
        ) {
            let p = Problem {
                sizes: allocs.iter().map(|&(scale, size, _, _)| size << (6 * scale)).collect(),
                first: allocs.iter().map(|a| a.2).collect(),
                last: allocs.iter().map(|a| a.2 + a.3).collect(),
            };
            let by_size = by_size(&p);
            let mut shuffled = p.nonzero();
            shuffled.sort_by_key(|&i| splitmix(seed ^ u64::from(i)));
            for sequence in [&by_size, &shuffled] {
                for fit in [Fit::Lowest, Fit::Smallest] {
                    let plain = pass(&p, sequence, fit, Kept::None);
                    for kept in [Kept::Nodes, Kept::Lifetimes, Kept::Both] {
                        let floored = pass(&p, sequence, fit, kept);
                        prop_assert_eq!(&plain, &floored, "{:?}", kept);
                    }
                }
            }
        }
    }

    /// A pass under a cap is given up exactly when the plan made without one is at least the
    /// cap's size, and otherwise makes that plan, after a given-up pass on the same scratch
    /// space too: on a dense graph (which takes on lifetime floors) and on a sparse model trace,
    /// by first fit and by best fit, with caps below, at and above the plan's arena.
    #[test]
    fn a_pass_under_a_cap_gives_up_exactly_when_its_plan_would_reach_it() {
        let inputs = [
            crate::plan::traces::sharded_graph(3000, 2),
            crate::plan::traces::transformer_training(4, 6, 2, 256, 512, 8, 3),
        ];
        for allocs in inputs {
            let p = Problem::new(&allocs, 1).unwrap();
            let by_size = by_size(&p);
            for fit in [Fit::Lowest, Fit::Smallest] {
                let plan = Greedy::new(&p).pass(&p, &by_size, fit);
                let arena = plan.arena_size;
                let mut greedy = Greedy::new(&p);
                for cap in [1, arena / 2, arena - 1, arena, arena + 1, u64::MAX] {
                    let made = greedy.pass_under(&p, &by_size, fit, Some(cap));
                    if arena >= cap {
                        assert_eq!(made, None, "{fit:?} cap {cap}, arena {arena}");
                    } else {
                        assert_eq!(made.as_ref(), Some(&plan), "{fit:?} cap {cap}");
                    }
                }
            }
        }
    }

    proptest! {
        /// A lookup answers the highest height raised for a lifetime whose blocks lie within
        /// the whole blocks of the range asked about (0 if none), as a scan of every raise
        /// says; so never more than the highest raised for a lifetime within the range.
        #[test]
        fn a_lifetime_floor_is_the_highest_raise_within_the_range(
            spans in prop::collection::vec((0u32..400, 1u32..200), 1..60),
            raises in prop::collection::vec((0usize..60, 1u64..1000), 0..80),
            asks in prop::collection::vec((0usize..400, 1usize..401), 1..40),
        ) {
            let leaves = 600usize;
            let spans: Vec<(u32, u32)> = spans.iter().map(|&(lo, len)| (lo, lo + len)).collect();
            let mut floors = LifetimeFloors::new(leaves, spans.iter().copied());
            let mut raised: Vec<((u32, u32), u64)> = Vec::new();
            for &(k, height) in &raises {
                let (lo, hi) = spans[k % spans.len()];
                floors.raise((lo as usize, hi as usize), height);
                raised.push(((lo, hi), height));
            }
            let block = 1usize << BLOCK_SHIFT;
            for &(lo, len) in &asks {
                let hi = (lo + len).min(leaves);
                let highest = |within: &dyn Fn(usize, usize) -> bool| {
                    raised
                        .iter()
                        .filter(|&&((l, h), _)| within(l as usize, h as usize))
                        .map(|&(_, height)| height)
                        .max()
                        .unwrap_or(0)
                };
                let by_blocks = highest(&|l, h| {
                    l / block >= lo.div_ceil(block) && h.div_ceil(block) <= hi / block
                });
                let exact = highest(&|l, h| l >= lo && h <= hi);
                let floor = floors.under((lo, hi));
                prop_assert_eq!(floor, by_blocks);
                prop_assert!(floor <= exact);
            }
        }
    }

    proptest! {
        /// A list holds the union of the intervals added to it, merged where they overlap or
        /// touch, short (scanned) or long (bisected, [`LONG_LIST`]); adding reports a change
        /// unless one held interval already covered the new one.
        #[test]
        fn a_list_holds_the_union_of_what_was_added(
            added in prop::collection::vec((0u64..20_000, 1u64..40), 1..400),
        ) {
            let mut lists = Lists::new(1);
            lists.clear();
            let mut union: Vec<(u64, u64)> = Vec::new();
            for &(start, len) in &added {
                let range = (start, start + len);
                let covered = union.iter().any(|&(s, e)| s <= range.0 && range.1 <= e);
                prop_assert_eq!(lists.add(0, range), !covered);
                union.push(range);
                union.sort_unstable();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for &(s, e) in &union {
                    match merged.last_mut() {
                        Some(last) if s <= last.1 => last.1 = last.1.max(e),
                        _ => merged.push((s, e)),
                    }
                }
                union = merged;
                prop_assert_eq!(lists.get(0), &union[..]);
            }
        }
    }
}

//! The greedy placement pass behind every greedy order: allocations, in a given order, each go
//! into the smallest gap (the lowest among equals) left by the already placed allocations they
//! are live with, or on top of them.
//!
//! The placed neighbours of an allocation are found without a conflict graph. With the
//! allocations ranked by first use, the ones that start during its lifetime are a run of
//! ranks, scanned in a bitmap of placed ranks; the ones that started earlier and are still
//! live when it starts are those whose own run contains its rank, found by a stabbing query
//! on a segment tree over ranks. Only placed neighbours are visited, each once, and they are
//! put in offset order with a bitmap over the distinct offsets placed so far.

use super::{OffsetPlan, Problem};

/// Rank structures of one problem and the scratch space of its passes.
pub(crate) struct Greedy {
    /// Nonzero allocations by (first use, index): rank → allocation.
    by_first: Vec<u32>,
    /// Allocation → rank (for nonzero allocations).
    rank: Vec<u32>,
    /// Ranks `r + 1 .. later_end[r]` start while rank `r` is live.
    later_end: Vec<u32>,
    /// Pairs of allocations live together: the work of one pass.
    pairs: usize,
    /// Leaves of the segment tree (a power of two, at least the number of ranks).
    leaves: usize,
    /// Segment tree over ranks: the placed ranks whose run covers each node.
    tree: Vec<Vec<u32>>,
    /// Placed ranks.
    placed: Vec<u64>,
    /// End and distinct-offset id of each placed rank.
    placed_at: Vec<(u64, u32)>,
    offsets: Vec<u64>,
    index: OffsetIndex,
}

impl Greedy {
    pub(crate) fn new(p: &Problem) -> Greedy {
        let mut keyed: Vec<(u64, u32)> = p
            .nonzero()
            .into_iter()
            .map(|i| (p.first[i as usize], i))
            .collect();
        keyed.sort_unstable();
        let firsts: Vec<u64> = keyed.iter().map(|&(f, _)| f).collect();
        let by_first: Vec<u32> = keyed.into_iter().map(|(_, i)| i).collect();
        let mut rank = vec![u32::MAX; p.len()];
        for (r, &i) in by_first.iter().enumerate() {
            rank[i as usize] = r as u32;
        }
        let later_end: Vec<u32> = by_first
            .iter()
            .map(|&i| firsts.partition_point(|&f| f <= p.last[i as usize]) as u32)
            .collect();
        // Rank r is live with every earlier rank except those that ended before it started
        // (which all have lower ranks, since they started earlier still).
        let mut lasts: Vec<u64> = by_first.iter().map(|&i| p.last[i as usize]).collect();
        lasts.sort_unstable();
        let pairs = firsts
            .iter()
            .enumerate()
            .map(|(r, &f)| r - lasts.partition_point(|&l| l < f))
            .sum();
        let m = by_first.len();
        let leaves = m.next_power_of_two().max(1);
        Greedy {
            by_first,
            rank,
            later_end,
            pairs,
            leaves,
            tree: vec![Vec::new(); 2 * leaves],
            placed: vec![0; m.div_ceil(64)],
            placed_at: vec![(0, 0); m],
            offsets: vec![0; p.len()],
            index: OffsetIndex::default(),
        }
    }

    /// The work of one pass: pairs of allocations live together, plus allocations.
    pub(crate) fn work(&self) -> usize {
        self.pairs + self.by_first.len()
    }

    /// Places the allocations of `sequence` (the nonzero ones of `p`, in placing order).
    pub(crate) fn pass(&mut self, p: &Problem, sequence: &[u32]) -> OffsetPlan {
        self.tree.iter_mut().for_each(Vec::clear);
        self.placed.iter_mut().for_each(|w| *w = 0);
        self.offsets.iter_mut().for_each(|o| *o = 0);
        self.index.clear();
        let mut arena = 0u64;
        for &i in sequence {
            let i = i as usize;
            let r = self.rank[i] as usize;
            let size = p.sizes[i];
            let end_rank = self.later_end[r] as usize;
            // Placed neighbours that start during this one's life.
            let (lo, hi) = (r + 1, end_rank);
            if lo < hi {
                for w in lo / 64..hi.div_ceil(64) {
                    let mut word = self.placed[w];
                    if w == lo / 64 {
                        word &= u64::MAX << (lo % 64);
                    }
                    if w == (hi - 1) / 64 && hi % 64 != 0 {
                        word &= u64::MAX >> (64 - hi % 64);
                    }
                    while word != 0 {
                        let q = w * 64 + word.trailing_zeros() as usize;
                        let (end, id) = self.placed_at[q];
                        self.index.mark(id, end);
                        word &= word - 1;
                    }
                }
            }
            // Placed neighbours that started earlier and are live when this one starts.
            let mut node = r + self.leaves;
            while node >= 1 {
                for &q in &self.tree[node] {
                    let (end, id) = self.placed_at[q as usize];
                    self.index.mark(id, end);
                }
                node >>= 1;
            }
            let mut top = 0u64;
            let mut best: Option<(u64, u64)> = None;
            self.index.drain(|start, end| {
                if start >= top + size {
                    let gap = start - top;
                    if best.is_none_or(|(g, _)| gap < g) {
                        best = Some((gap, top));
                    }
                }
                top = top.max(end);
            });
            let offset = best.map_or(top, |(_, at)| at);
            self.offsets[i] = offset;
            self.placed_at[r] = (offset + size, self.index.id(offset));
            self.placed[r / 64] |= 1 << (r % 64);
            self.insert(lo, hi, r as u32);
            arena = arena.max(offset + size);
        }
        OffsetPlan {
            offsets: self.offsets.clone(),
            arena_size: arena,
        }
    }

    /// Records that `rank` is live at ranks `lo..hi`.
    fn insert(&mut self, lo: usize, hi: usize, rank: u32) {
        let (mut l, mut h) = (lo + self.leaves, hi + self.leaves);
        while l < h {
            if l & 1 == 1 {
                self.tree[l].push(rank);
                l += 1;
            }
            if h & 1 == 1 {
                h -= 1;
                self.tree[h].push(rank);
            }
            l >>= 1;
            h >>= 1;
        }
    }
}

/// The distinct offsets placed so far, in order. Greedy layouts stack allocations on the
/// same few offsets, so there are far fewer distinct offsets than allocations, and the
/// neighbours of an allocation can be put in offset order by marking their offsets' ranks in
/// a bitmap, instead of sorting them.
#[derive(Default)]
struct OffsetIndex {
    /// Offsets by rank.
    values: Vec<u64>,
    id_at_rank: Vec<u32>,
    rank_of_id: Vec<u32>,
    /// Marks, by rank, the offsets of the neighbours being gathered.
    bits: Vec<u64>,
    /// Largest end among the gathered neighbours at each rank's offset.
    max_end: Vec<u64>,
}

impl OffsetIndex {
    fn clear(&mut self) {
        self.values.clear();
        self.id_at_rank.clear();
        self.rank_of_id.clear();
        self.bits.clear();
        self.max_end.clear();
    }

    /// The id of `offset`, added if new.
    fn id(&mut self, offset: u64) -> u32 {
        match self.values.binary_search(&offset) {
            Ok(rank) => self.id_at_rank[rank],
            Err(rank) => {
                let id = self.rank_of_id.len() as u32;
                for r in &mut self.rank_of_id {
                    if *r as usize >= rank {
                        *r += 1;
                    }
                }
                self.rank_of_id.push(rank as u32);
                self.values.insert(rank, offset);
                self.id_at_rank.insert(rank, id);
                self.max_end.push(0);
                self.bits.resize(self.values.len().div_ceil(64), 0);
                id
            }
        }
    }

    /// Marks a neighbour at offset id `id` ending at `end`.
    #[inline]
    fn mark(&mut self, id: u32, end: u64) {
        // The hottest loop of planning: every placed neighbour of every allocation passes here.
        debug_assert!((id as usize) < self.rank_of_id.len());
        // SAFETY: ids are only made by `id`, which pushes one `rank_of_id` entry per id.
        let r = unsafe { *self.rank_of_id.get_unchecked(id as usize) } as usize;
        debug_assert!(r < self.max_end.len() && r >> 6 < self.bits.len());
        // SAFETY: ranks are below `values.len()`, which `max_end` matches and `bits` covers
        // (both grow in `id` with `values`).
        unsafe {
            *self.bits.get_unchecked_mut(r >> 6) |= 1 << (r & 63);
            let slot = self.max_end.get_unchecked_mut(r);
            if end > *slot {
                *slot = end;
            }
        }
    }

    /// Calls `f(start, end)` for each marked offset in increasing order (with the largest end
    /// marked there), clearing the marks.
    #[inline]
    fn drain(&mut self, mut f: impl FnMut(u64, u64)) {
        for w in 0..self.bits.len() {
            let mut word = self.bits[w];
            if word == 0 {
                continue;
            }
            self.bits[w] = 0;
            while word != 0 {
                let r = w * 64 + word.trailing_zeros() as usize;
                f(self.values[r], self.max_end[r]);
                self.max_end[r] = 0;
                word &= word - 1;
            }
        }
    }
}

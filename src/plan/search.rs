//! Exact offset planning by branch and bound, for small inputs and under a work budget.
//!
//! Any layout can be pushed down until every allocation rests at offset 0 or on the end of an
//! allocation it is live with, without growing the arena. Placing allocations in increasing
//! (offset, index) order, each at 0 or at the end of an already placed conflicting one, so
//! reaches every such layout exactly once; allocations not yet placed all go at or above the
//! current offset, which gives the bound used for pruning.

use super::offsets::Conflicts;
use super::{OffsetPlan, Problem};

/// Inputs with more nonzero allocations than this are left to the heuristics.
const SEARCH_LIMIT: usize = 64;

struct Search {
    sizes: Vec<u64>,
    /// Bit `j` of `conflicts[k]`: allocations `k` and `j` are live together.
    conflicts: Vec<u64>,
    /// Bit `k` of `live[t]`: allocation `k` is live at time step `t`.
    live: Vec<u64>,
    offsets: Vec<u64>,
    best: Vec<u64>,
    best_size: u64,
    bound: u64,
    /// Nodes the search may still visit.
    nodes_left: u64,
    out_of_time: bool,
}

impl Problem {
    /// The smallest layout found within `nodes` search nodes, starting from `incumbent`;
    /// optimal when the search completes. Never larger than `incumbent`.
    pub(crate) fn branch_and_bound(
        &self,
        conflicts: &Conflicts,
        incumbent: OffsetPlan,
        bound: u64,
        nodes: u64,
    ) -> OffsetPlan {
        let ids = &conflicts.nonzero;
        let m = ids.len();
        if m > SEARCH_LIMIT || incumbent.arena_size <= bound {
            return incumbent;
        }
        let local: std::collections::HashMap<u32, usize> =
            ids.iter().enumerate().map(|(k, &i)| (i, k)).collect();
        let mut steps: Vec<u64> = ids.iter().map(|&i| self.first[i as usize]).collect();
        steps.sort_unstable();
        steps.dedup();
        let mut live = vec![0u64; steps.len()];
        let mut masks = vec![0u64; m];
        for (k, &i) in ids.iter().enumerate() {
            let i = i as usize;
            let s = steps.partition_point(|&t| t < self.first[i]);
            let e = steps.partition_point(|&t| t <= self.last[i]);
            for mask in &mut live[s..e] {
                *mask |= 1 << k;
            }
            for j in conflicts.of_alloc(i) {
                masks[k] |= 1 << local[&j];
            }
        }
        let mut search = Search {
            sizes: ids.iter().map(|&i| self.sizes[i as usize]).collect(),
            conflicts: masks,
            live,
            offsets: vec![0; m],
            best: ids.iter().map(|&i| incumbent.offsets[i as usize]).collect(),
            best_size: incumbent.arena_size,
            bound,
            nodes_left: nodes,
            out_of_time: false,
        };
        let before = search.best_size;
        search.descend(0, 0, None, 0);
        if search.best_size >= before {
            return incumbent;
        }
        let mut offsets = vec![0u64; self.len()];
        for (k, &i) in ids.iter().enumerate() {
            offsets[i as usize] = search.best[k];
        }
        OffsetPlan {
            offsets,
            arena_size: search.best_size,
        }
    }
}

impl Search {
    /// Places the next allocation above (`floor`, `last`) in (offset, index) order.
    fn descend(&mut self, placed: u64, floor: u64, last: Option<usize>, peak: u64) {
        if self.out_of_time || self.best_size <= self.bound {
            return;
        }
        if self.nodes_left == 0 {
            self.out_of_time = true;
            return;
        }
        self.nodes_left -= 1;
        let m = self.sizes.len();
        if placed.count_ones() as usize == m {
            if peak < self.best_size {
                self.best_size = peak;
                self.best.copy_from_slice(&self.offsets);
            }
            return;
        }
        // Everything not yet placed stacks above `floor`.
        let unplaced = !placed & mask_of(m);
        for &live in &self.live {
            let mut rest = live & unplaced;
            let mut sum = floor;
            while rest != 0 {
                sum += self.sizes[rest.trailing_zeros() as usize];
                rest &= rest - 1;
            }
            if sum >= self.best_size {
                return;
            }
        }
        let mut children: Vec<(u64, usize)> = Vec::new();
        for k in 0..m {
            if placed & (1 << k) != 0 {
                continue;
            }
            let size = self.sizes[k];
            let below = self.conflicts[k] & placed;
            let mut candidates = vec![0u64];
            let mut rest = below;
            while rest != 0 {
                let j = rest.trailing_zeros() as usize;
                candidates.push(self.offsets[j] + self.sizes[j]);
                rest &= rest - 1;
            }
            candidates.sort_unstable();
            candidates.dedup();
            for o in candidates {
                let after_last = match last {
                    None => true,
                    Some(l) => o > floor || (o == floor && k > l),
                };
                if !after_last || o + size >= self.best_size {
                    continue;
                }
                let mut rest = below;
                let mut free = true;
                while rest != 0 {
                    let j = rest.trailing_zeros() as usize;
                    if o < self.offsets[j] + self.sizes[j] && self.offsets[j] < o + size {
                        free = false;
                        break;
                    }
                    rest &= rest - 1;
                }
                if free {
                    children.push((o, k));
                }
            }
        }
        children.sort_unstable_by_key(|&(o, k)| (o, std::cmp::Reverse(self.sizes[k]), k));
        for (o, k) in children {
            self.offsets[k] = o;
            self.descend(placed | (1 << k), o, Some(k), peak.max(o + self.sizes[k]));
            if self.out_of_time || self.best_size <= self.bound {
                return;
            }
        }
    }
}

fn mask_of(m: usize) -> u64 {
    if m == 64 {
        u64::MAX
    } else {
        (1u64 << m) - 1
    }
}

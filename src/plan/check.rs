//! The lower bound every layout must reach, and the validator that proves a layout correct.

use std::collections::BTreeMap;

use super::{Allocation, OffsetPlan, Problem};
use crate::error::{Error, Result};

/// The smallest arena any layout of `allocs` can have: the largest number of bytes (sizes
/// rounded up to `alignment`) live at one time step. Fails on the inputs
/// [`plan_offsets`](super::plan_offsets) rejects.
pub fn lower_bound(allocs: &[Allocation], alignment: u64) -> Result<u64> {
    Ok(Problem::new(allocs, alignment)?.lower_bound())
}

impl Problem {
    pub(crate) fn lower_bound(&self) -> u64 {
        // Bytes live at step t: those started by t minus those ended before t. The maximum is
        // reached at some first use.
        let mut starts: Vec<(u64, u64)> = Vec::with_capacity(self.len());
        let mut ends: Vec<(u64, u64)> = Vec::with_capacity(self.len());
        for i in 0..self.len() {
            if self.sizes[i] > 0 {
                starts.push((self.first[i], self.sizes[i]));
                ends.push((self.last[i], self.sizes[i]));
            }
        }
        starts.sort_unstable();
        ends.sort_unstable();
        let (mut live, mut peak, mut e) = (0u64, 0u64, 0usize);
        for &(t, size) in &starts {
            while e < ends.len() && ends[e].0 < t {
                live -= ends[e].1;
                e += 1;
            }
            live += size;
            peak = peak.max(live);
        }
        peak
    }
}

/// Proves `plan` a correct layout of `allocs`: one offset per allocation, each a multiple of
/// `alignment`, each allocation (size rounded up to the alignment) inside the arena, and no two
/// allocations live at the same time sharing a byte. The error names the first fault found.
pub fn validate(allocs: &[Allocation], plan: &OffsetPlan, alignment: u64) -> Result<()> {
    let problem = Problem::new(allocs, alignment)?;
    if plan.offsets.len() != allocs.len() {
        return Err(Error::InvalidArgument(format!(
            "the plan has {} offsets for {} allocations",
            plan.offsets.len(),
            allocs.len()
        )));
    }
    for (i, (&offset, &size)) in plan.offsets.iter().zip(&problem.sizes).enumerate() {
        if offset % alignment != 0 {
            return Err(Error::InvalidArgument(format!(
                "allocation {i} is at offset {offset}, not a multiple of {alignment}"
            )));
        }
        let end = offset.checked_add(size);
        if size > 0 && end.is_none_or(|e| e > plan.arena_size) {
            return Err(Error::InvalidArgument(format!(
                "allocation {i} ({size} bytes at offset {offset}) ends past the arena ({} bytes)",
                plan.arena_size
            )));
        }
    }
    // Sweep through time, keeping the live allocations ordered by offset: a new one may only
    // collide with its neighbours in that order.
    let mut events: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * allocs.len());
    for i in 0..allocs.len() {
        if problem.sizes[i] > 0 {
            events.push((problem.first[i], 0, i));
            events.push((problem.last[i], 1, i));
        }
    }
    events.sort_unstable();
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    let end_of = |i: usize| plan.offsets[i] + problem.sizes[i];
    let collision = |i: usize, j: usize| {
        Error::InvalidArgument(format!(
            "allocations {j} and {i} are live together and overlap: [{}, {}) and [{}, {})",
            plan.offsets[j],
            end_of(j),
            plan.offsets[i],
            end_of(i)
        ))
    };
    for (_, kind, i) in events {
        let offset = plan.offsets[i];
        if kind == 1 {
            live.remove(&offset);
            continue;
        }
        if let Some((_, &below)) = live.range(..=offset).next_back() {
            if end_of(below) > offset {
                return Err(collision(i, below));
            }
        }
        if let Some((_, &above)) = live.range(offset..).next() {
            if plan.offsets[above] < end_of(i) {
                return Err(collision(i, above));
            }
        }
        live.insert(offset, i);
    }
    Ok(())
}

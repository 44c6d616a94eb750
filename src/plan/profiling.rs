//! The profiling allocator: record one iteration's allocations, plan them into one blob,
//! check later iterations against the plan, and serve them from the blob.
//!
//! An allocation's identity is its position in the iteration (the n-th `malloc`); its lifetime
//! is how many allocations had been made when it was freed. Allocations still live at the end
//! of the recording are not planned and always come from the ordinary allocator.
//!
//! Serving never trusts the plan blindly: a request that differs from the plan (another size,
//! more allocations than recorded) or whose planned bytes are still held by a live allocation
//! (an earlier free came late) goes to the ordinary allocator and is counted, so a changed
//! iteration costs speed, never correctness.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::memory::MemorySource;
use super::{plan_offsets, validate, Algorithm, Allocation, OffsetPlan};
use crate::error::{Error, Result};

/// A plan for the profiling allocator; serializes to JSON so that a plan made in testing can
/// be loaded in deployment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfilePlan {
    /// Alignment of every offset, and of the blob.
    pub alignment: u64,
    /// Name of the algorithm that made the offsets.
    pub algorithm: String,
    /// Bytes asked for by each allocation, in order.
    pub sizes: Vec<u64>,
    /// For each allocation, how many allocations had been made when it was freed; `None` when
    /// it was not freed during the recording (it is then not served from the blob).
    pub frees: Vec<Option<u64>>,
    /// Offset of each allocation in the blob (0 for those not served from it).
    pub offsets: Vec<u64>,
    /// Bytes of the blob.
    pub blob_size: u64,
}

impl ProfilePlan {
    /// Plans a recording with `algorithm`.
    pub fn new(
        sizes: Vec<u64>,
        frees: Vec<Option<u64>>,
        alignment: u64,
        algorithm: Algorithm,
    ) -> Result<ProfilePlan> {
        let allocations = allocations_of(&sizes, &frees)?;
        let OffsetPlan {
            offsets,
            arena_size,
        } = plan_offsets(&allocations, alignment, algorithm)?;
        Ok(ProfilePlan {
            alignment,
            algorithm: algorithm.name().to_string(),
            sizes,
            frees,
            offsets,
            blob_size: arena_size,
        })
    }

    /// Whether allocation `id` is served from the blob.
    pub fn planned(&self, id: usize) -> bool {
        self.sizes[id] > 0 && self.frees[id].is_some()
    }

    /// Proves the plan consistent (as a loaded plan must be before it is served from).
    pub fn check(&self) -> Result<()> {
        if self.frees.len() != self.sizes.len() || self.offsets.len() != self.sizes.len() {
            return Err(Error::InvalidArgument(format!(
                "the plan has {} sizes, {} frees and {} offsets",
                self.sizes.len(),
                self.frees.len(),
                self.offsets.len()
            )));
        }
        if usize::try_from(self.blob_size).is_err() {
            return Err(Error::InvalidArgument(format!(
                "the plan's blob ({} bytes) is too large",
                self.blob_size
            )));
        }
        let allocations = allocations_of(&self.sizes, &self.frees)?;
        let plan = OffsetPlan {
            offsets: self.offsets.clone(),
            arena_size: self.blob_size,
        };
        validate(&allocations, &plan, self.alignment)
    }

    /// Reads a plan from JSON and checks it.
    pub fn from_json(text: &str) -> Result<ProfilePlan> {
        let plan: ProfilePlan = serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("not a profiling plan: {e}")))?;
        plan.check()?;
        Ok(plan)
    }

    /// The plan as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a plan is plain data")
    }
}

/// The offset-planning problem of a recording: allocation `i` is made at step `i` and lives
/// until the step before the allocation that followed its free; unplanned ones get size 0.
fn allocations_of(sizes: &[u64], frees: &[Option<u64>]) -> Result<Vec<Allocation>> {
    let n = sizes.len() as u64;
    sizes
        .iter()
        .zip(frees)
        .enumerate()
        .map(|(i, (&size, &free))| {
            let i = i as u64;
            match free {
                None => Ok(Allocation::new(0, i, i)),
                Some(f) if f > i && f <= n => Ok(Allocation::new(size, i, f - 1)),
                Some(f) => Err(Error::InvalidArgument(format!(
                    "allocation {i} is freed after {f} allocations, outside 1 + {i} ..= {n}"
                ))),
            }
        })
        .collect()
}

/// What the profiling allocator is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Allocations come from the ordinary allocator and are not watched.
    Idle,
    /// Allocations come from the ordinary allocator and are recorded.
    Recording,
    /// Allocations come from the ordinary allocator and are compared with the plan.
    Validating,
    /// Allocations come from the blob as planned (or from the ordinary allocator).
    Serving,
}

/// Counters of a profiling allocator since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfilingStats {
    /// Allocations in the current plan (0 without one).
    pub plan_allocations: u64,
    /// Of those, how many are served from the blob.
    pub plan_planned: u64,
    /// Bytes of the current plan's blob.
    pub plan_blob_bytes: u64,
    /// Bytes of the blob held now (the largest plan served so far).
    pub blob_bytes: u64,
    /// Iterations recorded.
    pub recordings: u64,
    /// Iterations validated.
    pub validations: u64,
    /// Iterations validated that matched the plan.
    pub validations_matched: u64,
    /// Iterations served.
    pub iterations_served: u64,
    /// Allocations served from the blob.
    pub served_from_blob: u64,
    /// Allocations served by the ordinary allocator while serving because the plan leaves
    /// them out (not freed during the recording, or zero bytes).
    pub served_unplanned: u64,
    /// Allocations served by the ordinary allocator because they strayed from the plan.
    pub mismatches: u64,
    /// Frees that came at another point of the iteration than planned.
    pub lifetime_mismatches: u64,
    /// Pointers handed out and not yet freed.
    pub live_allocations: u64,
}

#[derive(Debug, Clone, Copy)]
enum Owner {
    /// In the blob at this offset; the allocation `id` of the serving iteration `epoch`.
    Blob { offset: u64, epoch: u64, id: u64 },
    /// From the ordinary allocator; the allocation `id` of iteration `epoch`.
    Ordinary { epoch: u64, id: u64 },
}

/// A profiling allocator over a memory source. Not thread-safe by itself (the C handle locks).
pub struct Profiler {
    memory: Box<dyn MemorySource>,
    alignment: u64,
    mode: Mode,
    /// Counts `begin_*` calls, so that frees of pointers from earlier iterations are told apart.
    epoch: u64,
    /// Allocations made in the current iteration.
    count: u64,
    rec_sizes: Vec<u64>,
    rec_frees: Vec<Option<u64>>,
    plan: Option<ProfilePlan>,
    validation_ok: bool,
    validation_frees: u64,
    blob: usize,
    blob_size: u64,
    /// Blob allocations outstanding: offset → end.
    blob_live: BTreeMap<u64, u64>,
    live: HashMap<usize, Owner>,
    stats: ProfilingStats,
}

impl Profiler {
    /// A profiling allocator whose blob and ordinary allocations come from `memory`, with
    /// offsets aligned to `alignment` (a nonzero power of two).
    pub fn new(memory: Box<dyn MemorySource>, alignment: u64) -> Result<Profiler> {
        super::check_alignment(alignment)?;
        if usize::try_from(alignment).is_err() {
            return Err(Error::InvalidArgument(format!(
                "alignment {alignment} is too large"
            )));
        }
        Ok(Profiler {
            memory,
            alignment,
            mode: Mode::Idle,
            epoch: 0,
            count: 0,
            rec_sizes: Vec::new(),
            rec_frees: Vec::new(),
            plan: None,
            validation_ok: true,
            validation_frees: 0,
            blob: 0,
            blob_size: 0,
            blob_live: BTreeMap::new(),
            live: HashMap::new(),
            stats: ProfilingStats::default(),
        })
    }

    /// What the allocator is doing now.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The current plan, if any.
    pub fn plan(&self) -> Option<&ProfilePlan> {
        self.plan.as_ref()
    }

    fn begin(&mut self, mode: Mode) -> Result<()> {
        if self.mode != Mode::Idle {
            return Err(Error::InvalidArgument(format!(
                "cannot begin {mode:?} while {:?} (end it first)",
                self.mode
            )));
        }
        self.mode = mode;
        self.epoch += 1;
        self.count = 0;
        Ok(())
    }

    fn end(&mut self, mode: Mode) -> Result<()> {
        if self.mode != mode {
            return Err(Error::InvalidArgument(format!(
                "cannot end {mode:?} while {:?}",
                self.mode
            )));
        }
        self.mode = Mode::Idle;
        Ok(())
    }

    /// Starts recording an iteration (replacing any earlier recording).
    pub fn begin_recording(&mut self) -> Result<()> {
        self.begin(Mode::Recording)?;
        self.rec_sizes.clear();
        self.rec_frees.clear();
        Ok(())
    }

    /// Ends the recording.
    pub fn end_recording(&mut self) -> Result<()> {
        self.end(Mode::Recording)?;
        self.stats.recordings += 1;
        Ok(())
    }

    /// Plans the last recording with `algorithm`, replacing the current plan.
    pub fn formulate(&mut self, algorithm: Algorithm) -> Result<()> {
        if self.mode != Mode::Idle {
            return Err(Error::InvalidArgument(format!(
                "cannot plan while {:?}",
                self.mode
            )));
        }
        if self.stats.recordings == 0 {
            return Err(Error::InvalidArgument(
                "nothing was recorded to plan".to_string(),
            ));
        }
        let plan = ProfilePlan::new(
            self.rec_sizes.clone(),
            self.rec_frees.clone(),
            self.alignment,
            algorithm,
        )?;
        self.set_plan(plan)
    }

    /// Replaces the current plan with `plan` (checked first).
    pub fn set_plan(&mut self, plan: ProfilePlan) -> Result<()> {
        if self.mode != Mode::Idle {
            return Err(Error::InvalidArgument(format!(
                "cannot change the plan while {:?}",
                self.mode
            )));
        }
        plan.check()?;
        if plan.alignment < self.alignment {
            return Err(Error::InvalidArgument(format!(
                "the plan's alignment ({}) is less than this allocator's ({}): its offsets would \
                 give pointers the allocator does not promise",
                plan.alignment, self.alignment
            )));
        }
        if usize::try_from(plan.alignment).is_err() {
            return Err(Error::InvalidArgument(format!(
                "alignment {} is too large",
                plan.alignment
            )));
        }
        self.stats.plan_allocations = plan.sizes.len() as u64;
        self.stats.plan_planned = (0..plan.sizes.len()).filter(|&i| plan.planned(i)).count() as u64;
        self.stats.plan_blob_bytes = plan.blob_size;
        self.plan = Some(plan);
        Ok(())
    }

    fn require_plan(&self) -> Result<&ProfilePlan> {
        self.plan.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "there is no plan: record and plan, or load one, first".to_string(),
            )
        })
    }

    /// Starts comparing an iteration with the plan.
    pub fn begin_validating(&mut self) -> Result<()> {
        self.require_plan()?;
        self.begin(Mode::Validating)?;
        self.validation_ok = true;
        self.validation_frees = 0;
        Ok(())
    }

    /// Ends the comparison: whether the iteration made the planned allocations, of the planned
    /// sizes, and freed each at its planned point.
    pub fn end_validating(&mut self) -> Result<bool> {
        self.end(Mode::Validating)?;
        let plan = self.require_plan()?;
        let expected_frees = plan.frees.iter().filter(|f| f.is_some()).count() as u64;
        let matched = self.validation_ok
            && self.count == plan.sizes.len() as u64
            && self.validation_frees == expected_frees;
        self.stats.validations += 1;
        if matched {
            self.stats.validations_matched += 1;
        }
        Ok(matched)
    }

    /// Starts serving an iteration from the blob, allocating (or growing) the blob first.
    /// Growing fails while allocations from the old blob are live.
    pub fn begin_serving(&mut self) -> Result<()> {
        let plan = self.require_plan()?;
        let (need, alignment) = (plan.blob_size, plan.alignment);
        if self.mode != Mode::Idle {
            return self.begin(Mode::Serving);
        }
        if need > self.blob_size {
            if !self.blob_live.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "the plan needs a larger blob ({need} bytes) but {} allocations from the current one are live",
                    self.blob_live.len()
                )));
            }
            let blob = self.memory.allocate(need as usize, alignment as usize)?;
            if self.blob != 0 {
                self.memory.deallocate(self.blob)?;
            }
            self.blob = blob;
            self.blob_size = need;
            self.stats.blob_bytes = need;
        } else if self.blob != 0 && !self.blob.is_multiple_of(alignment as usize) {
            return Err(Error::InvalidArgument(format!(
                "the plan's alignment ({alignment}) is larger than the blob's; make a new allocator"
            )));
        }
        self.begin(Mode::Serving)
    }

    /// Ends serving. Allocations still live stay valid until freed.
    pub fn end_serving(&mut self) -> Result<()> {
        self.end(Mode::Serving)?;
        self.stats.iterations_served += 1;
        Ok(())
    }

    /// Allocates `size` bytes. Returns 0 for zero bytes (which still count as an allocation of
    /// the iteration).
    pub fn malloc(&mut self, size: u64) -> Result<usize> {
        let id = self.count;
        let epoch = self.epoch;
        let from_plan = match self.mode {
            Mode::Recording => {
                self.rec_sizes.push(size);
                self.rec_frees.push(None);
                None
            }
            Mode::Validating => {
                let plan = self.plan.as_ref().expect("validating needs a plan");
                if plan.sizes.get(id as usize) != Some(&size) {
                    self.validation_ok = false;
                }
                None
            }
            Mode::Serving => self.blob_slot(id, size),
            Mode::Idle => None,
        };
        self.count += 1;
        if size == 0 {
            return Ok(0);
        }
        if let Some(offset) = from_plan {
            let addr = self.blob + offset as usize;
            self.blob_live.insert(offset, offset + size);
            self.live.insert(addr, Owner::Blob { offset, epoch, id });
            self.stats.served_from_blob += 1;
            self.stats.live_allocations += 1;
            return Ok(addr);
        }
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("absurd size {size}")))?;
        let addr = self.memory.allocate(size, self.alignment as usize)?;
        self.live.insert(addr, Owner::Ordinary { epoch, id });
        self.stats.live_allocations += 1;
        Ok(addr)
    }

    /// The blob offset for allocation `id` of `size` bytes while serving, or `None` (counted)
    /// when it must come from the ordinary allocator.
    fn blob_slot(&mut self, id: u64, size: u64) -> Option<u64> {
        let plan = self.plan.as_ref().expect("serving needs a plan");
        let i = id as usize;
        if plan.sizes.get(i) != Some(&size) {
            self.stats.mismatches += 1;
            return None;
        }
        if !plan.planned(i) {
            if size > 0 {
                self.stats.served_unplanned += 1;
            }
            return None;
        }
        let offset = plan.offsets[i];
        let end = offset + size;
        let below = self.blob_live.range(..end).next_back();
        if below.is_some_and(|(_, &e)| e > offset) {
            self.stats.mismatches += 1;
            return None;
        }
        Some(offset)
    }

    /// Frees `addr` (from [`Profiler::malloc`]; 0 is ignored).
    pub fn free(&mut self, addr: usize) -> Result<()> {
        if addr == 0 {
            return Ok(());
        }
        let owner = self.live.remove(&addr).ok_or_else(|| {
            Error::UnknownPointer(format!(
                "{addr:#x} was not allocated by this profiling allocator, or was freed"
            ))
        })?;
        self.stats.live_allocations -= 1;
        let (epoch, id) = match owner {
            Owner::Blob { offset, epoch, id } => {
                self.blob_live.remove(&offset);
                (epoch, id)
            }
            Owner::Ordinary { epoch, id } => {
                self.memory.deallocate(addr)?;
                (epoch, id)
            }
        };
        if epoch != self.epoch {
            return Ok(());
        }
        match self.mode {
            Mode::Recording => self.rec_frees[id as usize] = Some(self.count),
            Mode::Validating => {
                let plan = self.plan.as_ref().expect("validating needs a plan");
                if plan.frees.get(id as usize).copied().flatten() == Some(self.count) {
                    self.validation_frees += 1;
                } else {
                    self.validation_ok = false;
                }
            }
            Mode::Serving => {
                let plan = self.plan.as_ref().expect("serving needs a plan");
                if plan.frees.get(id as usize).copied().flatten() != Some(self.count) {
                    self.stats.lifetime_mismatches += 1;
                }
            }
            Mode::Idle => {}
        }
        Ok(())
    }

    /// The counters.
    pub fn stats(&self) -> ProfilingStats {
        self.stats
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        for (&addr, owner) in &self.live {
            if let Owner::Ordinary { .. } = owner {
                let _ = self.memory.deallocate(addr);
            }
        }
        if self.blob != 0 {
            let _ = self.memory.deallocate(self.blob);
        }
    }
}

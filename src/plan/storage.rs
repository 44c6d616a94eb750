//! The storage-group planner (Static Runtime's `MemoryPlanner`): values that are never live
//! at the same time share a storage group; each iteration gets one buffer holding every
//! group at its own offset, sized by the largest value the group has held so far.
//!
//! Values are assigned in time order: the values first used at a time step take a free group
//! (the one freed most recently) or a new one, then the values last used at that step give
//! their groups back. The first iteration has no sizes yet, so its values come from wherever
//! the client allocates them; the sizes it reports make the buffer of the next iteration.
//!
//! Managed outputs are not reused: each gets its own slot in a separate output buffer, which
//! stays allocated until the client releases the outputs.

use super::memory::MemorySource;
use super::{align_up, DEFAULT_ALIGNMENT};
use crate::error::{Error, Result};

/// The largest size a value may report: 1 PiB, more than any device or host holds, so that a
/// negative number passed as a size is refused rather than laid out.
const MAX_VALUE_BYTES: u64 = 1 << 50;

/// A value to manage: the inclusive range of time steps (nodes) that use it, and whether it
/// is an output the client keeps after the iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageValue {
    /// First time step (node) that uses the value.
    pub first_use: u64,
    /// Last time step (node) that uses the value, inclusive.
    pub last_use: u64,
    /// Whether the value is a managed output (own slot, kept until released).
    pub output: bool,
}

/// The planner's counters, as Static Runtime reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageStats {
    /// Bytes of the intermediate buffer: the sum of the groups' sizes.
    pub managed_bytes: u64,
    /// Intermediate (non-output) values managed.
    pub managed_values: u64,
    /// Values that share a group with an earlier one, in the last laid-out buffer.
    pub reused_values: u64,
    /// Bytes of the output buffer.
    pub output_buffer_bytes: u64,
    /// Storage groups.
    pub groups: u64,
    /// Managed outputs.
    pub outputs: u64,
    /// Iterations ended.
    pub iterations: u64,
}

#[derive(Debug, Clone)]
struct Slot {
    /// Largest aligned size held so far.
    size: u64,
    /// Offset in the buffer, while one is allocated and the slot has a nonzero size.
    offset: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
enum Home {
    Group(usize),
    Output(usize),
}

/// A storage-group planner over a memory source. Not thread-safe by itself.
pub struct StoragePlanner {
    memory: Box<dyn MemorySource>,
    homes: Vec<Home>,
    /// Members of each group, in assignment order.
    members: Vec<Vec<usize>>,
    groups: Vec<Slot>,
    outputs: Vec<Slot>,
    /// Aligned size each value reported in the current iteration.
    reported: Vec<u64>,
    buffer: usize,
    output_buffer: usize,
    running: bool,
    /// An iteration with managed outputs ended and they are not released yet.
    outputs_held: bool,
    stats: StorageStats,
}

impl StoragePlanner {
    /// Assigns `values` to storage groups. Fails when a value's last use comes before its
    /// first.
    pub fn new(values: &[StorageValue], memory: Box<dyn MemorySource>) -> Result<StoragePlanner> {
        for (i, v) in values.iter().enumerate() {
            if v.first_use > v.last_use {
                return Err(Error::InvalidArgument(format!(
                    "value {i} ends (last use {}) before it starts (first use {})",
                    v.last_use, v.first_use
                )));
            }
        }
        let mut homes = vec![Home::Output(0); values.len()];
        let mut outputs = 0;
        for (i, v) in values.iter().enumerate() {
            if v.output {
                homes[i] = Home::Output(outputs);
                outputs += 1;
            }
        }
        // (time, 0 = first use / 1 = last use, value): at one step, uses before releases.
        let mut events: Vec<(u64, u8, usize)> = Vec::new();
        for (i, v) in values.iter().enumerate().filter(|(_, v)| !v.output) {
            events.push((v.first_use, 0, i));
            events.push((v.last_use, 1, i));
        }
        events.sort_unstable();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut free: Vec<usize> = Vec::new();
        for (_, kind, i) in events {
            if kind == 0 {
                let group = free.pop().unwrap_or_else(|| {
                    members.push(Vec::new());
                    members.len() - 1
                });
                members[group].push(i);
                homes[i] = Home::Group(group);
            } else if let Home::Group(g) = homes[i] {
                free.push(g);
            }
        }
        let empty = Slot {
            size: 0,
            offset: None,
        };
        let stats = StorageStats {
            managed_values: (values.len() - outputs) as u64,
            groups: members.len() as u64,
            outputs: outputs as u64,
            ..StorageStats::default()
        };
        Ok(StoragePlanner {
            memory,
            homes,
            groups: vec![empty.clone(); members.len()],
            members,
            outputs: vec![empty; outputs],
            reported: vec![0; values.len()],
            buffer: 0,
            output_buffer: 0,
            running: false,
            outputs_held: false,
            stats,
        })
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.homes.len()
    }

    /// Whether the planner has no values.
    pub fn is_empty(&self) -> bool {
        self.homes.is_empty()
    }

    /// The storage group of value `v` (`None` for an output, or an unknown value).
    pub fn group_of(&self, v: usize) -> Option<usize> {
        match self.homes.get(v) {
            Some(&Home::Group(g)) => Some(g),
            _ => None,
        }
    }

    /// The values of group `g`, in assignment order.
    pub fn members(&self, g: usize) -> &[usize] {
        &self.members[g]
    }

    /// Starts an iteration: allocates the intermediate buffer (when the groups have sizes) and
    /// the output buffer (when the outputs have sizes). Fails while an iteration runs, or
    /// when the previous iteration made managed outputs that are not released yet.
    pub fn allocate(&mut self) -> Result<()> {
        if self.running {
            return Err(Error::InvalidArgument(
                "an iteration is already running (deallocate ends it)".to_string(),
            ));
        }
        if self.outputs_held {
            return Err(Error::InvalidArgument(
                "the previous iteration's outputs are not released yet".to_string(),
            ));
        }
        let (Some(managed), Some(outputs)) =
            (lay_out(&mut self.groups), lay_out(&mut self.outputs))
        else {
            self.groups.iter_mut().for_each(|s| s.offset = None);
            self.outputs.iter_mut().for_each(|s| s.offset = None);
            return Err(Error::OutOfMemory(
                "the values' sizes add up to more than 2^64 bytes".to_string(),
            ));
        };
        self.buffer = self.take(managed)?;
        match self.take(outputs) {
            Ok(b) => self.output_buffer = b,
            Err(e) => {
                self.give_back_buffer();
                return Err(e);
            }
        }
        self.stats.managed_bytes = managed;
        self.stats.output_buffer_bytes = outputs;
        self.stats.reused_values = self
            .members
            .iter()
            .zip(&self.groups)
            .filter(|(_, slot)| slot.size > 0)
            .map(|(m, _)| m.len() as u64 - 1)
            .sum();
        self.running = true;
        Ok(())
    }

    fn take(&self, bytes: u64) -> Result<usize> {
        if bytes == 0 {
            return Ok(0);
        }
        let bytes =
            usize::try_from(bytes).map_err(|_| Error::OutOfMemory(format!("{bytes} bytes")))?;
        self.memory.allocate(bytes, DEFAULT_ALIGNMENT as usize)
    }

    fn give_back_buffer(&mut self) {
        if self.buffer != 0 {
            let _ = self.memory.deallocate(self.buffer);
            self.buffer = 0;
        }
        self.groups.iter_mut().for_each(|s| s.offset = None);
    }

    /// Reports that value `v` needs `nbytes` bytes in this iteration, and returns where it
    /// lives in the buffer, or `None` when the buffer has no room for it yet (the first
    /// iteration, or a value larger than ever before): the client then allocates it itself,
    /// and the next iteration's buffer has room.
    pub fn place(&mut self, v: usize, nbytes: u64) -> Result<Option<usize>> {
        if !self.running {
            return Err(Error::InvalidArgument(
                "no iteration is running (allocate starts one)".to_string(),
            ));
        }
        let home = *self.homes.get(v).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "there is no value {v} (the planner has {})",
                self.homes.len()
            ))
        })?;
        let aligned = align_up(nbytes, DEFAULT_ALIGNMENT)
            .filter(|&a| a <= MAX_VALUE_BYTES)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "size {nbytes} of value {v} is absurd (more than 1 PiB: a negative number \
                     passed as a size?)"
                ))
            })?;
        self.reported[v] = self.reported[v].max(aligned);
        let (slot, base) = match home {
            Home::Group(g) => (&self.groups[g], self.buffer),
            Home::Output(o) => (&self.outputs[o], self.output_buffer),
        };
        Ok(match slot.offset {
            Some(offset) if aligned <= slot.size && base != 0 => Some(base + offset as usize),
            _ => None,
        })
    }

    /// Ends an iteration: the groups grow to the largest size any member reported, and the
    /// intermediate buffer is freed (the output buffer stays until [`Self::release_outputs`]).
    pub fn deallocate(&mut self) -> Result<()> {
        if !self.running {
            return Err(Error::InvalidArgument(
                "no iteration is running".to_string(),
            ));
        }
        for (slot, members) in self.groups.iter_mut().zip(&self.members) {
            for &v in members {
                slot.size = slot.size.max(self.reported[v]);
                self.reported[v] = 0;
            }
        }
        self.stats.managed_bytes = total(&self.groups);
        self.give_back_buffer();
        self.running = false;
        self.outputs_held = !self.outputs.is_empty();
        self.stats.iterations += 1;
        Ok(())
    }

    /// Releases the managed outputs: their slots grow to the sizes reported, and the output
    /// buffer is freed. Fails while an iteration runs.
    pub fn release_outputs(&mut self) -> Result<()> {
        if self.running {
            return Err(Error::InvalidArgument(
                "outputs are released after the iteration ends".to_string(),
            ));
        }
        for (v, home) in self.homes.iter().enumerate() {
            if let Home::Output(o) = *home {
                self.outputs[o].size = self.outputs[o].size.max(self.reported[v]);
                self.reported[v] = 0;
            }
        }
        self.stats.output_buffer_bytes = total(&self.outputs);
        if self.output_buffer != 0 {
            self.memory.deallocate(self.output_buffer)?;
            self.output_buffer = 0;
        }
        self.outputs.iter_mut().for_each(|s| s.offset = None);
        self.outputs_held = false;
        Ok(())
    }

    /// The counters.
    pub fn stats(&self) -> StorageStats {
        self.stats
    }
}

/// The bytes of `slots`, at most `u64::MAX`.
fn total(slots: &[Slot]) -> u64 {
    slots.iter().fold(0, |sum, s| sum.saturating_add(s.size))
}

/// Gives each slot with a nonzero size the next offset; returns the total, or `None` when it
/// passes `u64::MAX` (the offsets are then partly written: the caller clears them).
fn lay_out(slots: &mut [Slot]) -> Option<u64> {
    let mut offset = 0u64;
    for slot in slots {
        if slot.size > 0 {
            slot.offset = Some(offset);
            offset = offset.checked_add(slot.size)?;
        } else {
            slot.offset = None;
        }
    }
    Some(offset)
}

impl Drop for StoragePlanner {
    fn drop(&mut self) {
        self.give_back_buffer();
        if self.output_buffer != 0 {
            let _ = self.memory.deallocate(self.output_buffer);
        }
    }
}

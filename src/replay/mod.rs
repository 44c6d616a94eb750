//! Replaying recorded allocation traces on the simulated device: "will this run fit in N GB
//! with these settings?" without a GPU.
//!
//! [`snapshot`] reads a PyTorch memory snapshot into a [`Trace`]; [`run`] builds a fresh
//! unbacked simulated device of the given capacity and a [`DeviceAllocator`] with the given
//! [`Config`], recreates the state at the first event, then allocates at every `alloc` and
//! frees at every `free_completed`, mapping the recorded addresses to the replayed ones.
//!
//! Allocated bytes are counted as PyTorch counts them: a block stops counting at its
//! `free_requested`, even while other streams keep it out of the pool until
//! `free_completed`. Reserved bytes are the replayed allocator's.

mod guard;
pub mod output;
pub mod snapshot;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::config::Config;
use crate::device::size::format_bytes;
use crate::device::DeviceAllocator;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::error::{Error, Result};
pub use snapshot::{Action, InitialSegment, Trace, TraceEvent};

/// Device capacity used when none is given: large enough that no trace runs out.
pub const UNLIMITED_MEMORY: u64 = 1 << 40;

/// Parses an allocator configuration as `TENSORALLOC_CONF` does; `default` (or nothing) is
/// the default configuration.
pub fn parse_config(text: &str) -> Result<Config> {
    let t = text.trim();
    if t.is_empty() || t == "default" {
        Ok(Config::default())
    } else {
        Config::parse(t)
    }
}

/// The first allocation that failed for lack of device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OomEvent {
    /// Index of the `alloc` event in the trace.
    pub index: usize,
    /// Bytes it asked for.
    pub size: u64,
    /// Its stream.
    pub stream: u64,
    /// Bytes allocated just before it.
    pub allocated_bytes: u64,
    /// Bytes reserved just before it.
    pub reserved_bytes: u64,
}

/// One point of the time series: after event `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sample {
    pub index: usize,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
}

/// What a replay found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Segments the replayed allocator obtained from the device during the trace.
    pub num_device_alloc: u64,
    /// Allocations that failed for lack of memory (they are skipped, with their frees).
    pub ooms: u64,
    pub first_oom_event: Option<OomEvent>,
    pub events: usize,
    /// Bytes reserved before the first event (segments recreated from the snapshot).
    pub initial_reserved_bytes: u64,
    /// Wall time of the replay loop per event (0 for an empty trace).
    pub ns_per_event: f64,
    /// Allocated and reserved bytes after every event, when asked for.
    #[serde(skip)]
    pub series: Vec<Sample>,
}

impl Report {
    /// Peak reserved over peak allocated (1.0 for an empty trace).
    pub fn ratio(&self) -> f64 {
        if self.peak_allocated_bytes == 0 {
            1.0
        } else {
            self.peak_reserved_bytes as f64 / self.peak_allocated_bytes as f64
        }
    }
}

/// How to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Capacity of the simulated device.
    pub memory: u64,
    /// Keep allocated and reserved bytes after every event in [`Report::series`].
    pub series: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            memory: UNLIMITED_MEMORY,
            series: false,
        }
    }
}

/// Replays `trace` with `config` on a simulated device of `memory` bytes.
pub fn run(trace: &Trace, config: &Config, memory: u64) -> Result<Report> {
    run_with(
        trace,
        config,
        &Options {
            memory,
            series: false,
        },
        &mut |_| {},
    )
}

/// A block of the trace that the replayed allocator holds.
struct Live {
    addr: usize,
    stream: usize,
    bytes: u64,
    free_requested: bool,
}

/// Replays `trace`; `progress` is told how many events are done, every few thousand events.
/// Fails with [`Error::OutOfMemory`] when the segments reserved when recording started do not
/// fit in the device (the trace cannot start), and with [`Error::InvalidArgument`] when the
/// settings or the trace cannot be replayed.
pub fn run_with(
    trace: &Trace,
    config: &Config,
    options: &Options,
    progress: &mut dyn FnMut(usize),
) -> Result<Report> {
    if options.memory == 0 {
        return Err(Error::InvalidArgument(
            "device memory must be more than 0 bytes".into(),
        ));
    }
    let driver = SimDriver::new(SimConfig {
        devices: 1,
        capacity: options.memory,
        backed: false,
    })?;
    let alloc = DeviceAllocator::new(Arc::new(driver), 0, config)?;
    let mut live = recreate(&alloc, trace, options.memory)?;
    let device_allocs_before = alloc.stats().num_device_alloc;
    let (_, reserved0) = alloc.current_bytes();
    let mut allocated: u64 = live
        .values()
        .filter(|l| !l.free_requested)
        .map(|l| l.bytes)
        .sum();
    let mut report = Report {
        peak_allocated_bytes: allocated,
        peak_reserved_bytes: reserved0,
        num_device_alloc: 0,
        ooms: 0,
        first_oom_event: None,
        events: trace.events.len(),
        initial_reserved_bytes: reserved0,
        ns_per_event: 0.0,
        series: Vec::with_capacity(if options.series {
            trace.events.len()
        } else {
            0
        }),
    };
    let mut reserved = reserved0;
    let start = Instant::now();
    for (index, e) in trace.events.iter().enumerate() {
        match e.action {
            Action::Alloc => {
                let (before, _) = alloc.current_bytes();
                match alloc.malloc(e.size as usize, e.stream as usize) {
                    Ok(addr) => {
                        let (after, now_reserved) = alloc.current_bytes();
                        let bytes = after - before;
                        live.insert(
                            e.addr,
                            Live {
                                addr,
                                stream: e.stream as usize,
                                bytes,
                                free_requested: false,
                            },
                        );
                        allocated += bytes;
                        reserved = now_reserved;
                        report.peak_allocated_bytes = report.peak_allocated_bytes.max(allocated);
                        report.peak_reserved_bytes = report.peak_reserved_bytes.max(reserved);
                    }
                    Err(Error::OutOfMemory(_)) => {
                        report.ooms += 1;
                        reserved = alloc.current_bytes().1;
                        report.first_oom_event.get_or_insert(OomEvent {
                            index,
                            size: e.size,
                            stream: e.stream,
                            allocated_bytes: allocated,
                            reserved_bytes: reserved,
                        });
                    }
                    Err(err) => {
                        return Err(Error::InvalidArgument(format!(
                            "event {index} (alloc of {} bytes): {err}",
                            e.size
                        )))
                    }
                }
            }
            Action::FreeRequested => {
                if let Some(l) = live.get_mut(&e.addr) {
                    if !l.free_requested {
                        l.free_requested = true;
                        allocated -= l.bytes;
                    }
                }
            }
            Action::FreeCompleted => {
                if let Some(l) = live.remove(&e.addr) {
                    if !l.free_requested {
                        allocated -= l.bytes;
                    }
                    alloc.free(l.addr, Some(l.stream))?;
                    reserved = alloc.current_bytes().1;
                }
            }
            _ => {}
        }
        if options.series {
            report.series.push(Sample {
                index,
                allocated_bytes: allocated,
                reserved_bytes: reserved,
            });
        }
        if index % 4096 == 4095 {
            progress(index + 1);
        }
    }
    let elapsed = start.elapsed();
    progress(trace.events.len());
    // An empty trace has no time per event.
    report.ns_per_event = if trace.events.is_empty() {
        0.0
    } else {
        elapsed.as_nanos() as f64 / trace.events.len() as f64
    };
    report.num_device_alloc = (alloc.stats().num_device_alloc - device_allocs_before).max(0) as u64;
    Ok(report)
}

/// Recreates the segments and live blocks at the first event; returns the live blocks by
/// recorded address.
///
/// Each segment is first taken whole (so no other free block exists), then given back and
/// allocated again piece by piece in address order (gaps and live blocks), so the live blocks
/// land at their recorded offsets; finally the gaps are freed.
fn recreate(alloc: &DeviceAllocator, trace: &Trace, memory: u64) -> Result<HashMap<u64, Live>> {
    const HALF_SMALL: usize = 1 << 20;
    let mut live = HashMap::new();
    // Running out of memory here is an answer (the state the recording started in does not
    // fit); anything else is a trace the allocator cannot take.
    let setup = |e: Error| match e {
        Error::OutOfMemory(_) => Error::OutOfMemory(format!(
            "the {} reserved when recording started {} the device's {}",
            format_bytes(trace.initial_reserved()),
            if trace.initial_reserved() > memory {
                "need more than"
            } else {
                "could not be laid out again in"
            },
            format_bytes(memory)
        )),
        e => Error::InvalidArgument(format!(
            "recreating the {} bytes reserved before the first event: {e}",
            trace.initial_reserved()
        )),
    };
    let mut holders: Vec<Vec<usize>> = Vec::with_capacity(trace.initial.len());
    for s in &trace.initial {
        let stream = s.stream as usize;
        let held = if s.small {
            vec![
                alloc.malloc(HALF_SMALL, stream).map_err(setup)?,
                alloc.malloc(HALF_SMALL, stream).map_err(setup)?,
            ]
        } else {
            vec![alloc.malloc(s.size as usize, stream).map_err(setup)?]
        };
        holders.push(held);
    }
    let mut gaps = Vec::new();
    for (s, held) in trace.initial.iter().zip(holders) {
        let stream = s.stream as usize;
        for p in held {
            alloc.free(p, Some(stream))?;
        }
        let mut cursor = s.addr;
        // Every gap is taken too, the one after the last live block included, so that the
        // only free block is always the rest of the segment being laid out.
        let fill = |cursor: u64, end: u64, gaps: &mut Vec<usize>| -> Result<()> {
            let mut gap = end.saturating_sub(cursor) as usize;
            // A large-pool gap of up to 1 MiB cannot be asked for (it would come from the
            // small pool); PyTorch's rules never leave one.
            if !s.small && gap <= HALF_SMALL {
                return Ok(());
            }
            while gap > 0 {
                let piece = if s.small { gap.min(HALF_SMALL) } else { gap };
                gaps.push(alloc.malloc(piece, stream).map_err(setup)?);
                gap -= piece;
            }
            Ok(())
        };
        for (i, b) in s.live.iter().enumerate() {
            fill(cursor, b.addr, &mut gaps)?;
            // Events give requested sizes; the block is rounded, and in the large pool it
            // kept any rest of up to 1 MiB before the next block (PyTorch does not split
            // that off).
            let next = s.live.get(i + 1).map_or(s.addr + s.size, |n| n.addr);
            let mut size = b.size.max(1).next_multiple_of(512);
            if !s.small && next.saturating_sub(b.addr + size) <= HALF_SMALL as u64 {
                size = next.saturating_sub(b.addr).max(size);
            }
            let (before, _) = alloc.current_bytes();
            let addr = alloc.malloc(size as usize, stream).map_err(setup)?;
            let bytes = alloc.current_bytes().0 - before;
            live.insert(
                b.addr,
                Live {
                    addr,
                    stream,
                    bytes,
                    free_requested: b.free_requested,
                },
            );
            cursor = b.addr + size;
        }
        fill(cursor, s.addr + s.size, &mut gaps)?;
    }
    for g in gaps {
        if !alloc.try_free(g, None)? {
            return Err(Error::Internal(format!(
                "a placeholder block at {g:#x} vanished while recreating the initial state"
            )));
        }
    }
    Ok(live)
}

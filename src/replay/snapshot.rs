//! Reading PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()`, and tensoralloc's
//! own) into a [`Trace`] for replay.
//!
//! A snapshot holds the allocator's state when it was taken (`segments`, each with its
//! `blocks`) and the events recorded before that (`device_traces`, one list per device).
//! Only four kinds of event drive a replay:
//! - `alloc`: the program got a block (address, size, stream);
//! - `free_requested`: the program freed it; PyTorch stops counting it as allocated here, but
//!   a block used on other streams (`record_stream`) is not reusable yet;
//! - `free_completed`: the block went back to its pool (at once, or once the other streams'
//!   work completed); this is when the replayed allocator frees it;
//! - `segment_alloc` / `segment_free` (and `segment_map` / `segment_unmap` for expandable
//!   segments) are the recording allocator's own decisions: the replayed allocator makes its
//!   own, so they only serve to find the state before the first event.
//!
//! A trace need not start from an empty allocator (recording started after warm-up, or the
//! ring of events overflowed). The state at the first event is found by walking the events
//! backwards from the final state: an `alloc` removes its block, a `free_completed` restores
//! it, a `segment_alloc` removes its segment, a `segment_free` restores it. Segments that
//! existed then are recreated before replay, with the blocks that were live in them.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

use super::guard;
pub use crate::device::history::Action;
use crate::error::{Error, Result};

/// Largest decompressed snapshot accepted (a million events take about 80 MB).
pub const MAX_PICKLE_BYTES: u64 = 1 << 30;

/// One recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEvent {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
}

/// A block that was allocated when the trace starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitialBlock {
    pub addr: u64,
    pub size: u64,
    /// Freed by the program but not yet returned to its pool (waiting for other streams).
    pub free_requested: bool,
}

/// A segment that existed when the trace starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitialSegment {
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    /// A small-pool (2 MiB) segment.
    pub small: bool,
    /// Blocks allocated at the start, in address order.
    pub live: Vec<InitialBlock>,
}

/// The events of one device, ready to replay.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub device: usize,
    pub events: Vec<TraceEvent>,
    /// Segments at the first event, in address order (empty when recording started on an
    /// empty allocator).
    pub initial: Vec<InitialSegment>,
    /// `allocator_settings.PYTORCH_CUDA_ALLOC_CONF` of the recording process, if present.
    pub recorded_config: Option<String>,
    /// Blocks live at the start that lie in no segment (an inconsistent snapshot); they are
    /// left out of the initial state and their frees are ignored.
    pub orphan_blocks: usize,
}

impl Trace {
    /// Bytes reserved at the first event.
    pub fn initial_reserved(&self) -> u64 {
        self.initial.iter().map(|s| s.size).sum()
    }

    /// The recording allocator's peak reserved bytes over the trace: the initial segments
    /// plus its `segment_alloc` / `segment_map` minus its `segment_free` / `segment_unmap`.
    pub fn recorded_peak_reserved(&self) -> u64 {
        let mut reserved = self.initial_reserved() as i128;
        let mut peak = reserved;
        for e in &self.events {
            match e.action {
                Action::SegmentAlloc | Action::SegmentMap => reserved += e.size as i128,
                Action::SegmentFree | Action::SegmentUnmap => reserved -= e.size as i128,
                _ => {}
            }
            peak = peak.max(reserved);
        }
        peak.max(0) as u64
    }

    /// How many events of each action the trace has.
    pub fn count(&self, action: Action) -> usize {
        self.events.iter().filter(|e| e.action == action).count()
    }

    /// The trace's allocations and frees as calls a program makes, with each allocation's
    /// address replaced by a slot number (the slots used are `0..` the second value), so that
    /// a replay does nothing but call. Frees of blocks allocated before the trace started
    /// are left out.
    pub fn calls(&self) -> (Vec<TraceCall>, usize) {
        let mut slots = std::collections::HashMap::new();
        let mut calls = Vec::new();
        let mut used = 0;
        for e in &self.events {
            match e.action {
                Action::Alloc => {
                    let slot = used;
                    used += 1;
                    slots.insert(e.addr, slot);
                    calls.push(TraceCall::Malloc {
                        slot,
                        size: e.size as usize,
                        stream: e.stream,
                    });
                }
                Action::FreeCompleted => {
                    if let Some(slot) = slots.remove(&e.addr) {
                        calls.push(TraceCall::Free { slot });
                    }
                }
                _ => {}
            }
        }
        (calls, used)
    }
}

/// An allocation or free of [`Trace::calls`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceCall {
    /// Allocate `size` bytes on `stream` into `slot`.
    Malloc {
        slot: usize,
        size: usize,
        stream: u64,
    },
    /// Free the allocation in `slot`.
    Free { slot: usize },
}

#[derive(Deserialize)]
struct RawSnapshot {
    #[serde(default)]
    segments: Vec<RawSegment>,
    #[serde(default)]
    device_traces: Vec<Vec<RawEvent>>,
    #[serde(default)]
    allocator_settings: Option<RawSettings>,
}

#[derive(Deserialize)]
struct RawSettings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF", default)]
    conf: Option<String>,
}

#[derive(Deserialize)]
struct RawSegment {
    #[serde(default)]
    device: i64,
    address: u64,
    total_size: u64,
    #[serde(default)]
    stream: u64,
    #[serde(default)]
    segment_type: Option<String>,
    #[serde(default)]
    blocks: Vec<RawBlock>,
}

#[derive(Deserialize)]
struct RawBlock {
    address: u64,
    size: u64,
    state: String,
}

#[derive(Deserialize)]
struct RawEvent {
    action: String,
    #[serde(default)]
    addr: u64,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    stream: u64,
}

/// The pickle inside `bytes`: decompressed when it is gzip, refused when larger than
/// [`MAX_PICKLE_BYTES`].
pub fn decompress(bytes: &[u8]) -> Result<Vec<u8>> {
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        if bytes.len() as u64 > MAX_PICKLE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "snapshot is larger than {MAX_PICKLE_BYTES} bytes"
            )));
        }
        return Ok(bytes.to_vec());
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes)
        .take(MAX_PICKLE_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::InvalidArgument(format!("snapshot is damaged gzip data: {e}")))?;
    if out.len() as u64 > MAX_PICKLE_BYTES {
        return Err(Error::InvalidArgument(format!(
            "snapshot decompresses to more than {MAX_PICKLE_BYTES} bytes"
        )));
    }
    Ok(out)
}

/// Reads the trace of `device` from a snapshot file (gzip or plain pickle).
pub fn load(path: &Path, device: usize) -> Result<Trace> {
    let bytes = std::fs::read(path).map_err(|e| {
        Error::InvalidArgument(format!("cannot read snapshot {}: {e}", path.display()))
    })?;
    parse(&bytes, device).map_err(|e| match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{}: {m}", path.display())),
        other => other,
    })
}

/// Reads the trace of `device` from the bytes of a snapshot (gzip or plain pickle).
pub fn parse(bytes: &[u8], device: usize) -> Result<Trace> {
    let pickle = decompress(bytes)?;
    guard::check(&pickle)?;
    // serde-pickle miscounts references to containers shared by several parents (PyTorch
    // shares stack-frame dicts between events) and reports them as recursive; real cycles were
    // refused by the guard, so a repeated reference only ever stands for a shared value. The
    // shared values are frames, which replay ignores; a field replay needs that came out as
    // None fails to decode.
    let options = serde_pickle::DeOptions::new().replace_recursive_structures();
    let raw: RawSnapshot = serde_pickle::from_slice(&pickle, options).map_err(|e| {
        Error::InvalidArgument(format!(
            "not a memory snapshot (a dict with `segments` and `device_traces`): {e}"
        ))
    })?;
    if raw.device_traces.is_empty() && raw.segments.is_empty() {
        return Err(Error::InvalidArgument(
            "the snapshot has neither segments nor device traces".into(),
        ));
    }
    let devices = raw.device_traces.len();
    if device >= devices.max(1) {
        return Err(Error::InvalidArgument(format!(
            "the snapshot has traces for {devices} device(s); device {device} does not exist"
        )));
    }
    let events: Vec<TraceEvent> = raw
        .device_traces
        .into_iter()
        .nth(device)
        .unwrap_or_default()
        .into_iter()
        .map(|e| TraceEvent {
            action: Action::parse(&e.action),
            addr: e.addr,
            size: e.size,
            stream: e.stream,
        })
        .collect();
    let segments: Vec<RawSegment> = raw
        .segments
        .into_iter()
        .filter(|s| s.device == device as i64)
        .collect();
    let (initial, orphan_blocks) = initial_state(&segments, &events);
    Ok(Trace {
        device,
        events,
        initial,
        recorded_config: raw.allocator_settings.and_then(|s| s.conf),
        orphan_blocks,
    })
}

/// Segments by address: (size, stream, small pool).
type Segments = BTreeMap<u64, (u64, u64, bool)>;

/// Takes `[addr, addr + size)` out of the segment that holds it (walking back over the
/// mapping of that range), leaving the parts on either side. A range no segment holds (an
/// inconsistent snapshot) changes nothing.
fn unmap_range(segs: &mut Segments, addr: u64, size: u64) {
    let Some((&start, &(len, stream, small))) = segs.range(..=addr).next_back() else {
        return;
    };
    let (end, range_end) = (start + len, addr.saturating_add(size));
    if range_end > end {
        return;
    }
    segs.remove(&start);
    if addr > start {
        segs.insert(start, (addr - start, stream, small));
    }
    if end > range_end {
        segs.insert(range_end, (end - range_end, stream, small));
    }
}

/// Puts `[addr, addr + size)` back as mapped (walking back over its unmapping), merged with
/// the segments of the same stream that touch it, as a snapshot shows a contiguous mapped
/// range. A range alone is in the small pool when its size is not a multiple of the large
/// pool's 20 MiB pages.
fn map_range(segs: &mut Segments, addr: u64, size: u64, stream: u64) {
    let (mut start, mut end) = (addr, addr.saturating_add(size));
    let mut small = None;
    if let Some((&s, &(len, st, sm))) = segs.range(..addr).next_back() {
        if s + len == addr && st == stream {
            segs.remove(&s);
            start = s;
            small = Some(sm);
        }
    }
    if let Some(&(len, st, sm)) = segs.get(&end) {
        if st == stream {
            segs.remove(&end);
            end += len;
            small = small.or(Some(sm));
        }
    }
    let small = small.unwrap_or(!size.is_multiple_of(20 << 20));
    segs.insert(start, (end - start, stream, small));
}

/// The segments and live blocks at the first event (see the module documentation).
fn initial_state(segments: &[RawSegment], events: &[TraceEvent]) -> (Vec<InitialSegment>, usize) {
    let mut segs: Segments = segments
        .iter()
        .map(|s| {
            let small = s.segment_type.as_deref() == Some("small");
            (s.address, (s.total_size, s.stream, small))
        })
        .collect();
    // addr -> (size, free requested)
    let mut live: HashMap<u64, (u64, bool)> = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state != "inactive")
        .map(|b| (b.address, (b.size, b.state == "active_pending_free")))
        .collect();
    for e in events.iter().rev() {
        match e.action {
            Action::Alloc => {
                live.remove(&e.addr);
            }
            Action::FreeCompleted => {
                live.insert(e.addr, (e.size, true));
            }
            Action::FreeRequested => {
                if let Some(b) = live.get_mut(&e.addr) {
                    b.1 = false;
                }
            }
            Action::SegmentAlloc => {
                segs.remove(&e.addr);
            }
            Action::SegmentFree => {
                // Small-pool segments are the only 2 MiB ones.
                segs.insert(e.addr, (e.size, e.stream, e.size == 2 << 20));
            }
            // Expandable segments: a snapshot shows each mapped range as a segment, so a map
            // takes its range out of the segment that holds it, and an unmap puts it back.
            Action::SegmentMap => unmap_range(&mut segs, e.addr, e.size),
            Action::SegmentUnmap => map_range(&mut segs, e.addr, e.size, e.stream),
            _ => {}
        }
    }
    let mut out: Vec<InitialSegment> = segs
        .iter()
        .map(|(&addr, &(size, stream, small))| InitialSegment {
            addr,
            size,
            stream,
            small,
            live: Vec::new(),
        })
        .collect();
    let index: BTreeMap<u64, usize> = out.iter().enumerate().map(|(i, s)| (s.addr, i)).collect();
    let mut orphans = 0;
    for (addr, (size, free_requested)) in live {
        let owner = index
            .range(..=addr)
            .next_back()
            .map(|(_, &i)| i)
            .filter(|&i| addr + size <= out[i].addr + out[i].size);
        match owner {
            Some(i) => out[i].live.push(InitialBlock {
                addr,
                size,
                free_requested,
            }),
            None => orphans += 1,
        }
    }
    for s in &mut out {
        s.live.sort_by_key(|b| b.addr);
    }
    (out, orphans)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(action: Action, addr: u64, size: u64, stream: u64) -> TraceEvent {
        TraceEvent {
            action,
            addr,
            size,
            stream,
        }
    }

    /// Allocations take new slots in order, a free names its allocation's slot (also when the
    /// address comes back later), and only completed frees of blocks the trace allocated count.
    #[test]
    fn calls_name_allocations_by_slot() {
        let trace = Trace {
            events: vec![
                event(Action::Alloc, 0x1000, 512, 7),
                event(Action::SegmentAlloc, 0x1000, 2 << 20, 7),
                event(Action::Alloc, 0x2000, 1024, 8),
                event(Action::FreeRequested, 0x1000, 512, 7),
                event(Action::FreeCompleted, 0x1000, 512, 7),
                event(Action::FreeCompleted, 0x9000, 512, 7),
                event(Action::Alloc, 0x1000, 512, 7),
                event(Action::FreeCompleted, 0x1000, 512, 7),
            ],
            ..Trace::default()
        };
        let (calls, used) = trace.calls();
        assert_eq!(used, 3);
        assert_eq!(
            calls,
            [
                TraceCall::Malloc {
                    slot: 0,
                    size: 512,
                    stream: 7
                },
                TraceCall::Malloc {
                    slot: 1,
                    size: 1024,
                    stream: 8
                },
                TraceCall::Free { slot: 0 },
                TraceCall::Malloc {
                    slot: 2,
                    size: 512,
                    stream: 7
                },
                TraceCall::Free { slot: 2 },
            ]
        );
    }
}

//! Memory history: a bounded ring of the allocator's events (PyTorch's
//! `_record_memory_history`), and snapshots of the allocator in PyTorch's `_dump_snapshot`
//! layout, which PyTorch's memory viewer and `tensoralloc replay` read.
//!
//! Recording is off by default; the allocator's hooks then cost one relaxed load of a flag.
//! When on, each event takes the ring's lock and reads the clock.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use parking_lot::Mutex;
use serde::Serialize;

use super::shard::{Block, ShardInner, State};
use super::size::PoolKind;
use super::{DeviceAllocator, Shard};
use crate::config::Config;
use crate::error::{Error, Result};

/// Most events a ring may be asked to keep (about 40 bytes each).
///
/// cbindgen:ignore
pub const MAX_ENTRIES: usize = 1 << 26;

/// What happened at one event of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Oom,
    /// Anything else PyTorch records (`snapshot`, user annotations); ignored by replay.
    Other,
}

impl Action {
    /// The action PyTorch names `name`.
    pub fn parse(name: &str) -> Action {
        match name {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "oom" => Action::Oom,
            _ => Action::Other,
        }
    }

    /// PyTorch's name of the action.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Other => "other",
        }
    }
}

/// One recorded event, as PyTorch's `TraceEntry`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub action: Action,
    /// The block's address; for [`Action::Oom`], the bytes the device had free.
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: i64,
}

#[derive(Default)]
struct Ring {
    max: usize,
    entries: VecDeque<Entry>,
}

/// The event ring of one device.
#[derive(Default)]
pub struct History {
    on: AtomicBool,
    ring: Mutex<Ring>,
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl History {
    /// Whether events are being recorded.
    #[inline(always)]
    pub fn on(&self) -> bool {
        self.on.load(Relaxed)
    }

    /// Starts recording into a fresh ring that keeps the last `max_entries` events, or stops
    /// recording (keeping what was recorded, for a later snapshot).
    pub fn set(&self, enabled: bool, max_entries: usize) -> Result<()> {
        if !enabled {
            self.on.store(false, Relaxed);
            return Ok(());
        }
        if max_entries == 0 || max_entries > MAX_ENTRIES {
            return Err(Error::InvalidArgument(format!(
                "max_entries must be from 1 to {MAX_ENTRIES}, got {max_entries}"
            )));
        }
        let mut ring = self.ring.lock();
        ring.max = max_entries;
        ring.entries = VecDeque::new();
        self.on.store(true, Relaxed);
        Ok(())
    }

    /// Appends an event, dropping the oldest when the ring is full.
    #[cold]
    pub fn record(&self, action: Action, addr: usize, size: usize, stream: usize) {
        let mut ring = self.ring.lock();
        if !self.on() {
            return;
        }
        // Read under the lock: the ring's order is the order of the times.
        let entry = Entry {
            action,
            addr: addr as u64,
            size: size as u64,
            stream: stream as u64,
            time_us: now_us(),
        };
        if ring.entries.len() >= ring.max {
            ring.entries.pop_front();
        }
        ring.entries.push_back(entry);
    }

    /// The recorded events, oldest first.
    pub fn entries(&self) -> Vec<Entry> {
        self.ring.lock().entries.iter().copied().collect()
    }
}

/// Hooks of the allocator: each records only when recording is on.
impl DeviceAllocator {
    #[inline(always)]
    pub(super) fn note(&self, action: Action, addr: usize, size: usize, stream: usize) {
        if self.history.on() {
            self.history.record(action, addr, size, stream);
        }
    }

    /// An event about block `id` of `shard`.
    #[inline(always)]
    pub(super) fn note_block(&self, action: Action, shard: &Shard, inner: &ShardInner, id: u32) {
        if self.history.on() {
            let b = inner.block(id);
            self.history
                .record(action, b.addr, b.requested, shard.stream());
        }
    }

    /// The device's memory history.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// This device's segments and blocks now, in the layout of PyTorch's snapshot.
    pub fn snapshot_segments(&self) -> Vec<SegmentInfo> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            // A private shard's segments belong to its graph pool, as PyTorch reports them.
            let pool = if shard.private {
                self.graph.owner(shard.index).unwrap_or((0, 0))
            } else {
                (0, 0)
            };
            let inner = shard.inner.lock();
            for blocks in inner.segments() {
                let mut info = segment_info(self.device, shard.stream(), &blocks);
                info.segment_pool_id = pool;
                out.push(info);
            }
        }
        out.sort_by_key(|s| s.address);
        out
    }
}

/// A block of a snapshot segment.
#[derive(Debug, Clone, Serialize)]
pub struct BlockInfo {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: &'static str,
    pub frames: Vec<()>,
}

/// A segment of a snapshot, with PyTorch's field names.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentInfo {
    pub device: i64,
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: u64,
    pub segment_type: &'static str,
    pub segment_pool_id: (u64, u64),
    pub is_expandable: bool,
    pub frames: Vec<()>,
    pub blocks: Vec<BlockInfo>,
}

fn segment_info(device: usize, stream: usize, blocks: &[&Block]) -> SegmentInfo {
    let mut s = SegmentInfo {
        device: device as i64,
        address: blocks.first().map_or(0, |b| b.addr as u64),
        total_size: 0,
        allocated_size: 0,
        active_size: 0,
        requested_size: 0,
        stream: stream as u64,
        segment_type: match blocks.first().map(|b| b.pool) {
            Some(PoolKind::Small) => "small",
            _ => "large",
        },
        segment_pool_id: (0, 0),
        is_expandable: blocks.first().is_some_and(|b| b.exp != super::shard::NONE),
        frames: Vec::new(),
        blocks: Vec::with_capacity(blocks.len()),
    };
    for b in blocks {
        let (size, requested) = (b.size as u64, b.requested as u64);
        s.total_size += size;
        let state = match b.state {
            State::Allocated => {
                s.allocated_size += size;
                s.active_size += size;
                s.requested_size += requested;
                "active_allocated"
            }
            State::AwaitingEvents => {
                s.active_size += size;
                s.requested_size += requested;
                "active_pending_free"
            }
            // Never passed in: segments() leaves unmapped address space out.
            State::Free | State::Unmapped => "inactive",
        };
        s.blocks.push(BlockInfo {
            address: b.addr as u64,
            size,
            requested_size: if b.state == State::Free { 0 } else { requested },
            state,
            frames: Vec::new(),
        });
    }
    s
}

/// A trace event with PyTorch's field names. An `oom` event has `device_free` (the bytes the
/// device had free) where the others have `addr`, as PyTorch writes it (its memory viewer
/// reads that key).
#[derive(Serialize)]
struct TraceEntry {
    action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    addr: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<u64>,
    size: u64,
    stream: u64,
    time_us: i64,
    frames: Vec<()>,
}

/// `allocator_settings` of a snapshot.
#[derive(Serialize)]
struct Settings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    conf: String,
    max_split_size: i64,
    garbage_collection_threshold: f64,
    expandable_segments: bool,
    pinned_num_register_threads: u64,
    release_lock_on_cudamalloc: bool,
    pinned_use_cuda_host_register: bool,
    roundup_power2_divisions: std::collections::BTreeMap<String, u64>,
}

#[derive(Serialize)]
struct Snapshot {
    segments: Vec<SegmentInfo>,
    device_traces: Vec<Vec<TraceEntry>>,
    allocator_settings: Settings,
}

/// Writes a snapshot of `devices` (segments, blocks and each device's recorded events) as
/// PyTorch's `_dump_snapshot` pickle (protocol 3, like `pickle.dump`'s default of old).
pub fn write_snapshot<'a, W: std::io::Write>(
    out: &mut W,
    devices: impl Iterator<Item = &'a DeviceAllocator>,
    config: &Config,
    conf_text: &str,
) -> Result<()> {
    let mut snapshot = Snapshot {
        segments: Vec::new(),
        device_traces: Vec::new(),
        allocator_settings: Settings {
            conf: conf_text.to_string(),
            max_split_size: if config.max_split_size == usize::MAX {
                -1
            } else {
                config.max_split_size as i64
            },
            garbage_collection_threshold: config.garbage_collection_threshold,
            expandable_segments: config.expandable_segments
                || config.policy == crate::config::Policy::Compact,
            pinned_num_register_threads: config.pinned_num_register_threads as u64,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: config.pinned_use_host_register,
            roundup_power2_divisions: (0..crate::config::ROUNDUP_INTERVALS)
                .map(|i| {
                    (
                        (1u64 << i).to_string(),
                        config.roundup_power2_divisions[i] as u64,
                    )
                })
                .collect(),
        },
    };
    for d in devices {
        let index = d.device();
        snapshot.segments.extend(d.snapshot_segments());
        if snapshot.device_traces.len() <= index {
            snapshot.device_traces.resize_with(index + 1, Vec::new);
        }
        snapshot.device_traces[index] = d
            .history()
            .entries()
            .into_iter()
            .map(|e| TraceEntry {
                action: e.action.name(),
                addr: (e.action != Action::Oom).then_some(e.addr),
                device_free: (e.action == Action::Oom).then_some(e.addr),
                size: e.size,
                stream: e.stream,
                time_us: e.time_us,
                frames: Vec::new(),
            })
            .collect();
    }
    serde_pickle::to_writer(out, &snapshot, serde_pickle::SerOptions::new())
        .map_err(|e| Error::Internal(format!("cannot encode the snapshot: {e}")))
}

/// Writes [`write_snapshot`] into the file `path`, gzip-compressed when the name ends in
/// `.gz`. The settings text is `TENSORALLOC_CONF` (else `PYTORCH_CUDA_ALLOC_CONF`). The
/// snapshot is written to a temporary file beside `path` and renamed over it once complete,
/// so a failed dump (a full disk, a file size limit) leaves an earlier file at `path` whole.
pub fn dump_snapshot<'a>(
    path: &std::path::Path,
    devices: impl Iterator<Item = &'a DeviceAllocator>,
    config: &Config,
) -> Result<()> {
    let conf = std::env::var("TENSORALLOC_CONF")
        .or_else(|_| std::env::var("PYTORCH_CUDA_ALLOC_CONF"))
        .unwrap_or_default();
    let fail = |e: &dyn std::fmt::Display| {
        Error::InvalidArgument(format!("cannot write snapshot {}: {e}", path.display()))
    };
    // A device or a pipe (`/dev/stdout`) is written in place; a link, through to its file.
    let target = match std::fs::canonicalize(path) {
        Ok(real) if !real.is_file() => {
            return write_file(path, path, devices, config, &conf).map_err(|e| fail(&e));
        }
        Ok(real) => real,
        Err(_) => path.to_path_buf(),
    };
    let path = target.as_path();
    let name = path
        .file_name()
        .ok_or_else(|| fail(&"the path names no file"))?;
    let mut temporary = std::ffi::OsString::from(".");
    temporary.push(name);
    temporary.push(format!(".{}.tmp", std::process::id()));
    let temporary = path.with_file_name(temporary);
    let written = write_file(&temporary, path, devices, config, &conf)
        .and_then(|()| std::fs::rename(&temporary, path).map_err(|e| e.to_string()));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        fail(&e)
    })
}

/// [`dump_snapshot`]'s writing into `file`, compressed as the name of `path` says.
fn write_file<'a>(
    file: &std::path::Path,
    path: &std::path::Path,
    devices: impl Iterator<Item = &'a DeviceAllocator>,
    config: &Config,
    conf: &str,
) -> std::result::Result<(), String> {
    let out = std::io::BufWriter::new(std::fs::File::create(file).map_err(|e| e.to_string())?);
    // Encoding our own values fails only when writing does.
    let message = |e: Error| e.message().to_string();
    let out = if path.extension().is_some_and(|e| e == "gz") {
        let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
        write_snapshot(&mut gz, devices, config, conf).map_err(message)?;
        gz.finish().map_err(|e| e.to_string())?
    } else {
        let mut out = out;
        write_snapshot(&mut out, devices, config, conf).map_err(message)?;
        out
    };
    let file = out.into_inner().map_err(|e| e.into_error().to_string())?;
    if file.metadata().is_ok_and(|m| m.is_file()) {
        file.sync_all().map_err(|e| e.to_string())?;
    }
    Ok(())
}

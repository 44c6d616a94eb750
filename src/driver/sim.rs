//! The simulated device: per-device capacity, host-backed (or unbacked) device memory,
//! streams that accept any handle, and events whose completion tests control by holding and
//! releasing streams.
//!
//! Device memory is one `mmap(MAP_NORESERVE)` reservation per device, so a 16 GiB device costs
//! nothing until its pages are touched, and tests can write to what they allocate. Freed
//! ranges are handed back to the kernel with `madvise(MADV_DONTNEED)`.
//!
//! Events: recording an event on a stream that is not held completes it at once. Recording on
//! a held stream leaves it pending until the stream is released, or until someone waits on
//! it with [`Driver::event_synchronize`] (waiting finishes the work the event captured).
//!
//! Graph capture ([`capture`]): tests begin and end captures on streams; event queries and
//! waits and device frees made during the calling thread's capture invalidate it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::{Driver, Event, MemInfo, PhysHandle, Stream};
use crate::config::parse_size;
use crate::error::{Error, Result};

pub mod capture;

/// Default capacity of a simulated device.
pub(crate) const DEFAULT_CAPACITY: u64 = 16 << 30;
/// Device allocations are aligned like the CUDA driver's.
const ALIGNMENT: u64 = 512;

/// How a simulated device is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Number of devices.
    pub devices: usize,
    /// Bytes each device can hand out.
    pub capacity: u64,
    /// Whether device memory is real host memory (true) or only addresses (false, for
    /// replaying traces larger than this machine).
    pub backed: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity: DEFAULT_CAPACITY,
            backed: true,
        }
    }
}

impl SimConfig {
    /// Reads `TENSORALLOC_SIM_MEMORY` (bytes or a size such as `512MiB`; default 16 GiB) and
    /// `TENSORALLOC_SIM_DEVICES` (default 1).
    pub fn from_env() -> Result<SimConfig> {
        let mut config = SimConfig::default();
        if let Ok(v) = std::env::var("TENSORALLOC_SIM_MEMORY") {
            config.capacity = parse_size(&v).map_err(|e| {
                Error::Config(format!("TENSORALLOC_SIM_MEMORY={v:?}: {}", e.message()))
            })?;
            if config.capacity == 0 {
                return Err(Error::Config(
                    "TENSORALLOC_SIM_MEMORY must be more than 0 bytes".into(),
                ));
            }
        }
        if let Ok(v) = std::env::var("TENSORALLOC_SIM_DEVICES") {
            config.devices = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=64).contains(n))
                .ok_or_else(|| {
                    Error::Config(format!(
                        "TENSORALLOC_SIM_DEVICES={v:?} is not a device count from 1 to 64"
                    ))
                })?;
        }
        Ok(config)
    }
}

/// Call counters of a simulated driver, for tests that prove caching.
#[derive(Debug, Default)]
pub struct SimCounters {
    pub mem_alloc: AtomicU64,
    pub mem_free: AtomicU64,
    pub events_created: AtomicU64,
    pub events_destroyed: AtomicU64,
    pub event_records: AtomicU64,
    pub event_queries: AtomicU64,
    pub event_syncs: AtomicU64,
    pub host_alloc: AtomicU64,
    pub host_free: AtomicU64,
    pub host_register: AtomicU64,
    pub host_unregister: AtomicU64,
    pub vmm_reserve: AtomicU64,
    /// Physical allocations created and mapped.
    pub vmm_map: AtomicU64,
    /// Physical allocations unmapped and released.
    pub vmm_unmap: AtomicU64,
    /// Physical allocations unmapped and kept ([`Driver::vmm_unmap_keep`]).
    pub vmm_unmap_keep: AtomicU64,
    /// Kept physical allocations mapped again ([`Driver::vmm_map_kept`]).
    pub vmm_map_kept: AtomicU64,
    /// Kept physical allocations released ([`Driver::vmm_release`]).
    pub vmm_release: AtomicU64,
}

/// One device's address range and its free list.
struct SimDevice {
    base: u64,
    span: u64,
    capacity: u64,
    backed: bool,
    state: Mutex<DeviceState>,
}

struct DeviceState {
    used: u64,
    /// The most `used` has been.
    most_used: u64,
    /// Free ranges of the reservation: start -> length.
    free: BTreeMap<u64, u64>,
    /// Live allocations: start -> length.
    live: HashMap<u64, u64>,
    vmm: VmmState,
}

/// Granularity of simulated virtual memory mappings (2 MiB, as on current NVIDIA GPUs).
pub(crate) const SIM_GRANULARITY: usize = 2 << 20;

/// Default virtual address space a simulated device lets its users reserve.
const DEFAULT_ADDRESS_SPACE: u64 = 1 << 46;

/// Reserved ranges and mapped pages of one simulated device. Mapped bytes count in
/// [`DeviceState::used`] like ordinary allocations.
#[derive(Default)]
struct VmmState {
    /// Reserved ranges by start address.
    ranges: BTreeMap<u64, Reservation>,
    reserved: u64,
    /// Next address of an unbacked device's reservations.
    next_unbacked: u64,
    next_handle: u64,
    /// Physical allocations unmapped but not released, as (handle, size): a few at a time,
    /// between an unmapping and the growth that maps them again.
    kept: Vec<(u64, u64)>,
}

/// One reserved range and what is mapped in it, page by page of the granularity (a slot per
/// page, so that mapping and unmapping cost no search whatever was mapped before).
struct Reservation {
    size: u64,
    /// Bytes mapped.
    mapped: u64,
    /// Pages from the first granularity-aligned address at or below the start, up to the
    /// highest page ever mapped (the rest are unmapped).
    pages: Vec<Page>,
}

/// What one page of a reservation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Page {
    #[default]
    Unmapped,
    /// The first page of physical allocation `handle` of `size` bytes.
    Head { handle: u64, size: u64 },
    /// A later page of the allocation mapped at the nearest `Head` below.
    Tail,
}

impl Reservation {
    /// The reservation of `ranges` that holds all of `[addr, addr + size)`, with its start.
    fn find(
        ranges: &mut BTreeMap<u64, Reservation>,
        addr: u64,
        size: u64,
    ) -> Option<(u64, &mut Reservation)> {
        ranges
            .range_mut(..=addr)
            .next_back()
            .filter(|(&s, r)| addr.checked_add(size).is_some_and(|end| end <= s + r.size))
            .map(|(&s, r)| (s, r))
    }

    /// The index in [`Reservation::pages`] of the page at `addr` (granularity-aligned) of the
    /// reservation starting at `start`.
    #[inline]
    fn page(start: u64, addr: u64) -> usize {
        let g = SIM_GRANULARITY as u64;
        ((addr - start / g * g) / g) as usize
    }

    /// Refuses a range (inside the reservation) any part of which is mapped.
    fn check_unmapped(&self, start: u64, addr: u64, size: u64) -> Result<()> {
        let first = Self::page(start, addr);
        let last = first + size.div_ceil(SIM_GRANULARITY as u64) as usize;
        let pages = self.pages.get(first..last.min(self.pages.len()));
        if pages.is_some_and(|p| p.iter().any(|&p| p != Page::Unmapped)) {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: [{addr:#x}, +{size}) is already mapped"
            )));
        }
        Ok(())
    }

    /// Records `[addr, addr + size)` (checked unmapped) as mapped by `allocations`, (handle,
    /// bytes) back to back from `addr`.
    #[inline]
    fn map(
        &mut self,
        start: u64,
        addr: u64,
        size: u64,
        allocations: impl IntoIterator<Item = (u64, u64)>,
    ) {
        let first = Self::page(start, addr);
        let end = first + size.div_ceil(SIM_GRANULARITY as u64) as usize;
        if self.pages.len() < end {
            self.pages.resize(end, Page::Unmapped);
        }
        let mut at = first;
        for (handle, bytes) in allocations {
            at = self.place(at, handle, bytes);
        }
        debug_assert_eq!(at, end);
        self.mapped += size;
    }

    /// Records allocation `handle` of `size` bytes as mapped from page `at` (covered and
    /// unmapped). Returns the page after it.
    #[inline]
    fn place(&mut self, at: usize, handle: u64, size: u64) -> usize {
        let end = at + size.div_ceil(SIM_GRANULARITY as u64) as usize;
        self.pages[at] = Page::Head { handle, size };
        self.pages[at + 1..end].fill(Page::Tail);
        end
    }

    /// Unmaps allocation `handle` of `size` bytes at `addr`; false (and nothing changed) when
    /// that is not what is mapped there.
    #[inline]
    fn unmap(&mut self, start: u64, addr: u64, size: u64, handle: u64) -> bool {
        let first = Self::page(start, addr);
        if !addr.is_multiple_of(SIM_GRANULARITY as u64)
            || self.pages.get(first) != Some(&Page::Head { handle, size })
        {
            return false;
        }
        let n = size.div_ceil(SIM_GRANULARITY as u64) as usize;
        self.pages[first..first + n].fill(Page::Unmapped);
        self.mapped -= size;
        true
    }
}

impl SimDevice {
    fn new(index: usize, capacity: u64, backed: bool) -> Result<SimDevice> {
        // Twice the capacity of address space, so fragmentation of the simulated address
        // space never fails an allocation that the capacity allows.
        let span = capacity
            .checked_mul(2)
            .and_then(|s| s.checked_next_multiple_of(2 << 20))
            .ok_or_else(|| Error::Config(format!("simulated capacity {capacity} is too large")))?;
        let base = if backed {
            // SAFETY: an anonymous private mapping with no address hint has no preconditions;
            // the result is checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    span as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(Error::Driver(format!(
                    "simulated device {index}: cannot reserve {span} bytes of address space: {}",
                    std::io::Error::last_os_error()
                )));
            }
            p as u64
        } else {
            // Unbacked devices hand out addresses that are never dereferenced.
            (0x1000_0000_0000u64 + (index as u64) * span).next_multiple_of(2 << 20)
        };
        let mut free = BTreeMap::new();
        free.insert(base, span);
        Ok(SimDevice {
            base,
            span,
            capacity,
            backed,
            state: Mutex::new(DeviceState {
                used: 0,
                most_used: 0,
                free,
                live: HashMap::new(),
                vmm: VmmState {
                    next_unbacked: 0x4000_0000_0000 + (index as u64) * DEFAULT_ADDRESS_SPACE,
                    ..VmmState::default()
                },
            }),
        })
    }

    fn alloc(&self, size: usize) -> Result<usize> {
        let size = (size as u64).max(1).next_multiple_of(ALIGNMENT);
        let mut st = self.state.lock();
        if st.used + size > self.capacity {
            return Err(Error::OutOfMemory(format!(
                "simulated device has {} bytes free of {}, {size} requested",
                self.capacity - st.used,
                self.capacity
            )));
        }
        let found = st
            .free
            .iter()
            .find(|(_, &len)| len >= size)
            .map(|(&a, &l)| (a, l));
        let Some((start, len)) = found else {
            return Err(Error::OutOfMemory(
                "simulated device address space is fragmented".into(),
            ));
        };
        st.free.remove(&start);
        if len > size {
            st.free.insert(start + size, len - size);
        }
        st.live.insert(start, size);
        st.used += size;
        st.most_used = st.most_used.max(st.used);
        Ok(start as usize)
    }

    fn free(&self, ptr: usize) -> Result<()> {
        let ptr = ptr as u64;
        let mut st = self.state.lock();
        let Some(size) = st.live.remove(&ptr) else {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: {ptr:#x} is not an allocation of this simulated device"
            )));
        };
        st.used -= size;
        if self.backed {
            // Only the pages wholly inside the range: the kernel would drop a partial last page
            // whole, zeroing the start of a neighbouring live allocation.
            let page = 4096u64;
            let (first, end) = (ptr.next_multiple_of(page), (ptr + size) / page * page);
            if end > first {
                // SAFETY: [first, end) lies inside [ptr, ptr+size), inside our own mapping, and
                // is no longer handed out; MADV_DONTNEED only drops its pages.
                unsafe {
                    libc::madvise(
                        first as *mut libc::c_void,
                        (end - first) as usize,
                        libc::MADV_DONTNEED,
                    )
                };
            }
        }
        // Insert and coalesce with neighbours.
        let (mut start, mut len) = (ptr, size);
        if let Some((&prev, &plen)) = st.free.range(..start).next_back() {
            if prev + plen == start {
                st.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        if let Some(&nlen) = st.free.get(&(start + len)) {
            st.free.remove(&(start + len));
            len += nlen;
        }
        st.free.insert(start, len);
        Ok(())
    }
}

impl SimDevice {
    fn vmm_reserve(&self, size: usize, limit: u64) -> Result<usize> {
        let size = size as u64;
        if size == 0 || !size.is_multiple_of(SIM_GRANULARITY as u64) {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: cannot reserve {size} bytes (not a positive multiple of the {SIM_GRANULARITY}-byte granularity)"
            )));
        }
        let mut st = self.state.lock();
        if st.vmm.reserved.saturating_add(size) > limit {
            return Err(Error::OutOfMemory(format!(
                "simulated device: virtual address space exhausted ({} of {limit} bytes reserved, {size} requested)",
                st.vmm.reserved
            )));
        }
        let start = if self.backed {
            // SAFETY: a fresh anonymous inaccessible mapping with no address hint; checked
            // against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size as usize,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(Error::OutOfMemory(format!(
                    "simulated device: cannot reserve {size} bytes of address space: {}",
                    std::io::Error::last_os_error()
                )));
            }
            p as u64
        } else {
            let start = st.vmm.next_unbacked;
            st.vmm.next_unbacked += size;
            start
        };
        st.vmm.ranges.insert(
            start,
            Reservation {
                size,
                mapped: 0,
                pages: Vec::new(),
            },
        );
        st.vmm.reserved += size;
        Ok(start as usize)
    }

    fn vmm_free_range(&self, addr: usize, size: usize) -> Result<()> {
        let (addr, size) = (addr as u64, size as u64);
        let mut st = self.state.lock();
        let Some(range) = st.vmm.ranges.get(&addr).filter(|r| r.size == size) else {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: [{addr:#x}, +{size}) is not a reserved range"
            )));
        };
        if range.mapped != 0 {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: the range at {addr:#x} still has mappings"
            )));
        }
        st.vmm.ranges.remove(&addr);
        st.vmm.reserved -= size;
        if self.backed {
            // SAFETY: the mapping was made by vmm_reserve with this address and size, and was
            // removed from the table above, so it is unmapped once.
            unsafe { libc::munmap(addr as *mut libc::c_void, size as usize) };
        }
        Ok(())
    }

    /// Maps `[addr, addr + size)` as allocations of `handle` bytes each (the last one the
    /// rest), under one lock; all or nothing.
    fn vmm_map_many(
        &self,
        addr: usize,
        size: usize,
        handle: usize,
        handles: &mut Vec<PhysHandle>,
    ) -> Result<()> {
        let (addr, size, handle) = (addr as u64, size as u64, handle as u64);
        let g = SIM_GRANULARITY as u64;
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let aligned = size != 0
            && handle != 0
            && addr.is_multiple_of(g)
            && size.is_multiple_of(g)
            && handle.is_multiple_of(g);
        let Some((start, range)) =
            Reservation::find(&mut st.vmm.ranges, addr, size).filter(|_| aligned)
        else {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: cannot map [{addr:#x}, +{size}): not a granularity-aligned part of a reserved range"
            )));
        };
        range.check_unmapped(start, addr, size)?;
        if st.used + size > self.capacity {
            return Err(Error::OutOfMemory(format!(
                "simulated device has {} bytes free of {}, {size} requested",
                self.capacity - st.used,
                self.capacity
            )));
        }
        self.make_accessible(addr, size)?;
        st.used += size;
        st.most_used = st.most_used.max(st.used);
        let first = st.vmm.next_handle + 1;
        let count = size.div_ceil(handle);
        st.vmm.next_handle += count;
        range.map(
            start,
            addr,
            size,
            (0..count).map(|k| (first + k, handle.min(size - k * handle))),
        );
        handles.extend((first..first + count).map(PhysHandle));
        Ok(())
    }

    /// Unmaps each mapping of `maps` under one lock, stopping at the first that is not one;
    /// releases their memory, or with `keep` keeps it for [`SimDevice::vmm_map_kept`].
    fn vmm_unmap_many(&self, maps: &[(usize, usize, PhysHandle)], keep: bool) -> Result<()> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let vmm = &mut st.vmm;
        // The reservation of the mapping before, reused while the mappings stay inside it.
        let mut last: Option<(u64, &mut Reservation)> = None;
        for &(addr, size, handle) in maps {
            let (a, len) = (addr as u64, size as u64);
            let inside = |s: u64, r: &Reservation| a >= s && a.saturating_add(len) <= s + r.size;
            if !last.as_ref().is_some_and(|(s, r)| inside(*s, r)) {
                last = Reservation::find(&mut vmm.ranges, a, len);
            }
            let unmapped = last
                .as_mut()
                .is_some_and(|(s, r)| r.unmap(*s, a, len, handle.0));
            if !unmapped {
                return Err(Error::Driver(format!(
                    "CUDA_ERROR_INVALID_VALUE: [{addr:#x}, +{size}) is not mapped by handle {}",
                    handle.0
                )));
            }
            if keep {
                vmm.kept.push((handle.0, len));
            } else {
                st.used -= len;
            }
            if self.backed {
                // SAFETY: the range was mapped read-write by vmm_map_many inside our own
                // reservation; dropping its pages and making it inaccessible again touches
                // nothing else.
                unsafe {
                    libc::madvise(addr as *mut libc::c_void, size, libc::MADV_DONTNEED);
                    libc::mprotect(addr as *mut libc::c_void, size, libc::PROT_NONE);
                }
            }
        }
        Ok(())
    }
}

impl SimDevice {
    /// Makes `[addr, addr + size)`, inside one of this device's reservations (checked by the
    /// caller), readable and writable.
    fn make_accessible(&self, addr: u64, size: u64) -> Result<()> {
        if self.backed {
            // SAFETY: the range lies inside our own PROT_NONE reservation.
            let r = unsafe {
                libc::mprotect(
                    addr as *mut libc::c_void,
                    size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            if r != 0 {
                return Err(Error::Driver(format!(
                    "simulated device: cannot map pages: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        Ok(())
    }

    /// Maps kept allocations back to back from `addr`; all or nothing. The simulated device
    /// does not carry their contents along.
    fn vmm_map_kept(&self, addr: usize, maps: &[(usize, PhysHandle)]) -> Result<()> {
        let g = SIM_GRANULARITY as u64;
        let addr = addr as u64;
        let size: u64 = maps.iter().map(|&(l, _)| l as u64).sum();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        // Usually the allocations kept last, in order (an unmapping, then the growth that maps
        // them again): then they are found without a search.
        let is_tail = st.vmm.kept.len() >= maps.len()
            && st.vmm.kept[st.vmm.kept.len() - maps.len()..]
                .iter()
                .zip(maps)
                .all(|(&k, &(l, h))| k == (h.0, l as u64));
        let kept = is_tail
            || maps
                .iter()
                .all(|&(l, h)| st.vmm.kept.contains(&(h.0, l as u64)));
        let found = Reservation::find(&mut st.vmm.ranges, addr, size)
            .filter(|_| size != 0 && addr.is_multiple_of(g) && kept);
        let Some((start, range)) = found else {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: cannot map kept allocations at [{addr:#x}, +{size}): not kept allocations mapped into a granularity-aligned part of a reserved range"
            )));
        };
        range.check_unmapped(start, addr, size)?;
        self.make_accessible(addr, size)?;
        range.map(
            start,
            addr,
            size,
            maps.iter().map(|&(l, h)| (h.0, l as u64)),
        );
        if is_tail {
            let left = st.vmm.kept.len() - maps.len();
            st.vmm.kept.truncate(left);
        } else {
            st.vmm
                .kept
                .retain(|&(h, _)| !maps.iter().any(|&(_, m)| m.0 == h));
        }
        Ok(())
    }

    fn vmm_release(&self, handle: PhysHandle) -> Result<()> {
        let mut st = self.state.lock();
        // Callers release the allocations they kept last first: search from the end.
        let found = st.vmm.kept.iter().rposition(|&(h, _)| h == handle.0);
        let Some((_, size)) = found.map(|i| st.vmm.kept.remove(i)) else {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_INVALID_VALUE: handle {} is not a kept allocation",
                handle.0
            )));
        };
        st.used -= size;
        Ok(())
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        if self.backed {
            // SAFETY: the mapping was made in `new` with this base and span and nothing else
            // refers to it once the device is dropped.
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.span as usize) };
            for (&start, range) in &self.state.get_mut().vmm.ranges {
                // SAFETY: reservations still listed were made by vmm_reserve and never unmapped.
                unsafe { libc::munmap(start as *mut libc::c_void, range.size as usize) };
            }
        }
    }
}

/// Stream holds, shared by every simulated driver in the process (stream handles are global,
/// as they are in CUDA).
#[derive(Default)]
struct StreamState {
    held: bool,
    /// Bumped each time the stream is released: events recorded before a release complete.
    releases: u64,
}

static STREAMS: Lazy<Mutex<HashMap<Stream, StreamState>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

/// Holds `stream`: events recorded on it from now on stay pending until [`release_stream`].
pub fn hold_stream(stream: Stream) {
    STREAMS.lock().entry(stream).or_default().held = true;
}

/// Releases `stream`: every event recorded on it while it was held completes.
pub fn release_stream(stream: Stream) {
    let mut streams = STREAMS.lock();
    let s = streams.entry(stream).or_default();
    s.held = false;
    s.releases += 1;
}

/// Releases every held stream (a device-wide synchronisation), leaving none held.
pub fn release_all_streams() {
    for s in STREAMS.lock().values_mut().filter(|s| s.held) {
        s.held = false;
        s.releases += 1;
    }
}

/// Whether `stream` is held.
pub fn stream_is_held(stream: Stream) -> bool {
    STREAMS.lock().get(&stream).is_some_and(|s| s.held)
}

/// Host memory known to the simulated driver.
#[derive(Clone, Copy)]
enum HostRange {
    /// Mapped by `host_alloc`; `locked` when `mlock` succeeded.
    Pinned { size: usize, locked: bool },
    /// The caller's pages, registered by `host_register`.
    Registered,
}

#[derive(Clone, Copy)]
enum EventState {
    /// Created or completed.
    Done,
    /// Recorded on a held stream, before its `releases`-th release.
    Pending { stream: Stream, releases: u64 },
}

/// The simulated driver.
pub struct SimDriver {
    config: SimConfig,
    devices: Vec<SimDevice>,
    events: Mutex<HashMap<u64, EventState>>,
    next_event: AtomicU64,
    host: Mutex<HashMap<usize, HostRange>>,
    /// Whether virtual memory management is offered (tests turn it off).
    vmm_supported: std::sync::atomic::AtomicBool,
    /// Bytes of virtual address space each device lets its users reserve.
    address_space: AtomicU64,
    /// Call counters.
    pub counters: SimCounters,
}

impl SimDriver {
    /// A simulated driver as the environment configures it.
    pub fn from_env() -> Result<SimDriver> {
        SimDriver::new(SimConfig::from_env()?)
    }

    /// A simulated driver with `config`.
    pub fn new(config: SimConfig) -> Result<SimDriver> {
        if config.devices == 0 {
            return Err(Error::Config(
                "a simulated driver needs at least one device".into(),
            ));
        }
        let devices = (0..config.devices)
            .map(|i| SimDevice::new(i, config.capacity, config.backed))
            .collect::<Result<Vec<_>>>()?;
        Ok(SimDriver {
            config,
            devices,
            events: Mutex::new(HashMap::new()),
            next_event: AtomicU64::new(1),
            host: Mutex::new(HashMap::new()),
            vmm_supported: std::sync::atomic::AtomicBool::new(true),
            address_space: AtomicU64::new(DEFAULT_ADDRESS_SPACE),
            counters: SimCounters::default(),
        })
    }

    /// A shared simulated driver with `devices` devices of `capacity` bytes each.
    pub fn shared(devices: usize, capacity: u64) -> Result<Arc<SimDriver>> {
        Ok(Arc::new(SimDriver::new(SimConfig {
            devices,
            capacity,
            backed: true,
        })?))
    }

    /// The configuration this driver was built with.
    pub fn config(&self) -> SimConfig {
        self.config
    }

    /// Bytes of device memory handed out on `device`.
    pub fn used(&self, device: usize) -> u64 {
        self.devices.get(device).map_or(0, |d| d.state.lock().used)
    }

    /// The most bytes of device memory handed out on `device` at any one time.
    pub fn most_used(&self, device: usize) -> u64 {
        self.devices
            .get(device)
            .map_or(0, |d| d.state.lock().most_used)
    }

    fn device(&self, device: usize) -> Result<&SimDevice> {
        self.devices.get(device).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device {device} does not exist: the simulated driver has {} device(s) (TENSORALLOC_SIM_DEVICES)",
                self.devices.len()
            ))
        })
    }

    /// Offers virtual memory management or not (on by default), to test the fallback of
    /// drivers that lack it.
    pub fn set_vmm_supported(&self, supported: bool) {
        self.vmm_supported.store(supported, Ordering::Relaxed);
    }

    /// Limits the virtual address space each device lets its users reserve (default 64 TiB).
    pub fn set_address_space(&self, bytes: u64) {
        self.address_space.store(bytes, Ordering::Relaxed);
    }

    /// Bytes of device memory mapped through virtual memory management on `device`.
    pub fn mapped(&self, device: usize) -> u64 {
        self.devices.get(device).map_or(0, |d| {
            d.state.lock().vmm.ranges.values().map(|r| r.mapped).sum()
        })
    }

    /// Unmaps `maps`, keeping their allocations with `keep`, and counts them.
    fn unmap_counted(
        &self,
        device: usize,
        maps: &[(usize, usize, PhysHandle)],
        keep: bool,
    ) -> Result<()> {
        self.vmm_device(device)?.vmm_unmap_many(maps, keep)?;
        let counter = if keep {
            &self.counters.vmm_unmap_keep
        } else {
            &self.counters.vmm_unmap
        };
        counter.fetch_add(maps.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn vmm_device(&self, device: usize) -> Result<&SimDevice> {
        if !self.vmm_supported.load(Ordering::Relaxed) {
            return Err(Error::Driver(
                "CUDA_ERROR_NOT_SUPPORTED: this simulated device has no virtual memory management"
                    .into(),
            ));
        }
        self.device(device)
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.devices.len())
    }

    fn mem_alloc(&self, device: usize, size: usize) -> Result<usize> {
        let p = self.device(device)?.alloc(size)?;
        Self::bump(&self.counters.mem_alloc);
        Ok(p)
    }

    fn mem_free(&self, device: usize, ptr: usize) -> Result<()> {
        capture::unsafe_call("a device free (cuMemFree)");
        self.device(device)?.free(ptr)?;
        Self::bump(&self.counters.mem_free);
        Ok(())
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        let d = self.device(device)?;
        let used = d.state.lock().used;
        Ok(MemInfo {
            free: d.capacity - used,
            total: d.capacity,
        })
    }

    fn event_create(&self, device: usize) -> Result<Event> {
        self.device(device)?;
        let id = self.next_event.fetch_add(1, Ordering::Relaxed);
        self.events.lock().insert(id, EventState::Done);
        Self::bump(&self.counters.events_created);
        Ok(Event(id))
    }

    fn event_destroy(&self, _device: usize, event: Event) -> Result<()> {
        self.events.lock().remove(&event.0).ok_or_else(|| {
            Error::Driver(format!(
                "CUDA_ERROR_INVALID_HANDLE: event {} does not exist",
                event.0
            ))
        })?;
        Self::bump(&self.counters.events_destroyed);
        Ok(())
    }

    fn event_record(&self, _device: usize, event: Event, stream: Stream) -> Result<()> {
        let state = {
            let streams = STREAMS.lock();
            match streams.get(&stream) {
                Some(s) if s.held => EventState::Pending {
                    stream,
                    releases: s.releases,
                },
                _ => EventState::Done,
            }
        };
        let mut events = self.events.lock();
        let slot = events.get_mut(&event.0).ok_or_else(|| {
            Error::Driver(format!(
                "CUDA_ERROR_INVALID_HANDLE: event {} does not exist",
                event.0
            ))
        })?;
        *slot = state;
        Self::bump(&self.counters.event_records);
        Ok(())
    }

    fn event_query(&self, _device: usize, event: Event) -> Result<bool> {
        capture::unsafe_call("an event query (cuEventQuery)");
        Self::bump(&self.counters.event_queries);
        let state = *self.events.lock().get(&event.0).ok_or_else(|| {
            Error::Driver(format!(
                "CUDA_ERROR_INVALID_HANDLE: event {} does not exist",
                event.0
            ))
        })?;
        Ok(match state {
            EventState::Done => true,
            EventState::Pending { stream, releases } => STREAMS
                .lock()
                .get(&stream)
                .is_none_or(|s| s.releases > releases),
        })
    }

    fn event_synchronize(&self, _device: usize, event: Event) -> Result<()> {
        capture::unsafe_call("an event wait (cuEventSynchronize)");
        let mut events = self.events.lock();
        let slot = events.get_mut(&event.0).ok_or_else(|| {
            Error::Driver(format!(
                "CUDA_ERROR_INVALID_HANDLE: event {} does not exist",
                event.0
            ))
        })?;
        // Waiting finishes the captured work.
        *slot = EventState::Done;
        Self::bump(&self.counters.event_syncs);
        Ok(())
    }

    fn stream_device(&self, _stream: Stream) -> Result<usize> {
        Ok(0)
    }

    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        Ok(capture::is_capturing(stream))
    }

    fn host_alloc(&self, size: usize) -> Result<usize> {
        if size == 0 {
            return Err(Error::InvalidArgument("cannot pin 0 bytes".into()));
        }
        // SAFETY: an anonymous private mapping with no hint; checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::OutOfMemory(format!(
                "cannot map {size} bytes of host memory"
            )));
        }
        // Lock the pages where the process may; pinned memory is page-locked on a real driver.
        // SAFETY: [p, p+size) is the mapping just made.
        let locked = unsafe { libc::mlock(p, size) } == 0;
        self.host
            .lock()
            .insert(p as usize, HostRange::Pinned { size, locked });
        Self::bump(&self.counters.host_alloc);
        Ok(p as usize)
    }

    fn host_free(&self, ptr: usize) -> Result<()> {
        let (size, locked) = {
            let mut host = self.host.lock();
            match host.get(&ptr) {
                Some(&HostRange::Pinned { size, locked }) => {
                    host.remove(&ptr);
                    (size, locked)
                }
                _ => {
                    return Err(Error::Driver(format!(
                        "CUDA_ERROR_INVALID_VALUE: {ptr:#x} is not pinned host memory"
                    )))
                }
            }
        };
        // SAFETY: the range is the mapping made by host_alloc, removed from the table above so
        // it is unmapped once.
        unsafe {
            if locked {
                libc::munlock(ptr as *mut libc::c_void, size);
            }
            libc::munmap(ptr as *mut libc::c_void, size);
        }
        Self::bump(&self.counters.host_free);
        Ok(())
    }

    fn host_register(&self, ptr: usize, size: usize) -> Result<()> {
        if ptr == 0 || size == 0 {
            return Err(Error::Driver(
                "CUDA_ERROR_INVALID_VALUE: empty range to register".into(),
            ));
        }
        // Registered memory is simply remembered: the caller owns the pages.
        let mut host = self.host.lock();
        if host.contains_key(&ptr) {
            return Err(Error::Driver(format!(
                "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: {ptr:#x}"
            )));
        }
        host.insert(ptr, HostRange::Registered);
        Self::bump(&self.counters.host_register);
        Ok(())
    }

    fn host_unregister(&self, ptr: usize) -> Result<()> {
        {
            let mut host = self.host.lock();
            if !matches!(host.get(&ptr), Some(HostRange::Registered)) {
                return Err(Error::Driver(format!(
                    "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: {ptr:#x}"
                )));
            }
            host.remove(&ptr);
        }
        Self::bump(&self.counters.host_unregister);
        Ok(())
    }

    fn vmm_granularity(&self, device: usize) -> Result<usize> {
        self.vmm_device(device)?;
        Ok(SIM_GRANULARITY)
    }

    fn vmm_reserve(&self, device: usize, size: usize) -> Result<usize> {
        let limit = self.address_space.load(Ordering::Relaxed);
        let p = self.vmm_device(device)?.vmm_reserve(size, limit)?;
        Self::bump(&self.counters.vmm_reserve);
        Ok(p)
    }

    fn vmm_free_range(&self, device: usize, addr: usize, size: usize) -> Result<()> {
        self.vmm_device(device)?.vmm_free_range(addr, size)
    }

    fn vmm_unmap(&self, device: usize, addr: usize, size: usize, handle: PhysHandle) -> Result<()> {
        self.vmm_unmap_many(device, &[(addr, size, handle)])
    }

    fn vmm_map_many(
        &self,
        device: usize,
        addr: usize,
        size: usize,
        handle: usize,
        handles: &mut Vec<PhysHandle>,
    ) -> Result<()> {
        let before = handles.len();
        self.vmm_device(device)?
            .vmm_map_many(addr, size, handle, handles)?;
        self.counters
            .vmm_map
            .fetch_add((handles.len() - before) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn vmm_unmap_many(&self, device: usize, maps: &[(usize, usize, PhysHandle)]) -> Result<()> {
        self.unmap_counted(device, maps, false)
    }

    fn vmm_unmap_keep(&self, device: usize, maps: &[(usize, usize, PhysHandle)]) -> Result<()> {
        self.unmap_counted(device, maps, true)
    }

    fn vmm_map_kept(&self, device: usize, addr: usize, maps: &[(usize, PhysHandle)]) -> Result<()> {
        self.vmm_device(device)?.vmm_map_kept(addr, maps)?;
        self.counters
            .vmm_map_kept
            .fetch_add(maps.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn vmm_release(&self, device: usize, handle: PhysHandle) -> Result<()> {
        self.vmm_device(device)?.vmm_release(handle)?;
        Self::bump(&self.counters.vmm_release);
        Ok(())
    }
}

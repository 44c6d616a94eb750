//! The allocators behind the hooks and the rules that give CUDA's allocation calls their
//! meaning on top of a stream-ordered caching allocator.
//!
//! - `cudaFree`/`cuMemFree` are synchronous for the caller: a freed block may be handed out
//!   again only once every piece of work issued before the free has completed, on every
//!   stream. Freed blocks wait in an open batch; the batch is closed by recording one marker
//!   event on the legacy default stream (which waits for every blocking stream of the
//!   context) and one on each non-blocking stream the program created, and its blocks return
//!   to the cache once all its markers have completed. A batch is closed when it is large, or
//!   at an allocation when no older batch is still in flight. Only when memory runs short is
//!   the device synchronised, once, to take back everything.
//! - `cudaMallocAsync`/`cudaFreeAsync` keep stream order: a block freed on the stream it was
//!   allocated on is reused there at once, on other streams after an event.
//! - Blocks synchronous allocations hand out belong to a pool of their own ([`SYNC_POOL`]), so
//!   stream-ordered reuse never hands them to a stream early.
//! - A block freed in stream order on its own stream is kept aside for the next allocation of
//!   its size on that stream, and a synchronous allocation's block whose batch completed for the
//!   next synchronous allocation of its size ([`crate::front`]), without going through the
//!   allocator.
//! - `cudaFreeHost`/`cuMemFreeHost` blocks join the same batches (of the calling thread's
//!   current device): they return to the pinned cache when the batch's markers have completed.
//!
//! The hot paths (a cached pair) take no lock of their own but the lock of one front slot (per
//! stream or size) and the batch lock of a synchronous free, touch no thread-local storage,
//! and read the settings through one atomic: the live allocations are a lock-free table
//! ([`crate::live`]), the device of a context or stream is found in small shared caches filled
//! on first sight.

use std::collections::{HashSet, VecDeque};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Arc;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use tensoralloc::config::Config;
use tensoralloc::device::size::round_size_with;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::driver::{Driver, Event, Stream};
use tensoralloc::host::HostAllocator;
use tensoralloc::Error;

use crate::front::{self, Front};
use crate::live::{Live, LiveTable, PtrMap, HOST};
use crate::real::{self, CuContext, Status};

/// The pool key of blocks from synchronous allocations: never a stream handle (a
/// non-canonical address), and below the top-bit values the device refuses as streams.
pub const SYNC_POOL: Stream = 1 << 62;
/// `CU_STREAM_LEGACY` / `cudaStreamLegacy`.
pub const STREAM_LEGACY: Stream = 1;
/// `CU_STREAM_PER_THREAD` / `cudaStreamPerThread`.
pub const STREAM_PER_THREAD: Stream = 2;

/// An allocation closes the open batch (when no batch is in flight) from this many blocks...
const CLOSE_AT_ALLOC_BLOCKS: usize = 32;
/// ...or bytes.
const CLOSE_AT_ALLOC_BYTES: usize = 2 << 20;
/// A free closes the open batch from this many blocks or bytes, whatever is in flight.
const CLOSE_AT_FREE_BLOCKS: usize = 1024;
const CLOSE_AT_FREE_BYTES: usize = 256 << 20;

/// While a batch is in flight, an allocation looks at its markers once per this many.
const POLL_EVERY: u32 = 8;

/// What [`Device::reclaim`] does besides returning the batches whose markers completed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reclaim {
    /// Closes the open batch when it is due and none is in flight.
    Poll,
    /// Also closes it when it holds pinned blocks.
    CloseForHost,
    /// Synchronises the device and takes everything back.
    All,
}

/// Event counts shown at exit, for the paths that are not hot (the allocator's own statistics
/// count allocations and frees, without a process-wide counter every thread would write).
#[derive(Default)]
pub struct Counters {
    pub markers: AtomicU64,
    pub syncs: AtomicU64,
    pub passed_through: AtomicU64,
    pub invalid_frees: AtomicU64,
    pub host_served: AtomicU64,
}

/// Frees of one device waiting for their markers.
#[derive(Default)]
struct Deferred {
    /// Device blocks: address, pool and size asked for.
    open: Vec<(usize, Stream, usize)>,
    /// Pinned-host blocks: address and the host allocator's context.
    open_host: Vec<(usize, usize)>,
    open_bytes: usize,
    closed: VecDeque<Batch>,
    /// Bytes in `open` and `closed`.
    held: usize,
    /// Non-blocking streams of this device's primary context, which the legacy stream does
    /// not wait for: each batch records a marker on each of them too.
    nonblocking: HashSet<usize>,
    spare_events: Vec<Event>,
    /// Frees ever deferred.
    deferred_total: u64,
}

impl Deferred {
    fn open_blocks(&self) -> usize {
        self.open.len() + self.open_host.len()
    }
}

struct Batch {
    markers: Vec<Event>,
    ptrs: Vec<(usize, Stream, usize)>,
    host: Vec<(usize, usize)>,
    /// Device bytes.
    bytes: usize,
}

/// One device: its allocator, primary context and deferred frees.
pub struct Device {
    pub index: usize,
    pub alloc: DeviceAllocator,
    /// The primary context (the one the CUDA runtime uses), retained for the process.
    pub primary: usize,
    deferred: Mutex<Deferred>,
    /// Blocks in `deferred.open` and `deferred.closed`, readable without the lock (written
    /// under it).
    pending: AtomicUsize,
    closed_batches: AtomicUsize,
    /// The open batch is large enough to be closed at the next allocation.
    close_due: AtomicBool,
    /// Allocations since the markers were last looked at.
    poll_tick: AtomicU32,
    /// The open batch holds pinned blocks.
    host_waiting: AtomicBool,
    /// Blocks freed in stream order, kept for their stream.
    by_stream: Front,
    /// Blocks of synchronous allocations whose batch completed, kept by size.
    by_size: Front,
}

/// Everything the hooks share.
pub struct State {
    pub driver: Arc<CudaDriver>,
    pub config: Config,
    devices: Box<[OnceCell<Device>]>,
    /// Each device's primary context once the device is made (0 before), to recognise the
    /// current context without asking the driver more than for the context itself.
    primaries: Box<[AtomicUsize]>,
    host: OnceCell<HostAllocator>,
    /// Device and pinned-host allocations handed out.
    pub live: LiveTable,
    /// Every pinned address ever handed out, to tell a double free from a foreign pointer.
    pub host_known: PtrMap<()>,
    pub counters: Counters,
}

static STATE: OnceCell<Option<State>> = OnceCell::new();
/// The built state while the hooks serve (null before, when disabled, and in a forked child):
/// what a hot path reads, one load.
static SERVING: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());

/// Stream handle -> device, for the streams seen: `stream << 8 | (device + 1)` in the slot of
/// the stream's hash (a later stream with the same hash takes the slot over). Handles at or
/// above 2^56 are not cached.
const STREAM_SLOTS: usize = 256;
static STREAM_CACHE: [AtomicU64; STREAM_SLOTS] = [const { AtomicU64::new(0) }; STREAM_SLOTS];

fn stream_slot(stream: Stream) -> &'static AtomicU64 {
    let h = (stream as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    &STREAM_CACHE[(h >> (64 - STREAM_SLOTS.trailing_zeros())) as usize]
}

/// Forgets a destroyed stream (its handle may name another stream afterwards).
pub fn stream_destroyed(stream: Stream) {
    let slot = stream_slot(stream);
    let cur = slot.load(Relaxed);
    if cur >> 8 == stream as u64 {
        let _ = slot.compare_exchange(cur, 0, Relaxed, Relaxed);
    }
}

/// Stops serving (in a forked child).
pub fn stop_serving() {
    SERVING.store(std::ptr::null_mut(), Relaxed);
}

impl State {
    /// The state when the hooks serve: one atomic load once it is built.
    #[inline]
    pub fn serving() -> Option<&'static State> {
        let p = SERVING.load(Acquire);
        if p.is_null() {
            return Self::serving_slow();
        }
        // SAFETY: SERVING only ever points into STATE, which lives for the process.
        Some(unsafe { &*p })
    }

    #[cold]
    fn serving_slow() -> Option<&'static State> {
        if !crate::enabled() {
            return None;
        }
        let s = Self::get()?;
        // A fork between the check above and here leaves the child serving: it re-checks.
        if crate::enabled() {
            SERVING.store(s as *const State as *mut State, Release);
        }
        Some(s)
    }

    /// The state, built on the first call; `None` (everything passes through) when the
    /// driver or the configuration cannot be used, which is said once on stderr.
    pub fn get() -> Option<&'static State> {
        STATE
            .get_or_init(|| match State::build() {
                Ok(s) => Some(s),
                Err(e) => {
                    eprintln!(
                        "tensoralloc preload: disabled, every call goes to CUDA unchanged: {e}"
                    );
                    None
                }
            })
            .as_ref()
    }

    fn build() -> tensoralloc::Result<State> {
        let config = Config::from_env()?;
        let driver = Arc::new(CudaDriver::load()?);
        let count = driver.device_count()?;
        crate::register_fork_handler();
        if let Ok(v) = std::env::var("TENSORALLOC_PRELOAD") {
            if crate::switch(v.as_bytes()).is_none() {
                eprintln!(
                    "tensoralloc preload: TENSORALLOC_PRELOAD={v:?} is neither on nor off; \
                     serving (use on or off)"
                );
            }
        }
        let stats = std::env::var("TENSORALLOC_PRELOAD_STATS").unwrap_or_default();
        let stats_on = crate::switch(stats.as_bytes());
        if !stats.is_empty() && stats_on.is_none() {
            eprintln!(
                "tensoralloc preload: TENSORALLOC_PRELOAD_STATS={stats:?} is neither on nor off; \
                 no statistics (use 1 or 0)"
            );
        }
        if stats_on == Some(true) {
            // SAFETY: registers a plain function; it runs once at exit.
            unsafe { libc::atexit(print_stats_at_exit) };
        }
        Ok(State {
            driver,
            config,
            devices: (0..count).map(|_| OnceCell::new()).collect(),
            primaries: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            host: OnceCell::new(),
            live: LiveTable::new(),
            host_known: PtrMap::new(),
            counters: Counters::default(),
        })
    }

    fn dyn_driver(&self) -> Arc<dyn Driver> {
        self.driver.clone()
    }

    /// Device `index`, made on first use (retaining its primary context).
    #[inline]
    pub fn device(&self, index: usize) -> Option<&Device> {
        let cell = self.devices.get(index)?;
        match cell.get() {
            Some(d) => Some(d),
            None => self.make_device(cell, index),
        }
    }

    #[cold]
    fn make_device<'a>(&'a self, cell: &'a OnceCell<Device>, index: usize) -> Option<&'a Device> {
        let d = cell
            .get_or_try_init(|| {
                let alloc = DeviceAllocator::new(self.dyn_driver(), index, &self.config)?;
                let primary = retain_primary(index)?;
                Ok::<_, Error>(Device {
                    index,
                    alloc,
                    primary,
                    deferred: Mutex::new(Deferred::default()),
                    pending: AtomicUsize::new(0),
                    closed_batches: AtomicUsize::new(0),
                    close_due: AtomicBool::new(false),
                    poll_tick: AtomicU32::new(0),
                    host_waiting: AtomicBool::new(false),
                    by_stream: Front::new(4),
                    by_size: Front::new(64),
                })
            })
            .map_err(|e| {
                eprintln!(
                    "tensoralloc preload: device {index} unusable, its calls pass through: {e}"
                )
            })
            .ok()?;
        self.primaries[index].store(d.primary, Release);
        Some(d)
    }

    /// Devices made so far.
    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.devices.iter().filter_map(OnceCell::get)
    }

    /// The pinned-host allocator.
    pub fn host(&self) -> &HostAllocator {
        self.host
            .get_or_init(|| HostAllocator::new(self.dyn_driver(), &self.config))
    }

    /// The device whose primary context `ctx` is, if it is one.
    #[inline]
    pub fn device_of_context(&self, ctx: CuContext) -> Option<&Device> {
        let ctx = ctx as usize;
        if ctx == 0 {
            return None;
        }
        for (i, p) in self.primaries.iter().enumerate() {
            if p.load(Acquire) == ctx {
                return self.devices[i].get();
            }
        }
        self.device_of_context_slow(ctx)
    }

    #[cold]
    fn device_of_context_slow(&self, ctx: usize) -> Option<&Device> {
        let push = real::cuCtxPushCurrent_v2()?;
        let pop = real::cuCtxPopCurrent_v2()?;
        let get_device = real::cuCtxGetDevice()?;
        let mut ordinal: c_int = -1;
        // SAFETY: `ctx` is a context handle the driver gave; push/pop leave the thread's
        // context stack as it was; the out-pointers are valid.
        unsafe {
            if push(ctx as CuContext) != real::SUCCESS {
                return None;
            }
            get_device(&mut ordinal);
            pop(std::ptr::null_mut());
        }
        let device = self.device(usize::try_from(ordinal).ok()?)?;
        (device.primary == ctx).then_some(device)
    }

    /// The device of the calling thread's current context, when that is a primary context.
    pub fn current_device(&self) -> Option<&Device> {
        let get = real::cuCtxGetCurrent()?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        if unsafe { get(&mut ctx) } != real::SUCCESS {
            return None;
        }
        self.device_of_context(ctx)
    }

    /// The device of a stream handle (other than the special handles 0, 1, 2), when it
    /// belongs to a primary context.
    #[inline]
    pub fn stream_device(&self, stream: Stream) -> Option<&Device> {
        let cached = stream_slot(stream).load(Relaxed);
        if cached >> 8 == stream as u64 && cached & 0xff != 0 {
            return self.devices.get((cached & 0xff) as usize - 1)?.get();
        }
        let d = self.stream_device_uncached(stream)?;
        if (stream as u64) < 1 << 56 && d.index < 0xff {
            stream_slot(stream).store((stream as u64) << 8 | (d.index as u64 + 1), Relaxed);
        }
        Some(d)
    }

    #[cold]
    fn stream_device_uncached(&self, stream: Stream) -> Option<&Device> {
        let get = real::cuStreamGetCtx()?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the driver validates the handle.
        if unsafe { get(stream as real::CuStream, &mut ctx) } != real::SUCCESS {
            return None;
        }
        self.device_of_context(ctx)
    }

    /// Where the device allocation at `ptr` came from, if it is a live allocation of ours.
    #[inline]
    pub fn take_live(&self, ptr: usize) -> Option<Live> {
        self.take_live_of(ptr, false)
    }

    /// The entry of `ptr` when it is live and a pinned (`host`) or device allocation as asked;
    /// an allocation of the other kind stays live.
    #[inline]
    fn take_live_of(&self, ptr: usize, host: bool) -> Option<Live> {
        let live = self.live.remove(ptr)?;
        if (live.device == HOST) != host {
            self.live.insert(ptr, live);
            return None;
        }
        Some(live)
    }

    /// Whether `ptr` lies in memory this state's allocators own (a double free when it is not
    /// live).
    pub fn owns(&self, ptr: usize) -> bool {
        self.devices().any(|d| d.alloc.owns(ptr))
    }

    /// Allocates for a synchronous `cudaMalloc`/`cuMemAlloc`.
    #[inline]
    pub fn malloc_sync(&self, d: &Device, size: usize) -> tensoralloc::Result<usize> {
        if d.pending.load(Relaxed) != 0 {
            d.maybe_reclaim(self);
        }
        self.malloc_from(d, &d.by_size, size, size, SYNC_POOL)
    }

    /// Allocates in `stream`'s order.
    #[inline]
    pub fn malloc_async(
        &self,
        d: &Device,
        size: usize,
        stream: Stream,
    ) -> tensoralloc::Result<usize> {
        self.malloc_from(d, &d.by_stream, stream, size, stream)
    }

    /// Allocates for `pool`: a block kept under `key` in `front` when there is one, else from
    /// the allocator (making room once when memory is short).
    #[inline]
    fn malloc_from(
        &self,
        d: &Device,
        front: &Front,
        key: usize,
        size: usize,
        pool: Stream,
    ) -> tensoralloc::Result<usize> {
        let kept = if size <= front::MAX_BYTES {
            front.take(key, size)
        } else {
            None
        };
        let ptr = match kept {
            Some(ptr) => ptr,
            None => match d.alloc.malloc(size, pool) {
                Err(Error::OutOfMemory(_)) if d.make_room(self) => d.alloc.malloc(size, pool)?,
                other => other?,
            },
        };
        self.handed_out(d, ptr, size, pool);
        Ok(ptr)
    }

    #[inline]
    fn handed_out(&self, d: &Device, ptr: usize, size: usize, pool: Stream) {
        self.live.insert(
            ptr,
            Live {
                device: d.index as u8,
                size,
                pool,
            },
        );
    }

    /// Frees with `cudaFree`'s meaning: the block waits for a marker of a later batch.
    pub fn free_sync(&self, ptr: usize, live: Live) {
        let Some(d) = self.device(live.device as usize) else {
            return;
        };
        let size = round_size_with(live.size, self.config.divisions_for(live.size));
        let mut g = d.deferred.lock();
        g.deferred_total += 1;
        g.open.push((ptr, live.pool, live.size));
        g.open_bytes += size;
        g.held += size;
        d.opened(self, &mut g);
    }

    /// Notes a pinned block handed out.
    pub fn host_handed_out(&self, ptr: usize, ctx: usize, size: usize) {
        self.live.insert(
            ptr,
            Live {
                pool: ctx,
                size,
                device: HOST,
            },
        );
    }

    /// The host allocator's context of the pinned block at `ptr`, if it is live; a device
    /// allocation stays live.
    pub fn take_host_live(&self, ptr: usize) -> Option<usize> {
        self.take_live_of(ptr, true).map(|live| live.pool)
    }

    /// Returns a pinned block to the cache once the work queued so far on `d`'s legacy and
    /// non-blocking streams is done: it joins `d`'s open batch.
    pub fn free_host_deferred(&self, d: &Device, ptr: usize, ctx: usize) {
        let mut g = d.deferred.lock();
        g.open_host.push((ptr, ctx));
        d.host_waiting.store(true, Relaxed);
        d.opened(self, &mut g);
    }

    /// Lets every device look at its batches before pinned memory is allocated (blocks freed
    /// with `cudaFreeHost` wait there): an open batch with pinned blocks is closed at once when
    /// no batch is in flight, since pinning new memory costs far more than a marker. With
    /// `all` (the cache is short), takes every block back.
    pub fn reclaim_for_host(&self, all: bool) {
        for d in self.devices() {
            if d.pending.load(Relaxed) == 0 {
                continue;
            }
            if all {
                d.reclaim(self, Reclaim::All);
            } else if d.closed_batches.load(Relaxed) == 0 && d.host_waiting.load(Relaxed) {
                d.reclaim(self, Reclaim::CloseForHost);
            } else {
                d.maybe_reclaim(self);
            }
        }
    }

    /// Frees in `stream`'s order (`cudaFreeAsync`).
    pub fn free_async(&self, ptr: usize, live: Live, stream: Stream) -> tensoralloc::Result<()> {
        let d = self
            .device(live.device as usize)
            .ok_or_else(|| Error::Internal(format!("device {} vanished", live.device)))?;
        if stream != live.pool {
            d.alloc.record_stream(ptr, stream)?;
        } else if live.size <= front::MAX_BYTES {
            d.by_stream
                .keep(stream, live.size, ptr, |p, pool| d.give_back(p, pool));
            return Ok(());
        }
        d.alloc.free(ptr, Some(live.pool))
    }

    /// Bytes of device `d` that tensoralloc holds but the program does not use.
    pub fn cached_free_bytes(&self, d: &Device) -> usize {
        let stats = d.alloc.stats();
        let reserved = stats.reserved_bytes[0].current.max(0) as usize;
        let allocated = stats.allocated_bytes[0].current.max(0) as usize;
        let kept: usize = [&d.by_stream, &d.by_size]
            .iter()
            .flat_map(|f| f.summary().0)
            .map(|size| round_size_with(size, self.config.divisions_for(size)))
            .sum();
        reserved.saturating_sub(allocated) + d.deferred.lock().held + kept
    }

    /// Counts one call that went to CUDA unchanged.
    pub fn passed(&self) {
        self.counters.passed_through.fetch_add(1, Relaxed);
    }
}

impl Device {
    /// After a block joined the open batch (the caller holds the lock): counts it, and closes
    /// the batch when it is very large.
    fn opened(&self, state: &State, g: &mut Deferred) {
        self.pending.store(self.pending.load(Relaxed) + 1, Relaxed);
        let blocks = g.open_blocks();
        if blocks >= CLOSE_AT_FREE_BLOCKS || g.open_bytes >= CLOSE_AT_FREE_BYTES {
            self.close_batch(state, g);
        } else if blocks >= CLOSE_AT_ALLOC_BLOCKS || g.open_bytes >= CLOSE_AT_ALLOC_BYTES {
            self.close_due.store(true, Relaxed);
        }
    }

    /// What an allocation does while frees wait: closes the open batch when it is due and no
    /// batch is in flight, and otherwise looks at the markers in flight now and then.
    #[inline]
    fn maybe_reclaim(&self, state: &State) {
        let due = if self.closed_batches.load(Relaxed) == 0 {
            self.close_due.load(Relaxed)
        } else {
            self.poll_tick
                .fetch_add(1, Relaxed)
                .is_multiple_of(POLL_EVERY)
        };
        if due {
            self.reclaim(state, Reclaim::Poll);
        }
    }

    /// Returns to the cache the batches whose markers have completed, closing the open batch
    /// first when no batch is in flight and it is worth a marker. With `all` (memory is
    /// short), synchronises the device once and returns everything.
    #[cold]
    fn reclaim(&self, state: &State, how: Reclaim) {
        let mut g = self.deferred.lock();
        if how == Reclaim::All {
            let open = std::mem::take(&mut g.open);
            let open_host = std::mem::take(&mut g.open_host);
            g.open_bytes = 0;
            self.close_due.store(false, Relaxed);
            self.host_waiting.store(false, Relaxed);
            let batches: Vec<Batch> = g.closed.drain(..).collect();
            self.synchronize(state);
            self.release(state, &open, &open_host);
            for b in batches {
                self.finish_batch(state, &mut g, b);
            }
            g.held = 0;
            self.pending.store(0, Relaxed);
            self.closed_batches.store(0, Relaxed);
            return;
        }
        self.poll(state, &mut g);
        if g.closed.is_empty()
            && (g.open_blocks() >= CLOSE_AT_ALLOC_BLOCKS
                || g.open_bytes >= CLOSE_AT_ALLOC_BYTES
                || (how == Reclaim::CloseForHost && !g.open_host.is_empty()))
        {
            self.close_batch(state, &mut g);
            self.poll(state, &mut g);
        }
    }

    /// Returns the completed batches, oldest first.
    fn poll(&self, state: &State, g: &mut Deferred) {
        while let Some(front) = g.closed.front() {
            let done = front.markers.iter().all(|&e| {
                // A marker that cannot be queried is waited for instead.
                state
                    .driver
                    .event_query(self.index, e)
                    .unwrap_or_else(|_| state.driver.event_synchronize(self.index, e).is_ok())
            });
            if !done {
                break;
            }
            let b = g.closed.pop_front().expect("front exists");
            self.closed_batches.store(g.closed.len(), Relaxed);
            g.held -= b.bytes;
            self.finish_batch(state, g, b);
        }
    }

    fn finish_batch(&self, state: &State, g: &mut Deferred, b: Batch) {
        g.spare_events.extend(b.markers);
        self.release(state, &b.ptrs, &b.host);
        let waiting = self.pending.load(Relaxed);
        self.pending
            .store(waiting.saturating_sub(b.ptrs.len() + b.host.len()), Relaxed);
    }

    /// Returns deferred blocks to their caches (the caller holds the deferred lock and
    /// counts them off `pending`).
    fn release(&self, state: &State, ptrs: &[(usize, Stream, usize)], host: &[(usize, usize)]) {
        for &(ptr, pool, size) in ptrs {
            if pool == SYNC_POOL && size <= front::MAX_BYTES {
                self.by_size
                    .keep(size, size, ptr, |p, _| self.give_back(p, SYNC_POOL));
            } else {
                self.give_back(ptr, pool);
            }
        }
        for &(ptr, ctx) in host {
            if let Err(e) = state.host().free(ptr, Some(ctx)) {
                eprintln!(
                    "tensoralloc preload: returning pinned {ptr:#x} to the cache failed: {e}"
                );
            }
        }
    }

    /// Records the markers of the open batch (legacy stream and each non-blocking stream).
    fn close_batch(&self, state: &State, g: &mut Deferred) {
        self.close_due.store(false, Relaxed);
        self.host_waiting.store(false, Relaxed);
        if g.open_blocks() == 0 {
            return;
        }
        let streams: Vec<Stream> = std::iter::once(0)
            .chain(g.nonblocking.iter().copied())
            .collect();
        let mut markers = Vec::with_capacity(streams.len());
        let mut failed = false;
        for s in streams {
            let event = match g.spare_events.pop() {
                Some(e) => Ok(e),
                None => state.driver.event_create(self.index),
            };
            match event.and_then(|e| state.driver.event_record(self.index, e, s).map(|()| e)) {
                Ok(e) => markers.push(e),
                Err(_) => failed = true,
            }
        }
        state
            .counters
            .markers
            .fetch_add(markers.len() as u64, Relaxed);
        let ptrs = std::mem::take(&mut g.open);
        let host = std::mem::take(&mut g.open_host);
        let bytes = std::mem::replace(&mut g.open_bytes, 0);
        let b = Batch {
            markers,
            ptrs,
            host,
            bytes,
        };
        if failed {
            // A stream could not take a marker (destroyed behind our back?): wait for the
            // whole device instead.
            self.synchronize(state);
            g.held -= bytes;
            self.finish_batch(state, g, b);
            return;
        }
        g.closed.push_back(b);
        self.closed_batches.store(g.closed.len(), Relaxed);
    }

    /// Waits for all work of the device's primary context.
    fn synchronize(&self, state: &State) {
        state.counters.syncs.fetch_add(1, Relaxed);
        let (Some(push), Some(pop), Some(sync)) = (
            real::cuCtxPushCurrent_v2(),
            real::cuCtxPopCurrent_v2(),
            real::cuCtxSynchronize(),
        ) else {
            return;
        };
        // SAFETY: the primary context is retained for the process; push/pop are balanced.
        unsafe {
            if push(self.primary as CuContext) == real::SUCCESS {
                sync();
                pop(std::ptr::null_mut());
            }
        }
    }

    /// Notes a non-blocking stream created in this device's primary context.
    pub fn add_nonblocking_stream(&self, stream: Stream) {
        self.deferred.lock().nonblocking.insert(stream);
    }

    /// Forgets a destroyed stream, and gives back the blocks kept for it.
    pub fn remove_stream(&self, stream: Stream) {
        self.deferred.lock().nonblocking.remove(&stream);
        self.by_stream
            .drain(Some(stream), |p, pool| self.give_back(p, pool));
    }

    /// When an allocation found no memory: synchronises to take back the frees waiting for
    /// markers, and gives back the blocks kept aside. Whether anything came back.
    #[cold]
    fn make_room(&self, state: &State) -> bool {
        let mut freed = false;
        if self.pending.load(Relaxed) != 0 {
            self.reclaim(state, Reclaim::All);
            freed = true;
        }
        self.by_stream.drain(None, |p, pool| {
            self.give_back(p, pool);
            freed = true;
        });
        self.by_size.drain(None, |p, _| {
            self.give_back(p, SYNC_POOL);
            freed = true;
        });
        freed
    }

    /// Returns a block to the allocator (said on stderr if that fails: nothing else to do).
    fn give_back(&self, ptr: usize, pool: Stream) {
        if let Err(e) = self.alloc.free(ptr, Some(pool)) {
            eprintln!(
                "tensoralloc preload: device {}: returning {ptr:#x} to the cache failed: {e}",
                self.index
            );
        }
    }

    /// Frees deferred so far, blocks waiting for a marker, batches in flight, and bytes held
    /// (for the statistics).
    fn deferred_summary(&self) -> (u64, usize, usize, usize) {
        let g = self.deferred.lock();
        let waiting = g.open_blocks()
            + g.closed
                .iter()
                .map(|b| b.ptrs.len() + b.host.len())
                .sum::<usize>();
        (g.deferred_total, waiting, g.closed.len(), g.held)
    }
}

/// Retains device `index`'s primary context and returns its handle.
fn retain_primary(index: usize) -> tensoralloc::Result<usize> {
    let fail =
        |what: &str, code: Status| Error::Driver(format!("{what} failed with CUDA error {code}"));
    let get = real::cuDeviceGet().ok_or_else(|| fail("finding cuDeviceGet", -1))?;
    let retain = real::cuDevicePrimaryCtxRetain()
        .ok_or_else(|| fail("finding cuDevicePrimaryCtxRetain", -1))?;
    let mut dev: c_int = 0;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the ordinal is below the driver's device count.
    unsafe {
        let r = get(&mut dev, index as c_int);
        if r != real::SUCCESS {
            return Err(fail("cuDeviceGet", r));
        }
        let r = retain(&mut ctx, dev);
        if r != real::SUCCESS {
            return Err(fail("cuDevicePrimaryCtxRetain", r));
        }
    }
    Ok(ctx as usize)
}

extern "C" fn print_stats_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Some(s)) = STATE.get() {
            eprint!("{}", s.stats_text());
        }
    });
}

impl State {
    /// The statistics `TENSORALLOC_PRELOAD_STATS=1` prints at exit.
    pub fn stats_text(&self) -> String {
        use std::fmt::Write as _;
        let c = &self.counters;
        let mut t = String::new();
        let mut served = 0;
        let mut deferred = 0;
        let mut lines = String::new();
        for d in self.devices() {
            let s = d.alloc.stats();
            let (total, waiting, batches, held) = d.deferred_summary();
            let hits = d.by_stream.summary().1 + d.by_size.summary().1;
            served += s.allocation[0].allocated + hits as i64;
            deferred += total;
            let _ = writeln!(
                lines,
                "tensoralloc preload: device {}: {} driver allocations, {} driver frees, {} bytes reserved ({} peak), {} bytes allocated ({} peak), {} blocks ({} bytes) waiting in {} batches in flight",
                d.index,
                s.num_device_alloc,
                s.num_device_free,
                s.reserved_bytes[0].current,
                s.reserved_bytes[0].peak,
                s.allocated_bytes[0].current,
                s.allocated_bytes[0].peak,
                waiting,
                held,
                batches,
            );
        }
        let _ = writeln!(
            t,
            "tensoralloc preload: {served} device allocations served, {deferred} cudaFree/cuMemFree calls deferred to {} batch markers, {} device synchronisations, {} calls passed through, {} invalid frees, {} pinned-host allocations served",
            c.markers.load(Relaxed),
            c.syncs.load(Relaxed),
            c.passed_through.load(Relaxed),
            c.invalid_frees.load(Relaxed),
            c.host_served.load(Relaxed),
        );
        t.push_str(&lines);
        if let Some(h) = self.host.get() {
            let s = h.stats();
            let _ = writeln!(
                t,
                "tensoralloc preload: pinned host: {} driver allocations, {} bytes reserved ({} peak)",
                s.driver_allocations, s.reserved_bytes.current, s.reserved_bytes.peak
            );
        }
        t
    }
}

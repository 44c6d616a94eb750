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

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::c_int;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
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

use crate::real::{self, CuContext, Status};

/// The pool key of blocks from synchronous allocations (never a stream handle).
pub const SYNC_POOL: Stream = usize::MAX - 0xfff;
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

/// A hasher for addresses (512-byte aligned): one multiplication.
#[derive(Default)]
pub struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, x: usize) {
        let h = (x as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }
}

type Map<V> = HashMap<usize, V, BuildHasherDefault<PtrHasher>>;
const MAP_SHARDS: usize = 32;

/// A map from addresses, sharded so threads rarely meet on a lock.
pub struct PtrMap<V> {
    shards: [Mutex<Map<V>>; MAP_SHARDS],
}

impl<V> PtrMap<V> {
    fn new() -> Self {
        PtrMap {
            shards: std::array::from_fn(|_| Mutex::new(Map::default())),
        }
    }
    fn shard(&self, ptr: usize) -> &Mutex<Map<V>> {
        &self.shards[(ptr >> 9) % MAP_SHARDS]
    }
    pub fn insert(&self, ptr: usize, v: V) {
        self.shard(ptr).lock().insert(ptr, v);
    }
    pub fn remove(&self, ptr: usize) -> Option<V> {
        self.shard(ptr).lock().remove(&ptr)
    }
}

/// A device allocation handed out by a hook.
#[derive(Clone, Copy)]
pub struct Live {
    pub device: u32,
    /// The size of its block (the request rounded as the allocator rounds it).
    pub size: usize,
    /// The pool it came from: a stream handle, or [`SYNC_POOL`].
    pub pool: Stream,
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
    open: Vec<usize>,
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

struct Batch {
    markers: Vec<Event>,
    ptrs: Vec<usize>,
    bytes: usize,
}

/// One device: its allocator, primary context and deferred frees.
pub struct Device {
    pub index: usize,
    pub alloc: DeviceAllocator,
    /// The primary context (the one the CUDA runtime uses), retained for the process.
    pub primary: usize,
    deferred: Mutex<Deferred>,
    /// Blocks in `deferred.open` and `deferred.closed`, readable without the lock.
    pending: AtomicUsize,
    closed_batches: AtomicUsize,
}

/// Everything the hooks share.
pub struct State {
    pub driver: Arc<CudaDriver>,
    pub config: Config,
    devices: Box<[OnceCell<Device>]>,
    host: OnceCell<HostAllocator>,
    pub live: PtrMap<Live>,
    /// Pinned blocks handed out: address -> the allocator's context for it.
    pub host_live: PtrMap<usize>,
    /// Every pinned address ever handed out, to tell a double free from a foreign pointer.
    pub host_known: PtrMap<()>,
    pub counters: Counters,
}

static STATE: OnceCell<Option<State>> = OnceCell::new();

thread_local! {
    /// The last context seen current on this thread and its device (or `usize::MAX`).
    static LAST_CONTEXT: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, usize::MAX)) };
    /// The last stream this thread allocated on, its device, and [`STREAM_GENERATION`] then.
    static LAST_STREAM: std::cell::Cell<(usize, usize, u64)> = const { std::cell::Cell::new((0, usize::MAX, u64::MAX)) };
}

/// Bumped whenever a stream is destroyed: a handle may name another stream afterwards.
static STREAM_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Forgets what the threads know about stream handles (one was destroyed).
pub fn stream_destroyed() {
    STREAM_GENERATION.fetch_add(1, Relaxed);
}

impl State {
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
        if std::env::var("TENSORALLOC_PRELOAD_STATS").is_ok_and(|v| v.trim() == "1") {
            // SAFETY: registers a plain function; it runs once at exit.
            unsafe { libc::atexit(print_stats_at_exit) };
        }
        Ok(State {
            driver,
            config,
            devices: (0..count).map(|_| OnceCell::new()).collect(),
            host: OnceCell::new(),
            live: PtrMap::new(),
            host_live: PtrMap::new(),
            host_known: PtrMap::new(),
            counters: Counters::default(),
        })
    }

    fn dyn_driver(&self) -> Arc<dyn Driver> {
        self.driver.clone()
    }

    /// Device `index`, made on first use (retaining its primary context).
    pub fn device(&self, index: usize) -> Option<&Device> {
        let cell = self.devices.get(index)?;
        cell.get_or_try_init(|| {
            let alloc = DeviceAllocator::new(self.dyn_driver(), index, &self.config)?;
            let primary = retain_primary(index)?;
            Ok::<_, Error>(Device {
                index,
                alloc,
                primary,
                deferred: Mutex::new(Deferred::default()),
                pending: AtomicUsize::new(0),
                closed_batches: AtomicUsize::new(0),
            })
        })
        .map_err(|e| {
            eprintln!("tensoralloc preload: device {index} unusable, its calls pass through: {e}")
        })
        .ok()
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
    pub fn device_of_context(&self, ctx: CuContext) -> Option<&Device> {
        let ctx = ctx as usize;
        if ctx == 0 {
            return None;
        }
        let (last_ctx, last_dev) = LAST_CONTEXT.with(|c| c.get());
        if last_ctx == ctx {
            return self.devices.get(last_dev)?.get();
        }
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
        if device.primary != ctx {
            return None;
        }
        LAST_CONTEXT.with(|c| c.set((ctx, device.index)));
        Some(device)
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
    pub fn stream_device(&self, stream: Stream) -> Option<&Device> {
        let generation = STREAM_GENERATION.load(Relaxed);
        let (last, dev, seen) = LAST_STREAM.with(|c| c.get());
        if last == stream && seen == generation {
            return self.devices.get(dev)?.get();
        }
        let d = self.stream_device_uncached(stream)?;
        LAST_STREAM.with(|c| c.set((stream, d.index, generation)));
        Some(d)
    }

    fn stream_device_uncached(&self, stream: Stream) -> Option<&Device> {
        let get = real::cuStreamGetCtx()?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the driver validates the handle.
        if unsafe { get(stream as real::CuStream, &mut ctx) } != real::SUCCESS {
            return None;
        }
        self.device_of_context(ctx)
    }

    /// Where the allocation at `ptr` came from, if it is a live allocation of ours.
    pub fn take_live(&self, ptr: usize) -> Option<Live> {
        self.live.remove(ptr)
    }

    /// Whether `ptr` lies in memory this state's allocators own (a double free when it is not
    /// live).
    pub fn owns(&self, ptr: usize) -> bool {
        self.devices().any(|d| d.alloc.owns(ptr))
    }

    /// Allocates for a synchronous `cudaMalloc`/`cuMemAlloc`.
    pub fn malloc_sync(&self, d: &Device, size: usize) -> tensoralloc::Result<usize> {
        if d.pending.load(Relaxed) != 0 {
            d.reclaim(self, false);
        }
        let ptr = match d.alloc.malloc(size, SYNC_POOL) {
            Err(Error::OutOfMemory(_)) if d.pending.load(Relaxed) != 0 => {
                d.reclaim(self, true);
                d.alloc.malloc(size, SYNC_POOL)?
            }
            other => other?,
        };
        self.handed_out(d, ptr, size, SYNC_POOL);
        Ok(ptr)
    }

    /// Allocates in `stream`'s order.
    pub fn malloc_async(
        &self,
        d: &Device,
        size: usize,
        stream: Stream,
    ) -> tensoralloc::Result<usize> {
        let ptr = match d.alloc.malloc(size, stream) {
            Err(Error::OutOfMemory(_)) if d.pending.load(Relaxed) != 0 => {
                d.reclaim(self, true);
                d.alloc.malloc(size, stream)?
            }
            other => other?,
        };
        self.handed_out(d, ptr, size, stream);
        Ok(ptr)
    }

    fn handed_out(&self, d: &Device, ptr: usize, size: usize, pool: Stream) {
        let size = round_size_with(size, self.config.divisions_for(size));
        self.live.insert(
            ptr,
            Live {
                device: d.index as u32,
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
        let mut g = d.deferred.lock();
        g.deferred_total += 1;
        g.open.push(ptr);
        g.open_bytes += live.size;
        g.held += live.size;
        d.pending.fetch_add(1, Relaxed);
        if g.open.len() >= CLOSE_AT_FREE_BLOCKS || g.open_bytes >= CLOSE_AT_FREE_BYTES {
            d.close_batch(self, &mut g);
        }
    }

    /// Frees in `stream`'s order (`cudaFreeAsync`).
    pub fn free_async(&self, ptr: usize, live: Live, stream: Stream) -> tensoralloc::Result<()> {
        let d = self
            .device(live.device as usize)
            .ok_or_else(|| Error::Internal(format!("device {} vanished", live.device)))?;
        if stream != live.pool {
            d.alloc.record_stream(ptr, stream)?;
        }
        d.alloc.free(ptr, Some(live.pool))
    }

    /// Bytes of device `d` that tensoralloc holds but the program does not use.
    pub fn cached_free_bytes(&self, d: &Device) -> usize {
        let stats = d.alloc.stats();
        let reserved = stats.reserved_bytes[0].current.max(0) as usize;
        let allocated = stats.allocated_bytes[0].current.max(0) as usize;
        reserved.saturating_sub(allocated) + d.deferred.lock().held
    }

    /// Counts one call that went to CUDA unchanged.
    pub fn passed(&self) {
        self.counters.passed_through.fetch_add(1, Relaxed);
    }
}

impl Device {
    /// Returns to the cache the batches whose markers have completed, closing the open batch
    /// first when no batch is in flight and it is worth a marker. With `all` (memory is
    /// short), synchronises the device once and returns everything.
    fn reclaim(&self, state: &State, all: bool) {
        let mut g = self.deferred.lock();
        if all {
            let open = std::mem::take(&mut g.open);
            g.open_bytes = 0;
            let batches: Vec<Batch> = g.closed.drain(..).collect();
            self.synchronize(state);
            for ptr in open {
                self.release(ptr);
            }
            for b in batches {
                self.finish_batch(&mut g, b);
            }
            g.held = 0;
            self.closed_batches.store(0, Relaxed);
            return;
        }
        self.poll(state, &mut g);
        if g.closed.is_empty()
            && (g.open.len() >= CLOSE_AT_ALLOC_BLOCKS || g.open_bytes >= CLOSE_AT_ALLOC_BYTES)
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
            self.closed_batches.fetch_sub(1, Relaxed);
            g.held -= b.bytes;
            self.finish_batch(g, b);
        }
    }

    fn finish_batch(&self, g: &mut Deferred, b: Batch) {
        g.spare_events.extend(b.markers);
        for ptr in b.ptrs {
            self.release(ptr);
        }
    }

    /// Returns one deferred block to the cache (the caller holds the deferred lock).
    fn release(&self, ptr: usize) {
        self.pending.fetch_sub(1, Relaxed);
        if let Err(e) = self.alloc.free(ptr, None) {
            eprintln!(
                "tensoralloc preload: device {}: returning {ptr:#x} to the cache failed: {e}",
                self.index
            );
        }
    }

    /// Records the markers of the open batch (legacy stream and each non-blocking stream).
    fn close_batch(&self, state: &State, g: &mut Deferred) {
        if g.open.is_empty() {
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
        let bytes = std::mem::replace(&mut g.open_bytes, 0);
        if failed {
            // A stream could not take a marker (destroyed behind our back?): wait for the
            // whole device instead.
            self.synchronize(state);
            g.spare_events.extend(markers);
            g.held -= bytes;
            for ptr in ptrs {
                self.release(ptr);
            }
            return;
        }
        g.closed.push_back(Batch {
            markers,
            ptrs,
            bytes,
        });
        self.closed_batches.fetch_add(1, Relaxed);
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

    /// The non-blocking streams known on this device.
    pub fn nonblocking_streams(&self) -> Vec<Stream> {
        self.deferred.lock().nonblocking.iter().copied().collect()
    }

    /// Forgets a destroyed stream.
    pub fn remove_stream(&self, stream: Stream) {
        self.deferred.lock().nonblocking.remove(&stream);
    }

    /// Frees deferred so far, blocks waiting for a marker, batches in flight, and bytes held
    /// (for the statistics).
    fn deferred_summary(&self) -> (u64, usize, usize, usize) {
        let g = self.deferred.lock();
        let waiting = g.open.len() + g.closed.iter().map(|b| b.ptrs.len()).sum::<usize>();
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
            served += s.allocation[0].allocated;
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

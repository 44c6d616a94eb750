//! A segment returned to the driver may come straight back, at the same address, to another
//! stream of the device. The new owner's allocations there stay freeable through the segment
//! map (a free whose stream is unknown or wrong) however the two threads interleave: here the
//! other stream allocates inside the driver's free, the moment the addresses are the driver's
//! again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::driver::{Driver, Event, MemInfo, Stream};
use tensoralloc::Result;

const MIB: usize = 1 << 20;
const STREAM_A: Stream = 0x5e9_0a00;
const STREAM_B: Stream = 0x5e9_0b00;

/// Forwards to the simulated driver; after the driver frees the address in `reuse_at`, has
/// another thread allocate `reuse_size` bytes on stream B and keeps what it got in `reused`.
struct Reusing {
    inner: Arc<SimDriver>,
    alloc: OnceLock<Arc<DeviceAllocator>>,
    reuse_at: AtomicUsize,
    reuse_size: usize,
    reused: Mutex<Option<usize>>,
}

impl Reusing {
    fn after_free(&self, ptr: usize) {
        let armed = self
            .reuse_at
            .compare_exchange(ptr, 0, Ordering::AcqRel, Ordering::Acquire);
        if ptr == 0 || armed.is_err() {
            return;
        }
        let alloc = self.alloc.get().unwrap().clone();
        let size = self.reuse_size;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(alloc.malloc(size, STREAM_B));
        });
        let got = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("stream B could not allocate while stream A's segment was freed");
        *self.reused.lock().unwrap() = Some(got.unwrap());
    }
}

impl Driver for Reusing {
    fn name(&self) -> &'static str {
        "reusing"
    }
    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }
    fn mem_alloc(&self, device: usize, size: usize) -> Result<usize> {
        self.inner.mem_alloc(device, size)
    }
    fn mem_free(&self, device: usize, ptr: usize) -> Result<()> {
        self.inner.mem_free(device, ptr)?;
        self.after_free(ptr);
        Ok(())
    }
    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }
    fn event_create(&self, device: usize) -> Result<Event> {
        self.inner.event_create(device)
    }
    fn event_destroy(&self, device: usize, event: Event) -> Result<()> {
        self.inner.event_destroy(device, event)
    }
    fn event_record(&self, device: usize, event: Event, stream: Stream) -> Result<()> {
        self.inner.event_record(device, event, stream)
    }
    fn event_query(&self, device: usize, event: Event) -> Result<bool> {
        self.inner.event_query(device, event)
    }
    fn event_synchronize(&self, device: usize, event: Event) -> Result<()> {
        self.inner.event_synchronize(device, event)
    }
    fn stream_device(&self, stream: Stream) -> Result<usize> {
        self.inner.stream_device(stream)
    }
    fn host_alloc(&self, size: usize) -> Result<usize> {
        self.inner.host_alloc(size)
    }
    fn host_free(&self, ptr: usize) -> Result<()> {
        self.inner.host_free(ptr)
    }
    fn host_register(&self, ptr: usize, size: usize) -> Result<()> {
        self.inner.host_register(ptr, size)
    }
    fn host_unregister(&self, ptr: usize) -> Result<()> {
        self.inner.host_unregister(ptr)
    }
}

#[test]
fn a_segment_another_stream_gets_back_at_once_stays_freeable() {
    let driver = Arc::new(Reusing {
        inner: SimDriver::shared(1, (1 << 30) as u64).unwrap(),
        alloc: OnceLock::new(),
        reuse_at: AtomicUsize::new(0),
        reuse_size: 20 * MIB,
        reused: Mutex::new(None),
    });
    let a = Arc::new(DeviceAllocator::new(driver.clone(), 0, &Config::default()).unwrap());
    assert!(driver.alloc.set(a.clone()).is_ok());
    // Stream B's shard comes first (the cache is emptied in shard order) and once held what it
    // gets back below, so it allocates there without settling peaks against stream A's shard,
    // whose lock the freeing thread holds.
    let small = a.malloc(512, STREAM_B).unwrap();
    let p = a.malloc(20 * MIB, STREAM_A).unwrap();
    let b = a.malloc(20 * MIB, STREAM_B).unwrap();
    a.free(p, Some(STREAM_A)).unwrap();
    a.free(b, Some(STREAM_B)).unwrap();
    driver.reuse_at.store(p, Ordering::Release);
    a.empty_cache().unwrap();

    let q = driver
        .reused
        .lock()
        .unwrap()
        .take()
        .expect("the segment was not freed");
    assert_eq!(
        q, p,
        "the driver handed out other addresses: the test proves nothing"
    );
    assert!(a.is_allocated(q));
    // Found through the segment map: by an interior pointer, and freed with the wrong stream
    // and with none.
    assert_eq!(a.base_allocation(q + MIB).unwrap().0, q);
    a.free(q, Some(STREAM_A)).unwrap();
    a.free(small, None).unwrap();
    let st = a.stats();
    assert_eq!(st.allocated_bytes[0].current, 0);
    assert_eq!(st.num_invalid_frees, 0);
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes[0].current, 0);
}

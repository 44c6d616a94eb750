//! Driver calls are made with no lock held that allocation needs: a driver that, inside each
//! call, has another thread allocate (through the slow path, which takes every lock of the
//! allocator) and read the statistics would otherwise wait forever.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tensoralloc::config::Config;
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::driver::{Driver, Event, MemInfo, Stream};
use tensoralloc::host::HostAllocator;
use tensoralloc::Result;

/// Forwards to the simulated driver, first proving from another thread that the allocator
/// can still allocate, free and report statistics.
struct Probing {
    inner: Arc<SimDriver>,
    host: OnceLock<&'static HostAllocator>,
    probing: AtomicBool,
    probes: AtomicU64,
    next_size: AtomicU64,
}

impl Probing {
    fn probe(&self, call: &str) {
        let Some(&host) = self.host.get() else { return };
        // The probe's own driver calls are not probed.
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        // A size no cached block serves, so the probe takes the slow path and every lock.
        let size = 1usize << (16 + self.next_size.fetch_add(1, Ordering::Relaxed) % 8);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = host.stats();
            let b = host.malloc(size).unwrap();
            host.free(b.ptr, Some(b.ctx)).unwrap();
            let _ = tx.send(());
        });
        let finished = rx.recv_timeout(Duration::from_secs(20)).is_ok();
        self.probing.store(false, Ordering::Release);
        assert!(finished, "allocation blocked while the driver ran {call}");
        self.probes.fetch_add(1, Ordering::Relaxed);
    }
}

impl Driver for Probing {
    fn name(&self) -> &'static str {
        "probing"
    }
    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }
    fn mem_alloc(&self, device: usize, size: usize) -> Result<usize> {
        self.inner.mem_alloc(device, size)
    }
    fn mem_free(&self, device: usize, ptr: usize) -> Result<()> {
        self.inner.mem_free(device, ptr)
    }
    fn mem_info(&self, device: usize) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }
    fn event_create(&self, device: usize) -> Result<Event> {
        self.probe("event_create");
        self.inner.event_create(device)
    }
    fn event_destroy(&self, device: usize, event: Event) -> Result<()> {
        self.probe("event_destroy");
        self.inner.event_destroy(device, event)
    }
    fn event_record(&self, device: usize, event: Event, stream: Stream) -> Result<()> {
        self.probe("event_record");
        self.inner.event_record(device, event, stream)
    }
    fn event_query(&self, device: usize, event: Event) -> Result<bool> {
        self.probe("event_query");
        self.inner.event_query(device, event)
    }
    fn event_synchronize(&self, device: usize, event: Event) -> Result<()> {
        self.inner.event_synchronize(device, event)
    }
    fn stream_device(&self, stream: Stream) -> Result<usize> {
        self.probe("stream_device");
        self.inner.stream_device(stream)
    }
    fn host_alloc(&self, size: usize) -> Result<usize> {
        self.probe("host_alloc");
        self.inner.host_alloc(size)
    }
    fn host_free(&self, ptr: usize) -> Result<()> {
        self.probe("host_free");
        self.inner.host_free(ptr)
    }
    fn host_register(&self, ptr: usize, size: usize) -> Result<()> {
        self.probe("host_register");
        self.inner.host_register(ptr, size)
    }
    fn host_unregister(&self, ptr: usize) -> Result<()> {
        self.probe("host_unregister");
        self.inner.host_unregister(ptr)
    }
}

#[test]
fn no_driver_call_is_made_while_holding_a_lock_that_allocation_needs() {
    for register in [false, true] {
        let driver = Arc::new(Probing {
            inner: SimDriver::shared(1, 1 << 30).unwrap(),
            host: OnceLock::new(),
            probing: AtomicBool::new(false),
            probes: AtomicU64::new(0),
            next_size: AtomicU64::new(0),
        });
        let config = Config {
            pinned_use_host_register: register,
            ..Config::default()
        };
        // Leaked: the driver refers back to the allocator for the whole test.
        let host: &'static HostAllocator =
            Box::leak(Box::new(HostAllocator::new(driver.clone(), &config)));
        driver.host.set(host).ok().unwrap();
        let stream = if register { 0x5002 } else { 0x5001 };

        let a = host.malloc(4096).unwrap();
        assert!(host.record_event(a.ptr, Some(a.ctx), stream));
        sim::hold_stream(stream);
        host.free(a.ptr, Some(a.ctx)).unwrap();
        sim::release_stream(stream);
        host.empty_cache().unwrap();
        // Pinning, stream lookup, event creation and recording, and unpinning were probed.
        assert!(
            driver.probes.load(Ordering::Relaxed) >= 5,
            "{}",
            driver.probes.load(Ordering::Relaxed)
        );
    }
}

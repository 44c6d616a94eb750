//! Driver calls are made with no lock held that allocation needs: a driver that, inside each
//! call, has another thread allocate (through the slow path, which takes every lock of the
//! allocator) and read the statistics would otherwise wait forever.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tensoralloc::config::Config;
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::host::HostAllocator;
use tensoralloc::Result;

#[path = "support/hooked.rs"]
mod hooked;

use hooked::{Call, Hook, Hooked};

/// A hook on the simulated driver that, before a call, proves from another thread that the
/// allocator can still allocate, free and report statistics.
struct Probing {
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

impl Hook for Probing {
    fn before(&self, call: Call) -> Result<()> {
        let unprobed = matches!(
            call,
            Call::MemAlloc { .. } | Call::MemFree { .. } | Call::EventSynchronize
        );
        if !unprobed {
            self.probe(call.name());
        }
        Ok(())
    }
}

#[test]
fn no_driver_call_is_made_while_holding_a_lock_that_allocation_needs() {
    for register in [false, true] {
        let driver = Arc::new(Hooked {
            sim: SimDriver::shared(1, 1 << 30).unwrap(),
            hook: Probing {
                host: OnceLock::new(),
                probing: AtomicBool::new(false),
                probes: AtomicU64::new(0),
                next_size: AtomicU64::new(0),
            },
        });
        let config = Config {
            pinned_use_host_register: register,
            ..Config::default()
        };
        // Leaked: the driver refers back to the allocator for the whole test.
        let host: &'static HostAllocator =
            Box::leak(Box::new(HostAllocator::new(driver.clone(), &config)));
        driver.hook.host.set(host).ok().unwrap();
        let stream = if register { 0x5002 } else { 0x5001 };

        let a = host.malloc(4096).unwrap();
        assert!(host.record_event(a.ptr, Some(a.ctx), stream));
        sim::hold_stream(stream);
        host.free(a.ptr, Some(a.ctx)).unwrap();
        sim::release_stream(stream);
        host.empty_cache().unwrap();
        // Pinning, stream lookup, event creation and recording, and unpinning were probed.
        assert!(
            driver.hook.probes.load(Ordering::Relaxed) >= 5,
            "{}",
            driver.hook.probes.load(Ordering::Relaxed)
        );
    }
}

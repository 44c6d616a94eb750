//! Bad input to the pinned-host allocator: double frees, unknown and interior pointers, wrong
//! contexts, and driver failures. Each is reported and leaves the allocator intact.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::host::HostAllocator;
use tensoralloc::{Error, Result};

#[path = "support/hooked.rs"]
mod hooked;

use hooked::{Call, Hook, Hooked};

fn setup() -> (Arc<SimDriver>, HostAllocator) {
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let host = HostAllocator::new(sim.clone(), &Config::default());
    (sim, host)
}

#[test]
fn a_double_free_is_reported_and_changes_nothing() {
    let (_sim, host) = setup();
    let a = host.malloc(4096).unwrap();
    let keep = host.malloc(4096).unwrap();
    host.free(a.ptr, Some(a.ctx)).unwrap();
    let before = host.stats();
    let e = host.free(a.ptr, Some(a.ctx)).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer(_)), "{e}");
    assert!(e.message().contains("double free"), "{e}");
    assert!(matches!(
        host.free(a.ptr, None),
        Err(Error::UnknownPointer(_))
    ));
    assert_eq!(host.stats(), before);
    // The block was cached once, so it is handed out once.
    let b = host.malloc(4096).unwrap();
    let c = host.malloc(4096).unwrap();
    assert_eq!(b.ptr, a.ptr);
    assert_ne!(c.ptr, a.ptr);
    for x in [b, c, keep] {
        host.free(x.ptr, None).unwrap();
    }
}

#[test]
fn freeing_an_unknown_pointer_is_reported_and_changes_nothing() {
    let (sim, host) = setup();
    let a = host.malloc(4096).unwrap();
    let before = host.stats();
    let mut local = [0u8; 16];
    let e = host.free(local.as_mut_ptr() as usize, None).unwrap_err();
    assert!(matches!(e, Error::UnknownPointer(_)), "{e}");
    assert!(matches!(
        host.free(0x1000, None),
        Err(Error::UnknownPointer(_))
    ));
    assert!(matches!(
        host.free(usize::MAX, Some(usize::MAX)),
        Err(Error::UnknownPointer(_))
    ));
    assert_eq!(host.stats(), before);
    assert_eq!(sim.counters.host_free.load(Ordering::Relaxed), 0);
    host.free(a.ptr, None).unwrap();
}

#[test]
fn freeing_inside_a_block_is_an_unknown_pointer() {
    let (_sim, host) = setup();
    let a = host.malloc(4096).unwrap();
    assert!(matches!(
        host.free(a.ptr + 8, Some(a.ctx)),
        Err(Error::UnknownPointer(_))
    ));
    assert_eq!(host.stats().allocations.current, 1);
    host.free(a.ptr, None).unwrap();
}

#[test]
fn free_with_another_blocks_context_frees_the_block_at_the_address() {
    let (_sim, host) = setup();
    let a = host.malloc(4096).unwrap();
    let b = host.malloc(4096).unwrap();
    host.free(a.ptr, Some(b.ctx)).unwrap();
    assert_eq!(host.stats().allocations.current, 1);
    // `b` is still allocated.
    assert!(host.record_event(b.ptr, Some(b.ctx), 0x2001));
    host.free(b.ptr, Some(b.ctx)).unwrap();
}

/// A hook on the simulated driver that can make pinning and event recording fail.
struct Flaky {
    fail_pin: AtomicBool,
    fail_record: AtomicBool,
    /// Registrations allowed before they start failing.
    registrations_left: AtomicU64,
}

impl Hook for Flaky {
    fn before(&self, call: Call) -> Result<()> {
        match call {
            Call::EventRecord { .. } if self.fail_record.load(Ordering::Relaxed) => Err(
                Error::Driver("CUDA_ERROR_INVALID_HANDLE: bad stream".into()),
            ),
            Call::HostAlloc { .. } if self.fail_pin.load(Ordering::Relaxed) => {
                Err(Error::OutOfMemory("no pinned memory left".into()))
            }
            Call::HostRegister { .. } => {
                let left = self.registrations_left.load(Ordering::Relaxed);
                if left == 0 {
                    return Err(Error::Driver(
                        "CUDA_ERROR_OUT_OF_MEMORY: cannot lock pages".into(),
                    ));
                }
                self.registrations_left.store(left - 1, Ordering::Relaxed);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn flaky_with(config: &Config) -> (Arc<Hooked<Flaky>>, HostAllocator) {
    let driver = Arc::new(Hooked {
        sim: SimDriver::shared(1, 1 << 30).unwrap(),
        hook: Flaky {
            fail_pin: false.into(),
            fail_record: false.into(),
            registrations_left: u64::MAX.into(),
        },
    });
    let host = HostAllocator::new(driver.clone(), config);
    (driver, host)
}

fn flaky() -> (Arc<Hooked<Flaky>>, HostAllocator) {
    flaky_with(&Config::default())
}

#[test]
fn out_of_pinned_memory_empties_the_cache_and_retries_before_failing() {
    let (driver, host) = flaky();
    let a = host.malloc(1 << 16).unwrap();
    host.free(a.ptr, None).unwrap();
    driver.hook.fail_pin.store(true, Ordering::Relaxed);
    let e = host.malloc(1 << 20).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    // The retry returned the cached block to the driver first.
    assert_eq!(driver.sim.counters.host_free.load(Ordering::Relaxed), 1);
    let s = host.stats();
    assert_eq!((s.allocations.current, s.reserved_bytes.current), (0, 0));
    driver.hook.fail_pin.store(false, Ordering::Relaxed);
    let b = host.malloc(1 << 20).unwrap();
    host.free(b.ptr, None).unwrap();
}

#[test]
fn a_block_whose_event_cannot_be_recorded_is_never_reused() {
    let (driver, host) = flaky();
    let a = host.malloc(4096).unwrap();
    host.record_event(a.ptr, None, 0x2101);
    driver.hook.fail_record.store(true, Ordering::Relaxed);
    let e = host.free(a.ptr, None).unwrap_err();
    assert!(matches!(e, Error::Driver(_)), "{e}");
    driver.hook.fail_record.store(false, Ordering::Relaxed);
    let b = host.malloc(4096).unwrap();
    assert_ne!(b.ptr, a.ptr);
    host.empty_cache().unwrap();
    assert_eq!(host.stats().active_blocks.current, 2);
    // The failed free freed the allocation as far as the caller is concerned.
    assert_eq!(host.stats().allocations.current, 1);
    host.free(b.ptr, None).unwrap();
}

#[test]
fn a_failed_registration_undoes_the_chunks_already_registered() {
    let config = Config {
        pinned_use_host_register: true,
        ..Config::default()
    };
    let (driver, host) = flaky_with(&config);
    let host = host.with_register_chunk(1 << 20);
    driver.hook.registrations_left.store(2, Ordering::Relaxed);
    let e = host.malloc(4 << 20).unwrap_err();
    assert!(matches!(e, Error::Driver(_)), "{e}");
    let c = &driver.sim.counters;
    assert_eq!(c.host_register.load(Ordering::Relaxed), 2);
    assert_eq!(c.host_unregister.load(Ordering::Relaxed), 2);
    let s = host.stats();
    assert_eq!(
        (
            s.reserved_bytes.current,
            s.allocations.current,
            s.driver_allocations
        ),
        (0, 0, 0)
    );
    driver
        .hook
        .registrations_left
        .store(u64::MAX, Ordering::Relaxed);
    let a = host.malloc(4 << 20).unwrap();
    host.free(a.ptr, None).unwrap();
}

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
use tensoralloc::driver::Stream;

#[path = "support/hooked.rs"]
mod hooked;

use hooked::{Call, Hook, Hooked};

const MIB: usize = 1 << 20;
const STREAM_A: Stream = 0x5e9_0a00;
const STREAM_B: Stream = 0x5e9_0b00;

/// A hook on the simulated driver: after the driver frees the address in `reuse_at`, has
/// another thread allocate `reuse_size` bytes on stream B and keeps what it got in `reused`.
struct Reusing {
    alloc: OnceLock<Arc<DeviceAllocator>>,
    reuse_at: AtomicUsize,
    reuse_size: usize,
    reused: Mutex<Option<usize>>,
}

impl Hook for Reusing {
    fn after(&self, call: Call) {
        let Call::MemFree { ptr } = call else { return };
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

#[test]
fn a_segment_another_stream_gets_back_at_once_stays_freeable() {
    let driver = Arc::new(Hooked {
        sim: SimDriver::shared(1, (1 << 30) as u64).unwrap(),
        hook: Reusing {
            alloc: OnceLock::new(),
            reuse_at: AtomicUsize::new(0),
            reuse_size: 20 * MIB,
            reused: Mutex::new(None),
        },
    });
    let a = Arc::new(DeviceAllocator::new(driver.clone(), 0, &Config::default()).unwrap());
    assert!(driver.hook.alloc.set(a.clone()).is_ok());
    // Stream B's shard comes first (the cache is emptied in shard order) and once held what it
    // gets back below, so it allocates there without settling peaks against stream A's shard,
    // whose lock the freeing thread holds.
    let small = a.malloc(512, STREAM_B).unwrap();
    let p = a.malloc(20 * MIB, STREAM_A).unwrap();
    let b = a.malloc(20 * MIB, STREAM_B).unwrap();
    a.free(p, Some(STREAM_A)).unwrap();
    a.free(b, Some(STREAM_B)).unwrap();
    driver.hook.reuse_at.store(p, Ordering::Release);
    a.empty_cache().unwrap();

    let q = driver
        .hook
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

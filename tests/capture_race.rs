//! Once allocation to a private pool has begun (PyTorch's `beginAllocateToPool`, just before a
//! CUDA graph capture starts), no driver call that a capture forbids may be made for the
//! allocator: no memory freed, no event queried, waited for or recorded, however other
//! threads were emptying the cache, polling events or freeing memory when it began.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[path = "support/hooked.rs"]
mod hooked;

use hooked::{Call, Hook, Hooked};
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::Result;

const MIB: usize = 1 << 20;
const RELEASING: usize = 0x7c0_0100;
const SIDE: usize = 0x7c0_0200;
const CAPTURED: usize = 0x7c0_0300;
const CAPTURES: u64 = 60;

/// Counts the calls a capture forbids that are made while the test says a capture runs;
/// slows every free of memory down, so that a release under way when a capture begins is
/// still under way after `begin_allocate_to_pool` returns unless that waits for it.
#[derive(Default)]
struct CaptureWatch {
    capturing: AtomicBool,
    forbidden: Mutex<Vec<Call>>,
}

impl Hook for CaptureWatch {
    fn before(&self, call: Call) -> Result<()> {
        let forbidden = matches!(
            call,
            Call::MemFree { .. }
                | Call::EventQuery
                | Call::EventSynchronize
                | Call::EventRecord { .. }
        );
        if forbidden && self.capturing.load(SeqCst) {
            self.forbidden.lock().unwrap().push(call);
        }
        if let Call::MemFree { .. } = call {
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}

#[test]
fn nothing_a_capture_forbids_happens_after_allocation_to_a_pool_begins() {
    let driver = Arc::new(Hooked {
        sim: SimDriver::shared(1, 1 << 40).unwrap(),
        hook: CaptureWatch::default(),
    });
    let a = Arc::new(DeviceAllocator::new(driver.clone(), 0, &Config::default()).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    // Fills the cache with many segments, some used by a side stream (so their frees wait for
    // events), and empties it, over and over.
    let releaser = {
        let (a, done) = (a.clone(), done.clone());
        std::thread::spawn(move || {
            let mut rounds = 0usize;
            while !done.load(SeqCst) || rounds < 20 {
                let blocks: Vec<usize> = (0..24)
                    .map(|k| a.malloc((3 + k % 5) * MIB, RELEASING).unwrap())
                    .collect();
                for (k, &b) in blocks.iter().enumerate() {
                    if k % 3 == 0 {
                        a.record_stream(b, SIDE).unwrap();
                    }
                    a.free(b, None).unwrap();
                }
                a.poll_events();
                a.empty_cache().unwrap();
                rounds += 1;
            }
            rounds
        })
    };
    for pool in 1..=CAPTURES {
        let id = (pool, 1);
        a.begin_allocate_to_pool(id, Some(Arc::new(|s| s == CAPTURED)))
            .unwrap();
        driver.hook.capturing.store(true, SeqCst);
        let p = a.malloc(MIB, CAPTURED).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        a.free(p, None).unwrap();
        driver.hook.capturing.store(false, SeqCst);
        a.end_allocate_to_pool(id).unwrap();
        a.release_pool(id).unwrap();
        std::thread::sleep(Duration::from_micros(500));
    }
    done.store(true, SeqCst);
    let rounds = releaser.join().unwrap();
    assert!(rounds >= 20, "the releasing thread made {rounds} rounds");
    let forbidden = driver.hook.forbidden.lock().unwrap();
    assert!(
        forbidden.is_empty(),
        "{} forbidden driver calls during {} captures: {:?}",
        forbidden.len(),
        CAPTURES,
        [
            "mem_free",
            "event_query",
            "event_synchronize",
            "event_record"
        ]
        .map(|name| {
            let n = forbidden.iter().filter(|c| c.name() == name).count();
            format!("{name} {n}")
        })
    );
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes[0].current, 0);
}

//! Many threads on one pinned-host allocator: no block is ever handed to two holders, frees
//! from other threads land correctly, and the statistics add up afterwards.

mod host_support;

use host_support::setup;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Mutex};

use tensoralloc::driver::sim::{self};
use tensoralloc::host::HostBlock;

#[test]
fn many_threads_never_share_a_live_block() {
    for register in [false, true] {
        let (_sim, host) = setup(register);
        let live = Mutex::new(HashSet::new());
        std::thread::scope(|s| {
            for t in 0..8usize {
                let (host, live) = (&host, &live);
                s.spawn(move || {
                    let mut held: Vec<HostBlock> = Vec::new();
                    for i in 0..2000usize {
                        if held.len() < 8 && (i * 7 + t) % 3 != 0 {
                            let size = 512 << ((i + t) % 6);
                            let b = host.malloc(size).unwrap();
                            assert!(live.lock().unwrap().insert(b.ptr), "block handed out twice");
                            // SAFETY: `b` is a live block of at least `size` bytes owned here.
                            unsafe { (b.ptr as *mut u8).write_bytes(t as u8, size) };
                            held.push(b);
                        } else if let Some(b) = held.pop() {
                            assert!(live.lock().unwrap().remove(&b.ptr));
                            host.free(b.ptr, Some(b.ctx)).unwrap();
                        }
                    }
                    for b in held {
                        assert!(live.lock().unwrap().remove(&b.ptr));
                        host.free(b.ptr, None).unwrap();
                    }
                });
            }
        });
        let s = host.stats();
        assert_eq!(s.allocations.current, 0);
        assert_eq!(s.active_blocks.current, 0);
        assert_eq!(s.allocated_bytes.current, 0);
        assert!(s.allocations.peak <= 64 && s.allocations.peak >= 1);
        host.empty_cache().unwrap();
        assert_eq!(host.stats().reserved_bytes.current, 0);
    }
}

#[test]
fn blocks_allocated_on_one_thread_and_freed_on_another_are_recycled() {
    let (sim, host) = setup(false);
    let (tx, rx) = mpsc::sync_channel::<HostBlock>(4);
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..5000 {
                tx.send(host.malloc(4096).unwrap()).unwrap();
            }
            drop(tx);
        });
        s.spawn(|| {
            for b in rx {
                host.free(b.ptr, Some(b.ctx)).unwrap();
            }
        });
    });
    let s = host.stats();
    assert_eq!(s.allocations.current, 0);
    assert!(s.allocations.peak <= 8, "peak {}", s.allocations.peak);
    // The cache kept up: only the blocks in flight at once were ever pinned.
    assert!(sim.counters.host_alloc.load(Ordering::Relaxed) <= 8);
}

#[test]
fn concurrent_double_frees_free_a_block_once() {
    let (_sim, host) = setup(false);
    for _ in 0..200 {
        let a = host.malloc(4096).unwrap();
        let oks = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| host.free(a.ptr, None).is_ok()))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&ok| ok)
                .count()
        });
        assert_eq!(oks, 1);
    }
    let s = host.stats();
    assert_eq!(s.allocations.current, 0);
    assert_eq!(s.cached_blocks, 1);
}

#[test]
fn streams_used_from_many_threads_defer_and_then_release_every_block() {
    let (_sim, host) = setup(false);
    let streams: Vec<usize> = (0..4).map(|i| 0x3000 + i).collect();
    for &s in &streams {
        sim::hold_stream(s);
    }
    std::thread::scope(|sc| {
        for &stream in &streams {
            let host = &host;
            sc.spawn(move || {
                for _ in 0..50 {
                    let b = host.malloc(8192).unwrap();
                    assert!(host.record_event(b.ptr, Some(b.ctx), stream));
                    host.free(b.ptr, Some(b.ctx)).unwrap();
                }
            });
        }
    });
    assert_eq!(host.stats().active_blocks.current, 200);
    assert_eq!(host.stats().driver_allocations, 200);
    for &s in &streams {
        sim::release_stream(s);
    }
    host.empty_cache().unwrap();
    let s = host.stats();
    assert_eq!(s.active_blocks.current, 0);
    assert_eq!(s.reserved_bytes.current, 0);
}

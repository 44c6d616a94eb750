//! The pinned-host cache: rounding, reuse, best fit, empty_cache and statistics, in both
//! pinning modes (driver allocation and registration of ordinary pages).

mod host_support;

use host_support::setup;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::host::HostAllocator;
use tensoralloc::Error;

/// Driver pinning calls so far: allocations (or registrations) and frees (or unregistrations).
fn pins(sim: &SimDriver) -> (u64, u64) {
    let c = &sim.counters;
    (
        c.host_alloc.load(Ordering::Relaxed) + c.host_register.load(Ordering::Relaxed),
        c.host_free.load(Ordering::Relaxed) + c.host_unregister.load(Ordering::Relaxed),
    )
}

fn both_modes(test: impl Fn(Arc<SimDriver>, HostAllocator)) {
    for register in [false, true] {
        let (sim, host) = setup(register);
        assert_eq!(host.uses_host_register(), register);
        test(sim, host);
    }
}

#[test]
fn requests_are_rounded_up_to_a_power_of_two() {
    both_modes(|_, host| {
        let a = host.malloc(5000).unwrap();
        let s = host.stats();
        assert_eq!(s.allocated_bytes.current, 8192);
        assert_eq!(s.reserved_bytes.current, 8192);
        host.free(a.ptr, Some(a.ctx)).unwrap();
        host.empty_cache().unwrap();
        let b = host.malloc(1).unwrap();
        assert_eq!(host.stats().allocated_bytes.current, 1);
        let c = host.malloc(4097).unwrap();
        assert_eq!(host.stats().allocated_bytes.current, 1 + 8192);
        host.free(c.ptr, None).unwrap();
        host.free(b.ptr, None).unwrap();
    });
}

#[test]
fn pinned_memory_is_writable_over_its_whole_rounded_size() {
    both_modes(|_, host| {
        let a = host.malloc(3 * 4096 + 5).unwrap();
        // SAFETY: the block is 16 KiB (rounded) of host memory owned by this test until freed.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut u8, 16384) };
        bytes.fill(0xA5);
        assert!(bytes.iter().all(|&b| b == 0xA5));
        host.free(a.ptr, Some(a.ctx)).unwrap();
    });
}

#[test]
fn a_freed_block_is_reused_without_pinning_again() {
    both_modes(|sim, host| {
        let a = host.malloc(4096).unwrap();
        host.free(a.ptr, Some(a.ctx)).unwrap();
        let before = pins(&sim);
        for _ in 0..100 {
            let b = host.malloc(3000).unwrap();
            assert_eq!(b.ptr, a.ptr);
            host.free(b.ptr, Some(b.ctx)).unwrap();
        }
        assert_eq!(pins(&sim), before);
        assert_eq!(host.stats().driver_allocations, 1);
    });
}

#[test]
fn a_larger_free_block_serves_a_smaller_request() {
    both_modes(|sim, host| {
        let big = host.malloc(1 << 20).unwrap();
        host.free(big.ptr, None).unwrap();
        let small = host.malloc(4096).unwrap();
        assert_eq!(small.ptr, big.ptr);
        assert_eq!(pins(&sim).0, 1);
        assert_eq!(host.stats().allocated_bytes.current, 1 << 20);
        host.free(small.ptr, None).unwrap();
    });
}

#[test]
fn best_fit_prefers_the_smallest_block_then_the_lowest_address() {
    both_modes(|_, host| {
        let big = host.malloc(1 << 20).unwrap();
        let mut mids: Vec<_> = (0..3).map(|_| host.malloc(64 << 10).unwrap()).collect();
        let small = host.malloc(4096).unwrap();
        host.free(big.ptr, None).unwrap();
        for m in &mids {
            host.free(m.ptr, None).unwrap();
        }
        host.free(small.ptr, None).unwrap();
        mids.sort_by_key(|m| m.ptr);
        // 10 KiB rounds to 16 KiB: the 64 KiB blocks fit best, lowest address first.
        let got: Vec<_> = (0..3).map(|_| host.malloc(10 << 10).unwrap()).collect();
        assert_eq!(
            got.iter().map(|g| g.ptr).collect::<Vec<_>>(),
            mids.iter().map(|m| m.ptr).collect::<Vec<_>>()
        );
        let next = host.malloc(10 << 10).unwrap();
        assert_eq!(next.ptr, big.ptr);
        for g in got.iter().chain([&next]) {
            host.free(g.ptr, None).unwrap();
        }
    });
}

#[test]
fn a_block_freed_on_another_thread_is_reused() {
    both_modes(|sim, host| {
        let a = host.malloc(4096).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| host.free(a.ptr, Some(a.ctx)).unwrap());
        });
        let b = std::thread::scope(|s| s.spawn(|| host.malloc(4096).unwrap()).join().unwrap());
        assert_eq!(b.ptr, a.ptr);
        assert_eq!(pins(&sim).0, 1);
        host.free(b.ptr, None).unwrap();
    });
}

#[test]
fn zero_bytes_give_a_null_block_and_no_error() {
    both_modes(|sim, host| {
        let z = host.malloc(0).unwrap();
        assert_eq!((z.ptr, z.ctx), (0, 0));
        host.free(0, None).unwrap();
        assert_eq!(pins(&sim), (0, 0));
    });
}

#[test]
fn an_absurd_size_is_an_invalid_argument() {
    both_modes(|sim, host| {
        assert!(matches!(
            host.malloc(usize::MAX),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(pins(&sim), (0, 0));
    });
}

#[test]
fn empty_cache_returns_free_blocks_and_keeps_blocks_in_use() {
    both_modes(|sim, host| {
        let keep = host.malloc(4096).unwrap();
        let drop1 = host.malloc(8192).unwrap();
        let drop2 = host.malloc(1 << 16).unwrap();
        host.free(drop1.ptr, None).unwrap();
        host.free(drop2.ptr, None).unwrap();
        host.empty_cache().unwrap();
        assert_eq!(pins(&sim), (3, 2));
        let s = host.stats();
        assert_eq!(s.reserved_bytes.current, 4096);
        assert_eq!(s.cached_blocks, 0);
        assert_eq!(s.driver_frees, 2);
        // The kept block is still ours and still works.
        // SAFETY: `keep` is a live 4 KiB block owned by this test.
        unsafe { (keep.ptr as *mut u8).write_bytes(1, 4096) };
        host.free(keep.ptr, Some(keep.ctx)).unwrap();
        // Released addresses are forgotten.
        assert!(matches!(
            host.free(drop1.ptr, None),
            Err(Error::UnknownPointer(_))
        ));
    });
}

#[test]
fn after_empty_cache_a_request_pins_new_memory() {
    both_modes(|sim, host| {
        let a = host.malloc(4096).unwrap();
        host.free(a.ptr, None).unwrap();
        host.empty_cache().unwrap();
        let b = host.malloc(4096).unwrap();
        assert_eq!(pins(&sim), (2, 1));
        host.free(b.ptr, Some(b.ctx)).unwrap();
    });
}

#[test]
fn statistics_follow_allocations_and_frees() {
    both_modes(|_, host| {
        let a = host.malloc(4096).unwrap();
        let b = host.malloc(4096).unwrap();
        let c = host.malloc(1 << 20).unwrap();
        let s = host.stats();
        assert_eq!((s.allocations.current, s.allocations.peak), (3, 3));
        assert_eq!((s.active_blocks.current, s.active_blocks.peak), (3, 3));
        assert_eq!(s.allocated_bytes.current, 8192 + (1 << 20));
        assert_eq!(s.reserved_bytes.current, 8192 + (1 << 20));
        assert_eq!(s.driver_allocations, 3);
        assert!(s.pin_time_total >= s.pin_time_max);
        host.free(c.ptr, None).unwrap();
        host.free(b.ptr, None).unwrap();
        let s = host.stats();
        assert_eq!((s.allocations.current, s.allocations.peak), (1, 3));
        assert_eq!(
            (s.allocated_bytes.current, s.allocated_bytes.peak),
            (4096, 8192 + (1 << 20))
        );
        assert_eq!(s.reserved_bytes.current, 8192 + (1 << 20));
        assert_eq!(s.cached_blocks, 2);
        host.free(a.ptr, None).unwrap();
        assert_eq!(host.stats().allocations.current, 0);
    });
}

#[test]
fn reset_peak_stats_sets_peaks_to_current_values() {
    both_modes(|_, host| {
        let blocks: Vec<_> = (0..4).map(|_| host.malloc(4096).unwrap()).collect();
        for b in &blocks[1..] {
            host.free(b.ptr, None).unwrap();
        }
        host.empty_cache().unwrap();
        host.reset_peak_stats();
        let s = host.stats();
        assert_eq!(s.allocations.peak, 1);
        assert_eq!(s.allocated_bytes.peak, 4096);
        assert_eq!(s.active_blocks.peak, 1);
        assert_eq!(s.reserved_bytes.peak, 4096);
        // Peaks climb again from there.
        let more: Vec<_> = (0..2).map(|_| host.malloc(4096).unwrap()).collect();
        assert_eq!(host.stats().allocations.peak, 3);
        for b in more.iter().chain(&blocks[..1]) {
            host.free(b.ptr, None).unwrap();
        }
    });
}

#[test]
fn reset_accumulated_stats_zeroes_driver_counts_and_times() {
    both_modes(|_, host| {
        let a = host.malloc(4096).unwrap();
        host.free(a.ptr, None).unwrap();
        host.empty_cache().unwrap();
        let s = host.stats();
        assert_eq!((s.driver_allocations, s.driver_frees), (1, 1));
        host.reset_accumulated_stats();
        let s = host.stats();
        assert_eq!((s.driver_allocations, s.driver_frees), (0, 0));
        assert!(s.pin_time_total.is_zero() && s.pin_time_max.is_zero());
        assert!(s.unpin_time_total.is_zero() && s.unpin_time_max.is_zero());
    });
}

#[test]
fn peaks_count_blocks_held_at_once_across_threads() {
    both_modes(|_, host| {
        let barrier = std::sync::Barrier::new(5);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let mine: Vec<_> = (0..5).map(|_| host.malloc(4096).unwrap()).collect();
                    barrier.wait();
                    barrier.wait();
                    for b in mine {
                        host.free(b.ptr, Some(b.ctx)).unwrap();
                    }
                });
            }
            // All 20 are held between the two waits.
            barrier.wait();
            assert_eq!(host.stats().allocations.current, 20);
            barrier.wait();
        });
        let s = host.stats();
        assert_eq!(s.allocations.peak, 20);
        assert_eq!(s.allocated_bytes.peak, 20 * 4096);
        assert_eq!(s.allocations.current, 0);
    });
}

#[test]
fn without_power_of_two_rounding_sizes_round_to_pages() {
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let config = Config {
        pinned_round_power2: false,
        ..Config::default()
    };
    let host = HostAllocator::new(sim.clone(), &config);
    let a = host.malloc(5 * 4096 + 1).unwrap();
    assert_eq!(host.stats().allocated_bytes.current, 6 * 4096);
    host.free(a.ptr, None).unwrap();
    // A 7-page block does not fit in the cached 6-page one; a 5-page request reuses it.
    let b = host.malloc(7 * 4096).unwrap();
    assert_ne!(b.ptr, a.ptr);
    let c = host.malloc(5 * 4096).unwrap();
    assert_eq!(c.ptr, a.ptr);
    assert_eq!(pins(&sim).0, 2);
    host.free(b.ptr, None).unwrap();
    host.free(c.ptr, None).unwrap();
}

#[test]
fn dropping_the_allocator_returns_cached_blocks() {
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    {
        let host = HostAllocator::new(sim.clone(), &Config::default());
        let a = host.malloc(4096).unwrap();
        host.free(a.ptr, None).unwrap();
    }
    assert_eq!(pins(&sim), (1, 1));
}

#[test]
fn peaks_are_exact_when_threads_take_turns() {
    let (_sim, host) = setup(false);
    let on_new_thread = |n: usize| {
        std::thread::scope(|s| {
            s.spawn(|| {
                (0..n)
                    .map(|_| host.malloc(4096).unwrap())
                    .collect::<Vec<_>>()
            })
            .join()
            .unwrap()
        })
    };
    let first = on_new_thread(1);
    host.free(first[0].ptr, None).unwrap();
    let second = on_new_thread(1);
    assert_eq!(host.stats().allocations.peak, 1);
    let third = on_new_thread(1);
    assert_eq!(host.stats().allocations.peak, 2);
    for b in second.iter().chain(&third) {
        host.free(b.ptr, None).unwrap();
    }
    assert_eq!(host.stats().allocations.peak, 2);
    let fourth = on_new_thread(3);
    let s = host.stats();
    assert_eq!((s.allocations.current, s.allocations.peak), (3, 3));
    assert_eq!(s.allocated_bytes.peak, 3 * 4096);
    for b in fourth {
        host.free(b.ptr, None).unwrap();
    }
}

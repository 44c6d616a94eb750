//! Replaying cached malloc+free pairs (the shard's memo) changes nothing observable: the same
//! operations on an allocator that replays and on one that always takes the full path return
//! the same addresses and leave the same statistics (peaks and totals included) and the same
//! segments and blocks.

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::SimDriver;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn allocator(pair_memo: bool) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = SimDriver::shared(1, 4 << 30).unwrap();
    let mut a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
    a.set_pair_memo(pair_memo);
    (sim, a)
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The segments and blocks of `a`, with addresses as offsets from `base` (the simulated
/// devices of the two allocators lie at different addresses).
fn layout(a: &DeviceAllocator, base: usize) -> Vec<(usize, u64, u64, u64, Vec<String>)> {
    a.snapshot_segments()
        .iter()
        .map(|s| {
            (
                s.address as usize - base,
                s.total_size,
                s.allocated_size,
                s.stream,
                s.blocks
                    .iter()
                    .map(|b| {
                        format!(
                            "{} {} {} {}",
                            b.address as usize - base,
                            b.size,
                            b.requested_size,
                            b.state
                        )
                    })
                    .collect(),
            )
        })
        .collect()
}

/// Runs one seeded mix of operations on both allocators, comparing after every step.
fn run_both(seed: u64, steps: usize) -> u64 {
    let (_s1, memo) = allocator(true);
    let (_s2, full) = allocator(false);
    let streams = [0x7100usize, 0x7200, 0x7300];
    let sizes = [
        1,
        512,
        4 * KIB,
        4 * KIB + 1,
        100 * KIB,
        KIB * KIB - 512,
        KIB * KIB,
        3 * MIB,
        12 * MIB,
        25 * MIB,
    ];
    let mut x = seed;
    // Each device's first segment starts its address space.
    let first = (
        memo.malloc(1, streams[0]).unwrap(),
        full.malloc(1, streams[0]).unwrap(),
    );
    let offset = first.1.wrapping_sub(first.0);
    let mut live: Vec<(usize, usize)> = vec![(first.0, streams[0])];
    for step in 0..steps {
        let r = next(&mut x);
        let stream = streams[(r % 3) as usize];
        match (r >> 8) % 16 {
            // Pairs of one size, the case the memo serves, the last one perhaps kept.
            0..=6 => {
                let size = sizes[(r >> 16) as usize % sizes.len()];
                for i in 0..=(r >> 48) % 4 {
                    let (p, q) = (
                        memo.malloc(size, stream).unwrap(),
                        full.malloc(size, stream).unwrap(),
                    );
                    assert_eq!(p.wrapping_add(offset), q, "step {step}: malloc({size})");
                    if i > 0 || !(r >> 32).is_multiple_of(4) {
                        memo.free(p, Some(stream)).unwrap();
                        full.free(q, Some(stream)).unwrap();
                    } else {
                        live.push((p, stream));
                    }
                    assert_eq!(memo.stats(), full.stats(), "step {step}");
                }
            }
            // An allocation kept for a while.
            7..=9 => {
                let size = sizes[(r >> 16) as usize % sizes.len()] + (r >> 40) as usize % 3000;
                let (p, q) = (
                    memo.malloc(size, stream).unwrap(),
                    full.malloc(size, stream).unwrap(),
                );
                assert_eq!(p.wrapping_add(offset), q, "step {step}: malloc({size})");
                live.push((p, stream));
            }
            // A free with the right stream, a wrong one, or none.
            10..=12 if !live.is_empty() => {
                let (p, s) = live.swap_remove((r >> 16) as usize % live.len());
                let hint = match (r >> 32) % 3 {
                    0 => Some(s),
                    1 => Some(stream),
                    _ => None,
                };
                memo.free(p, hint).unwrap();
                full.free(p.wrapping_add(offset), hint).unwrap();
            }
            // Another stream uses a live allocation.
            13 if !live.is_empty() => {
                let (p, _) = live[(r >> 16) as usize % live.len()];
                memo.record_stream(p, stream).unwrap();
                full.record_stream(p.wrapping_add(offset), stream).unwrap();
            }
            14 if (r >> 16).is_multiple_of(8) => {
                memo.empty_cache().unwrap();
                full.empty_cache().unwrap();
            }
            15 if (r >> 16).is_multiple_of(4) => {
                memo.reset_peak_stats();
                full.reset_peak_stats();
            }
            _ => {
                if let Some(&(p, _)) = live.first() {
                    assert!(memo.is_allocated(p));
                    assert!(full.is_allocated(p.wrapping_add(offset)));
                }
            }
        }
        assert_eq!(memo.stats(), full.stats(), "step {step}");
        if step % 16 == 0 {
            assert_eq!(
                layout(&memo, first.0),
                layout(&full, first.1),
                "step {step}"
            );
        }
    }
    for (p, s) in live {
        memo.free(p, Some(s)).unwrap();
        full.free(p.wrapping_add(offset), Some(s)).unwrap();
    }
    assert_eq!(memo.stats(), full.stats());
    assert_eq!(full.pair_memo_hits(), 0);
    memo.pair_memo_hits()
}

#[test]
fn replayed_pairs_return_the_same_addresses_and_statistics_as_the_full_path() {
    let mut hits = 0;
    for seed in 1..=6u64 {
        hits += run_both(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 1500);
    }
    // The memo served a good share of the pairs (counted in debug builds, where tests run).
    if cfg!(debug_assertions) {
        assert!(hits > 2000, "only {hits} mallocs were replayed");
    }
}

#[test]
fn a_repeated_pair_is_replayed_and_keeps_exact_peaks() {
    let (_sim, a) = allocator(true);
    let s = 0x7400;
    for _ in 0..100 {
        let p = a.malloc(4096, s).unwrap();
        a.free(p, Some(s)).unwrap();
    }
    let keep = a.malloc(8192, s).unwrap();
    let p = a.malloc(4096, s).unwrap();
    let st = a.stats();
    assert_eq!(st.allocated_bytes[0].current, 8192 + 4096);
    assert_eq!(st.allocated_bytes[0].peak, 8192 + 4096);
    assert_eq!(st.allocation[0].allocated, 102);
    a.free(p, Some(s)).unwrap();
    a.free(keep, Some(s)).unwrap();
    let st = a.stats();
    assert_eq!(st.allocation[0].freed, 102);
    assert_eq!(st.allocated_bytes[0].current, 0);
    if cfg!(debug_assertions) {
        assert!(a.pair_memo_hits() >= 98);
    }
}

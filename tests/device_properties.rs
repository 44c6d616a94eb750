//! Random operation sequences against the caching device allocator: live allocations never
//! overlap, statistics match a model of what is live, and everything returns to the driver.

use std::sync::Arc;

use proptest::prelude::*;
use tensoralloc::config::Config;
use tensoralloc::device::size::round_size;
use tensoralloc::device::stats::{DeviceStats, Stat};
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::{SimConfig, SimDriver};

#[derive(Debug, Clone)]
enum Op {
    Malloc { size: usize, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        1usize..2048,
        2048usize..(1 << 20),
        (1usize << 20)..(12 << 20),
        (12usize << 20)..(40 << 20),
    ];
    prop_oneof![
        6 => (size, 0usize..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => Just(Op::EmptyCache),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_allocations_disjoint_and_stats_exact(ops in proptest::collection::vec(op(), 1..200)) {
        let sim = Arc::new(SimDriver::new(SimConfig { devices: 1, capacity: 256 << 20, backed: false }).unwrap());
        let a = DeviceAllocator::new(sim.clone(), 0, &Config::default()).unwrap();
        let streams = [0x10usize, 0x20, 0x30];
        let mut live: Vec<(usize, usize, usize)> = Vec::new(); // (ptr, size, stream)
        let mut peak_bytes = 0i64;
        let mut shared = false;
        for op in ops {
            match op {
                Op::Malloc { size, stream } => match a.malloc(size, streams[stream]) {
                    Ok(p) => {
                        let r = round_size(size);
                        for &(q, qs, _) in &live {
                            let qr = round_size(qs);
                            prop_assert!(p + r <= q || q + qr <= p, "{p:#x}+{r} overlaps {q:#x}+{qr}");
                        }
                        live.push((p, size, streams[stream]));
                    }
                    Err(e) => prop_assert!(matches!(e, tensoralloc::Error::OutOfMemory(_)), "{e}"),
                },
                Op::Free { pick } if !live.is_empty() => {
                    let (p, _, s) = live.swap_remove(pick % live.len());
                    a.free(p, Some(s)).unwrap();
                }
                Op::RecordStream { pick, stream } if !live.is_empty() => {
                    let (p, _, _) = live[pick % live.len()];
                    a.record_stream(p, streams[stream]).unwrap();
                    shared = true;
                }
                Op::EmptyCache => a.empty_cache().unwrap(),
                _ => {}
            }
            let s = a.stats();
            let bytes: i64 = live.iter().map(|&(_, n, _)| round_size(n) as i64).sum();
            let requested: i64 = live.iter().map(|&(_, n, _)| n as i64).sum();
            peak_bytes = peak_bytes.max(bytes);
            prop_assert_eq!(s.allocation[0].current, live.len() as i64);
            prop_assert_eq!(s.allocation[0].current, s.allocation[1].current + s.allocation[2].current);
            prop_assert!(s.allocated_bytes[0].current <= bytes.max(0) + live.len() as i64 * (20 << 20));
            prop_assert!(s.allocated_bytes[0].current >= bytes);
            // Blocks freed while another stream uses them stay requested until its work is
            // done (PyTorch's rule), as they stay active.
            if shared {
                prop_assert!(s.requested_bytes[0].current >= requested);
                prop_assert!(s.requested_bytes[0].current <= s.active_bytes[0].current);
            } else {
                prop_assert_eq!(s.requested_bytes[0].current, requested);
            }
            prop_assert!(s.allocated_bytes[0].peak >= peak_bytes);
            prop_assert!(s.reserved_bytes[0].current >= s.active_bytes[0].current);
            prop_assert!(s.active_bytes[0].current >= s.allocated_bytes[0].current);
            prop_assert_eq!(s.reserved_bytes[0].current as u64, sim.used(0));
            prop_assert_eq!(s.allocation[0].allocated - s.allocation[0].freed, s.allocation[0].current);
        }
        for (p, _, s) in live.drain(..) {
            a.free(p, Some(s)).unwrap();
        }
        a.empty_cache().unwrap();
        let s = a.stats();
        prop_assert_eq!(s.active_bytes[0].current, 0);
        prop_assert_eq!(s.requested_bytes[0].current, 0);
        prop_assert_eq!(s.inactive_split[0].current, 0);
        prop_assert_eq!(s.reserved_bytes[0].current, 0);
        prop_assert_eq!(sim.used(0), 0);
    }
}

/// One turn of a stream: free some of what is live (on any stream), allocate a batch, free
/// all but `keep` of the batch.
#[derive(Debug, Clone)]
struct Turn {
    stream: usize,
    frees: Vec<usize>,
    sizes: Vec<usize>,
    keep: usize,
    reset_peaks: bool,
    /// Empty the cache first: streams that hold nothing give up their headroom.
    empty_cache: bool,
}

fn turn() -> impl Strategy<Value = Turn> {
    let size = prop_oneof![
        1usize..4096,
        4096usize..(2 << 20),
        (2usize << 20)..(24 << 20)
    ];
    (
        0usize..4,
        proptest::collection::vec(any::<usize>(), 0..3),
        proptest::collection::vec(size, 1..12),
        0usize..3,
        proptest::bool::weighted(0.05),
        proptest::bool::weighted(0.15),
    )
        .prop_map(
            |(stream, frees, sizes, keep, reset_peaks, empty_cache)| Turn {
                stream,
                frees,
                sizes,
                keep,
                reset_peaks,
                empty_cache,
            },
        )
}

/// Statistics whose value moves one way within a single malloc or free, so their exact peak
/// is the highest value seen between operations; `field` picks current or peak.
fn monotone(s: &DeviceStats, field: fn(&Stat) -> i64) -> [i64; 12] {
    let arrays = [
        &s.allocation,
        &s.allocated_bytes,
        &s.requested_bytes,
        &s.active_bytes,
    ];
    std::array::from_fn(|i| field(&arrays[i / 3][i % 3]))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Streams that take turns holding memory (one thread, PyTorch's producer/consumer
    /// pattern) move headroom between shards on every turn; device-wide peaks stay the exact
    /// highest totals after every operation.
    #[test]
    fn peaks_stay_exact_when_streams_take_turns(turns in proptest::collection::vec(turn(), 1..60)) {
        let sim = Arc::new(SimDriver::new(SimConfig { devices: 1, capacity: 1 << 30, backed: false }).unwrap());
        let a = DeviceAllocator::new(sim, 0, &Config::default()).unwrap();
        let streams = [0x10usize, 0x20, 0x30, 0x40];
        let mut live: Vec<(usize, usize)> = Vec::new(); // (ptr, stream)
        let mut high = [0i64; 12];
        let check = |a: &DeviceAllocator, high: &mut [i64; 12]| -> Result<(), TestCaseError> {
            let s = a.stats();
            let current = monotone(&s, |s| s.current);
            for (h, c) in high.iter_mut().zip(current) {
                *h = (*h).max(c);
            }
            prop_assert_eq!(monotone(&s, |s| s.peak), *high);
            Ok(())
        };
        for t in turns {
            if t.empty_cache {
                a.empty_cache().unwrap();
                check(&a, &mut high)?;
            }
            if t.reset_peaks {
                a.reset_peak_stats();
                high = monotone(&a.stats(), |s| s.current);
            }
            for pick in t.frees {
                if !live.is_empty() {
                    let (p, s) = live.swap_remove(pick % live.len());
                    a.free(p, Some(s)).unwrap();
                    check(&a, &mut high)?;
                }
            }
            let stream = streams[t.stream];
            let mut batch = Vec::new();
            for size in t.sizes {
                batch.push(a.malloc(size, stream).unwrap());
                check(&a, &mut high)?;
            }
            for p in batch.drain(t.keep.min(batch.len())..).rev() {
                a.free(p, Some(stream)).unwrap();
                check(&a, &mut high)?;
            }
            live.extend(batch.into_iter().map(|p| (p, stream)));
        }
    }
}

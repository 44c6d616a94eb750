//! Random sequences of pinned-host operations checked against a model: live blocks never
//! overlap, a block guarded by a running stream is never handed out, the statistics match
//! what the caller holds, and everything goes back to the driver at the end.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use proptest::prelude::*;
use tensoralloc::config::Config;
use tensoralloc::driver::sim::{self, SimDriver};
use tensoralloc::host::{HostAllocator, HostBlock};

/// Streams of this test (simulated streams are process-wide).
const STREAMS: [usize; 3] = [0x9100, 0x9200, 0x9300];

#[derive(Debug, Clone)]
enum Op {
    Malloc(usize),
    Free(usize),
    Record(usize, usize),
    Hold(usize),
    Release(usize),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..=1 << 17).prop_map(Op::Malloc),
        3 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), 0..STREAMS.len()).prop_map(|(i, s)| Op::Record(i, s)),
        1 => (0..STREAMS.len()).prop_map(Op::Hold),
        1 => (0..STREAMS.len()).prop_map(Op::Release),
        1 => Just(Op::EmptyCache),
    ]
}

struct Live {
    block: HostBlock,
    size: usize,
    streams: HashSet<usize>,
}

fn run(ops: Vec<Op>, register: bool) {
    for s in STREAMS {
        sim::release_stream(s);
    }
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let config = Config {
        pinned_use_host_register: register,
        ..Config::default()
    };
    let host = HostAllocator::new(sim.clone(), &config);
    let mut live: Vec<Live> = Vec::new();
    let mut held: HashSet<usize> = HashSet::new();
    // Freed blocks whose streams were held at the free: address -> streams still running.
    let mut guarded: HashMap<usize, HashSet<usize>> = HashMap::new();
    for op in ops {
        match op {
            Op::Malloc(size) => {
                let before = host.stats().allocated_bytes.current as usize;
                let block = host.malloc(size).unwrap();
                // A larger cached block may serve the request.
                let got = host.stats().allocated_bytes.current as usize - before;
                assert!(
                    got >= size.next_power_of_two() && got.is_power_of_two(),
                    "{size} got {got}"
                );
                assert!(
                    !guarded.contains_key(&block.ptr),
                    "handed out a block a stream still uses"
                );
                for l in &live {
                    let apart = block.ptr + got <= l.block.ptr || l.block.ptr + l.size <= block.ptr;
                    assert!(apart, "live blocks overlap");
                }
                live.push(Live {
                    block,
                    size: got,
                    streams: HashSet::new(),
                });
            }
            Op::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                host.free(l.block.ptr, Some(l.block.ctx)).unwrap();
                let running: HashSet<usize> = l.streams.intersection(&held).copied().collect();
                if !running.is_empty() {
                    guarded.insert(l.block.ptr, running);
                }
            }
            Op::Record(i, s) if !live.is_empty() => {
                let n = live.len();
                let l = &mut live[i % n];
                assert!(host.record_event(l.block.ptr, None, STREAMS[s]));
                l.streams.insert(STREAMS[s]);
            }
            Op::Hold(s) => {
                sim::hold_stream(STREAMS[s]);
                held.insert(STREAMS[s]);
            }
            Op::Release(s) => {
                sim::release_stream(STREAMS[s]);
                held.remove(&STREAMS[s]);
                for g in guarded.values_mut() {
                    g.remove(&STREAMS[s]);
                }
                guarded.retain(|_, g| !g.is_empty());
            }
            Op::EmptyCache => host.empty_cache().unwrap(),
            Op::Free(_) | Op::Record(..) => {}
        }
        let s = host.stats();
        assert_eq!(s.allocations.current, live.len() as u64);
        assert_eq!(
            s.allocated_bytes.current,
            live.iter().map(|l| l.size as u64).sum::<u64>()
        );
        assert!(s.active_blocks.current >= s.allocations.current + guarded.len() as u64);
        assert!(s.reserved_bytes.current >= s.allocated_bytes.current);
        assert!(s.allocations.peak >= s.allocations.current);
        assert!(s.allocated_bytes.peak >= s.allocated_bytes.current);
        assert!(s.reserved_bytes.peak >= s.reserved_bytes.current);
    }
    for s in STREAMS {
        sim::release_stream(s);
    }
    for l in live {
        host.free(l.block.ptr, None).unwrap();
    }
    host.empty_cache().unwrap();
    let s = host.stats();
    assert_eq!((s.active_blocks.current, s.reserved_bytes.current), (0, 0));
    let c = &sim.counters;
    let pinned = c.host_alloc.load(Ordering::Relaxed) + c.host_register.load(Ordering::Relaxed);
    let unpinned = c.host_free.load(Ordering::Relaxed) + c.host_unregister.load(Ordering::Relaxed);
    assert_eq!(
        pinned, unpinned,
        "every pinned range went back to the driver"
    );
    assert_eq!(s.driver_allocations, s.driver_frees);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_rule(ops in proptest::collection::vec(op(), 1..80), register in any::<bool>()) {
        run(ops, register);
    }
}

//! Inactive split blocks and bytes change once per block operation, by the operation's net
//! change, as PyTorch's allocator changes them: their accumulated totals (`allocated`,
//! `freed`) count only net changes, not each merge and split on the way.

use tensoralloc::config::Config;
use tensoralloc::device::stats::Stat;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::SimDriver;

const MIB: i64 = 1 << 20;
const AGG: usize = 0;
const LARGE: usize = 2;

fn stat(current: i64, peak: i64, allocated: i64, freed: i64) -> Stat {
    Stat {
        current,
        peak,
        allocated,
        freed,
    }
}

/// The replayed pair path and the full path must count alike.
fn allocators() -> Vec<DeviceAllocator> {
    [true, false]
        .into_iter()
        .map(|memo| {
            let sim = SimDriver::shared(1, 1 << 30).unwrap();
            let mut a = DeviceAllocator::new(sim, 0, &Config::default()).unwrap();
            a.set_pair_memo(memo);
            a
        })
        .collect()
}

#[test]
fn a_split_of_a_split_block_and_merges_count_net_changes() {
    for a in allocators() {
        // A 20 MiB segment: the first 2 MiB are handed out, 18 MiB stay inactive.
        let p = a.malloc(2 * MIB as usize, 0).unwrap();
        // The inactive block shrinks by 2 MiB: no block appears or goes.
        let q = a.malloc(2 * MIB as usize, 0).unwrap();
        let s = a.stats();
        assert_eq!(s.inactive_split[LARGE], stat(1, 1, 1, 0));
        assert_eq!(
            s.inactive_split_bytes[LARGE],
            stat(16 * MIB, 18 * MIB, 18 * MIB, 2 * MIB)
        );
        // p is returned beside allocated q: one more inactive block.
        a.free(p, Some(0)).unwrap();
        // q merges with both neighbours into the whole segment: two blocks and 18 MiB go.
        a.free(q, Some(0)).unwrap();
        let s = a.stats();
        assert_eq!(s.inactive_split[AGG], stat(0, 2, 2, 2));
        assert_eq!(
            s.inactive_split_bytes[AGG],
            stat(0, 18 * MIB, 20 * MIB, 20 * MIB)
        );
    }
}

#[test]
fn cached_pairs_of_a_split_block_count_only_the_bytes_handed_out() {
    for a in allocators() {
        let keep = a.malloc(2 * MIB as usize, 0).unwrap();
        for _ in 0..3 {
            let p = a.malloc(MIB as usize + 512, 0).unwrap();
            a.free(p, Some(0)).unwrap();
        }
        let s = a.stats();
        assert_eq!(s.inactive_split[LARGE], stat(1, 1, 1, 0));
        // Each pair: 18 MiB shrink by the 1 MiB + 512 handed out, and grow back.
        let pairs = 3 * (MIB + 512);
        assert_eq!(
            s.inactive_split_bytes[LARGE],
            stat(18 * MIB, 18 * MIB, 18 * MIB + pairs, pairs)
        );
        a.free(keep, Some(0)).unwrap();
    }
}

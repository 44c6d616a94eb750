//! Runs cached pairs through `libtensoralloc_preload.so` on the fake driver, for counting
//! instructions per pair with callgrind (deterministic, unlike timings on a loaded machine):
//!
//! ```sh
//! cargo build --release -p tensoralloc_preload --example pair_count
//! valgrind --tool=callgrind --toggle-collect='*pair_count*measured*' \
//!     target/release/examples/pair_count async 100000
//! ```
//!
//! The total collected, divided by the pair count, is the cost of one pair (kinds: `async`,
//! `sync`, `host`, `floor`: the allocator alone, without the interposer; `driver`: the fake
//! driver's own uncached pair).

#[path = "../benches/support/mod.rs"]
mod support;

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::cuda::CudaDriver;

#[inline(never)]
fn pairs(kind: &str, n: usize, l: &support::Loaded, floor: &DeviceAllocator) {
    let stream = l.stream as usize;
    for _ in 0..n {
        match kind {
            "async" => l.async_pair(4096),
            "sync" => l.sync_pair(4096),
            "host" => l.host_pair(8192),
            "driver" => {
                let mut p = 0u64;
                // SAFETY: the fake driver's functions with a valid out-pointer.
                unsafe {
                    assert_eq!((l.fake_alloc)(&mut p, 4096), 0);
                    assert_eq!((l.fake_free)(p), 0);
                }
            }
            "floor" => {
                let p = floor.malloc(4096, stream).unwrap();
                floor.free(p, Some(stream)).unwrap();
            }
            other => panic!("unknown kind {other}"),
        }
    }
}

/// Only this call is collected (`--toggle-collect`), not the warm-up.
#[inline(never)]
fn measured(kind: &str, n: usize, l: &support::Loaded, floor: &DeviceAllocator) {
    pairs(kind, n, l, floor)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let kind = args.get(1).map(String::as_str).unwrap_or("async");
    let n: usize = args.get(2).map_or(100_000, |s| s.parse().unwrap());
    let l = support::load();
    let floor =
        DeviceAllocator::new(Arc::new(CudaDriver::load().unwrap()), 0, &Config::default()).unwrap();
    // Warm: segments exist, batches have cycled.
    pairs(kind, 1000, &l, &floor);
    measured(kind, n, &l, &floor);
    println!("{n} {kind} pairs");
}

//! One thread whose streams take turns holding memory, PyTorch's producer/consumer pattern:
//! each of four streams allocates a batch, frees it, and the next stream goes. Used to count
//! instructions of the statistics' peak settling (`valgrind --tool=callgrind`).
//!
//! Usage: `stream_turns [rounds]` (default 2000).

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::{SimConfig, SimDriver};

const STREAMS: usize = 4;
const BATCH: usize = 16;

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("rounds must be a number"))
        .unwrap_or(2000);
    let sim = SimDriver::new(SimConfig {
        devices: 1,
        capacity: 64 << 30,
        backed: false,
    })
    .unwrap();
    let a = DeviceAllocator::new(Arc::new(sim), 0, &Config::default()).unwrap();
    let mut ptrs = Vec::with_capacity(BATCH);
    for _ in 0..rounds {
        for s in 0..STREAMS {
            let stream = 0x1000 + s * 0x100;
            for i in 0..BATCH {
                ptrs.push(a.malloc(512 << (i % 12), stream).unwrap());
            }
            for p in ptrs.drain(..).rev() {
                a.free(p, Some(stream)).unwrap();
            }
        }
    }
    let peak = a.stats().allocated_bytes[0].peak;
    println!("{rounds} rounds of {STREAMS} streams x {BATCH} allocations; peak {peak} bytes");
}

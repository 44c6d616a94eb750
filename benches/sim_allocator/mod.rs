//! The allocator the device benchmarks measure: one simulated device of 64 GiB without host
//! backing, PyTorch's default settings.

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::sim::{SimConfig, SimDriver};

pub fn allocator() -> DeviceAllocator {
    allocator_with(&Config::default())
}

/// The same device with other allocator settings.
#[allow(dead_code)] // Not every bench that includes this module compares settings.
pub fn allocator_with(config: &Config) -> DeviceAllocator {
    let sim = SimDriver::new(SimConfig {
        devices: 1,
        capacity: 64 << 30,
        backed: false,
    })
    .unwrap();
    DeviceAllocator::new(Arc::new(sim), 0, config).unwrap()
}

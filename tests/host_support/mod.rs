//! Shared by the `host_*` integration tests.

use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::host::HostAllocator;

/// A fresh simulated driver and a pinned-host allocator over it; `register` picks the pinning
/// mode (`cuMemHostRegister` over ordinary pages, or driver-pinned allocations).
pub fn setup(register: bool) -> (Arc<SimDriver>, HostAllocator) {
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let config = Config {
        pinned_use_host_register: register,
        ..Config::default()
    };
    let host = HostAllocator::new(sim.clone(), &config);
    (sim, host)
}

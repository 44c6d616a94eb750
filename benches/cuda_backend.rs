//! The cached malloc+free pair through the NVIDIA driver backend (cudarc, on the fake
//! `libcuda.so.1`) against the same pair on the simulated device. The hot path makes no driver
//! call, so the two figures should match (within noise).
//!
//! Needs the fake driver: `cargo build --release -p fakecuda` (a debug build is used when no
//! release build exists), then `cargo bench --bench cuda_backend`.

#[path = "../tests/cuda_support/mod.rs"]
mod cuda_support;

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::driver::Driver;

const SIZE: usize = 1 << 20;
const STREAM: usize = 0x100;

fn pair(c: &mut Criterion, name: &str, driver: Arc<dyn Driver>) {
    let a = DeviceAllocator::new(driver, 0, &Config::default()).unwrap();
    // Warm the cache: the first malloc gets a segment from the driver.
    let p = a.malloc(SIZE, STREAM).unwrap();
    a.free(p, Some(STREAM)).unwrap();
    c.bench_function(name, |b| {
        b.iter(|| {
            let p = a.malloc(black_box(SIZE), STREAM).unwrap();
            a.free(black_box(p), Some(STREAM)).unwrap();
        })
    });
    a.empty_cache().unwrap();
}

fn cached_pair(c: &mut Criterion) {
    pair(
        c,
        "cached malloc+free 1 MiB / simulated device",
        SimDriver::shared(1, 1 << 30).unwrap(),
    );
    cuda_support::load_fake();
    let cuda = CudaDriver::load().expect("the backend loads the fake driver");
    pair(
        c,
        "cached malloc+free 1 MiB / cuda backend on fake libcuda",
        Arc::new(cuda),
    );
}

criterion_group!(benches, cached_pair);
criterion_main!(benches);

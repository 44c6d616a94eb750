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

/// A warmed allocator for device 0 of `driver`: its first malloc took a segment from the driver.
fn warmed(driver: Arc<dyn Driver>) -> DeviceAllocator {
    let a = DeviceAllocator::new(driver, 0, &Config::default()).unwrap();
    let p = a.malloc(SIZE, STREAM).unwrap();
    a.free(p, Some(STREAM)).unwrap();
    a
}

fn cached_pair(c: &mut Criterion) {
    let sim = warmed(SimDriver::shared(1, 1 << 30).unwrap());
    cuda_support::load_fake();
    let cuda = warmed(Arc::new(
        CudaDriver::load().expect("the backend loads the fake driver"),
    ));
    let mut group = c.benchmark_group("cached malloc+free 1 MiB");
    for (name, a) in [
        ("simulated device", &sim),
        ("cuda backend on fake libcuda", &cuda),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let p = a.malloc(black_box(SIZE), STREAM).unwrap();
                a.free(black_box(p), Some(STREAM)).unwrap();
            })
        });
    }
    group.finish();
    sim.empty_cache().unwrap();
    cuda.empty_cache().unwrap();
}

criterion_group!(benches, cached_pair);
criterion_main!(benches);

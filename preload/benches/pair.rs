//! A cached allocation/free pair through `libtensoralloc_preload.so` on the fake driver (both
//! built in release mode; the hooks are called through the shared library's own symbols, as a
//! preloaded program's calls land in them): what a CUDA program pays per pair once the cache is
//! warm. The hooks' real calls go to the fake driver: `cuCtxGetCurrent` on each synchronous
//! allocation, and the marker events of `cuMemFree`'s batches.

mod support;

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use tensoralloc::config::Config;
use tensoralloc::device::DeviceAllocator;
use tensoralloc::driver::cuda::CudaDriver;

fn pairs(c: &mut Criterion) {
    let l = support::load();
    let mut g = c.benchmark_group("preload_pair");
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    g.bench_function("cuMemAllocAsync+cuMemFreeAsync 4KiB same stream", |b| {
        b.iter(|| l.async_pair(4096))
    });
    g.bench_function("cuMemAlloc+cuMemFree 4KiB", |b| {
        b.iter(|| l.sync_pair(4096))
    });
    g.bench_function("cuMemAlloc+cuMemFree 1MiB", |b| {
        b.iter(|| l.sync_pair(1 << 20))
    });
    g.bench_function("cuMemHostAlloc+cuMemFreeHost 8KiB", |b| {
        b.iter(|| l.host_pair(8192))
    });
    let floor =
        DeviceAllocator::new(Arc::new(CudaDriver::load().unwrap()), 0, &Config::default()).unwrap();
    let stream = l.stream as usize;
    g.bench_function(
        "DeviceAllocator malloc+free 4KiB, no interposer (the floor)",
        |b| {
            b.iter(|| {
                let p = floor.malloc(4096, stream).unwrap();
                floor.free(p, Some(stream)).unwrap();
            })
        },
    );
    g.bench_function(
        "fake driver cuMemAlloc+cuMemFree 4KiB, no interposer",
        |b| {
            b.iter(|| {
                let mut p = 0u64;
                // SAFETY: the fake driver's functions with a valid out-pointer.
                unsafe {
                    assert_eq!((l.fake_alloc)(&mut p, 4096), 0);
                    assert_eq!((l.fake_free)(p), 0);
                }
            })
        },
    );
    g.finish();
}

criterion_group!(benches, pairs);
criterion_main!(benches);

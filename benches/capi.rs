//! The cached paths through the exported C functions, on the simulated device, as a C program
//! calls them (`TENSORALLOC_DRIVER=sim`, one process-wide runtime).
//!
//! - `capi_device_pair/fresh`: `tensoralloc_malloc(4096, 0, s)` + `tensoralloc_free` on a
//!   stream used for nothing else, before anything else was allocated;
//! - `capi_device_pair/populated`: the same pair on one of four streams that served 600 mixed
//!   allocations (1 B to 4 MiB, some freed early), all freed again, so the cache holds blocks;
//! - `capi_device_pair/glibc`: `malloc(4096)` + `free` in the same process, for comparison;
//! - `capi_device_threads/N`: N threads, each on its own stream, doing cached pairs. Each
//!   thread does one pair before the measured region (the first use of a stream makes its
//!   shard and takes a segment from the driver), so the region holds cached pairs only.
//!   Time is the wall time for every thread to do one pair; throughput counts pairs of all
//!   threads, so scaling is the throughput ratio to N = 1. `capi_device_threads_cpu/N` is
//!   each thread's CPU time per pair in the same run: flat in N when threads share nothing;
//! - `capi_host_pair/*` and `capi_host_threads[_cpu]/N`: the same for `tensoralloc_host_malloc` /
//!   `tensoralloc_host_free`, after four threads churned blocks of mixed sizes.
//!
//! Run with `cargo bench --bench capi`; `cargo bench --bench capi -- host` runs only the
//! pinned-host part.

use std::time::Duration;

mod capi_work;
mod common;

use capi_work::{device_pair, glibc_pair, host_pair, populate_device, populate_host, stream};
use common::in_threads;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn use_sim() {
    // SAFETY: set before the benchmark starts any thread or calls tensoralloc.
    unsafe { std::env::set_var("TENSORALLOC_DRIVER", "sim") };
}

/// `<group>/N`: wall time, so the throughput ratio to N = 1 is the scaling; and
/// `<group>_cpu/N`: each thread's CPU time per pair, which stays flat with N when threads
/// share no lock or written cache line (on a machine busy with other work, where wall time
/// also counts time the threads were not running, this is the figure to read).
fn thread_groups(c: &mut Criterion, group: &str, work: fn(usize)) {
    let mut g = c.benchmark_group(group);
    for n in [1usize, 2, 4] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| in_threads(n, iters, work).0)
        });
    }
    g.finish();
    let mut g = c.benchmark_group(format!("{group}_cpu"));
    g.throughput(Throughput::Elements(1));
    for n in [1usize, 2, 4] {
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| in_threads(n, iters, work).1)
        });
    }
    g.finish();
}

fn device(c: &mut Criterion) {
    use_sim();
    let mut g = c.benchmark_group("capi_device_pair");
    g.throughput(Throughput::Elements(1));
    let fresh = stream(0x900);
    device_pair(fresh);
    g.bench_function("fresh", |b| b.iter(|| device_pair(fresh)));
    let streams = [0x1000, 0x2000, 0x3000, 0x4000];
    populate_device(streams);
    let populated = stream(streams[0]);
    device_pair(populated);
    g.bench_function("populated", |b| b.iter(|| device_pair(populated)));
    g.bench_function("glibc", |b| b.iter(glibc_pair));
    g.finish();

    thread_groups(c, "capi_device_threads", |t| device_pair(stream(20 + t)));
}

fn host(c: &mut Criterion) {
    use_sim();
    populate_host();
    host_pair();
    let mut g = c.benchmark_group("capi_host_pair");
    g.throughput(Throughput::Elements(1));
    g.bench_function("cached_4KiB", |b| b.iter(host_pair));
    g.finish();
    thread_groups(c, "capi_host_threads", |_| host_pair());
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = device, host
}
criterion_main!(benches);

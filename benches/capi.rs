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

use std::ffi::c_void;
use std::hint::black_box;
use std::time::Duration;

mod common;

use common::in_threads;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tensoralloc::capi::device::{tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::host::{tensoralloc_host_free, tensoralloc_host_malloc};
use tensoralloc::capi::CUstream_st;

const SIZE: usize = 4096;

fn stream(s: usize) -> *mut CUstream_st {
    s as *mut CUstream_st
}

fn use_sim() {
    // SAFETY: set before the benchmark starts any thread or calls tensoralloc.
    unsafe { std::env::set_var("TENSORALLOC_DRIVER", "sim") };
}

fn device_pair(s: *mut CUstream_st) {
    let p = tensoralloc_malloc(black_box(SIZE), 0, s);
    assert!(!p.is_null());
    tensoralloc_free(black_box(p), SIZE, 0, s);
}

fn host_pair() {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let p = tensoralloc_host_malloc(black_box(SIZE), &mut ctx);
    assert!(!p.is_null());
    tensoralloc_host_free(black_box(p), ctx);
}

/// xorshift64: a fixed, repeatable mix of sizes.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// 600 allocations of 1 B to 4 MiB (sizes spread over powers of two) on four streams, a
/// third of them freed early, then all freed: a realistic mix left in the cache.
fn populate_device(streams: [usize; 4]) {
    let mut x = 0x2545_f491_4f6c_dd1d;
    let mut live: Vec<Option<(*mut c_void, usize, usize)>> = Vec::with_capacity(600);
    for i in 0..600 {
        let r = next(&mut x);
        let size = (1 + next(&mut x) % (1 << (r % 23))).min(4 << 20) as usize;
        let s = streams[(r >> 8) as usize % 4];
        let p = tensoralloc_malloc(size, 0, stream(s));
        assert!(!p.is_null());
        live.push(Some((p, size, s)));
        if (r >> 16).is_multiple_of(3) {
            let j = (r >> 20) as usize % (i + 1);
            if let Some((p, size, s)) = live[j].take() {
                tensoralloc_free(p, size, 0, stream(s));
            }
        }
    }
    for (p, size, s) in live.into_iter().flatten() {
        tensoralloc_free(p, size, 0, stream(s));
    }
}

/// Four threads each hold up to 100 pinned blocks of 1 B to 1 MiB, then free them.
fn populate_host() {
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                let blocks: Vec<_> = (0..100)
                    .map(|_| {
                        let mut ctx: *mut c_void = std::ptr::null_mut();
                        let size = 1 + (next(&mut x) % (1 << 20)) as usize;
                        let p = tensoralloc_host_malloc(size, &mut ctx);
                        assert!(!p.is_null());
                        (p as usize, ctx as usize)
                    })
                    .collect();
                for (p, ctx) in blocks {
                    tensoralloc_host_free(p as *mut c_void, ctx as *mut c_void);
                }
            });
        }
    });
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
    g.bench_function("glibc", |b| {
        b.iter(|| {
            // SAFETY: malloc and free of one block, freed once.
            unsafe { libc::free(black_box(libc::malloc(black_box(SIZE)))) }
        })
    });
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

//! Pinned-host allocator benchmarks: the cached 4 KiB malloc+free pair on one thread (through
//! the Rust API and through the C ABI), and 1, 2 and 4 threads churning at once.
//!
//! Run with `cargo bench --bench host`. For the thread benchmarks criterion's time is the wall
//! time for every thread to do one pair; its throughput (elements/s) counts pairs of all
//! threads, so scaling is the throughput ratio.
//!
//! The `*_cpu` variants report CPU time of the measuring threads instead of wall time: on a
//! machine shared with other work, wall time includes time the threads were not running. In
//! `host_threads_cpu_per_pair/N` each of N threads measures its own CPU time per pair; if
//! the threads shared a lock or a written cache line, that time would grow with N.
//!
//! `host_threads_control/N` runs the same harness with thread-private arithmetic instead of
//! the allocator: its throughput ratio between N and 1 threads is what the machine itself
//! allows, the ceiling for the allocator's ratio.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{in_threads, thread_cpu};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tensoralloc::capi::host::{tensoralloc_host_free, tensoralloc_host_malloc};
use tensoralloc::config::Config;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::host::HostAllocator;

const SIZE: usize = 4096;

fn allocator() -> Arc<HostAllocator> {
    let sim = SimDriver::shared(1, 1 << 30).expect("simulated driver");
    Arc::new(HostAllocator::new(sim, &Config::default()))
}

fn cached_pair(c: &mut Criterion) {
    let host = allocator();
    let warm = host.malloc(SIZE).unwrap();
    host.free(warm.ptr, Some(warm.ctx)).unwrap();
    let mut g = c.benchmark_group("host_cached_pair_4k");
    g.throughput(Throughput::Elements(1));
    g.bench_function("rust", |b| {
        b.iter(|| {
            let blk = host.malloc(black_box(SIZE)).unwrap();
            host.free(black_box(blk.ptr), Some(blk.ctx)).unwrap();
        })
    });
    g.bench_function("rust_cpu", |b| {
        b.iter_custom(|iters| {
            let t0 = thread_cpu();
            for _ in 0..iters {
                let blk = host.malloc(black_box(SIZE)).unwrap();
                host.free(black_box(blk.ptr), Some(blk.ctx)).unwrap();
            }
            thread_cpu() - t0
        })
    });
    g.bench_function("rust_no_ctx", |b| {
        b.iter(|| {
            let blk = host.malloc(black_box(SIZE)).unwrap();
            host.free(black_box(blk.ptr), None).unwrap();
        })
    });

    // The C functions use the process-wide allocator on the simulated driver.
    std::env::set_var("TENSORALLOC_DRIVER", "sim");
    let mut ctx = std::ptr::null_mut();
    let p = tensoralloc_host_malloc(SIZE, &mut ctx);
    assert!(!p.is_null());
    tensoralloc_host_free(p, ctx);
    g.bench_function("c_abi", |b| {
        b.iter(|| {
            let mut ctx = std::ptr::null_mut();
            let p = tensoralloc_host_malloc(black_box(SIZE), &mut ctx);
            tensoralloc_host_free(black_box(p), ctx);
        })
    });
    g.finish();
}

/// Wall time for `threads` threads to each do `iters` cached pairs, started together, and the
/// mean CPU time of those threads.
fn churn(host: &Arc<HostAllocator>, threads: usize, iters: u64) -> (Duration, Duration) {
    let host = host.clone();
    in_threads(threads, iters, move |_| {
        let blk = host.malloc(black_box(SIZE)).unwrap();
        host.free(black_box(blk.ptr), Some(blk.ctx)).unwrap();
    })
}

/// Thread-private work of about the cost of a cached pair: the control for `churn`.
fn control(threads: usize, iters: u64) -> Duration {
    in_threads(threads, iters, |_| {
        let mut x = black_box(1u64);
        for _ in 0..18 {
            x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
        }
        black_box(x);
    })
    .0
}

fn threads(c: &mut Criterion) {
    let host = allocator();
    let mut g = c.benchmark_group("host_threads_pair_4k");
    for n in [1usize, 2, 4] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("{n}"), |b| {
            b.iter_custom(|iters| churn(&host, n, iters).0)
        });
    }
    g.finish();
    let mut g = c.benchmark_group("host_threads_control");
    for n in [1usize, 2, 4] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("{n}"), |b| b.iter_custom(|iters| control(n, iters)));
    }
    g.finish();
    let mut g = c.benchmark_group("host_threads_cpu_per_pair");
    g.throughput(Throughput::Elements(1));
    for n in [1usize, 2, 4] {
        g.bench_function(format!("{n}"), |b| {
            b.iter_custom(|iters| churn(&host, n, iters).1)
        });
    }
    g.finish();
}

criterion_group!(benches, cached_pair, threads);
criterion_main!(benches);

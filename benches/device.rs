//! Criterion benchmarks of the caching device allocator on the simulated device.
//!
//! - `cached_pair/<size>`: one malloc+free that is served from the cache, on one stream;
//! - `churn/mixed`: a mixed workload of sizes and lifetimes on one stream;
//! - `threads/N`: N threads, each on its own stream, doing cached pairs (throughput scaling);
//! - `stream_turns/4x16`: one thread whose four streams take turns: each allocates 16 blocks
//!   and frees them before the next goes (headroom of device-wide peaks moves every turn);
//! - `c_abi/cached_pair_4KiB`: the pair through the exported C functions.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

mod sim_allocator;
use sim_allocator::allocator;

fn cached_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("cached_pair");
    for (name, size) in [
        ("4KiB", 4usize << 10),
        ("1MiB", 1 << 20),
        ("64MiB", 64 << 20),
    ] {
        let a = allocator();
        let warm = a.malloc(size, 7).unwrap();
        a.free(warm, Some(7)).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                let p = a.malloc(black_box(size), 7).unwrap();
                a.free(black_box(p), Some(7)).unwrap();
            })
        });
    }
    g.finish();
}

/// A training-step-like mix: activations of many sizes allocated in order and freed in
/// reverse, with a few long-lived buffers and small temporaries interleaved.
fn churn(c: &mut Criterion) {
    let a = allocator();
    let sizes: Vec<usize> = (0..64)
        .map(|i| match i % 8 {
            0 => 512,
            1 => 4096 + 512 * i,
            2 => 65536,
            3 => 1 << 20,
            4 => (3 << 20) + 4096 * i,
            5 => 12 << 20,
            6 => 200 << 10,
            _ => 8 << 20,
        })
        .collect();
    let mut live = Vec::with_capacity(64);
    let mut g = c.benchmark_group("churn");
    g.throughput(Throughput::Elements(sizes.len() as u64 * 2));
    g.bench_function("mixed", |b| {
        b.iter(|| {
            for (i, &s) in sizes.iter().enumerate() {
                live.push(a.malloc(s, 3).unwrap());
                if i % 4 == 3 {
                    // a temporary freed right away
                    let t = live.pop().unwrap();
                    a.free(t, Some(3)).unwrap();
                    live.push(a.malloc(s / 2 + 512, 3).unwrap());
                }
            }
            while let Some(p) = live.pop() {
                a.free(p, Some(3)).unwrap();
            }
        })
    });
    g.finish();
}

/// N threads on N streams doing cached 4 KiB pairs; reports the time per pair per thread, so
/// perfect scaling keeps it flat and the throughput is N / time.
fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    let a = Arc::new(allocator());
    for n in [1usize, 2] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let barrier = Arc::new(Barrier::new(n + 1));
                let handles: Vec<_> = (0..n)
                    .map(|t| {
                        let (a, barrier) = (a.clone(), barrier.clone());
                        std::thread::spawn(move || {
                            let stream = 0x1000 + t * 0x100;
                            let p = a.malloc(4096, stream).unwrap();
                            a.free(p, Some(stream)).unwrap();
                            barrier.wait();
                            for _ in 0..iters {
                                let p = a.malloc(black_box(4096), stream).unwrap();
                                a.free(black_box(p), Some(stream)).unwrap();
                            }
                        })
                    })
                    .collect();
                barrier.wait();
                let start = Instant::now();
                for h in handles {
                    h.join().unwrap();
                }
                start.elapsed()
            })
        });
    }
    g.finish();
}

/// Time per malloc or free when four streams of one thread take turns holding memory.
fn stream_turns(c: &mut Criterion) {
    let a = allocator();
    let mut g = c.benchmark_group("stream_turns");
    g.throughput(Throughput::Elements(4 * 16 * 2));
    let mut ptrs = Vec::with_capacity(16);
    g.bench_function("4x16", |b| {
        b.iter(|| {
            for s in 0..4 {
                let stream = 0x1000 + s * 0x100;
                for i in 0..16 {
                    ptrs.push(a.malloc(black_box(512 << (i % 12)), stream).unwrap());
                }
                for p in ptrs.drain(..).rev() {
                    a.free(p, Some(stream)).unwrap();
                }
            }
        })
    });
    g.finish();
}

fn c_abi(c: &mut Criterion) {
    // SAFETY: setting the environment before any other thread of this benchmark reads it.
    unsafe { std::env::set_var("TENSORALLOC_DRIVER", "sim") };
    use tensoralloc::capi::device::{tensoralloc_free, tensoralloc_malloc};
    let stream = 0x900 as *mut tensoralloc::capi::CUstream_st;
    let p = tensoralloc_malloc(4096, 0, stream);
    assert!(!p.is_null());
    tensoralloc_free(p, 4096, 0, stream);
    c.bench_function("c_abi/cached_pair_4KiB", |b| {
        b.iter(|| {
            let p = tensoralloc_malloc(black_box(4096), 0, stream);
            tensoralloc_free(black_box(p), 4096, 0, stream);
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = cached_pair, churn, threads, stream_turns, c_abi
}
criterion_main!(benches);

//! Planner benchmarks: offset planning time on synthetic model traces of 10,000 to 60,000
//! allocations and on MiniMalloc's "challenging" instances (`tests/data/planner/`)
//! (`cargo bench --bench plan`), the plan / lower-bound ratio of every algorithm on those
//! inputs (printed first; with `TENSORALLOC_BENCH_EXACT=1` also the `exact` algorithm's time
//! and proof per challenging instance), and serving an iteration from a profiling plan.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use criterion::{criterion_group, BenchmarkId, Criterion};
use tensoralloc::plan::memory::HostMemory;
use tensoralloc::plan::profiling::Profiler;
use tensoralloc::plan::{
    lower_bound, plan_offsets, plan_offsets_with, traces, Algorithm, Allocation, PlanOptions,
};

/// The traces measured: name and allocations.
fn model_traces() -> Vec<(&'static str, Vec<Allocation>)> {
    vec![
        // 24 layers, 14 micro-batches of 8 × up to 1024 tokens, hidden 1024: 9,326 allocations.
        (
            "transformer-train-24L",
            traces::transformer_training(24, 14, 8, 1024, 1024, 16, 1),
        ),
        // 48 layers, 7 micro-batches: deeper, so more activations live at once. 9,391.
        (
            "transformer-train-48L",
            traces::transformer_training(48, 7, 8, 1024, 1024, 16, 2),
        ),
        // ResNet-50 layout, batch 32 at 224 px, 28 steps: 10,108 allocations.
        ("resnet50-train", traces::cnn_training(32, 224, 28, 3)),
        // 24-layer transformer serving 40 requests of up to 2048 tokens: 9,718 allocations.
        (
            "transformer-infer",
            traces::transformer_inference(24, 40, 1, 2048, 2048, 16, 4),
        ),
        // A small training step, where the default also runs every greedy order.
        (
            "transformer-train-12L-small",
            traces::transformer_training(12, 4, 4, 512, 768, 12, 5),
        ),
    ]
}

/// Larger model traces: 30,000 to 60,000 allocations.
fn large_traces() -> Vec<(&'static str, Vec<Allocation>)> {
    vec![
        (
            "transformer-train-24L-30k",
            traces::transformer_training(24, 45, 8, 1024, 1024, 16, 6),
        ),
        (
            "transformer-train-48L-60k",
            traces::transformer_training(48, 45, 8, 1024, 1024, 16, 7),
        ),
        ("resnet50-train-60k", traces::cnn_training(32, 224, 166, 8)),
    ]
}

/// Dense graphs with sizes of every magnitude ([`traces::sharded_graph`]): thousands of
/// allocations live at once, with a fragmented layout; 10,000 to 60,000 allocations, the sizes
/// that the planner's speed targets name.
fn dense_graphs() -> Vec<(&'static str, Vec<Allocation>)> {
    vec![
        ("sharded-graph-10k", traces::sharded_graph(10_000, 9)),
        ("sharded-graph-30k", traces::sharded_graph(30_000, 10)),
        ("sharded-graph-60k", traces::sharded_graph(60_000, 1)),
    ]
}

const CHALLENGING: [&str; 11] = ["A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K"];

/// A challenging instance: half-open lifetimes `[lower, upper)` read as inclusive last uses.
fn challenging(name: &str) -> Vec<Allocation> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/planner")
        .join(format!("{name}.1048576.csv"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    traces::minimalloc_csv(&text).unwrap()
}

/// Prints, for each challenging instance, the default's and PyTorch's ratio to the lower
/// bound and, when asked, the exact algorithm's time and proof.
fn report_challenging() {
    let exact = std::env::var_os("TENSORALLOC_BENCH_EXACT").is_some();
    println!("challenging set (alignment 1): plan size / lower bound");
    for name in CHALLENGING {
        let allocs = challenging(name);
        let bound = lower_bound(&allocs, 1).unwrap() as f64;
        let start = Instant::now();
        let default = plan_offsets(&allocs, 1, Algorithm::Best).unwrap();
        let took = start.elapsed();
        let pytorch = plan_offsets(&allocs, 1, Algorithm::Pytorch).unwrap();
        print!(
            "  {name} n={:3} default {:.4} ({:.1} ms) pytorch {:.4}",
            allocs.len(),
            default.arena_size as f64 / bound,
            took.as_secs_f64() * 1e3,
            pytorch.arena_size as f64 / bound
        );
        if exact {
            let start = Instant::now();
            let out =
                plan_offsets_with(&allocs, 1, Algorithm::Exact, &PlanOptions::default()).unwrap();
            print!(
                "  exact {:.4} ({:.2} s, {} work units) proven {}",
                out.plan.arena_size as f64 / bound,
                start.elapsed().as_secs_f64(),
                out.work,
                out.proven_optimal
            );
        }
        println!();
    }
}

/// Prints, for each trace, every algorithm's arena divided by the lower bound.
fn report_ratios() {
    println!("plan size / lower bound (alignment 64):");
    for (name, allocs) in model_traces()
        .into_iter()
        .chain(large_traces())
        .chain(dense_graphs())
    {
        let bound = lower_bound(&allocs, 64).unwrap();
        print!(
            "  {name:28} n={:5} bound={:6.2} GiB",
            allocs.len(),
            bound as f64 / (1u64 << 30) as f64
        );
        for algorithm in Algorithm::all() {
            if algorithm == Algorithm::Exact {
                continue;
            }
            let plan = plan_offsets(&allocs, 64, algorithm).unwrap();
            print!(
                "  {} {:.4}",
                algorithm.name(),
                plan.arena_size as f64 / bound as f64
            );
        }
        println!();
    }
}

fn offsets(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan_offsets");
    group.sample_size(20);
    for (name, allocs) in model_traces() {
        for algorithm in [Algorithm::Best, Algorithm::Pytorch, Algorithm::GreedyBySize] {
            group.bench_with_input(
                BenchmarkId::new(algorithm.name(), name),
                &allocs,
                |b, allocs| b.iter(|| plan_offsets(black_box(allocs), 64, algorithm).unwrap()),
            );
        }
    }
    for (name, allocs) in large_traces().into_iter().chain(dense_graphs()) {
        group.bench_with_input(BenchmarkId::new("best", name), &allocs, |b, allocs| {
            b.iter(|| plan_offsets(black_box(allocs), 64, Algorithm::Best).unwrap())
        });
    }
    group.finish();
    let mut group = c.benchmark_group("plan_challenging");
    group.sample_size(10);
    for name in CHALLENGING {
        let allocs = challenging(name);
        group.bench_with_input(BenchmarkId::new("best", name), &allocs, |b, allocs| {
            b.iter(|| plan_offsets(black_box(allocs), 1, Algorithm::Best).unwrap())
        });
    }
    group.finish();
}

fn serving(c: &mut Criterion) {
    // An inference-like iteration of 1,000 allocations, each freed two allocations later.
    let sizes: Vec<usize> = (0..1000).map(|i| 256 + (i * 7919) % 65536).collect();
    let iteration = |p: &mut Profiler| {
        let mut live = std::collections::VecDeque::new();
        for &s in &sizes {
            live.push_back(p.malloc(s as u64).unwrap());
            if live.len() > 2 {
                p.free(live.pop_front().unwrap()).unwrap();
            }
        }
        for a in live {
            p.free(a).unwrap();
        }
    };
    let mut p = Profiler::new(Box::new(HostMemory), 64).unwrap();
    p.begin_recording().unwrap();
    iteration(&mut p);
    p.end_recording().unwrap();
    p.formulate(Algorithm::Best).unwrap();
    c.bench_function("profiling/serve_1000_allocations", |b| {
        b.iter(|| {
            p.begin_serving().unwrap();
            iteration(&mut p);
            p.end_serving().unwrap();
        })
    });
}

criterion_group!(benches, offsets, serving);

fn main() {
    report_ratios();
    report_challenging();
    benches();
    Criterion::default().configure_from_args().final_summary();
}

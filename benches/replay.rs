//! Replay and memory-history benchmarks.
//!
//! First a table: every snapshot in `tests/data/traces/` replayed under `default`,
//! `expandable_segments:True` and `policy:compact` (settings the parser rejects are shown as
//! unsupported): peak allocated, peak reserved, their ratio and the best ns per event of three
//! replays. Then criterion:
//! - `history/cached_pair_off`: a cached malloc+free with recording off (the hook is one
//!   relaxed load);
//! - `history/cached_pair_on`: the same pair with recording on; each pair records three
//!   events (alloc, free_requested, free_completed), so the cost per event is a third of the
//!   difference.
//! - `cached/{small,large}/{config}`: a malloc+free pair that a cached block serves (4 KiB
//!   and 64 MiB) under each of the settings of the table.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::Criterion;
use tensoralloc::replay::{self, snapshot, UNLIMITED_MEMORY};

const CONFIGS: [&str; 3] = ["default", "expandable_segments:True", "policy:compact"];

fn table() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!("no traces in {}", dir.display());
        return;
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().contains(".pickle"))
        .collect();
    files.sort();
    println!(
        "{:36} {:26} {:>16} {:>16} {:>7} {:>9}",
        "trace", "config", "peak allocated", "peak reserved", "ratio", "ns/event"
    );
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let trace = match snapshot::load(&file, 0) {
            Ok(t) => t,
            Err(e) => {
                println!("{name:36} unreadable: {e}");
                continue;
            }
        };
        for text in CONFIGS {
            let config = match replay::parse_config(text) {
                Ok(c) => c,
                Err(e) => {
                    println!("{name:36} {text:26} unsupported ({})", e.message());
                    continue;
                }
            };
            let mut best: Option<replay::Report> = None;
            for _ in 0..3 {
                match replay::run(&trace, &config, UNLIMITED_MEMORY) {
                    Ok(r) => {
                        if best
                            .as_ref()
                            .is_none_or(|b| r.ns_per_event < b.ns_per_event)
                        {
                            best = Some(r);
                        }
                    }
                    Err(e) => {
                        println!("{name:36} {text:26} failed: {e}");
                        break;
                    }
                }
            }
            if let Some(r) = best {
                println!(
                    "{name:36} {text:26} {:>16} {:>16} {:>7.3} {:>9.0}",
                    r.peak_allocated_bytes,
                    r.peak_reserved_bytes,
                    r.ratio(),
                    r.ns_per_event
                );
            }
        }
    }
}

mod sim_allocator;
use sim_allocator::{allocator, allocator_with};

fn cached(c: &mut Criterion) {
    let mut g = c.benchmark_group("cached");
    for (name, size) in [("small", 4096), ("large", 64 << 20)] {
        for text in CONFIGS {
            let a = allocator_with(&replay::parse_config(text).unwrap());
            let warm = a.malloc(size, 7).unwrap();
            a.free(warm, Some(7)).unwrap();
            g.bench_function(format!("{name}/{text}"), |b| {
                b.iter(|| {
                    let p = a.malloc(black_box(size), 7).unwrap();
                    a.free(black_box(p), Some(7)).unwrap();
                })
            });
        }
    }
    g.finish();
}

fn history(c: &mut Criterion) {
    let mut g = c.benchmark_group("history");
    for (name, on) in [("cached_pair_off", false), ("cached_pair_on", true)] {
        let a = allocator();
        let warm = a.malloc(4096, 7).unwrap();
        a.free(warm, Some(7)).unwrap();
        if on {
            a.history().set(true, 1 << 16).unwrap();
        }
        g.bench_function(name, |b| {
            b.iter(|| {
                let p = a.malloc(black_box(4096), 7).unwrap();
                a.free(black_box(p), Some(7)).unwrap();
            })
        });
    }
    g.finish();
}

fn main() {
    table();
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    cached(&mut c);
    history(&mut c);
    c.final_summary();
}

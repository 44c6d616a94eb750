//! Distributions of the cached paths through the exported C functions, over repeated short
//! runs, for a machine that other work shares (a single criterion figure hides the spread).
//!
//! `cargo bench --bench capi_runs [-- SECTION...]`, sections `pairs`, `threads` and `replay`
//! (all by default); `CAPI_RUNS=N` sets the number of runs (default 10); the simulated device
//! has 256 GiB unless `TENSORALLOC_SIM_MEMORY` says otherwise (valgrind cannot reserve that much). Every run prints a
//! line, then each figure's minimum, median and maximum over the runs, with `uptime`'s load.
//!
//! - `pairs`: ns per cached 4 KiB pair: `tensoralloc_malloc`/`tensoralloc_free` on a stream
//!   that served 600 mixed allocations on four streams (all freed again, so the cache holds
//!   blocks), glibc's `malloc`/`free` in the same run, their ratio, and
//!   `tensoralloc_host_malloc`/`tensoralloc_host_free` after four threads churned blocks; each
//!   as wall time and as the thread's CPU time.
//! - `threads`: 1, 2 and 4 threads, each on its own stream (device) or its own shard (host),
//!   doing cached pairs; each thread does one pair before the measured region (the first use
//!   of a stream makes its shard and takes a segment from the driver). Reported per N: wall
//!   time per pair of one thread, each thread's CPU time per pair, the scaling (throughput
//!   ratio to one thread, from wall time), and the cores the run actually got (CPU time of
//!   all threads / wall time). When other processes take the cores, wall scaling falls with
//!   the cores granted while CPU time per pair stays flat if the threads share nothing.
//!   Then the device's threads all on one stream: they take turns at its lock, so the
//!   figures show what contention costs (throughput falls below one thread's).
//! - `replay`: every trace in `tests/data/traces/` replayed through `tensoralloc_malloc` and
//!   `tensoralloc_free` on the simulated device, on streams of its own per trace (the
//!   allocations live when recording started are not recreated, and their frees skipped):
//!   ns per call and per trace event.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::path::PathBuf;
use std::time::Instant;

mod capi_work;
mod common;

use capi_work::{device_pair, glibc_pair, host_pair, populate_device, populate_host, stream};
use common::{in_threads, thread_cpu};
use tensoralloc::capi::device::{tensoralloc_empty_cache, tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::tensoralloc_last_error;
use tensoralloc::replay::snapshot::{self, TraceCall};

/// Nanoseconds per call of `f` over `n` calls: wall clock and the thread's CPU time.
fn ns_per(n: u64, f: impl Fn()) -> (f64, f64) {
    let (t, cpu) = (Instant::now(), thread_cpu());
    for _ in 0..n {
        f();
    }
    let cpu = (thread_cpu() - cpu).as_nanos() as f64 / n as f64;
    (t.elapsed().as_nanos() as f64 / n as f64, cpu)
}

/// Minimum, median and maximum.
fn spread(v: &[f64]) -> String {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let mid = if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    format!(
        "min {:8.2}  median {:8.2}  max {:8.2}",
        s[0],
        mid,
        s[s.len() - 1]
    )
}

fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn runs() -> usize {
    std::env::var("CAPI_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

fn pairs() {
    const N: u64 = 2_000_000;
    let streams = [0x1000, 0x2000, 0x3000, 0x4000];
    populate_device(streams);
    populate_host();
    let s = stream(streams[0]);
    device_pair(s);
    host_pair();
    // Wall clock, then the thread's CPU time (the figure to read when other work takes the
    // cores: wall time also counts time the thread waited for one).
    let mut figures: [[Vec<f64>; 5]; 2] = Default::default();
    println!(
        "pairs ({N} per figure per run; ns per pair, wall / CPU; load {})",
        uptime()
    );
    for run in 1..=runs() {
        let d = ns_per(N, || device_pair(s));
        let g = ns_per(N, glibc_pair);
        let h = ns_per(N, host_pair);
        println!(
            "  run {run:2}: device {:5.1} / {:5.1}  glibc {:5.1} / {:5.1}  device/glibc {:4.2} / {:4.2}  host {:5.1} / {:5.1}  host/glibc {:4.2} / {:4.2}",
            d.0, d.1, g.0, g.1, d.0 / g.0, d.1 / g.1, h.0, h.1, h.0 / g.0, h.1 / g.1
        );
        for (k, (d, g, h)) in [(d.0, g.0, h.0), (d.1, g.1, h.1)].into_iter().enumerate() {
            for (v, x) in figures[k].iter_mut().zip([d, g, d / g, h, h / g]) {
                v.push(x);
            }
        }
    }
    for (k, clock) in ["wall", "CPU"].into_iter().enumerate() {
        let [dev, glibc, ratio, host, host_ratio] = &figures[k];
        println!("  {clock}:");
        println!("    device pair (populated) ns: {}", spread(dev));
        println!("    glibc pair ns:              {}", spread(glibc));
        println!("    device / glibc:             {}", spread(ratio));
        println!("    host pair ns:               {}", spread(host));
        println!("    host / glibc:               {}", spread(host_ratio));
    }
    println!("  load after: {}", uptime());
}

fn threads_of(name: &str, work: fn(usize)) {
    const ITERS: u64 = 1_000_000;
    println!(
        "{name} threads ({ITERS} pairs per thread per run; load {})",
        uptime()
    );
    let mut scaling: HashMap<usize, Vec<f64>> = HashMap::new();
    let mut cpu_ns: HashMap<usize, Vec<f64>> = HashMap::new();
    let mut cores: HashMap<usize, Vec<f64>> = HashMap::new();
    for run in 1..=runs() {
        let mut line = format!("  run {run:2}:");
        let mut one = 0.0;
        for n in [1usize, 2, 4] {
            let (wall, cpu) = in_threads(n, ITERS, work);
            let wall_ns = wall.as_nanos() as f64 / ITERS as f64;
            let cpu_pair = cpu.as_nanos() as f64 / ITERS as f64;
            let throughput = n as f64 / wall_ns;
            if n == 1 {
                one = throughput;
            }
            let got = cpu_pair * n as f64 / wall_ns;
            line += &format!(
                "  N={n}: wall {wall_ns:6.1} cpu {cpu_pair:5.1} x{:4.2} cores {got:4.2}",
                throughput / one
            );
            scaling.entry(n).or_default().push(throughput / one);
            cpu_ns.entry(n).or_default().push(cpu_pair);
            cores.entry(n).or_default().push(got);
        }
        println!("{line}");
    }
    for n in [1usize, 2, 4] {
        println!("  N={n} scaling (wall):        {}", spread(&scaling[&n]));
        println!("  N={n} CPU ns per pair:       {}", spread(&cpu_ns[&n]));
        println!("  N={n} cores granted:         {}", spread(&cores[&n]));
    }
    println!("  load after: {}", uptime());
}

fn threads() {
    threads_of("device", |t| device_pair(stream(20 + t)));
    threads_of("device, one stream shared", |_| device_pair(stream(19)));
    threads_of("host", |_| host_pair());
}

fn replay() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| p.to_string_lossy().contains(".pickle"));
    files.sort();
    println!(
        "replay through the C functions (thread CPU time, best of 3; load {})\n  {:36} {:>9} {:>9} {:>11} {:>11}",
        uptime(),
        "trace",
        "events",
        "calls",
        "ns/call",
        "ns/event"
    );
    let mut per_call = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let trace = match snapshot::load(file, 0) {
            Ok(t) => t,
            Err(e) => {
                println!("  {name:36} unreadable: {e}");
                continue;
            }
        };
        // The calls, with the trace's addresses resolved to slots beforehand so the timed
        // loop does nothing but call.
        let (ops, used) = trace.calls();
        let calls = ops.len() as u64;
        let mut best = f64::INFINITY;
        for round in 0..3 {
            // Streams of their own, so no earlier replay's cache serves this one.
            let base = ((i * 3 + round + 1) as u64) << 32;
            let mut ptrs: Vec<(*mut c_void, u64)> = vec![(std::ptr::null_mut(), 0); used];
            let mut failed = 0u64;
            let t = thread_cpu();
            for &op in &ops {
                match op {
                    TraceCall::Malloc {
                        slot,
                        size,
                        stream: s,
                    } => {
                        let s = base + s;
                        let p = tensoralloc_malloc(size, 0, stream(s as usize));
                        failed += (p.is_null() && size > 0) as u64;
                        ptrs[slot] = (p, s);
                    }
                    TraceCall::Free { slot } => {
                        let (p, s) = ptrs[slot];
                        tensoralloc_free(p, 0, 0, stream(s as usize));
                        ptrs[slot].0 = std::ptr::null_mut();
                    }
                }
            }
            best = best.min((thread_cpu() - t).as_nanos() as f64);
            if failed > 0 {
                // SAFETY: the last error is a NUL-terminated string owned by this thread.
                let why = unsafe { CStr::from_ptr(tensoralloc_last_error()) };
                panic!("{name}: {failed} allocations failed, the last: {why:?}");
            }
            for &(p, s) in &ptrs {
                tensoralloc_free(p, 0, 0, stream(s as usize));
            }
            tensoralloc_empty_cache();
        }
        let call = best / calls.max(1) as f64;
        per_call.push(call);
        println!(
            "  {name:36} {:>9} {:>9} {call:>11.1} {:>11.1}",
            trace.events.len(),
            calls,
            best / trace.events.len().max(1) as f64
        );
    }
    if !per_call.is_empty() {
        println!("  ns per call over traces:    {}", spread(&per_call));
    }
}

fn main() {
    // SAFETY: set before any thread starts or tensoralloc is called.
    unsafe {
        std::env::set_var("TENSORALLOC_DRIVER", "sim");
        if std::env::var_os("TENSORALLOC_SIM_MEMORY").is_none() {
            std::env::set_var("TENSORALLOC_SIM_MEMORY", "256GiB");
        }
    }
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let want = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
    if want("pairs") {
        pairs();
    }
    if want("threads") {
        threads();
    }
    if want("replay") {
        replay();
    }
}

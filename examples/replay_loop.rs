//! Replays one snapshot many times under one configuration and prints its peaks and the best
//! and median ns per event (for profiling a policy on one trace).
//!
//! `cargo run --release --example replay_loop -- TRACE CONFIG [RUNS]`

use tensoralloc::replay::{self, snapshot, UNLIMITED_MEMORY};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (path, conf) = (&args[1], &args[2]);
    let runs: usize = args.get(3).map_or(20, |r| r.parse().unwrap());
    let trace = snapshot::load(std::path::Path::new(path), 0).unwrap();
    let config = replay::parse_config(conf).unwrap();
    let reports: Vec<_> = (0..runs.max(1))
        .map(|_| replay::run(&trace, &config, UNLIMITED_MEMORY).unwrap())
        .collect();
    let mut ns: Vec<f64> = reports.iter().map(|r| r.ns_per_event).collect();
    ns.sort_by(f64::total_cmp);
    let r = &reports[0];
    println!(
        "{conf}: allocated {} reserved {} ({:.4}x), {} device allocations; best {:.0} median {:.0} ns/event",
        r.peak_allocated_bytes,
        r.peak_reserved_bytes,
        r.ratio(),
        r.num_device_alloc,
        ns[0],
        ns[ns.len() / 2]
    );
}

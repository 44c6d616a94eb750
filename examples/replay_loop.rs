//! Replays one snapshot many times under one configuration and prints the best and median
//! ns per event (for profiling a policy on one trace).
//!
//! `cargo run --release --example replay_loop -- TRACE CONFIG [RUNS]`

use tensoralloc::replay::{self, snapshot, UNLIMITED_MEMORY};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (path, conf) = (&args[1], &args[2]);
    let runs: usize = args.get(3).map_or(20, |r| r.parse().unwrap());
    let trace = snapshot::load(std::path::Path::new(path), 0).unwrap();
    let config = replay::parse_config(conf).unwrap();
    let mut ns: Vec<f64> = (0..runs)
        .map(|_| {
            replay::run(&trace, &config, UNLIMITED_MEMORY)
                .unwrap()
                .ns_per_event
        })
        .collect();
    ns.sort_by(f64::total_cmp);
    println!(
        "{conf}: best {:.0} median {:.0} ns/event",
        ns[0],
        ns[runs / 2]
    );
}

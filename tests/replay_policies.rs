//! The shared PyTorch snapshots replayed under `expandable_segments:True` and
//! `policy:compact`: how much each reserves for the same allocations, against PyTorch's own
//! figures (the traces README and the measurements on the H100 that recorded them).

use std::collections::HashMap;
use std::path::PathBuf;

use tensoralloc::config::Config;
use tensoralloc::replay::{self, snapshot, Action, Report, Trace, UNLIMITED_MEMORY};

const EXPANDABLE: &str = "expandable_segments:True";
const COMPACT: &str = "policy:compact";

fn load(name: &str) -> Trace {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/traces")
        .join(name);
    snapshot::load(&path, 0).unwrap()
}

fn replay(trace: &Trace, conf: &str) -> Report {
    let report = replay::run(trace, &Config::parse(conf).unwrap(), UNLIMITED_MEMORY).unwrap();
    assert_eq!(report.ooms, 0, "{conf}");
    eprintln!(
        "{conf:>26}: allocated {} reserved {} ({:.3}x), {:.0} ns/event, {} device allocations",
        report.peak_allocated_bytes,
        report.peak_reserved_bytes,
        report.ratio(),
        report.ns_per_event,
        report.num_device_alloc
    );
    report
}

/// The most bytes live at once when a block counts until its `free_completed` (until the
/// other streams that used it are done with it): no allocator can reserve less.
fn peak_live_until_free_completed(trace: &Trace) -> u64 {
    let (mut live, mut peak) = (0u64, 0u64);
    let mut sizes = HashMap::new();
    for e in &trace.events {
        match e.action {
            Action::Alloc => {
                live += e.size;
                sizes.insert(e.addr, e.size);
                peak = peak.max(live);
            }
            Action::FreeCompleted => live -= sizes.remove(&e.addr).unwrap_or(0),
            _ => {}
        }
    }
    peak
}

#[test]
fn gpt2_serving_needs_no_more_than_pytorchs_expandable_segments() {
    let trace = load("h100_gpt2_serve.pickle.gz");
    let expandable = replay(&trace, EXPANDABLE);
    // PyTorch's expandable mode reserved 5.38 GB for this workload on the H100.
    assert!(expandable.peak_reserved_bytes <= 5_380_000_000);
    assert!(expandable.ratio() < 1.05);
    let compact = replay(&trace, COMPACT);
    assert!(compact.peak_reserved_bytes <= expandable.peak_reserved_bytes);
    assert!(compact.ratio() <= 1.005, "{}", compact.ratio());
}

#[test]
fn gpt2_training_under_compact_reserves_within_half_a_percent_of_allocated() {
    let trace = load("h100_gpt2_train.pickle.gz");
    let expandable = replay(&trace, EXPANDABLE);
    // PyTorch's expandable mode: 14.54 GB.
    assert!(expandable.peak_reserved_bytes <= 14_550_000_000);
    let compact = replay(&trace, COMPACT);
    assert!(compact.ratio() <= 1.005, "{}", compact.ratio());
    assert!(compact.peak_reserved_bytes <= expandable.peak_reserved_bytes);
}

#[test]
fn resnet50_training_stays_within_one_percent_under_expandable_and_0_4_percent_under_compact() {
    let trace = load("h100_resnet50_train.pickle.gz");
    let expandable = replay(&trace, EXPANDABLE);
    assert!(expandable.ratio() <= 1.01);
    let compact = replay(&trace, COMPACT);
    assert!(compact.ratio() <= 1.004, "{}", compact.ratio());
    assert!(compact.peak_reserved_bytes <= expandable.peak_reserved_bytes);
}

#[test]
fn multistream_compact_reserves_close_to_what_other_streams_still_use() {
    let trace = load("h100_multistream.pickle.gz");
    let live = peak_live_until_free_completed(&trace);
    let expandable = replay(&trace, EXPANDABLE);
    // PyTorch's expandable mode: 5.12 GB.
    assert!(expandable.peak_reserved_bytes <= 5_120_000_000);
    let compact = replay(&trace, COMPACT);
    assert!(compact.peak_reserved_bytes < expandable.peak_reserved_bytes);
    assert!(
        (compact.peak_reserved_bytes as f64) <= live as f64 * 1.04,
        "{} reserved for {live} live until their frees completed",
        compact.peak_reserved_bytes
    );
}

#[test]
fn finetuning_and_warm_traces_stay_within_two_percent() {
    for name in [
        "decomfl_opt_finetune.pickle.gz",
        "cs336_transformer_fwd_bwd.pickle.gz",
    ] {
        let trace = load(name);
        let expandable = replay(&trace, EXPANDABLE);
        assert!(expandable.ratio() <= 1.02, "{name}");
        let compact = replay(&trace, COMPACT);
        assert!(compact.ratio() <= 1.02, "{name}");
        assert!(
            compact.peak_reserved_bytes <= expandable.peak_reserved_bytes,
            "{name}"
        );
    }
}

#[test]
fn finetuning_from_an_empty_allocator_under_compact_stays_within_half_a_percent() {
    let trace = load("decomfl_opt_finetune.pickle.gz");
    let compact = replay(&trace, COMPACT);
    assert!(compact.ratio() <= 1.005, "{}", compact.ratio());
}

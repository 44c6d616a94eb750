//! The shared PyTorch snapshots replay on the simulated device, under the default
//! configuration, to the reserved peaks PyTorch recorded on the GPU.

use std::path::PathBuf;

use tensoralloc::config::Config;
use tensoralloc::replay::{self, snapshot, UNLIMITED_MEMORY};

fn trace_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/traces")
        .join(name)
}

fn replays_to(name: &str, recorded_peak_reserved: u64) {
    let trace = snapshot::load(&trace_path(name), 0).unwrap();
    // The peak the recording allocator reached, from its own segment events.
    assert_eq!(
        trace.recorded_peak_reserved(),
        recorded_peak_reserved,
        "{name}: recorded"
    );
    let report = replay::run(&trace, &Config::default(), UNLIMITED_MEMORY).unwrap();
    assert_eq!(
        report.peak_reserved_bytes, recorded_peak_reserved,
        "{name}: replayed"
    );
    assert_eq!(report.ooms, 0);
    eprintln!("{name}: {report:?}");
}

#[test]
fn gpt2_serving_replays_to_the_recorded_reserved_peak() {
    replays_to("h100_gpt2_serve.pickle.gz", 16_745_758_720);
}

#[test]
fn gpt2_training_replays_to_the_recorded_reserved_peak() {
    replays_to("h100_gpt2_train.pickle.gz", 15_286_140_928);
}

#[test]
fn resnet50_training_replays_to_the_recorded_reserved_peak() {
    replays_to("h100_resnet50_train.pickle.gz", 6_824_132_608);
}

#[test]
fn multistream_trace_replays_to_the_recorded_reserved_peak() {
    replays_to("h100_multistream.pickle.gz", 5_108_662_272);
}

#[test]
fn opt_finetuning_replays_to_the_recorded_reserved_peak() {
    replays_to("decomfl_opt_finetune.pickle.gz", 1_897_922_560);
}

#[test]
fn a_trace_recorded_after_warm_up_starts_from_its_recorded_segments() {
    // Recording started with 216 segments already reserved and 229 blocks live; PyTorch
    // allocated no segment during the trace, and neither may the replay.
    let trace = snapshot::load(&trace_path("cs336_transformer_fwd_bwd.pickle.gz"), 0).unwrap();
    assert_eq!(trace.initial.len(), 216);
    assert_eq!(
        trace.initial.iter().map(|s| s.live.len()).sum::<usize>(),
        229
    );
    assert_eq!(trace.initial_reserved(), 14_180_941_824);
    let report = replay::run(&trace, &Config::default(), UNLIMITED_MEMORY).unwrap();
    assert_eq!(report.initial_reserved_bytes, 14_180_941_824);
    assert_eq!(report.peak_reserved_bytes, 14_180_941_824);
    assert_eq!(report.num_device_alloc, 0);
}

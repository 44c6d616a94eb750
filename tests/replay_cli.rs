//! The `tensoralloc replay` command: tables, JSON, SVG, configurations compared side by side,
//! and clear errors for files that are not snapshots.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};

fn trace(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/traces")
        .join(name)
}

fn tensoralloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensoralloc"))
        .args(args)
        .output()
        .unwrap()
}

/// `tensoralloc replay` of a shared trace with each of `configs`, then `extra` arguments.
fn replay_configs(name: &str, configs: &[&str], extra: &[&str]) -> Output {
    let t = trace(name);
    let mut args = vec!["replay", t.to_str().unwrap()];
    for c in configs {
        args.extend(["--config", c]);
    }
    args.extend(extra);
    tensoralloc(&args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn scratch(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
    path
}

#[test]
fn json_prints_one_object_per_configuration_with_the_documented_fields() {
    let o = replay_configs(
        "h100_multistream.pickle.gz",
        &["default", "max_split_size_mb:64"],
        &["--json"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["config"], "default");
    assert_eq!(lines[0]["peak_reserved_bytes"], 5_108_662_272u64);
    assert_eq!(lines[0]["peak_allocated_bytes"], 218_112_000u64);
    assert_eq!(lines[0]["num_device_alloc"], 182);
    assert_eq!(lines[0]["ooms"], 0);
    assert!(lines[0]["first_oom_event"].is_null());
    assert_eq!(lines[1]["config"], "max_split_size_mb:64");
    assert!(lines[1]["peak_reserved_bytes"].is_u64());
}

#[test]
fn too_little_memory_reports_the_first_failing_allocation() {
    let t = trace("h100_gpt2_serve.pickle.gz");
    let o = tensoralloc(&["replay", t.to_str().unwrap(), "--memory", "5GiB", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["ooms"].as_u64().unwrap() > 0);
    let first = &v["first_oom_event"];
    assert!(first["index"].as_u64().unwrap() > 0);
    assert!(first["size"].as_u64().unwrap() > 0);
    assert!(v["peak_reserved_bytes"].as_u64().unwrap() <= 5 << 30);
}

#[test]
fn the_table_compares_configurations_and_marks_rejected_ones_unsupported() {
    let o = replay_configs(
        "h100_resnet50_train.pickle.gz",
        &["default", "no_such_option:1"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("6.36 GiB"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("no_such_option:1") && l.contains("unsupported")),
        "{out}"
    );
}

#[test]
fn svg_draws_a_chart_of_each_configuration() {
    let svg = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("multistream.svg");
    let o = replay_configs(
        "h100_multistream.pickle.gz",
        &["default", "max_split_size_mb:64"],
        &["--svg", svg.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
    assert!(text.contains("reserved (default)"));
    assert!(text.contains("reserved (max_split_size_mb:64)"));
    assert!(text.contains("<polyline"));
}

#[test]
fn a_file_that_is_not_a_snapshot_is_a_clear_error() {
    let p = scratch("not_a_snapshot.txt", b"hello, world\n");
    let o = tensoralloc(&["replay", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("not a memory snapshot"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_truncated_gzip_snapshot_is_a_clear_error() {
    let bytes = std::fs::read(trace("h100_multistream.pickle.gz")).unwrap();
    let p = scratch("truncated.pickle.gz", &bytes[..bytes.len() / 2]);
    let o = tensoralloc(&["replay", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("damaged gzip"), "{}", stderr(&o));
}

#[test]
fn a_bad_memory_size_is_a_clear_error() {
    let t = trace("h100_multistream.pickle.gz");
    let o = tensoralloc(&["replay", t.to_str().unwrap(), "--memory", "lots"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--memory"), "{}", stderr(&o));
}

#[test]
fn a_warm_trace_whose_starting_segments_exceed_the_memory_does_not_fit_and_is_no_error() {
    // cs336 starts with 13.21 GiB reserved.
    let o = replay_configs(
        "cs336_transformer_fwd_bwd.pickle.gz",
        &["default", "expandable_segments:True"],
        &["--memory", "8GiB"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for config in ["default ", "expandable_segments:True "] {
        assert!(
            out.lines().any(|l| l.starts_with(config)
                && l.contains("does not fit: the 13.21 GiB reserved when recording started")
                && l.contains("8.00 GiB")),
            "{out}"
        );
    }
    assert!(!out.contains("unsupported"), "{out}");
    let o = replay_configs(
        "cs336_transformer_fwd_bwd.pickle.gz",
        &["default"],
        &["--memory", "8GiB", "--json"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(
        v["does_not_fit"].as_str().unwrap().contains("13.21 GiB"),
        "{v}"
    );
    assert!(
        v["error"].is_null() && v["peak_reserved_bytes"].is_null(),
        "{v}"
    );
}

#[test]
fn an_empty_config_is_a_usage_error() {
    let o = replay_configs("h100_multistream.pickle.gz", &["default", " "], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--config needs settings"),
        "{}",
        stderr(&o)
    );
    assert!(stdout(&o).is_empty());
}

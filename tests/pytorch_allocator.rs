//! tensoralloc against PyTorch's own CUDA caching allocator (the pinned torch wheel's
//! `libc10_cuda.so`, running on a stand-in CUDA runtime), call for call over the real
//! snapshots in `tests/data/traces/`.

use std::path::PathBuf;

#[path = "pytorch_native/harness.rs"]
mod harness;
mod support;

/// Builds the replay program and writes the calls to replay; removes them when dropped.
struct Setup {
    dir: PathBuf,
    exe: PathBuf,
    ops: Vec<PathBuf>,
}

impl Setup {
    /// The calls of the six real traces.
    fn new(name: &str) -> Setup {
        let mut s = Setup::empty(name);
        let traces = harness::traces();
        assert!(
            traces.len() >= 6,
            "expected the six real traces, found {traces:?}"
        );
        s.ops = traces
            .iter()
            .map(|t| harness::write_ops(t, &s.dir))
            .collect();
        s
    }

    /// Three seeded random workloads of 12,000 calls, with private pool phases if `pools`.
    fn random(name: &str, pools: bool) -> Setup {
        let mut s = Setup::empty(name);
        s.ops = (0..3)
            .map(|seed| harness::write_random_ops(seed, 12_000, pools, &s.dir))
            .collect();
        s
    }

    fn empty(name: &str) -> Setup {
        let dir =
            std::env::temp_dir().join(format!("tensoralloc-pytorch-{name}-{}", std::process::id()));
        let exe = harness::build(&dir, &harness::lib_dir());
        Setup {
            dir,
            exe,
            ops: Vec::new(),
        }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Replays `ops` for `rounds` rounds with the PyTorch setting `conf` (for both allocators)
/// and, if given, memory fraction `fraction` set on both; every statistic must agree.
fn assert_same_statistics(
    exe: &std::path::Path,
    ops: &[PathBuf],
    rounds: u32,
    conf: &str,
    fraction: Option<&str>,
) {
    let mut env = vec![("PYTORCH_CUDA_ALLOC_CONF", conf)];
    if let Some(f) = fraction {
        env.push(("FRACTION", f));
    }
    let (ok, out) = harness::replay(exe, ops, rounds, &env);
    assert!(
        ok && out.contains("0 statistics differ"),
        "`{conf}`, fraction {fraction:?}:\n{out}"
    );
}

/// Every device statistic PyTorch reports (each counter's current, peak, allocated and freed
/// values for every pool, and the retry, OOM and driver-call counts) agrees.
#[test]
fn default_policy_statistics_equal_pytorchs_on_real_traces() {
    let s = Setup::new("default");
    // Two rounds: the second starts from the cache the first left after emptying it.
    let (ok, out) = harness::replay(&s.exe, &s.ops, 2, &[]);
    assert!(ok, "statistics differ from PyTorch's allocator:\n{out}");
    assert!(out.contains("0 statistics differ"), "{out}");
    assert_eq!(harness::peaks(&out).len(), s.ops.len(), "{out}");
}

/// PyTorch's settings give PyTorch's results too: `max_split_size_mb`,
/// `large_segment_size_mb`, `max_non_split_rounding_mb`, both forms of
/// `roundup_power2_divisions`, and `garbage_collection_threshold` with a memory fraction (set
/// by call or by `per_process_memory_fraction`),
/// including fractions too small for the traces, where both fail the same requests.
#[test]
fn settings_and_memory_fractions_give_pytorchs_statistics() {
    let s = Setup::new("settings");
    for (conf, fraction) in [
        ("max_split_size_mb:128", None),
        ("large_segment_size_mb:40", None),
        ("max_non_split_rounding_mb:100,max_split_size_mb:100", None),
        ("roundup_power2_divisions:4", None),
        ("roundup_power2_divisions:[256:1,512:2,>:8]", None),
        ("garbage_collection_threshold:0.5", Some("0.25")),
        (
            "max_split_size_mb:40,garbage_collection_threshold:0.6",
            Some("0.1"),
        ),
        (
            "max_split_size_mb:300,roundup_power2_divisions:[64:2,256:4]",
            Some("0.05"),
        ),
        (
            "per_process_memory_fraction:0.25,garbage_collection_threshold:0.5",
            None,
        ),
        // A fraction of 1.0 sets none: collection stays off, as in PyTorch.
        (
            "per_process_memory_fraction:1.0,garbage_collection_threshold:0.1",
            None,
        ),
    ] {
        assert_same_statistics(&s.exe, &s.ops, 1, conf, fraction);
    }
}

/// Seeded random workloads on four streams, beyond what the traces do: every statistic agrees
/// by default, under PyTorch's settings, and under memory fractions small enough that both
/// fail requests.
#[test]
fn random_workloads_give_pytorchs_statistics() {
    let s = Setup::random("random", false);
    for (conf, fraction) in [
        ("", None),
        ("max_split_size_mb:100", None),
        ("", Some("0.05")),
        (
            "garbage_collection_threshold:0.6,max_split_size_mb:64",
            Some("0.08"),
        ),
        ("roundup_power2_divisions:[32:4,256:2,>:1]", Some("0.1")),
        ("expandable_segments:True", None),
    ] {
        assert_same_statistics(&s.exe, &s.ops, 2, conf, fraction);
    }
}

/// Private pools (PyTorch's `beginAllocateToPool`, as a CUDA graph capture or a
/// `torch.cuda.MemPool` uses them) route the same requests as in PyTorch: every statistic
/// agrees with pools begun, ended and released at the end, under memory pressure too (no
/// retry while a pool is being allocated to, as in PyTorch).
#[test]
fn private_pools_give_pytorchs_statistics() {
    let s = Setup::random("pools", true);
    for (conf, fraction) in [
        ("", None),
        ("", Some("0.05")),
        ("max_split_size_mb:100", Some("0.1")),
    ] {
        assert_same_statistics(&s.exe, &s.ops, 2, conf, fraction);
    }
}

/// Under `expandable_segments:True` for both, every statistic agrees too (PyTorch counts no
/// segments and no inactive split blocks for expandable segments), and `policy:compact`
/// reserves at most what PyTorch's expandable segments reserve.
#[test]
fn expandable_segments_equal_pytorchs_and_compact_reserves_no_more() {
    let s = Setup::new("expandable");
    for (what, ours, exact) in [
        ("expandable_segments:True", "expandable_segments:True", "1"),
        ("policy:compact", "policy:compact", "0"),
    ] {
        let (ok, out) = harness::replay(
            &s.exe,
            &s.ops,
            1,
            &[
                ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
                ("TENSORALLOC_CONF", ours),
                ("EXACT", exact),
            ],
        );
        assert!(ok, "{what}: the replay failed or statistics differ:\n{out}");
        if exact == "1" {
            assert!(out.contains("0 statistics differ"), "{out}");
        }
        let peaks = harness::peaks(&out);
        assert_eq!(peaks.len(), s.ops.len(), "{out}");
        for (trace, torch, ours) in peaks {
            assert!(
                ours <= torch,
                "{what} on {trace}: tensoralloc reserved {ours} bytes, PyTorch's expandable segments {torch}"
            );
        }
    }
}

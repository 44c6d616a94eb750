//! tensoralloc against PyTorch's own CUDA caching allocator (the pinned torch wheel's
//! `libc10_cuda.so`, running on a stand-in CUDA runtime), call for call over the real
//! snapshots in `tests/data/traces/`.

use std::path::PathBuf;

#[path = "pytorch_native/harness.rs"]
mod harness;
mod support;

/// Builds the replay program and writes the traces' calls; removes them when dropped.
struct Setup {
    dir: PathBuf,
    exe: PathBuf,
    ops: Vec<PathBuf>,
}

impl Setup {
    fn new(name: &str) -> Setup {
        let dir =
            std::env::temp_dir().join(format!("tensoralloc-pytorch-{name}-{}", std::process::id()));
        let exe = harness::build(&dir, &harness::lib_dir());
        let traces = harness::traces();
        assert!(
            traces.len() >= 6,
            "expected the six real traces, found {traces:?}"
        );
        let ops = traces.iter().map(|t| harness::write_ops(t, &dir)).collect();
        Setup { dir, exe, ops }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
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

/// Under `expandable_segments:True` for both, tensoralloc reserves at most what PyTorch's
/// expandable segments reserve, and `policy:compact` at most that too.
#[test]
fn expandable_and_compact_reserve_no_more_than_pytorchs_expandable_segments() {
    let s = Setup::new("expandable");
    for (what, ours) in [
        ("expandable_segments:True", "expandable_segments:True"),
        ("policy:compact", "policy:compact"),
    ] {
        let (ok, out) = harness::replay(
            &s.exe,
            &s.ops,
            1,
            &[
                ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
                ("TENSORALLOC_CONF", ours),
                ("EXACT", "0"),
            ],
        );
        assert!(ok, "{what}: the replay failed:\n{out}");
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

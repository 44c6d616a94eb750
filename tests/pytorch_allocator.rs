//! tensoralloc's default policy against PyTorch's own CUDA caching allocator (the pinned
//! torch wheel's `libc10_cuda.so`, running on a stand-in CUDA runtime), call for call over the
//! real snapshots in `tests/data/traces/`: every device statistic PyTorch reports must come
//! out the same, counters of each pool included.

#[path = "pytorch_native/harness.rs"]
mod harness;

#[test]
fn every_statistic_matches_pytorchs_own_allocator_on_real_traces() {
    let dir = std::env::temp_dir().join(format!("tensoralloc-pytorch-{}", std::process::id()));
    let exe = harness::build(&dir, &harness::lib_dir());
    let traces = harness::traces();
    assert!(
        traces.len() >= 6,
        "expected the six real traces, found {traces:?}"
    );
    let ops: Vec<_> = traces.iter().map(|t| harness::write_ops(t, &dir)).collect();
    // Two rounds: the second starts from the cache the first left after emptying it.
    let (ok, out) = harness::replay(&exe, &ops, 2);
    std::fs::remove_dir_all(&dir).ok();
    assert!(ok, "statistics differ from PyTorch's allocator:\n{out}");
    assert!(out.contains("0 statistics differ"), "{out}");
}

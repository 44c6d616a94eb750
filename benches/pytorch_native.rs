//! Time per allocator call of PyTorch's own CUDA caching allocator and of tensoralloc's C
//! functions, replaying the real snapshots in `tests/data/traces/` in one process
//! (`tests/pytorch_native/replay.cpp`; PyTorch's `libc10_cuda.so` runs on a stand-in CUDA
//! runtime, tensoralloc on the simulated device). Thread CPU time, best of `ROUNDS` rounds
//! (default 5); prints ns per call and per trace event of each, and their ratio.
//! `PYTORCH_CUDA_ALLOC_CONF` reaches both allocators and `TENSORALLOC_CONF` overrides it for
//! tensoralloc; `EXACT=0` skips the statistics comparison (for settings that are not
//! PyTorch's, such as `policy:compact`).
//!
//! `cargo bench --bench pytorch_native` after `scripts/fetch-torch-headers` (which also
//! unpacks PyTorch's allocator libraries into `target/torch-lib`).

#[allow(dead_code)] // the statistics test also uses the harness
#[path = "../tests/pytorch_native/harness.rs"]
mod harness;
#[path = "../tests/support/mod.rs"]
mod support;

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` run passes nothing and
    // only checks that this builds.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let lib = harness::lib_dir();
    let dir =
        std::env::temp_dir().join(format!("tensoralloc-pytorch-bench-{}", std::process::id()));
    let exe = harness::build(&dir, &lib);
    let ops: Vec<_> = harness::traces()
        .iter()
        .map(|t| harness::write_ops(t, &dir))
        .collect();
    let rounds = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    // Settings pass through: `PYTORCH_CUDA_ALLOC_CONF` reaches both allocators, and
    // `TENSORALLOC_CONF` overrides it for tensoralloc.
    let settings: Vec<(String, String)> = ["PYTORCH_CUDA_ALLOC_CONF", "TENSORALLOC_CONF", "EXACT"]
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
        .collect();
    let env: Vec<(&str, &str)> = settings
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let (ok, out) = harness::replay(&exe, &ops, rounds, &env);
    print!("{out}");
    std::fs::remove_dir_all(&dir).ok();
    assert!(ok, "the replay failed");
}

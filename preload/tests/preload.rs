//! The preload library in front of unmodified C programs on the fake driver (`libfakecuda.so`
//! as `libcuda.so.1`): each program runs without and with `LD_PRELOAD`; the lines it prints
//! starting with `result:` must be the same, and the fake driver's counters (`count:` lines)
//! show what reached the driver. Needs `cargo build --workspace` first (scripts/test does it)
//! and NVIDIA's headers (`scripts/fetch-cuda-headers`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// target/<profile>.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn built(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(
        p.is_file(),
        "{} is not built: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// The library `cargo test` just built (`deps/`: it does not copy a cdylib up to the profile
/// directory, where `cargo build` puts it).
fn preload_lib() -> PathBuf {
    let fresh = profile_dir().join("deps/libtensoralloc_preload.so");
    if fresh.is_file() {
        return fresh;
    }
    built("libtensoralloc_preload.so")
}

/// A directory where the fake driver is `libcuda.so` and `libcuda.so.1`.
fn fake_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let fake = built("libfakecuda.so");
        let dir = profile_dir().join("preload-tests").join("lib");
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["libcuda.so", "libcuda.so.1"] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&fake, &link).unwrap();
        }
        dir
    })
}

fn cuda_include() -> PathBuf {
    let dir = std::env::var_os("CUDA_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/cuda-include")
        });
    assert!(
        dir.join("cuda.h").is_file(),
        "NVIDIA's cuda.h is not in {}: run scripts/fetch-cuda-headers",
        dir.display()
    );
    dir
}

fn c_source(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"))
}

/// Runs the C compiler with the project's warnings and NVIDIA's headers.
fn compile(what: &str, args: impl IntoIterator<Item = std::ffi::OsString>) {
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-I"])
        .arg(cuda_include())
        .args(args)
        .output()
        .expect("run the C compiler");
    assert!(
        out.status.success(),
        "{what} does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `libcudart.so` on the fake driver: `tests/c/fake_cudart.c`, next to the fake driver.
fn fake_runtime() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = fake_dir();
        compile(
            "fake_cudart.c",
            [
                "-shared".into(),
                "-fPIC".into(),
                "-o".into(),
                dir.join("libcudart.so").into_os_string(),
                c_source("fake_cudart").into_os_string(),
                "-L".into(),
                dir.as_os_str().to_owned(),
                "-lcuda".into(),
            ],
        );
    });
}

/// Compiles `tests/c/<source>.c` as `<exe>` with `defines`, once per test run.
fn program_variant(source: &str, exe: &'static str, defines: &[&str]) -> PathBuf {
    static BUILT: OnceLock<std::sync::Mutex<Vec<(&'static str, PathBuf)>>> = OnceLock::new();
    let built = BUILT.get_or_init(Default::default);
    let mut built = built.lock().unwrap();
    if let Some((_, p)) = built.iter().find(|(n, _)| *n == exe) {
        return p.clone();
    }
    let path = profile_dir().join("preload-tests").join(exe);
    let mut args: Vec<std::ffi::OsString> = defines.iter().map(Into::into).collect();
    args.extend([
        "-o".into(),
        path.clone().into_os_string(),
        c_source(source).into(),
    ]);
    let dir = fake_dir().as_os_str().to_owned();
    match source {
        "driver_direct" => args.extend(["-L".into(), dir, "-lcuda".into()]),
        "runtime_async" => {
            fake_runtime();
            let mut rpath_link = std::ffi::OsString::from("-Wl,-rpath-link,");
            rpath_link.push(&dir);
            args.extend(["-L".into(), dir, rpath_link, "-lcudart".into()]);
        }
        _ => {}
    }
    args.extend(["-ldl".into(), "-lpthread".into()]);
    compile(&format!("{source}.c"), args);
    built.push((exe, path.clone()));
    path
}

/// Compiles `tests/c/<name>.c` once per test run.
fn program(name: &'static str) -> PathBuf {
    program_variant(name, name, &[])
}

struct Run {
    stdout: String,
    stderr: String,
}

impl Run {
    fn results(&self) -> Vec<&str> {
        self.stdout
            .lines()
            .filter(|l| l.starts_with("result:"))
            .collect()
    }

    /// The number at the end of the `count:` line that starts with `what`.
    fn count(&self, what: &str) -> u64 {
        let line = self
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("count: ")?.strip_prefix(what))
            .unwrap_or_else(|| panic!("no `count: {what}` line in:\n{}", self.stdout));
        line.trim().parse().unwrap()
    }
}

fn run_with(exe: &Path, args: &[&str], preload: bool, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("LD_LIBRARY_PATH", fake_dir())
        .env_remove("LD_PRELOAD")
        .env_remove("TENSORALLOC_PRELOAD")
        .env_remove("TENSORALLOC_PRELOAD_STATS");
    if preload {
        cmd.env("LD_PRELOAD", preload_lib());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out: Output = cmd.output().expect("run the program");
    let run = Run {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        out.status.success(),
        "{} {args:?} (preload: {preload}) failed ({}):\n{}{}",
        exe.display(),
        out.status,
        run.stdout,
        run.stderr
    );
    run
}

/// Runs `driver_direct <mode>` with the preload and the environment `env`.
fn driver_direct_with(mode: &str, env: &[(&str, &str)]) -> Run {
    run_with(&program("driver_direct"), &[mode], true, env)
}

/// Runs `driver_direct <mode>` with the preload; its results must be `expected`.
fn assert_preloaded_results(mode: &str, expected: &[&str]) {
    let r = run(&program("driver_direct"), &[mode], true);
    assert_eq!(r.results(), expected, "{}{}", r.stdout, r.stderr);
}

fn run(exe: &Path, args: &[&str], preload: bool) -> Run {
    run_with(exe, args, preload, &[])
}

/// Runs without and with the preload; the results must agree.
fn both(name: &'static str, args: &[&str]) -> (Run, Run) {
    both_at(&program(name), args)
}

fn both_at(exe: &Path, args: &[&str]) -> (Run, Run) {
    let plain = run(exe, args, false);
    let preloaded = run(exe, args, true);
    assert!(!plain.results().is_empty(), "no results:\n{}", plain.stdout);
    assert_eq!(
        plain.results(),
        preloaded.results(),
        "results differ with the preload:\n--- without\n{}\n--- with\n{}{}",
        plain.stdout,
        preloaded.stdout,
        preloaded.stderr
    );
    (plain, preloaded)
}

/// Without the preload every pair reached the driver; with it, at most 2 calls did (one
/// segment, perhaps one more while a batch of frees waits for its marker), and nothing was
/// said on stderr.
fn assert_cached(plain: &Run, preloaded: &Run, host_pairs: u64) {
    for (what, pairs) in [
        ("sync pairs mem_alloc", 10_000),
        ("async pairs mem_alloc", 10_000),
        ("host pairs host_alloc", host_pairs),
    ] {
        assert_eq!(plain.count(what), pairs, "{}", plain.stdout);
        assert!(preloaded.count(what) <= 2, "{what}:\n{}", preloaded.stdout);
    }
    assert!(preloaded.stderr.is_empty(), "{}", preloaded.stderr);
}

#[test]
fn a_driver_api_program_gets_the_same_results_and_cached_allocations() {
    let (plain, preloaded) = both("driver_direct", &["pairs"]);
    assert_cached(&plain, &preloaded, 2_000);
}

#[test]
fn a_program_reaching_the_driver_through_cu_get_proc_address_is_served_too() {
    let (plain, preloaded) = both("procaddr", &[]);
    assert_cached(&plain, &preloaded, 1_000);
}

/// A runtime API program's allocations are served by the runtime hooks (none reaches the
/// runtime) and cached (at most 2 reach the driver).
fn assert_runtime_served(plain: &Run, preloaded: &Run) {
    for what in ["sync pairs", "null stream pairs", "stream pairs"] {
        let (allocs, calls) = (format!("{what} mem_alloc"), format!("{what} runtime_calls"));
        assert_eq!(plain.count(&allocs), 10_000, "{}", plain.stdout);
        assert_eq!(plain.count(&calls), 20_000, "{}", plain.stdout);
        assert!(
            preloaded.count(&allocs) <= 2,
            "{what}:\n{}",
            preloaded.stdout
        );
        assert_eq!(preloaded.count(&calls), 0, "{what}:\n{}", preloaded.stdout);
    }
}

/// `runtime_async.c` built as with `--default-stream per-thread`: its stream-ordered calls are
/// the runtime's `_ptsz` functions.
fn runtime_ptsz_program() -> PathBuf {
    program_variant(
        "runtime_async",
        "runtime_async_ptsz",
        &["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"],
    )
}

#[test]
fn a_runtime_api_program_gets_the_same_results_and_cached_allocations() {
    let exe = program_variant("runtime_async", "runtime_async", &[]);
    let (plain, preloaded) = both_at(&exe, &["pairs"]);
    assert_runtime_served(&plain, &preloaded);
}

#[test]
fn the_per_thread_default_stream_runtime_calls_are_served_too() {
    let exe = runtime_ptsz_program();
    let (plain, preloaded) = both_at(&exe, &["pairs"]);
    assert!(plain
        .results()
        .contains(&"result: per-thread default stream"));
    assert_runtime_served(&plain, &preloaded);
}

#[test]
fn threads_sharing_the_per_thread_default_stream_handle_get_disjoint_blocks() {
    let exe = runtime_ptsz_program();
    let r = run(&exe, &["threads"], true);
    assert!(
        r.results()
            .contains(&"result: threads saw only their own data: yes"),
        "{}{}",
        r.stdout,
        r.stderr
    );
}

#[test]
fn a_double_free_returns_invalid_value_and_is_reported_once() {
    let (_, preloaded) = both("driver_direct", &["double-free"]);
    assert_eq!(
        preloaded.results(),
        [
            "result: second cuMemFree = 1",
            "result: another second cuMemFree = 1"
        ]
    );
    assert_eq!(
        preloaded.stderr.matches("not a live allocation").count(),
        1,
        "{}",
        preloaded.stderr
    );
}

#[test]
fn a_freed_block_waits_for_work_queued_before_the_free() {
    assert_preloaded_results(
        "marker",
        &[
            "result: reused while the legacy stream is busy: no",
            "result: reused once it completed: yes",
        ],
    );
}

#[test]
fn pinned_host_frees_share_one_marker_per_batch_and_their_blocks_come_back() {
    let (plain, preloaded) = both("driver_direct", &["host-batch"]);
    assert_eq!(plain.count("host batch host_alloc"), 64);
    // 64 frees, one batch: one marker on the legacy stream (no non-blocking stream exists).
    assert_eq!(
        preloaded.count("host batch event_records"),
        1,
        "{}",
        preloaded.stdout
    );
    assert!(
        preloaded.count("host batch events_created") <= 1,
        "{}",
        preloaded.stdout
    );
    assert_eq!(
        preloaded.count("host batch host_alloc"),
        0,
        "{}",
        preloaded.stdout
    );
}

#[test]
fn a_freed_pinned_block_waits_for_work_queued_before_the_free() {
    assert_preloaded_results(
        "host-marker",
        &[
            "result: pinned block reused while the legacy stream is busy: no",
            "result: pinned block reused once it completed: yes",
        ],
    );
}

#[test]
fn a_block_freed_in_stream_order_is_reused_on_its_stream_at_once_and_not_on_another() {
    assert_preloaded_results(
        "stream-reuse",
        &[
            "result: reused on another stream: no",
            "result: reused on its stream: yes",
        ],
    );
}

#[test]
fn blocks_kept_for_a_stream_are_given_back_when_it_is_destroyed() {
    let r = driver_direct_with("stream-reuse", &[("TENSORALLOC_PRELOAD_STATS", "1")]);
    // Both streams' last blocks were freed on them, then the streams destroyed.
    assert!(r.stderr.contains(" 0 bytes allocated ("), "{}", r.stderr);
}

/// Runs `mode` on a 16 MiB device without and with the preload: its large allocation, which
/// needs the memory of blocks freed before, must succeed both times.
fn assert_large_allocation_fits(mode: &str, result: &str) {
    let exe = program("driver_direct");
    for preload in [false, true] {
        let r = run_with(
            &exe,
            &[mode],
            preload,
            &[("TENSORALLOC_SIM_MEMORY", "16MiB")],
        );
        assert_eq!(
            r.results(),
            [result],
            "preload: {preload}\n{}{}",
            r.stdout,
            r.stderr
        );
    }
}

#[test]
fn blocks_kept_for_a_stream_are_given_back_when_memory_runs_short() {
    assert_large_allocation_fits("short", "result: 14 MiB on another stream = 0");
}

#[test]
fn blocks_kept_by_size_are_given_back_when_memory_runs_short() {
    assert_large_allocation_fits("short-sync", "result: 14 MiB = 0");
}

#[test]
fn a_bad_configuration_is_said_once_and_every_call_passes_through() {
    let r = driver_direct_with("pairs", &[("TENSORALLOC_CONF", "no_such_option:1")]);
    assert_eq!(r.count("sync pairs mem_alloc"), 10_000);
    assert_eq!(
        r.stderr.matches("tensoralloc preload: disabled").count(),
        1,
        "{}",
        r.stderr
    );
}

#[test]
fn preload_off_passes_every_call_through() {
    let exe = program("driver_direct");
    let off = run_with(&exe, &["pairs"], true, &[("TENSORALLOC_PRELOAD", "off")]);
    assert_eq!(off.count("sync pairs mem_alloc"), 10_000);
    assert_eq!(off.count("async pairs mem_alloc"), 10_000);
    let exe = program("procaddr");
    let off = run_with(&exe, &[], true, &[("TENSORALLOC_PRELOAD", "off")]);
    assert_eq!(off.count("sync pairs mem_alloc"), 10_000);
}

#[test]
fn a_program_that_never_touches_cuda_runs_unchanged() {
    let (_, preloaded) = both("no_cuda", &[]);
    assert!(preloaded.stderr.is_empty(), "{}", preloaded.stderr);
    assert!(preloaded
        .results()
        .contains(&"result: dlsym(RTLD_NEXT) works"));
}

#[test]
fn a_forked_child_passes_through_and_the_parent_keeps_its_cache() {
    let (_, preloaded) = both("driver_direct", &["fork"]);
    assert!(preloaded
        .results()
        .contains(&"result: child allocation reached the driver: yes"));
}

#[test]
fn threads_get_disjoint_blocks() {
    assert_preloaded_results("threads", &["result: threads saw only their own data: yes"]);
}

#[test]
fn statistics_are_printed_at_exit_when_asked() {
    let r = driver_direct_with("double-free", &[("TENSORALLOC_PRELOAD_STATS", "1")]);
    assert!(
        r.stderr
            .contains("tensoralloc preload: 2 device allocations served"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("2 invalid frees"), "{}", r.stderr);
    assert!(
        r.stderr.contains("device 0: 1 driver allocations"),
        "{}",
        r.stderr
    );
}

//! Without a usable NVIDIA driver, the CUDA backend (the default) fails cleanly with a message
//! that says what is wrong and how to run without a GPU: no `libcuda.so.1` at all, one too old
//! to have the entry points the backend calls, or one whose `cuInit` fails.
//!
//! Each check runs in a child process whose `LD_LIBRARY_PATH` names only what the check wants
//! the loader to find (nothing, or a stand-in `libcuda.so.1`). Where the system itself has a
//! `libcuda.so`, the loader would find it first and the scenario cannot be built on that
//! machine; the test says so.

mod cuda_support;

use std::process::Command;

use tensoralloc::driver::cuda::CudaDriver;
use tensoralloc::runtime::Runtime;

const CHILD: &str = "TENSORALLOC_TEST_NO_DRIVER_CHILD";

/// Whether the dynamic loader can find a `libcuda.so.1` in the system's own directories.
fn system_has_libcuda() -> bool {
    Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so"))
        .unwrap_or(false)
}

/// Runs `child_test` of this test binary in a child process with no driver selection and
/// `library_path` as `LD_LIBRARY_PATH`, and returns its output.
fn run_child_with(child_test: &str, library_path: &str, envs: &[(&str, &str)]) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            child_test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", library_path)
        .env_remove("TENSORALLOC_DRIVER")
        .envs(envs.iter().copied())
        .output()
        .expect("run the test binary again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    text
}

/// Runs `child_test` in a child process that can find no driver library.
fn run_child(child_test: &str) -> String {
    run_child_with(child_test, "", &[])
}

/// A fresh directory for a stand-in driver library.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tensoralloc-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The text after `marker` in the child's output.
fn error_line<'a>(text: &'a str, marker: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.split_once(marker).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no `{marker}` line in:\n{text}"))
}

#[test]
fn without_libcuda_the_backend_names_the_library_the_path_and_the_simulator() {
    if system_has_libcuda() {
        eprintln!(
            "this machine has a system libcuda.so: the no-driver case cannot be reproduced here"
        );
        return;
    }
    let text = run_child("child_loads_the_cuda_backend");
    let line = error_line(&text, "load error: ");
    assert!(line.contains("no driver:"), "{line}");
    assert!(line.contains("libcuda.so.1"), "{line}");
    assert!(line.contains("LD_LIBRARY_PATH"), "{line}");
    assert!(line.contains("TENSORALLOC_DRIVER=sim"), "{line}");
}

#[test]
fn without_libcuda_the_default_runtime_fails_with_the_same_explanation() {
    if system_has_libcuda() {
        eprintln!(
            "this machine has a system libcuda.so: the no-driver case cannot be reproduced here"
        );
        return;
    }
    let text = run_child("child_builds_the_runtime");
    let line = error_line(&text, "runtime error: ");
    assert!(line.contains("libcuda.so.1"), "{line}");
    assert!(line.contains("TENSORALLOC_DRIVER=sim"), "{line}");
}

#[test]
fn a_driver_without_the_needed_entry_points_is_reported_by_name() {
    if system_has_libcuda() {
        eprintln!(
            "this machine has a system libcuda.so: the old-driver case cannot be reproduced here"
        );
        return;
    }
    // A stand-in libcuda.so.1 that has cuInit and nothing else the backend calls.
    let dir = scratch_dir("old-driver");
    let src = dir.join("old.c");
    std::fs::write(
        &src,
        "unsigned cuInit(unsigned flags) { (void)flags; return 0; }\n",
    )
    .unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so.1"))
        .arg(&src)
        .status()
        .expect("run the C compiler");
    assert!(built.success(), "cannot build the stand-in driver");
    let text = run_child_with("child_loads_the_cuda_backend", dir.to_str().unwrap(), &[]);
    let _ = std::fs::remove_dir_all(&dir);
    let line = error_line(&text, "load error: ");
    assert!(line.contains("lacks"), "{line}");
    assert!(line.contains("cuMemAlloc_v2"), "{line}");
    assert!(line.contains("TENSORALLOC_DRIVER=sim"), "{line}");
}

#[test]
fn a_driver_whose_cuinit_fails_is_reported_with_the_driver_error() {
    if system_has_libcuda() {
        eprintln!("this machine has a system libcuda.so: the failing-cuInit case cannot be reproduced here");
        return;
    }
    // The fake driver refuses to initialize with an impossible device count.
    let dir = scratch_dir("bad-init");
    std::os::unix::fs::symlink(cuda_support::fake_library_path(), dir.join("libcuda.so.1"))
        .unwrap();
    let text = run_child_with(
        "child_loads_the_cuda_backend",
        dir.to_str().unwrap(),
        &[("TENSORALLOC_SIM_DEVICES", "0")],
    );
    let _ = std::fs::remove_dir_all(&dir);
    let line = error_line(&text, "load error: ");
    assert!(line.contains("no driver:"), "{line}");
    assert!(
        line.contains("cuInit failed: CUDA_ERROR_INVALID_VALUE"),
        "{line}"
    );
    assert!(line.contains("TENSORALLOC_DRIVER=sim"), "{line}");
}

#[test]
#[ignore = "runs only as the child process of a no-driver test"]
fn child_loads_the_cuda_backend() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    match CudaDriver::load() {
        Ok(_) => println!("load succeeded"),
        Err(e) => println!("load error: {e}"),
    }
}

#[test]
#[ignore = "runs only as the child process of a no-driver test"]
fn child_builds_the_runtime() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    match Runtime::get() {
        Ok(r) => println!("runtime driver: {}", r.driver().name()),
        Err(e) => println!("runtime error: {e}"),
    }
}

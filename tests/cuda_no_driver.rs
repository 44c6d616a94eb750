//! Without an NVIDIA driver, the CUDA backend (the default) fails cleanly with a message that
//! says what is missing and how to run without a GPU.
//!
//! The check runs in a child process started with an empty `LD_LIBRARY_PATH`, so that no fake
//! or real `libcuda.so.1` can be found (unless the system itself has one: then the scenario
//! cannot be built on this machine and the test says so).

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

/// Runs `child_test` of this test binary in a child process with no library path and no
/// driver selection, and returns its output.
fn run_child(child_test: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            child_test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", "")
        .env_remove("TENSORALLOC_DRIVER")
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

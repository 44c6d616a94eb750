//! Environment variables reach the C ABI: bad values give NULL and a last error that names the
//! variable, and good ones shape the simulated device. Each case runs a small C program in a
//! child process, since the runtime reads the environment once per process.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use support::{lib_dir, run};

const PROBE: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include "tensoralloc.h"
int main(int argc, char **argv) {
    int device = argc > 1 ? atoi(argv[1]) : 0;
    size_t size = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 4096;
    void *p = tensoralloc_malloc(size, device, NULL);
    printf("%s|%s\n", p ? "ok" : "null", tensoralloc_last_error());
    if (p) tensoralloc_free(p, size, device, NULL);
    return 0;
}
"#;

fn probe() -> &'static PathBuf {
    static PROBE_EXE: OnceLock<PathBuf> = OnceLock::new();
    PROBE_EXE.get_or_init(|| {
        let lib = lib_dir();
        let dir = lib.join("env-probe");
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("probe.c");
        std::fs::write(&src, PROBE).unwrap();
        let exe = dir.join("probe");
        run(
            &mut support::compile_c(&src, &exe, &lib),
            "compiling the probe",
        );
        exe
    })
}

fn malloc_with(env: &[(&str, &str)], args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(probe());
    cmd.env_remove("TENSORALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF");
    cmd.env("TENSORALLOC_DRIVER", "sim");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(cmd.args(args), "the probe");
    let line = out.lines().last().unwrap_or_default().to_string();
    let (status, error) = line.split_once('|').unwrap_or((&line, ""));
    (status == "ok", error.to_string())
}

#[test]
fn an_unknown_driver_name_is_reported() {
    let (ok, e) = malloc_with(&[("TENSORALLOC_DRIVER", "opencl")], &[]);
    assert!(!ok);
    assert!(e.contains("TENSORALLOC_DRIVER") && e.contains("sim"), "{e}");
}

#[test]
fn a_bad_simulated_memory_size_is_reported() {
    let (ok, e) = malloc_with(&[("TENSORALLOC_SIM_MEMORY", "lots")], &[]);
    assert!(!ok);
    assert!(e.contains("TENSORALLOC_SIM_MEMORY"), "{e}");
}

#[test]
fn a_bad_device_count_is_reported() {
    let (ok, e) = malloc_with(&[("TENSORALLOC_SIM_DEVICES", "0")], &[]);
    assert!(!ok);
    assert!(e.contains("TENSORALLOC_SIM_DEVICES"), "{e}");
}

#[test]
fn a_bad_configuration_string_is_reported() {
    let (ok, e) = malloc_with(&[("TENSORALLOC_CONF", "max_split_size_mb:banana")], &[]);
    assert!(!ok);
    assert!(
        e.contains("TENSORALLOC_CONF") && e.contains("max_split_size_mb"),
        "{e}"
    );
}

#[test]
fn pytorch_configuration_is_read_when_ours_is_unset() {
    let (ok, e) = malloc_with(&[("PYTORCH_CUDA_ALLOC_CONF", "nonsense:1")], &[]);
    assert!(!ok);
    assert!(
        e.contains("PYTORCH_CUDA_ALLOC_CONF") && e.contains("nonsense"),
        "{e}"
    );
    let (ok, e) = malloc_with(&[("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")], &[]);
    assert!(ok, "{e}");
}

#[test]
fn simulated_devices_and_capacity_follow_the_environment() {
    let env = [
        ("TENSORALLOC_SIM_DEVICES", "2"),
        ("TENSORALLOC_SIM_MEMORY", "64MiB"),
    ];
    assert!(malloc_with(&env, &["1"]).0, "device 1 exists");
    let (ok, e) = malloc_with(&env, &["2"]);
    assert!(!ok && e.contains("device 2 does not exist"), "{e}");
    let (ok, e) = malloc_with(&env, &["0", "100000000"]);
    assert!(
        !ok && e.contains("64.00 MiB"),
        "capacity from TENSORALLOC_SIM_MEMORY: {e}"
    );
    assert!(malloc_with(&env, &["0", "60000000"]).0);
}

//! Shared helpers of the integration tests that drive the built `libtensoralloc.so`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The directory holding `libtensoralloc.so` for this test build (target/<profile>).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let lib = dir.join("libtensoralloc.so");
    assert!(
        lib.exists(),
        "{} is missing: build the library with `cargo build` first",
        lib.display()
    );
    dir.to_path_buf()
}

/// A directory of downloaded files: `$var`, else `target/<default>`, filled by `script`;
/// `probe` is a file it must hold.
pub fn fetched_dir(var: &str, default: &str, probe: &str, script: &str) -> PathBuf {
    let dir = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target").join(default));
    assert!(
        dir.join(probe).exists(),
        "{probe} is not in {}: run {script} (or set {var})",
        dir.display()
    );
    dir
}

/// The C compiler: `$CC`, else `cc`.
pub fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// Runs `cmd`, returning its combined output, and panics with that output when it fails.
pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

/// Sets the driver for a child process: whatever the test run selected with
/// `TENSORALLOC_DRIVER`, else the simulated device.
pub fn with_driver(cmd: &mut Command) -> &mut Command {
    if std::env::var_os("TENSORALLOC_DRIVER").is_none() {
        cmd.env("TENSORALLOC_DRIVER", "sim");
    }
    cmd
}

/// A command that compiles the C program `src` into `exe`, linked against `libtensoralloc.so`
/// in `lib` (found again at run time through an rpath). Add flags before running it.
pub fn compile_c(src: &Path, exe: &Path, lib: &Path) -> Command {
    let mut cmd = Command::new(cc());
    cmd.arg("-std=c99")
        .arg("-I")
        .arg(root().join("include"))
        .arg(src)
        .arg("-o")
        .arg(exe)
        .arg("-L")
        .arg(lib)
        .args(["-ltensoralloc", "-lpthread"])
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    cmd
}

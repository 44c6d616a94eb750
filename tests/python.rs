//! Runs the Python check that loads the library the way PyTorch's CUDAPluggableAllocator does.

mod support;

use std::process::Command;

use support::{lib_dir, root, run, with_driver};

#[test]
fn python_loads_the_allocator_like_pytorch_pluggable_allocator() {
    let lib = lib_dir().join("libtensoralloc.so");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let text = run(
        with_driver(
            Command::new(python)
                .arg(root().join("tests/python/pluggable_allocator.py"))
                .arg(&lib),
        ),
        "the Python pluggable-allocator check",
    );
    assert!(text.contains("PyTorch-style loading works"), "{text}");
}

/// `pip install ./python` into a fresh virtual environment under target/, bundling the library
/// of this test build, then the package check from outside the repository.
#[test]
fn python_package_installs_into_a_fresh_venv_and_reports_statistics() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let venv = root().join(format!("target/python-venv-{}", std::process::id()));
    std::fs::remove_dir_all(&venv).ok();
    run(
        Command::new(python).args(["-m", "venv"]).arg(&venv),
        "creating a virtual environment",
    );
    let venv_python = venv.join("bin/python");
    run(
        Command::new(&venv_python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(root().join("python"))
            .env("TENSORALLOC_LIB", lib_dir().join("libtensoralloc.so")),
        "pip install ./python",
    );
    let text = run(
        with_driver(
            Command::new(&venv_python)
                .arg(root().join("tests/python/package_check.py"))
                .current_dir(&venv),
        ),
        "the Python package check",
    );
    assert!(text.contains("tensoralloc package works"), "{text}");
    std::fs::remove_dir_all(&venv).ok();
}

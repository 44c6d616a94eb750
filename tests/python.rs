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

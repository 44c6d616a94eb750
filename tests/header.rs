//! The generated header: committed, self-contained C99 and C++17, and compatible with
//! NVIDIA's `cuda_runtime_api.h` (streams are `struct CUstream_st *`).

mod support;

use std::process::Command;

use support::{cc, fetched_dir, root, run};

fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_string())
}

/// Compiles the header on its own, strictly, as `language` with `standard`.
fn compile_alone(compiler: String, standard: &str, language: &str) {
    run(
        Command::new(compiler)
            .args([
                standard,
                "-pedantic",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fsyntax-only",
            ])
            .args(["-x", language])
            .arg(root().join("include/tensoralloc.h")),
        &format!("compiling the header alone as {language} ({standard})"),
    );
}

#[test]
fn header_compiles_alone_as_c99() {
    compile_alone(cc(), "-std=c99", "c");
}

#[test]
fn header_compiles_alone_as_cpp17() {
    compile_alone(cxx(), "-std=c++17", "c++");
}

/// NVIDIA's CUDA headers, which `scripts/fetch-cuda-headers` takes from the
/// `nvidia-cuda-runtime` wheel.
fn cuda_include_dir() -> std::path::PathBuf {
    fetched_dir(
        "CUDA_INCLUDE_DIR",
        "cuda-include",
        "cuda_runtime_api.h",
        "scripts/fetch-cuda-headers",
    )
}

#[test]
fn header_mixes_with_nvidia_cuda_runtime_api() {
    let cuda = cuda_include_dir();
    let dir = std::env::temp_dir().join(format!("tensoralloc-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tu = dir.join("mix.c");
    // Assigning our functions to pointers of the types PyTorch's CUDAPluggableAllocator uses
    // proves that the stream parameter is exactly cudaStream_t.
    std::fs::write(
        &tu,
        r#"
#include <cuda_runtime_api.h>
#include <cuda.h>
#include "tensoralloc.h"
typedef void *(*alloc_fn)(size_t, int, cudaStream_t);
typedef void (*free_fn)(void *, size_t, int, cudaStream_t);
typedef void (*record_fn)(void *, cudaStream_t);
alloc_fn a = tensoralloc_malloc;
free_fn f = tensoralloc_free;
record_fn r = tensoralloc_record_stream;
void (*reset_fn)(void) = tensoralloc_empty_cache;
void (*init_fn)(int) = tensoralloc_init;
CUstream as_driver_stream(cudaStream_t s) { return s; }
"#,
    )
    .unwrap();
    for (compiler, std) in [
        (cc(), "-std=c99"),
        (
            std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
            "-std=c++17",
        ),
    ] {
        let mut cmd = Command::new(compiler);
        cmd.args([std, "-Wall", "-Werror", "-fsyntax-only"]);
        if std.contains("++") {
            cmd.args(["-x", "c++"]);
        }
        run(
            cmd.arg("-I")
                .arg(&cuda)
                .arg("-I")
                .arg(root().join("include"))
                .arg(&tu),
            "compiling the header with NVIDIA's cuda_runtime_api.h",
        );
    }
}

#[test]
fn committed_header_matches_the_generated_one() {
    let generated = std::fs::read_to_string(concat!(env!("OUT_DIR"), "/tensoralloc.h"))
        .expect("build.rs writes the generated header to OUT_DIR");
    let root = root();
    if root.join(".git").exists() {
        let committed = Command::new("git")
            .args(["show", "HEAD:include/tensoralloc.h"])
            .current_dir(&root)
            .output()
            .expect("git runs");
        assert!(
            committed.status.success(),
            "include/tensoralloc.h is not committed"
        );
        assert!(
            String::from_utf8_lossy(&committed.stdout) == generated,
            "the committed include/tensoralloc.h differs from what build.rs generates: commit the regenerated header"
        );
    } else {
        let on_disk = std::fs::read_to_string(root.join("include/tensoralloc.h")).unwrap();
        assert_eq!(on_disk, generated);
    }
}

/// PyTorch's C++ headers, which `scripts/fetch-torch-headers` takes from the pinned torch
/// wheel.
fn torch_include_dir() -> std::path::PathBuf {
    fetched_dir(
        "TORCH_INCLUDE_DIR",
        "torch-include",
        "torch/csrc/cuda/CUDAPluggableAllocator.h",
        "scripts/fetch-torch-headers",
    )
}

#[test]
fn torch_helper_compiles_against_pytorch_and_nvidia_headers() {
    let torch = torch_include_dir();
    let dir = std::env::temp_dir().join(format!("tensoralloc-torch-hpp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tu = dir.join("install.cpp");
    // What a libtorch program does; the function types PyTorch's setters take are checked by
    // the compiler where the helper passes tensoralloc's functions to them.
    std::fs::write(
        &tu,
        r#"
#include <tensoralloc_torch.hpp>
std::shared_ptr<tensoralloc::torch::Allocator> use() { return tensoralloc::torch::install(); }
c10::cuda::CUDACachingAllocator::CUDAAllocator *as_pytorch_allocator(tensoralloc::torch::Allocator *a) { return a; }
"#,
    )
    .unwrap();
    // PyTorch's own headers are system headers here: only the helper's warnings are errors.
    run(
        Command::new(cxx())
            .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"])
            .arg("-I")
            .arg(root().join("include"))
            .arg("-isystem")
            .arg(&torch)
            .arg("-isystem")
            .arg(torch.join("torch/csrc/api/include"))
            .arg("-isystem")
            .arg(cuda_include_dir())
            .arg(&tu),
        "compiling include/tensoralloc_torch.hpp against PyTorch's headers",
    );
    std::fs::remove_dir_all(&dir).ok();
}

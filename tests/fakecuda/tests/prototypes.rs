//! The fake driver's exports have NVIDIA's exact prototypes.
//!
//! Each exported function's Rust signature is written out in C and assigned, in a translation
//! unit that includes NVIDIA's `cuda.h`, to a pointer of that type initialized with NVIDIA's
//! declaration of the function; the C compiler (with `-Werror`) rejects any mismatch. The sizes
//! and field offsets of the structures and scalar types the fake defines are checked with
//! `_Static_assert`.
//!
//! Needs NVIDIA's `cuda.h` (from the `nvidia-cuda-runtime` wheel) in `$CUDA_INCLUDE_DIR` or
//! `target/cuda-include` (`scripts/fetch-cuda-headers`). Without it the test fails and says so.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use fakecuda::all_exports;
use fakecuda::entry::LEGACY_EXPORTS;
use fakecuda::types::{FIELD_OFFSETS, TYPE_SIZES};

/// NVIDIA's header directory: `$CUDA_INCLUDE_DIR`, else the workspace's `target/cuda-include`,
/// which `scripts/fetch-cuda-headers` fills from the `nvidia-cuda-runtime` wheel.
fn cuda_include_dir() -> PathBuf {
    let dir = std::env::var_os("CUDA_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/cuda-include")
        });
    assert!(
        dir.join("cuda.h").is_file(),
        "NVIDIA's cuda.h is not in {}: run scripts/fetch-cuda-headers (or set CUDA_INCLUDE_DIR to a \
         directory holding cuda.h)",
        dir.display()
    );
    dir
}

/// The C spelling of a Rust parameter type as `stringify!` wrote it (`*mut *const c_char`
/// becomes `char const * *`).
fn c_type(rust: &str) -> String {
    let t = rust.trim();
    if let Some(pointee) = t.strip_prefix('*') {
        let pointee = pointee.trim_start();
        if let Some(rest) = pointee.strip_prefix("mut ") {
            return format!("{} *", c_type(rest));
        }
        if let Some(rest) = pointee.strip_prefix("const ") {
            return format!("{} const *", c_type(rest));
        }
        panic!("a raw pointer type without mut or const: `{rust}`");
    }
    match t {
        "usize" => "size_t",
        "c_int" => "int",
        "c_uint" => "unsigned int",
        "c_uchar" => "unsigned char",
        "c_ulonglong" => "unsigned long long",
        "c_char" => "char",
        "c_void" => "void",
        "cuuint64_t" => "cuuint64_t",
        // The fake's own types carry cuda.h's names.
        name => {
            assert!(
                name.starts_with("CU"),
                "no C spelling for the Rust type `{name}`"
            );
            name
        }
    }
    .to_string()
}

#[test]
fn c_spelling_of_rust_pointer_types() {
    assert_eq!(c_type("*mut *const c_char"), "char const * *");
    assert_eq!(c_type("* const CUmemAccessDesc"), "CUmemAccessDesc const *");
    assert_eq!(c_type("usize"), "size_t");
}

/// The translation unit that checks `exports` against `cuda.h` (with the declarations of the
/// older ABIs when `legacy`).
fn check_source<'a>(
    exports: impl Iterator<Item = &'a (&'a str, &'a [&'a str])>,
    legacy: bool,
) -> String {
    let mut c = String::new();
    if legacy {
        c.push_str("#define __CUDA_API_VERSION_INTERNAL 1\n");
    }
    c.push_str("#include <stddef.h>\n#include <cuda.h>\n\n");
    for (ty, size) in TYPE_SIZES {
        writeln!(
            c,
            "_Static_assert(sizeof({ty}) == {size}, \"size of {ty}\");"
        )
        .unwrap();
    }
    for (ty, field, offset) in FIELD_OFFSETS {
        writeln!(
            c,
            "_Static_assert(offsetof({ty}, {field}) == {offset}, \"offset of {ty}.{field}\");"
        )
        .unwrap();
    }
    c.push_str("\nvoid fakecuda_prototypes(void);\nvoid fakecuda_prototypes(void) {\n");
    for (name, params) in exports {
        let params = if params.is_empty() {
            "void".to_string()
        } else {
            params
                .iter()
                .map(|p| c_type(p))
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(
            c,
            "    {{ CUresult (*fake)({params}) = {name}; (void)fake; }}"
        )
        .unwrap();
    }
    c.push_str("}\n");
    c
}

#[test]
fn every_export_has_nvidias_prototype() {
    compile_check(&check_source(all_exports(), false), "current");
}

#[test]
fn every_legacy_export_has_nvidias_older_prototype() {
    compile_check(&check_source(LEGACY_EXPORTS.iter(), true), "legacy");
}

/// Compiles `source` against NVIDIA's headers; fails with the compiler's complaint.
fn compile_check(source: &str, what: &str) {
    let include = cuda_include_dir();
    let dir =
        std::env::temp_dir().join(format!("fakecuda-prototypes-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("prototypes.c");
    std::fs::write(&src, source).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-c", "-o"])
        .arg(dir.join("prototypes.o"))
        .arg("-I")
        .arg(&include)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "the fake driver's prototypes differ from NVIDIA's cuda.h ({}):\n{}",
        include.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The fake driver library next to this test's profile directory.
fn fake_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("libfakecuda.so");
    assert!(
        lib.is_file(),
        "{} is not built (cargo build -p fakecuda)",
        lib.display()
    );
    lib
}

#[test]
fn every_exported_driver_symbol_is_checked() {
    let lib = fake_library();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("run nm (binutils)");
    assert!(out.status.success(), "nm failed on {}", lib.display());
    let listed: Vec<&str> = all_exports()
        .chain(LEGACY_EXPORTS)
        .map(|(n, _)| *n)
        .collect();
    let exported: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|s| s.starts_with("cu"))
        .map(str::to_string)
        .collect();
    assert!(
        exported.len() >= 30,
        "too few cu* symbols found: {exported:?}"
    );
    for s in &exported {
        assert!(
            listed.contains(&s.as_str()),
            "{s} is exported but not in the prototype check"
        );
    }
    for n in &listed {
        assert!(
            exported.iter().any(|s| s == n),
            "{n} is listed but not exported"
        );
    }
}

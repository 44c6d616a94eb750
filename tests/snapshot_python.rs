//! A snapshot written through the C functions loads in Python with an unpickler that refuses
//! every global, and, where PyTorch's `_memory_viz.py` has been fetched
//! (`scripts/fetch-memory-viz`, run by `scripts/test`), with PyTorch's own memory viewer.

use std::ffi::CString;
use std::path::PathBuf;
use std::process::Command;

use tensoralloc::capi::device::{tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::snapshot::{tensoralloc_dump_snapshot, tensoralloc_record_memory_history};
use tensoralloc::capi::{tensoralloc_last_error, TENSORALLOC_ERR_INVALID_ARGUMENT, TENSORALLOC_OK};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn last_error() -> String {
    // SAFETY: tensoralloc_last_error never returns NULL and the string lives until the next call.
    unsafe { std::ffi::CStr::from_ptr(tensoralloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn record_and_dump(name: &str) -> PathBuf {
    assert_eq!(
        tensoralloc_record_memory_history(1, 100_000),
        TENSORALLOC_OK,
        "{}",
        last_error()
    );
    let stream = std::ptr::null_mut();
    let mut live = Vec::new();
    for i in 0..40usize {
        let p = tensoralloc_malloc(1000 + i * 300_000, 0, stream);
        assert!(!p.is_null(), "{}", last_error());
        live.push(p);
        if i % 3 == 0 {
            tensoralloc_free(live.remove(0), 0, 0, stream);
        }
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let c = CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(
        tensoralloc_dump_snapshot(c.as_ptr()),
        TENSORALLOC_OK,
        "{}",
        last_error()
    );
    for p in live {
        tensoralloc_free(p, 0, 0, stream);
    }
    path
}

#[test]
fn a_snapshot_loads_with_a_restricted_unpickler_and_pytorchs_memory_viewer() {
    let path = record_and_dump("capi_snapshot.pickle.gz");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    let viz = root().join("target/torch-memory-viz");
    let mut cmd = Command::new(python);
    cmd.arg(root().join("tests/python/snapshot_check.py"))
        .arg(&path);
    let with_viz = viz.join("_memory_viz.py").exists();
    if with_viz {
        cmd.arg(&viz);
    } else {
        eprintln!("PyTorch's _memory_viz.py is not in {}: run scripts/fetch-memory-viz; checking the layout only", viz.display());
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("layout ok"), "{text}");
    if with_viz {
        assert!(text.contains("_memory_viz accepts it"), "{text}");
    }
}

#[test]
fn bad_arguments_are_refused_with_a_message() {
    assert_eq!(
        tensoralloc_record_memory_history(1, 0),
        TENSORALLOC_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("max_entries"));
    assert_eq!(
        tensoralloc_dump_snapshot(std::ptr::null()),
        TENSORALLOC_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("NULL"));
    let c = CString::new("/nonexistent-dir/x.pickle").unwrap();
    assert_eq!(
        tensoralloc_dump_snapshot(c.as_ptr()),
        TENSORALLOC_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("cannot write"), "{}", last_error());
}

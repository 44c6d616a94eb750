//! One trace of `tests/data/traces/` replayed through `tensoralloc_malloc` and
//! `tensoralloc_free` as `benches/capi_runs.rs` replays it, `ROUNDS` times (default 1), each
//! on streams of its own, the allocator's cache emptied between them; the last round is the
//! measured one (earlier rounds leave idle shards behind, as in the benchmark). A small driver for
//! instruction-count profiling, e.g.
//! `valgrind --tool=callgrind --toggle-collect='*replay_calls'
//! target/release/examples/capi_replay gpt2_train [ROUNDS]` (a file name or part of one; prints the
//! calls made, to divide the instruction count by). The simulated device has 16 GiB unless
//! `TENSORALLOC_SIM_MEMORY` says otherwise: valgrind cannot reserve the benchmark's 256 GiB.

use std::ffi::c_void;
use std::path::PathBuf;

use tensoralloc::capi::device::{tensoralloc_empty_cache, tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::CUstream_st;
use tensoralloc::replay::snapshot::{self, TraceCall as Call};

/// The measured round (`--toggle-collect='*replay_calls'`).
#[inline(never)]
fn replay_calls(calls: &[Call], base: u64, ptrs: &mut [(*mut c_void, u64)]) {
    replay(calls, base, ptrs)
}

#[inline(always)]
fn replay(calls: &[Call], base: u64, ptrs: &mut [(*mut c_void, u64)]) {
    for &call in calls {
        match call {
            Call::Malloc { slot, size, stream } => {
                let s = base + stream;
                let p = tensoralloc_malloc(size, 0, s as usize as *mut CUstream_st);
                assert!(!p.is_null() || size == 0, "allocation of {size} failed");
                ptrs[slot] = (p, s);
            }
            Call::Free { slot } => {
                let (p, s) = ptrs[slot];
                tensoralloc_free(p, 0, 0, s as usize as *mut CUstream_st);
                ptrs[slot].0 = std::ptr::null_mut();
            }
        }
    }
}

fn main() {
    // SAFETY: set before any thread starts or tensoralloc is called.
    unsafe {
        std::env::set_var("TENSORALLOC_DRIVER", "sim");
        if std::env::var_os("TENSORALLOC_SIM_MEMORY").is_none() {
            std::env::set_var("TENSORALLOC_SIM_MEMORY", "16GiB");
        }
    }
    let want = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "gpt2_train".into());
    let rounds: u64 = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let file = std::fs::read_dir(&dir)
        .expect("tests/data/traces")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            let name = p.to_string_lossy();
            name.contains(".pickle") && name.contains(&want)
        })
        .unwrap_or_else(|| panic!("no trace named like {want:?}"));
    let trace = snapshot::load(&file, 0).expect("trace");
    let (calls, used) = trace.calls();
    for round in 0..rounds {
        let base = (round + 1) << 32;
        let mut ptrs = vec![(std::ptr::null_mut(), 0); used];
        if round + 1 == rounds {
            replay_calls(&calls, base, &mut ptrs);
        } else {
            replay(&calls, base, &mut ptrs);
        }
        for &(p, s) in &ptrs {
            tensoralloc_free(p, 0, 0, s as usize as *mut CUstream_st);
        }
        tensoralloc_empty_cache();
    }
    println!(
        "{}: {} events, {} calls per round, {rounds} round(s), the last measured",
        file.file_name().unwrap().to_string_lossy(),
        trace.events.len(),
        calls.len()
    );
}

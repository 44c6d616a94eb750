//! Cached 4 KiB device and host pairs through the exported C functions, in a populated
//! allocator (the workloads of `benches/capi.rs`), and glibc's pair: a small driver for
//! instruction-count profiling, e.g.
//! `valgrind --tool=callgrind --toggle-collect='*pairs' target/release/examples/capi_pairs device 100000`
//! (`device`, `host` or `glibc`).

#[path = "../benches/capi_work/mod.rs"]
mod capi_work;

use capi_work::{
    device_pair, glibc_pair, host_pair, populate_device, populate_host, stream, CUstream_st,
};

/// The measured loops (`--toggle-collect='*pairs'`).
#[inline(never)]
fn device_pairs(s: *mut CUstream_st, n: u64) {
    for _ in 0..n {
        device_pair(s);
    }
}

#[inline(never)]
fn host_pairs(n: u64) {
    for _ in 0..n {
        host_pair();
    }
}

#[inline(never)]
fn glibc_pairs(n: u64) {
    for _ in 0..n {
        glibc_pair();
    }
}

fn main() {
    // SAFETY: set before any thread starts or tensoralloc is called.
    unsafe { std::env::set_var("TENSORALLOC_DRIVER", "sim") };
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map_or("device", String::as_str);
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    match what {
        "device" => {
            populate_device([0x1000, 0x2000, 0x3000, 0x4000]);
            device_pairs(stream(0x1000), 1);
            device_pairs(stream(0x1000), n);
        }
        "host" => {
            populate_host();
            host_pairs(1);
            host_pairs(n);
        }
        _ => {
            glibc_pairs(1);
            glibc_pairs(n);
        }
    }
}

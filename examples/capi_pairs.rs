//! Cached 4 KiB device and host pairs through the exported C functions, in a populated
//! allocator: a small driver for instruction-count profiling
//! (`valgrind --tool=callgrind target/release/examples/capi_pairs device 100000`).

use std::ffi::c_void;
use std::hint::black_box;

use tensoralloc::capi::device::{tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::host::{tensoralloc_host_free, tensoralloc_host_malloc};
use tensoralloc::capi::CUstream_st;

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn stream(s: usize) -> *mut CUstream_st {
    s as *mut CUstream_st
}

fn populate(streams: [usize; 4]) {
    let mut x = 0x2545_f491_4f6c_dd1d;
    let mut live: Vec<Option<(*mut c_void, usize, usize)>> = Vec::with_capacity(600);
    for i in 0..600 {
        let r = next(&mut x);
        let size = (1 + next(&mut x) % (1 << (r % 23))).min(4 << 20) as usize;
        let s = streams[(r >> 8) as usize % 4];
        let p = tensoralloc_malloc(size, 0, stream(s));
        live.push(Some((p, size, s)));
        if (r >> 16).is_multiple_of(3) {
            let j = (r >> 20) as usize % (i + 1);
            if let Some((p, size, s)) = live[j].take() {
                tensoralloc_free(p, size, 0, stream(s));
            }
        }
    }
    for (p, size, s) in live.into_iter().flatten() {
        tensoralloc_free(p, size, 0, stream(s));
    }
}

/// The measured loop (`--toggle-collect=*device_pairs`).
#[inline(never)]
fn device_pairs(s: *mut CUstream_st, n: u64) {
    for _ in 0..n {
        let p = tensoralloc_malloc(black_box(4096), 0, s);
        tensoralloc_free(black_box(p), 4096, 0, s);
    }
}

#[inline(never)]
fn host_pairs(n: u64) {
    for _ in 0..n {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        let p = tensoralloc_host_malloc(black_box(4096), &mut ctx);
        tensoralloc_host_free(black_box(p), ctx);
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
            populate([0x1000, 0x2000, 0x3000, 0x4000]);
            device_pairs(stream(0x1000), 1);
            device_pairs(stream(0x1000), n);
        }
        _ => {
            host_pairs(1);
            host_pairs(n);
        }
    }
}

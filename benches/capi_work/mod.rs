//! The calls and workloads the C-ABI benchmarks share: cached 4 KiB pairs through the
//! exported functions, glibc's pair for comparison, and the mixes that populate the caches.

use std::ffi::c_void;
use std::hint::black_box;

use tensoralloc::capi::device::{tensoralloc_free, tensoralloc_malloc};
use tensoralloc::capi::host::{tensoralloc_host_free, tensoralloc_host_malloc};
pub use tensoralloc::capi::CUstream_st;

pub const SIZE: usize = 4096;

/// A stream as a C program passes it (any non-null value names a stream on the simulator).
pub fn stream(s: usize) -> *mut CUstream_st {
    s as *mut CUstream_st
}

pub fn device_pair(s: *mut CUstream_st) {
    let p = tensoralloc_malloc(black_box(SIZE), 0, s);
    assert!(!p.is_null());
    tensoralloc_free(black_box(p), SIZE, 0, s);
}

pub fn host_pair() {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let p = tensoralloc_host_malloc(black_box(SIZE), &mut ctx);
    assert!(!p.is_null());
    tensoralloc_host_free(black_box(p), ctx);
}

pub fn glibc_pair() {
    // SAFETY: malloc and free of one block, freed once.
    unsafe { libc::free(black_box(libc::malloc(black_box(SIZE)))) }
}

/// xorshift64: a fixed, repeatable mix of sizes.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// 600 allocations of 1 B to 4 MiB (sizes spread over powers of two) on four streams, a
/// third of them freed early, then all freed: a realistic mix left in the cache.
pub fn populate_device(streams: [usize; 4]) {
    let mut x = 0x2545_f491_4f6c_dd1d;
    let mut live: Vec<Option<(*mut c_void, usize, usize)>> = Vec::with_capacity(600);
    for i in 0..600 {
        let r = next(&mut x);
        let size = (1 + next(&mut x) % (1 << (r % 23))).min(4 << 20) as usize;
        let s = streams[(r >> 8) as usize % 4];
        let p = tensoralloc_malloc(size, 0, stream(s));
        assert!(!p.is_null());
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

/// Four threads each hold up to 100 pinned blocks of 1 B to 1 MiB, then free them.
pub fn populate_host() {
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                let blocks: Vec<_> = (0..100)
                    .map(|_| {
                        let mut ctx: *mut c_void = std::ptr::null_mut();
                        let size = 1 + (next(&mut x) % (1 << 20)) as usize;
                        let p = tensoralloc_host_malloc(size, &mut ctx);
                        assert!(!p.is_null());
                        (p as usize, ctx as usize)
                    })
                    .collect();
                for (p, ctx) in blocks {
                    tensoralloc_host_free(p as *mut c_void, ctx as *mut c_void);
                }
            });
        }
    });
}

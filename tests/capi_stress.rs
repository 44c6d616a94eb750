//! The device C functions called by four threads at once with random arguments, good and
//! bad: sizes from 0 to absurd, unknown and interior pointers, wrong streams
//! and devices, `record_stream`, `empty_cache`, memory fractions (valid or not), private pools
//! begun, ended and released in any order, memory history on and off. Nothing may crash,
//! hang or hand out memory twice, and once everything is freed and the pools released, the
//! device holds nothing. Runs on whatever device the environment selects.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use tensoralloc::capi::device::{
    tensoralloc_device_stats, tensoralloc_empty_cache, tensoralloc_free,
    tensoralloc_get_device_stats, tensoralloc_malloc, tensoralloc_record_stream,
};
use tensoralloc::capi::pools::{
    tensoralloc_begin_allocate_to_pool, tensoralloc_end_allocate_to_pool,
    tensoralloc_get_base_allocation, tensoralloc_release_pool, tensoralloc_set_memory_fraction,
};
use tensoralloc::capi::snapshot::tensoralloc_record_memory_history;
use tensoralloc::capi::CUstream_st;

/// Live allocations of all threads: address -> size.
static LIVE: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Records a fresh allocation, checking it overlaps no live one.
fn handed_out(p: usize, size: usize) {
    let mut live = LIVE.lock().unwrap();
    if let Some((&q, &len)) = live.range(..=p).next_back() {
        assert!(
            q + len <= p,
            "{p:#x} lies inside the live allocation {q:#x} (+{len})"
        );
    }
    if let Some((&q, _)) = live.range(p..).next() {
        assert!(
            p + size <= q,
            "{p:#x} (+{size}) runs into the live allocation {q:#x}"
        );
    }
    live.insert(p, size);
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

extern "C" fn any_stream(_ctx: *mut c_void, _stream: *mut CUstream_st) -> i32 {
    1
}

fn stream(s: u64) -> *mut CUstream_st {
    s as usize as *mut CUstream_st
}

const POOLS: u64 = 3;

fn run(seed: u64, steps: usize) {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let streams = [0u64, 7, 0x1000, 0x2000, 0xdead_0000];
    let devices = [0, 0, 0, 0, -1, 1, 99];
    let sizes = [
        0,
        1,
        512,
        4096,
        100_000,
        1 << 20,
        (1 << 20) + 1,
        3 << 20,
        21 << 20,
        300 << 20,
        usize::MAX,
        usize::MAX / 2,
        1 << 51,
    ];
    let mut live: Vec<(usize, usize, u64)> = Vec::new();
    for _ in 0..steps {
        let s = r.pick(&streams);
        match r.next() % 20 {
            0..=7 => {
                let size = r.pick(&sizes);
                let p = tensoralloc_malloc(size, r.pick(&devices), stream(s)) as usize;
                if p != 0 {
                    handed_out(p, size);
                    live.push((p, size, s));
                }
            }
            8..=12 if !live.is_empty() => {
                let (p, size, s) = live.swap_remove((r.next() % live.len() as u64) as usize);
                // Sometimes with another stream than the allocation's.
                let s = if r.next().is_multiple_of(3) {
                    r.pick(&streams)
                } else {
                    s
                };
                LIVE.lock().unwrap().remove(&p);
                tensoralloc_free(p as *mut c_void, size, 0, stream(s));
            }
            13 => {
                // A pointer inside a live allocation of this thread, or one no allocation can
                // have (odd): reported, not crashed. (A double free could race with another
                // thread's reuse of the address; single-threaded tests cover it.)
                let p = match live.first() {
                    Some(l) if r.next().is_multiple_of(2) => l.0 + 16,
                    _ => r.next() as usize | 1,
                };
                tensoralloc_free(p as *mut c_void, 0, r.pick(&devices), stream(s));
            }
            14 => {
                let p = live.first().map_or(r.next() as usize, |l| l.0);
                tensoralloc_record_stream(p as *mut c_void, stream(r.pick(&streams)));
            }
            15 => tensoralloc_empty_cache(),
            16 => {
                let f = r.pick(&[0.0, 0.5, 1.0, -1.0, 2.0, f64::NAN]);
                tensoralloc_set_memory_fraction(f, r.pick(&devices));
                if r.next().is_multiple_of(2) {
                    tensoralloc_set_memory_fraction(1.0, 0);
                }
            }
            17 => {
                let (device, id) = (r.pick(&devices), r.next() % POOLS);
                match r.next() % 3 {
                    0 => tensoralloc_begin_allocate_to_pool(
                        device,
                        0,
                        id,
                        Some(any_stream),
                        std::ptr::null_mut(),
                    ),
                    1 => tensoralloc_end_allocate_to_pool(device, 0, id),
                    _ => tensoralloc_release_pool(device, 0, id),
                };
            }
            18 => {
                tensoralloc_record_memory_history((r.next() % 2) as i32, (r.next() % 100) as usize);
            }
            _ => {
                let p = live.last().map_or(r.next() as usize, |l| l.0 + 8);
                let mut size = 0;
                tensoralloc_get_base_allocation(p as *mut c_void, &mut size);
            }
        }
    }
    for (p, size, s) in live {
        LIVE.lock().unwrap().remove(&p);
        tensoralloc_free(p as *mut c_void, size, 0, stream(s));
    }
}

#[test]
fn four_threads_calling_with_random_arguments_leave_nothing_behind() {
    let threads: Vec<_> = (0..4)
        .map(|t| std::thread::spawn(move || run(0x5eed + t, 20_000)))
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Each begin is ended and each pool released as often as it could have been begun.
    for _ in 0..20_000 {
        for id in 0..POOLS {
            tensoralloc_end_allocate_to_pool(0, 0, id);
            tensoralloc_release_pool(0, 0, id);
        }
    }
    tensoralloc_record_memory_history(0, 0);
    tensoralloc_set_memory_fraction(1.0, 0);
    tensoralloc_empty_cache();
    let mut stats = tensoralloc_device_stats::default();
    assert_eq!(tensoralloc_get_device_stats(0, &mut stats), 0);
    assert_eq!(stats.allocated_bytes[0].current, 0);
    assert_eq!(stats.allocation[0].current, 0);
    assert_eq!(stats.reserved_bytes[0].current, 0, "segments left behind");
    assert!(stats.allocated_bytes[0].peak > 0);
    assert!(stats.num_invalid_frees > 0, "bad frees were not counted");
}

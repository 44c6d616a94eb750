//! The thread harness the benchmarks share.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// CPU time consumed by the calling thread.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Runs `work(thread)` `iters` times on each of `threads` threads started together, after one
/// unmeasured call each (the first call on a thread may take a slow path). Returns the wall
/// time and the threads' mean CPU time.
pub fn in_threads(
    threads: usize,
    iters: u64,
    work: impl Fn(usize) + Clone + Send + 'static,
) -> (Duration, Duration) {
    let start = Arc::new(Barrier::new(threads + 1));
    let done = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (work, start, done) = (work.clone(), start.clone(), done.clone());
            std::thread::spawn(move || {
                work(t);
                start.wait();
                let t0 = thread_cpu();
                for _ in 0..iters {
                    work(t);
                }
                let cpu = thread_cpu() - t0;
                done.wait();
                cpu
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    done.wait();
    let took = t0.elapsed();
    let cpu: Duration = handles.into_iter().map(|h| h.join().unwrap()).sum();
    (took, cpu / threads as u32)
}

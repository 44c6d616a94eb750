//! The lock of a shard, in both allocators.
//!
//! A shard is nearly always locked by one thread (the one working on a device shard's stream,
//! the one a host shard is home to), for the tens of nanoseconds of a cached malloc or free,
//! but a device shard now and then for the milliseconds of a driver call (a new segment, an
//! emptied cache) while other threads want it. So waiters must sleep rather than spin, and the
//! uncontended path should cost as little as possible: one compare-and-swap to lock, and a
//! plain release store to unlock, where a general-purpose mutex unlocks with a second atomic
//! read-modify-write.
//!
//! The lock has three states: free, locked, and locked with waiters that may sleep
//! (*contended*). A waiter spins a little, then marks the lock contended and sleeps in
//! `parking_lot_core`'s queue; the holder of a contended lock wakes one sleeper when it
//! unlocks. A waiter that took the lock after sleeping keeps the contended mark, so that its
//! own unlock wakes the next. An uncontended unlock reads the state and, seeing no mark,
//! stores *free*: a waiter that marks the lock between that read and that store is not woken,
//! which is why every sleep is capped at [`NAP`]. Such a waiter looks again at the latest when
//! its nap ends, so the race costs at most one nap, and only to a waiter that arrived within
//! nanoseconds of an unlock. A thread that unlocks and at once locks again would win nearly
//! every time against a sleeper that must first wake up, so an unlock now and then hands the
//! lock to the sleeper it wakes instead of freeing it (eventual fairness).

use std::sync::atomic::{
    AtomicU8,
    Ordering::{Acquire, Relaxed, Release},
};
use std::time::{Duration, Instant};

use lock_api::RawMutex as _;
use parking_lot_core::{
    ParkResult, SpinWait, UnparkToken, DEFAULT_PARK_TOKEN, DEFAULT_UNPARK_TOKEN,
};

const FREE: u8 = 0;
const LOCKED: u8 = 1;
/// Locked, and other threads may sleep waiting for it.
const CONTENDED: u8 = 2;

/// Passed to a sleeper woken by an unlock that left it the lock
/// ([`RawShardLock::unlock_contended`]).
const HANDED_OVER: UnparkToken = UnparkToken(1);

/// The longest a waiter sleeps before it looks at the lock again (see the module
/// documentation).
const NAP: Duration = Duration::from_micros(200);

/// The raw lock of a shard; see the module documentation.
pub(crate) struct RawShardLock {
    state: AtomicU8,
}

/// A value behind a [`RawShardLock`].
pub(crate) type ShardMutex<T> = lock_api::Mutex<RawShardLock, T>;
/// The guard of a locked [`ShardMutex`].
pub(crate) type ShardGuard<'a, T> = lock_api::MutexGuard<'a, RawShardLock, T>;

// SAFETY: a thread holds the lock only after changing the state from free to locked or
// contended with Acquire ordering (a compare-and-swap or a swap that saw free), or when an
// unlock that left the state locked handed it over (the woken thread is the one holder, and
// `parking_lot_core`'s queue lock orders the two threads), so one thread holds it at a time;
// every other unlock stores free with Release ordering, so the holder's writes are seen by
// the next one.
unsafe impl lock_api::RawMutex for RawShardLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: RawShardLock = RawShardLock {
        state: AtomicU8::new(FREE),
    };
    type GuardMarker = lock_api::GuardSend;

    #[inline]
    fn lock(&self) {
        if !self.try_lock() {
            self.wait(None);
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        self.state
            .compare_exchange(FREE, LOCKED, Acquire, Relaxed)
            .is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        if self.state.load(Relaxed) == LOCKED {
            self.state.store(FREE, Release);
        } else {
            self.unlock_contended();
        }
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.state.load(Relaxed) != FREE
    }
}

// SAFETY: as for `RawMutex`: the timed locks take the lock only the same ways.
unsafe impl lock_api::RawMutexTimed for RawShardLock {
    type Duration = Duration;
    type Instant = Instant;

    fn try_lock_for(&self, timeout: Duration) -> bool {
        // A timeout too long to represent waits as long as it takes.
        self.try_lock() || self.wait(Instant::now().checked_add(timeout))
    }

    fn try_lock_until(&self, deadline: Instant) -> bool {
        self.try_lock() || self.wait(Some(deadline))
    }
}

impl RawShardLock {
    /// Takes the lock once it is free, or gives up at `deadline`. Returns whether it took
    /// the lock.
    #[cold]
    #[inline(never)]
    fn wait(&self, deadline: Option<Instant>) -> bool {
        // A short hold ends while the waiter spins.
        let mut spin = SpinWait::new();
        loop {
            if self.state.load(Relaxed) == FREE {
                if self.try_lock() {
                    return true;
                }
            } else if !spin.spin() {
                break;
            }
        }
        loop {
            // Taking the lock this way keeps the contended mark: others may still sleep.
            if self.state.swap(CONTENDED, Acquire) == FREE {
                return true;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return false;
            }
            let wake = now + NAP;
            let wake = deadline.map_or(wake, |d| d.min(wake));
            // SAFETY: the key is this lock's address, unique to it while it lives (a thread
            // sleeps only inside this call, which borrows the lock); the callbacks neither
            // panic nor call into `parking_lot_core`.
            let woken = unsafe {
                parking_lot_core::park(
                    self.key(),
                    || self.state.load(Relaxed) == CONTENDED,
                    || {},
                    |_, _| {},
                    DEFAULT_PARK_TOKEN,
                    Some(wake),
                )
            };
            if woken == ParkResult::Unparked(HANDED_OVER) {
                return true;
            }
        }
    }

    /// Unlocks a lock that others may wait for, and wakes one of them. Now and then (when
    /// `parking_lot_core` says a sleeper has waited long enough, about every half
    /// millisecond) the lock passes to the woken thread without being freed, so that a thread
    /// that unlocks and locks again at once cannot keep a sleeper out for long.
    #[cold]
    #[inline(never)]
    fn unlock_contended(&self) {
        // SAFETY: as in `wait`; the callback only stores the state.
        unsafe {
            parking_lot_core::unpark_one(self.key(), |result| {
                if result.unparked_threads != 0 && result.be_fair {
                    // Still locked, and contended as every lock taken after sleeping is.
                    HANDED_OVER
                } else {
                    self.state.store(FREE, Release);
                    DEFAULT_UNPARK_TOKEN
                }
            });
        }
    }

    fn key(&self) -> usize {
        self as *const RawShardLock as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    fn state<T>(m: &ShardMutex<T>) -> u8 {
        // SAFETY: reading the raw lock's state neither locks nor unlocks it.
        unsafe { m.raw() }.state.load(Relaxed)
    }

    #[test]
    fn threads_never_hold_it_together() {
        // More threads than the cores of a small machine, so that holders are preempted and
        // waiters sleep.
        const THREADS: usize = 6;
        const ROUNDS: usize = 20_000;
        let counter = Arc::new(ShardMutex::new(0usize));
        let inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..THREADS)
            .map(|k| {
                let (counter, inside) = (counter.clone(), inside.clone());
                std::thread::spawn(move || {
                    for round in 0..ROUNDS {
                        let mut held = counter.lock();
                        assert_eq!(inside.fetch_add(1, Relaxed), 0, "two holders at once");
                        // A plain read-modify-write, lost if another holder interleaved.
                        let seen = *held;
                        if (round + k) % 1000 == 0 {
                            // Now and then a long hold, as of a driver call.
                            std::thread::sleep(Duration::from_micros(300));
                        }
                        *held = seen + 1;
                        inside.fetch_sub(1, Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*counter.lock(), THREADS * ROUNDS);
        assert!(!counter.is_locked());
    }

    #[test]
    fn a_sleeper_is_not_kept_out_by_a_thread_that_locks_again_at_once() {
        // One thread unlocks and locks again in a tight loop; another takes the lock 1,000
        // times, each after sleeping in the queue. Without hand-overs, each of those waits
        // until it happens to win a race that the looping thread nearly always wins. With
        // them, a sleeper waits about half a millisecond at most: some 25 of the looping
        // thread's 20 µs holds. Holds are counted, not time, so that a loaded machine (which
        // stretches every wait) does not fail the test; the deadline only catches a hang.
        const TAKES: usize = 1000;
        let m = Arc::new(ShardMutex::new(()));
        let holds = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hammer = {
            let (m, holds, stop) = (m.clone(), holds.clone(), stop.clone());
            std::thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(60);
                while !stop.load(Relaxed) && Instant::now() < end {
                    let held = m.lock();
                    // A hold long enough that a waiter stops spinning and sleeps.
                    let start = Instant::now();
                    while start.elapsed() < Duration::from_micros(20) {
                        std::hint::spin_loop();
                    }
                    drop(held);
                    holds.fetch_add(1, Relaxed);
                }
                !stop.load(Relaxed)
            })
        };
        let mut waited: Vec<usize> = (0..TAKES)
            .map(|_| {
                let before = holds.load(Relaxed);
                drop(m.lock());
                let during = holds.load(Relaxed) - before;
                // Let the looping thread take the lock back before the next try.
                std::thread::sleep(Duration::from_micros(100));
                during
            })
            .collect();
        stop.store(true, Relaxed);
        let timed_out = hammer.join().unwrap();
        assert!(!timed_out, "{TAKES} takes did not finish within 60 s");
        waited.sort_unstable();
        let median = waited[TAKES / 2];
        assert!(
            median <= 100,
            "a sleeper waited for {median} holds of the looping thread (median)"
        );
    }

    #[test]
    fn a_timed_lock_gives_up_at_its_timeout_and_takes_a_freed_lock() {
        let m = Arc::new(ShardMutex::new(()));
        let held = m.lock();
        let other = m.clone();
        let start = Instant::now();
        let took =
            std::thread::spawn(move || other.try_lock_for(Duration::from_millis(20)).is_some())
                .join()
                .unwrap();
        assert!(!took, "took a lock held throughout");
        assert!(
            start.elapsed() >= Duration::from_millis(20),
            "gave up early"
        );
        // The waiter left the contended mark behind: the unlock wakes nobody, harmlessly.
        assert_eq!(state(&m), CONTENDED);
        drop(held);
        assert_eq!(state(&m), FREE);

        let held = m.lock();
        let other = m.clone();
        let waiter =
            std::thread::spawn(move || other.try_lock_for(Duration::from_secs(60)).is_some());
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        assert!(waiter.join().unwrap(), "a freed lock was not taken");
        assert!(!m.is_locked());
    }

    #[test]
    fn a_sleeping_waiter_is_woken_by_the_unlock() {
        let m = Arc::new(ShardMutex::new(0u32));
        let mut held = m.lock();
        let other = m.clone();
        let waiter = std::thread::spawn(move || {
            let mut v = other.lock();
            *v += 1;
            *v
        });
        // The waiter stops spinning and sleeps (polled: a loaded machine may start it late).
        let end = Instant::now() + Duration::from_secs(20);
        while state(&m) != CONTENDED && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(state(&m), CONTENDED, "the waiter did not sleep within 20 s");
        // Asleep, not spinning: the unlock below must wake it.
        std::thread::sleep(Duration::from_millis(20));
        *held = 41;
        drop(held);
        assert_eq!(waiter.join().unwrap(), 42);
        assert_eq!(state(&m), FREE);
    }
}

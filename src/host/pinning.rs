//! Obtaining and returning pinned memory through the driver, in one of two modes:
//!
//! - **driver allocation** (the default): `host_alloc` / `host_free` (`cuMemHostAlloc`,
//!   portable across devices);
//! - **registration** (`pinned_use_cuda_host_register:True`): ordinary anonymous pages,
//!   pre-faulted and registered with `host_register` in chunks of at most
//!   [`DEFAULT_REGISTER_CHUNK`] bytes, spread over up to `pinned_num_register_threads`
//!   threads. Faulting pages in is the slow part of pinning a large range, and it
//!   parallelises; chunking keeps each driver call short.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::driver::Driver;
use crate::error::{Error, Result};

/// Largest single registration in registration mode.
pub(crate) const DEFAULT_REGISTER_CHUNK: usize = 64 << 20;

/// How pinned memory is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Alloc,
    Register { threads: usize, chunk: usize },
}

/// Pins and unpins ranges.
pub(crate) struct Pinner {
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) mode: Mode,
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

impl Pinner {
    /// Pins `size` bytes and returns the address.
    pub(crate) fn pin(&self, size: usize) -> Result<usize> {
        match self.mode {
            Mode::Alloc => self.driver.host_alloc(size),
            Mode::Register { threads, chunk } => self.map_and_register(size, threads, chunk),
        }
    }

    /// Returns a range made by [`Pinner::pin`] with the same `size`.
    pub(crate) fn unpin(&self, ptr: usize, size: usize) -> Result<()> {
        match self.mode {
            Mode::Alloc => self.driver.host_free(ptr),
            Mode::Register { chunk, .. } => {
                let len = mapped_len(size);
                let mut first_error = None;
                for start in chunk_starts(ptr, len, chunk) {
                    if let Err(e) = self.driver.host_unregister(start) {
                        first_error.get_or_insert(e);
                    }
                }
                if let Some(e) = first_error {
                    // Pages the driver may still consider registered are not unmapped.
                    return Err(e);
                }
                unmap(ptr, len);
                Ok(())
            }
        }
    }

    fn map_and_register(&self, size: usize, threads: usize, chunk: usize) -> Result<usize> {
        let len = mapped_len(size);
        // SAFETY: an anonymous private mapping with no address hint; checked against
        // MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::OutOfMemory(format!(
                "cannot map {len} bytes of host memory to pin: {}",
                std::io::Error::last_os_error()
            )));
        }
        let base = p as usize;
        let starts: Vec<usize> = chunk_starts(base, len, chunk).collect();
        let end = base + len;
        let next = AtomicUsize::new(0);
        let registered = Mutex::new(Vec::with_capacity(starts.len()));
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let work = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= starts.len() || failure.lock().is_some() {
                break;
            }
            let start = starts[i];
            let stop = starts.get(i + 1).copied().unwrap_or(end);
            prefault(start, stop);
            match self.driver.host_register(start, stop - start) {
                Ok(()) => registered.lock().push(start),
                Err(e) => {
                    failure.lock().get_or_insert(e);
                }
            }
        };
        let workers = threads.clamp(1, starts.len().max(1));
        if workers == 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 1..workers {
                    s.spawn(work);
                }
                work();
            });
        }
        if let Some(e) = failure.into_inner() {
            for start in registered.into_inner() {
                let _ = self.driver.host_unregister(start);
            }
            unmap(base, len);
            return Err(e);
        }
        Ok(base)
    }
}

/// Bytes mapped for a block of `size` bytes: whole pages.
fn mapped_len(size: usize) -> usize {
    size.next_multiple_of(page_size())
}

/// Start addresses of the registration chunks of `[base, base + len)`.
fn chunk_starts(base: usize, len: usize, chunk: usize) -> impl Iterator<Item = usize> {
    let chunk = chunk.max(1).next_multiple_of(page_size());
    (base..base + len).step_by(chunk)
}

/// Touches one byte per page so the kernel backs every page before it is registered.
fn prefault(start: usize, stop: usize) {
    let page = page_size();
    let mut p = start;
    while p < stop {
        // SAFETY: [start, stop) lies inside a fresh private writable mapping made by
        // `map_and_register`, not yet handed to anyone.
        unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
        p += page;
    }
}

fn unmap(ptr: usize, len: usize) {
    // SAFETY: [ptr, ptr + len) is a mapping made by `map_and_register` that no block refers
    // to any more.
    unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
}

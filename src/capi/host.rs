//! C functions of the caching pinned-host allocator. The names and types follow PyTorch's
//! `CachingHostAllocator` (`allocate` returning a pointer and a context, `free(ctx)`,
//! `record_event(ptr, ctx, stream)`, `empty_cache`). One allocator serves the process, built on
//! first use from the driver and configuration that `TENSORALLOC_DRIVER` and
//! `TENSORALLOC_CONF` select.

// These functions are called from C, where `unsafe` cannot be seen: the validity of the
// pointers they write through is the documented contract of each function.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::c_void;

use super::{fail, ffi_boundary, stream_id, tensoralloc_status, CUstream_st, TENSORALLOC_OK};
use crate::error::{Error, Result};
use crate::host::{HostAllocator, HostStats};
use crate::runtime::Runtime;

/// Statistics of the pinned-host allocator. "Peak" values are the highest since the last
/// `tensoralloc_host_reset_peak_stats`; accumulated values count since the last
/// `tensoralloc_host_reset_accumulated_stats`. Sizes are bytes, times nanoseconds.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct tensoralloc_host_stats {
    /// Blocks handed out by `tensoralloc_host_malloc` and not yet freed.
    pub allocations_current: u64,
    /// Peak of `allocations_current`.
    pub allocations_peak: u64,
    /// Blocks that cannot be handed out: allocated, or freed but waiting for the streams that
    /// used them (`tensoralloc_host_record_event`).
    pub active_blocks_current: u64,
    /// Peak of `active_blocks_current`.
    pub active_blocks_peak: u64,
    /// Bytes of allocated blocks (each rounded up to a power of two).
    pub allocated_bytes_current: u64,
    /// Peak of `allocated_bytes_current`.
    pub allocated_bytes_peak: u64,
    /// Bytes of pinned memory held from the driver: active and cached blocks.
    pub reserved_bytes_current: u64,
    /// Peak of `reserved_bytes_current`.
    pub reserved_bytes_peak: u64,
    /// Free blocks in the cache, ready for reuse.
    pub cached_blocks: u64,
    /// Pinned ranges obtained from the driver (accumulated).
    pub driver_allocations: u64,
    /// Pinned ranges returned to the driver (accumulated).
    pub driver_frees: u64,
    /// Time spent obtaining pinned memory from the driver, in total (accumulated).
    pub pin_time_total_ns: u64,
    /// Longest single pinning call (accumulated).
    pub pin_time_max_ns: u64,
    /// Time spent returning pinned memory to the driver, in total (accumulated).
    pub unpin_time_total_ns: u64,
    /// Longest single unpinning call (accumulated).
    pub unpin_time_max_ns: u64,
}

impl From<HostStats> for tensoralloc_host_stats {
    fn from(s: HostStats) -> Self {
        let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        tensoralloc_host_stats {
            allocations_current: s.allocations.current,
            allocations_peak: s.allocations.peak,
            active_blocks_current: s.active_blocks.current,
            active_blocks_peak: s.active_blocks.peak,
            allocated_bytes_current: s.allocated_bytes.current,
            allocated_bytes_peak: s.allocated_bytes.peak,
            reserved_bytes_current: s.reserved_bytes.current,
            reserved_bytes_peak: s.reserved_bytes.peak,
            cached_blocks: s.cached_blocks,
            driver_allocations: s.driver_allocations,
            driver_frees: s.driver_frees,
            pin_time_total_ns: ns(s.pin_time_total),
            pin_time_max_ns: ns(s.pin_time_max),
            unpin_time_total_ns: ns(s.unpin_time_total),
            unpin_time_max_ns: ns(s.unpin_time_max),
        }
    }
}

/// The process-wide pinned-host allocator.
#[inline]
fn host() -> Result<&'static HostAllocator> {
    Runtime::get().map(Runtime::host)
}

fn ctx_arg(ctx: *mut c_void) -> Option<usize> {
    (!ctx.is_null()).then_some(ctx as usize)
}

/// Allocates `size` bytes of pinned (page-locked) host memory, rounded up to a power of two,
/// from tensoralloc's cache, pinning new memory through the driver only when no cached block
/// is large enough.
///
/// If `ctx` is not NULL, `*ctx` receives a context that identifies the block to
/// `tensoralloc_host_free` and `tensoralloc_host_record_event` without a lookup (PyTorch's
/// `DataPtr` context); it is only meaningful to tensoralloc.
///
/// Returns the address, owned by the caller until passed to `tensoralloc_host_free`. A 0-byte
/// request returns NULL (and `*ctx = NULL`) with an empty last error. Returns NULL (and
/// `*ctx = NULL`) with a last error on an absurd size, no usable driver, or when the driver
/// cannot pin more memory even after the cache was returned to it.
#[no_mangle]
pub extern "C" fn tensoralloc_host_malloc(size: usize, ctx: *mut *mut c_void) -> *mut c_void {
    ffi_boundary! {
        let (ptr, c) = match host().and_then(|h| h.malloc(size)) {
            Ok(b) => (b.ptr as *mut c_void, b.ctx as *mut c_void),
            Err(e) => {
                fail(&e);
                (std::ptr::null_mut(), std::ptr::null_mut())
            }
        };
        if !ctx.is_null() {
            // SAFETY: the caller passes NULL or a pointer to writable storage for one pointer.
            unsafe { ctx.write(c) };
        }
        ptr
    }
}

/// Returns `ptr`, from `tensoralloc_host_malloc`, to the cache. `ctx` is the context that
/// `tensoralloc_host_malloc` gave, or NULL to find the block by address (a context that does
/// not belong to `ptr` is ignored the same way).
///
/// If streams used the block (`tensoralloc_host_record_event`), an event is recorded on each
/// and the block is reused only after all of them have completed; this call never waits.
///
/// Freeing NULL does nothing. A pointer that is not a live block of this allocator (never
/// allocated, already freed, inside a block) changes nothing and sets the last error. If an
/// event cannot be recorded, the block is kept out of the cache for good (a stream may still
/// read it) and the last error says so.
#[no_mangle]
pub extern "C" fn tensoralloc_host_free(ptr: *mut c_void, ctx: *mut c_void) {
    ffi_boundary! {
        if ptr.is_null() {
            return;
        }
        if let Err(e) = host().and_then(|h| h.free(ptr as usize, ctx_arg(ctx))) {
            fail(&e);
        }
    }
}

/// Records that `stream` uses the pinned block `ptr` (`ctx` as given by
/// `tensoralloc_host_malloc`, or NULL), so that when the block is freed it is not reused
/// before the work queued on `stream` up to the free has completed. Any pointer may be passed.
///
/// Returns true if `ptr` is a live block of this allocator. Returns false, changing nothing,
/// for any other pointer (not pinned by tensoralloc, or already freed); the last error stays
/// empty, since that is not a failure. Returns false with a last error when no driver is
/// usable.
#[no_mangle]
pub extern "C" fn tensoralloc_host_record_event(
    ptr: *mut c_void,
    ctx: *mut c_void,
    stream: *mut CUstream_st,
) -> bool {
    ffi_boundary! {
        match host() {
            Ok(h) => h.record_event(ptr as usize, ctx_arg(ctx), stream_id(stream)),
            Err(e) => {
                fail(&e);
                false
            }
        }
    }
}

/// Returns every free cached pinned block to the driver, after moving blocks whose stream
/// events have completed back into the cache (without waiting for the others). Blocks in use,
/// and freed blocks whose streams are still running, are kept. On failure the last error says
/// why; the other blocks are still released.
#[no_mangle]
pub extern "C" fn tensoralloc_host_empty_cache() {
    ffi_boundary! {
        if let Err(e) = host().and_then(|h| h.empty_cache()) {
            fail(&e);
        }
    }
}

/// Copies the pinned-host allocator's statistics into `*out` (owned by the caller).
///
/// Returns `TENSORALLOC_OK`, or an error status with a last error when `out` is NULL or no
/// driver is usable; `*out` is then unchanged.
#[no_mangle]
pub extern "C" fn tensoralloc_host_get_stats(
    out: *mut tensoralloc_host_stats,
) -> tensoralloc_status {
    ffi_boundary! {
        if out.is_null() {
            return fail(&Error::InvalidArgument("tensoralloc_host_get_stats: out is NULL".into()));
        }
        match host() {
            Ok(h) => {
                // SAFETY: `out` is non-NULL and the caller promises it points to writable
                // storage for one tensoralloc_host_stats.
                unsafe { out.write(h.stats().into()) };
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

/// Sets every peak of the pinned-host statistics to its current value. On failure (no usable
/// driver) the last error says why.
#[no_mangle]
pub extern "C" fn tensoralloc_host_reset_peak_stats() {
    ffi_boundary! {
        match host() {
            Ok(h) => h.reset_peak_stats(),
            Err(e) => {
                fail(&e);
            }
        }
    }
}

/// Zeroes the accumulated pinned-host statistics: `driver_allocations`, `driver_frees` and
/// the pinning and unpinning times. On failure (no usable driver) the last error says why.
#[no_mangle]
pub extern "C" fn tensoralloc_host_reset_accumulated_stats() {
    ffi_boundary! {
        match host() {
            Ok(h) => h.reset_accumulated_stats(),
            Err(e) => {
                fail(&e);
            }
        }
    }
}

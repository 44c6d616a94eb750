//! C functions for PyTorch's remaining pluggable-allocator hooks: the memory fraction, base
//! allocations (for sharing memory between processes), and CUDA graph private pools. Each
//! has the type of the `CUDAPluggableAllocator` hook it serves where PyTorch has one.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::{fail, ffi_boundary, status, tensoralloc_status, CUstream_st, TENSORALLOC_OK};
use crate::device::{DeviceAllocator, StreamFilter};
use crate::error::{Error, Result};
use crate::runtime::Runtime;

/// Decides whether an allocation on `stream` goes to a graph private pool: nonzero = yes.
/// `ctx` is the pointer given to `tensoralloc_begin_allocate_to_pool`. Called on allocations
/// made while the pool is active, from the allocating thread and under tensoralloc's pool
/// lock: it must be thread-safe, cheap, and must not call tensoralloc.
#[allow(non_camel_case_types)]
pub type tensoralloc_stream_filter =
    Option<extern "C" fn(ctx: *mut c_void, stream: *mut CUstream_st) -> c_int>;

/// Sets the memory fraction of device `device` (PyTorch's `memory_fraction` hook, used by
/// `torch.cuda.set_per_process_memory_fraction`): from now on the bytes tensoralloc reserves
/// on that device stay at most `fraction` times its total memory. An allocation that would
/// need more first returns cached memory to the driver and retries (not while a private pool
/// is being allocated to), then fails as out of memory with a message that gives the limit
/// (and counts in `num_ooms`). Memory reserved already is kept. `fraction` must lie in [0, 1].
/// As in PyTorch, setting a fraction also turns on `garbage_collection_threshold`, which is a
/// share of the bytes the fraction allows.
///
/// On a fraction outside [0, 1] (or NaN), a device that does not exist, or no usable driver,
/// nothing changes and the last error says why.
#[no_mangle]
pub extern "C" fn tensoralloc_set_memory_fraction(fraction: f64, device: c_int) {
    ffi_boundary! {
        let result = Runtime::get()
            .and_then(|rt| rt.device_from_c(device))
            .and_then(|d| d.set_memory_fraction(fraction));
        if let Err(e) = result {
            fail(&e);
        }
    }
}

/// Writes the memory fraction of device `device` to `*out` (owned by the caller): 1.0 when it
/// was never set. Returns `TENSORALLOC_OK`, or an error status with a last error when `out` is
/// NULL, the device does not exist or no driver is usable; `*out` is then unchanged.
#[no_mangle]
pub extern "C" fn tensoralloc_get_memory_fraction(
    device: c_int,
    out: *mut f64,
) -> tensoralloc_status {
    ffi_boundary! {
        if out.is_null() {
            return fail(&Error::InvalidArgument("tensoralloc_get_memory_fraction: out is NULL".into()));
        }
        match Runtime::get().and_then(|rt| rt.device_from_c(device)) {
            Ok(d) => {
                // SAFETY: `out` is non-NULL and the caller promises it points to a writable double.
                unsafe { out.write(d.memory_fraction()) };
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

/// The base of the device memory segment that holds the live allocation containing `ptr`
/// (its start or any byte inside it), with the segment's size written to `*size` (PyTorch's
/// `base_alloc` hook, used by `torch.multiprocessing` to share CUDA tensors: the segment is
/// what the driver allocated, so it is what an IPC handle covers). The memory stays owned by
/// tensoralloc.
///
/// Returns NULL with a last error when `ptr` is not inside a live allocation of tensoralloc
/// (never allocated, freed, or cached), or `size` is NULL; `*size` is then unchanged.
#[no_mangle]
pub extern "C" fn tensoralloc_get_base_allocation(
    ptr: *mut c_void,
    size: *mut usize,
) -> *mut c_void {
    ffi_boundary! {
        let result = Runtime::get().and_then(|rt| {
            if size.is_null() {
                return Err(Error::InvalidArgument("tensoralloc_get_base_allocation: size is NULL".into()));
            }
            let addr = ptr as usize;
            match rt.owner_of(addr) {
                Some(d) => d.base_allocation(addr),
                None => Err(Error::UnknownPointer(format!(
                    "base allocation: {addr:#x} is not inside a live allocation of tensoralloc"
                ))),
            }
        });
        match result {
            Ok((base, bytes)) => {
                // SAFETY: `size` is non-NULL (checked above) and the caller promises it points
                // to a writable size_t.
                unsafe { size.write(bytes) };
                base as *mut c_void
            }
            Err(e) => {
                fail(&e);
                std::ptr::null_mut()
            }
        }
    }
}

/// Runs `f` on the allocator of C device index `device` and reports its result as a status.
fn on_device(device: c_int, f: impl FnOnce(&DeviceAllocator) -> Result<()>) -> tensoralloc_status {
    status(
        Runtime::get()
            .and_then(|rt| rt.device_from_c(device))
            .and_then(f),
    )
}

/// A C filter and its context, callable from any thread.
struct CFilter {
    filter: extern "C" fn(*mut c_void, *mut CUstream_st) -> c_int,
    ctx: *mut c_void,
}

impl CFilter {
    fn accepts(&self, stream: usize) -> bool {
        (self.filter)(self.ctx, stream as *mut CUstream_st) != 0
    }
}

// SAFETY: the caller of tensoralloc_begin_allocate_to_pool promises that `filter` may be called
// from any thread with `ctx` and that `ctx` stays valid until the matching end returns; the
// allocator drops the filter (under its pool lock) before that end returns.
unsafe impl Send for CFilter {}
// SAFETY: as above.
unsafe impl Sync for CFilter {}

/// Starts allocating to the graph private pool `(pool_id_0, pool_id_1)` of device `device`
/// (PyTorch's `begin_allocate_to_pool` hook; the C++ helper unpacks PyTorch's `MempoolId_t`).
/// Until `tensoralloc_end_allocate_to_pool` with the same id, allocations on a stream for
/// which `filter(ctx, stream)` returns nonzero (every stream when `filter` is NULL) come from
/// that pool, and its blocks are never handed to allocations outside it. The pool is created
/// on first use; each begin adds a use, which `tensoralloc_release_pool` drops. Several pools
/// may be active at once; a stream goes to the first begun pool that accepts it.
///
/// While any pool of the device is active, tensoralloc takes the device to be capturing a CUDA
/// graph: it queries and waits for no event, records the events of frees of blocks used by
/// other streams (`tensoralloc_record_stream`) only once the last pool ends, and frees no
/// cached memory to the driver (`tensoralloc_empty_cache` does nothing to the device then)
/// except oversize blocks that an allocation which found no room needs freed, as PyTorch does.
/// The call returns once such work that other threads began before it (emptying the cache,
/// waiting for or recording events) has finished, so a capture begun after it sees none of it;
/// it may therefore wait as long as such a driver call takes.
///
/// `ctx` (owned by the caller) must stay valid until the matching end returns. Returns
/// `TENSORALLOC_OK`, or an error status with a last error for the id (0, 0) (PyTorch's "no
/// pool"), a device that does not exist, or no usable driver.
#[no_mangle]
pub extern "C" fn tensoralloc_begin_allocate_to_pool(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
    filter: tensoralloc_stream_filter,
    ctx: *mut c_void,
) -> tensoralloc_status {
    ffi_boundary! {
        let filter: Option<StreamFilter> = filter.map(|filter| {
            let c = CFilter { filter, ctx };
            Arc::new(move |stream: usize| c.accepts(stream))
                as StreamFilter
        });
        on_device(device, |d| d.begin_allocate_to_pool((pool_id_0, pool_id_1), filter))
    }
}

/// Stops allocating to the pool `(pool_id_0, pool_id_1)` of device `device` (PyTorch's
/// `end_allocate_to_pool` hook): ends the oldest begin of it still underway. Once no pool of
/// the device is active, deferred stream events are recorded. The pool keeps its memory and
/// its use. Returns `TENSORALLOC_OK`, or an error status with a last error when no allocation
/// to that pool is underway, for the id (0, 0), or a device that does not exist.
#[no_mangle]
pub extern "C" fn tensoralloc_end_allocate_to_pool(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
) -> tensoralloc_status {
    ffi_boundary! {
        on_device(device, |d| d.end_allocate_to_pool((pool_id_0, pool_id_1)))
    }
}

/// Drops one use of the pool `(pool_id_0, pool_id_1)` of device `device` (PyTorch's
/// `release_pool` hook, called when a CUDA graph or memory pool is destroyed). When no use
/// remains, the pool's cached segments go back to the driver as soon as nothing allocated in
/// them remains and no capture is underway (at the latest at `tensoralloc_empty_cache`), and
/// the pool disappears once it holds no memory. Returns `TENSORALLOC_OK`, or an error status
/// with a last error when the pool has no use to drop, for the id (0, 0), or a device that
/// does not exist.
#[no_mangle]
pub extern "C" fn tensoralloc_release_pool(
    device: c_int,
    pool_id_0: u64,
    pool_id_1: u64,
) -> tensoralloc_status {
    ffi_boundary! {
        on_device(device, |d| d.release_pool((pool_id_0, pool_id_1)))
    }
}

//! C functions of the caching device allocator. The allocation functions have exactly the
//! types PyTorch's `CUDAPluggableAllocator` loads.

use std::ffi::{c_int, c_void};

use super::{
    fail, ffi_boundary, status, stream_id, tensoralloc_status, CUstream_st, TENSORALLOC_OK,
};
use crate::device::stats::{DeviceStats, Stat};
use crate::error::Error;
use crate::runtime::Runtime;

/// Column of a `tensoralloc_stat` array that covers both pools.
pub const TENSORALLOC_STAT_AGGREGATE: usize = 0;
/// Column of a `tensoralloc_stat` array for the small pool (blocks up to 1 MiB).
pub const TENSORALLOC_STAT_SMALL_POOL: usize = 1;
/// Column of a `tensoralloc_stat` array for the large pool (blocks over 1 MiB).
pub const TENSORALLOC_STAT_LARGE_POOL: usize = 2;

/// One statistic.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct tensoralloc_stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last `tensoralloc_reset_peak_stats`.
    pub peak: i64,
    /// Total added since the last `tensoralloc_reset_accumulated_stats`.
    pub allocated: i64,
    /// Total removed since the last `tensoralloc_reset_accumulated_stats`.
    pub freed: i64,
}

/// Statistics of one device, as PyTorch's `torch.cuda.memory_stats` reports them. Each array
/// is indexed by `TENSORALLOC_STAT_AGGREGATE`, `TENSORALLOC_STAT_SMALL_POOL` and
/// `TENSORALLOC_STAT_LARGE_POOL`. Sizes are bytes.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct tensoralloc_device_stats {
    /// Allocations handed to clients.
    pub allocation: [tensoralloc_stat; 3],
    /// Segments obtained from the driver (`cuMemAlloc`).
    pub segment: [tensoralloc_stat; 3],
    /// Active blocks: allocated, or freed but still in use by a stream (`record_stream`).
    pub active: [tensoralloc_stat; 3],
    /// Free blocks inside split segments (cached, but not returnable to the driver).
    pub inactive_split: [tensoralloc_stat; 3],
    /// Bytes allocated to clients (sizes rounded up to 512 B).
    pub allocated_bytes: [tensoralloc_stat; 3],
    /// Bytes reserved from the driver (allocated plus cached).
    pub reserved_bytes: [tensoralloc_stat; 3],
    /// Bytes in active blocks.
    pub active_bytes: [tensoralloc_stat; 3],
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: [tensoralloc_stat; 3],
    /// Bytes clients asked for (before rounding).
    pub requested_bytes: [tensoralloc_stat; 3],
    /// Driver allocations that failed and were retried after freeing the cache.
    pub num_alloc_retries: i64,
    /// Allocations that failed with out-of-memory even after freeing the cache.
    pub num_ooms: i64,
    /// Allocations of blocks of at least `max_split_size` bytes.
    pub oversize_allocations: tensoralloc_stat,
    /// Segments of at least `max_split_size` bytes.
    pub oversize_segments: tensoralloc_stat,
    /// Times the allocator waited for all outstanding stream events before freeing segments.
    pub num_sync_all_streams: i64,
    /// Segments obtained from the driver.
    pub num_device_alloc: i64,
    /// Segments returned to the driver.
    pub num_device_free: i64,
    /// Blocks of at least this many bytes are never split (`max_split_size_mb`); -1 = no limit.
    pub max_split_size: i64,
    /// Frees of pointers that were not live allocations (unknown or already freed); each was
    /// ignored without changing anything.
    pub num_invalid_frees: i64,
}

fn c_stat(s: Stat) -> tensoralloc_stat {
    tensoralloc_stat {
        current: s.current,
        peak: s.peak,
        allocated: s.allocated,
        freed: s.freed,
    }
}

fn c_array(a: [Stat; 3]) -> [tensoralloc_stat; 3] {
    a.map(c_stat)
}

impl From<DeviceStats> for tensoralloc_device_stats {
    fn from(s: DeviceStats) -> Self {
        tensoralloc_device_stats {
            allocation: c_array(s.allocation),
            segment: c_array(s.segment),
            active: c_array(s.active),
            inactive_split: c_array(s.inactive_split),
            allocated_bytes: c_array(s.allocated_bytes),
            reserved_bytes: c_array(s.reserved_bytes),
            active_bytes: c_array(s.active_bytes),
            inactive_split_bytes: c_array(s.inactive_split_bytes),
            requested_bytes: c_array(s.requested_bytes),
            num_alloc_retries: s.num_alloc_retries,
            num_ooms: s.num_ooms,
            oversize_allocations: c_stat(s.oversize_allocations),
            oversize_segments: c_stat(s.oversize_segments),
            num_sync_all_streams: s.num_sync_all_streams,
            num_device_alloc: s.num_device_alloc,
            num_device_free: s.num_device_free,
            max_split_size: s.max_split_size,
            num_invalid_frees: s.num_invalid_frees,
        }
    }
}

/// Allocates `size` bytes of memory on device `device` for use on `stream` (NULL is the legacy
/// default stream). The memory is reused only by allocations on the same stream unless
/// `tensoralloc_record_stream` says otherwise. The signature is PyTorch's
/// `CUDAPluggableAllocator` allocation function.
///
/// Returns the address, owned by the caller until passed to `tensoralloc_free`. Returns NULL
/// with an empty last error when `size` is 0. Returns NULL with a last error on an absurd size
/// (over 1 PiB, e.g. a negative number cast to `size_t`), a device index that does not exist,
/// no usable driver, or out of memory (after returning cached memory to the driver and
/// retrying, except while a private pool is being allocated to; the message gives the
/// device's capacity, its free memory, and what tensoralloc holds). A device serves 4,096
/// streams at once: a new stream beyond them takes over the share of a stream that holds no
/// memory (none allocated, no free waiting for other streams' work, and under expandable
/// segments no free page still mapped: `tensoralloc_empty_cache` returns those), and gets NULL
/// with a last error only when every one of them holds some. A stream handle with its top bit
/// set (`0x8000000000000000` and above: a kernel-space address, which no CUDA stream has) names
/// no stream and gets NULL with a last error.
#[no_mangle]
pub extern "C" fn tensoralloc_malloc(
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
) -> *mut c_void {
    ffi_boundary! {
        match Runtime::get().and_then(|rt| rt.device_from_c(device)).and_then(|d| d.malloc(size, stream_id(stream))) {
            Ok(p) => p as *mut c_void,
            Err(e) => {
                fail(&e);
                std::ptr::null_mut()
            }
        }
    }
}

/// Frees memory returned by `tensoralloc_malloc`. `size`, `device` and `stream` are those given
/// at allocation (PyTorch's `CUDAPluggableAllocator` free function passes them); the pointer
/// alone decides what is freed, so a wrong `size` or `stream` does no harm. The memory returns
/// to tensoralloc's cache; if other streams used it (`tensoralloc_record_stream`), only once
/// their work queued so far has completed.
///
/// Freeing NULL does nothing. Freeing a pointer that is not a live allocation (never
/// allocated, already freed, or inside a block) changes nothing: the last error says so, the
/// device's `num_invalid_frees` counts it, and the first one prints a warning on stderr.
#[no_mangle]
pub extern "C" fn tensoralloc_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
) {
    let _ = size;
    ffi_boundary! {
        if ptr.is_null() {
            return;
        }
        let result = Runtime::get().and_then(|rt| {
            let addr = ptr as usize;
            let hint = Some(stream_id(stream));
            let given = rt.device_from_c(device);
            if let Ok(d) = given {
                if d.try_free(addr, hint)? {
                    return Ok(());
                }
            }
            // A wrong device index: find the owner by address.
            match rt.owner_of(addr) {
                Some(d) if d.try_free(addr, hint)? => Ok(()),
                Some(d) => Err(d.invalid_free(addr)),
                None => Err(given.or_else(|_| rt.device(0))?.invalid_free(addr)),
            }
        });
        if let Err(e) = result {
            fail(&e);
        }
    }
}

/// Marks the allocation `ptr` as used by `stream` (PyTorch's `record_stream`): when it is
/// freed, it is not reused until the work queued on `stream` up to that free has completed.
/// Recording the allocation's own stream does nothing.
///
/// On an unknown pointer, or a stream handle with its top bit set (see `tensoralloc_malloc`),
/// nothing changes and the last error says why.
#[no_mangle]
pub extern "C" fn tensoralloc_record_stream(ptr: *mut c_void, stream: *mut CUstream_st) {
    ffi_boundary! {
        let result = Runtime::get().and_then(|rt| {
            let addr = ptr as usize;
            match rt.owner_of(addr) {
                Some(d) => d.record_stream(addr, stream_id(stream)),
                None => Err(Error::UnknownPointer(format!(
                    "record_stream: {addr:#x} is not a live allocation of tensoralloc"
                ))),
            }
        });
        if let Err(e) = result {
            fail(&e);
        }
    }
}

/// Returns every cached, unused segment of every device to the driver, after waiting for the
/// stream work that deferred frees are waiting on. Live allocations are untouched.
/// PyTorch's pluggable-allocator reset hook. On failure the last error says why.
#[no_mangle]
pub extern "C" fn tensoralloc_empty_cache() {
    ffi_boundary! {
        let result = Runtime::get().and_then(|rt| rt.devices().try_for_each(|d| d.empty_cache()));
        if let Err(e) = result {
            fail(&e);
        }
    }
}

/// Initializes tensoralloc for `device_count` devices (PyTorch's pluggable-allocator init
/// hook). Optional: the first allocation initializes too. Selects the driver
/// (`TENSORALLOC_DRIVER`) and reads the configuration (`TENSORALLOC_CONF`). When there is no
/// usable driver or the configuration is bad, the last error says why and later calls fail
/// with the same reason. A count the driver cannot serve (negative, or more devices than it
/// has) only sets the last error: later calls on existing devices still work.
#[no_mangle]
pub extern "C" fn tensoralloc_init(device_count: c_int) {
    ffi_boundary! {
        let result = Runtime::get().and_then(|rt| {
            if device_count < 0 || device_count as usize > rt.device_count() {
                return Err(Error::InvalidArgument(format!(
                    "init for {device_count} devices, but the {} driver has {}",
                    rt.driver().name(),
                    rt.device_count()
                )));
            }
            (0..device_count as usize).try_for_each(|i| rt.device(i).map(|_| ()))
        });
        if let Err(e) = result {
            fail(&e);
        }
    }
}

/// Copies device `device`'s statistics into `*out` (owned by the caller). Reading statistics
/// never blocks allocation.
///
/// Returns `TENSORALLOC_OK`, or an error status with a last error when `out` is NULL, the
/// device does not exist, or no driver is usable; `*out` is then unchanged.
#[no_mangle]
pub extern "C" fn tensoralloc_get_device_stats(
    device: c_int,
    out: *mut tensoralloc_device_stats,
) -> tensoralloc_status {
    ffi_boundary! {
        if out.is_null() {
            return fail(&Error::InvalidArgument("tensoralloc_get_device_stats: out is NULL".into()));
        }
        match Runtime::get().and_then(|rt| rt.device_from_c(device)) {
            Ok(d) => {
                // SAFETY: `out` is non-NULL and the caller promises it points to writable
                // storage for one tensoralloc_device_stats.
                unsafe { out.write(d.stats().into()) };
                TENSORALLOC_OK
            }
            Err(e) => fail(&e),
        }
    }
}

/// Sets every peak statistic of device `device` to its current value.
/// Returns `TENSORALLOC_OK`, or an error status with a last error for a bad device.
#[no_mangle]
pub extern "C" fn tensoralloc_reset_peak_stats(device: c_int) -> tensoralloc_status {
    ffi_boundary! {
        status(Runtime::get().and_then(|rt| rt.device_from_c(device)).map(|d| d.reset_peak_stats()))
    }
}

/// Zeroes the accumulated statistics of device `device`: every `allocated` and `freed` total,
/// and the counters `num_alloc_retries`, `num_ooms`, `num_sync_all_streams`,
/// `num_device_alloc`, `num_device_free`, `num_invalid_frees`.
/// Returns `TENSORALLOC_OK`, or an error status with a last error for a bad device.
#[no_mangle]
pub extern "C" fn tensoralloc_reset_accumulated_stats(device: c_int) -> tensoralloc_status {
    ffi_boundary! {
        status(Runtime::get().and_then(|rt| rt.device_from_c(device)).map(|d| d.reset_accumulated_stats()))
    }
}

/// Number of devices tensoralloc can allocate on, or -1 with a last error when no driver is
/// usable.
#[no_mangle]
pub extern "C" fn tensoralloc_device_count() -> c_int {
    ffi_boundary! {
        match Runtime::get() {
            Ok(rt) => rt.device_count() as c_int,
            Err(e) => {
                fail(&e);
                -1
            }
        }
    }
}

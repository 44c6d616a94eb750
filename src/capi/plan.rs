//! C functions of the memory planners: offset planning, the profiling allocator
//! (`tensoralloc_profiling`) and the storage-group planner (`tensoralloc_storage_plan`).

use std::ffi::{c_char, c_int, c_void};

use parking_lot::Mutex;

use super::{fail, ffi_boundary, opt_str, status, stream_id, tensoralloc_status, CUstream_st};
use crate::error::{Error, Result};
use crate::plan::memory::{DeviceMemory, HostMemory, MemorySource};
use crate::plan::profiling::{ProfilePlan, Profiler};
use crate::plan::storage::{StoragePlanner, StorageValue};
use crate::plan::{
    lower_bound, plan_offsets_with, validate, Algorithm, Allocation, OffsetPlan, PlanOptions,
    PlanOutcome,
};

/// Reads `n` elements at `p`; NULL is accepted only when `n` is 0.
///
/// # Safety
/// `p` must be NULL or point to `n` readable elements.
unsafe fn input<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::InvalidArgument(format!(
            "{what} is NULL but n is {n}"
        )));
    }
    if n > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Error::InvalidArgument(format!("n ({n}) is absurd")));
    }
    // SAFETY: non-NULL, and the caller promises `n` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Reads the allocations described by three parallel arrays.
///
/// # Safety
/// Each pointer must be NULL or point to `n` readable values.
unsafe fn allocations(
    n: usize,
    sizes: *const u64,
    first: *const u64,
    last: *const u64,
) -> Result<Vec<Allocation>> {
    // SAFETY: forwarded from the caller.
    let (sizes, first, last) = unsafe {
        (
            input(sizes, n, "sizes")?,
            input(first, n, "first_use")?,
            input(last, n, "last_use")?,
        )
    };
    Ok((0..n)
        .map(|i| Allocation::new(sizes[i], first[i], last[i]))
        .collect())
}

fn out_is_set<T>(p: *mut T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("{what} is NULL")));
    }
    Ok(())
}

/// Plans the allocations of three parallel arrays with `options` and writes `offsets[0..n]`;
/// `out_checked` is the caller's check of its other output, reported after the input's faults
/// and before anything is written.
///
/// # Safety
/// As for `tensoralloc_plan_offsets_ex`: each array NULL or `n` readable values, `algorithm`
/// NULL or NUL-terminated, `offsets` NULL or room for `n` values.
unsafe fn plan_into(
    (n, sizes, first_use, last_use): (usize, *const u64, *const u64, *const u64),
    alignment: u64,
    algorithm: *const c_char,
    options: &PlanOptions,
    offsets: *mut u64,
    out_checked: Result<()>,
) -> Result<PlanOutcome> {
    // SAFETY: the caller promises `n` readable values behind each non-NULL array.
    let allocs = unsafe { allocations(n, sizes, first_use, last_use)? };
    // SAFETY: the caller promises a NUL-terminated string when not NULL.
    let name = unsafe { opt_str(algorithm, "algorithm")? };
    let algorithm = name.map_or(Ok(Algorithm::Best), Algorithm::from_name)?;
    if n > 0 {
        out_is_set(offsets, "offsets")?;
    }
    out_checked?;
    let outcome = plan_offsets_with(&allocs, alignment, algorithm, options)?;
    if n > 0 {
        // SAFETY: `offsets` is non-NULL and the caller promises room for `n` values.
        unsafe { std::ptr::copy_nonoverlapping(outcome.plan.offsets.as_ptr(), offsets, n) };
    }
    Ok(outcome)
}

/// Lays out `n` allocations in one arena. Allocation `i` has `sizes[i]` bytes and is live from
/// time step `first_use[i]` to `last_use[i]` inclusive; allocations `i` and `j` are live
/// together when `first_use[i] <= last_use[j] && first_use[j] <= last_use[i]`, and then never
/// share a byte. Sizes are rounded up to `alignment`; zero-byte allocations get offset 0.
///
/// `alignment` is a nonzero power of two (64 suits CPU and GPU tensors). `algorithm` is NULL
/// or `"default"` (the best plan tensoralloc finds: never larger than `"pytorch"`'s; when no
/// greedy placement meets the lower bound, a search of up to 20,000,000 work units, a
/// fraction of a second, the whole budget only for a plan at least 1/16 above the bound and
/// a share in proportion to its excess below that; above 1,024 nonzero allocations,
/// first-fit passes in orders that promote what ended above the bound, within the same
/// budget, instead of the search), `"pytorch"` (PyTorch's profiling-allocator plan: time
/// order, best fit among free gaps), `"greedy-by-size"`, `"greedy-by-breadth"`,
/// `"greedy-by-area"`, `"greedy-by-lifetime"`, `"greedy-by-time"` (one greedy placement each,
/// every allocation in the smallest gap that holds it), `"first-fit-by-size"` (largest first,
/// every allocation in the lowest gap that holds it: the fastest greedy pass on dense
/// inputs), `"best"` (same as the default) or `"exact"` (a canonical search with a budget of
/// 10,000,000,000 work units, under half a minute on a current CPU;
/// `tensoralloc_plan_offsets_ex` sets another budget and says whether the plan is proven
/// optimal). In every greedy placement, tiny allocations (at most a 2^-20th of the lower bound)
/// go after all the others, each in the lowest gap that holds it, or on top of the allocations
/// live with it when more than 64 of their byte ranges lie between its lowest free byte and
/// that gap. A first-fit placement whose larger allocations found their gaps above 64 busy
/// byte ranges each on average (dense inputs of many thousands of allocations) instead puts
/// every allocation of at most a 2^-19th of the bound in a region of its own above all the
/// others, in time order, unless such allocations have more than a 256th of the bound live at
/// once. Plans are deterministic: the same input gives the same plan on any machine. For
/// inputs of 4,096 or more nonzero allocations, `"default"` and `"exact"` make PyTorch's plan
/// on a second thread while the greedy passes run (a few milliseconds; the thread is started
/// and joined within the call), or on the calling thread when no other can be started.
///
/// On success writes `offsets[0..n]` (each a multiple of `alignment`) and `*arena_size` (the
/// largest offset + rounded size) and returns `TENSORALLOC_OK`. Returns
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` with a last error, writing nothing, for an unknown
/// algorithm, a `first_use[i] > last_use[i]`, a zero or non-power-of-two alignment, NULL arrays
/// with `n > 0`, a NULL `arena_size`, or sizes adding up to more than `UINT64_MAX`. The arrays
/// stay the caller's.
#[no_mangle]
pub extern "C" fn tensoralloc_plan_offsets(
    n: usize,
    sizes: *const u64,
    first_use: *const u64,
    last_use: *const u64,
    alignment: u64,
    algorithm: *const c_char,
    offsets: *mut u64,
    arena_size: *mut u64,
) -> tensoralloc_status {
    ffi_boundary! {
        let run = || -> Result<()> {
            let defaults = PlanOptions::default();
            // SAFETY: forwarded from the caller.
            let outcome = unsafe {
                plan_into(
                    (n, sizes, first_use, last_use),
                    alignment,
                    algorithm,
                    &defaults,
                    offsets,
                    out_is_set(arena_size, "arena_size"),
                )?
            };
            // SAFETY: non-NULL, and the caller promises a writable uint64_t.
            unsafe { arena_size.write(outcome.plan.arena_size) };
            Ok(())
        };
        status(run())
    }
}

/// Options of `tensoralloc_plan_offsets_ex`. Zero-initialise it (`= {0}`) for the defaults,
/// then set what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tensoralloc_plan_options {
    /// Work units the search of `"default"` and `"exact"` may spend (allocations scanned,
    /// sections checked, neighbours updated: roughly 6·10^8 to 9·10^8 a second of search on
    /// one core), and with it the greedy passes that refine the plan of `"default"` (each
    /// costing its pairs of allocations live together plus its allocations). 0 means the
    /// algorithm's default (20,000,000 for `"default"`, 10,000,000,000 for `"exact"`).
    /// `"default"` spends all of it only on a plan at least 1/16 above the lower bound, and
    /// a share in proportion to the excess below that. The plan depends only on the input
    /// and this budget, never on the machine.
    pub work_budget: u64,
    /// Wall-clock cap in milliseconds, 0 for none. Passing it stops the search early, so
    /// plans made under a time cap may differ between runs; use `work_budget` for
    /// reproducible ones.
    pub time_limit_ms: u64,
}

/// What `tensoralloc_plan_offsets_ex` found besides the offsets.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tensoralloc_plan_result {
    /// Bytes the arena needs: the largest offset + rounded size.
    pub arena_size: u64,
    /// The smallest arena any layout can have (most bytes live at once).
    pub lower_bound: u64,
    /// Work units the search spent (0 when none ran).
    pub work: u64,
    /// 1 when no layout has a smaller arena (the plan meets the lower bound, or the search
    /// finished); 0 when the budget or time cap stopped it first.
    pub proven_optimal: c_int,
}

/// `tensoralloc_plan_offsets` with the search budget and time cap of `options` (for
/// `"default"` and `"exact"`; the other algorithms do not search), reporting whether the plan
/// is proven optimal. `options` may be NULL (all defaults: 20,000,000 work units for
/// `"default"`, 10,000,000,000 for `"exact"`, no time cap). On success writes `offsets[0..n]`
/// and `*result` and returns `TENSORALLOC_OK`. Returns `TENSORALLOC_ERR_INVALID_ARGUMENT` with
/// a last error, writing nothing, on the inputs `tensoralloc_plan_offsets` rejects or a NULL
/// `result`. The arrays and structs stay the caller's.
#[no_mangle]
pub extern "C" fn tensoralloc_plan_offsets_ex(
    n: usize,
    sizes: *const u64,
    first_use: *const u64,
    last_use: *const u64,
    alignment: u64,
    algorithm: *const c_char,
    options: *const tensoralloc_plan_options,
    offsets: *mut u64,
    result: *mut tensoralloc_plan_result,
) -> tensoralloc_status {
    ffi_boundary! {
        let run = || -> Result<()> {
            // SAFETY: the caller promises a readable struct when not NULL.
            let options = unsafe { options.as_ref() }.copied().unwrap_or_default();
            let plan_options = PlanOptions {
                work_budget: (options.work_budget > 0).then_some(options.work_budget),
                time_limit: (options.time_limit_ms > 0)
                    .then(|| std::time::Duration::from_millis(options.time_limit_ms)),
            };
            // SAFETY: forwarded from the caller.
            let (outcome, bound) = unsafe {
                let outcome = plan_into(
                    (n, sizes, first_use, last_use),
                    alignment,
                    algorithm,
                    &plan_options,
                    offsets,
                    out_is_set(result, "result"),
                )?;
                (outcome, lower_bound(&allocations(n, sizes, first_use, last_use)?, alignment)?)
            };
            // SAFETY: non-NULL, and the caller promises a writable struct.
            unsafe {
                result.write(tensoralloc_plan_result {
                    arena_size: outcome.plan.arena_size,
                    lower_bound: bound,
                    work: outcome.work,
                    proven_optimal: c_int::from(outcome.proven_optimal),
                })
            };
            Ok(())
        };
        status(run())
    }
}

/// The smallest arena any layout of the `n` allocations can have (the most bytes, sizes
/// rounded up to `alignment`, live at one time step), written to `*bound`. The arguments mean
/// what they mean for `tensoralloc_plan_offsets`. Returns `TENSORALLOC_OK`, or
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` with a last error on the inputs that function rejects or
/// a NULL `bound`.
#[no_mangle]
pub extern "C" fn tensoralloc_plan_lower_bound(
    n: usize,
    sizes: *const u64,
    first_use: *const u64,
    last_use: *const u64,
    alignment: u64,
    bound: *mut u64,
) -> tensoralloc_status {
    ffi_boundary! {
        let run = || -> Result<()> {
            // SAFETY: the caller promises `n` readable values behind each non-NULL array.
            let allocs = unsafe { allocations(n, sizes, first_use, last_use)? };
            out_is_set(bound, "bound")?;
            let b = lower_bound(&allocs, alignment)?;
            // SAFETY: non-NULL, and the caller promises a writable uint64_t.
            unsafe { bound.write(b) };
            Ok(())
        };
        status(run())
    }
}

/// Checks a layout: returns `TENSORALLOC_OK` when every `offsets[i]` is a multiple of
/// `alignment`, every allocation (size rounded up) fits in `arena_size` bytes, and no two
/// allocations live together share a byte. Otherwise returns
/// `TENSORALLOC_ERR_INVALID_ARGUMENT`, and the last error names the first fault (for example
/// the two overlapping allocations). The other arguments are as for `tensoralloc_plan_offsets`.
#[no_mangle]
pub extern "C" fn tensoralloc_plan_validate(
    n: usize,
    sizes: *const u64,
    first_use: *const u64,
    last_use: *const u64,
    alignment: u64,
    offsets: *const u64,
    arena_size: u64,
) -> tensoralloc_status {
    ffi_boundary! {
        let run = || -> Result<()> {
            // SAFETY: the caller promises `n` readable values behind each non-NULL array.
            let allocs = unsafe { allocations(n, sizes, first_use, last_use)? };
            // SAFETY: as above.
            let offsets = unsafe { input(offsets, n, "offsets")? }.to_vec();
            validate(&allocs, &OffsetPlan { offsets, arena_size }, alignment)
        };
        status(run())
    }
}

/// The memory of a planner handle: host memory for a negative device, else that device's
/// caching allocator on `stream`.
fn memory_of(device: c_int, stream: *mut CUstream_st) -> Result<Box<dyn MemorySource>> {
    if device < 0 {
        Ok(Box::new(HostMemory))
    } else {
        Ok(Box::new(DeviceMemory::new(
            device as usize,
            stream_id(stream),
        )?))
    }
}

/// A profiling allocator (opaque). Made by `tensoralloc_profiling_new`, released by
/// `tensoralloc_profiling_free`. Safe to use from several threads (calls are serialized), but
/// an iteration is one sequence of calls: record, validate and serve from one thread.
///
/// The cycle: record an iteration (`begin_recording`, the iteration's
/// `tensoralloc_profiling_malloc` / `_release` calls, `end_recording`);
/// `tensoralloc_profiling_plan`; then optionally
/// check a later iteration (`begin_validating` ... `end_validating`, which says whether it
/// matched); then serve iterations from one blob (`begin_serving` ... `end_serving`). Plans
/// save to and load from JSON.
#[allow(non_camel_case_types)]
pub struct tensoralloc_profiling {
    inner: Mutex<Profiler>,
}

/// Counters of a profiling allocator, since it was made.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct tensoralloc_profiling_stats {
    /// Allocations in the current plan (0 without a plan).
    pub plan_allocations: u64,
    /// Of those, how many are served from the blob (the others were not freed during the
    /// recording, or were zero bytes, and come from the ordinary allocator).
    pub plan_planned: u64,
    /// Bytes of the blob the current plan needs.
    pub plan_blob_bytes: u64,
    /// Bytes of the blob held now.
    pub blob_bytes: u64,
    /// Iterations recorded.
    pub recordings: u64,
    /// Iterations validated.
    pub validations: u64,
    /// Iterations validated that matched the plan.
    pub validations_matched: u64,
    /// Iterations served.
    pub iterations_served: u64,
    /// Allocations served from the blob.
    pub served_from_blob: u64,
    /// Allocations that the plan leaves to the ordinary allocator, served while serving.
    pub served_unplanned: u64,
    /// Allocations that strayed from the plan while serving (another size, more allocations
    /// than recorded, or planned bytes still in use) and came from the ordinary allocator.
    pub mismatches: u64,
    /// Frees that came at another point of an iteration than planned (harmless: the blob
    /// bytes are reused only once free).
    pub lifetime_mismatches: u64,
    /// Pointers handed out and not yet released.
    pub live_allocations: u64,
}

/// Reads a profiling handle.
///
/// # Safety
/// `h` must be NULL or a live handle from `tensoralloc_profiling_new`.
unsafe fn profiler<'a>(h: *mut tensoralloc_profiling) -> Result<&'a tensoralloc_profiling> {
    if h.is_null() {
        return Err(Error::InvalidArgument(
            "the profiling allocator handle is NULL".into(),
        ));
    }
    // SAFETY: non-NULL, and the caller promises a live handle.
    Ok(unsafe { &*h })
}

/// Runs `f` on the profiler behind `h` and converts the result to a status.
fn with_profiler(
    h: *mut tensoralloc_profiling,
    f: impl FnOnce(&mut Profiler) -> Result<()>,
) -> tensoralloc_status {
    // SAFETY: the caller of the exported function promises a live handle or NULL.
    match unsafe { profiler(h) } {
        Ok(p) => status(f(&mut p.inner.lock())),
        Err(e) => fail(&e),
    }
}

/// Makes a profiling allocator. `device < 0`: host memory (`posix_memalign`); otherwise the
/// blob and the ordinary allocations come from tensoralloc's caching allocator of device
/// `device`, on `stream` (NULL: the legacy default stream). Offsets in plans it makes are
/// multiples of `alignment` (a nonzero power of two; 64 suits most uses; device memory is
/// aligned to 512 bytes at most).
///
/// Returns the handle, owned by the caller until `tensoralloc_profiling_free`; NULL with a last
/// error for a bad alignment, a device that does not exist, or no usable driver.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_new(
    device: c_int,
    stream: *mut CUstream_st,
    alignment: u64,
) -> *mut tensoralloc_profiling {
    ffi_boundary! {
        match memory_of(device, stream).and_then(|m| Profiler::new(m, alignment)) {
            Ok(p) => Box::into_raw(Box::new(tensoralloc_profiling { inner: Mutex::new(p) })),
            Err(e) => {
                fail(&e);
                std::ptr::null_mut()
            }
        }
    }
}

/// Releases a profiling allocator, its blob and every allocation it handed out that is still
/// live (those pointers become invalid). NULL does nothing.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_free(h: *mut tensoralloc_profiling) {
    ffi_boundary! {
        if !h.is_null() {
            // SAFETY: the caller passes a handle from tensoralloc_profiling_new, once.
            drop(unsafe { Box::from_raw(h) });
        }
    }
}

/// Starts recording an iteration (replacing an earlier recording). Returns `TENSORALLOC_OK`,
/// or `TENSORALLOC_ERR_INVALID_ARGUMENT` with a last error for a NULL handle or while another
/// phase (recording, validating, serving) is under way.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_begin_recording(
    h: *mut tensoralloc_profiling,
) -> tensoralloc_status {
    ffi_boundary! { with_profiler(h, Profiler::begin_recording) }
}

/// Ends the recording. Errors as for `tensoralloc_profiling_begin_recording` (when not
/// recording).
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_end_recording(
    h: *mut tensoralloc_profiling,
) -> tensoralloc_status {
    ffi_boundary! { with_profiler(h, Profiler::end_recording) }
}

/// Plans the last recording with `algorithm` (NULL: the default; the names of
/// `tensoralloc_plan_offsets`), replacing the current plan. Returns `TENSORALLOC_OK`, or
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` with a last error for a NULL handle, nothing recorded,
/// an unknown algorithm, or a phase under way.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_plan(
    h: *mut tensoralloc_profiling,
    algorithm: *const c_char,
) -> tensoralloc_status {
    ffi_boundary! {
        with_profiler(h, |p| {
            // SAFETY: the caller promises a NUL-terminated string when not NULL.
            let name = unsafe { opt_str(algorithm, "algorithm")? };
            p.formulate(name.map_or(Ok(Algorithm::Best), Algorithm::from_name)?)
        })
    }
}

/// Starts comparing an iteration with the plan; its allocations come from the ordinary
/// allocator. Fails (`TENSORALLOC_ERR_INVALID_ARGUMENT`) without a plan or while a phase is
/// under way.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_begin_validating(
    h: *mut tensoralloc_profiling,
) -> tensoralloc_status {
    ffi_boundary! { with_profiler(h, Profiler::begin_validating) }
}

/// Ends the comparison and writes to `*matched` whether the iteration made exactly the planned
/// allocations (same count and sizes) and freed each planned one at its planned point.
/// Returns `TENSORALLOC_OK`, or `TENSORALLOC_ERR_INVALID_ARGUMENT` when not validating, or for
/// a NULL handle or `matched`.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_end_validating(
    h: *mut tensoralloc_profiling,
    matched: *mut bool,
) -> tensoralloc_status {
    ffi_boundary! {
        with_profiler(h, |p| {
            out_is_set(matched, "matched")?;
            let m = p.end_validating()?;
            // SAFETY: non-NULL, and the caller promises a writable bool.
            unsafe { matched.write(m) };
            Ok(())
        })
    }
}

/// Starts serving an iteration from the blob, first allocating it (or growing it to the plan's
/// size). Returns `TENSORALLOC_OK`; `TENSORALLOC_ERR_INVALID_ARGUMENT` without a plan, while a
/// phase is under way, or when the blob must grow while allocations from it are live;
/// `TENSORALLOC_ERR_OUT_OF_MEMORY` when the blob cannot be allocated.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_begin_serving(
    h: *mut tensoralloc_profiling,
) -> tensoralloc_status {
    ffi_boundary! { with_profiler(h, Profiler::begin_serving) }
}

/// Ends serving; allocations still live stay valid until released. Errors as
/// `tensoralloc_profiling_begin_recording` (when not serving).
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_end_serving(
    h: *mut tensoralloc_profiling,
) -> tensoralloc_status {
    ffi_boundary! { with_profiler(h, Profiler::end_serving) }
}

/// Allocates `size` bytes: while serving, from the blob at the planned offset when the request
/// matches the plan, otherwise (and in every other phase) from the ordinary allocator. Every
/// call counts as one allocation of the iteration, even of 0 bytes.
///
/// Returns the address, owned by the caller until `tensoralloc_profiling_release`; NULL with an
/// empty last error for 0 bytes; NULL with a last error for a NULL handle or out of memory.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_malloc(
    h: *mut tensoralloc_profiling,
    size: usize,
) -> *mut c_void {
    ffi_boundary! {
        // SAFETY: the caller promises a live handle or NULL.
        match unsafe { profiler(h) }.and_then(|p| p.inner.lock().malloc(size as u64)) {
            Ok(addr) => addr as *mut c_void,
            Err(e) => {
                fail(&e);
                std::ptr::null_mut()
            }
        }
    }
}

/// Releases `ptr` (from `tensoralloc_profiling_malloc` of this handle). NULL does nothing.
/// Returns `TENSORALLOC_OK`; `TENSORALLOC_ERR_UNKNOWN_POINTER` with a last error (changing
/// nothing) for a pointer this allocator did not hand out or that was already released;
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL handle.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_release(
    h: *mut tensoralloc_profiling,
    ptr: *mut c_void,
) -> tensoralloc_status {
    ffi_boundary! { with_profiler(h, |p| p.free(ptr as usize)) }
}

/// Writes the counters to `*out`. Returns `TENSORALLOC_OK`, or
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL handle or `out`.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_get_stats(
    h: *mut tensoralloc_profiling,
    out: *mut tensoralloc_profiling_stats,
) -> tensoralloc_status {
    ffi_boundary! {
        with_profiler(h, |p| {
            out_is_set(out, "out")?;
            let s = p.stats();
            let c = tensoralloc_profiling_stats {
                plan_allocations: s.plan_allocations,
                plan_planned: s.plan_planned,
                plan_blob_bytes: s.plan_blob_bytes,
                blob_bytes: s.blob_bytes,
                recordings: s.recordings,
                validations: s.validations,
                validations_matched: s.validations_matched,
                iterations_served: s.iterations_served,
                served_from_blob: s.served_from_blob,
                served_unplanned: s.served_unplanned,
                mismatches: s.mismatches,
                lifetime_mismatches: s.lifetime_mismatches,
                live_allocations: s.live_allocations,
            };
            // SAFETY: non-NULL, and the caller promises a writable tensoralloc_profiling_stats.
            unsafe { out.write(c) };
            Ok(())
        })
    }
}

/// Writes the current plan as JSON (NUL-terminated) into `buf`, which holds `capacity` bytes,
/// and its length without the NUL to `*length`. Call with `buf` NULL (and any capacity) to
/// learn the length first. Returns `TENSORALLOC_OK`; `TENSORALLOC_ERR_INVALID_ARGUMENT` with a
/// last error for a NULL handle or `length`, no plan, or a `buf` too small for length + 1
/// bytes (nothing is written to `buf` then, but `*length` is set).
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_save_json(
    h: *mut tensoralloc_profiling,
    buf: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> tensoralloc_status {
    ffi_boundary! {
        with_profiler(h, |p| {
            out_is_set(length, "length")?;
            let plan = p.plan().ok_or_else(|| Error::InvalidArgument("there is no plan to save".into()))?;
            let text = plan.to_json();
            // SAFETY: non-NULL, and the caller promises a writable size_t.
            unsafe { length.write(text.len()) };
            if buf.is_null() {
                return Ok(());
            }
            if capacity <= text.len() {
                return Err(Error::InvalidArgument(format!(
                    "the buffer holds {capacity} bytes; the plan needs {}",
                    text.len() + 1
                )));
            }
            // SAFETY: `buf` has room for `capacity > text.len()` bytes, as the caller promises.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, text.len());
                buf.add(text.len()).write(0);
            }
            Ok(())
        })
    }
}

/// Replaces the current plan with one read from `json` (a NUL-terminated string from
/// `tensoralloc_profiling_save_json`, possibly of another process). The plan is checked first:
/// a plan whose allocations would overlap is refused, and so is one aligned to less than the
/// handle's alignment. Returns `TENSORALLOC_OK`, or `TENSORALLOC_ERR_INVALID_ARGUMENT` with a
/// last error for a NULL handle or text, text that is not a valid plan, or a phase under way.
#[no_mangle]
pub extern "C" fn tensoralloc_profiling_load_json(
    h: *mut tensoralloc_profiling,
    json: *const c_char,
) -> tensoralloc_status {
    ffi_boundary! {
        with_profiler(h, |p| {
            // SAFETY: the caller promises a NUL-terminated string when not NULL.
            let text = unsafe { opt_str(json, "json")? }.ok_or_else(|| Error::InvalidArgument("json is NULL".into()))?;
            p.set_plan(ProfilePlan::from_json(text)?)
        })
    }
}

/// A storage-group planner (opaque), Static Runtime's memory planner: values that are never
/// live together share a storage group, and each iteration gets one buffer with every group at
/// its offset, sized by the largest value the group has held. Made by
/// `tensoralloc_storage_plan_new`, released by `tensoralloc_storage_plan_free`; calls are
/// serialized.
///
/// Each iteration: `tensoralloc_storage_plan_allocate`; for each value as it is made,
/// `tensoralloc_storage_plan_place` (which says where it lives, or that the client allocates it
/// itself this time); `tensoralloc_storage_plan_deallocate` at the end; and, once the client is
/// done with the outputs, `tensoralloc_storage_plan_release_outputs`.
#[allow(non_camel_case_types)]
pub struct tensoralloc_storage_plan {
    inner: Mutex<StoragePlanner>,
}

/// Counters of a storage-group planner (Static Runtime's names).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct tensoralloc_storage_plan_stats {
    /// Bytes of the intermediate buffer: the sum of the groups' sizes.
    pub managed_bytes: u64,
    /// Intermediate (non-output) values managed.
    pub managed_values: u64,
    /// Values sharing a group with an earlier value, in the last buffer laid out.
    pub reused_values: u64,
    /// Bytes of the output buffer.
    pub output_buffer_bytes: u64,
    /// Storage groups.
    pub groups: u64,
    /// Managed outputs.
    pub outputs: u64,
    /// Iterations ended.
    pub iterations: u64,
}

/// Reads a storage-plan handle.
///
/// # Safety
/// `h` must be NULL or a live handle from `tensoralloc_storage_plan_new`.
unsafe fn storage<'a>(h: *mut tensoralloc_storage_plan) -> Result<&'a tensoralloc_storage_plan> {
    if h.is_null() {
        return Err(Error::InvalidArgument(
            "the storage plan handle is NULL".into(),
        ));
    }
    // SAFETY: non-NULL, and the caller promises a live handle.
    Ok(unsafe { &*h })
}

fn with_storage(
    h: *mut tensoralloc_storage_plan,
    f: impl FnOnce(&mut StoragePlanner) -> Result<()>,
) -> tensoralloc_status {
    // SAFETY: the caller of the exported function promises a live handle or NULL.
    match unsafe { storage(h) } {
        Ok(p) => status(f(&mut p.inner.lock())),
        Err(e) => fail(&e),
    }
}

/// Makes a storage-group planner for `n` values: value `i` is used by time steps (nodes)
/// `first_use[i]` to `last_use[i]` inclusive, and is a managed output when `is_output` is
/// non-NULL and `is_output[i]` is true. Buffers come from host memory when `device < 0`, else
/// from tensoralloc's caching allocator of that device on `stream`.
///
/// Returns the handle, owned by the caller until `tensoralloc_storage_plan_free`; NULL with a
/// last error for NULL `first_use`/`last_use` with `n > 0`, a `first_use[i] > last_use[i]`, a
/// device that does not exist, or no usable driver.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_new(
    n: usize,
    first_use: *const u64,
    last_use: *const u64,
    is_output: *const bool,
    device: c_int,
    stream: *mut CUstream_st,
) -> *mut tensoralloc_storage_plan {
    ffi_boundary! {
        let make = || -> Result<StoragePlanner> {
            // SAFETY: the caller promises `n` readable values behind each non-NULL array.
            let (first, last) = unsafe { (input(first_use, n, "first_use")?, input(last_use, n, "last_use")?) };
            let outputs = if is_output.is_null() {
                None
            } else {
                // SAFETY: as above.
                Some(unsafe { input(is_output, n, "is_output")? })
            };
            let values: Vec<StorageValue> = (0..n)
                .map(|i| StorageValue {
                    first_use: first[i],
                    last_use: last[i],
                    output: outputs.is_some_and(|o| o[i]),
                })
                .collect();
            StoragePlanner::new(&values, memory_of(device, stream)?)
        };
        match make() {
            Ok(p) => Box::into_raw(Box::new(tensoralloc_storage_plan { inner: Mutex::new(p) })),
            Err(e) => {
                fail(&e);
                std::ptr::null_mut()
            }
        }
    }
}

/// Releases a storage-group planner and its buffers (pointers into them become invalid).
/// NULL does nothing.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_free(h: *mut tensoralloc_storage_plan) {
    ffi_boundary! {
        if !h.is_null() {
            // SAFETY: the caller passes a handle from tensoralloc_storage_plan_new, once.
            drop(unsafe { Box::from_raw(h) });
        }
    }
}

/// Starts an iteration: allocates the intermediate buffer (once values have reported sizes)
/// and the output buffer. Returns `TENSORALLOC_OK`; `TENSORALLOC_ERR_INVALID_ARGUMENT` with a
/// last error for a NULL handle, an iteration already running, or outputs of the previous
/// iteration not yet released; `TENSORALLOC_ERR_OUT_OF_MEMORY` when a buffer cannot be had
/// (also when the sizes reported add up past 2^64 bytes).
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_allocate(
    h: *mut tensoralloc_storage_plan,
) -> tensoralloc_status {
    ffi_boundary! { with_storage(h, StoragePlanner::allocate) }
}

/// Reports that value `value` needs `nbytes` bytes in this iteration and writes where it lives
/// to `*ptr`: inside this iteration's buffer, or NULL when the buffer has no room for it yet
/// (the first iteration, or a value larger than before), in which case the client allocates
/// it itself and the next iteration makes room. Returns `TENSORALLOC_OK`, or
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` with a last error for a NULL handle or `ptr`, an unknown
/// value, an absurd `nbytes` (over 1 PiB, e.g. a negative number cast to `size_t`), or no
/// iteration running; `*ptr` is then left unchanged.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_place(
    h: *mut tensoralloc_storage_plan,
    value: usize,
    nbytes: usize,
    ptr: *mut *mut c_void,
) -> tensoralloc_status {
    ffi_boundary! {
        with_storage(h, |p| {
            out_is_set(ptr, "ptr")?;
            let at = p.place(value, nbytes as u64)?;
            // SAFETY: non-NULL, and the caller promises a writable pointer.
            unsafe { ptr.write(at.map_or(std::ptr::null_mut(), |a| a as *mut c_void)) };
            Ok(())
        })
    }
}

/// Ends an iteration: every group grows to the largest size its values reported, and the
/// intermediate buffer is freed (pointers into it become invalid). Returns `TENSORALLOC_OK`,
/// or `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL handle or no iteration running.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_deallocate(
    h: *mut tensoralloc_storage_plan,
) -> tensoralloc_status {
    ffi_boundary! { with_storage(h, StoragePlanner::deallocate) }
}

/// Releases the managed outputs of the last iteration: their slots grow to the sizes reported
/// and the output buffer is freed (pointers into it become invalid). Returns
/// `TENSORALLOC_OK`, or `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL handle or while an
/// iteration runs.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_release_outputs(
    h: *mut tensoralloc_storage_plan,
) -> tensoralloc_status {
    ffi_boundary! { with_storage(h, StoragePlanner::release_outputs) }
}

/// Writes the storage group of value `value` to `*group` (`SIZE_MAX` for a managed output).
/// Returns `TENSORALLOC_OK`, or `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL handle or
/// `group`, or an unknown value.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_group_of(
    h: *mut tensoralloc_storage_plan,
    value: usize,
    group: *mut usize,
) -> tensoralloc_status {
    ffi_boundary! {
        with_storage(h, |p| {
            out_is_set(group, "group")?;
            if value >= p.len() {
                return Err(Error::InvalidArgument(format!("there is no value {value} (the planner has {})", p.len())));
            }
            // SAFETY: non-NULL, and the caller promises a writable size_t.
            unsafe { group.write(p.group_of(value).unwrap_or(usize::MAX)) };
            Ok(())
        })
    }
}

/// Writes the counters to `*out`. Returns `TENSORALLOC_OK`, or
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL handle or `out`.
#[no_mangle]
pub extern "C" fn tensoralloc_storage_plan_get_stats(
    h: *mut tensoralloc_storage_plan,
    out: *mut tensoralloc_storage_plan_stats,
) -> tensoralloc_status {
    ffi_boundary! {
        with_storage(h, |p| {
            out_is_set(out, "out")?;
            let s = p.stats();
            let c = tensoralloc_storage_plan_stats {
                managed_bytes: s.managed_bytes,
                managed_values: s.managed_values,
                reused_values: s.reused_values,
                output_buffer_bytes: s.output_buffer_bytes,
                groups: s.groups,
                outputs: s.outputs,
                iterations: s.iterations,
            };
            // SAFETY: non-NULL, and the caller promises a writable tensoralloc_storage_plan_stats.
            unsafe { out.write(c) };
            Ok(())
        })
    }
}

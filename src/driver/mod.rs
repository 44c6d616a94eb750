//! The driver boundary: the only code that talks to a GPU driver lives below this module.
//!
//! The allocators are written against [`Driver`] and never know whether they run on a real
//! GPU ([`cuda`], the NVIDIA driver API through cudarc), on the simulated device ([`sim`]), or
//! inside a replayed trace.

use crate::error::{Error, Result};

pub mod cuda;
pub mod sim;

/// A stream handle as the C caller passes it (`cudaStream_t` / `CUstream` cast to an
/// integer). 0 is the legacy default stream.
pub type Stream = usize;

/// An event handle created by a driver. Only meaningful to the driver that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// Free and total memory of a device, in bytes, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// Physical memory mapped into a reserved virtual range by [`Driver::vmm_map`]. Only
/// meaningful to the driver that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// What a driver says when it has no virtual memory management: the caller falls back to
/// ordinary allocations.
fn no_vmm(name: &str) -> Error {
    Error::Driver(format!(
        "the {name} driver has no virtual memory management (CUDA_ERROR_NOT_SUPPORTED)"
    ))
}

/// Everything the allocators need from a GPU driver.
///
/// Implementations are thread-safe. Calls that take a `device` index run in that device's
/// context and leave the calling thread's current context as they found it.
pub trait Driver: Send + Sync {
    /// A short name for messages (`"cuda"`, `"sim"`).
    fn name(&self) -> &'static str;

    /// How many devices the driver can see.
    fn device_count(&self) -> Result<usize>;

    /// Allocates `size` bytes of device memory and returns its address. Running out of device
    /// memory is reported as [`Error::OutOfMemory`], so the caller can free its cache and retry.
    fn mem_alloc(&self, device: usize, size: usize) -> Result<usize>;

    /// Frees memory returned by [`Driver::mem_alloc`].
    fn mem_free(&self, device: usize, ptr: usize) -> Result<()>;

    /// Free and total memory of `device`.
    fn mem_info(&self, device: usize) -> Result<MemInfo>;

    /// Creates an event without timing on `device`. Expensive on real drivers: callers pool them.
    fn event_create(&self, device: usize) -> Result<Event>;

    /// Destroys an event made by [`Driver::event_create`].
    fn event_destroy(&self, device: usize, event: Event) -> Result<()>;

    /// Records `event` on `stream` (which belongs to `device`).
    fn event_record(&self, device: usize, event: Event, stream: Stream) -> Result<()>;

    /// Whether all work captured by `event` has completed. Never blocks.
    fn event_query(&self, device: usize, event: Event) -> Result<bool>;

    /// Blocks until the work captured by `event` has completed.
    fn event_synchronize(&self, device: usize, event: Event) -> Result<()>;

    /// The device a stream belongs to (for the legacy stream 0: the calling thread's current
    /// device, or 0).
    fn stream_device(&self, stream: Stream) -> Result<usize>;

    /// Whether `stream` is being captured into a CUDA graph. While it is, the allocator must
    /// not query or wait for events, nor free device memory (the capture would be
    /// invalidated). Drivers without graph capture keep this default: never.
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        let _ = stream;
        Ok(false)
    }

    /// Allocates `size` bytes of page-locked host memory, portable across devices.
    fn host_alloc(&self, size: usize) -> Result<usize>;

    /// Frees memory returned by [`Driver::host_alloc`].
    fn host_free(&self, ptr: usize) -> Result<()>;

    /// Page-locks (registers) ordinary host memory `[ptr, ptr + size)`.
    fn host_register(&self, ptr: usize, size: usize) -> Result<()>;

    /// Undoes [`Driver::host_register`] for the range that starts at `ptr`.
    fn host_unregister(&self, ptr: usize) -> Result<()>;

    /// The granularity of virtual memory mappings on `device` (the size and alignment every
    /// [`Driver::vmm_map`] range must be a multiple of), or an error when the driver or device
    /// has no virtual memory management.
    fn vmm_granularity(&self, device: usize) -> Result<usize> {
        let _ = device;
        Err(no_vmm(self.name()))
    }

    /// Reserves `size` bytes (a multiple of the granularity) of virtual address space on
    /// `device`, backed by nothing. Running out of address space is [`Error::OutOfMemory`].
    fn vmm_reserve(&self, device: usize, size: usize) -> Result<usize> {
        let _ = (device, size);
        Err(no_vmm(self.name()))
    }

    /// Returns a range made by [`Driver::vmm_reserve`]; nothing may be mapped in it.
    fn vmm_free_range(&self, device: usize, addr: usize, size: usize) -> Result<()> {
        let _ = (device, addr, size);
        Err(no_vmm(self.name()))
    }

    /// Creates one physical allocation of `size` bytes on `device`, maps it at `addr` (inside a
    /// reserved range, granularity-aligned) and makes it readable and writable by `device`.
    /// Out of device memory is [`Error::OutOfMemory`], and then nothing stays created.
    /// Provided as a [`Driver::vmm_map_many`] of one allocation.
    fn vmm_map(&self, device: usize, addr: usize, size: usize) -> Result<PhysHandle> {
        let mut one = Vec::with_capacity(1);
        self.vmm_map_many(device, addr, size, size, &mut one)?;
        Ok(one[0])
    }

    /// Unmaps `[addr, addr + size)`, mapped by one [`Driver::vmm_map`] that returned `handle`,
    /// and releases the physical memory.
    fn vmm_unmap(&self, device: usize, addr: usize, size: usize, handle: PhysHandle) -> Result<()> {
        let _ = (device, addr, size, handle);
        Err(no_vmm(self.name()))
    }

    /// Maps `[addr, addr + size)` as consecutive physical allocations of `handle` bytes each
    /// (the last one takes what is left), appending their handles to `handles` in address
    /// order, and makes the range readable and writable by `device`. All or nothing: on error
    /// no new allocation stays created or mapped and `handles` is as it was. This is what a
    /// driver with virtual memory management implements: it pays per-range costs (locking,
    /// access rights) once per range instead of once per allocation.
    fn vmm_map_many(
        &self,
        device: usize,
        addr: usize,
        size: usize,
        handle: usize,
        handles: &mut Vec<PhysHandle>,
    ) -> Result<()> {
        let _ = (device, addr, size, handle, handles);
        Err(no_vmm(self.name()))
    }

    /// Unmaps and releases each `(addr, size, handle)` of `maps` as [`Driver::vmm_unmap`]
    /// does, stopping at the first error.
    fn vmm_unmap_many(&self, device: usize, maps: &[(usize, usize, PhysHandle)]) -> Result<()> {
        maps.iter()
            .try_for_each(|&(a, l, h)| self.vmm_unmap(device, a, l, h))
    }

    /// Unmaps each `(addr, size, handle)` of `maps` (a mapping made by
    /// [`Driver::vmm_map_many`] or [`Driver::vmm_map_kept`]) but keeps its physical
    /// allocation, to be mapped again elsewhere by [`Driver::vmm_map_kept`] or given back by
    /// [`Driver::vmm_release`] (`cuMemUnmap` without `cuMemRelease`). Stops at the first
    /// error: the entries before it are unmapped and kept, the rest are as they were.
    fn vmm_unmap_keep(&self, device: usize, maps: &[(usize, usize, PhysHandle)]) -> Result<()> {
        let _ = (device, maps);
        Err(no_vmm(self.name()))
    }

    /// Maps physical allocations kept by [`Driver::vmm_unmap_keep`] back to back from `addr`
    /// (inside a reserved range, granularity-aligned), each `(size, handle)` of `maps` being
    /// one allocation and its size, and makes the range readable and writable by `device`
    /// (`cuMemMap` of each, one `cuMemSetAccess`). Moving memory this way costs no
    /// `cuMemRelease` and `cuMemCreate`. All or nothing: on error nothing of this call stays
    /// mapped, and the allocations stay kept.
    fn vmm_map_kept(&self, device: usize, addr: usize, maps: &[(usize, PhysHandle)]) -> Result<()> {
        let _ = (device, addr, maps);
        Err(no_vmm(self.name()))
    }

    /// Releases a physical allocation kept by [`Driver::vmm_unmap_keep`] (`cuMemRelease`).
    fn vmm_release(&self, device: usize, handle: PhysHandle) -> Result<()> {
        let _ = (device, handle);
        Err(no_vmm(self.name()))
    }
}

/// Which backend `TENSORALLOC_DRIVER` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cuda,
    Sim,
}

impl Backend {
    /// Reads `TENSORALLOC_DRIVER` (`cuda`, the default, or `sim`).
    pub fn from_env() -> Result<Backend> {
        match std::env::var("TENSORALLOC_DRIVER") {
            Err(_) => Ok(Backend::Cuda),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "cuda" => Ok(Backend::Cuda),
                "sim" => Ok(Backend::Sim),
                other => Err(Error::Config(format!(
                    "TENSORALLOC_DRIVER={other:?} is not a driver: use `cuda` (the NVIDIA driver) or `sim` (the simulated device)"
                ))),
            },
        }
    }
}

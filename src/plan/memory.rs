//! Where the planners' memory comes from: the blob a plan is served from, and the ordinary
//! allocations made while recording or when an iteration strays from its plan.

use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::runtime::Runtime;

/// A source of memory for the planners. Implementations are thread-safe.
pub trait MemorySource: Send + Sync {
    /// Allocates `size` bytes (`size > 0`) aligned to `alignment` (a power of two) and returns
    /// the address.
    fn allocate(&self, size: usize, alignment: usize) -> Result<usize>;
    /// Returns memory that [`MemorySource::allocate`] gave.
    fn deallocate(&self, addr: usize) -> Result<()>;
    /// Whose memory this is, for messages (`"host"`, `"device 0"`).
    fn describe(&self) -> String;
}

/// Host memory from the C library's `posix_memalign` / `free`.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostMemory;

impl MemorySource for HostMemory {
    fn allocate(&self, size: usize, alignment: usize) -> Result<usize> {
        let alignment = alignment.max(std::mem::size_of::<usize>());
        let mut ptr: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the alignment is a power of two and a multiple
        // of the pointer size, as posix_memalign requires.
        let rc = unsafe { libc::posix_memalign(&mut ptr, alignment, size) };
        if rc != 0 || ptr.is_null() {
            return Err(Error::OutOfMemory(format!(
                "host memory: posix_memalign could not allocate {size} bytes"
            )));
        }
        Ok(ptr as usize)
    }

    fn deallocate(&self, addr: usize) -> Result<()> {
        // SAFETY: `addr` came from posix_memalign in `allocate` and is freed once (callers own
        // the bookkeeping that guarantees both).
        unsafe { libc::free(addr as *mut libc::c_void) };
        Ok(())
    }

    fn describe(&self) -> String {
        "host".to_string()
    }
}

/// Device memory from the caching device allocator of one device, on one stream.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMemory {
    device: usize,
    stream: Stream,
}

impl DeviceMemory {
    /// Memory of device `device` used on `stream`. Fails when the device does not exist or no
    /// driver can be loaded.
    pub fn new(device: usize, stream: Stream) -> Result<DeviceMemory> {
        Runtime::get()?.device(device)?;
        Ok(DeviceMemory { device, stream })
    }
}

impl MemorySource for DeviceMemory {
    fn allocate(&self, size: usize, alignment: usize) -> Result<usize> {
        let allocator = Runtime::get()?.device(self.device)?;
        let addr = allocator.malloc(size, self.stream)?;
        if addr % alignment != 0 {
            allocator.free(addr, Some(self.stream))?;
            return Err(Error::InvalidArgument(format!(
                "device {}: the caching allocator's blocks are not aligned to {alignment} bytes",
                self.device
            )));
        }
        Ok(addr)
    }

    fn deallocate(&self, addr: usize) -> Result<()> {
        Runtime::get()?
            .device(self.device)?
            .free(addr, Some(self.stream))
    }

    fn describe(&self) -> String {
        format!("device {}", self.device)
    }
}

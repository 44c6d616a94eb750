//! The NVIDIA driver backend.

use super::{Driver, Event, MemInfo, Stream};
use crate::error::{Error, Result};

/// The NVIDIA driver API, loaded at run time.
pub struct CudaDriver {
    _private: (),
}

impl CudaDriver {
    /// Loads `libcuda.so.1` and initializes the driver.
    pub fn load() -> Result<CudaDriver> {
        Err(Error::NoDriver(
            "the NVIDIA driver backend is not built yet; set TENSORALLOC_DRIVER=sim to use the simulated device".into(),
        ))
    }
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device_count(&self) -> Result<usize> {
        Ok(0)
    }
    fn mem_alloc(&self, _device: usize, _size: usize) -> Result<usize> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn mem_free(&self, _device: usize, _ptr: usize) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn mem_info(&self, _device: usize) -> Result<MemInfo> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn event_create(&self, _device: usize) -> Result<Event> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn event_destroy(&self, _device: usize, _event: Event) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn event_record(&self, _device: usize, _event: Event, _stream: Stream) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn event_query(&self, _device: usize, _event: Event) -> Result<bool> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn event_synchronize(&self, _device: usize, _event: Event) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn stream_device(&self, _stream: Stream) -> Result<usize> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn host_alloc(&self, _size: usize) -> Result<usize> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn host_free(&self, _ptr: usize) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn host_register(&self, _ptr: usize, _size: usize) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
    fn host_unregister(&self, _ptr: usize) -> Result<()> {
        Err(Error::NoDriver("no driver".into()))
    }
}

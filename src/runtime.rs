//! The process-wide state behind the C ABI: the driver the environment selects, the
//! configuration, and one allocator per device, made once on first use.

use std::sync::Arc;

use once_cell::sync::OnceCell;

use crate::config::Config;
use crate::device::DeviceAllocator;
use crate::driver::{cuda::CudaDriver, sim::SimDriver, Backend, Driver};
use crate::error::{Error, Result};
use crate::host::HostAllocator;

/// Process-wide state.
pub struct Runtime {
    driver: Arc<dyn Driver>,
    sim: Option<Arc<SimDriver>>,
    cuda: Option<Arc<CudaDriver>>,
    config: Config,
    devices: Box<[OnceCell<DeviceAllocator>]>,
    host: OnceCell<HostAllocator>,
}

static RUNTIME: OnceCell<std::result::Result<Runtime, Error>> = OnceCell::new();

impl Runtime {
    /// The process-wide runtime, built on first use from the environment
    /// (`TENSORALLOC_DRIVER`, `TENSORALLOC_CONF`...). A failure (no driver, bad configuration)
    /// is remembered and returned by every later call.
    #[inline]
    pub fn get() -> Result<&'static Runtime> {
        match RUNTIME.get() {
            Some(r) => r.as_ref().map_err(Clone::clone),
            None => RUNTIME
                .get_or_init(Runtime::from_env)
                .as_ref()
                .map_err(Clone::clone),
        }
    }

    fn from_env() -> Result<Runtime> {
        let config = Config::from_env()?;
        let (driver, sim, cuda): (Arc<dyn Driver>, _, _) = match Backend::from_env()? {
            Backend::Sim => {
                let sim = Arc::new(SimDriver::from_env()?);
                (sim.clone(), Some(sim), None)
            }
            Backend::Cuda => {
                let cuda = Arc::new(CudaDriver::load()?);
                (cuda.clone(), None, Some(cuda))
            }
        };
        let count = driver.device_count()?;
        Ok(Runtime {
            driver,
            sim,
            cuda,
            config,
            devices: (0..count).map(|_| OnceCell::new()).collect(),
            host: OnceCell::new(),
        })
    }

    /// The driver every allocator of the process uses.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The simulated driver, when `TENSORALLOC_DRIVER=sim` selected it.
    pub fn sim(&self) -> Option<&Arc<SimDriver>> {
        self.sim.as_ref()
    }

    /// The NVIDIA driver backend, when `TENSORALLOC_DRIVER=cuda` (the default) selected it.
    pub fn cuda(&self) -> Option<&Arc<CudaDriver>> {
        self.cuda.as_ref()
    }

    /// The parsed configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// How many devices the driver has.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The caching allocator of device `index`, made on first use.
    #[inline]
    pub fn device(&self, index: usize) -> Result<&DeviceAllocator> {
        let cell = self
            .devices
            .get(index)
            .ok_or_else(|| self.bad_device(index as i64))?;
        match cell.get() {
            Some(d) => Ok(d),
            None => cell
                .get_or_try_init(|| DeviceAllocator::new(self.driver.clone(), index, &self.config)),
        }
    }

    /// The pinned-host allocator, made on first use.
    #[inline]
    pub fn host(&self) -> &HostAllocator {
        self.host
            .get_or_init(|| HostAllocator::new(self.driver.clone(), &self.config))
    }

    /// The allocator of a device index given by a C caller (an `int`).
    #[inline]
    pub fn device_from_c(&self, index: i32) -> Result<&DeviceAllocator> {
        if index < 0 {
            return Err(self.bad_device(index as i64));
        }
        self.device(index as usize)
    }

    fn bad_device(&self, index: i64) -> Error {
        Error::InvalidArgument(format!(
            "device {index} does not exist: the {} driver has {} device(s), numbered from 0",
            self.driver.name(),
            self.devices.len()
        ))
    }

    /// Allocators made so far.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceAllocator> {
        self.devices.iter().filter_map(OnceCell::get)
    }

    /// The allocator whose segments contain `ptr`.
    pub fn owner_of(&self, ptr: usize) -> Option<&DeviceAllocator> {
        self.devices().find(|d| d.owns(ptr))
    }
}

//! The process-wide state behind the C ABI: the driver the environment selects, the
//! configuration, and one allocator per device, made once on first use.

use std::sync::Arc;

use once_cell::sync::OnceCell;

use crate::config::Config;
use crate::driver::{self, Driver};
use crate::error::{Error, Result};

/// Process-wide state.
pub struct Runtime {
    driver: Arc<dyn Driver>,
    config: Config,
}

static RUNTIME: OnceCell<std::result::Result<Runtime, Error>> = OnceCell::new();

impl Runtime {
    /// The process-wide runtime, built on first use from the environment
    /// (`TENSORALLOC_DRIVER`, `TENSORALLOC_CONF`...). A failure (no driver, bad configuration)
    /// is remembered and returned by every later call.
    pub fn get() -> Result<&'static Runtime> {
        RUNTIME.get_or_init(Runtime::from_env).as_ref().map_err(Clone::clone)
    }

    fn from_env() -> Result<Runtime> {
        let config = Config::from_env()?;
        let driver = driver::from_env()?;
        Ok(Runtime { driver, config })
    }

    /// The driver every allocator of the process uses.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// The parsed configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }
}

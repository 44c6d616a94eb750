//! tensoralloc: a drop-in caching memory allocator for GPU machine-learning runtimes.
//!
//! - [`device`]: the CUDA caching device allocator (PyTorch's CUDACachingAllocator semantics);
//! - [`host`]: the caching pinned-host allocator;
//! - [`plan`]: memory planners for static workloads;
//! - [`replay`]: PyTorch memory snapshots read and replayed on the simulated device;
//! - [`driver`]: the only code that talks to a GPU driver (NVIDIA through cudarc, or the
//!   simulated device);
//! - [`capi`]: the C boundary, described by `include/tensoralloc.h`.

pub mod capi;
pub mod config;
pub mod device;
pub mod driver;
pub mod error;
pub mod host;
pub(crate) mod lock;
pub mod plan;
/// cbindgen:ignore
pub mod replay;
pub mod runtime;

pub use error::{Error, Result};

/// Helpers shared by the unit tests.
#[cfg(test)]
pub(crate) mod testing {
    /// Advances a xorshift64 generator (`state` nonzero, and never zero after): a fixed,
    /// cheap sequence for tests that check a structure against a model over random steps.
    pub(crate) fn xorshift(state: &mut u64) {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
    }
}

//! The per-device memory limit (PyTorch's `set_per_process_memory_fraction`).
//!
//! A fraction of the device's total memory, as the driver reports it when the fraction is
//! set, caps the bytes reserved from the driver. It is checked before each new segment:
//! a segment that would cross it fails like a driver out-of-memory (the cache is freed and the
//! request retried, then it fails with a message that gives the limit).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::size::format_bytes;
use super::stats::{self, StatKind};
use super::DeviceAllocator;
use crate::error::{Error, Result};

/// No limit.
const UNLIMITED: u64 = u64::MAX;

/// A device's memory fraction and the byte limit it stands for.
pub(crate) struct MemoryLimit {
    /// `f64` bits of the fraction; 1.0 until set.
    fraction: AtomicU64,
    /// Bytes that may be reserved; [`UNLIMITED`] until a fraction is set.
    bytes: AtomicU64,
}

impl Default for MemoryLimit {
    fn default() -> Self {
        MemoryLimit {
            fraction: AtomicU64::new(1.0f64.to_bits()),
            bytes: AtomicU64::new(UNLIMITED),
        }
    }
}

impl MemoryLimit {
    /// The byte limit, if a fraction was set.
    pub fn bytes(&self) -> Option<u64> {
        Some(self.bytes.load(Relaxed)).filter(|&b| b != UNLIMITED)
    }
}

impl DeviceAllocator {
    /// Limits the bytes this device may reserve to `fraction` of its total memory (PyTorch's
    /// `set_per_process_memory_fraction`). `fraction` must lie in [0, 1]. Memory already
    /// reserved beyond the new limit is kept; growth past it fails as out of memory.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidArgument(format!(
                "memory fraction {fraction} is invalid: it must lie in [0, 1]"
            )));
        }
        let total = self.driver.mem_info(self.device)?.total;
        let limit = (fraction * total as f64) as u64;
        self.limit.fraction.store(fraction.to_bits(), Relaxed);
        self.limit.bytes.store(limit, Relaxed);
        Ok(())
    }

    /// The memory fraction of this device: 1.0 until set.
    pub fn memory_fraction(&self) -> f64 {
        f64::from_bits(self.limit.fraction.load(Relaxed))
    }

    /// Fails with out-of-memory when reserving `size` more bytes would cross the limit.
    pub(super) fn check_limit(&self, size: usize) -> Result<()> {
        let Some(limit) = self.limit.bytes() else {
            return Ok(());
        };
        let reserved = self
            .total_current(stats::aggregate(StatKind::ReservedBytes))
            .max(0) as u64;
        if reserved.saturating_add(size as u64) > limit {
            return Err(Error::OutOfMemory(format!(
                "a new segment of {} would take reserved memory past the limit of {}",
                format_bytes(size as u64),
                format_bytes(limit)
            )));
        }
        Ok(())
    }

    /// The limit's part of an out-of-memory message, when a fraction is set.
    pub(super) fn limit_text(&self) -> Option<String> {
        self.limit.bytes().map(|limit| {
            format!(
                "{} allowed (memory fraction {})",
                format_bytes(limit),
                self.memory_fraction()
            )
        })
    }
}

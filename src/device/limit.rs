//! The per-device memory limit (PyTorch's `set_per_process_memory_fraction`).
//!
//! A fraction of the device's total memory, as the driver reports it when the fraction is
//! set, caps the bytes reserved from the driver. It is checked before each new segment:
//! a segment that would cross it fails like a driver out-of-memory (the cache is freed and the
//! request retried, then it fails with a message that gives the limit).
//!
//! Streams grow under their own locks, so two threads may check at the same time. Each check
//! therefore claims its bytes before it reads what is reserved, and keeps the claim until its
//! growth is counted as reserved ([`LimitClaim`]): of two growths at once, the later claim
//! sees the earlier one, as a claim or as reserved bytes, and together they stay within the
//! limit. Pages that a growth of `policy:compact` unmaps from idle streams to map again keep
//! their physical memory meanwhile: they are claimed before their bytes leave the reserved
//! ones ([`LimitClaim::add`]), and stay claimed until that growth has mapped or released them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed, Ordering::SeqCst};

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
    /// Bytes of growths that passed the check and are not counted as reserved yet.
    claimed: AtomicU64,
}

/// Bytes a growth may add under the limit, held from the check until the growth is counted
/// in the reserved statistics (drop it after that): growths on other streams count it
/// meanwhile.
pub(super) struct LimitClaim<'a> {
    limit: &'a MemoryLimit,
    bytes: u64,
}

impl LimitClaim<'_> {
    /// Claims `bytes` more, without a check: memory the device holds already and is about to
    /// stop counting as reserved. Nothing when no limit is set.
    pub fn add(&mut self, bytes: u64) {
        if self.limit.bytes().is_some() && bytes > 0 {
            self.limit.claimed.fetch_add(bytes, SeqCst);
            self.bytes += bytes;
        }
    }
}

impl Drop for LimitClaim<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // Sequentially consistent: a later claim that reads past this release also sees
            // the reserved bytes counted before it.
            self.limit.claimed.fetch_sub(self.bytes, SeqCst);
        }
    }
}

impl Default for MemoryLimit {
    fn default() -> Self {
        MemoryLimit {
            fraction: AtomicU64::new(1.0f64.to_bits()),
            bytes: AtomicU64::new(UNLIMITED),
            claimed: AtomicU64::new(0),
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

    /// Fails with out-of-memory when reserving `size()` more bytes would cross the limit,
    /// counting the growths other threads are making; otherwise returns the claim on those
    /// bytes, to be dropped once the growth is counted as reserved (or has failed). `size` is
    /// asked for only when a limit is set.
    pub(super) fn check_limit(&self, size: impl FnOnce() -> usize) -> Result<LimitClaim<'_>> {
        let Some(limit) = self.limit.bytes() else {
            return Ok(self.no_claim());
        };
        let size = size() as u64;
        // Claimed before reserved bytes are read: a growth that released its claim before
        // this one counted its bytes first, and this read sees them.
        let others = self.limit.claimed.fetch_add(size, SeqCst);
        let claim = LimitClaim {
            limit: &self.limit,
            bytes: size,
        };
        let reserved = self
            .total_current(stats::aggregate(StatKind::ReservedBytes))
            .max(0) as u64;
        if reserved.saturating_add(others).saturating_add(size) > limit {
            let growing = if others > 0 {
                format!(
                    " ({} more are being reserved by other streams)",
                    format_bytes(others)
                )
            } else {
                String::new()
            };
            return Err(Error::OutOfMemory(format!(
                "a new segment of {} would take reserved memory past the limit of {}{growing}",
                format_bytes(size),
                format_bytes(limit)
            )));
        }
        Ok(claim)
    }

    /// An empty claim, for [`LimitClaim::add`].
    pub(super) fn no_claim(&self) -> LimitClaim<'_> {
        LimitClaim {
            limit: &self.limit,
            bytes: 0,
        }
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

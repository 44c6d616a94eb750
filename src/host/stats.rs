//! Statistics of the pinned-host allocator.
//!
//! Counters that change on the cached path (allocations, allocated bytes, active blocks)
//! live in the shards and are summed when read; their peaks are kept exact by the limit
//! scheme described in [`super::shard`]. Everything that changes only when the driver is
//! called (reserved bytes, driver calls and their durations) lives in [`Accumulated`] under
//! the allocator's global lock.

use std::time::Duration;

/// A value now and its highest value since creation or the last peak reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
}

/// A snapshot of a [`super::HostAllocator`]'s statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Blocks handed to callers and not yet freed.
    pub allocations: Stat,
    /// Blocks that cannot be handed out: allocated, or freed but waiting for stream events.
    pub active_blocks: Stat,
    /// Bytes of the blocks handed to callers and not yet freed (rounded block sizes).
    pub allocated_bytes: Stat,
    /// Bytes of pinned memory held from the driver: active and cached blocks.
    pub reserved_bytes: Stat,
    /// Free blocks in the cache, ready for reuse.
    pub cached_blocks: u64,
    /// Pinned ranges obtained from the driver since creation or the last reset.
    pub driver_allocations: u64,
    /// Pinned ranges returned to the driver since creation or the last reset.
    pub driver_frees: u64,
    /// Time spent obtaining pinned memory (driver allocation, or mapping, pre-faulting and
    /// registering), in total and in the longest single call.
    pub pin_time_total: Duration,
    pub pin_time_max: Duration,
    /// Time spent returning pinned memory to the driver, in total and the longest call.
    pub unpin_time_total: Duration,
    pub unpin_time_max: Duration,
}

/// State changed only around driver calls.
#[derive(Debug, Default)]
pub(crate) struct Accumulated {
    pub(crate) reserved_bytes: u64,
    pub(crate) reserved_peak: u64,
    pub(crate) driver_allocations: u64,
    pub(crate) driver_frees: u64,
    pub(crate) pin_total: Duration,
    pub(crate) pin_max: Duration,
    pub(crate) unpin_total: Duration,
    pub(crate) unpin_max: Duration,
}

impl Accumulated {
    pub(crate) fn pinned(&mut self, size: usize, took: Duration) {
        self.reserved_bytes += size as u64;
        self.reserved_peak = self.reserved_peak.max(self.reserved_bytes);
        self.driver_allocations += 1;
        self.pin_total += took;
        self.pin_max = self.pin_max.max(took);
    }

    pub(crate) fn unpinned(&mut self, size: usize, took: Duration) {
        self.reserved_bytes = self.reserved_bytes.saturating_sub(size as u64);
        self.driver_frees += 1;
        self.unpin_total += took;
        self.unpin_max = self.unpin_max.max(took);
    }

    pub(crate) fn pin_failed(&mut self, took: Duration) {
        self.pin_total += took;
        self.pin_max = self.pin_max.max(took);
    }

    pub(crate) fn reset_accumulated(&mut self) {
        self.driver_allocations = 0;
        self.driver_frees = 0;
        self.pin_total = Duration::ZERO;
        self.pin_max = Duration::ZERO;
        self.unpin_total = Duration::ZERO;
        self.unpin_max = Duration::ZERO;
    }
}

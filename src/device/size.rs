//! Size rules of the caching device allocator (PyTorch's CUDACachingAllocator rules).

/// Every block is a multiple of this many bytes.
pub const MIN_BLOCK_SIZE: usize = 512;
/// Requests up to this size come from the small pool.
pub const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_BUFFER: usize = 2 << 20;
/// Segment size of the large pool for requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: usize = 20 << 20;
/// Large requests from this size on get a segment of their own size (rounded to [`ROUND_LARGE`]).
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Rounding of segments for large requests.
pub const ROUND_LARGE: usize = 2 << 20;
/// Larger requests are rejected as absurd: no device has a petabyte, and sizes near
/// `SIZE_MAX` are usually negative numbers cast to `size_t`.
pub const MAX_REQUEST: usize = 1 << 50;

/// Which pool a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Small,
    Large,
}

impl PoolKind {
    /// The pool that serves a request of `rounded` bytes.
    pub fn for_size(rounded: usize) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }
}

/// A request rounded up to a whole number of [`MIN_BLOCK_SIZE`] blocks.
pub fn round_size(size: usize) -> usize {
    size.max(1).next_multiple_of(MIN_BLOCK_SIZE)
}

/// Size of the segment to ask the driver for when no cached block fits `rounded` bytes.
pub fn segment_size(rounded: usize) -> usize {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.next_multiple_of(ROUND_LARGE)
    }
}

/// Whether a free block of `block_size` bytes serving `rounded` bytes is split, leaving the
/// rest in the pool: in the small pool when the rest can hold a block at all; in the large pool
/// when the rest is over [`SMALL_SIZE`] and the request is under `max_split_size`.
pub fn should_split(pool: PoolKind, block_size: usize, rounded: usize, max_split_size: usize) -> bool {
    let remaining = block_size - rounded;
    match pool {
        PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
        PoolKind::Large => rounded < max_split_size && remaining > SMALL_SIZE,
    }
}

/// Whether a cached block of `block_size` bytes may serve a request of `rounded` bytes given
/// `max_split_size`: an oversize block is never handed to a smaller-than-oversize request, and
/// an oversize request takes an oversize block only if the waste stays under [`LARGE_BUFFER`].
pub fn block_fits(block_size: usize, rounded: usize, max_split_size: usize) -> bool {
    if rounded < max_split_size && block_size >= max_split_size {
        return false;
    }
    if rounded >= max_split_size && block_size >= rounded.saturating_add(LARGE_BUFFER) {
        return false;
    }
    true
}

/// Formats a byte count for people: `512 B`, `1.50 KiB`, `2.00 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_512_bytes() {
        assert_eq!(round_size(0), 512);
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
    }

    #[test]
    fn segment_sizes_follow_the_pool_rules() {
        assert_eq!(segment_size(512), 2 << 20);
        assert_eq!(segment_size(1 << 20), 2 << 20);
        assert_eq!(segment_size((1 << 20) + 512), 20 << 20);
        assert_eq!(segment_size((10 << 20) - 512), 20 << 20);
        assert_eq!(segment_size(10 << 20), 10 << 20);
        assert_eq!(segment_size((10 << 20) + 512), 12 << 20);
    }

    #[test]
    fn split_thresholds_differ_by_pool() {
        assert!(should_split(PoolKind::Small, 1024, 512, usize::MAX));
        assert!(!should_split(PoolKind::Small, 1024, 1024, usize::MAX));
        assert!(should_split(PoolKind::Large, 20 << 20, (19 << 20) - 512, usize::MAX));
        assert!(should_split(PoolKind::Large, 20 << 20, 18 << 20, usize::MAX));
        assert!(!should_split(PoolKind::Large, 20 << 20, 19 << 20, usize::MAX));
        assert!(!should_split(PoolKind::Large, 40 << 20, 30 << 20, 25 << 20));
    }

    #[test]
    fn bytes_format_with_binary_units() {
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(2 << 30), "2.00 GiB");
    }
}

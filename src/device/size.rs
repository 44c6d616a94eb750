//! Size rules of the caching device allocator (PyTorch's CUDACachingAllocator rules).

/// Every block is a multiple of this many bytes.
pub(crate) const MIN_BLOCK_SIZE: usize = 512;
/// Requests up to this size come from the small pool.
pub(crate) const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool.
pub(crate) const SMALL_BUFFER: usize = 2 << 20;
/// Segment size of the large pool for requests under [`MIN_LARGE_ALLOC`], unless
/// `large_segment_size_mb` sets another.
pub(crate) const LARGE_BUFFER: usize = 20 << 20;
/// Large requests from this size on get a segment of their own size (rounded to [`ROUND_LARGE`]).
pub(crate) const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Rounding of segments for large requests.
pub(crate) const ROUND_LARGE: usize = 2 << 20;
/// Larger requests are rejected as absurd: no device has a petabyte, and sizes near
/// `SIZE_MAX` are usually negative numbers cast to `size_t`.
pub(crate) const MAX_REQUEST: usize = 1 << 50;

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

/// A request rounded as PyTorch's `roundup_power2_divisions` asks: with `divisions` > 1 (a
/// power of two) and a request larger than `divisions` blocks, each range between powers of
/// two is cut into `divisions` equal steps and the request rounded up to the next step, so
/// that similar sizes share blocks; otherwise [`round_size`].
pub fn round_size_with(size: usize, divisions: usize) -> usize {
    if divisions > 1 && size > MIN_BLOCK_SIZE * divisions && !size.is_power_of_two() {
        let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
        // floor > 256 * divisions and both are powers of two, so the step is a multiple of 512.
        return size.next_multiple_of(floor / divisions);
    }
    round_size(size)
}

/// Size of the segment to ask the driver for when no cached block fits `rounded` bytes, with
/// large-pool requests under [`MIN_LARGE_ALLOC`] packed in segments of `large_segment` bytes
/// ([`LARGE_BUFFER`] unless `large_segment_size_mb` says otherwise).
pub fn segment_size(rounded: usize, large_segment: usize) -> usize {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        large_segment
    } else {
        rounded.next_multiple_of(ROUND_LARGE)
    }
}

/// Whether a free block of `block_size` bytes serving `rounded` bytes is split, leaving the
/// rest in the pool: in the small pool when the rest can hold a block at all; in the large pool
/// when the rest is over [`SMALL_SIZE`] and the request is under `max_split_size`.
pub fn should_split(
    pool: PoolKind,
    block_size: usize,
    rounded: usize,
    max_split_size: usize,
) -> bool {
    let remaining = block_size - rounded;
    match pool {
        PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
        PoolKind::Large => rounded < max_split_size && remaining > SMALL_SIZE,
    }
}

/// Whether a cached block of `block_size` bytes may serve a request of `rounded` bytes given
/// `max_split_size`: an oversize block is never handed to a smaller-than-oversize request, and
/// an oversize request takes an oversize block only if the waste stays under
/// `non_split_rounding` (`max_non_split_rounding_mb`, by default the large segment size).
pub fn block_fits(
    block_size: usize,
    rounded: usize,
    max_split_size: usize,
    non_split_rounding: usize,
) -> bool {
    if rounded < max_split_size && block_size >= max_split_size {
        return false;
    }
    if rounded >= max_split_size && block_size >= rounded.saturating_add(non_split_rounding) {
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
    fn power2_divisions_round_to_equal_steps_between_powers_of_two() {
        assert_eq!(
            round_size_with(1_300_000, 4),
            5 << 18,
            "steps of 256 KiB between 1 and 2 MiB"
        );
        assert_eq!(round_size_with(1 << 20, 4), 1 << 20, "powers of two stay");
        assert_eq!(
            round_size_with(1000, 4),
            1024,
            "too small to divide: 512 B rounding"
        );
        assert_eq!(round_size_with(1_300_000, 1), round_size(1_300_000));
        assert_eq!(
            round_size_with((96 << 20) + 1, 8),
            104 << 20,
            "steps of 8 MiB between 64 and 128 MiB"
        );
    }

    #[test]
    fn segment_sizes_follow_the_pool_rules() {
        assert_eq!(segment_size(512, LARGE_BUFFER), 2 << 20);
        assert_eq!(segment_size(1 << 20, LARGE_BUFFER), 2 << 20);
        assert_eq!(segment_size((1 << 20) + 512, LARGE_BUFFER), 20 << 20);
        assert_eq!(segment_size((10 << 20) - 512, LARGE_BUFFER), 20 << 20);
        assert_eq!(segment_size(10 << 20, LARGE_BUFFER), 10 << 20);
        assert_eq!(segment_size((10 << 20) + 512, LARGE_BUFFER), 12 << 20);
    }

    #[test]
    fn split_thresholds_differ_by_pool() {
        assert!(should_split(PoolKind::Small, 1024, 512, usize::MAX));
        assert!(!should_split(PoolKind::Small, 1024, 1024, usize::MAX));
        assert!(should_split(
            PoolKind::Large,
            20 << 20,
            (19 << 20) - 512,
            usize::MAX
        ));
        assert!(should_split(
            PoolKind::Large,
            20 << 20,
            18 << 20,
            usize::MAX
        ));
        assert!(!should_split(
            PoolKind::Large,
            20 << 20,
            19 << 20,
            usize::MAX
        ));
        assert!(!should_split(PoolKind::Large, 40 << 20, 30 << 20, 25 << 20));
    }

    #[test]
    fn bytes_format_with_binary_units() {
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(2 << 30), "2.00 GiB");
    }
}

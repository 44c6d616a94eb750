//! The caching pinned-host allocator.

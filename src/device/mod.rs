//! The caching device allocator.

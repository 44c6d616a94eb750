//! C functions of the device allocator.

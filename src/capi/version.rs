//! The library's version, for C callers that check at run time which build they loaded.

use std::ffi::{c_char, c_int};

use super::ffi_boundary;

/// The major version of this header (the `X` of `X.Y.Z`). Equal to what
/// `tensoralloc_version()` reports when the header and the loaded library match.
pub const TENSORALLOC_VERSION_MAJOR: c_int = 0;
/// The minor version of this header (the `Y` of `X.Y.Z`).
pub const TENSORALLOC_VERSION_MINOR: c_int = 1;
/// The patch version of this header (the `Z` of `X.Y.Z`).
pub const TENSORALLOC_VERSION_PATCH: c_int = 0;

/// The loaded library's version as a NUL-terminated string, `"MAJOR.MINOR.PATCH"` (for example
/// `"0.1.0"`). The string is static: the caller must not free or modify it, and it stays valid
/// for the life of the process. Never NULL, never fails; an installed library's SONAME
/// (`libtensoralloc.so.MAJOR`, see `scripts/install`) carries the same major version.
#[no_mangle]
pub extern "C" fn tensoralloc_version() -> *const c_char {
    ffi_boundary! {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_constants_are_the_crate_version() {
        let parts: Vec<c_int> = env!("CARGO_PKG_VERSION")
            .split('.')
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(
            parts,
            [
                TENSORALLOC_VERSION_MAJOR,
                TENSORALLOC_VERSION_MINOR,
                TENSORALLOC_VERSION_PATCH
            ]
        );
    }
}

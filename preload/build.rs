//! Links the preload library with `-z nodelete` (the interposed `dlsym` and the hooks may be
//! called until the very end of the process, so it is never unmapped), and keeps the C API of
//! the tensoralloc library it is built from out of its exports (`--exclude-libs`: symbols of
//! linked Rust libraries stay local), so it never shadows `libtensoralloc.so`.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
    println!("cargo:rerun-if-changed=build.rs");
}

//! Gives the fake driver the SONAME of NVIDIA's (`libcuda.so.1`), so a process that loaded it
//! by path gets the same copy back when it later asks the loader for `libcuda.so.1`.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}

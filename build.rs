//! Writes `include/tensoralloc.h` from the C boundary's Rust sources with cbindgen.
//! The committed header must equal what this writes (`.ci/run` checks with git).

use std::path::PathBuf;

fn main() {
    let dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config =
        cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml is valid");
    let header = match cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
    {
        Ok(h) => h,
        Err(e) => {
            // A half-edited source must not stop the compiler from reporting the real error.
            println!("cargo:warning=cbindgen could not generate the header: {e}");
            return;
        }
    };
    let mut text = Vec::new();
    header.write(&mut text);
    let out = dir.join("include").join("tensoralloc.h");
    if std::fs::read(&out).ok().as_deref() != Some(&text[..]) {
        std::fs::create_dir_all(out.parent().unwrap()).expect("can create include/");
        std::fs::write(&out, &text).expect("can write include/tensoralloc.h");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out_dir.join("tensoralloc.h"), &text).expect("can write OUT_DIR header");
}

//! Writes `include/tensoralloc.h` from the C boundary's Rust sources with cbindgen.
//! The committed header must equal what this writes (`.ci/run` checks with git).
//! Also gives the shared library its versioned name (`libtensoralloc.so.MAJOR`).

use std::path::PathBuf;

fn main() {
    let dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    soname();
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

/// Sets the SONAME to `libtensoralloc.so.MAJOR`, so programs linked against one release keep
/// loading compatible later ones (`scripts/install` adds the versioned file and links).
/// Programs linked in the build tree record that name too, so a `libtensoralloc.so.MAJOR` link
/// to the library is made next to it in `target/<profile>`.
fn soname() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets the version");
    let soname = format!("libtensoralloc.so.{major}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    // OUT_DIR is target/<profile>/build/<package>-<hash>/out.
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    if let Some(profile_dir) = out_dir.ancestors().nth(3) {
        let link = profile_dir.join(&soname);
        if std::fs::read_link(&link).is_err() {
            // A concurrent build may have made it already; either way it is there.
            let _ = std::os::unix::fs::symlink("libtensoralloc.so", &link);
        }
    }
}

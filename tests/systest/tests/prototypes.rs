//! The header's function prototypes and names against `src/capi/`: every exported function
//! is declared with the prototype its Rust signature implies, the header declares nothing that
//! `src/capi/` does not export, every exported item is one the generator can check, and
//! `include/tensoralloc.h` is the header all these checks compiled.
//!
//! The tables come from `build.rs`, which reads `src/capi/`; each `compatible` function is C,
//! compiled against the header, and answers with `__builtin_types_compatible_p`.

use std::collections::BTreeSet;

/// One exported function.
struct Function {
    name: &'static str,
    /// Where it is defined, e.g. `src/capi/device.rs`.
    file: &'static str,
    /// Its Rust signature.
    rust: &'static str,
    /// The C prototype its Rust signature implies.
    c: &'static str,
    /// Whether the header's prototype is compatible with `c` (1) or not (0).
    compatible: unsafe extern "C" fn() -> std::ffi::c_int,
}

include!(concat!(env!("OUT_DIR"), "/prototypes.rs"));

/// The header the ABI check compiled: cbindgen's output for the sources under test.
const CHECKED_HEADER: &str = include_str!(concat!(env!("OUT_DIR"), "/include/tensoralloc.h"));

/// The header users compile against.
fn committed_header() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../include/tensoralloc.h");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

/// The header without comments, without the C++-only lines (`extern "C" {`), and without
/// its include guard.
fn header_code(text: &str) -> String {
    let mut code = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        code.push_str(&rest[..start]);
        rest = rest[start + 2..]
            .split_once("*/")
            .map_or("", |(_, after)| after);
    }
    code.push_str(rest);
    let mut lines = Vec::new();
    let mut cplusplus = 0;
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        if line.starts_with("#ifdef __cplusplus") {
            cplusplus += 1;
        } else if cplusplus > 0 && line.starts_with("#endif") {
            cplusplus -= 1;
        } else if cplusplus == 0 {
            lines.push(line);
        }
    }
    lines.join("\n")
}

fn identifiers(text: &str) -> Vec<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
        .collect()
}

/// The header's macro names (without the include guard) and its file-scope declarations,
/// each on one line without the final `;` and with struct bodies left out.
fn header_items(text: &str) -> (Vec<String>, Vec<String>) {
    let code = header_code(text);
    let guard = code
        .lines()
        .find_map(|l| l.strip_prefix("#ifndef "))
        .map(str::trim)
        .unwrap_or_default();
    let mut macros = Vec::new();
    let mut declarations = String::new();
    for line in code.lines() {
        if let Some(define) = line.strip_prefix("#define ") {
            let name = identifiers(define)[0];
            if name != guard {
                macros.push(name.to_string());
            }
        } else if !line.starts_with('#') {
            declarations.push_str(line);
            declarations.push(' ');
        }
    }
    // File-scope declarations end with `;` outside braces.
    let mut statements = Vec::new();
    let mut depth = 0;
    let mut statement = String::new();
    for c in declarations.chars() {
        match c {
            '{' => {
                if depth == 0 {
                    statement.push_str(" { } ");
                }
                depth += 1;
            }
            '}' => depth -= 1,
            ';' if depth == 0 => {
                let s = std::mem::take(&mut statement);
                statements.push(s.split_whitespace().collect::<Vec<_>>().join(" "));
            }
            _ if depth == 0 => statement.push(c),
            _ => {}
        }
    }
    (macros, statements)
}

/// The function a declaration declares: the last word before the parameter list.
fn function_name(statement: &str) -> Option<&str> {
    if statement.starts_with("typedef") {
        return None;
    }
    let (before, _) = statement.split_once('(')?;
    identifiers(before).last().copied()
}

/// Every name the header declares at file scope: macros, typedefs, struct tags and functions.
fn header_names(text: &str) -> BTreeSet<String> {
    let (macros, statements) = header_items(text);
    let mut names: BTreeSet<String> = macros.into_iter().collect();
    for s in &statements {
        let words = identifiers(s);
        if let Some(rest) = s.strip_prefix("typedef") {
            // `typedef struct tag { } name`, `typedef int name`, `typedef void (*name)(...)`
            if let Some(tag) = rest.trim().strip_prefix("struct").map(identifiers) {
                names.insert(tag[0].to_string());
            }
            let name = match rest.split_once("(*") {
                Some((_, after)) => identifiers(after)[0],
                None => words[words.len() - 1],
            };
            names.insert(name.to_string());
        } else if let Some(name) = function_name(s) {
            names.insert(name.to_string());
        } else if s.starts_with("struct") {
            names.insert(words[1].to_string());
        }
    }
    names
}

/// The header's declaration of function `name`.
fn declaration_of(text: &str, name: &str) -> Option<String> {
    header_items(text)
        .1
        .into_iter()
        .find(|s| function_name(s) == Some(name))
}

#[test]
fn every_exported_function_has_the_prototype_its_rust_signature_implies() {
    let wrong: Vec<String> = FUNCTIONS
        .iter()
        // SAFETY: the probes are generated C functions with no arguments and no side effects.
        .filter(|f| unsafe { (f.compatible)() } == 0)
        .map(|f| {
            let declared = declaration_of(CHECKED_HEADER, f.name);
            format!(
                "`{}` ({}): `{}` is in C\n    {};\nbut the header declares\n    {};",
                f.name,
                f.file,
                f.rust,
                f.c,
                declared.as_deref().unwrap_or("(no declaration found)")
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "the header and the Rust definitions disagree:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_committed_header_is_the_one_the_abi_check_compiled() {
    assert!(
        committed_header() == CHECKED_HEADER,
        "include/tensoralloc.h is not what cbindgen generates from the sources, which is what \
         the ABI check compiled: a `cargo build` regenerates it"
    );
}

#[test]
fn the_generator_finds_the_pluggable_allocator_functions() {
    // The names PyTorch loads: if these are missing, the generator is reading the wrong files.
    for name in ["tensoralloc_malloc", "tensoralloc_free"] {
        assert!(
            FUNCTIONS.iter().any(|f| f.name == name),
            "{name} not found in src/capi/"
        );
    }
}

#[test]
fn the_header_declares_only_what_src_capi_exports() {
    let exported: BTreeSet<&str> = FUNCTIONS
        .iter()
        .map(|f| f.name)
        .chain(TYPES.iter().copied())
        .chain(CONSTANTS.iter().copied())
        .collect();
    let extra: Vec<String> = header_names(CHECKED_HEADER)
        .into_iter()
        .filter(|n| !exported.contains(n.as_str()))
        .collect();
    assert!(
        extra.is_empty(),
        "include/tensoralloc.h declares names that src/capi/ does not export (internal items \
         that leaked into the header: make them pub(crate)): {extra:?}"
    );
}

#[test]
fn every_item_src_capi_exports_is_checked() {
    assert!(
        UNSUPPORTED.is_empty(),
        "src/capi/ exports items that tests/systest/build.rs cannot check:\n{}",
        UNSUPPORTED.join("\n")
    );
}

#[test]
fn the_header_reader_finds_macros_typedefs_structs_and_functions() {
    let text = "#ifndef G\n#define G\n/* c */\n#define A 1\ntypedef struct S S;\n\
                typedef struct T {\n  int x;\n} T;\ntypedef int U;\ntypedef void (*F)(int);\n\
                #ifdef __cplusplus\nextern \"C\" {\n#endif\nconst char *f(void);\n\
                void *g(size_t n,\n        int d);\n#ifdef __cplusplus\n}\n#endif\n#endif\n";
    let names: Vec<String> = header_names(text).into_iter().collect();
    assert_eq!(names, ["A", "F", "S", "T", "U", "f", "g"]);
    assert_eq!(
        declaration_of(text, "g").as_deref(),
        Some("void *g(size_t n, int d)")
    );
}

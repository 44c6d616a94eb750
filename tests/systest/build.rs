//! Generates tensoralloc's ABI check from the C boundary's own sources.
//!
//! The header is generated here as tensoralloc's build script generates
//! `include/tensoralloc.h` (cbindgen, `cbindgen.toml`), so that it matches the sources being
//! checked even when cargo runs that script later; a test checks that the committed header is
//! the same file.
//!
//! Every file under `src/capi/` is parsed with `syn`. What it exports to C (each
//! `#[no_mangle] pub extern "C" fn`, `pub struct`, `pub type` and `pub const`) is written out
//! into `OUT_DIR` three ways:
//! - `ctest_input.rs`: a standalone copy of those items. ctest expands it with rustc to learn
//!   them and writes `all.rs` + `all.c`: sizes, alignments, field offsets, sizes and C types,
//!   constant values, signedness and function addresses, compared with the header.
//! - `capi.rs`: what the test crate checks: the real items re-exported from `tensoralloc`, the
//!   functions declared in an `extern "C"` block with their own signatures, and compile-time
//!   proofs that every declaration, alias, constant and field has the real item's exact type.
//! - `prototypes.c` + `prototypes.rs`: for each function, whether the header's prototype is
//!   compatible with the one its Rust signature implies (ctest compares addresses only), and
//!   the names the header may declare.
//!
//! Nothing is listed by hand: a new file or item in `src/capi/` is checked as it appears.
//! Items the generator cannot express are left out and named in `UNSUPPORTED`, which a test
//! requires to be empty.

mod cdecl;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use cdecl::CType;
use proc_macro2::TokenStream;
use quote::{format_ident, quote, ToTokens};
use syn::{Attribute, Expr, Fields, FnArg, Item, Pat, ReturnType, Type, Visibility};

fn main() {
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest.join("../..");
    let capi_dir = root.join("src/capi");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // cbindgen reads the whole crate: a `pub` item anywhere can reach the header.
    for input in ["src", "cbindgen.toml", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", root.join(input).display());
    }

    let include_dir = out.join("include");
    write_header(&root, &include_dir.join("tensoralloc.h"));
    let api = Api::collect(&root, &capi_dir);
    write(&out.join("ctest_input.rs"), &api.ctest_input());
    write(&out.join("capi.rs"), &api.test_items());
    write(&out.join("prototypes.rs"), &api.prototypes_rs());
    write(&out.join("prototypes.c"), &api.prototypes_c());

    cc::Build::new()
        .file(out.join("prototypes.c"))
        .include(&include_dir)
        .flag("-std=c99")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("tensoralloc_prototypes");

    let mut cfg = ctest::TestGenerator::new();
    cfg.header("tensoralloc.h")
        .include(&include_dir)
        .out_dir(&out);
    // C sees these only as incomplete types: there is no layout to compare.
    let opaque: BTreeSet<String> = api
        .structs
        .iter()
        .filter(|s| !s.layout)
        .map(|s| s.name.clone())
        .collect();
    cfg.skip_struct(move |s| opaque.contains(s.ident()));
    if let Err(e) = ctest::generate_test(&mut cfg, out.join("ctest_input.rs"), "all.rs") {
        panic!("ctest could not generate the ABI test: {e}");
    }
}

/// Writes the header exactly as tensoralloc's own build script does (same cbindgen, same
/// configuration). Cargo may run that script after this one, so `include/tensoralloc.h` can
/// still be the previous version here; `tests/prototypes.rs` checks that it is this one.
fn write_header(root: &Path, path: &Path) {
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("cannot read cbindgen.toml: {e}"));
    let header = cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen cannot generate the header: {e}"));
    std::fs::create_dir_all(path.parent().expect("the header has a directory"))
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    header.write_to_file(path);
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    if path.extension().is_some_and(|e| e == "rs") {
        // Readable when a check fails and someone opens the file; unformatted works as well.
        let _ = std::process::Command::new("rustfmt")
            .args(["--edition", "2021"])
            .arg(path)
            .status();
    }
}

/// Where an item is defined.
#[derive(Clone)]
struct Source {
    /// Relative to the repository root, e.g. `src/capi/device.rs`.
    file: String,
    /// Module path in the crate, e.g. `["capi", "device"]`.
    module: Vec<String>,
}

impl Source {
    /// `::tensoralloc::capi::device::name`.
    fn real_path(&self, name: &str) -> TokenStream {
        let segments = self.module.iter().map(|m| format_ident!("{}", m));
        let name = format_ident!("{}", name);
        quote!(::tensoralloc #(::#segments)* ::#name)
    }
}

struct Function {
    name: String,
    src: Source,
    sig: syn::Signature,
    /// Parameter names for the declaration (`_` where the definition uses a pattern).
    params: Vec<syn::Ident>,
    /// Parameter and return types, normalized (see [`Api::rust_type`]).
    inputs: Vec<Type>,
    output: Option<Type>,
}

struct Struct {
    name: String,
    src: Source,
    /// `#[repr(C)]` with named, public fields: C sees its layout. Otherwise C sees an
    /// incomplete type (a handle).
    layout: bool,
    repr: Vec<Attribute>,
    fields: Vec<(syn::Ident, Type)>,
}

struct Alias {
    name: String,
    src: Source,
    ty: Type,
}

struct Const {
    name: String,
    src: Source,
    ty: Type,
}

#[derive(Default)]
struct Api {
    functions: Vec<Function>,
    structs: Vec<Struct>,
    aliases: Vec<Alias>,
    consts: Vec<Const>,
    /// Exported items the generator cannot check, each with the reason.
    unsupported: Vec<String>,
}

/// The C types of `core::ffi`, which the crate's signatures use.
const C_TYPES: &[(&str, &str)] = &[
    ("c_void", "void"),
    ("c_char", "char"),
    ("c_schar", "signed char"),
    ("c_uchar", "unsigned char"),
    ("c_short", "short"),
    ("c_ushort", "unsigned short"),
    ("c_int", "int"),
    ("c_uint", "unsigned int"),
    ("c_long", "long"),
    ("c_ulong", "unsigned long"),
    ("c_longlong", "long long"),
    ("c_ulonglong", "unsigned long long"),
    ("c_float", "float"),
    ("c_double", "double"),
];

/// Rust primitives and their C names as cbindgen writes them (`usize_is_size_t`).
const PRIMITIVES: &[(&str, &str)] = &[
    ("bool", "bool"),
    ("i8", "int8_t"),
    ("i16", "int16_t"),
    ("i32", "int32_t"),
    ("i64", "int64_t"),
    ("u8", "uint8_t"),
    ("u16", "uint16_t"),
    ("u32", "uint32_t"),
    ("u64", "uint64_t"),
    ("isize", "ptrdiff_t"),
    ("usize", "size_t"),
    ("f32", "float"),
    ("f64", "double"),
];

/// Paths under which the `C_TYPES` are reached.
const C_TYPE_MODULES: &[&[&str]] = &[
    &["std", "ffi"],
    &["core", "ffi"],
    &["std", "os", "raw"],
    &["libc"],
];

fn is_pub(vis: &Visibility) -> bool {
    matches!(vis, Visibility::Public(_))
}

/// `#[cfg(test)]` items are not part of the library.
fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta.to_token_stream().to_string().replace(' ', "") == "cfg(test)"
    })
}

/// `#[no_mangle]` or `#[unsafe(no_mangle)]`.
fn is_no_mangle(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("no_mangle")
            || (a.path().is_ident("unsafe")
                && a.meta.to_token_stream().to_string().replace(' ', "") == "unsafe(no_mangle)")
    })
}

fn has_export_name(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| a.path().is_ident("export_name"))
}

fn repr_attrs(attrs: &[Attribute]) -> Vec<Attribute> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("repr"))
        .cloned()
        .collect()
}

fn has_repr_c(attrs: &[Attribute]) -> bool {
    repr_attrs(attrs).iter().any(|a| {
        let mut c = false;
        let _ = a.parse_nested_meta(|m| {
            c |= m.path.is_ident("C");
            // `align(N)` / `packed(N)` carry a value; skip it.
            if m.input.peek(syn::token::Paren) {
                let _content;
                syn::parenthesized!(_content in m.input);
            }
            Ok(())
        });
        c
    })
}

/// Token text made readable for messages: `* mut T` -> `*mut T`, `a :: b` -> `a::b`.
fn pretty(tokens: impl ToTokens) -> String {
    let mut s = tokens.to_token_stream().to_string();
    for (from, to) in [
        (" :: ", "::"),
        (":: ", "::"),
        ("* mut ", "*mut "),
        ("* const ", "*const "),
        (" ,", ","),
        (" :", ":"),
        ("< ", "<"),
        (" >", ">"),
        ("& ", "&"),
        (" (", "("),
        ("( ", "("),
        (" )", ")"),
        ("[ ", "["),
        (" ]", "]"),
        (" ;", ";"),
        (",)", ")"),
    ] {
        s = s.replace(from, to);
    }
    s
}

impl Api {
    fn collect(root: &Path, capi_dir: &Path) -> Api {
        let mut files = Vec::new();
        rust_files(capi_dir, &mut files);
        files.sort();
        assert!(
            !files.is_empty(),
            "no Rust files under {}",
            capi_dir.display()
        );
        let mut api = Api::default();
        for path in files {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let file = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("cannot parse {}: {e}", path.display()));
            let relative = path.strip_prefix(root).unwrap_or(&path);
            let src = Source {
                file: relative.display().to_string(),
                module: module_path(relative),
            };
            api.walk(&file.items, &src);
        }
        api.normalize();
        api
    }

    /// Collects the exported items of one module (and of its inline modules).
    fn walk(&mut self, items: &[Item], src: &Source) {
        for item in items {
            match item {
                Item::Fn(f)
                    if !is_test_only(&f.attrs)
                        && (is_no_mangle(&f.attrs) || has_export_name(&f.attrs)) =>
                {
                    let name = f.sig.ident.to_string();
                    let abi = f
                        .sig
                        .abi
                        .as_ref()
                        .and_then(|a| a.name.as_ref())
                        .map(|n| n.value());
                    if has_export_name(&f.attrs) {
                        self.unsupported
                            .push(format!("{}: `{name}` uses #[export_name]", src.file));
                    } else if !is_pub(&f.vis) {
                        // The test crate cannot name it to check its type.
                        self.unsupported.push(format!(
                            "{}: exported function `{name}` is not `pub` (cbindgen declares it and \
                             libtensoralloc.so exports it all the same; make it `pub`)",
                            src.file
                        ));
                    } else if f.sig.abi.is_none() || !matches!(abi.as_deref(), None | Some("C")) {
                        self.unsupported.push(format!(
                            "{}: exported function `{name}` is not `extern \"C\"`",
                            src.file
                        ));
                    } else if !f.sig.generics.params.is_empty()
                        || f.sig.variadic.is_some()
                        || f.sig.asyncness.is_some()
                    {
                        self.unsupported.push(format!(
                            "{}: exported function `{name}` is generic, variadic or async",
                            src.file
                        ));
                    } else {
                        let params = f
                            .sig
                            .inputs
                            .iter()
                            .enumerate()
                            .map(|(i, arg)| match arg {
                                FnArg::Typed(t) => match &*t.pat {
                                    Pat::Ident(p) => p.ident.clone(),
                                    _ => format_ident!("arg{}", i),
                                },
                                FnArg::Receiver(_) => format_ident!("self_"),
                            })
                            .collect();
                        self.functions.push(Function {
                            name,
                            src: src.clone(),
                            sig: f.sig.clone(),
                            params,
                            inputs: Vec::new(),
                            output: None,
                        });
                    }
                }
                Item::Struct(s) if is_pub(&s.vis) && !is_test_only(&s.attrs) => {
                    let name = s.ident.to_string();
                    let all_private = s.fields.iter().all(|f| !is_pub(&f.vis));
                    let all_public = s.fields.iter().all(|f| is_pub(&f.vis));
                    let repr_c = has_repr_c(&s.attrs);
                    if !s.generics.params.is_empty() {
                        self.unsupported
                            .push(format!("{}: struct `{name}` is generic", src.file));
                    } else if repr_c
                        && matches!(s.fields, Fields::Named(_))
                        && !s.fields.is_empty()
                        && all_public
                    {
                        let fields = s
                            .fields
                            .iter()
                            .map(|f| (f.ident.clone().expect("named field"), f.ty.clone()))
                            .collect();
                        self.structs.push(Struct {
                            name,
                            src: src.clone(),
                            layout: true,
                            repr: repr_attrs(&s.attrs),
                            fields,
                        });
                    } else if all_private || !repr_c {
                        self.structs.push(Struct {
                            name,
                            src: src.clone(),
                            layout: false,
                            repr: Vec::new(),
                            fields: Vec::new(),
                        });
                    } else {
                        self.unsupported.push(format!(
                            "{}: #[repr(C)] struct `{name}` mixes public and private fields or has unnamed fields",
                            src.file
                        ));
                    }
                }
                Item::Type(t) if is_pub(&t.vis) && !is_test_only(&t.attrs) => {
                    if t.generics.params.is_empty() {
                        self.aliases.push(Alias {
                            name: t.ident.to_string(),
                            src: src.clone(),
                            ty: (*t.ty).clone(),
                        });
                    } else {
                        self.unsupported
                            .push(format!("{}: type alias `{}` is generic", src.file, t.ident));
                    }
                }
                Item::Const(c) if is_pub(&c.vis) && !is_test_only(&c.attrs) => {
                    self.consts.push(Const {
                        name: c.ident.to_string(),
                        src: src.clone(),
                        ty: (*c.ty).clone(),
                    });
                }
                Item::Enum(e) if is_pub(&e.vis) && !is_test_only(&e.attrs) => {
                    self.unsupported.push(format!(
                        "{}: enum `{}` (the generator does not check enums)",
                        src.file, e.ident
                    ));
                }
                Item::Union(u) if is_pub(&u.vis) && !is_test_only(&u.attrs) => {
                    self.unsupported.push(format!(
                        "{}: union `{}` (the generator does not check unions)",
                        src.file, u.ident
                    ));
                }
                Item::Static(s)
                    if (is_pub(&s.vis) || is_no_mangle(&s.attrs)) && !is_test_only(&s.attrs) =>
                {
                    self.unsupported.push(format!(
                        "{}: static `{}` (the generator does not check statics)",
                        src.file, s.ident
                    ));
                }
                Item::Mod(m) if !is_test_only(&m.attrs) => {
                    if let Some((_, inner)) = &m.content {
                        let mut sub = src.clone();
                        sub.module.push(m.ident.to_string());
                        self.walk(inner, &sub);
                    }
                }
                _ => {}
            }
        }
    }

    /// Rewrites every type into the form the generated files use, and drops (into
    /// `unsupported`) items whose types are neither C types nor types of `src/capi/`. Repeats
    /// until nothing more is dropped, since dropping a type drops the items that use it
    /// (normalizing a normalized type changes nothing).
    fn normalize(&mut self) {
        loop {
            let known: BTreeSet<String> = self
                .structs
                .iter()
                .map(|s| s.name.clone())
                .chain(self.aliases.iter().map(|a| a.name.clone()))
                .collect();
            let consts: BTreeSet<String> = self.consts.iter().map(|c| c.name.clone()).collect();
            let names = Names {
                types: &known,
                consts: &consts,
            };
            let mut unsupported = Vec::new();

            let mut duplicates = BTreeSet::new();
            let mut seen = BTreeSet::new();
            for name in self
                .functions
                .iter()
                .map(|f| &f.name)
                .chain(self.structs.iter().map(|s| &s.name))
                .chain(self.aliases.iter().map(|a| &a.name))
                .chain(self.consts.iter().map(|c| &c.name))
            {
                if !seen.insert(name.clone()) {
                    duplicates.insert(name.clone());
                }
            }
            for name in &duplicates {
                unsupported.push(format!(
                    "`{name}` is defined more than once in src/capi (C has one namespace)"
                ));
            }

            self.aliases.retain_mut(|a| match names.rust_type(&a.ty) {
                Ok(t) if !duplicates.contains(&a.name) => {
                    a.ty = t;
                    true
                }
                Ok(_) => false,
                Err(e) => {
                    unsupported.push(format!("{}: type alias `{}`: {e}", a.src.file, a.name));
                    false
                }
            });
            self.consts.retain_mut(|c| match names.rust_type(&c.ty) {
                Ok(t) if !duplicates.contains(&c.name) => {
                    c.ty = t;
                    true
                }
                Ok(_) => false,
                Err(e) => {
                    unsupported.push(format!("{}: constant `{}`: {e}", c.src.file, c.name));
                    false
                }
            });
            self.structs.retain_mut(|s| {
                if duplicates.contains(&s.name) {
                    return false;
                }
                let fields: Result<Vec<_>, String> = s
                    .fields
                    .iter()
                    .map(|(f, t)| {
                        names
                            .rust_type(t)
                            .map(|t| (f.clone(), t))
                            .map_err(|e| format!("field `{f}`: {e}"))
                    })
                    .collect();
                match fields {
                    Ok(f) => {
                        s.fields = f;
                        true
                    }
                    Err(e) => {
                        unsupported.push(format!("{}: struct `{}`: {e}", s.src.file, s.name));
                        false
                    }
                }
            });
            self.functions.retain_mut(|f| {
                if duplicates.contains(&f.name) {
                    return false;
                }
                let inputs: Result<Vec<_>, String> = f
                    .sig
                    .inputs
                    .iter()
                    .map(|a| match a {
                        FnArg::Typed(t) => names.rust_type(&t.ty),
                        FnArg::Receiver(_) => Err("takes `self`".to_string()),
                    })
                    .collect();
                let output = match &f.sig.output {
                    ReturnType::Default => Ok(None),
                    ReturnType::Type(_, t) => names.rust_type(t).map(Some),
                };
                match (inputs, output) {
                    (Ok(i), Ok(o)) => {
                        f.inputs = i;
                        f.output = o;
                        true
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        unsupported.push(format!("{}: function `{}`: {e}", f.src.file, f.name));
                        false
                    }
                }
            });
            let done = unsupported.is_empty();
            self.unsupported.extend(unsupported);
            if done {
                break;
            }
        }
    }

    fn names(&self) -> (BTreeSet<String>, BTreeSet<String>) {
        let types = self
            .structs
            .iter()
            .map(|s| s.name.clone())
            .chain(self.aliases.iter().map(|a| a.name.clone()))
            .collect();
        let consts = self.consts.iter().map(|c| c.name.clone()).collect();
        (types, consts)
    }

    /// The `extern "C"` declarations of every exported function, with its own signature.
    fn declarations(&self) -> TokenStream {
        let decls = self.functions.iter().map(|f| {
            let name = format_ident!("{}", f.name);
            let params = &f.params;
            let inputs = &f.inputs;
            let output = f.output.as_ref().map(|t| quote!(-> #t));
            quote!(pub fn #name(#(#params: #inputs),*) #output;)
        });
        quote!(extern "C" { #(#decls)* })
    }

    /// The standalone copy that ctest reads. Constant values are placeholders: ctest takes
    /// only names and types from here, and the test crate compiles against the real items.
    fn ctest_input(&self) -> String {
        let structs = self.structs.iter().map(|s| {
            let name = format_ident!("{}", s.name);
            if s.layout {
                let repr = &s.repr;
                let fields = s.fields.iter().map(|(f, t)| quote!(pub #f: #t));
                quote!(#(#repr)* pub struct #name { #(#fields),* })
            } else {
                quote!(#[repr(C)] pub struct #name { _opaque: [u8; 0] })
            }
        });
        let aliases = self.aliases.iter().map(|a| {
            let name = format_ident!("{}", a.name);
            let ty = &a.ty;
            quote!(pub type #name = #ty;)
        });
        let consts = self.consts.iter().map(|c| {
            let name = format_ident!("{}", c.name);
            let ty = &c.ty;
            quote!(pub const #name: #ty = unsafe { ::core::mem::zeroed() };)
        });
        let decls = self.declarations();
        let code = quote! {
            #![allow(non_camel_case_types, dead_code)]
            use std::ffi::*;
            #(#structs)*
            #(#aliases)*
            #(#consts)*
            #decls
        };
        format!(
            "// Generated by tests/systest/build.rs from src/capi/ for ctest to read; never compiled.\n{}\n",
            code
        )
    }

    /// The items the test crate checks, and compile-time proofs that they are the real ones.
    fn test_items(&self) -> String {
        let reexports = self
            .structs
            .iter()
            .map(|s| s.src.real_path(&s.name))
            .chain(self.aliases.iter().map(|a| a.src.real_path(&a.name)))
            .chain(self.consts.iter().map(|c| c.src.real_path(&c.name)));
        let decls = self.declarations();
        let alias_checks = self.aliases.iter().map(|a| {
            let name = format_ident!("{}", a.name);
            let ty = &a.ty;
            quote!(const _: () = same_type::<#ty, #name>();)
        });
        let const_checks = self.consts.iter().map(|c| {
            let name = format_ident!("{}", c.name);
            let ty = &c.ty;
            quote!(const _: () = has_type::<#ty, _>(&#name);)
        });
        let struct_checks = self.structs.iter().filter(|s| s.layout).map(|s| {
            let name = format_ident!("{}", s.name);
            let check = format_ident!("fields_of_{}", s.name);
            let fields: Vec<_> = s.fields.iter().map(|(f, _)| f).collect();
            let types = s.fields.iter().map(|(_, t)| t);
            // The pattern names every field (no `..`), so a field missing here fails too.
            quote! {
                #[allow(dead_code)]
                fn #check(s: &#name) {
                    let #name { #(#fields),* } = s;
                    #(has_type::<#types, _>(#fields);)*
                }
            }
        });
        let fn_checks = self.functions.iter().map(|f| {
            let real = f.src.real_path(&f.name);
            let unsafety = &f.sig.unsafety;
            let abi = &f.sig.abi;
            let inputs = &f.inputs;
            let output = f.output.as_ref().map(|t| quote!(-> #t));
            // Coercing the function item to a function pointer of the declared type compiles
            // only when the types are identical (safety included).
            quote!(const _: #unsafety #abi fn(#(#inputs),*) #output = #real;)
        });
        let code = quote! {
            use std::ffi::*;
            #(pub use #reexports;)*

            #[allow(improper_ctypes)]
            #decls

            /// Implemented only for `T` itself: `B: Is<A>` holds exactly when `A` and `B` are one type.
            trait Is<T: ?Sized> {}
            impl<T: ?Sized> Is<T> for T {}
            const fn same_type<A: ?Sized, B: ?Sized + Is<A>>() {}
            const fn has_type<T, V: Is<T>>(_: &V) {}

            #(#alias_checks)*
            #(#const_checks)*
            #(#struct_checks)*
            #(#fn_checks)*
        };
        format!(
            "// Generated by tests/systest/build.rs from src/capi/.\n{}\n",
            code
        )
    }

    /// The tables `tests/prototypes.rs` checks.
    fn prototypes_rs(&self) -> String {
        let (types, consts) = self.names();
        let externs = self.functions.iter().map(|f| {
            let probe = format_ident!("tensoralloc_systest_prototype__{}", f.name);
            quote!(fn #probe() -> ::std::ffi::c_int;)
        });
        let entries = self.functions.iter().map(|f| {
            let name = &f.name;
            let file = &f.src.file;
            let rust = pretty(&f.sig);
            let c = self.c_prototype(f);
            let probe = format_ident!("tensoralloc_systest_prototype__{}", f.name);
            quote!(Function { name: #name, file: #file, rust: #rust, c: #c, compatible: #probe },)
        });
        let types = types.iter();
        let consts = consts.iter();
        let unsupported = self.unsupported.iter();
        let code = quote! {
            extern "C" { #(#externs)* }
            /// Every exported function.
            const FUNCTIONS: &[Function] = &[#(#entries)*];
            /// Every type (struct or alias) `src/capi/` exports.
            const TYPES: &[&str] = &[#(#types),*];
            /// Every constant `src/capi/` exports.
            const CONSTANTS: &[&str] = &[#(#consts),*];
            /// Exported items the generator could not check, with the reason.
            const UNSUPPORTED: &[&str] = &[#(#unsupported),*];
        };
        format!(
            "// Generated by tests/systest/build.rs from src/capi/.\n{}\n",
            code
        )
    }

    /// One C function per exported function: 1 when the header's prototype is compatible with
    /// the one the Rust signature implies.
    fn prototypes_c(&self) -> String {
        let mut c = String::from(
            "/* Generated by tests/systest/build.rs from src/capi/: is each prototype in tensoralloc.h\n \
             * compatible with the one its Rust definition implies? */\n\
             #include <stdbool.h>\n#include <stddef.h>\n#include <stdint.h>\n#include \"tensoralloc.h\"\n",
        );
        for f in &self.functions {
            let fn_ptr = CType::Pointer(Box::new(self.c_fn_type(f)), false);
            writeln!(
                c,
                "\nint tensoralloc_systest_prototype__{name}(void);\n\
                 int tensoralloc_systest_prototype__{name}(void) {{\n    \
                 return __builtin_types_compatible_p(__typeof__(&{name}), {ty});\n}}",
                name = f.name,
                ty = fn_ptr.declare("")
            )
            .expect("writing to a String cannot fail");
        }
        c
    }

    fn c_fn_type(&self, f: &Function) -> CType {
        let (types, consts) = self.names();
        let names = Names {
            types: &types,
            consts: &consts,
        };
        let ret = f
            .output
            .as_ref()
            .map_or(CType::void(), |t| names.c_type(t, self));
        let params = f.inputs.iter().map(|t| names.c_type(t, self)).collect();
        CType::Function(Box::new(ret), params)
    }

    /// The function's C prototype, with parameter names, as a reader would write it.
    fn c_prototype(&self, f: &Function) -> String {
        let CType::Function(ret, params) = self.c_fn_type(f) else {
            unreachable!("c_fn_type returns a function type")
        };
        let params: Vec<String> = params
            .iter()
            .zip(&f.params)
            .map(|(t, n)| t.declare(&n.to_string()))
            .collect();
        let params = if params.is_empty() {
            "void".to_string()
        } else {
            params.join(", ")
        };
        ret.declare(&format!("{}({params})", f.name))
    }

    fn is_struct(&self, name: &str) -> bool {
        self.structs.iter().any(|s| s.name == name)
    }
}

/// Names that `src/capi/` defines, for resolving types.
struct Names<'a> {
    types: &'a BTreeSet<String>,
    consts: &'a BTreeSet<String>,
}

impl Names<'_> {
    /// Rewrites `ty` with `src/capi/` types by their bare name and C types as `core::ffi`'s
    /// bare names, which both generated Rust files bring into scope; fails on anything else.
    fn rust_type(&self, ty: &Type) -> Result<Type, String> {
        match ty {
            Type::Paren(p) => self.rust_type(&p.elem),
            Type::Group(g) => self.rust_type(&g.elem),
            Type::Ptr(p) => {
                let mut p = p.clone();
                *p.elem = self.rust_type(&p.elem)?;
                Ok(Type::Ptr(p))
            }
            Type::Reference(r) => {
                let mut r = r.clone();
                *r.elem = self.rust_type(&r.elem)?;
                Ok(Type::Reference(r))
            }
            Type::Array(a) => {
                let mut a = a.clone();
                *a.elem = self.rust_type(&a.elem)?;
                a.len = self.array_len(&a.len)?;
                Ok(Type::Array(a))
            }
            Type::Tuple(t) if t.elems.is_empty() => Ok(ty.clone()),
            Type::BareFn(f) => {
                let mut f = f.clone();
                let c_abi = f
                    .abi
                    .as_ref()
                    .is_some_and(|a| a.name.as_ref().is_none_or(|n| n.value() == "C"));
                if !c_abi {
                    return Err(format!(
                        "`{}` is not an `extern \"C\"` function pointer",
                        pretty(ty)
                    ));
                }
                for input in &mut f.inputs {
                    input.ty = self.rust_type(&input.ty)?;
                }
                if let ReturnType::Type(_, t) = &mut f.output {
                    **t = self.rust_type(t)?;
                }
                Ok(Type::BareFn(f))
            }
            Type::Path(p) if p.qself.is_none() => {
                let segments: Vec<String> = p
                    .path
                    .segments
                    .iter()
                    .map(|s| s.ident.to_string())
                    .collect();
                let last = p.path.segments.last().expect("a path has a segment");
                let name = segments.last().expect("a path has a segment").as_str();
                let module: Vec<&str> = segments[..segments.len() - 1]
                    .iter()
                    .map(String::as_str)
                    .collect();
                let plain = last.arguments.is_none();
                if plain && segments.len() == 1 && PRIMITIVES.iter().any(|(r, _)| *r == name) {
                    return Ok(ty.clone());
                }
                if plain
                    && C_TYPES.iter().any(|(r, _)| *r == name)
                    && (module.is_empty() || C_TYPE_MODULES.contains(&module.as_slice()))
                {
                    let ident = format_ident!("{}", name);
                    return Ok(syn::parse_quote!(#ident));
                }
                if plain && self.types.contains(name) {
                    // `super::X`, `crate::capi::X`, `X`: all one item, since C names are unique.
                    let ident = format_ident!("{}", name);
                    return Ok(syn::parse_quote!(#ident));
                }
                let option = matches!(
                    module.as_slice(),
                    [] | ["std", "option"] | ["core", "option"]
                ) && name == "Option";
                if option {
                    if let syn::PathArguments::AngleBracketed(args) = &last.arguments {
                        if let [syn::GenericArgument::Type(
                            inner @ (Type::BareFn(_) | Type::Reference(_)),
                        )] = args.args.iter().collect::<Vec<_>>().as_slice()
                        {
                            let inner = self.rust_type(inner)?;
                            return Ok(syn::parse_quote!(Option<#inner>));
                        }
                    }
                }
                Err(format!(
                    "`{}` is neither a C type nor a type defined in src/capi/",
                    pretty(ty)
                ))
            }
            _ => Err(format!(
                "`{}` has no C equivalent the generator knows",
                pretty(ty)
            )),
        }
    }

    /// Array lengths: literals, or constants of `src/capi/` (the header defines them too).
    fn array_len(&self, len: &Expr) -> Result<Expr, String> {
        match len {
            Expr::Lit(_) => Ok(len.clone()),
            Expr::Path(p) if p.qself.is_none() => {
                let name = p
                    .path
                    .segments
                    .last()
                    .expect("a path has a segment")
                    .ident
                    .to_string();
                if self.consts.contains(&name) {
                    let ident = format_ident!("{}", name);
                    Ok(syn::parse_quote!(#ident))
                } else {
                    Err(format!(
                        "array length `{}` is not a constant of src/capi/",
                        pretty(len)
                    ))
                }
            }
            _ => Err(format!(
                "array length `{}` is neither a literal nor a constant",
                pretty(len)
            )),
        }
    }

    /// The C type of a normalized Rust type.
    fn c_type(&self, ty: &Type, api: &Api) -> CType {
        match ty {
            Type::Ptr(p) => {
                CType::Pointer(Box::new(self.c_type(&p.elem, api)), p.mutability.is_none())
            }
            Type::Reference(r) => {
                CType::Pointer(Box::new(self.c_type(&r.elem, api)), r.mutability.is_none())
            }
            Type::Array(a) => CType::Array(Box::new(self.c_type(&a.elem, api)), pretty(&a.len)),
            Type::Tuple(_) => CType::void(),
            Type::BareFn(f) => {
                let ret = match &f.output {
                    ReturnType::Default => CType::void(),
                    ReturnType::Type(_, t) => self.c_type(t, api),
                };
                let params = f.inputs.iter().map(|i| self.c_type(&i.ty, api)).collect();
                CType::Pointer(Box::new(CType::Function(Box::new(ret), params)), false)
            }
            Type::Path(p) => {
                let last = p.path.segments.last().expect("a path has a segment");
                let name = last.ident.to_string();
                if name == "Option" {
                    if let syn::PathArguments::AngleBracketed(args) = &last.arguments {
                        if let Some(syn::GenericArgument::Type(inner)) = args.args.first() {
                            return self.c_type(inner, api);
                        }
                    }
                }
                let c = PRIMITIVES
                    .iter()
                    .chain(C_TYPES)
                    .find(|(r, _)| *r == name)
                    .map(|(_, c)| c.to_string())
                    .unwrap_or_else(|| {
                        if api.is_struct(&name) {
                            format!("struct {name}")
                        } else {
                            name
                        }
                    });
                CType::Named(c)
            }
            _ => unreachable!("normalized types are paths, pointers, arrays, unit or fn pointers"),
        }
    }
}

/// `src/capi/device.rs` -> `["capi", "device"]`; `src/capi/mod.rs` -> `["capi"]`.
fn module_path(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.first().map(String::as_str) == Some("src") {
        parts.remove(0);
    }
    if parts.last().map(String::as_str) == Some("mod") {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

//! The C declarations `build.rs` writes for the prototype checks and failure messages.

#[path = "../cdecl.rs"]
mod cdecl;

use cdecl::CType;

fn named(n: &str) -> CType {
    CType::Named(n.to_string())
}

fn ptr(to: CType) -> CType {
    CType::Pointer(Box::new(to), false)
}

fn ptr_to_const(to: CType) -> CType {
    CType::Pointer(Box::new(to), true)
}

fn func(ret: CType, params: Vec<CType>) -> CType {
    CType::Function(Box::new(ret), params)
}

#[test]
fn a_pointer_to_const_char_puts_const_first() {
    assert_eq!(ptr_to_const(named("char")).declare("s"), "const char *s");
}

#[test]
fn a_pointer_to_a_const_pointer_puts_const_after_the_inner_star() {
    // Rust `*const *mut c_char`.
    assert_eq!(
        ptr_to_const(ptr(named("char"))).declare("argv"),
        "char *const *argv"
    );
}

#[test]
fn a_pointer_to_a_pointer_to_void_has_two_stars() {
    assert_eq!(ptr(ptr(CType::void())).declare("ctx"), "void **ctx");
}

#[test]
fn an_array_of_structs_puts_the_length_after_the_name() {
    let t = CType::Array(Box::new(named("struct tensoralloc_stat")), "3".into());
    assert_eq!(
        t.declare("allocation"),
        "struct tensoralloc_stat allocation[3]"
    );
}

#[test]
fn a_pointer_to_an_array_needs_parentheses() {
    let t = ptr(CType::Array(Box::new(named("int")), "4".into()));
    assert_eq!(t.declare("p"), "int (*p)[4]");
}

#[test]
fn a_function_pointer_parameter_needs_parentheses() {
    let t = ptr(func(named("int"), vec![named("int"), ptr(CType::void())]));
    assert_eq!(t.declare("callback"), "int (*callback)(int, void *)");
}

#[test]
fn an_abstract_function_pointer_type_has_no_name() {
    let t = ptr(func(
        ptr(CType::void()),
        vec![
            named("size_t"),
            named("int"),
            ptr(named("struct CUstream_st")),
        ],
    ));
    assert_eq!(
        t.declare(""),
        "void *(*)(size_t, int, struct CUstream_st *)"
    );
}

#[test]
fn a_function_without_parameters_takes_void() {
    assert_eq!(func(named("int"), vec![]).declare("f"), "int f(void)");
}

#[test]
fn a_function_returning_a_function_pointer_nests_its_parameter_lists() {
    let t = func(ptr(func(named("int"), vec![named("int")])), vec![]);
    assert_eq!(t.declare("f"), "int (*f(void))(int)");
}

//! C declarations of C types, written inside out as C requires (`int (*f)(void)`,
//! `char *const *p`). Shared by `build.rs` and its test, `tests/cdecl.rs`.

/// A C type, for writing declarations.
pub enum CType {
    /// A named type: `int`, `struct tensoralloc_stat`, `tensoralloc_status`.
    Named(String),
    /// A pointer; `true` = to const.
    Pointer(Box<CType>, bool),
    Array(Box<CType>, String),
    Function(Box<CType>, Vec<CType>),
}

impl CType {
    pub fn void() -> CType {
        CType::Named("void".into())
    }

    /// A declaration of `name` with this type (`name` empty: an abstract type name).
    pub fn declare(&self, name: &str) -> String {
        self.declare_inner(name.to_string(), false)
    }

    /// Builds the declarator inside out; `konst`: this type itself is const-qualified.
    fn declare_inner(&self, inner: String, konst: bool) -> String {
        match self {
            CType::Named(n) => {
                let q = if konst { "const " } else { "" };
                if inner.is_empty() {
                    format!("{q}{n}")
                } else {
                    format!("{q}{n} {inner}")
                }
            }
            CType::Pointer(to, to_const) => {
                let star = if konst {
                    format!("*const {inner}")
                } else {
                    format!("*{inner}")
                };
                to.declare_inner(star.trim_end().to_string(), *to_const)
            }
            CType::Array(of, len) => {
                let inner = if inner.starts_with('*') {
                    format!("({inner})")
                } else {
                    inner
                };
                of.declare_inner(format!("{inner}[{len}]"), konst)
            }
            CType::Function(ret, params) => {
                let inner = if inner.starts_with('*') {
                    format!("({inner})")
                } else {
                    inner
                };
                let params: Vec<String> = params.iter().map(|p| p.declare("")).collect();
                let params = if params.is_empty() {
                    "void".to_string()
                } else {
                    params.join(", ")
                };
                ret.declare_inner(format!("{inner}({params})"), false)
            }
        }
    }
}

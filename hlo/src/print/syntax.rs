//! How the pieces of an op's text are written: identifiers, strings, integer lists and
//! arrays, attributes and shardings.

use super::literals::float_text;
use crate::graph::*;
use crate::types::DType;

// The pieces of a module's text that the reader (`super::read`) finds things by: printed and
// read from these alone, so that the two cannot drift apart.

/// A top-level function's first line up to its parameters, and its last line.
pub(super) fn func_head(visibility: &str, name: &str) -> String {
    format!("  func.func {visibility} @{name}(")
}
pub(super) const FUNC_END: &str = "  }\n";
/// Between a function's parameters and its results.
pub(super) const FUNC_RESULTS: &str = ") -> (";
/// A composite call: `stablehlo.composite "NAME" %operands {composite_attributes = {ATTRS},
/// decomposition = @SYMBOL, version = N : i32} : (TYPES) -> TYPES`.
pub(super) const COMPOSITE_OP: &str = "stablehlo.composite ";
pub(super) const COMPOSITE_ATTRS: &str = "{composite_attributes = {";
pub(super) const COMPOSITE_DECOMPOSITION: &str = "}, decomposition = @";
pub(super) const COMPOSITE_VERSION: &str = ", version = ";
pub(super) const COMPOSITE_END: &str = " : i32} : (";
/// An attribute's name and value, and two attributes.
pub(super) const ATTR_IS: &str = " = ";
pub(super) const LIST_SEP: &str = ", ";
/// The types an i64 and an f32 attribute are written with.
pub(super) const I64_ATTR: &str = " : i64";
pub(super) const F32_ATTR: &str = " : f32";

/// Turn a human name into a legal MLIR identifier (letters, digits, `$._-`; not starting with
/// a digit).
pub(super) fn sanitize(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "$._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, 'v');
    }
    s
}

pub(super) fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub(super) fn attr_text(a: &Attr) -> String {
    match a {
        Attr::Int(v) => format!("{v}{I64_ATTR}"),
        Attr::Float(v) => format!("{}{F32_ATTR}", float_text(*v, DType::F32)),
        Attr::Str(v) => format!("\"{}\"", escape(v)),
    }
}

pub(super) fn i64_list(v: &[i64]) -> String {
    let parts: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

pub(super) fn i64_array(v: &[i64]) -> String {
    if v.is_empty() {
        return "array<i64>".into();
    }
    let parts: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    format!("array<i64: {}>", parts.join(", "))
}

pub(super) fn sharding_attr(s: &Sharding) -> String {
    let dims: Vec<String> = s
        .dims
        .iter()
        .map(|axes| {
            let a: Vec<String> = axes.iter().map(|x| format!("\"{x}\"")).collect();
            format!("{{{}}}", a.join(", "))
        })
        .collect();
    format!("<@mesh, [{}]>", dims.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitized() {
        assert_eq!(sanitize("layers.0.q_proj.lora_A"), "layers.0.q_proj.lora_A");
        assert_eq!(sanitize("0abc"), "v0abc");
        assert_eq!(sanitize("a b/c"), "a_b_c");
    }
}

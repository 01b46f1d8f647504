//! How the pieces of an op's text are written: identifiers, strings, integer lists and
//! arrays, attributes and shardings.

use super::literals::float_text;
use crate::graph::*;
use crate::types::DType;

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
        Attr::Int(v) => format!("{v} : i64"),
        Attr::Float(v) => format!("{} : f32", float_text(*v, DType::F32)),
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

//! `PJRT_NamedValue`: the typed key-value pairs PJRT uses for create options, device and topology
//! attributes and cost analyses, in both directions.

use crate::ffi::*;
use std::ffi::{c_char, CString};
use std::fmt;
use std::ptr::null_mut;

/// One value of a `PJRT_NamedValue`.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl Value {
    /// The value as a number, where it is one.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(v) => Some(*v as f64),
            Value::Float(v) => Some(*v as f64),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Str(s) => write!(f, "{s}"),
            Value::Int(v) => write!(f, "{v}"),
            Value::Ints(v) => {
                let parts: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                write!(f, "[{}]", parts.join(","))
            }
            Value::Float(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// Named values laid out for a call: the C array plus the strings and lists it points into, all
/// kept alive as long as this value.
pub(crate) struct NamedValues {
    values: Vec<PJRT_NamedValue>,
    _names: Vec<CString>,
    _strings: Vec<Vec<u8>>,
    _lists: Vec<Vec<i64>>,
}

impl NamedValues {
    pub(crate) fn new(options: &[(String, Value)]) -> NamedValues {
        let names: Vec<CString> = options
            .iter()
            .map(|(k, _)| CString::new(k.as_str()).unwrap_or_default())
            .collect();
        let strings: Vec<Vec<u8>> = options
            .iter()
            .map(|(_, v)| match v {
                Value::Str(s) => s.as_bytes().to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let lists: Vec<Vec<i64>> = options
            .iter()
            .map(|(_, v)| match v {
                Value::Ints(l) => l.clone(),
                _ => Vec::new(),
            })
            .collect();
        let values = options
            .iter()
            .enumerate()
            .map(|(i, (k, v))| {
                // The 8-byte union: a pointer, an int64, or a float / bool in its low bytes.
                let (type_, value, value_size) = match v {
                    Value::Str(s) => (NAMED_VALUE_STRING, strings[i].as_ptr() as u64, s.len()),
                    Value::Int(x) => (NAMED_VALUE_INT64, *x as u64, 1),
                    Value::Ints(l) => (NAMED_VALUE_INT64_LIST, lists[i].as_ptr() as u64, l.len()),
                    Value::Float(x) => (NAMED_VALUE_FLOAT, x.to_bits() as u64, 1),
                    Value::Bool(x) => (NAMED_VALUE_BOOL, *x as u64, 1),
                };
                PJRT_NamedValue {
                    struct_size: crate::struct_size!(PJRT_NamedValue, value_size),
                    extension_start: null_mut(),
                    name: names[i].as_ptr(),
                    name_size: k.len(),
                    type_,
                    value,
                    value_size,
                }
            })
            .collect();
        NamedValues {
            values,
            _names: names,
            _strings: strings,
            _lists: lists,
        }
    }

    pub(crate) fn as_ptr(&self) -> *const PJRT_NamedValue {
        self.values.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.values.len()
    }
}

/// Copy `n` named values a plugin returned into owned Rust values.
///
/// # Safety
/// `ptr` must point to `n` valid `PJRT_NamedValue`s (or be null with `n == 0`).
pub(crate) unsafe fn read(ptr: *const PJRT_NamedValue, n: usize) -> Vec<(String, Value)> {
    if ptr.is_null() || n == 0 {
        return Vec::new();
    }
    std::slice::from_raw_parts(ptr, n)
        .iter()
        .map(|nv| {
            let name = crate::str_from(nv.name, nv.name_size);
            let value = match nv.type_ {
                NAMED_VALUE_STRING => Value::Str(crate::str_from(
                    nv.value as usize as *const c_char,
                    nv.value_size,
                )),
                NAMED_VALUE_INT64 => Value::Int(nv.value as i64),
                NAMED_VALUE_INT64_LIST => {
                    let p = nv.value as usize as *const i64;
                    if p.is_null() {
                        Value::Ints(Vec::new())
                    } else {
                        Value::Ints(std::slice::from_raw_parts(p, nv.value_size).to_vec())
                    }
                }
                NAMED_VALUE_FLOAT => Value::Float(f32::from_bits(nv.value as u32)),
                NAMED_VALUE_BOOL => Value::Bool(nv.value as u8 != 0),
                other => Value::Str(format!("(unknown named value type {other})")),
            };
            (name, value)
        })
        .collect()
}

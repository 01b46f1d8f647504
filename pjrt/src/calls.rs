//! How the C API is called: the macros that look up an entry of the plugin's table (checking
//! that the table has it) and call it with its argument struct, and the conversions of strings
//! and programs across the boundary. Declared first in lib.rs, so every module may use the macros.

use crate::ffi::*;
use std::ffi::c_char;
use std::ptr::null_mut;

/// Look up an entry of the API table, checking that the plugin's table is long enough to have it.
macro_rules! api_fn {
    ($plugin:expr, $name:ident) => {{
        let p: &$crate::Plugin = $plugin;
        let api = unsafe { &*p.api };
        let end = std::mem::offset_of!($crate::ffi::PJRT_Api, $name)
            + std::mem::size_of::<$crate::ffi::ApiFn>();
        match (end <= api.struct_size).then_some(api.$name).flatten() {
            Some(f) => f,
            None => {
                return Err($crate::Error::Invalid(format!(
                    "PJRT plugin {} (API {}.{}) does not provide PJRT_{}",
                    p.path.display(),
                    p.version.0,
                    p.version.1,
                    stringify!($name)
                )))
            }
        }
    }};
}

/// Call an API entry with an argument struct whose `struct_size` is set by the caller.
macro_rules! call {
    ($plugin:expr, $name:ident, $args:expr) => {{
        let p: &$crate::Plugin = $plugin;
        let f = api_fn!(p, $name);
        let err = unsafe { f($args as *mut _ as *mut std::ffi::c_void) };
        p.check(concat!("PJRT_", stringify!($name)), err)
    }};
}

macro_rules! args {
    ($t:ident, $last:ident { $($field:ident : $value:expr),* $(,)? }) => {{
        // SAFETY: every PJRT argument struct is plain old data for which all-zero is valid.
        let mut a: $t = unsafe { std::mem::zeroed() };
        a.struct_size = $crate::struct_size!($t, $last);
        $(a.$field = $value;)*
        a
    }};
}

/// A `PJRT_Program` over StableHLO text (format `mlir`, which takes text or bytecode); valid as
/// long as `mlir`.
pub(crate) fn mlir_program(mlir: &str) -> PJRT_Program {
    const FORMAT: &[u8] = b"mlir";
    PJRT_Program {
        struct_size: crate::struct_size!(PJRT_Program, format_size),
        extension_start: null_mut(),
        code: mlir.as_ptr() as *mut c_char,
        code_size: mlir.len(),
        format: FORMAT.as_ptr() as *const c_char,
        format_size: FORMAT.len(),
    }
}

pub(crate) unsafe fn str_from(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() {
        return String::new();
    }
    let bytes = std::slice::from_raw_parts(ptr as *const u8, len);
    String::from_utf8_lossy(bytes).into_owned()
}

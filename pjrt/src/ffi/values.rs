//! Values that cross the boundary on their own: named values (create and compile options,
//! attributes) and the key-value store's callbacks.

use super::*;
use std::ffi::{c_char, c_int, c_void};

pub const NAMED_VALUE_STRING: c_int = 0;
pub const NAMED_VALUE_INT64: c_int = 1;
pub const NAMED_VALUE_INT64_LIST: c_int = 2;
pub const NAMED_VALUE_FLOAT: c_int = 3;
pub const NAMED_VALUE_BOOL: c_int = 4;

#[repr(C)]
pub struct PJRT_NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub name: *const c_char,
    pub name_size: usize,
    pub type_: c_int,
    /// Union of string pointer / int64 / int64 list pointer / float / bool; 8 bytes.
    pub value: u64,
    pub value_size: usize,
}

/// `PJRT_CallbackError`: made by the plugin, called by a callback to make the `PJRT_Error` it
/// returns (`message` is copied).
pub type PJRT_CallbackError = Option<
    unsafe extern "C" fn(code: c_int, message: *const c_char, size: usize) -> *mut PJRT_Error,
>;

/// Frees a value a key-value callback returned.
pub type PJRT_KeyValue_ValueDeleter = Option<unsafe extern "C" fn(value: *mut c_char)>;

#[repr(C)]
pub struct PJRT_KeyValueGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub timeout_in_ms: c_int,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: PJRT_KeyValue_ValueDeleter,
}

#[repr(C)]
pub struct PJRT_KeyValueTryGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: PJRT_KeyValue_ValueDeleter,
}

#[repr(C)]
pub struct PJRT_KeyValuePutCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub value: *const c_char,
    pub value_size: usize,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
}

pub type PJRT_KeyValueGetCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error;
pub type PJRT_KeyValueTryGetCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error;
pub type PJRT_KeyValuePutCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error;

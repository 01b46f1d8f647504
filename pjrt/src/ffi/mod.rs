//! Hand-written declarations for the subset of the PJRT C API (`pjrt_c_api.h`) that xtrain uses.
//!
//! Written against header version 0.81. Every argument struct starts with `struct_size` (set to the
//! size the header defines: offset of the last field plus its size) and `extension_start`; the plugin
//! checks `struct_size`, which is what lets one binary talk to older and newer plugins.
#![allow(non_snake_case, non_camel_case_types, dead_code)]

use std::ffi::c_void;

mod args;
mod table;
mod values;

pub use args::*;
pub use table::*;
pub use values::*;

/// The header version these declarations were written against.
pub const HEADER_MAJOR: i32 = 0;
pub const HEADER_MINOR: i32 = 81;

pub enum PJRT_Error {}
pub enum PJRT_Client {}
pub enum PJRT_Device {}
pub enum PJRT_DeviceDescription {}
pub enum PJRT_Buffer {}
pub enum PJRT_Event {}
pub enum PJRT_Executable {}
pub enum PJRT_LoadedExecutable {}
pub enum PJRT_SerializedExecutable {}
pub enum PJRT_TopologyDescription {}
pub enum PJRT_Memory {}

/// Every API entry takes one pointer to its argument struct and returns an error or null.
pub type ApiFn = Option<unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error>;

/// `PJRT_STRUCT_SIZE(T, last_field)`: the byte size a caller declares for an argument struct.
#[macro_export]
macro_rules! struct_size {
    ($t:ty, $last:ident) => {{
        let probe = std::mem::MaybeUninit::<$t>::uninit();
        let base = probe.as_ptr();
        // SAFETY: only the address of a field is taken, nothing is read.
        let field = unsafe { std::ptr::addr_of!((*base).$last) };
        fn size_of_pointee<T>(_: *const T) -> usize {
            std::mem::size_of::<T>()
        }
        std::mem::offset_of!($t, $last) + size_of_pointee(field)
    }};
}

//! Device buffers: what they hold, where they live, and copying them back to the host.

use crate::ffi::*;
use crate::{ClientInner, ElementType, Error, Event, HostTensor, Memory, Plugin, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// A device buffer. Destroyed on drop; a donated buffer reports [`Buffer::is_deleted`].
pub struct Buffer {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut PJRT_Buffer,
    /// Host memory the plugin uses as this buffer's (a zero-copy upload,
    /// [`crate::Client::to_device_owned`]), with the event that fires once the plugin is done
    /// with it: freed only then, after the buffer is destroyed.
    pub(crate) host: Option<(Vec<u8>, Event)>,
}

unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = args!(
            PJRT_Handle_Args,
            handle {
                handle: self.raw as *mut c_void
            }
        );
        let _ = (|| call!(&self.client.plugin, Buffer_Destroy, &mut a))();
        if let Some((bytes, done)) = self.host.take() {
            // The plugin may still read the memory until the work using the buffer ends; if
            // waiting fails the memory is leaked rather than freed under it.
            match done.wait() {
                Ok(()) => drop(bytes),
                Err(_) => std::mem::forget(bytes),
            }
        }
    }
}

impl Buffer {
    fn p(&self) -> &Plugin {
        &self.client.plugin
    }

    pub fn element_type(&self) -> Result<ElementType> {
        let mut a = args!(PJRT_Buffer_ElementType_Args, type_ { buffer: self.raw });
        call!(self.p(), Buffer_ElementType, &mut a)?;
        ElementType::from_pjrt_code(a.type_)
            .ok_or_else(|| Error::Invalid(format!("unsupported PJRT buffer type {}", a.type_)))
    }

    pub fn dims(&self) -> Result<Vec<i64>> {
        let mut a = args!(PJRT_Buffer_Dimensions_Args, num_dims { buffer: self.raw });
        call!(self.p(), Buffer_Dimensions, &mut a)?;
        Ok(unsafe { std::slice::from_raw_parts(a.dims, a.num_dims) }.to_vec())
    }

    /// The memory space this buffer lives in.
    pub fn memory(&self) -> Result<Memory> {
        let mut a = args!(PJRT_Buffer_Memory_Args, memory { buffer: self.raw });
        call!(self.p(), Buffer_Memory, &mut a)?;
        Ok(Memory {
            client: self.client.clone(),
            raw: a.memory,
        })
    }

    pub fn is_deleted(&self) -> Result<bool> {
        let mut a = args!(PJRT_Buffer_IsDeleted_Args, is_deleted { buffer: self.raw });
        call!(self.p(), Buffer_IsDeleted, &mut a)?;
        Ok(a.is_deleted)
    }

    /// Whether this buffer's memory is host memory handed over by a zero-copy upload.
    pub fn holds_host_memory(&self) -> bool {
        self.host.is_some()
    }

    /// The address of the buffer's memory on its device (for checks: on the CPU plugin, where a
    /// zero-copy upload put the buffer).
    pub fn device_pointer(&self) -> Result<usize> {
        let mut a = args!(
            PJRT_Buffer_UnsafePointer_Args,
            buffer_pointer { buffer: self.raw }
        );
        call!(self.p(), Buffer_UnsafePointer, &mut a)?;
        Ok(a.buffer_pointer)
    }

    pub fn on_device_bytes(&self) -> Result<usize> {
        let mut a = args!(
            PJRT_Handle_Word_Args,
            value {
                handle: self.raw as *mut c_void
            }
        );
        call!(self.p(), Buffer_OnDeviceSizeInBytes, &mut a)?;
        Ok(a.value as usize)
    }

    /// Copy the buffer to the host (waits for the copy).
    pub fn to_host(&self) -> Result<HostTensor> {
        let ty = self.element_type()?;
        let dims = self.dims()?;
        let n: i64 = dims.iter().product();
        let mut bytes = vec![0u8; ty.byte_size(n as usize)];
        let mut a = args!(
            PJRT_Buffer_ToHostBuffer_Args,
            event {
                src: self.raw,
                dst: bytes.as_mut_ptr() as *mut c_void,
                dst_size: bytes.len(),
            }
        );
        call!(self.p(), Buffer_ToHostBuffer, &mut a)?;
        if !a.event.is_null() {
            Event::new(self.client.clone(), a.event).wait()?;
        }
        Ok(HostTensor { ty, dims, bytes })
    }
}

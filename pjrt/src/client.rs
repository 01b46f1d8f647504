//! A client (the devices of one backend in this process) and its create options: compiling,
//! deserializing and uploading host tensors.

use crate::ffi::*;
use crate::{
    kv, mlir_program, str_from, AlignedHost, Buffer, CompileOptions, Device, ElementType, Error,
    Event, Executable, HostTensor, Memory, Plugin, Result, Value,
};
use std::ffi::{c_char, c_void};
use std::ptr::null_mut;
use std::sync::Arc;

/// Options for `PJRT_Client_Create`, e.g. `cpu_device_count` for the CPU plugin.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions {
    pub options: Vec<(String, Value)>,
}

impl ClientOptions {
    /// The CPU plugin's number of virtual devices (default 4).
    pub fn cpu_device_count(n: i64) -> Self {
        ClientOptions {
            options: vec![("cpu_device_count".into(), Value::Int(n))],
        }
    }

    /// The create options of one process of a run of `num_nodes` (the XLA GPU plugins' names:
    /// `num_nodes`, `node_id`), added to these.
    pub fn distributed(mut self, node_id: usize, num_nodes: usize) -> Self {
        self.options
            .push(("num_nodes".into(), Value::Int(num_nodes as i64)));
        self.options
            .push(("node_id".into(), Value::Int(node_id as i64)));
        self
    }

    /// The XLA GPU plugins' share of device memory for their allocator (their default is 0.75,
    /// which leaves a quarter of the GPU unused by a training step).
    pub fn gpu_memory_fraction(fraction: f32) -> Self {
        ClientOptions {
            options: vec![("memory_fraction".into(), Value::Float(fraction))],
        }
    }
}

pub(crate) struct ClientInner {
    pub(crate) plugin: Arc<Plugin>,
    pub(crate) raw: *mut PJRT_Client,
    /// The key-value store the plugin calls back into, dropped only after the client is
    /// destroyed (fields drop after `Drop::drop`).
    pub(crate) _store: Option<kv::Held>,
}

unsafe impl Send for ClientInner {}
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut a = args!(PJRT_Client_Destroy_Args, client { client: self.raw });
        let _ = (|| call!(&self.plugin, Client_Destroy, &mut a))();
    }
}

/// A PJRT client: the devices of one backend in this process. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl Client {
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.plugin
    }

    fn p(&self) -> &Plugin {
        &self.inner.plugin
    }

    pub fn platform_name(&self) -> Result<String> {
        let mut a = args!(
            PJRT_Client_PtrLen_Args,
            len {
                client: self.inner.raw
            }
        );
        call!(self.p(), Client_PlatformName, &mut a)?;
        Ok(unsafe { str_from(a.ptr as *const c_char, a.len) })
    }

    pub fn platform_version(&self) -> Result<String> {
        let mut a = args!(
            PJRT_Client_PtrLen_Args,
            len {
                client: self.inner.raw
            }
        );
        call!(self.p(), Client_PlatformVersion, &mut a)?;
        Ok(unsafe { str_from(a.ptr as *const c_char, a.len) })
    }

    /// The devices this process can address, in the plugin's order.
    pub fn devices(&self) -> Result<Vec<Device>> {
        let mut a = args!(
            PJRT_Client_PtrLen_Args,
            len {
                client: self.inner.raw
            }
        );
        call!(self.p(), Client_AddressableDevices, &mut a)?;
        Ok(self.device_list(&a))
    }

    /// Every device of the client, this process's and (in a client spanning several processes)
    /// the other processes', in the plugin's order.
    pub fn global_devices(&self) -> Result<Vec<Device>> {
        let mut a = args!(
            PJRT_Client_PtrLen_Args,
            len {
                client: self.inner.raw
            }
        );
        call!(self.p(), Client_Devices, &mut a)?;
        Ok(self.device_list(&a))
    }

    /// The devices a devices call returned (`ptr`, `len`: an array the client owns).
    fn device_list(&self, a: &PJRT_Client_PtrLen_Args) -> Vec<Device> {
        let raws = unsafe { std::slice::from_raw_parts(a.ptr as *const *mut PJRT_Device, a.len) };
        raws.iter()
            .map(|&raw| Device {
                client: self.inner.clone(),
                raw,
            })
            .collect()
    }

    /// Compile StableHLO (or MHLO) text. Errors carry XLA's diagnostic.
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<Executable> {
        let program = mlir_program(mlir);
        let opts = options.to_bytes();
        let mut a = args!(
            PJRT_Client_Compile_Args,
            executable {
                client: self.inner.raw,
                program: &program,
                compile_options: opts.as_ptr() as *const c_char,
                compile_options_size: opts.len(),
            }
        );
        call!(self.p(), Client_Compile, &mut a)?;
        Ok(Executable {
            client: self.inner.clone(),
            raw: a.executable,
            inputs: None,
        })
    }

    /// Load an executable serialized by [`Executable::serialize`] with the same plugin version.
    pub fn deserialize(&self, bytes: &[u8]) -> Result<Executable> {
        let mut a = args!(
            PJRT_Executable_DeserializeAndLoad_Args,
            overridden_serialized_compile_options_size {
                client: self.inner.raw,
                serialized_executable: bytes.as_ptr() as *const c_char,
                serialized_executable_size: bytes.len(),
            }
        );
        call!(self.p(), Executable_DeserializeAndLoad, &mut a)?;
        Ok(Executable {
            client: self.inner.clone(),
            raw: a.loaded_executable,
            inputs: None,
        })
    }

    /// Copy a host tensor to `device`. The host data may be freed when this returns.
    pub fn to_device(&self, host: &HostTensor, device: &Device) -> Result<Buffer> {
        self.upload_copy(host.ty, &host.dims, &host.bytes, device.raw, null_mut())
    }

    /// Copy a host tensor into a memory space (e.g. a device's `pinned_host` memory).
    pub fn to_memory(&self, host: &HostTensor, memory: &Memory) -> Result<Buffer> {
        self.upload_copy(host.ty, &host.dims, &host.bytes, null_mut(), memory.raw)
    }

    /// Copy an aligned host tensor to `device` (one another device also takes).
    pub fn to_device_copy(&self, host: &AlignedHost, device: &Device) -> Result<Buffer> {
        self.upload_copy(host.ty, &host.dims, host.data(), device.raw, null_mut())
    }

    /// Move a host tensor to `device`, letting the plugin use its memory as the buffer's own
    /// (PJRT's zero-copy host buffers) where it can: the CPU plugin does for memory aligned as
    /// its code needs ([`crate::HOST_ALIGN`]) in row-major layout. Where the plugin copies
    /// instead, the host memory is freed now. Returns the buffer and whether it kept the host
    /// memory. A buffer made this way must not be donated to an execution.
    pub fn to_device_owned(&self, host: AlignedHost, device: &Device) -> Result<(Buffer, bool)> {
        let (mut buffer, done) = self.upload(
            (host.ty, &host.dims, host.data()),
            device.raw,
            null_mut(),
            HOST_BUFFER_IMMUTABLE_ZERO_COPY,
        )?;
        let Some(done) = done else {
            return Ok((buffer, false));
        };
        // Aliased when the buffer's memory is the host memory; else the plugin copied it (maybe
        // still copying: waiting for the event says when the memory may go).
        let aliased = match buffer.device_pointer() {
            Ok(p) => p == host.data().as_ptr() as usize,
            Err(_) => !done.is_ready()?,
        };
        if !aliased {
            done.wait()?;
            return Ok((buffer, false));
        }
        buffer.host = Some((host.into_memory(), done));
        Ok((buffer, true))
    }

    /// `PJRT_Client_BufferFromHostBuffer` of the tensor (`ty`, `dims`, `data`) with
    /// `semantics`: the buffer, and the event that fires once the plugin is done with the host
    /// memory (None: done already).
    fn upload(
        &self,
        (ty, dims, data): (ElementType, &[i64], &[u8]),
        device: *mut PJRT_Device,
        memory: *mut PJRT_Memory,
        semantics: std::ffi::c_int,
    ) -> Result<(Buffer, Option<Event>)> {
        let expected = ty.byte_size(dims.iter().product::<i64>().max(0) as usize);
        if data.len() != expected {
            return Err(Error::Invalid(format!(
                "host tensor {ty:?} {dims:?} needs {expected} bytes but has {}",
                data.len()
            )));
        }
        let mut a = args!(
            PJRT_Client_BufferFromHostBuffer_Args,
            buffer {
                client: self.inner.raw,
                data: data.as_ptr() as *const c_void,
                type_: ty.pjrt_code(),
                dims: dims.as_ptr(),
                num_dims: dims.len(),
                host_buffer_semantics: semantics,
                device: device,
                memory: memory as *mut c_void,
            }
        );
        call!(self.p(), Client_BufferFromHostBuffer, &mut a)?;
        let buffer = Buffer {
            client: self.inner.clone(),
            raw: a.buffer,
            host: None,
        };
        let done = (!a.done_with_host_buffer.is_null())
            .then(|| Event::new(self.inner.clone(), a.done_with_host_buffer));
        Ok((buffer, done))
    }

    /// [`Client::upload`] of memory the caller frees when this returns.
    fn upload_copy(
        &self,
        ty: ElementType,
        dims: &[i64],
        data: &[u8],
        device: *mut PJRT_Device,
        memory: *mut PJRT_Memory,
    ) -> Result<Buffer> {
        let (buffer, done) = self.upload(
            (ty, dims, data),
            device,
            memory,
            HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL,
        )?;
        if let Some(done) = done {
            done.wait()?;
        }
        Ok(buffer)
    }
}

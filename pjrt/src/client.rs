//! A client (the devices of one backend in this process) and its create options: compiling,
//! deserializing and uploading host tensors.

use crate::ffi::*;
use crate::{
    kv, mlir_program, str_from, Buffer, CompileOptions, Device, Error, Event, Executable,
    HostTensor, Memory, Plugin, Result, Value,
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
        self.upload(host, device.raw, null_mut())
    }

    /// Copy a host tensor into a memory space (e.g. a device's `pinned_host` memory).
    pub fn to_memory(&self, host: &HostTensor, memory: &Memory) -> Result<Buffer> {
        self.upload(host, null_mut(), memory.raw)
    }

    fn upload(
        &self,
        host: &HostTensor,
        device: *mut PJRT_Device,
        memory: *mut PJRT_Memory,
    ) -> Result<Buffer> {
        let expected = host.ty.byte_size(host.element_count());
        if host.bytes.len() != expected {
            return Err(Error::Invalid(format!(
                "host tensor {:?} {:?} needs {expected} bytes but has {}",
                host.ty,
                host.dims,
                host.bytes.len()
            )));
        }
        let mut a = args!(
            PJRT_Client_BufferFromHostBuffer_Args,
            buffer {
                client: self.inner.raw,
                data: host.bytes.as_ptr() as *const c_void,
                type_: host.ty.pjrt_code(),
                dims: host.dims.as_ptr(),
                num_dims: host.dims.len(),
                host_buffer_semantics: HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL,
                device: device,
                memory: memory as *mut c_void,
            }
        );
        call!(self.p(), Client_BufferFromHostBuffer, &mut a)?;
        let buffer = Buffer {
            client: self.inner.clone(),
            raw: a.buffer,
        };
        if !a.done_with_host_buffer.is_null() {
            Event::new(self.inner.clone(), a.done_with_host_buffer).wait()?;
        }
        Ok(buffer)
    }
}

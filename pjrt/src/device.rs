//! A device of a client and the memory spaces it can address.

use crate::ffi::*;
use crate::{str_from, ClientInner, Plugin, Result};
use std::sync::Arc;

/// A device of a client, with what the plugin says about it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub id: i32,
    pub kind: String,
    pub description: String,
    /// Memory limit in bytes where the plugin reports it (GPUs do; the CPU plugin does not).
    pub memory_bytes: Option<i64>,
}

/// A device handle; valid as long as its client.
#[derive(Clone)]
pub struct Device {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut PJRT_Device,
}

unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    fn p(&self) -> &Plugin {
        &self.client.plugin
    }

    pub fn info(&self) -> Result<DeviceInfo> {
        let mut g = args!(
            PJRT_Device_GetDescription_Args,
            device_description { device: self.raw }
        );
        call!(self.p(), Device_GetDescription, &mut g)?;
        let desc = self.p().describe(g.device_description)?;
        let mut stats = args!(
            PJRT_Device_MemoryStats_Args,
            peak_pool_bytes_is_set { device: self.raw }
        );
        let memory_bytes = match call!(self.p(), Device_MemoryStats, &mut stats) {
            Ok(()) if stats.bytes_limit_is_set => Some(stats.bytes_limit),
            _ => None,
        };
        Ok(DeviceInfo {
            id: desc.id,
            kind: desc.kind,
            description: desc.description,
            memory_bytes,
        })
    }

    pub fn id(&self) -> Result<i32> {
        Ok(self.info()?.id)
    }

    /// The memories this device can address (device memory, and on plugins that have them host
    /// memory spaces such as `pinned_host` and `unpinned_host`).
    pub fn memories(&self) -> Result<Vec<Memory>> {
        let mut a = args!(
            PJRT_Device_AddressableMemories_Args,
            num_memories { device: self.raw }
        );
        call!(self.p(), Device_AddressableMemories, &mut a)?;
        if a.memories.is_null() {
            return Ok(Vec::new());
        }
        let raws = unsafe { std::slice::from_raw_parts(a.memories, a.num_memories) };
        Ok(raws
            .iter()
            .map(|&raw| Memory {
                client: self.client.clone(),
                raw,
            })
            .collect())
    }

    /// The memory this device's buffers live in unless told otherwise.
    pub fn default_memory(&self) -> Result<Memory> {
        let mut a = args!(PJRT_Device_DefaultMemory_Args, memory { device: self.raw });
        call!(self.p(), Device_DefaultMemory, &mut a)?;
        Ok(Memory {
            client: self.client.clone(),
            raw: a.memory,
        })
    }
}

/// A memory space of a device (its own memory, or host memory it can address).
#[derive(Clone)]
pub struct Memory {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut PJRT_Memory,
}

unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    /// The memory's kind, as XLA's memory-kind annotations name it: `device`, `pinned_host`,
    /// `unpinned_host`, ...
    pub fn kind(&self) -> Result<String> {
        let mut a = args!(PJRT_Memory_Kind_Args, kind_size { memory: self.raw });
        call!(&self.client.plugin, Memory_Kind, &mut a)?;
        Ok(unsafe { str_from(a.kind, a.kind_size) })
    }
}

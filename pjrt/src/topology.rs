//! Compiling for hardware that is not here: a topology description stands in for the devices,
//! and `PJRT_Compile` compiles on it with no client. libtpu does this for any TPU slice; the CUDA
//! and ROCm plugins do it for a GPU described by a target config.

use crate::ffi::*;
use crate::named::{self, NamedValues, Value};
use crate::{str_from, struct_size, CompileOptions, Error, Plugin, Result};
use std::ffi::{c_char, c_void};
use std::ptr::null_mut;
use std::sync::Arc;

/// A description of devices the plugin can compile for, whether or not they are present.
pub struct Topology {
    plugin: Arc<Plugin>,
    raw: *mut PJRT_TopologyDescription,
}

// SAFETY: a topology description is immutable once created; PJRT calls on it are thread-safe.
unsafe impl Send for Topology {}
unsafe impl Sync for Topology {}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut a = args!(
            PJRT_TopologyDescription_Destroy_Args,
            topology { topology: self.raw }
        );
        let _ = (|| call!(&self.plugin, TopologyDescription_Destroy, &mut a))();
    }
}

/// One device of a topology (or of a client), as the plugin describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceDescription {
    pub id: i32,
    /// The host (process) this device belongs to.
    pub process_index: i32,
    pub kind: String,
    pub description: String,
    /// Platform-specific attributes (a TPU chip's `coords` and `core_on_chip`, a GPU's
    /// `compute_capability`, ...).
    pub attributes: Vec<(String, Value)>,
}

impl Plugin {
    /// Describe devices by the plugin's own topology name and create options (libtpu:
    /// `v5p:2x2x1`; the GPU plugins ignore the name and read `topology` and `target_config`).
    pub fn topology(self: &Arc<Self>, name: &str, options: &[(String, Value)]) -> Result<Topology> {
        let values = NamedValues::new(options);
        let mut a = args!(
            PJRT_TopologyDescription_Create_Args,
            topology {
                topology_name: name.as_ptr() as *const c_char,
                topology_name_size: name.len(),
                create_options: values.as_ptr(),
                num_options: values.len(),
            }
        );
        call!(self, TopologyDescription_Create, &mut a)?;
        if a.topology.is_null() {
            return Err(Error::Invalid(format!(
                "PJRT_TopologyDescription_Create returned no topology for '{name}'"
            )));
        }
        Ok(Topology {
            plugin: self.clone(),
            raw: a.topology,
        })
    }

    /// What the plugin says about one device description (shared by clients and topologies).
    pub(crate) fn describe(&self, desc: *mut PJRT_DeviceDescription) -> Result<DeviceDescription> {
        let mut id = args!(
            PJRT_DeviceDescription_Id_Args,
            id {
                device_description: desc
            }
        );
        call!(self, DeviceDescription_Id, &mut id)?;
        let mut process = args!(
            PJRT_DeviceDescription_ProcessIndex_Args,
            process_index {
                device_description: desc
            }
        );
        call!(self, DeviceDescription_ProcessIndex, &mut process)?;
        let mut kind = args!(
            PJRT_DeviceDescription_Str_Args,
            len {
                device_description: desc
            }
        );
        call!(self, DeviceDescription_Kind, &mut kind)?;
        let mut text = args!(
            PJRT_DeviceDescription_Str_Args,
            len {
                device_description: desc
            }
        );
        call!(self, DeviceDescription_ToString, &mut text)?;
        let mut attrs = args!(
            PJRT_DeviceDescription_Attributes_Args,
            attributes {
                device_description: desc
            }
        );
        call!(self, DeviceDescription_Attributes, &mut attrs)?;
        Ok(DeviceDescription {
            id: id.id,
            process_index: process.process_index,
            kind: unsafe { str_from(kind.ptr, kind.len) },
            description: unsafe { str_from(text.ptr, text.len) },
            attributes: unsafe { named::read(attrs.attributes, attrs.num_attributes) },
        })
    }
}

impl crate::Device {
    /// What the plugin says about this device, its process index included (which host of a
    /// run of several holds it; 0 in a client of one process).
    pub fn description(&self) -> Result<DeviceDescription> {
        let mut g = args!(
            PJRT_Device_GetDescription_Args,
            device_description { device: self.raw }
        );
        call!(&self.client.plugin, Device_GetDescription, &mut g)?;
        self.client.plugin.describe(g.device_description)
    }
}

impl Topology {
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    fn string(&self, platform_version: bool) -> Result<String> {
        let mut a = args!(
            PJRT_TopologyDescription_Str_Args,
            len { topology: self.raw }
        );
        if platform_version {
            call!(&self.plugin, TopologyDescription_PlatformVersion, &mut a)?;
        } else {
            call!(&self.plugin, TopologyDescription_PlatformName, &mut a)?;
        }
        Ok(unsafe { str_from(a.ptr, a.len) })
    }

    /// "tpu", "cuda", "rocm", ...
    pub fn platform_name(&self) -> Result<String> {
        self.string(false)
    }

    pub fn platform_version(&self) -> Result<String> {
        self.string(true)
    }

    /// Every device of the topology, on every host, in the plugin's order.
    pub fn devices(&self) -> Result<Vec<DeviceDescription>> {
        let mut a = args!(
            PJRT_TopologyDescription_GetDeviceDescriptions_Args,
            num_descriptions { topology: self.raw }
        );
        call!(
            &self.plugin,
            TopologyDescription_GetDeviceDescriptions,
            &mut a
        )?;
        if a.descriptions.is_null() {
            return Ok(Vec::new());
        }
        let raws = unsafe { std::slice::from_raw_parts(a.descriptions, a.num_descriptions) };
        raws.iter().map(|&d| self.plugin.describe(d)).collect()
    }

    /// Platform-specific attributes of the whole topology.
    pub fn attributes(&self) -> Result<Vec<(String, Value)>> {
        let mut a = args!(
            PJRT_TopologyDescription_Attributes_Args,
            num_attributes { topology: self.raw }
        );
        call!(&self.plugin, TopologyDescription_Attributes, &mut a)?;
        Ok(unsafe { named::read(a.attributes, a.num_attributes) })
    }

    /// Compile StableHLO text for these devices without a client: nothing is loaded or run, but
    /// the result has the compiler's memory figures, cost analysis, optimized program and a
    /// serialized form that a client on the real hardware can load.
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<UnloadedExecutable> {
        let program = crate::mlir_program(mlir);
        let opts = options.to_bytes();
        let mut a = args!(
            PJRT_Compile_Args,
            executable {
                topology: self.raw,
                program: &program,
                compile_options: opts.as_ptr() as *const c_char,
                compile_options_size: opts.len(),
                client: null_mut(),
            }
        );
        call!(&self.plugin, Compile, &mut a)?;
        Ok(UnloadedExecutable {
            plugin: self.plugin.clone(),
            raw: a.executable,
        })
    }
}

/// XLA's compiled memory figures for one device, in bytes. Fields named `host_*` are what the
/// program keeps in host memory (offloaded arguments and temporaries), where the plugin has
/// memory spaces for it; the others are device memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub argument_bytes: i64,
    pub output_bytes: i64,
    /// Output bytes that reuse (alias) donated argument buffers.
    pub alias_bytes: i64,
    pub temp_bytes: i64,
    pub generated_code_bytes: i64,
    /// Peak device memory where the plugin computes it (0 otherwise).
    pub peak_bytes: i64,
    pub host_argument_bytes: i64,
    pub host_output_bytes: i64,
    pub host_alias_bytes: i64,
    pub host_temp_bytes: i64,
    pub host_generated_code_bytes: i64,
}

impl MemoryStats {
    /// Arguments + outputs not aliased to arguments + temporaries: the device memory one step
    /// keeps live.
    pub fn total_bytes(&self) -> i64 {
        self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
    }

    /// The same sum over the host memory spaces.
    pub fn host_total_bytes(&self) -> i64 {
        self.host_argument_bytes + self.host_output_bytes - self.host_alias_bytes
            + self.host_temp_bytes
    }
}

/// A compiled program that is not loaded onto devices: what `PJRT_Compile` returns for a
/// topology, and what a loaded executable is built from.
pub struct UnloadedExecutable {
    plugin: Arc<Plugin>,
    pub(crate) raw: *mut PJRT_Executable,
}

unsafe impl Send for UnloadedExecutable {}
unsafe impl Sync for UnloadedExecutable {}

impl Drop for UnloadedExecutable {
    fn drop(&mut self) {
        let mut a = args!(
            PJRT_Handle_Args,
            handle {
                handle: self.raw as *mut c_void
            }
        );
        let _ = (|| call!(&self.plugin, Executable_Destroy, &mut a))();
    }
}

impl UnloadedExecutable {
    pub(crate) fn from_raw(plugin: Arc<Plugin>, raw: *mut PJRT_Executable) -> Self {
        UnloadedExecutable { plugin, raw }
    }

    /// Number of outputs per device.
    pub fn num_outputs(&self) -> Result<usize> {
        let mut a = args!(
            PJRT_Handle_Word_Args,
            value {
                handle: self.raw as *mut c_void
            }
        );
        call!(&self.plugin, Executable_NumOutputs, &mut a)?;
        Ok(a.value as usize)
    }

    /// XLA's memory figures for one device.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        let mut a = args!(
            PJRT_Executable_GetCompiledMemoryStats_Args,
            peak_memory_in_bytes {
                executable: self.raw,
            }
        );
        call!(&self.plugin, Executable_GetCompiledMemoryStats, &mut a)?;
        Ok(MemoryStats {
            argument_bytes: a.argument_size_in_bytes,
            output_bytes: a.output_size_in_bytes,
            alias_bytes: a.alias_size_in_bytes,
            temp_bytes: a.temp_size_in_bytes,
            generated_code_bytes: a.generated_code_size_in_bytes,
            peak_bytes: a.peak_memory_in_bytes,
            host_argument_bytes: a.host_argument_size_in_bytes,
            host_output_bytes: a.host_output_size_in_bytes,
            host_alias_bytes: a.host_alias_size_in_bytes,
            host_temp_bytes: a.host_temp_size_in_bytes,
            host_generated_code_bytes: a.host_generated_code_size_in_bytes,
        })
    }

    /// The compiler's cost analysis (TPU: `flops`, `bytes accessed`, `transcendentals`,
    /// `optimal_seconds`, ...). Plugins without one (CUDA, ROCm) return their error.
    pub fn cost_analysis(&self) -> Result<Vec<(String, Value)>> {
        let mut a = args!(
            PJRT_Executable_GetCostAnalysis_Args,
            properties {
                executable: self.raw,
            }
        );
        call!(&self.plugin, Executable_GetCostAnalysis, &mut a)?;
        Ok(unsafe { named::read(a.properties, a.num_properties) })
    }

    /// The optimized program as the plugin serializes it: (format, bytes), the format usually
    /// `hlo_with_config` (a binary `HloModuleProtoWithConfig`).
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        let mut program = PJRT_Program {
            struct_size: struct_size!(PJRT_Program, format_size),
            extension_start: null_mut(),
            code: null_mut(),
            code_size: 0,
            format: std::ptr::null(),
            format_size: 0,
        };
        let mut a = args!(
            PJRT_Executable_OptimizedProgram_Args,
            program {
                executable: self.raw,
                program: &mut program,
            }
        );
        call!(&self.plugin, Executable_OptimizedProgram, &mut a)?;
        let mut code = vec![0u8; program.code_size];
        program.code = code.as_mut_ptr() as *mut c_char;
        let mut a = args!(
            PJRT_Executable_OptimizedProgram_Args,
            program {
                executable: self.raw,
                program: &mut program,
            }
        );
        call!(&self.plugin, Executable_OptimizedProgram, &mut a)?;
        code.truncate(program.code_size);
        let format = unsafe { str_from(program.format, program.format_size) };
        Ok((format, code))
    }

    /// The plugin's serialized form, loadable with [`crate::Client::deserialize`] by the same
    /// plugin build on matching devices.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut a = args!(
            PJRT_Executable_Serialize_Args,
            serialized_executable_deleter {
                executable: self.raw,
            }
        );
        call!(&self.plugin, Executable_Serialize, &mut a)?;
        let bytes = unsafe {
            std::slice::from_raw_parts(a.serialized_bytes as *const u8, a.serialized_bytes_size)
        }
        .to_vec();
        if let Some(deleter) = a.serialized_executable_deleter {
            unsafe { deleter(a.serialized_executable) };
        }
        Ok(bytes)
    }
}

//! A safe Rust layer over the PJRT C API, the interface XLA's plugins (CPU, CUDA, ROCm, TPU) export.
//!
//! The plugin is a shared object loaded with `dlopen`; [`Plugin::load`] checks the API table size
//! and version before anything is called. Every PJRT object is owned by exactly one Rust value and
//! destroyed once, in `Drop`. Every `PJRT_Error` becomes an [`Error`] carrying the plugin's words.
//!
//! ```no_run
//! let plugin = pjrt::Plugin::load(std::path::Path::new("xla_cpu_pjrt.so"))?;
//! let client = plugin.client(&pjrt::ClientOptions::default())?;
//! let exe = client.compile("module { ... }", &pjrt::CompileOptions::default())?;
//! # Ok::<(), pjrt::Error>(())
//! ```

pub mod discover;
pub mod ffi;
mod host;
pub mod kv;
pub mod options;

pub use host::{ElementType, HostTensor};
pub use kv::{KeyValueStore, KvCode, KvError};
pub use named::Value;
pub use options::{CompileOptions, OptionValue};
pub use topology::{DeviceDescription, MemoryStats, Topology, UnloadedExecutable};

use ffi::*;
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, OnceLock};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot load PJRT plugin {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error(
        "PJRT plugin {path} speaks PJRT C API {plugin_major}.{plugin_minor}, but xtrain needs {needed} \
         (xtrain was written against {header_major}.{header_minor}); install a newer plugin"
    )]
    Version {
        path: PathBuf,
        plugin_major: i32,
        plugin_minor: i32,
        needed: String,
        header_major: i32,
        header_minor: i32,
    },
    #[error("{call} failed ({code}): {message}")]
    Plugin {
        call: &'static str,
        code: &'static str,
        message: String,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// A loaded plugin. Plugins are never unloaded (XLA does not survive `dlclose`), so loading the
/// same path twice returns the same plugin.
pub struct Plugin {
    api: *const PJRT_Api,
    path: PathBuf,
    version: (i32, i32),
    _lib: libloading::Library,
}

// SAFETY: the PJRT C API is thread-safe; the table is immutable after load.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

/// The oldest API minor version whose table has every entry xtrain calls.
/// (`PJRT_Executable_GetCompiledMemoryStats` arrived last among them.)
const MIN_MINOR: i32 = 40;

/// Look up an entry of the API table, checking that the plugin's table is long enough to have it.
macro_rules! api_fn {
    ($plugin:expr, $name:ident) => {{
        let p: &Plugin = $plugin;
        let api = unsafe { &*p.api };
        let end = std::mem::offset_of!(PJRT_Api, $name) + std::mem::size_of::<ApiFn>();
        match (end <= api.struct_size).then_some(api.$name).flatten() {
            Some(f) => f,
            None => {
                return Err(Error::Invalid(format!(
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
        let p: &Plugin = $plugin;
        let f = api_fn!(p, $name);
        let err = unsafe { f($args as *mut _ as *mut c_void) };
        p.check(concat!("PJRT_", stringify!($name)), err)
    }};
}

macro_rules! args {
    ($t:ident, $last:ident { $($field:ident : $value:expr),* $(,)? }) => {{
        // SAFETY: every PJRT argument struct is plain old data for which all-zero is valid.
        let mut a: $t = unsafe { std::mem::zeroed() };
        a.struct_size = struct_size!($t, $last);
        $(a.$field = $value;)*
        a
    }};
}

// After the macros, which they use.
mod named;
mod topology;

static LOADED: OnceLock<Mutex<HashMap<PathBuf, Arc<Plugin>>>> = OnceLock::new();

/// Silence XLA's C++ logging unless the user asked for it. Must run before the plugin is loaded.
pub fn set_verbose(verbose: bool) {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", if verbose { "0" } else { "3" });
    }
}

impl Plugin {
    pub fn load(path: &Path) -> Result<Arc<Plugin>> {
        let key = path.canonicalize().map_err(|e| Error::Load {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap();
        if let Some(p) = loaded.get(&key) {
            return Ok(p.clone());
        }
        set_verbose(false);
        let load_err = |message: String| Error::Load {
            path: key.clone(),
            message,
        };
        // SAFETY: loading a shared object runs its initialisers; that is the point of a plugin.
        let lib = unsafe { libloading::Library::new(&key) }.map_err(|e| load_err(e.to_string()))?;
        let get: libloading::Symbol<unsafe extern "C" fn() -> *const PJRT_Api> = unsafe {
            lib.get(b"GetPjrtApi\0")
        }
        .map_err(|_| load_err("not a PJRT plugin: it does not export GetPjrtApi".to_string()))?;
        let api = unsafe { get() };
        if api.is_null() {
            return Err(load_err("GetPjrtApi returned null".into()));
        }
        let (size, major, minor) = unsafe {
            (
                (*api).struct_size,
                (*api).pjrt_api_version.major_version,
                (*api).pjrt_api_version.minor_version,
            )
        };
        let version_err = || Error::Version {
            path: key.clone(),
            plugin_major: major,
            plugin_minor: minor,
            needed: format!("{HEADER_MAJOR}.{MIN_MINOR} or newer (same major version)"),
            header_major: HEADER_MAJOR,
            header_minor: HEADER_MINOR,
        };
        let min_size = std::mem::offset_of!(PJRT_Api, Executable_GetCompiledMemoryStats)
            + std::mem::size_of::<ApiFn>();
        if major != HEADER_MAJOR || minor < MIN_MINOR || size < min_size {
            return Err(version_err());
        }
        let plugin = Plugin {
            api,
            path: key.clone(),
            version: (major, minor),
            _lib: lib,
        };
        let mut a = args!(PJRT_Plugin_Initialize_Args, extension_start {});
        call!(&plugin, Plugin_Initialize, &mut a)?;
        let plugin = Arc::new(plugin);
        loaded.insert(key, plugin.clone());
        Ok(plugin)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The PJRT C API version the plugin implements, e.g. (0, 81).
    pub fn api_version(&self) -> (i32, i32) {
        self.version
    }

    /// Turn a returned `PJRT_Error*` into a Result, destroying the error.
    fn check(&self, call: &'static str, err: *mut PJRT_Error) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let api = unsafe { &*self.api };
        let mut m = args!(PJRT_Error_Message_Args, message_size { error: err });
        let mut message = String::from("(no message)");
        if let Some(f) = api.Error_Message {
            unsafe { f(&mut m as *mut _ as *mut c_void) };
            message = unsafe { str_from(m.message, m.message_size) };
        }
        let mut c = args!(PJRT_Error_GetCode_Args, code { error: err });
        let code = match api.Error_GetCode {
            Some(f) if unsafe { f(&mut c as *mut _ as *mut c_void) }.is_null() => c.code,
            _ => 2,
        };
        let mut d = args!(PJRT_Error_Destroy_Args, error { error: err });
        if let Some(f) = api.Error_Destroy {
            unsafe { f(&mut d as *mut _ as *mut c_void) };
        }
        Err(Error::Plugin {
            call,
            code: error_code_name(code),
            message,
        })
    }

    /// Create a client. Each client owns its devices; most programs want one per process.
    pub fn client(self: &Arc<Self>, options: &ClientOptions) -> Result<Client> {
        self.create_client(options, None)
    }

    /// Create a client of a run of several processes: the plugin exchanges what its processes
    /// must share (topology, NCCL/RCCL ids) through `store`, which the client keeps alive. Give
    /// `options` the run's `num_nodes` and this process's `node_id`
    /// ([`ClientOptions::distributed`]).
    pub fn client_with_store(
        self: &Arc<Self>,
        options: &ClientOptions,
        store: Arc<dyn KeyValueStore>,
    ) -> Result<Client> {
        self.create_client(options, Some(Box::new(store)))
    }

    fn create_client(
        self: &Arc<Self>,
        options: &ClientOptions,
        store: Option<kv::Held>,
    ) -> Result<Client> {
        let values = named::NamedValues::new(&options.options);
        let mut a = args!(
            PJRT_Client_Create_Args,
            kv_try_get_user_arg {
                create_options: values.as_ptr(),
                num_options: values.len(),
            }
        );
        if let Some(held) = &store {
            // All three: the XLA GPU client ignores a store without try_get.
            let arg = kv::user_arg(held);
            a.kv_get_callback = kv::kv_get as *mut c_void;
            a.kv_get_user_arg = arg;
            a.kv_try_get_callback = kv::kv_try_get as *mut c_void;
            a.kv_try_get_user_arg = arg;
            a.kv_put_callback = kv::kv_put as *mut c_void;
            a.kv_put_user_arg = arg;
        }
        call!(self, Client_Create, &mut a)?;
        let inner = Arc::new(ClientInner {
            plugin: self.clone(),
            raw: a.client,
            _store: store,
        });
        Ok(Client { inner })
    }
}

fn error_code_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    NAMES.get(code as usize).copied().unwrap_or("UNKNOWN")
}

/// A `PJRT_Program` over StableHLO text (format `mlir`, which takes text or bytecode); valid as
/// long as `mlir`.
pub(crate) fn mlir_program(mlir: &str) -> PJRT_Program {
    const FORMAT: &[u8] = b"mlir";
    PJRT_Program {
        struct_size: struct_size!(PJRT_Program, format_size),
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

struct ClientInner {
    plugin: Arc<Plugin>,
    raw: *mut PJRT_Client,
    /// The key-value store the plugin calls back into, dropped only after the client is
    /// destroyed (fields drop after `Drop::drop`).
    _store: Option<kv::Held>,
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
    inner: Arc<ClientInner>,
}

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
    client: Arc<ClientInner>,
    raw: *mut PJRT_Device,
}

unsafe impl Send for Device {}
unsafe impl Sync for Device {}

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
    client: Arc<ClientInner>,
    raw: *mut PJRT_Memory,
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

/// A completion event; waiting returns the error of the work it tracks.
struct Event {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Event,
}

impl Event {
    fn new(client: Arc<ClientInner>, raw: *mut PJRT_Event) -> Self {
        Event { client, raw }
    }

    fn wait(self) -> Result<()> {
        let mut a = args!(PJRT_Event_Args, event { event: self.raw });
        call!(&self.client.plugin, Event_Await, &mut a)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let mut a = args!(PJRT_Event_Args, event { event: self.raw });
        let _ = (|| call!(&self.client.plugin, Event_Destroy, &mut a))();
    }
}

/// A device buffer. Destroyed on drop; a donated buffer reports [`Buffer::is_deleted`].
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Buffer,
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

/// A compiled, loaded program.
pub struct Executable {
    client: Arc<ClientInner>,
    raw: *mut PJRT_LoadedExecutable,
    /// Per-device argument types and dims, checked before each execute when known. Plugins do
    /// not all check them (the CPU plugin runs a [6] buffer where [3,2] was compiled).
    inputs: Option<Vec<(ElementType, Vec<i64>)>>,
}

unsafe impl Send for Executable {}
unsafe impl Sync for Executable {}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a = args!(
            PJRT_Handle_Args,
            handle {
                handle: self.raw as *mut c_void
            }
        );
        let _ = (|| call!(&self.client.plugin, LoadedExecutable_Destroy, &mut a))();
    }
}

impl Executable {
    fn p(&self) -> &Plugin {
        &self.client.plugin
    }

    /// The unloaded executable behind this one (a new handle, destroyed when dropped): its
    /// memory figures, cost analysis, optimized program and serialized form.
    pub fn unloaded(&self) -> Result<UnloadedExecutable> {
        let mut a = args!(
            PJRT_LoadedExecutable_GetExecutable_Args,
            executable {
                loaded_executable: self.raw,
            }
        );
        call!(self.p(), LoadedExecutable_GetExecutable, &mut a)?;
        Ok(UnloadedExecutable::from_raw(
            self.client.plugin.clone(),
            a.executable,
        ))
    }

    /// Declare the per-device argument types and dims; [`Executable::execute`] then rejects
    /// arguments that do not match, naming the argument.
    pub fn expect_inputs(&mut self, inputs: Vec<(ElementType, Vec<i64>)>) {
        self.inputs = Some(inputs);
    }

    fn check_inputs(&self, args: &[Vec<&Buffer>]) -> Result<()> {
        let Some(expected) = &self.inputs else {
            return Ok(());
        };
        for (d, list) in args.iter().enumerate() {
            if list.len() != expected.len() {
                return Err(Error::Invalid(format!(
                    "execute: the program takes {} arguments, device {d} was given {}",
                    expected.len(),
                    list.len()
                )));
            }
            for (i, (buf, (ty, dims))) in list.iter().zip(expected).enumerate() {
                let (got_ty, got_dims) = (buf.element_type()?, buf.dims()?);
                if got_ty != *ty || got_dims != *dims {
                    return Err(Error::Invalid(format!(
                        "execute: argument {i} on device {d} should be {ty:?}{dims:?} but is {got_ty:?}{got_dims:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Number of outputs per device.
    pub fn num_outputs(&self) -> Result<usize> {
        self.unloaded()?.num_outputs()
    }

    /// XLA's memory figures for one device of this executable.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        self.unloaded()?.memory_stats()
    }

    /// The plugin's serialized form, loadable with [`Client::deserialize`] by the same plugin build.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        self.unloaded()?.serialize()
    }

    /// Run on every device the program was compiled for. `args[d]` are device d's arguments, in
    /// the program's argument order. Returns each device's outputs. Donated arguments are deleted.
    pub fn execute(&self, args: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        let num_devices = args.len();
        if num_devices == 0 {
            return Err(Error::Invalid("execute needs at least one device".into()));
        }
        let num_args = args[0].len();
        if let Some((d, list)) = args.iter().enumerate().find(|(_, l)| l.len() != num_args) {
            return Err(Error::Invalid(format!(
                "execute: device 0 has {num_args} arguments but device {d} has {}",
                list.len()
            )));
        }
        self.check_inputs(args)?;
        let num_outputs = self.num_outputs()?;
        let arg_ptrs: Vec<Vec<*mut PJRT_Buffer>> = args
            .iter()
            .map(|l| l.iter().map(|b| b.raw).collect())
            .collect();
        let arg_lists: Vec<*const *mut PJRT_Buffer> = arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut out_ptrs: Vec<Vec<*mut PJRT_Buffer>> = (0..num_devices)
            .map(|_| vec![null_mut(); num_outputs])
            .collect();
        let out_lists: Vec<*mut *mut PJRT_Buffer> =
            out_ptrs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: Vec<*mut PJRT_Event> = vec![null_mut(); num_devices];
        let mut options = args!(PJRT_ExecuteOptions, incarnation_ids {});
        let mut a = args!(
            PJRT_LoadedExecutable_Execute_Args,
            execute_device {
                executable: self.raw,
                options: &mut options,
                argument_lists: arg_lists.as_ptr(),
                num_devices: num_devices,
                num_args: num_args,
                output_lists: out_lists.as_ptr(),
                device_complete_events: events.as_mut_ptr(),
            }
        );
        call!(self.p(), LoadedExecutable_Execute, &mut a)?;
        // Own the outputs first, so that they are destroyed even if an event reports an error.
        let outputs: Vec<Vec<Buffer>> = out_ptrs
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .map(|raw| Buffer {
                        client: self.client.clone(),
                        raw,
                    })
                    .collect()
            })
            .collect();
        let mut first_err = None;
        for e in events {
            if !e.is_null() {
                if let Err(err) = Event::new(self.client.clone(), e).wait() {
                    first_err.get_or_insert(err);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(outputs),
        }
    }
}

//! A loaded plugin: `dlopen`, the API version check, initialisation, and creating clients.

use crate::error::error_code_name;
use crate::ffi::*;
use crate::{
    kv, named, str_from, Client, ClientInner, ClientOptions, Error, KeyValueStore, Result,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// A loaded plugin. Plugins are never unloaded (XLA does not survive `dlclose`), so loading the
/// same path twice returns the same plugin.
pub struct Plugin {
    pub(crate) api: *const PJRT_Api,
    pub(crate) path: PathBuf,
    pub(crate) version: (i32, i32),
    _lib: libloading::Library,
}

// SAFETY: the PJRT C API is thread-safe; the table is immutable after load.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

/// The oldest API minor version whose table has every entry xtrain calls.
/// (`PJRT_Executable_GetCompiledMemoryStats` arrived last among them.)
const MIN_MINOR: i32 = 40;

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
    pub(crate) fn check(&self, call: &'static str, err: *mut PJRT_Error) -> Result<()> {
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

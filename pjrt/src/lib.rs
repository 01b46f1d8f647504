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

// First, so that every module below may use its macros (`api_fn!`, `call!`, `args!`).
#[macro_use]
mod calls;

mod aligned;
mod buffer;
mod client;
mod device;
pub mod discover;
mod error;
mod event;
mod executable;
pub mod ffi;
mod host;
pub mod kv;
mod named;
pub mod once;
pub mod options;
mod plugin;
mod topology;

pub use aligned::{AlignedHost, HOST_ALIGN};
pub use buffer::Buffer;
pub use client::{Client, ClientOptions};
pub use device::{Device, DeviceInfo, Memory};
pub use error::{Error, Result};
pub use executable::Executable;
pub use host::{ElementType, HostTensor};
pub use kv::{KeyValueStore, KvCode, KvError};
pub use named::Value;
pub use options::{CompileOptions, OptionValue};
pub use plugin::{set_verbose, Plugin};
pub use topology::{DeviceDescription, MemoryStats, Topology, UnloadedExecutable};

pub(crate) use calls::{mlir_program, str_from};
pub(crate) use client::ClientInner;
pub(crate) use event::Event;

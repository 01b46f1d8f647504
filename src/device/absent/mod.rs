//! Hardware that is not here: compile targets named on the command line (`tpu:v5p:2x2x1`,
//! `cuda:h100:8`), which need not be present, and compiling for them with no client.
//!
//! - `parse`: `--target` read into a [`Target`]: the plugin to load and the topology to create
//!   on it (the program itself does not know targets exist);
//! - `builtin`: the TPU generations and GPU descriptions known by name, a table
//!   (`builtin.toml`), and each GPU as the GpuTargetConfigProto text its plugin takes;
//! - `config_file` (with `text_proto`): a GPU described in a `--target-config` file, checked
//!   before a plugin sees it;
//! - [`aot`]: the target's plugin and topology, compiling for them ([`aot::TargetDevices`]).

pub mod aot;
mod builtin;
mod config_file;
mod parse;
mod text_proto;

pub use builtin::{gpus, tpus, GpuArch, GpuModel, TpuGeneration};
pub use parse::{known_targets, Target};

/// The platforms a target can name, each compiled by its own PJRT plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    Tpu,
    Cuda,
    Rocm,
}

impl Platform {
    /// The plugin name `pjrt::discover` knows it by.
    pub fn plugin(self) -> &'static str {
        match self {
            Platform::Tpu => "tpu",
            Platform::Cuda => "cuda",
            Platform::Rocm => "rocm",
        }
    }
}

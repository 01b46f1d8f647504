//! What `xtrain compile` is asked to do ([`CompileOptions`]), and where one compile is writing
//! ([`Writing`]).

use crate::model::config::LlamaConfig;
use crate::program::StepOptions;
use std::path::{Path, PathBuf};

/// Options of `xtrain compile`: the step and its shapes, the program dir, and what `--check`
/// compiles it for. The binary makes them from its flags (`cli::compile`).
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// The model's config (from `--model`: a directory, a preset or a repo id).
    pub model: LlamaConfig,
    /// Rows per step (all microbatches together) and tokens per row.
    pub batch: i64,
    pub seq: i64,
    /// The step's flags.
    pub step: StepOptions,
    /// `--mesh` as typed, for messages (None: not given).
    pub mesh_flag: Option<String>,
    /// The sharding rules a mesh taken from the targets' device count is placed by.
    pub rules: crate::program::sharding::Rules,
    /// The program dir to write, new or empty unless `overwrite`.
    pub out: PathBuf,
    pub overwrite: bool,
    /// What the command reads, which `out` may not be or hold.
    pub inputs: Vec<PathBuf>,
    /// Also compile the program (with this machine's plugin, or for `targets`).
    pub check: bool,
    /// With `check`: the kernels (`--kernel`) to compile in place of the composites they
    /// implement.
    pub kernels: Vec<String>,
    /// With `check`: write XLA's optimized HLO here.
    pub xla_dump: Option<PathBuf>,
    /// With `check` and no target: the plugin to compile with; with targets: their plugin file.
    pub plugin: Option<String>,
    /// `--target`s, as given (`tpu:v5p:2x2x1`), and the GPU description file of one GPU target.
    pub targets: Vec<String>,
    pub target_config: Option<PathBuf>,
    /// With `check` for a TPU: skip the whole-step estimate.
    pub no_estimate: bool,
    pub verbose: bool,
}

/// One compile under way: its options, the checked `--out` and the staging dir it writes into.
pub struct Writing<'a> {
    pub o: &'a CompileOptions,
    /// Where the program dir will be once complete: the name messages use.
    pub out: PathBuf,
    /// Where it is written meanwhile (beside `out`, moved there once complete).
    pub dir: PathBuf,
}

impl Writing<'_> {
    /// The dir the program and its builds are written to now.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

//! What `xtrain train` is asked to do.

use crate::data::DataOptions;
use crate::program::StepOptions;
use std::path::PathBuf;

/// Options of `xtrain train`.
pub struct TrainOptions {
    pub model: PathBuf,
    /// The data, how it is made into rows and batches, and what is held out for evaluation.
    pub data: DataOptions,
    /// The step: LoRA, AdamW, numerics, remat, accumulation, mesh.
    pub step: StepOptions,
    pub init_adapter: Option<PathBuf>,
    /// Optimizer steps; 0 = as many as `epochs` take.
    pub steps: u64,
    pub epochs: u64,
    pub lr: f64,
    pub warmup: u64,
    pub schedule: String,
    pub min_lr_ratio: f64,
    /// A program dir from `xtrain compile` to run instead of building the step.
    pub program: Option<PathBuf>,
    pub use_cache: bool,
    pub eval_every: u64,
    pub save_every: u64,
    pub resume: Option<PathBuf>,
    pub out: PathBuf,
    pub seed: u64,
    pub plugin: Option<String>,
    pub verbose: bool,
    pub log_every: u64,
    pub plot: bool,
    /// Stop this invocation after this many steps.
    pub stop_after: Option<u64>,
    /// On a non-finite loss or gradient: stop (false) or skip the step and go on (true).
    pub skip_nonfinite: bool,
}

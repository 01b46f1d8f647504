//! What `xtrain train` is asked to do.

use crate::model::lora::LoraConfig;
use crate::model::optim::AdamW;
use std::path::PathBuf;

/// Options of `xtrain train`.
pub struct TrainOptions {
    pub model: PathBuf,
    /// `.safetensors` (one pre-tokenized batch used for every step) or `.jsonl` (text data).
    pub data: PathBuf,
    pub init_adapter: Option<PathBuf>,
    /// Optimizer steps; 0 = as many as `epochs` take.
    pub steps: u64,
    pub epochs: u64,
    pub lr: f64,
    pub warmup: u64,
    pub schedule: String,
    pub min_lr_ratio: f64,
    pub adam: AdamW,
    pub lora: LoraConfig,
    /// "f32" or "bf16".
    pub dtype: String,
    pub remat: crate::program::Remat,
    pub microbatches: i64,
    /// A program dir from `xtrain compile` to run instead of building the step.
    pub program: Option<PathBuf>,
    pub use_cache: bool,
    /// Rows per step and tokens per row (JSONL data).
    pub batch_size: i64,
    pub seq: i64,
    pub pack: bool,
    pub train_on_prompt: bool,
    pub skip_bad_lines: bool,
    pub strict_length: bool,
    pub eval_fraction: f64,
    pub eval_data: Option<PathBuf>,
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
    /// Device mesh and sharding rules (None: one device).
    pub mesh: Option<crate::program::MeshPlan>,
    /// QLoRA: NF4 base weights.
    pub nf4: bool,
    /// On a non-finite loss or gradient: stop (false) or skip the step and go on (true).
    pub skip_nonfinite: bool,
    /// Compute the loss this many positions at a time (looped layers).
    pub loss_chunk: Option<i64>,
    pub attention_block: Option<i64>,
    /// `--matmul-result`: auto, f32 or compute (see [`crate::device::platform::wide_matmul_results`]).
    pub matmul_result: String,
}

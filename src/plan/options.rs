//! What `xtrain plan` is asked ([`PlanOptions`]) and what it found ([`Plan`]).

use super::search::{Limits, Point};
use super::space::Space;
use crate::model::config::LlamaConfig;
use crate::program::{sharding::Rules, StepOptions};
use std::path::PathBuf;

/// What `xtrain plan` is asked.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub model: LlamaConfig,
    /// `--model` as given, for the recipe.
    pub model_flag: String,
    /// The step's flags; the searched knobs' values in it are replaced by each point's.
    pub step: StepOptions,
    pub space: Space,
    /// The sharding rules the searched meshes are placed by.
    pub rules: Rules,
    /// `--target` (None: this machine's plugin, with `devices` devices).
    pub target: Option<String>,
    pub target_config: Option<PathBuf>,
    pub plugin: Option<String>,
    pub devices: i64,
    pub seq: SeqGoal,
    /// Rows per optimizer step, all microbatches and devices together.
    pub batch_size: i64,
    /// The device memory to fit, bytes (None: what the target's devices give XLA).
    pub memory_limit: Option<i64>,
    /// The host memory per device to fit, bytes (None: this machine's, or the target's usual
    /// machine's, `budget::host`).
    pub host_memory_limit: Option<i64>,
    /// How many points that fit to compile (the table's rows).
    pub confirm: usize,
    /// Compile every point the step takes, skipping nothing (to check the pruning).
    pub exhaustive: bool,
    /// Where to write plan.json and recipe.toml (new or empty unless `overwrite`).
    pub out: Option<PathBuf>,
    pub overwrite: bool,
    /// What the command reads, which `out` may not be or hold.
    pub inputs: Vec<PathBuf>,
    pub verbose: bool,
}

/// `--seq N`, or `--seq max` in steps of `step` tokens up to `upto` (None: the model's
/// positions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SeqGoal {
    Fixed(i64),
    Max { step: i64, upto: Option<i64> },
}

/// One probe of `--seq max`: a sequence, the least-memory settings tried, and whether they fit.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Probe {
    pub seq: i64,
    pub flags: String,
    pub fits: bool,
    pub device_bytes: Option<i64>,
    pub host_bytes: Option<i64>,
}

/// What the plan found.
pub struct Plan {
    pub target: String,
    /// `--target` as given (None: this machine).
    pub target_flag: Option<String>,
    /// The plugin `xtrain train` runs the pick with, as the recipe's `[train]` names it (None:
    /// train's default, the CPU).
    pub train_plugin: Option<String>,
    pub seq: i64,
    pub batch_size: i64,
    /// The device and host memory per device the points fit, and where each came from.
    pub limits: Limits,
    /// Every point, and the indices of those that fit, best first.
    pub points: Vec<Point>,
    pub ranked: Vec<usize>,
    /// Ranked by the TPU compiler's estimate (else by the time model).
    pub by_estimate: bool,
    /// What the time model stands on (None: nothing; the table gives no time).
    pub rates: Option<super::cost::Rates>,
    pub probes: Vec<Probe>,
    pub method: String,
}

impl Plan {
    /// The pick: the best of the points that fit.
    pub fn chosen(&self) -> Option<&Point> {
        self.ranked.first().map(|&i| &self.points[i])
    }
}

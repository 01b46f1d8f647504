//! `xtrain bench`: time the step on random weights and print the figures as JSON.

use crate::cli::args::StepArgs;
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use xtrain::device::runtime::Runtime;

#[derive(Args)]
pub struct BenchArgs {
    /// A model directory's config or a preset (the standard workload is bench-512).
    #[arg(long, default_value = "bench-512")]
    pub model: String,
    /// Weights: only `random` (no checkpoint).
    #[arg(long, default_value = "random")]
    pub init: String,
    #[arg(long, default_value_t = 4)]
    pub batch: i64,
    #[arg(long, default_value_t = 256)]
    pub seq: i64,
    #[command(flatten)]
    pub step: StepArgs,
    /// Steps timed after the warm-up.
    #[arg(long, default_value_t = 6)]
    pub steps: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Write the weights, LoRA and batch here (safetensors) for peer implementations.
    #[arg(long)]
    pub export: Option<PathBuf>,
    #[arg(long)]
    pub plugin: Option<String>,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.init != "random" {
        bail!("--init must be random");
    }
    if a.steps < 1 {
        bail!("--steps must be at least 1 (the steps timed)");
    }
    let (cfg, _) = xtrain::model::presets::resolve_model_config(&a.model)?;
    let options = a.step.options()?;
    let devices = options.mesh.as_ref().map_or(1, |m| m.devices());
    let rt = Runtime::open(a.plugin.as_deref(), Some(devices))?;
    let spec = options.spec(cfg, a.batch, a.seq)?;
    xtrain::device::platform::check_offload(&rt.platform(), spec.offload, "this step")?;
    let r = xtrain::train::bench::run(rt, spec, a.warmup, a.steps, a.export.as_deref())?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

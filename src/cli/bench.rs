//! `xtrain bench`: time the step on random weights and print the figures as JSON.

use crate::cli::args::StepArgs;
use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use xtrain::device::runtime::Runtime;

#[derive(Args)]
pub struct BenchArgs {
    /// A model directory's config or a preset (the standard workload is bench-512).
    #[arg(long, default_value = "bench-512")]
    pub model: String,
    /// Weights: only `random` (no checkpoint).
    #[arg(long, default_value = "random")]
    pub init: String,
    /// Rows per step of the random batch (also --batch).
    #[arg(long, alias = "batch", alias = "global-batch", default_value_t = 4)]
    pub batch_size: i64,
    /// Tokens per row of the random batch.
    #[arg(long, default_value_t = 256)]
    pub seq: i64,
    #[command(flatten)]
    pub step: StepArgs,
    /// Steps timed after the warm-up.
    #[arg(long, default_value_t = 6)]
    pub steps: usize,
    /// Untimed steps run before the timed ones (the first steps pay for warming up the device).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Write the weights, LoRA and batch here (safetensors) for peer implementations: a new file
    /// (see --overwrite), never one this command reads.
    #[arg(long, value_name = "FILE")]
    pub export: Option<PathBuf>,
    /// Replace the file --export names if it exists, once the new one is complete.
    #[arg(long)]
    pub overwrite: bool,
    /// PJRT plugin: cpu, cuda, rocm, tpu or a path to a plugin .so (default: $XTRAIN_PLUGIN or
    /// cpu).
    #[arg(long)]
    pub plugin: Option<String>,
    /// A kernel to compile in place of the composite ops it implements (repeatable), e.g.
    /// `cudnn` on NVIDIA GPUs: cuDNN's fused attention instead of the key-block loops. The
    /// program's text is unchanged; the run says what was replaced.
    #[arg(long = "kernel", value_name = "NAME")]
    pub kernel: Vec<String>,
}

impl BenchArgs {
    /// The files and directories this command reads, which `--export` may not replace: the model
    /// dir (or config file), the sharding rules and a plugin given as a file.
    fn inputs(&self) -> Vec<&Path> {
        let model = Path::new(&self.model);
        let plugin = self.plugin.as_deref().map(Path::new);
        [
            model.exists().then_some(model),
            self.step.sharding_rules.as_deref(),
            plugin.filter(|p| p.is_file()),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.init != "random" {
        bail!("--init must be random");
    }
    if a.steps < 1 {
        bail!("--steps must be at least 1 (the steps timed)");
    }
    let export = match &a.export {
        Some(file) => Some(xtrain::formats::outdir::check_writable_file(
            "--export",
            file,
            a.overwrite,
            &a.inputs(),
        )?),
        None if a.overwrite => {
            bail!(
                "--overwrite replaces the file --export names; without --export nothing is written"
            )
        }
        None => None,
    };
    let (cfg, _) = xtrain::model::presets::resolve_model_config(&a.model)?;
    let options = a.step.options()?;
    for (_, note) in options.idle_result_types() {
        xtrain::esay!("xtrain: note: {note}");
    }
    let devices = options.mesh.as_ref().map_or(1, |m| m.devices());
    let mut rt = Runtime::open(a.plugin.as_deref(), Some(devices))?;
    rt.use_kernels(&a.kernel)?;
    let spec = options.spec(cfg, a.batch_size, a.seq)?;
    xtrain::device::platform::check_offload(&rt.platform(), spec.offload, "this step")?;
    let r = xtrain::train::bench::run(rt, spec, a.warmup, a.steps, export.as_deref())?;
    xtrain::say!("{}", serde_json::to_string(&r)?);
    Ok(())
}

//! `xtrain plan`: its flags, made into the library's `plan::PlanOptions` for `plan::run`. Each
//! knob of the search whose flag is given (`--remat`, `--offload`, `--mesh`, `--grad-accum`,
//! `--key-block`, `--loss-chunk`, `--mlp-chunk`) is fixed to it; the others are searched.

use crate::cli::args::StepArgs;
use anyhow::{bail, Result};
use clap::Args;
use std::collections::BTreeSet;
use std::path::PathBuf;
use xtrain::plan::space::{Knob, Space};
use xtrain::plan::{PlanOptions, SeqGoal};

#[derive(Args)]
pub struct PlanArgs {
    /// A Hugging Face model directory, a preset (llama-3.1-8b, llama-3.1-70b, llama-3.2-1b,
    /// qwen3-8b, ...; `xtrain plan --help` lists them) or a repo id
    /// (its config.json only).
    #[arg(long, long_help = crate::cli::compile::model_long_help())]
    pub model: String,
    /// With a repo id: the branch, tag or commit (default main).
    #[arg(long)]
    pub revision: Option<String>,
    /// Tokens per row, or `max`: the longest sequence (in steps of --seq-step, up to the
    /// model's positions) that the least-memory settings fit, then the fastest settings there.
    #[arg(long, default_value = "2048", value_name = "N|max")]
    pub seq: String,
    /// With --seq max: the granularity of the sequence searched.
    #[arg(long, default_value_t = 1024)]
    pub seq_step: i64,
    /// With --seq max: the longest sequence to try (default: the model's positions).
    #[arg(long, value_name = "N")]
    pub seq_limit: Option<i64>,
    /// Rows per optimizer step, all microbatches and devices together (also --global-batch,
    /// --batch).
    #[arg(long, alias = "global-batch", alias = "batch", default_value_t = 1)]
    pub batch_size: i64,
    #[command(flatten)]
    pub step: StepArgs,
    /// The hardware to plan for, which need not be here (as `compile --target`:
    /// cuda:rtx4090:1, tpu:v5p:2x2x1, ...); left out: this machine's plugin (with --devices).
    #[arg(long)]
    pub target: Option<String>,
    /// Without --target: the devices of this machine's plugin to plan over (the CPU plugin
    /// makes as many virtual devices as asked).
    #[arg(long, default_value_t = 1)]
    pub devices: i64,
    /// With a cuda: or rocm: --target: describe the GPU with this file.
    #[arg(long)]
    pub target_config: Option<PathBuf>,
    /// The target's plugin file (default: the known plugin, installed on first use).
    #[arg(long)]
    pub plugin: Option<String>,
    /// The device memory to fit, GiB, instead of what the target's devices give XLA (e.g. to
    /// keep room for something else on the card).
    #[arg(long, value_name = "GIB")]
    pub memory_limit_gib: Option<f64>,
    /// The host memory a device's share of the step may use, GiB (offloaded weights and
    /// activations); left out: any (the table shows what each point needs).
    #[arg(long, value_name = "GIB")]
    pub host_memory_limit_gib: Option<f64>,
    /// How many settings that fit to compile and rank (the table's rows; 1: the pick alone).
    #[arg(long, default_value_t = 3)]
    pub confirm: usize,
    /// Compile every point of the space, skipping none (slow: to check what the search skips).
    #[arg(long)]
    pub exhaustive: bool,
    /// Write plan.json and recipe.toml into this directory (new or empty; see --overwrite).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Replace what --out holds once the plan is complete.
    #[arg(long)]
    pub overwrite: bool,
}

/// `given`: the flags typed on the command line (searched knobs are those left out).
pub fn plan(a: PlanArgs, verbose: bool, given: BTreeSet<String>) -> Result<()> {
    let seq = match a.seq.as_str() {
        "max" => SeqGoal::Max {
            step: a.seq_step,
            upto: a.seq_limit,
        },
        n => match n.parse::<i64>() {
            Ok(n) if n >= 2 => {
                for flag in ["seq-step", "seq-limit"] {
                    if given.contains(flag) {
                        bail!("--{flag} is for --seq max; --seq {n} is one length");
                    }
                }
                SeqGoal::Fixed(n)
            }
            _ => bail!("--seq must be a number of tokens (2 or more) or max, got `{n}`"),
        },
    };
    let memory_limit = gib_flag("memory-limit-gib", a.memory_limit_gib)?;
    let host_memory_limit = gib_flag("host-memory-limit-gib", a.host_memory_limit_gib)?;
    let step = a.step.options()?;
    let fixed = |flag: &str| given.contains(flag);
    let space = Space {
        mesh: Knob::given(fixed("mesh"), step.mesh.clone()),
        grad_accum: Knob::given(fixed("grad-accum"), step.grad_accum),
        remat: step.remat.map_or(Knob::Searched, Knob::Fixed),
        offload: step.offload.map_or(Knob::Searched, Knob::Fixed),
        key_block: Knob::given(fixed("key-block"), step.key_block),
        loss_chunk: Knob::given(fixed("loss-chunk"), step.loss_chunk),
        mlp_chunk: Knob::given(fixed("mlp-chunk"), step.mlp_chunk),
    };
    let model = std::path::Path::new(&a.model);
    let inputs: Vec<PathBuf> = [
        model.exists().then_some(model),
        a.step.sharding_rules.as_deref(),
        a.target_config.as_deref(),
    ]
    .into_iter()
    .flatten()
    .map(|p| p.to_path_buf())
    .collect();
    let options = PlanOptions {
        model: crate::cli::model::model_config(&a.model, a.revision.as_deref())?,
        model_flag: a.model.clone(),
        rules: a.step.rules()?,
        step,
        space,
        target: a.target,
        target_config: a.target_config,
        plugin: a.plugin,
        devices: a.devices,
        seq,
        batch_size: a.batch_size,
        memory_limit,
        host_memory_limit,
        confirm: a.confirm,
        exhaustive: a.exhaustive,
        out: a.out,
        overwrite: a.overwrite,
        inputs,
        verbose,
    };
    crate::cli::signals::end_at_once(crate::cli::signals::OnSignal {
        said: match &options.out {
            Some(d) => format!(
                "nothing was written to {} (plan.json and recipe.toml are written whole at the \
                 end)",
                d.display()
            ),
            None => "the plan was not finished".into(),
        },
        out: options.out.clone(),
        temp_prefixes: &[xtrain::device::dumps::ROOT_PREFIX],
    })?;
    xtrain::plan::run(&options)?;
    Ok(())
}

/// A `--...-gib` flag in bytes: a positive finite number of GiB.
fn gib_flag(flag: &str, v: Option<f64>) -> Result<Option<i64>> {
    match v {
        Some(g) if g.is_finite() && g > 0.0 => Ok(Some((g * (1u64 << 30) as f64) as i64)),
        Some(g) => bail!("--{flag} must be a positive number of GiB, got {g}"),
        None => Ok(None),
    }
}

//! `xtrain compile`: its flags, made into the library's `compile::CompileOptions` for
//! `compile::run` (which builds the step, writes its program dir and, with `--check`, compiles
//! it), and what the command says of the report.

use crate::cli::args::StepArgs;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use xtrain::compile::{CompileOptions, CompileReport};
use xtrain::program::AttentionBlockUnused;

#[derive(Args)]
pub struct CompileArgs {
    /// A TOML recipe whose keys are these flags (`lora_r = 16`); flags on the command line
    /// override it (see recipes/).
    #[arg(long, value_name = "FILE")]
    // Read before parsing, by config::expand; here only as an input --out may not replace.
    pub config: Option<PathBuf>,
    /// A Hugging Face model directory, a preset (llama-3.1-8b, qwen3-8b, mistral-7b-v0.3, ...;
    /// --help lists them all), or a repo id (org/name; its config.json only).
    #[arg(long, long_help = model_long_help())]
    pub model: String,
    /// With a repo id: the branch, tag or commit (default main).
    #[arg(long)]
    pub revision: Option<String>,
    /// Rows per optimizer step, all microbatches and devices together (also --batch).
    #[arg(long, alias = "batch", alias = "global-batch", default_value_t = 1)]
    pub batch_size: i64,
    /// Tokens per row.
    #[arg(long, default_value_t = 2048)]
    pub seq: i64,
    #[command(flatten)]
    pub step: StepArgs,
    /// Program directory to write (train_step.mlir, manifest.json): new or empty (see
    /// --overwrite).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what --out holds (an earlier program, or anything else) once the new program
    /// directory is complete.
    #[arg(long)]
    pub overwrite: bool,
    /// Also compile it with the plugin and print XLA's memory figures and the compile time.
    #[arg(long)]
    pub check: bool,
    /// With --check: a kernel to compile in place of the composite ops it implements
    /// (repeatable), e.g. `every-key`; each build records what it replaced. The program's text
    /// is the same with or without.
    #[arg(long = "kernel", value_name = "NAME")]
    pub kernel: Vec<String>,
    /// With --check: write XLA's optimized HLO here.
    #[arg(long)]
    pub xla_dump: Option<PathBuf>,
    /// With --check and no --target: the PJRT plugin to compile with (cpu, cuda, rocm, tpu or a
    /// path; default $XTRAIN_PLUGIN or cpu). With a --target: that target's plugin file. The
    /// program's text does not depend on it.
    #[arg(long)]
    pub plugin: Option<String>,
    /// Hardware to compile for, which need not be here; repeat it for several targets of the
    /// same device count (one program, one executable each): tpu:<generation>:<chips>
    /// (tpu:v5p:2x2x1, tpu:v5e:2x2, tpu:v6e:16x16), cuda:<gpu>:<count> or rocm:<gpu>:<count>
    /// with <count> per host or <hosts>x<per host> (cuda:h100:8, cuda:h100:2x8, rocm:mi300x:8).
    /// Without --mesh the mesh is FSDP over all its devices. The plugins are needed only with
    /// --check.
    #[arg(long)]
    pub target: Vec<String>,
    /// With a cuda: or rocm: --target: describe the GPU with this file (XLA's
    /// GpuTargetConfigProto in text form) instead of a built-in description.
    #[arg(long)]
    pub target_config: Option<PathBuf>,
    /// With --check for a TPU: skip the whole-step estimate (two more compiles, of unrolled 1- and
    /// 2-layer steps).
    #[arg(long)]
    pub no_estimate: bool,
}

impl CompileArgs {
    /// The files and directories this command reads, which `--out` may not be or hold: the model
    /// dir (or config file), the `--config` recipe, the sharding rules, the `--target-config`
    /// file and a plugin given as a file.
    fn inputs(&self) -> Vec<PathBuf> {
        let model = std::path::Path::new(&self.model);
        let plugin = self.plugin.as_deref().map(std::path::Path::new);
        [
            model.exists().then_some(model),
            self.config.as_deref(),
            self.step.sharding_rules.as_deref(),
            self.target_config.as_deref(),
            plugin.filter(|p| p.is_file()),
        ]
        .into_iter()
        .flatten()
        .map(|p| p.to_path_buf())
        .collect()
    }
}

/// `recipe`: the `--config` recipe and the flags it gave (not typed on the command line).
pub fn compile(
    mut a: CompileArgs,
    verbose: bool,
    recipe: Option<crate::cli::config::Recipe>,
) -> Result<()> {
    let from_recipe = |flag: &str| recipe.as_ref().is_some_and(|(_, f)| f.contains(flag));
    // A recipe's top-level `plugin` serves `train` too: without --check it is left unused, not
    // refused; typed on the command line, it would do nothing.
    if a.plugin.is_some() && !a.check && from_recipe("plugin") {
        a.plugin = None;
    }
    let options = CompileOptions {
        model: crate::cli::model::model_config(&a.model, a.revision.as_deref())?,
        batch: a.batch_size,
        seq: a.seq,
        step: a.step.options()?,
        mesh_flag: a.step.mesh.clone(),
        rules: a.step.rules()?,
        inputs: a.inputs(),
        out: a.out,
        overwrite: a.overwrite,
        check: a.check,
        kernels: a.kernel,
        xla_dump: a.xla_dump,
        plugin: a.plugin,
        targets: a.target,
        target_config: a.target_config,
        no_estimate: a.no_estimate,
        verbose,
    };
    let report = xtrain::compile::run(&options).map_err(|e| {
        // A recipe's --attention-block is named as the recipe's, not the command line's.
        match e.downcast_ref::<AttentionBlockUnused>() {
            Some(unused) => unused.from_source(&match &recipe {
                Some((file, _)) if from_recipe("attention-block") => {
                    format!("the recipe {} gives", file.display())
                }
                _ => "the command line gives".to_string(),
            }),
            None => e,
        }
    })?;
    say_what_auto_chose(&options, &report);
    Ok(())
}

/// `--remat auto` or `--offload auto` with `--check`: what auto chose, and for which targets'
/// memory (the one choice of the step that follows the target; without one, the choice where
/// the memory is not known).
fn say_what_auto_chose(o: &CompileOptions, report: &CompileReport) {
    let Some((remat, offload)) = report.chosen else {
        return;
    };
    let mut chose = Vec::new();
    if o.step.remat.is_none() {
        chose.push(format!("--remat {}", remat.name()));
    }
    if o.step.offload.is_none() {
        chose.push(format!("--offload {}", offload.name()));
    }
    if chose.is_empty() {
        return;
    }
    let why = match report.targets.len() {
        0 => "this machine's plugin: without --target the devices' memory is not known, so auto \
              is remat per layer and no offload"
            .to_string(),
        1 => format!("{}, by its devices' memory", report.targets[0]),
        _ => format!(
            "{}, by every one's devices' memory",
            report.targets.join(", ")
        ),
    };
    xtrain::say!("auto chose {} for {why}", chose.join(" "));
}

/// `--model`'s long help, with every preset by name: the list grows with the families, so it is
/// written from `presets::PRESETS` rather than by hand.
pub(crate) fn model_long_help() -> String {
    let names: Vec<&str> = xtrain::model::presets::PRESETS
        .iter()
        .map(|(name, _)| *name)
        .collect();
    format!(
        "A Hugging Face model directory, a preset, or a repo id (org/name; its config.json \
         only). Presets (tiny-llama3 and bench-512 are for tests and benchmarks): {}",
        names.join(", ")
    )
}

//! [`RunSettings`]: every setting of a run by its flag, what a checkpoint records; which of
//! them are paths and which only lay out and report; setting one flag of a run's options.

use crate::model::lora::Projection;
use crate::model::preference::PairLoss;
use crate::program::{
    sharding, KeyBlocks, MeshPlan, Method, MlpChunks, Offload, Preference, Quant, Reference, Remat,
    ResultType,
};
use crate::train::checkpoint::Settings;
use crate::train::options::TrainOptions;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

pub use crate::cluster::rendezvous::show;

pub(super) fn mesh_text(m: &Option<MeshPlan>) -> String {
    m.as_ref().map_or(String::new(), |m| {
        let axes: Vec<String> = m.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
        axes.join(",")
    })
}

/// A path as recorded: absolute (resolved through symlinks where it exists), "" for none.
fn path_text(p: Option<&Path>) -> String {
    match p {
        None => String::new(),
        Some(p) if p.as_os_str().is_empty() => String::new(),
        Some(p) => p
            .canonicalize()
            .or_else(|_| std::path::absolute(p))
            .unwrap_or_else(|_| p.to_path_buf())
            .display()
            .to_string(),
    }
}

/// The flags whose values are paths: the model, the data, the evaluation data, the output dir
/// and the program dir. A resumed run takes them from its checkpoint ([`take_recorded_paths`])
/// before the model's config is read; [`settle`] leaves them alone.
pub const PATH_FLAGS: &[&str] = &["model", "data", "eval-data", "out", "program"];

/// The flags that say how a run is laid out on devices and how it reports, not what it
/// computes: a resumed run takes the recorded value when the flag is left out, and a value
/// given on the command line wins over it (said, not refused). The program-form flags here
/// change the form of the same arithmetic (`--precompute-reference` too: the reference's
/// forward pass once before training instead of inside each step); `--attention-scores` is not
/// among them, since bf16 scores round once more than f32 ones.
pub const LAYOUT_AND_REPORTING: &[&str] = &[
    "remat",
    "offload",
    "grad-accum",
    "loss-chunk",
    "attention-block",
    "key-block",
    "mlp-chunk",
    "mesh",
    "sharding-rules",
    "matmul-result",
    "keep-softmax-stats",
    "pin-mlp-activations",
    "precompute-reference",
    "plugin",
    "program",
    "eval-data",
    "out",
    "save-every",
    "eval-every",
    "log-every",
    "no-plot",
    "peak-tflops",
];

/// Every setting of a run, each field named as its flag (`lora-alpha`, `grad-accum`, kebab-case
/// in the file) and holding the value as a user would type it after the flag: what a run
/// records in its checkpoints (`trainer_state.json`'s `settings`). What decides its result (the
/// model and data, the adapter, the optimizer, the schedule, the numerics, the seed), how it is
/// laid out on devices ([`LAYOUT_AND_REPORTING`]: mesh, remat, chunks, plugin, program dir) and
/// how it reports (output dir, evaluation data, saving, evaluation and logging cadence), so that
/// `xtrain train --resume CHECKPOINT` alone continues the run as it was started. Paths are
/// absolute. A new flag of `train` is a field here, in [`RunSettings::of`] and in
/// [`RunSettings::apply_to`] (the compiler names the one left out).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RunSettings {
    pub model: String,
    pub data: String,
    pub eval_data: String,
    pub out: String,
    pub program: String,
    pub seed: u64,
    pub lora_r: i64,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    pub lora_targets: String,
    pub lr: f64,
    pub warmup: u64,
    pub schedule: String,
    pub min_lr_ratio: f64,
    pub steps: u64,
    pub epochs: u64,
    pub betas: String,
    pub eps: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    pub dtype: String,
    pub quant: String,
    pub batch_size: i64,
    pub seq: i64,
    pub no_pack: bool,
    pub train_on_prompt: bool,
    pub skip_bad_lines: bool,
    pub strict_length: bool,
    pub text_column: String,
    pub messages_column: String,
    pub eval_fraction: f64,
    pub skip_nonfinite_steps: bool,
    // Layout.
    pub remat: String,
    pub offload: String,
    pub grad_accum: i64,
    pub loss_chunk: Option<i64>,
    pub attention_block: Option<i64>,
    pub key_block: String,
    pub mlp_chunk: String,
    pub mesh: String,
    pub sharding_rules: String,
    pub matmul_result: String,
    pub attention_scores: String,
    pub keep_softmax_stats: bool,
    pub pin_mlp_activations: bool,
    pub plugin: String,
    // Reporting.
    pub save_every: u64,
    pub eval_every: u64,
    pub log_every: u64,
    pub no_plot: bool,
    pub peak_tflops: Option<f64>,
    // Preference training (a checkpoint written before it has none of these: supervised).
    #[serde(default = "sft")]
    pub method: String,
    #[serde(default = "default_beta")]
    pub beta: f64,
    #[serde(default = "sigmoid")]
    pub dpo_loss: String,
    #[serde(default)]
    pub label_smoothing: f64,
    #[serde(default = "base")]
    pub reference: String,
    #[serde(default)]
    pub precompute_reference: bool,
}

fn sft() -> String {
    "sft".into()
}

fn default_beta() -> f64 {
    Preference::default().beta
}

fn sigmoid() -> String {
    Preference::default().dpo_loss.name().into()
}

fn base() -> String {
    Preference::default().reference.name().into()
}

/// The settings of `value` (a [`RunSettings`] or [`ProgramSettings`]) by flag, the form a
/// checkpoint records and settings are compared in.
pub(super) fn by_flag<T: serde::Serialize>(value: &T) -> Settings {
    match serde_json::to_value(value) {
        Ok(Value::Object(m)) => m.into_iter().collect(),
        _ => unreachable!("settings serialize as a JSON object"),
    }
}

impl RunSettings {
    /// The settings of the run `o` would be.
    pub fn of(o: &TrainOptions) -> RunSettings {
        let s = &o.step;
        let p = &s.preference;
        RunSettings {
            model: path_text(Some(&o.model)),
            data: path_text(Some(&o.data.path)),
            eval_data: path_text(o.data.eval_data.as_deref()),
            out: path_text(Some(&o.out)),
            program: path_text(o.program.as_deref()),
            seed: o.seed,
            lora_r: s.lora.r,
            lora_alpha: s.lora.alpha,
            lora_dropout: s.lora.dropout,
            lora_targets: Projection::list(&s.lora.targets),
            lr: o.lr,
            warmup: o.warmup,
            schedule: o.schedule.clone(),
            min_lr_ratio: o.min_lr_ratio,
            steps: o.steps,
            epochs: o.epochs,
            betas: format!("{},{}", s.adam.beta1, s.adam.beta2),
            eps: s.adam.eps,
            weight_decay: s.adam.weight_decay,
            max_grad_norm: s.adam.max_grad_norm,
            dtype: s.dtype.mlir().to_string(),
            quant: s.quant.name().to_string(),
            batch_size: o.data.batch_size,
            seq: o.data.seq,
            no_pack: !o.data.pack,
            train_on_prompt: o.data.train_on_prompt,
            skip_bad_lines: o.data.skip_bad_lines,
            strict_length: o.data.strict_length,
            text_column: o.data.columns.text.clone(),
            messages_column: o.data.columns.messages.clone(),
            eval_fraction: o.data.eval_fraction,
            skip_nonfinite_steps: o.skip_nonfinite,
            remat: s.remat.map_or("auto", |r| r.name()).to_string(),
            offload: s.offload.map_or("auto", |o| o.name()).to_string(),
            grad_accum: s.grad_accum,
            loss_chunk: s.loss_chunk,
            attention_block: s.attention_block,
            key_block: s.key_block.name(),
            mlp_chunk: s.mlp_chunk.name(),
            mesh: mesh_text(&s.mesh),
            sharding_rules: path_text(o.sharding_rules.as_deref()),
            matmul_result: s.matmul_result.name().to_string(),
            attention_scores: s.attention_scores.name().to_string(),
            keep_softmax_stats: s.keep_softmax_stats,
            pin_mlp_activations: s.pin_mlp_activations,
            plugin: o.plugin.clone().unwrap_or_default(),
            save_every: o.save_every,
            eval_every: o.eval_every,
            log_every: o.log_every,
            no_plot: !o.plot,
            peak_tflops: o.peak_tflops,
            method: s.method.name().into(),
            beta: p.beta,
            dpo_loss: p.dpo_loss.name().into(),
            label_smoothing: p.label_smoothing,
            reference: p.reference.name().into(),
            precompute_reference: p.precompute_reference,
        }
    }

    /// Set `o` to these settings, all but the paths of [`PATH_FLAGS`] (taken before the model
    /// is read, by [`take_recorded_paths`]). `RunSettings::of(o).apply_to(o)` changes nothing.
    fn apply_to(self, o: &mut TrainOptions) -> Result<()> {
        let RunSettings {
            model: _,
            data: _,
            eval_data: _,
            out: _,
            program: _,
            seed,
            lora_r,
            lora_alpha,
            lora_dropout,
            lora_targets,
            lr,
            warmup,
            schedule,
            min_lr_ratio,
            steps,
            epochs,
            betas,
            eps,
            weight_decay,
            max_grad_norm,
            dtype,
            quant,
            batch_size,
            seq,
            no_pack,
            train_on_prompt,
            skip_bad_lines,
            strict_length,
            text_column,
            messages_column,
            eval_fraction,
            skip_nonfinite_steps,
            remat,
            offload,
            grad_accum,
            loss_chunk,
            attention_block,
            key_block,
            mlp_chunk,
            mesh,
            sharding_rules,
            matmul_result,
            attention_scores,
            keep_softmax_stats,
            pin_mlp_activations,
            plugin,
            save_every,
            eval_every,
            log_every,
            no_plot,
            peak_tflops,
            method,
            beta,
            dpo_loss,
            label_smoothing,
            reference,
            precompute_reference,
        } = self;
        o.seed = seed;
        let s = &mut o.step;
        s.lora.r = lora_r;
        s.lora.alpha = lora_alpha;
        s.lora.dropout = lora_dropout;
        s.lora.targets = Projection::parse_list(&lora_targets).context("--lora-targets")?;
        o.lr = lr;
        o.warmup = warmup;
        o.schedule = schedule;
        o.min_lr_ratio = min_lr_ratio;
        o.steps = steps;
        o.epochs = epochs;
        (s.adam.beta1, s.adam.beta2) = two_numbers(&betas)?;
        s.adam.eps = eps;
        s.adam.weight_decay = weight_decay;
        s.adam.max_grad_norm = max_grad_norm;
        s.dtype = crate::program::parse_dtype(&dtype)?;
        s.quant = Quant::parse(&quant)?;
        o.data.batch_size = batch_size;
        o.data.seq = seq;
        o.data.pack = !no_pack;
        o.data.train_on_prompt = train_on_prompt;
        o.data.skip_bad_lines = skip_bad_lines;
        o.data.strict_length = strict_length;
        o.data.columns.text = text_column;
        o.data.columns.messages = messages_column;
        o.data.eval_fraction = eval_fraction;
        o.skip_nonfinite = skip_nonfinite_steps;
        let s = &mut o.step;
        s.remat = Remat::parse_choice(&remat)?;
        s.offload = Offload::parse_choice(&offload)?;
        s.grad_accum = grad_accum;
        s.loss_chunk = loss_chunk;
        s.attention_block = attention_block;
        s.key_block = KeyBlocks::parse(&key_block)?;
        s.mlp_chunk = MlpChunks::parse(&mlp_chunk)?;
        s.matmul_result = ResultType::parse("matmul-result", &matmul_result)?;
        s.attention_scores = ResultType::parse("attention-scores", &attention_scores)?;
        s.keep_softmax_stats = keep_softmax_stats;
        s.pin_mlp_activations = pin_mlp_activations;
        set_mesh(o, &mesh, sharding_rules)?;
        o.plugin = (!plugin.is_empty()).then_some(plugin);
        o.save_every = save_every;
        o.eval_every = eval_every;
        o.log_every = log_every;
        o.plot = !no_plot;
        o.peak_tflops = peak_tflops;
        o.step.method = Method::parse(&method)?;
        o.data.pairs = o.step.method == Method::Dpo;
        o.step.preference = Preference {
            beta,
            dpo_loss: PairLoss::parse(&dpo_loss).map_err(anyhow::Error::msg)?,
            label_smoothing,
            reference: Reference::parse(&reference)?,
            precompute_reference,
        };
        Ok(())
    }
}

/// `--betas` as recorded: two numbers, `b1,b2`.
fn two_numbers(betas: &str) -> Result<(f64, f64)> {
    betas
        .split_once(',')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .ok_or_else(|| anyhow::anyhow!("--betas `{betas}` is not two numbers"))
}

/// Set `o`'s mesh to `mesh` under the sharding rules of `--sharding-rules` (a path, "" for
/// none), or the default rules.
fn set_mesh(o: &mut TrainOptions, mesh: &str, sharding_rules: String) -> Result<()> {
    o.sharding_rules = (!sharding_rules.is_empty()).then(|| sharding_rules.into());
    let rules = match &o.sharding_rules {
        Some(p) => crate::formats::sharding_rules::read_rules(p)?,
        None => sharding::Rules::default(),
    };
    let axes = sharding::parse_mesh(mesh)?.axes;
    o.step.mesh = (!axes.is_empty()).then_some(MeshPlan { axes, rules });
    Ok(())
}

/// What a run records in its checkpoints, by flag ([`RunSettings`]).
pub fn of_run(o: &TrainOptions) -> Settings {
    by_flag(&RunSettings::of(o))
}

/// Set the flag `flag` of `o` to `v`, a value recorded by [`RunSettings`] or
/// [`ProgramSettings`] (whose flags are [`RunSettings`]' too): `o`'s settings with that one
/// replaced, applied back.
pub(super) fn apply(o: &mut TrainOptions, flag: &str, v: &Value) -> Result<()> {
    let mut all = by_flag(&RunSettings::of(o));
    if all.insert(flag.to_string(), v.clone()).is_none() {
        bail!("unknown recorded setting `{flag}`");
    }
    let settings: RunSettings = serde_json::from_value(Value::Object(all.into_iter().collect()))
        .map_err(|_| anyhow::anyhow!("recorded --{flag} {v} is not a valid value"))?;
    settings.apply_to(o)
}

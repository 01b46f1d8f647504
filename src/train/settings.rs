//! The settings that define a run, by the flag that sets them (`lora-alpha`, `lr`, `steps`, ...),
//! as recorded in every checkpoint (`trainer_state.json`) and as a program dir fixes them. A
//! resumed run (`--resume`) or a run of a compiled program (`--program`) takes every recorded
//! value for a flag left at its default, and refuses a flag given with another value, naming
//! both: a run never continues with another alpha, schedule or batch than the one it started
//! with, and never trains another rank than the one its program was built for.
//!
//! The flags' names are written once, as the fields of [`RunSettings`] (every setting of a run)
//! and `ProgramSettings` (those a program dir fixes); values are compared by flag in their JSON
//! form, and one is taken by replacing it in the run's settings and applying them back
//! ([`RunSettings::apply_to`]), so that no function maps names to fields by hand.

use crate::model::lora::Projection;
use crate::program::{sharding, KeyBlocks, MeshPlan, Offload, Quant, Remat, ResultType, StepSpec};
use crate::train::checkpoint::{Settings, TrainerState};
use crate::train::options::TrainOptions;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A value as a user would write it after its flag.
pub fn show(v: &Value) -> String {
    match v {
        Value::String(s) if s.is_empty() => "(none)".into(),
        Value::String(s) => s.clone(),
        Value::Null => "(none)".into(),
        Value::Number(n) if n.is_f64() => format!("{}", n.as_f64().unwrap_or(f64::NAN)),
        v => v.to_string(),
    }
}

fn mesh_text(m: &Option<MeshPlan>) -> String {
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
/// change the form of the same arithmetic; `--attention-scores` is not among them, since bf16
/// scores round once more than f32 ones.
pub const LAYOUT_AND_REPORTING: &[&str] = &[
    "remat",
    "offload",
    "grad-accum",
    "loss-chunk",
    "attention-block",
    "key-block",
    "mesh",
    "sharding-rules",
    "matmul-result",
    "keep-softmax-stats",
    "pin-mlp-activations",
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
}

/// The settings of `value` (a [`RunSettings`] or [`ProgramSettings`]) by flag, the form a
/// checkpoint records and settings are compared in.
fn by_flag<T: serde::Serialize>(value: &T) -> Settings {
    match serde_json::to_value(value) {
        Ok(Value::Object(m)) => m.into_iter().collect(),
        _ => unreachable!("settings serialize as a JSON object"),
    }
}

impl RunSettings {
    /// The settings of the run `o` would be.
    pub fn of(o: &TrainOptions) -> RunSettings {
        let s = &o.step;
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
        let (b1, b2) = betas
            .split_once(',')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| anyhow::anyhow!("--betas `{betas}` is not two numbers"))?;
        (s.adam.beta1, s.adam.beta2) = (b1, b2);
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
        s.matmul_result = ResultType::parse("matmul-result", &matmul_result)?;
        s.attention_scores = ResultType::parse("attention-scores", &attention_scores)?;
        s.keep_softmax_stats = keep_softmax_stats;
        s.pin_mlp_activations = pin_mlp_activations;
        // The mesh under the sharding rules of `--sharding-rules`, or the default rules.
        o.sharding_rules = (!sharding_rules.is_empty()).then(|| sharding_rules.into());
        let rules = match &o.sharding_rules {
            Some(p) => crate::formats::sharding_rules::read_rules(p)?,
            None => sharding::Rules::default(),
        };
        let axes = sharding::parse_mesh(&mesh)?.axes;
        o.step.mesh = (!axes.is_empty()).then_some(MeshPlan { axes, rules });
        o.plugin = (!plugin.is_empty()).then_some(plugin);
        o.save_every = save_every;
        o.eval_every = eval_every;
        o.log_every = log_every;
        o.plot = !no_plot;
        o.peak_tflops = peak_tflops;
        Ok(())
    }
}

/// What a run records in its checkpoints, by flag ([`RunSettings`]).
pub fn of_run(o: &TrainOptions) -> Settings {
    by_flag(&RunSettings::of(o))
}

/// The settings a program dir fixes, each field named as its flag (a subset of
/// [`RunSettings`]'s, written the same way): those of the step it was built for
/// ([`ProgramSettings::of_spec`]), compared with a run's ([`ProgramSettings::of_options`]). The
/// choices a run may leave to the program dir (`--remat auto`, `--offload auto`, `--key-block
/// auto`) are None in a run's.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
struct ProgramSettings {
    lora_r: i64,
    lora_alpha: f64,
    lora_dropout: f64,
    lora_targets: String,
    betas: String,
    eps: f64,
    weight_decay: f64,
    max_grad_norm: f64,
    dtype: String,
    quant: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    remat: Option<String>,
    grad_accum: i64,
    loss_chunk: Option<i64>,
    attention_block: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    key_block: Option<String>,
    attention_scores: String,
    matmul_result: String,
    keep_softmax_stats: bool,
    pin_mlp_activations: bool,
    mesh: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    offload: Option<String>,
    /// None for a `.safetensors` batch, which has the shape it has (checked against the
    /// program's later).
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_size: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seq: Option<i64>,
}

impl ProgramSettings {
    /// The settings the program dir of `spec` fixes. The result types are said as they are in
    /// effect (with f32 compute, f32 and compute are one: f32).
    fn of_spec(spec: &StepSpec) -> ProgramSettings {
        ProgramSettings {
            lora_r: spec.lora.r,
            lora_alpha: spec.lora.alpha,
            lora_dropout: spec.lora.dropout,
            lora_targets: Projection::list(&spec.lora.targets),
            betas: format!("{},{}", spec.adam.beta1, spec.adam.beta2),
            eps: spec.adam.eps,
            weight_decay: spec.adam.weight_decay,
            max_grad_norm: spec.adam.max_grad_norm,
            dtype: spec.dtype.mlir().to_string(),
            quant: spec.quant.name().to_string(),
            remat: Some(spec.remat.name().to_string()),
            grad_accum: spec.grad_accum,
            loss_chunk: spec.loss_chunk,
            attention_block: spec.attention_block,
            key_block: Some(spec.key_block.map_or("off".to_string(), |k| k.to_string())),
            attention_scores: in_effect(spec.attention_scores, spec.dtype),
            matmul_result: in_effect(spec.matmul_result, spec.dtype),
            keep_softmax_stats: spec.keep_softmax_stats,
            pin_mlp_activations: spec.pin_mlp_activations,
            mesh: mesh_text(&spec.mesh),
            offload: Some(spec.offload.name().to_string()),
            batch_size: Some(spec.batch),
            seq: Some(spec.seq),
        }
    }

    /// The same settings as the run `o` has them.
    fn of_options(o: &TrainOptions) -> ProgramSettings {
        let s = &o.step;
        let run = RunSettings::of(o);
        ProgramSettings {
            lora_r: run.lora_r,
            lora_alpha: run.lora_alpha,
            lora_dropout: run.lora_dropout,
            lora_targets: run.lora_targets,
            betas: run.betas,
            eps: run.eps,
            weight_decay: run.weight_decay,
            max_grad_norm: run.max_grad_norm,
            dtype: run.dtype,
            quant: run.quant,
            remat: s.remat.map(|r| r.name().to_string()),
            grad_accum: run.grad_accum,
            loss_chunk: run.loss_chunk,
            attention_block: run.attention_block,
            key_block: (s.key_block != KeyBlocks::Auto).then_some(run.key_block),
            attention_scores: in_effect(s.attention_scores, s.dtype),
            matmul_result: in_effect(s.matmul_result, s.dtype),
            keep_softmax_stats: run.keep_softmax_stats,
            pin_mlp_activations: run.pin_mlp_activations,
            mesh: run.mesh,
            offload: s.offload.map(|o| o.name().to_string()),
            batch_size: Some(run.batch_size),
            seq: Some(run.seq),
        }
    }
}

/// A result-type flag's value as it is in effect with compute type `dtype`.
fn in_effect(r: ResultType, dtype: hlo::DType) -> String {
    r.in_effect(dtype).name().to_string()
}

/// Set the flag `flag` of `o` to `v`, a value recorded by [`RunSettings`] or
/// [`ProgramSettings`] (whose flags are [`RunSettings`]' too): `o`'s settings with that one
/// replaced, applied back.
fn apply(o: &mut TrainOptions, flag: &str, v: &Value) -> Result<()> {
    let mut all = by_flag(&RunSettings::of(o));
    if all.insert(flag.to_string(), v.clone()).is_none() {
        bail!("unknown recorded setting `{flag}`");
    }
    let settings: RunSettings = serde_json::from_value(Value::Object(all.into_iter().collect()))
        .map_err(|_| anyhow::anyhow!("recorded --{flag} {v} is not a valid value"))?;
    settings.apply_to(o)
}

/// Where a value in force came from, for messages.
#[derive(Default)]
pub struct Pinned(BTreeMap<String, String>);

impl Pinned {
    /// The flags given on the command line or by its `--config` recipe, each with where it came
    /// from ("the command line gives", "the recipe FILE gives").
    pub fn from_command_line(o: &TrainOptions) -> Pinned {
        Pinned(
            o.explicit
                .iter()
                .map(|f| (f.clone(), format!("{} gives", o.given_by(f))))
                .collect(),
        )
    }
}

/// Take `recorded` (from `source`, e.g. "checkpoint runs/x/checkpoint-10, whose run has") into
/// `o`: a flag that differs is refused if `pinned` (given on the command line, or fixed by an
/// earlier source), else set to the recorded value. `may_differ` names flags whose difference is
/// allowed (said in `notes`). `spec` is the program dir's, when `recorded` is what it fixes.
/// Returns the flags taken, as `--flag value`.
fn reconcile(
    o: &mut TrainOptions,
    recorded: &Settings,
    source: &str,
    pinned: &mut Pinned,
    may_differ: &dyn Fn(&str) -> bool,
    spec: Option<&StepSpec>,
    notes: &mut Vec<String>,
) -> Result<Vec<String>> {
    // A program dir's flags are compared as its spec has them, a checkpoint's as a run's.
    let now = |o: &TrainOptions| match spec {
        Some(_) => by_flag(&ProgramSettings::of_options(o)),
        None => of_run(o),
    };
    let mut taken = Vec::new();
    for (flag, want) in recorded {
        let current = now(o);
        let Some(have) = current.get(flag) else {
            continue;
        };
        if have == want || numerically_equal(have, want) {
            pinned
                .0
                .entry(flag.clone())
                .or_insert_with(|| source.to_string());
            continue;
        }
        if let Some(by) = pinned.0.get(flag) {
            if may_differ(flag) {
                let by = by.strip_suffix(" gives").unwrap_or(by);
                notes.push(format!(
                    "--{flag} {} ({by}) instead of the recorded --{flag} {} ({source})",
                    show(have),
                    show(want)
                ));
                continue;
            }
            bail!(
                "{source} --{flag} {}, but {by} --{flag} {} (leave the flag out to take the recorded value)",
                show(want),
                show(have)
            );
        }
        apply(o, flag, want).with_context(|| format!("{source} --{flag} {}", show(want)))?;
        if let (Some(spec), "mesh") = (spec, flag.as_str()) {
            // The program's mesh with the sharding rules it was built with.
            o.step.mesh = spec.mesh.clone();
        }
        taken.push(format!("--{flag} {}", show(want)));
        pinned.0.insert(flag.clone(), source.to_string());
        o.taken_from.insert(flag.clone(), source.to_string());
    }
    Ok(taken)
}

fn numerically_equal(a: &Value, b: &Value) -> bool {
    matches!((a.as_f64(), b.as_f64()), (Some(x), Some(y)) if x == y)
}

/// What a checkpoint records, by flag: its `settings` when it has them; for a checkpoint of an
/// earlier xtrain, what its schedule, seed and adapter config say.
pub fn recorded_in(state: &TrainerState, ckpt: &Path) -> Result<Settings> {
    let mut m = state.settings.clone();
    if m.is_empty() {
        let s = &state.schedule;
        m.insert("seed".into(), json!(state.seed));
        m.insert("lr".into(), json!(s.lr));
        m.insert("warmup".into(), json!(s.warmup));
        m.insert("schedule".into(), json!(s.kind));
        m.insert("min-lr-ratio".into(), json!(s.min_ratio));
        m.insert("steps".into(), json!(s.total));
    }
    let c = crate::formats::peft::read_config(ckpt)?;
    m.insert("lora-r".into(), json!(c.r));
    m.insert("lora-alpha".into(), json!(c.alpha));
    m.insert("lora-dropout".into(), json!(c.dropout));
    m.insert("lora-targets".into(), json!(Projection::list(&c.targets)));
    Ok(m)
}

/// Settle the options of a run that takes a program dir and/or resumes a checkpoint: every
/// flag left at its default takes the recorded value, every flag given must agree with it. The
/// flags taken are added to `notes`, for the run to say once it starts.
pub fn settle(
    o: &mut TrainOptions,
    cfg: &crate::model::config::LlamaConfig,
    notes: &mut Vec<String>,
) -> Result<()> {
    let mut pinned = Pinned::from_command_line(o);
    if let Some(dir) = o.program.clone() {
        let (_, spec) = crate::formats::program_dir::read_dir_for_model(&dir, cfg, &o.model)?;
        // A .safetensors batch has the shape it has; the program's check against it comes later.
        let batch_file = o.data.is_batch_file();
        let mut fixed = ProgramSettings::of_spec(&spec);
        if batch_file {
            (fixed.batch_size, fixed.seq) = (None, None);
        }
        let fixed = by_flag(&fixed);
        let source = format!("program dir {} was built with", dir.display());
        let taken = reconcile(
            o,
            &fixed,
            &source,
            &mut pinned,
            &|_| false,
            Some(&spec),
            notes,
        )?;
        note(&taken, &format!("program dir {}", dir.display()), notes);
    }
    if let (Some(dir), None) = (o.init_adapter.clone(), &o.program) {
        // The adapter's rank, alpha and targets for the flags left out, as a checkpoint's are
        // for `--resume`; a flag given must agree with the adapter (checked when it is read).
        let c = crate::formats::peft::read_config(&dir)?;
        let lora = &mut o.step.lora;
        let mut taken = Vec::new();
        if !o.explicit.contains("lora-r") && lora.r != c.r {
            lora.r = c.r;
            taken.push(format!("--lora-r {}", c.r));
        }
        if !o.explicit.contains("lora-alpha") && (lora.alpha - c.alpha).abs() > 1e-9 {
            lora.alpha = c.alpha;
            taken.push(format!("--lora-alpha {}", c.alpha));
        }
        if !o.explicit.contains("lora-targets") && lora.targets != c.targets {
            lora.targets = c.targets.clone();
            taken.push(format!(
                "--lora-targets {}",
                crate::model::lora::Projection::list(&c.targets)
            ));
        }
        note(&taken, &format!("--init-adapter {}", dir.display()), notes);
    }
    if let Some(ckpt) = o.resume.clone() {
        let state = crate::train::checkpoint::read_state(&ckpt)?;
        let mut recorded = recorded_in(&state, &ckpt)?;
        if o.data.is_batch_file() {
            // The batch file's shape is checked against the recorded one once it is read.
            recorded.remove("batch-size");
            recorded.remove("seq");
        }
        // The paths were taken (or checked) before the model was read.
        for flag in PATH_FLAGS {
            recorded.remove(*flag);
        }
        let constant = recorded.get("schedule").and_then(|v| v.as_str()) == Some("constant");
        let source = format!("checkpoint {}'s run has", ckpt.display());
        let mut taken = reconcile(
            o,
            &recorded,
            &source,
            &mut pinned,
            // With a constant learning rate, a run may be extended (or shortened); the layout
            // and the reporting may change.
            &|f| constant && (f == "steps" || f == "epochs") || LAYOUT_AND_REPORTING.contains(&f),
            None,
            notes,
        )?;
        // `--epochs` given for a run that recorded `--steps`: the epochs set the length, as they
        // do in a new run where only they are given (the recorded steps would outvote them).
        let recorded_epochs = recorded.get("epochs").and_then(|v| v.as_u64());
        if constant
            && o.given("epochs")
            && !o.given("steps")
            && o.steps > 0
            && recorded_epochs != Some(o.epochs)
        {
            taken.retain(|t| !t.starts_with("--steps "));
            notes.push(format!(
                "--epochs {} sets the resumed run's length instead of its recorded --steps {}",
                o.epochs, o.steps
            ));
            o.steps = 0;
        }
        note(&taken, &format!("checkpoint {}", ckpt.display()), notes);
    }
    Ok(())
}

/// `--resume CHECKPOINT`: take the paths its run recorded ([`PATH_FLAGS`]) for the flags left
/// out, so that `xtrain train --resume CHECKPOINT` alone continues the run. A recorded path
/// that no longer exists is refused, naming it, unless the flag gives where it is now. A model
/// or data given on the command line must be the recorded one where that still exists; the
/// evaluation data, the output dir and the program dir may be others (said). The output dir left
/// out is the checkpoint's own run dir ([`own_run_dir`]).
pub fn take_recorded_paths(o: &mut TrainOptions, notes: &mut Vec<String>) -> Result<()> {
    let Some(ckpt) = o.resume.clone() else {
        return Ok(());
    };
    let state = crate::train::checkpoint::read_state(&ckpt)?;
    let c = ckpt.display();
    let mut taken = Vec::new();
    for flag in PATH_FLAGS {
        let given: Option<PathBuf> = match *flag {
            "model" => Some(o.model.clone()),
            "data" => Some(o.data.path.clone()),
            "eval-data" => o.data.eval_data.clone(),
            "out" => Some(o.out.clone()),
            _ => o.program.clone(),
        }
        .filter(|p| !p.as_os_str().is_empty());
        let recorded = state
            .settings
            .get(*flag)
            .and_then(|v| v.as_str())
            .map(PathBuf::from);
        if *flag == "out" && given.is_none() {
            if let Some(own) = own_run_dir(&ckpt) {
                take_own_run_dir(o, own, recorded, &mut taken, notes, &c.to_string());
                continue;
            }
        }
        let Some(recorded) = recorded else {
            if given.is_none() && ["model", "data", "out"].contains(flag) {
                bail!(
                    "--{flag} is needed: checkpoint {c} does not record its run's --{flag} (it was written by an earlier xtrain); give --{flag}"
                );
            }
            continue;
        };
        let none = recorded.as_os_str().is_empty();
        let exists = !none && recorded.exists();
        match given {
            None if none => {}
            None if exists => {
                taken.push(format!("--{flag} {}", recorded.display()));
                set_path(o, flag, recorded);
            }
            None => {
                let own_dir = if *flag == "out" {
                    ckpt.parent()
                        .map(|d| format!(" (the checkpoint is in {})", d.display()))
                        .unwrap_or_default()
                } else {
                    String::new()
                };
                bail!(
                    "checkpoint {c}'s run has --{flag} {}, which does not exist now (moved or deleted?); give --{flag} with where it is{own_dir}",
                    recorded.display()
                );
            }
            Some(g) => {
                let same = exists
                    && matches!((g.canonicalize(), recorded.canonicalize()), (Ok(a), Ok(b)) if a == b);
                if same {
                    continue;
                }
                let by = o.given_by(flag);
                if ["model", "data"].contains(flag) && exists {
                    bail!(
                        "checkpoint {c}'s run has --{flag} {}, but {by} gives --{flag} {} (leave the flag out to take the recorded value)",
                        recorded.display(),
                        g.display()
                    );
                }
                let was = if none {
                    "none".to_string()
                } else if exists {
                    recorded.display().to_string()
                } else {
                    format!("{}, which does not exist now", recorded.display())
                };
                notes.push(format!(
                    "--{flag} {} ({by}) instead of the recorded --{flag} {was} (checkpoint {c})",
                    g.display()
                ));
            }
        }
    }
    note(&taken, &format!("checkpoint {c}"), notes);
    Ok(())
}

/// The run dir a checkpoint belongs to: the directory it is in. That, not the `--out` its run
/// recorded, is the run's identity: a run dir copied (or moved) elsewhere is continued where it
/// is now, and the original is left alone.
fn own_run_dir(ckpt: &Path) -> Option<PathBuf> {
    let parent = ckpt.parent()?;
    let dir = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    dir.is_dir().then(|| dir.to_path_buf())
}

/// `--out` left out on `--resume`: the checkpoint's own run dir, said as taken from the
/// checkpoint where it is the recorded one, and as what it is where it is not.
fn take_own_run_dir(
    o: &mut TrainOptions,
    own: PathBuf,
    recorded: Option<PathBuf>,
    taken: &mut Vec<String>,
    notes: &mut Vec<String>,
    ckpt: &str,
) {
    let same =
        |r: &Path| matches!((r.canonicalize(), own.canonicalize()), (Ok(a), Ok(b)) if a == b);
    match recorded {
        Some(r) if same(&r) => taken.push(format!("--out {}", r.display())),
        Some(r) if !r.as_os_str().is_empty() => notes.push(format!(
            "--out {} (the run dir checkpoint {ckpt} is in) instead of the recorded --out {} (the run was copied or moved)",
            own.display(),
            r.display()
        )),
        _ => notes.push(format!(
            "--out {} (the run dir checkpoint {ckpt} is in)",
            own.display()
        )),
    }
    o.out = own;
}

fn set_path(o: &mut TrainOptions, flag: &str, p: PathBuf) {
    match flag {
        "model" => o.model = p,
        "data" => o.data.path = p,
        "eval-data" => o.data.eval_data = Some(p),
        "out" => o.out = p,
        _ => o.program = Some(p),
    }
}

fn note(taken: &[String], from: &str, notes: &mut Vec<String>) {
    if !taken.is_empty() {
        notes.push(format!("taking {} from {from}", taken.join(", ")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Columns, DataOptions};
    use crate::model::lora::LoraConfig;
    use crate::program::StepOptions;

    /// Options whose every recorded value differs from the fixture's, so that taking a value
    /// shows.
    fn options() -> TrainOptions {
        TrainOptions {
            model: "m".into(),
            data: DataOptions {
                path: "d.jsonl".into(),
                batch_size: 8,
                seq: 64,
                pack: false,
                train_on_prompt: true,
                skip_bad_lines: true,
                strict_length: true,
                eval_fraction: 0.5,
                eval_data: None,
                columns: Columns::new(Some("t".into()), Some("m".into())),
            },
            step: StepOptions {
                lora: LoraConfig {
                    r: 2,
                    alpha: 3.0,
                    dropout: 0.25,
                    targets: vec![Projection::Q],
                },
                adam: crate::model::optim::AdamW {
                    beta1: 0.5,
                    beta2: 0.75,
                    eps: 0.125,
                    weight_decay: 0.5,
                    max_grad_norm: 2.0,
                },
                dtype: hlo::DType::BF16,
                remat: Some(Remat::SaveProj),
                grad_accum: 2,
                mesh: Some(MeshPlan {
                    axes: vec![("fsdp".into(), 2)],
                    rules: sharding::Rules::default(),
                }),
                quant: Quant::Nf4,
                loss_chunk: Some(8),
                attention_block: None,
                key_block: KeyBlocks::Off,
                matmul_result: ResultType::Compute,
                attention_scores: ResultType::F32,
                keep_softmax_stats: true,
                pin_mlp_activations: true,
                offload: Some(Offload::NONE),
            },
            init_adapter: None,
            steps: 9,
            epochs: 3,
            lr: 0.5,
            warmup: 4,
            schedule: "cosine".into(),
            min_lr_ratio: 0.5,
            program: None,
            use_cache: true,
            eval_every: 7,
            save_every: 7,
            resume: None,
            out: "o".into(),
            overwrite: false,
            seed: 7,
            plugin: Some("cuda".into()),
            verbose: false,
            log_every: 7,
            plot: false,
            peak_tflops: Some(1.0),
            stop_after: None,
            skip_nonfinite: true,
            explicit: Default::default(),
            recipe: None,
            sharding_rules: None,
            taken_from: Default::default(),
            kernels: Vec::new(),
            launch: Default::default(),
        }
    }

    /// The settings of a checkpoint as xtrain wrote them on 2026-12-03: each is a flag of
    /// [`RunSettings`] with a value of its type, and taken one by one (as a resumed run takes
    /// them) the options then record every one of them as it was.
    #[test]
    fn a_checkpoint_written_before_the_typed_settings_is_taken_whole() {
        let state: TrainerState = serde_json::from_str(include_str!(
            "../../tests/fixtures/formats-2026-12-03/trainer_state.json"
        ))
        .unwrap();
        let recorded = &state.settings;
        let mut o = options();
        for (flag, v) in recorded {
            if !PATH_FLAGS.contains(&flag.as_str()) {
                apply(&mut o, flag, v).unwrap_or_else(|e| panic!("--{flag} {v}: {e:#}"));
            }
        }
        let now = of_run(&o);
        assert_eq!(
            now.keys().collect::<Vec<_>>(),
            recorded.keys().collect::<Vec<_>>()
        );
        for (flag, v) in recorded {
            if !PATH_FLAGS.contains(&flag.as_str()) {
                assert!(
                    &now[flag] == v || numerically_equal(&now[flag], v),
                    "--{flag}: recorded {v}, now {}",
                    now[flag]
                );
            }
        }
    }

    /// A setting of another type, or one no flag has, is refused naming it.
    #[test]
    fn a_recorded_value_of_another_type_or_flag_is_refused() {
        let mut o = options();
        let e = format!("{:#}", apply(&mut o, "lora-r", &json!("four")).unwrap_err());
        assert!(e.contains("--lora-r \"four\" is not a valid value"), "{e}");
        let e = format!("{:#}", apply(&mut o, "lora-rank", &json!(4)).unwrap_err());
        assert!(e.contains("unknown recorded setting `lora-rank`"), "{e}");
        // The options are as they were.
        assert_eq!(of_run(&o), of_run(&options()));
    }
}

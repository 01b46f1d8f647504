//! The settings that define a run, by the flag that sets them (`lora-alpha`, `lr`, `steps`, ...),
//! as recorded in every checkpoint (`trainer_state.json`) and as a program dir fixes them. A
//! resumed run (`--resume`) or a run of a compiled program (`--program`) takes every recorded
//! value for a flag left at its default, and refuses a flag given with another value, naming
//! both: a run never continues with another alpha, schedule or batch than the one it started
//! with, and never trains another rank than the one its program was built for.

use crate::model::lora::Target;
use crate::program::{sharding, KeyBlocks, MeshPlan, Remat, ResultType, StepSpec};
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

fn quant_text(nf4: bool) -> &'static str {
    if nf4 {
        "nf4"
    } else {
        "none"
    }
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

/// What a run records in its checkpoints, by flag: every setting of the run. What decides its
/// result (the model and data, the adapter, the optimizer, the schedule, the numerics, the
/// seed), how it is laid out on devices ([`LAYOUT_AND_REPORTING`]: mesh, remat, chunks,
/// plugin, program dir) and how it reports (output dir, evaluation data, saving, evaluation and
/// logging cadence), so that `xtrain train --resume CHECKPOINT` alone continues the run as it
/// was started. Paths are absolute.
pub fn of_run(o: &TrainOptions) -> Settings {
    let s = &o.step;
    let mut m = Settings::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("model", json!(path_text(Some(&o.model))));
    put("data", json!(path_text(Some(&o.data.path))));
    put("eval-data", json!(path_text(o.data.eval_data.as_deref())));
    put("out", json!(path_text(Some(&o.out))));
    put("program", json!(path_text(o.program.as_deref())));
    put("seed", json!(o.seed));
    put("lora-r", json!(s.lora.r));
    put("lora-alpha", json!(s.lora.alpha));
    put("lora-dropout", json!(s.lora.dropout));
    put("lora-targets", json!(Target::list(&s.lora.targets)));
    put("lr", json!(o.lr));
    put("warmup", json!(o.warmup));
    put("schedule", json!(o.schedule));
    put("min-lr-ratio", json!(o.min_lr_ratio));
    put("steps", json!(o.steps));
    put("epochs", json!(o.epochs));
    put("betas", json!(format!("{},{}", s.adam.beta1, s.adam.beta2)));
    put("eps", json!(s.adam.eps));
    put("weight-decay", json!(s.adam.weight_decay));
    put("max-grad-norm", json!(s.adam.max_grad_norm));
    put("dtype", json!(s.dtype.mlir()));
    put("quant", json!(quant_text(s.nf4)));
    put("batch-size", json!(o.data.batch_size));
    put("seq", json!(o.data.seq));
    put("no-pack", json!(!o.data.pack));
    put("train-on-prompt", json!(o.data.train_on_prompt));
    put("skip-bad-lines", json!(o.data.skip_bad_lines));
    put("strict-length", json!(o.data.strict_length));
    put("text-column", json!(o.data.columns.text));
    put("messages-column", json!(o.data.columns.messages));
    put("eval-fraction", json!(o.data.eval_fraction));
    put("skip-nonfinite-steps", json!(o.skip_nonfinite));
    // Layout.
    put("remat", json!(s.remat.map_or("auto", |r| r.name())));
    put("offload", json!(s.offload.map_or("auto", |o| o.name())));
    put("grad-accum", json!(s.microbatches));
    put("loss-chunk", json!(s.loss_chunk));
    put("attention-block", json!(s.attention_block));
    put("key-block", json!(s.key_block.name()));
    put("mesh", json!(mesh_text(&s.mesh)));
    put(
        "sharding-rules",
        json!(path_text(o.sharding_rules.as_deref())),
    );
    put("matmul-result", json!(s.matmul_result.name()));
    put("attention-scores", json!(s.attention_scores.name()));
    put("keep-softmax-stats", json!(s.keep_softmax_stats));
    put("pin-mlp-activations", json!(s.pin_mlp_activations));
    put("plugin", json!(o.plugin.clone().unwrap_or_default()));
    // Reporting.
    put("save-every", json!(o.save_every));
    put("eval-every", json!(o.eval_every));
    put("log-every", json!(o.log_every));
    put("no-plot", json!(!o.plot));
    put("peak-tflops", json!(o.peak_tflops));
    m
}

/// The settings of the flags a program dir fixes, as it was built.
pub fn of_spec(spec: &StepSpec) -> Settings {
    let mut m = Settings::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("lora-r", json!(spec.lora.r));
    put("lora-alpha", json!(spec.lora.alpha));
    put("lora-dropout", json!(spec.lora.dropout));
    put("lora-targets", json!(Target::list(&spec.lora.targets)));
    put(
        "betas",
        json!(format!("{},{}", spec.adam.beta1, spec.adam.beta2)),
    );
    put("eps", json!(spec.adam.eps));
    put("weight-decay", json!(spec.adam.weight_decay));
    put("max-grad-norm", json!(spec.adam.max_grad_norm));
    put("dtype", json!(spec.weight_dtype.mlir()));
    put("quant", json!(quant_text(spec.nf4)));
    put("remat", json!(spec.remat.name()));
    put("grad-accum", json!(spec.microbatches));
    put("loss-chunk", json!(spec.loss_chunk));
    put("attention-block", json!(spec.attention_block));
    put(
        "key-block",
        json!(spec.key_block.map_or("off".to_string(), |k| k.to_string())),
    );
    // The program's form, as its flags give it (with f32 compute, f32 and compute are one).
    let bf16 = spec.compute_dtype != hlo::DType::F32;
    put(
        "attention-scores",
        json!(if spec.narrow_attention_scores || !bf16 {
            "compute"
        } else {
            "f32"
        }),
    );
    put(
        "matmul-result",
        json!(if spec.wide_matmul_results || !bf16 {
            "f32"
        } else {
            "compute"
        }),
    );
    put("keep-softmax-stats", json!(spec.layer_keeps_softmax_stats));
    put("pin-mlp-activations", json!(spec.pin_mlp_activations));
    put("mesh", json!(mesh_text(&spec.mesh)));
    put("offload", json!(spec.offload.name()));
    put("batch-size", json!(spec.batch));
    put("seq", json!(spec.seq));
    m
}

/// The same flags' values in `o`, to compare with [`of_spec`].
fn of_options_for_spec(o: &TrainOptions) -> Settings {
    let s = &o.step;
    let of_spec_flags = [
        "lora-r",
        "lora-alpha",
        "lora-dropout",
        "lora-targets",
        "betas",
        "eps",
        "weight-decay",
        "max-grad-norm",
        "dtype",
        "quant",
        "batch-size",
        "seq",
    ];
    let mut m = of_run(o);
    m.retain(|k, _| of_spec_flags.contains(&k.as_str()));
    m.insert("grad-accum".into(), json!(s.microbatches));
    m.insert("loss-chunk".into(), json!(s.loss_chunk));
    m.insert("attention-block".into(), json!(s.attention_block));
    m.insert("mesh".into(), json!(mesh_text(&s.mesh)));
    // `--key-block auto` (the default) accepts what the program was built with.
    if s.key_block != KeyBlocks::Auto {
        m.insert("key-block".into(), json!(s.key_block.name()));
    }
    // With f32 compute, f32 and compute are one type: the flags are then whatever was built.
    let bf16 = s.dtype != hlo::DType::F32;
    let result = |r: ResultType, as_f32: &'static str| if bf16 { r.name() } else { as_f32 };
    m.insert(
        "attention-scores".into(),
        json!(result(s.attention_scores, "compute")),
    );
    m.insert(
        "matmul-result".into(),
        json!(result(s.matmul_result, "f32")),
    );
    m.insert("keep-softmax-stats".into(), json!(s.keep_softmax_stats));
    m.insert("pin-mlp-activations".into(), json!(s.pin_mlp_activations));
    // `--remat auto` and `--offload auto` (the defaults) accept what the program was built with.
    if let Some(r) = s.remat {
        m.insert("remat".into(), json!(r.name()));
    }
    if let Some(o) = s.offload {
        m.insert("offload".into(), json!(o.name()));
    }
    m
}

/// Set the flag `flag` of `o` to `v` (a value [`of_run`] or [`of_spec`] wrote).
fn apply(o: &mut TrainOptions, flag: &str, v: &Value, spec: Option<&StepSpec>) -> Result<()> {
    let bad = || anyhow::anyhow!("recorded --{flag} {v} is not a valid value");
    let f64_ = || v.as_f64().ok_or_else(bad);
    let u64_ = || v.as_u64().ok_or_else(bad);
    let i64_ = || v.as_i64().ok_or_else(bad);
    let bool_ = || v.as_bool().ok_or_else(bad);
    let str_ = || v.as_str().ok_or_else(bad);
    let s = &mut o.step;
    match flag {
        "seed" => o.seed = u64_()?,
        "lora-r" => s.lora.r = i64_()?,
        "lora-alpha" => s.lora.alpha = f64_()?,
        "lora-dropout" => s.lora.dropout = f64_()?,
        "lora-targets" => s.lora.targets = Target::parse_list(str_()?)?,
        "lr" => o.lr = f64_()?,
        "warmup" => o.warmup = u64_()?,
        "schedule" => o.schedule = str_()?.to_string(),
        "min-lr-ratio" => o.min_lr_ratio = f64_()?,
        "steps" => o.steps = u64_()?,
        "epochs" => o.epochs = u64_()?,
        "betas" => {
            let (a, b) = str_()?.split_once(',').ok_or_else(bad)?;
            s.adam.beta1 = a.parse().map_err(|_| bad())?;
            s.adam.beta2 = b.parse().map_err(|_| bad())?;
        }
        "eps" => s.adam.eps = f64_()?,
        "weight-decay" => s.adam.weight_decay = f64_()?,
        "max-grad-norm" => s.adam.max_grad_norm = f64_()?,
        "dtype" => s.dtype = crate::program::parse_dtype(str_()?)?,
        "quant" => s.nf4 = str_()? == "nf4",
        "batch-size" => o.data.batch_size = i64_()?,
        "seq" => o.data.seq = i64_()?,
        "no-pack" => o.data.pack = !bool_()?,
        "train-on-prompt" => o.data.train_on_prompt = bool_()?,
        "skip-bad-lines" => o.data.skip_bad_lines = bool_()?,
        "eval-fraction" => o.data.eval_fraction = f64_()?,
        "strict-length" => o.data.strict_length = bool_()?,
        "text-column" => o.data.columns.text = str_()?.to_string(),
        "messages-column" => o.data.columns.messages = str_()?.to_string(),
        "skip-nonfinite-steps" => o.skip_nonfinite = bool_()?,
        "sharding-rules" => {
            let path = str_()?;
            o.sharding_rules = (!path.is_empty()).then(|| path.into());
            let rules = match &o.sharding_rules {
                Some(p) => sharding::Rules::load(p)?,
                None => sharding::Rules::default(),
            };
            if let Some(m) = &mut s.mesh {
                m.rules = rules;
            }
        }
        "plugin" => {
            let p = str_()?;
            o.plugin = (!p.is_empty()).then(|| p.to_string());
        }
        "save-every" => o.save_every = u64_()?,
        "eval-every" => o.eval_every = u64_()?,
        "log-every" => o.log_every = u64_()?,
        "no-plot" => o.plot = !bool_()?,
        "peak-tflops" => o.peak_tflops = v.as_f64(),
        "remat" => s.remat = Remat::parse_choice(str_()?)?,
        "grad-accum" => s.microbatches = i64_()?,
        "loss-chunk" => s.loss_chunk = v.as_i64(),
        "attention-block" => s.attention_block = v.as_i64(),
        "key-block" => s.key_block = KeyBlocks::parse(str_()?)?,
        "attention-scores" => s.attention_scores = ResultType::parse("attention-scores", str_()?)?,
        "matmul-result" => s.matmul_result = ResultType::parse("matmul-result", str_()?)?,
        "keep-softmax-stats" => s.keep_softmax_stats = bool_()?,
        "pin-mlp-activations" => s.pin_mlp_activations = bool_()?,
        "offload" => s.offload = crate::program::Offload::parse_choice(str_()?)?,
        "mesh" => {
            s.mesh = match spec {
                Some(spec) => spec.mesh.clone(),
                None => {
                    let m = sharding::parse_mesh(str_()?)?;
                    (!m.axes.is_empty()).then(|| MeshPlan {
                        axes: m.axes,
                        rules: sharding::Rules::default(),
                    })
                }
            }
        }
        other => bail!("unknown recorded setting `{other}`"),
    }
    Ok(())
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
    let now = if spec.is_some() {
        of_options_for_spec
    } else {
        of_run
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
        apply(o, flag, want, spec).with_context(|| format!("{source} --{flag} {}", show(want)))?;
        taken.push(format!("--{flag} {}", show(want)));
        pinned.0.insert(flag.clone(), source.to_string());
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
    m.insert("lora-targets".into(), json!(Target::list(&c.targets)));
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
        let mut fixed = of_spec(&spec);
        if batch_file {
            fixed.remove("batch-size");
            fixed.remove("seq");
        }
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
                crate::model::lora::Target::list(&c.targets)
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

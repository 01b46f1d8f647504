//! Settling a run's options against what a program dir fixes and a checkpoint recorded: each
//! flag left out takes the recorded value, each flag given must agree (or is said to differ).

use super::program::ProgramSettings;
use super::run::{apply, by_flag, of_run, show, LAYOUT_AND_REPORTING, PATH_FLAGS};
use crate::model::lora::Projection;
use crate::program::StepSpec;
use crate::train::checkpoint::{Settings, TrainerState};
use crate::train::options::TrainOptions;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

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
    // Computed once, and again only after a recorded value is taken into `o`.
    let mut current = now(o);
    for (flag, want) in recorded {
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
        current = now(o);
        taken.push(format!("--{flag} {}", show(want)));
        pinned.0.insert(flag.clone(), source.to_string());
        o.taken_from.insert(flag.clone(), source.to_string());
    }
    Ok(taken)
}

pub(super) fn numerically_equal(a: &Value, b: &Value) -> bool {
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

pub(super) fn note(taken: &[String], from: &str, notes: &mut Vec<String>) {
    if !taken.is_empty() {
        notes.push(format!("taking {} from {from}", taken.join(", ")));
    }
}

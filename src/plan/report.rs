//! What `xtrain plan` says and writes: the ranked table, `plan.json` (the pick, every point
//! with its outcome and figures, the method) and `recipe.toml`, the pick as a `--config` recipe
//! that `xtrain compile` and `xtrain train` take as they are.

use super::options::{Plan, PlanOptions, SeqGoal};
use super::search::{Outcome, Point};
use crate::words::{duration, gib};
use anyhow::Result;
use serde_json::{json, Value};
use std::path::Path;

/// The table of the points that fit, best first, and a line on what else was found.
pub fn print_table(plan: &Plan) {
    let time = match plan.by_estimate {
        true => "TPU estimate",
        false => "model (not measured)",
    };
    let pairs = plan
        .points
        .iter()
        .find_map(|p| p.spec.as_ref())
        .is_some_and(|s| s.dpo.is_some());
    crate::say!(
        "plan for {}: {} tokens x {} {} per step, device memory limit {}",
        plan.target,
        plan.seq,
        plan.batch_size,
        if pairs {
            "preference pairs (two rows each)"
        } else {
            "rows"
        },
        gib(plan.limit_bytes)
    );
    // The settings column as wide as its longest line, so the figures line up.
    let w = plan
        .ranked
        .iter()
        .map(|&i| plan.points[i].knobs.line().len())
        .max()
        .unwrap_or(0)
        .max(72);
    crate::say!(
        "{:>4}  {:<w$} {:>22} {:>10} {:>22} {:>11}  binding",
        "rank",
        "settings",
        "device of limit",
        "host",
        time,
        "tokens/s"
    );
    for (rank, &i) in plan.ranked.iter().enumerate() {
        let p = &plan.points[i];
        let f = p.figures.as_ref().expect("a point that fits was compiled");
        let seconds = step_seconds(plan, p);
        crate::say!(
            "{:>4}  {:<w$} {:>22} {:>10} {:>22} {:>11}  {}",
            rank + 1,
            p.knobs.line(),
            format!("{} of {}", gib(f.device_bytes), gib(plan.limit_bytes)),
            gib(f.host_bytes),
            seconds.map_or("-".into(), duration),
            seconds.map_or("-".into(), |s| format!("{:.0}", tokens(plan) / s)),
            binding(plan, p)
        );
    }
    let count = |o: fn(&Outcome) -> bool| plan.points.iter().filter(|p| o(&p.outcome)).count();
    crate::say!(
        "{} points: {} fit, {} do not, {} skipped by the bound, {} by smaller microbatches that \
         do not fit, {} refused by the step's checks, {} not compiled (ranked below those that \
         fit)",
        plan.points.len(),
        count(|o| *o == Outcome::Fits),
        count(|o| *o == Outcome::DoesNotFit),
        count(|o| *o == Outcome::AboveBound),
        count(|o| matches!(o, Outcome::LargerThan(_))),
        count(|o| matches!(o, Outcome::Refused(_))),
        count(|o| *o == Outcome::Unexplored),
    );
    if let Some(p) = plan.chosen() {
        crate::say!("pick: {}", p.knobs.line());
    }
}

/// Why nothing fits, for the error `plan` ends with: the step's refusals (each distinct reason
/// once, with how many points it refused) and the smallest memory the compiled points need.
pub fn nothing_fits(plan: &Plan, wrote: Option<&Path>) -> String {
    let mut reasons: Vec<(String, usize)> = Vec::new();
    for p in &plan.points {
        if let Outcome::Refused(why) = &p.outcome {
            match reasons.iter_mut().find(|(r, _)| r == why) {
                Some((_, n)) => *n += 1,
                None => reasons.push((why.clone(), 1)),
            }
        }
    }
    let mut said = format!(
        "nothing fits {} at {} tokens x {} rows",
        plan.target, plan.seq, plan.batch_size
    );
    let least = plan
        .points
        .iter()
        .filter_map(|p| p.figures.as_ref())
        .map(|f| f.device_bytes)
        .min();
    if let Some(b) = least {
        said += &format!(
            "; the least device memory a compiled point needs is {} of {}",
            gib(b),
            gib(plan.limit_bytes)
        );
    }
    let bound = plan
        .points
        .iter()
        .filter(|p| p.outcome == Outcome::AboveBound)
        .filter_map(|p| p.bound_bytes)
        .min();
    if let Some(b) = bound {
        said += &format!(
            "; the points not compiled need at least {} of {} by their lower bound",
            gib(b),
            gib(plan.limit_bytes)
        );
    }
    for (why, n) in reasons.iter().take(5) {
        let points = if *n == 1 { "point" } else { "points" };
        said += &format!("\n  the step's checks refused {n} {points}: {why}");
    }
    if reasons.len() > 5 {
        said += &format!("\n  and {} other reasons", reasons.len() - 5);
    }
    said += &match wrote {
        Some(dir) => format!("\nevery point is in {}", dir.join("plan.json").display()),
        None => "\n(--out DIR writes every point to DIR/plan.json)".into(),
    };
    if reasons.is_empty() {
        said += "; more devices, --quant nf4, offload or a shorter --seq (or --seq max) may fit";
    }
    said
}

/// Tokens per step, all devices together (a preference pair's two rows each).
fn tokens(plan: &Plan) -> f64 {
    let rows = plan
        .points
        .iter()
        .find_map(|p| p.spec.as_ref())
        .map_or(1, |s| s.rows_per_example());
    (plan.seq * plan.batch_size * rows) as f64
}

/// The step's time as the plan ranks it: the TPU estimate, or the GPU model's.
fn step_seconds(plan: &Plan, p: &Point) -> Option<f64> {
    match plan.by_estimate {
        true => p.estimate_s,
        false => p.modelled.map(|m| m.seconds),
    }
}

/// What binds a point: device memory where it does not fit, else the model's largest part.
fn binding(plan: &Plan, p: &Point) -> &'static str {
    match (&p.outcome, p.modelled) {
        (Outcome::Fits, _) if plan.by_estimate => "(TPU estimate)",
        (Outcome::Fits, Some(m)) => m.binding(),
        _ => "device memory",
    }
}

/// One point as plan.json has it.
fn point_json(plan: &Plan, p: &Point) -> Value {
    let flags: serde_json::Map<String, Value> = p
        .knobs
        .flags()
        .into_iter()
        .map(|(f, v)| (f.to_string(), Value::String(v)))
        .collect();
    let mut figures = json!({
        "fits": p.outcome == Outcome::Fits,
        "limit_gib": plan.limit_bytes as f64 / GIB,
    });
    if let Some(f) = &p.figures {
        figures["device_gib"] = json!(f.device_bytes as f64 / GIB);
        figures["host_gib"] = json!(f.host_bytes as f64 / GIB);
        figures["compile_s"] = json!(f.compile_s);
    }
    if let Some(b) = p.bound_bytes {
        figures["lower_bound_gib"] = json!(b as f64 / GIB);
    }
    if let Some(m) = p.modelled {
        figures["model_s"] = json!(m.seconds);
        figures["model"] = json!(m);
    }
    if let Some(e) = p.estimate_s {
        figures["estimate_s"] = json!(e);
    }
    if let Some(s) = step_seconds(plan, p).filter(|_| p.outcome == Outcome::Fits) {
        figures["tokens_per_s"] = json!(tokens(plan) / s);
    }
    json!({
        "flags": flags,
        "outcome": p.outcome.says(&plan.points),
        "figures": figures,
    })
}

const GIB: f64 = (1u64 << 30) as f64;

/// plan.json's text.
pub fn plan_json(o: &PlanOptions, plan: &Plan) -> Value {
    let chosen = plan.chosen().map(|p| point_json(plan, p));
    let mut ranked: Vec<usize> = plan.ranked.clone();
    ranked.extend((0..plan.points.len()).filter(|i| !plan.ranked.contains(i)));
    json!({
        "target": plan.target,
        "model": o.model_flag,
        "seq": plan.seq,
        "batch_size": plan.batch_size,
        "seq_max": match o.seq {
            SeqGoal::Max { step, upto } => json!({"step": step, "upto": upto, "longest": plan.seq, "probes": plan.probes}),
            SeqGoal::Fixed(_) => Value::Null,
        },
        "chosen": chosen,
        "candidates": ranked.iter().map(|&i| point_json(plan, &plan.points[i])).collect::<Vec<_>>(),
        "method": plan.method,
    })
}

/// The pick as a `--config` recipe: the model and its flags as given, the shapes and the
/// pick's settings at the top (both commands take them), the target under `[compile]`.
pub fn recipe(o: &PlanOptions, plan: &Plan, p: &Point) -> String {
    let spec = p.spec.as_ref().expect("the pick was built");
    let q = |s: &str| format!("{s:?}");
    let mut lines =
        vec![
            format!(
            "# Written by `xtrain plan` for {}: {} tokens x {} rows per step, {} of {} per device \
             by the target compiler's figures (not a run on the hardware).",
            plan.target,
            plan.seq,
            plan.batch_size,
            p.figures.as_ref().map_or("?".into(), |f| gib(f.device_bytes)),
            gib(plan.limit_bytes)
        ),
            "#   xtrain compile --config recipe.toml --check --out PROGRAM_DIR".into(),
            train_line(&o.model_flag),
            String::new(),
            format!("model = {}", q(&o.model_flag)),
            format!("dtype = {}", q(spec.dtype.mlir())),
            format!("quant = {}", q(spec.quant.name())),
            format!("lora_r = {}", spec.lora.r),
            format!("lora_alpha = {:?}", spec.lora.alpha),
            format!("lora_dropout = {:?}", spec.lora.dropout),
            format!(
                "lora_targets = {}",
                q(&crate::model::lora::Projection::list(&spec.lora.targets))
            ),
            format!("batch_size = {}", plan.batch_size),
            format!("seq = {}", plan.seq),
            format!("matmul_result = {}", q(o.step.matmul_result.name())),
            format!("attention_scores = {}", q(o.step.attention_scores.name())),
            format!("keep_softmax_stats = {}", spec.keep_softmax_stats),
            // The optimizer's constants are part of the step program, as the plan compiled it.
            format!(
                "betas = {}",
                q(&format!("{},{}", o.step.adam.beta1, o.step.adam.beta2))
            ),
            format!("eps = {:?}", o.step.adam.eps),
            format!("weight_decay = {:?}", o.step.adam.weight_decay),
            format!("max_grad_norm = {:?}", o.step.adam.max_grad_norm),
        ];
    // Preference training: the step the plan compiled is DPO's (batch_size counts pairs).
    if let Some(d) = &spec.dpo {
        lines.push(format!("method = {}", q("dpo")));
        lines.push(format!("beta = {:?}", d.beta));
        lines.push(format!("dpo_loss = {}", q(d.dpo_loss.name())));
        lines.push(format!("label_smoothing = {:?}", d.label_smoothing));
        lines.push(format!("reference = {}", q(d.reference.name())));
        lines.push(format!("precompute_reference = {}", d.precompute_reference));
    }
    if let Some(b) = spec.attention_block {
        lines.push(format!("attention_block = {b}"));
    }
    if spec.mesh.is_some() {
        lines.push(format!(
            "pin_mlp_activations = {}",
            spec.pin_mlp_activations
        ));
    }
    for (flag, value) in p.knobs.given() {
        let key = flag.replace('-', "_");
        match flag {
            "grad-accum" | "loss-chunk" => lines.push(format!("{key} = {value}")),
            _ => lines.push(format!("{key} = {}", q(&value))),
        }
    }
    if let Some(target) = &plan.target_flag {
        lines.push(String::new());
        lines.push("[compile]".into());
        lines.push(format!("target = {}", q(target)));
        if let Some(c) = &o.target_config {
            lines.push(format!("target_config = {}", q(&c.display().to_string())));
        }
    }
    lines.join("\n") + "\n"
}

/// The recipe's `xtrain train` line: a preset is a config without weights, so the train line
/// names a checkpoint (the preset's Hugging Face repo, or a directory) with --model.
fn train_line(model: &str) -> String {
    use crate::model::presets::{is_preset, REPO_PRESETS};
    match REPO_PRESETS
        .iter()
        .find(|(_, p)| is_preset(model) && *p == model)
    {
        Some((repo, _)) => format!(
            "#   xtrain train --config recipe.toml --model {repo} --data DATA   (the preset \
             `{model}` has no weights: --model gives them, a repo id or a directory)"
        ),
        None => "#   xtrain train --config recipe.toml --data DATA".into(),
    }
}

/// Write plan.json and recipe.toml (the latter only where something fits) into `out`, whole or
/// not at all.
pub fn write(out: &Path, o: &PlanOptions, plan: &Plan) -> Result<()> {
    let json = serde_json::to_string_pretty(&plan_json(o, plan))? + "\n";
    let recipe = plan.chosen().map(|p| recipe(o, plan, p));
    let replace = crate::formats::atomic::Replace::when(o.overwrite);
    crate::formats::atomic::write_dir_atomic_as(out, replace, |dir| {
        crate::formats::atomic::write_bytes_atomic(&dir.join("plan.json"), json.as_bytes())?;
        if let Some(r) = &recipe {
            crate::formats::atomic::write_bytes_atomic(&dir.join("recipe.toml"), r.as_bytes())?;
        }
        Ok(())
    })?;
    crate::say!(
        "wrote {}{}",
        out.join("plan.json").display(),
        match recipe {
            Some(_) => format!(" and {}", out.join("recipe.toml").display()),
            None => String::new(),
        }
    );
    Ok(())
}

//! What `xtrain plan` says and writes: the ranked table, `plan.json` (the pick, every point
//! with its outcome and figures, the method) and `recipe.toml`, the pick as a `--config` recipe
//! that `xtrain compile` and `xtrain train` take as they are.

use super::options::{Plan, PlanOptions, SeqGoal};
use super::search::{Outcome, Point};
use crate::words::{count, duration, gib};
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
    let l = &plan.limits;
    crate::say!(
        "plan for {}: {} tokens x {} per step; per device: device memory limit {} ({}), host \
         memory budget {} ({})",
        plan.target,
        plan.seq,
        match pairs {
            true => count(plan.batch_size as usize, "preference pair") + " (two rows each)",
            false => count(plan.batch_size as usize, "row"),
        },
        gib(l.device.bytes),
        l.device.source,
        gib(l.host.bytes),
        l.host.source
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
            format!("{} of {}", gib(f.device_bytes), gib(l.device.bytes)),
            gib(f.host_bytes),
            seconds.map_or("-".into(), duration),
            seconds.map_or("-".into(), |s| format!("{:.0}", tokens(plan) / s)),
            binding(plan, p)
        );
    }
    let n = |o: fn(&Outcome) -> bool| plan.points.iter().filter(|p| o(&p.outcome)).count();
    crate::say!(
        "{}: {} fit, {} do not, {} skipped by the bound, {} by a point that needs no \
         more memory and does not fit, {} refused by the step's checks, {} not compiled (ranked below those that \
         fit)",
        count(plan.points.len(), "point"),
        n(|o| *o == Outcome::Fits),
        n(|o| *o == Outcome::DoesNotFit),
        n(|o| *o == Outcome::AboveBound),
        n(|o| matches!(o, Outcome::Dominated(..))),
        n(|o| matches!(o, Outcome::Refused(_))),
        n(|o| *o == Outcome::Unexplored),
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
        "nothing fits {} at {} tokens x {}",
        plan.target,
        plan.seq,
        count(plan.batch_size as usize, "row")
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
            gib(plan.limits.device.bytes)
        );
    }
    let host = plan
        .points
        .iter()
        .filter_map(|p| p.figures.as_ref())
        .filter(|f| f.device_bytes <= plan.limits.device.bytes)
        .map(|f| f.host_bytes)
        .min();
    if let Some(h) = host {
        said += &format!(
            "; those within the device's limit need {} of host memory or more, over the \
             budget of {} ({})",
            gib(h),
            gib(plan.limits.host.bytes),
            plan.limits.host.source
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
            gib(plan.limits.device.bytes)
        );
    }
    for (why, n) in reasons.iter().take(5) {
        said += &format!(
            "\n  the step's checks refused {}: {why}",
            count(*n, "point")
        );
    }
    if reasons.len() > 5 {
        said += &format!("\n  and {} more", count(reasons.len() - 5, "reason"));
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
        false => p
            .modelled
            .filter(|_| plan.rates.is_some())
            .map(|m| m.seconds),
    }
}

/// What binds a point: device memory where it does not fit, else the model's largest part.
fn binding(plan: &Plan, p: &Point) -> &'static str {
    match (&p.outcome, p.modelled) {
        (Outcome::Fits, _) if plan.by_estimate => "(TPU estimate)",
        (Outcome::Fits, _) if plan.rates.is_none() => "(no peak known: no time modelled)",
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
        "limit_gib": plan.limits.device.bytes as f64 / GIB,
        "host_limit_gib": plan.limits.host.bytes as f64 / GIB,
    });
    if let Some(f) = &p.figures {
        figures["device_gib"] = json!(f.device_bytes as f64 / GIB);
        figures["host_gib"] = json!(f.host_bytes as f64 / GIB);
        figures["compile_s"] = json!(f.compile_s);
        if let Some(l) = &f.launches {
            figures["launches"] = json!(l);
        }
    }
    if let Some(b) = p.bound_bytes {
        figures["lower_bound_gib"] = json!(b as f64 / GIB);
    }
    if let Some(b) = p.host_bound_bytes {
        figures["host_lower_bound_gib"] = json!(b as f64 / GIB);
    }
    if let Some(m) = p.modelled {
        if plan.rates.is_some() {
            figures["model_s"] = json!(m.seconds);
            figures["model"] = json!(m);
        }
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
        "limits": {
            "device_gib": plan.limits.device.bytes as f64 / GIB,
            "device_from": plan.limits.device.source,
            "host_gib": plan.limits.host.bytes as f64 / GIB,
            "host_from": plan.limits.host.source,
        },
        "seq_max": match o.seq {
            SeqGoal::Max { step, upto } => json!({"step": step, "upto": upto, "longest": plan.seq, "probes": plan.probes}),
            SeqGoal::Fixed(_) => Value::Null,
        },
        "chosen": chosen,
        "candidates": ranked.iter().map(|&i| point_json(plan, &plan.points[i])).collect::<Vec<_>>(),
        "method": plan.method,
    })
}

/// The pick as a `--config` recipe: the model and its flags as given (a directory written
/// absolute, so that the recipe works from any directory), the shapes and the pick's settings
/// at the top (both commands take them), the target under `[compile]` and its plugin under
/// `[train]`. TOML written by the `toml` crate.
pub fn recipe(o: &PlanOptions, plan: &Plan, p: &Point) -> Result<String> {
    use toml::Value;
    let spec = p.spec.as_ref().expect("the pick was built");
    let text = |s: &str| Value::String(s.to_string());
    let mut top = toml::Table::new();
    let mut put = |k: &str, v: Value| {
        top.insert(k.to_string(), v);
    };
    put("model", text(&absolute(&o.model_flag)));
    put("dtype", text(spec.dtype.mlir()));
    put("quant", text(spec.quant.name()));
    put("lora_r", Value::Integer(spec.lora.r));
    put("lora_alpha", Value::Float(spec.lora.alpha));
    put("lora_dropout", Value::Float(spec.lora.dropout));
    let targets = crate::model::lora::Projection::list(&spec.lora.targets);
    put("lora_targets", text(&targets));
    put("batch_size", Value::Integer(plan.batch_size));
    put("seq", Value::Integer(plan.seq));
    put("matmul_result", text(o.step.matmul_result.name()));
    put("attention_scores", text(o.step.attention_scores.name()));
    put(
        "keep_softmax_stats",
        Value::Boolean(spec.keep_softmax_stats),
    );
    // The optimizer's constants are part of the step program, as the plan compiled it.
    let adam = &o.step.adam;
    put("betas", text(&format!("{},{}", adam.beta1, adam.beta2)));
    put("eps", Value::Float(adam.eps));
    put("weight_decay", Value::Float(adam.weight_decay));
    put("max_grad_norm", Value::Float(adam.max_grad_norm));
    // Preference training: the step the plan compiled is DPO's (batch_size counts pairs).
    if let Some(d) = &spec.dpo {
        put("method", text("dpo"));
        put("beta", Value::Float(d.beta));
        put("dpo_loss", text(d.dpo_loss.name()));
        put("label_smoothing", Value::Float(d.label_smoothing));
        put("reference", text(d.reference.name()));
        put(
            "precompute_reference",
            Value::Boolean(d.precompute_reference),
        );
    }
    if let Some(b) = spec.attention_block {
        put("attention_block", Value::Integer(b));
    }
    if spec.mesh.is_some() {
        put(
            "pin_mlp_activations",
            Value::Boolean(spec.pin_mlp_activations),
        );
    }
    for (flag, value) in p.knobs.given() {
        let number = value.parse::<i64>().ok().filter(|_| flag != "mesh");
        put(
            &flag.replace('-', "_"),
            number.map_or(text(&value), Value::Integer),
        );
    }
    let mut compile = toml::Table::new();
    if let Some(target) = &plan.target_flag {
        compile.insert("target".into(), text(target));
        if let Some(c) = &o.target_config {
            compile.insert(
                "target_config".into(),
                text(&absolute(&c.display().to_string())),
            );
        }
    }
    if let Some(plugin) = &o.plugin {
        compile.insert("plugin".into(), text(&absolute(plugin)));
    }
    if !compile.is_empty() {
        top.insert("compile".into(), Value::Table(compile));
    }
    if let Some(plugin) = &plan.train_plugin {
        let mut train = toml::Table::new();
        train.insert("plugin".into(), text(&absolute(plugin)));
        top.insert("train".into(), Value::Table(train));
    }
    let head = [
        format!(
            "# Written by `xtrain plan` for {}: {} tokens x {} per step, {} of {} per device \
             by the target compiler's figures (not a run on the hardware).",
            plan.target,
            plan.seq,
            count(plan.batch_size as usize, "row"),
            p.figures
                .as_ref()
                .map_or("?".into(), |f| gib(f.device_bytes)),
            gib(plan.limits.device.bytes)
        ),
        "#   xtrain compile --config recipe.toml --check --out PROGRAM_DIR".into(),
        train_line(&o.model_flag),
    ];
    Ok(head.join("\n") + "\n\n" + &toml::to_string(&top)?)
}

/// `path` made absolute where it names something here (a model directory, a file), so that a
/// recipe names the same thing from any directory; a preset, repo id or plugin name as it is.
fn absolute(path: &str) -> String {
    let p = Path::new(path);
    match p.exists() && p.is_relative() {
        true => std::path::absolute(p).map_or(path.to_string(), |a| a.display().to_string()),
        false => path.to_string(),
    }
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
    let recipe = plan.chosen().map(|p| recipe(o, plan, p)).transpose()?;
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

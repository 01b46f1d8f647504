//! `xtrain plan`: will the step fit a target, with which settings, and how fast, answered by
//! the target's own compiler before any hardware is booked. It searches the settings a user
//! would otherwise try by hand ([`space`]: the mesh, microbatches, remat, offload, key blocks,
//! loss chunks and MLP tiles, each knob whose flag is given fixed), skips what cannot fit
//! without compiling it ([`cost`]: a lower bound of the device memory; larger microbatches
//! than a step that does not fit), compiles the rest fastest first until enough fit
//! ([`search`]), and ranks what fits: on TPUs by the compiler's estimate of the whole step, on
//! GPUs, where XLA gives no time, by a model it states ([`cost::GPU_MODEL`]), never presented
//! as a measurement. `--seq max` first finds the longest sequence that the least-memory settings
//! fit. The answer is a ranked table, `plan.json` and a `recipe.toml` that `compile --config`
//! and `train --config` take as they are ([`report`]).
//!
//! It drives compiles, so it is a stage after `compile`: it may use everything before it.

pub mod backend;
pub mod cost;
pub mod options;
pub mod report;
pub mod search;
pub mod space;

use crate::program::Program;
use anyhow::{bail, Result};
use backend::Backend;
pub use options::{Plan, PlanOptions, Probe, SeqGoal};
use search::{Compiled, Limits, Point};
use sha2::{Digest, Sha256};
use space::{Knob, Knobs};
use std::collections::HashMap;

/// Plan the step for the target as `o` asks; write its outputs if `o.out` is given.
pub fn run(o: &PlanOptions) -> Result<Plan> {
    if o.batch_size < 1 {
        bail!("--batch-size must be at least 1, got {}", o.batch_size);
    }
    if o.confirm < 1 {
        bail!(
            "--confirm must be at least 1 (the pick itself), got {}",
            o.confirm
        );
    }
    let out = match &o.out {
        Some(d) => {
            let inputs: Vec<&std::path::Path> = o.inputs.iter().map(|p| p.as_path()).collect();
            Some(crate::formats::outdir::check_writable_dir(
                d,
                o.overwrite,
                &inputs,
            )?)
        }
        None => None,
    };
    let mut backend = Backend::open(
        o.target.as_deref(),
        o.target_config.as_deref(),
        o.plugin.as_deref(),
        o.devices,
        o.verbose,
    )?;
    let name = backend.name();
    let limit = match (o.memory_limit, backend.usable_memory()?) {
        (Some(l), _) => l,
        (None, Some(u)) => u,
        (None, None) => {
            bail!("{name} does not say how much memory a device has; give --memory-limit-gib")
        }
    };
    let peak = backend.peak_tflops();
    let devices = backend.devices();
    let mut space = o.space.clone();
    if !backend.can_offload() {
        match space.offload {
            Knob::Fixed(off) if !off.is_none() => bail!(
                "--offload {}: {name} cannot keep values in host memory; leave --offload out \
                 or give none",
                off.name()
            ),
            _ => space.offload = Knob::Fixed(crate::program::Offload::NONE),
        }
    }
    let o = &PlanOptions { space, ..o.clone() };
    let limits = Limits {
        limit_bytes: limit,
        host_limit_bytes: o.host_memory_limit,
        confirm: o.confirm,
        exhaustive: o.exhaustive,
    };
    let mut compiled = HashMap::new();
    let mut compile = |program: &Program| compile_once(&mut backend, &mut compiled, program);
    let (seq, probes) = match o.seq {
        SeqGoal::Fixed(s) => (s, Vec::new()),
        SeqGoal::Max { step, upto } => longest(o, devices, &limits, (step, upto), &mut compile)?,
    };
    let points = o.space.points(devices, o.batch_size, seq, &o.rules);
    let built = search::points(points, &o.step, &o.model, o.batch_size, seq, peak);
    crate::esay!(
        "xtrain: plan: {} points for {name} at {seq} tokens x {} {} ({} refused by the \
         step's checks)",
        built.len(),
        o.batch_size,
        if o.step.dpo().is_some() {
            "pairs"
        } else {
            "rows"
        },
        built.iter().filter(|(_, p)| p.is_none()).count()
    );
    let (mut points, mut ranked) = search::search(built, &limits, &mut compile)?;
    let by_estimate = backend.is_tpu();
    if by_estimate {
        for &i in &ranked {
            let spec = points[i].spec.as_ref().expect("fits");
            crate::esay!(
                "xtrain: plan: estimating {} (unrolled 1- and 2-layer steps)",
                points[i].knobs.line()
            );
            points[i].estimate_s = backend.estimate(spec)?;
        }
        let key = |p: &Point| p.estimate_s.unwrap_or(f64::MAX);
        ranked.sort_by(|&a, &b| key(&points[a]).total_cmp(&key(&points[b])));
    }
    let plan = Plan {
        target: name,
        target_flag: backend.target_flag(),
        seq,
        batch_size: o.batch_size,
        limit_bytes: limit,
        points,
        ranked,
        by_estimate,
        probes,
        method: method(o, by_estimate, limit),
    };
    report::print_table(&plan);
    if let Some(out) = &out {
        report::write(out, o, &plan)?;
    }
    if plan.chosen().is_none() {
        bail!("{}", report::nothing_fits(&plan, out.as_deref()));
    }
    Ok(plan)
}

/// Compile `program` for its figures, once per plan: `--seq max`'s last probe is often a point
/// of the search at the length it found, the same program (`compiled`, by its sha256).
fn compile_once(
    backend: &mut Backend,
    compiled: &mut HashMap<[u8; 32], Compiled>,
    program: &Program,
) -> Result<Compiled> {
    let key: [u8; 32] = Sha256::new()
        .chain_update(program.partitions.to_le_bytes())
        .chain_update(program.text.as_bytes())
        .finalize()
        .into();
    if let Some(c) = compiled.get(&key) {
        crate::esay!("xtrain: plan: the same step was compiled before; its figures are reused");
        return Ok(c.clone());
    }
    let c = backend.compile(program)?;
    compiled.insert(key, c.clone());
    Ok(c)
}

/// How the plan was made, as plan.json's `method` says it.
fn method(o: &PlanOptions, by_estimate: bool, limit: i64) -> String {
    let fit = format!(
        "fits: the target compiler's device memory per device (arguments + non-aliased outputs + \
         temporaries) within {} ({}); every point that fits was compiled whole",
        crate::words::gib(limit),
        match o.memory_limit {
            Some(_) => "--memory-limit-gib",
            None => "what the device gives XLA",
        }
    ) + &o.host_memory_limit.map_or(String::new(), |h| {
        format!(
            ", and host memory per device within {} (--host-memory-limit-gib)",
            crate::words::gib(h)
        )
    });
    let rank = match by_estimate {
        true => "ranked by the TPU compiler's estimate of the whole step (its cost model over \
                 unrolled 1- and 2-layer steps), among the points the model put first"
            .to_string(),
        false => format!("ranked by a {}", cost::GPU_MODEL),
    };
    let skip = match o.exhaustive {
        true => "every point compiled".to_string(),
        false => format!(
            "points compiled fastest first by the model until {} fit; skipped without compiling: \
             a lower bound of the device memory (arguments in device memory, and the layer-input \
             stack where activations stay on the device) above the limit, and larger \
             microbatches than a point that does not fit",
            o.confirm
        ),
    };
    let seq = match o.seq {
        SeqGoal::Fixed(_) => String::new(),
        SeqGoal::Max { step, .. } => format!(
            "; --seq max: the longest multiple of {step} tokens that the least-memory settings \
             of the space fit (a binary search, taking a longer sequence than one that does \
             not fit not to fit either)"
        ),
    };
    format!("{fit}; {rank}; {skip}{seq}")
}

/// `--seq max`: the longest multiple of `step` tokens, up to the model's positions, that the
/// least-memory settings of the space fit, by binary search (each probe a full compile).
fn longest(
    o: &PlanOptions,
    devices: i64,
    limits: &Limits,
    (step, upto): (i64, Option<i64>),
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
) -> Result<(i64, Vec<Probe>)> {
    if step < 2 {
        bail!("--seq-step must be at least 2 tokens, got {step}");
    }
    let positions = o.model.max_position_embeddings;
    let most = upto.unwrap_or(positions).min(positions) / step;
    if most < 1 {
        bail!(
            "--seq-step {step} is longer than the longest sequence searched ({} tokens: the \
             model's positions, or --seq-limit)",
            upto.unwrap_or(positions).min(positions)
        );
    }
    let mut probes = Vec::new();
    let mut fits = |k: i64, probes: &mut Vec<Probe>| -> Result<bool> {
        let seq = k * step;
        for s in o.space.least_memory(devices, o.batch_size, seq, &o.rules) {
            let found = probe(o, &s, seq, compile)?;
            let fit = found.as_ref().is_some_and(|f| limits.holds(f));
            let gib = crate::words::gib;
            crate::esay!(
                "xtrain: plan: --seq {seq} with {}: {}",
                s.line(),
                match (fit, &found) {
                    (true, Some(f)) =>
                        format!("fits ({}, host {})", gib(f.device_bytes), gib(f.host_bytes)),
                    (false, Some(f)) => format!(
                        "does not fit ({}, host {})",
                        gib(f.device_bytes),
                        gib(f.host_bytes)
                    ),
                    _ => "does not fit".into(),
                }
            );
            probes.push(Probe {
                seq,
                flags: s.line(),
                fits: fit,
                device_bytes: found.as_ref().map(|f| f.device_bytes),
                host_bytes: found.as_ref().map(|f| f.host_bytes),
            });
            if fit {
                return Ok(true);
            }
        }
        Ok(false)
    };
    if !fits(1, &mut probes)? {
        bail!(
            "not even {step} tokens fit the target with the least-memory settings of the space \
             (see above); give more devices, --quant nf4, or a smaller --seq-step"
        );
    }
    let (mut lo, mut hi) = (1, most + 1);
    if fits(most, &mut probes)? {
        lo = most;
    } else {
        hi = most;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid, &mut probes)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    crate::esay!("xtrain: plan: --seq max: {} tokens", lo * step);
    Ok((lo * step, probes))
}

/// The memory figures of `s`'s step at `seq`, or None where the step refuses it or the compiler
/// says it does not fit.
fn probe(
    o: &PlanOptions,
    s: &Knobs,
    seq: i64,
    compile: &mut dyn FnMut(&Program) -> Result<Compiled>,
) -> Result<Option<search::Figures>> {
    let spec = match s.options(&o.step).spec(o.model.clone(), o.batch_size, seq) {
        Ok(spec) => spec,
        Err(e) => {
            crate::esay!(
                "xtrain: plan: --seq {seq} with {}: refused: {e:#}",
                s.line()
            );
            return Ok(None);
        }
    };
    let program = crate::program::build_train_step(&spec)?;
    Ok(match compile(&program)? {
        Compiled::Figures(f) => Some(f),
        Compiled::OutOfMemory => None,
    })
}

//! `xtrain plan`: will the step fit a target, with which settings, and how fast, answered by
//! the target's own compiler before any hardware is booked. It searches the settings a user
//! would otherwise try by hand ([`space`]: the mesh, microbatches, remat, offload, key blocks,
//! loss chunks and MLP tiles, each knob whose flag is given fixed), skips what cannot fit
//! without compiling it ([`cost`]: a lower bound of the device memory; larger microbatches
//! than a step that does not fit), compiles the rest fastest first until enough fit
//! ([`search`]), and ranks what fits: on TPUs by the compiler's estimate of the whole step, on
//! GPUs and the CPU, where XLA gives no time, by a model it states ([`cost::MODEL`]), never presented
//! as a measurement. `--seq max` first finds the longest sequence that the least-memory settings
//! fit. The answer is a ranked table, `plan.json` and a `recipe.toml` that `compile --config`
//! and `train --config` take as they are ([`report`]).
//!
//! It drives compiles, so it is a stage after `compile`: it may use everything before it.

pub mod backend;
pub mod budget;
pub mod cost;
pub mod longest;
pub mod options;
pub mod report;
pub mod search;
pub mod space;

use crate::program::Program;
use crate::words::count;
use anyhow::{bail, Result};
use backend::Backend;
use cost::Rates;
pub use options::{Plan, PlanOptions, Probe, SeqGoal};
use search::{Compiled, Limits};
use sha2::{Digest, Sha256};
use space::Knob;
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
    let (mut backend, o, limits) = open(o)?;
    let o = &o;
    let name = backend.name();
    let rates = backend.rates(o.step.dtype)?;
    // Without rates the model only orders the compiles (and says so in the table).
    let peak = rates.as_ref().map_or(1.0, |r| r.tflops_per_device);
    let devices = backend.devices();
    let mut compiled = HashMap::new();
    let mut compile = |program: &Program| compile_once(&mut backend, &mut compiled, program);
    let (seq, probes) = match o.seq {
        SeqGoal::Fixed(s) => (s, Vec::new()),
        SeqGoal::Max { step, upto } => {
            longest::longest(o, devices, &limits, (step, upto), &mut compile)?
        }
    };
    let points = o.space.points(devices, o.batch_size, seq, &o.rules);
    let built = search::points(points, &o.step, &o.model, o.batch_size, seq, peak);
    crate::esay!(
        "xtrain: plan: {} for {name} at {seq} tokens x {} ({} refused by the step's checks)",
        count(built.len(), "point"),
        count(
            o.batch_size as usize,
            if o.step.dpo().is_some() {
                "pair"
            } else {
                "row"
            }
        ),
        built.iter().filter(|(_, p)| p.is_none()).count()
    );
    let tight = matches!(o.seq, SeqGoal::Max { .. });
    let (mut points, mut ranked) = search::search(built, &limits, tight, &mut compile)?;
    let by_estimate = backend.is_tpu();
    if let Some(r) = &rates {
        for p in points.iter_mut() {
            let launches = p.figures.as_ref().and_then(|f| f.launches);
            if let (Some(m), Some(l)) = (p.modelled, launches) {
                p.modelled = Some(m.with_launches(l.count, r.per_launch_s));
            }
        }
        search::rank(&points, &mut ranked, |p| p.modelled.map(|m| m.seconds));
    }
    if by_estimate {
        for &i in &ranked {
            let spec = points[i].spec.as_ref().expect("fits");
            crate::esay!(
                "xtrain: plan: estimating {} (unrolled 1- and 2-layer steps)",
                points[i].knobs.line()
            );
            points[i].estimate_s = backend.estimate(spec)?;
        }
        search::rank(&points, &mut ranked, |p| p.estimate_s);
    }
    let plan = Plan {
        target: name,
        target_flag: backend.target_flag(),
        train_plugin: backend.train_plugin(o.plugin.as_deref()),
        seq,
        batch_size: o.batch_size,
        method: method(o, by_estimate, &limits, rates.as_ref()),
        rates,
        limits,
        points,
        ranked,
        by_estimate,
        probes,
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

/// The compiler the plan asks, the options with what the target cannot do fixed (no offload
/// on the CPU plugin), and the limits the points must fit: everything refused here is refused
/// before the first compile.
fn open(o: &PlanOptions) -> Result<(Backend, PlanOptions, Limits)> {
    let backend = Backend::open(
        o.target.as_deref(),
        o.target_config.as_deref(),
        o.plugin.as_deref(),
        o.devices,
        o.verbose,
    )?;
    let name = backend.name();
    let positions = o.model.max_position_embeddings;
    if let SeqGoal::Max { upto: Some(u), .. } = o.seq {
        if u > positions {
            crate::esay!(
                "xtrain: plan: --seq-limit {u} is more than the model's {positions} positions: \
                 searching up to {positions}"
            );
        }
    }
    let device = budget::device(&backend, o.memory_limit)?;
    let host = budget::host(&backend, o.host_memory_limit)?;
    let devices = backend.devices();
    if let Knob::Fixed(Some(mesh)) = &o.space.mesh {
        if mesh.devices() != devices {
            bail!(
                "--mesh {} is a mesh of {}, and {name} has {}: give a mesh of {}, or leave \
                 --mesh out to search them",
                space::mesh_text(mesh),
                count(mesh.devices() as usize, "device"),
                count(devices as usize, "device"),
                count(devices as usize, "device")
            );
        }
    }
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
    let limits = Limits {
        device,
        host,
        confirm: o.confirm,
        exhaustive: o.exhaustive,
    };
    Ok((backend, PlanOptions { space, ..o.clone() }, limits))
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
fn method(o: &PlanOptions, by_estimate: bool, limits: &Limits, rates: Option<&Rates>) -> String {
    let fit = format!(
        "fits: the target compiler's device memory per device (arguments + non-aliased outputs + \
         temporaries) within {} ({}), and its host memory per device within {} ({}); every \
         point that fits was compiled whole",
        crate::words::gib(limits.device.bytes),
        limits.device.source,
        crate::words::gib(limits.host.bytes),
        limits.host.source,
    );
    let rank = match by_estimate {
        true => "ranked by the TPU compiler's estimate of the whole step (its cost model over \
                 unrolled 1- and 2-layer steps), among the points the model put first"
            .to_string(),
        false => match rates {
            Some(r) => format!("ranked by a {} (here: {})", cost::MODEL, r.source),
            None => "no time given: the model has no peak for this device (a GPU described by \
                     a file, or a GPU plugin here); the compiles were ordered by the step's FLOPs"
                .to_string(),
        },
    };
    let skip = match o.exhaustive {
        true => "every point compiled".to_string(),
        false => format!(
            "points compiled fastest first by the model until {} fit, where memory is tight \
             after their neighbours with less memory; skipped without compiling: a lower bound \
             of the device memory (arguments in device memory, and the layer-input stack where \
             activations stay on the device) or of the host memory (arguments in host memory) \
             above its limit, and a point that needs at least the memory of a point that does \
             not fit it, knob by knob (more offload needs less device memory and more host \
             memory; a chunked loss, MLP tiles, remat per layer and more microbatches less of \
             both)",
            o.confirm
        ),
    };
    let seq = match o.seq {
        SeqGoal::Fixed(_) => String::new(),
        SeqGoal::Max { step, .. } => format!(
            "; --seq max: the longest multiple of {step} tokens that the least-memory settings \
             of the space fit, each probe a full compile of the step (the longest first, then \
             the lengths the figures point at by a line through the nearest probes, halving \
             where that does not narrow the interval; a longer sequence than one that does not \
             fit taken not to fit either)"
        ),
    };
    format!("{fit}; {rank}; {skip}{seq}")
}

//! The program dir of one choice of the step, and what compile says of it: the step it holds,
//! its arguments' size, the program's form and the mesh.

use crate::compile::options::Writing;
use crate::formats::program_dir::{self, Manifest};
use crate::program::{MeshPlan, Program, StepSpec};
use crate::words::gib;
use anyhow::Result;

/// Build the step and write its program dir, saying what it holds.
pub(super) fn write_program(w: &Writing, spec: &StepSpec) -> Result<(Program, Manifest)> {
    let t0 = std::time::Instant::now();
    let program = crate::program::build_train_step(spec)?;
    let build_s = t0.elapsed().as_secs_f64();
    let manifest = program_dir::write_dir(w.dir(), &program, spec)?;
    let arg_bytes: i64 = manifest.args.iter().map(|t| t.bytes).sum();
    let per_device: i64 = manifest.args.iter().map(|t| t.bytes_per_device()).sum();
    crate::say!(
        "wrote {} ({} bytes of StableHLO, {} arguments, built in {:.3}s) and manifest.json",
        w.out.join("train_step.mlir").display(),
        program.text.len(),
        program.args.len(),
        build_s
    );
    let sharded = if per_device != arg_bytes {
        format!(", {} per device", gib(per_device))
    } else {
        String::new()
    };
    let offload = if spec.offload.is_none() {
        String::new()
    } else {
        format!("; --offload {}", spec.offload.name())
    };
    // What the defaults chose, so that the figures below can be read (f32 weights take twice
    // bf16's bytes).
    let targets: Vec<&str> = spec
        .lora
        .targets
        .iter()
        .map(|t| t.module().trim_end_matches("_proj"))
        .collect();
    let mesh = match &spec.mesh {
        Some(m) => format!(
            ", --mesh {} ({} devices)",
            m.axes
                .iter()
                .map(|(n, k)| format!("{n}={k}"))
                .collect::<Vec<_>>()
                .join(","),
            m.devices()
        ),
        None => String::new(),
    };
    let method = match &spec.dpo {
        Some(p) => format!(
            "--method dpo (--dpo-loss {}, --beta {}{}, --reference {}{}; {} rows, a pair's two), ",
            p.dpo_loss.name(),
            p.beta,
            match p.label_smoothing {
                0.0 => String::new(),
                e => format!(", --label-smoothing {e}"),
            },
            p.reference.name(),
            if p.precompute_reference {
                ", --precompute-reference"
            } else {
                ""
            },
            spec.batch
        ),
        None => String::new(),
    };
    crate::say!(
        "step: {method}--dtype {} (weights and compute), --batch-size {}, --seq {}, --lora-r {} (alpha {}, on {}), --remat {}, --grad-accum {}{}{}",
        spec.dtype,
        spec.examples(),
        spec.seq,
        spec.lora.r,
        spec.lora.alpha,
        targets.join(","),
        spec.remat.name(),
        spec.grad_accum,
        if spec.quant.is_nf4() { ", --quant nf4" } else { "" },
        mesh,
    );
    crate::say!(
        "arguments: {}{sharded} ({} parameters in the base model{offload})",
        gib(arg_bytes),
        spec.model.param_count()
    );
    crate::say!("form: {}", spec.form());
    crate::say!("program sha256 {}", manifest.program_sha256);
    Ok((program, manifest))
}

/// The mesh and which device sits where on it.
pub(super) fn print_device_order(m: &MeshPlan) {
    let order: Vec<String> = (0..m.devices() as usize)
        .map(|p| {
            let c = crate::program::sharding::coords(&m.mesh(), p);
            let coords: Vec<String> = m
                .axes
                .iter()
                .map(|(n, _)| format!("{n}={}", c[n]))
                .collect();
            format!("device {p}: {}", coords.join(" "))
        })
        .collect();
    if order.len() <= 16 {
        crate::say!(
            "mesh {:?}, {} devices; {}",
            m.axes,
            m.devices(),
            order.join("; ")
        );
    } else {
        crate::say!(
            "mesh {:?}, {} devices, numbered row-major over the axes in this order",
            m.axes,
            m.devices()
        );
    }
}

//! When a program does not fit a device: what it needs against what the device has, and what
//! would make it fit. [`fit_advice`] is the one place that advice is worded, for every command
//! that compiles or runs a training step on a device (a run's compile, `xtrain compile --check`,
//! a compile for a `--target`); [`explain_out_of_memory`] turns a plugin's out-of-memory error
//! into that message, keeping the plugin's own words after it.

use crate::program::{Program, Remat, StepSpec};

use crate::words::gib;

/// Whether an error (its whole chain) is a plugin saying memory ran out: XLA's
/// `RESOURCE_EXHAUSTED`, or its "Out of memory" wording.
pub fn is_out_of_memory(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    text.contains("RESOURCE_EXHAUSTED") || text.to_ascii_lowercase().contains("out of memory")
}

/// The size XLA's message says it failed to allocate ("... allocate 17179869184 bytes", "...
/// allocate 16.00GiB", the CPU's "Out of memory allocating 2200150021784 bytes"), if it says
/// one.
pub fn bytes_in_message(msg: &str) -> Option<i64> {
    ["allocate ", "allocating "].iter().find_map(|key| {
        let at = msg.find(key)? + key.len();
        size_at(&msg[at..])
    })
}

/// The temporaries the TPU compiler's refusal says a step needs ("Ran out of memory on HBM, the
/// total memory required for HLO temporaries (33.15G) exceeds available HBM (31.25G)"), if it
/// says so.
pub fn tpu_temporaries_in_message(msg: &str) -> Option<i64> {
    let key = "required for HLO temporaries (";
    let at = msg.find(key)? + key.len();
    size_at(&msg[at..])
}

/// The size written at the start of `rest` ("16.00GiB", "17179869184 bytes", "33.15G").
fn size_at(rest: &str) -> Option<i64> {
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let number: f64 = rest[..end].parse().ok()?;
    let unit = rest[end..].trim_start();
    let scale = [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("TB", 1_000_000_000_000),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("G", 1 << 30),
        ("M", 1 << 20),
        ("K", 1 << 10),
        ("bytes", 1),
        ("B", 1),
    ]
    .iter()
    .find(|(u, _)| unit.starts_with(u))
    .map_or(1, |(_, s)| *s);
    Some((number * scale as f64) as i64)
}

/// Bytes of the arguments one device holds (its shards of the weights, the LoRA state and the
/// batch): a lower bound of what the step needs per device.
pub fn argument_bytes_per_device(program: &Program) -> i64 {
    program
        .args
        .iter()
        .zip(&program.arg_shard_dims)
        .map(|(a, d)| d.iter().product::<i64>() * a.dtype.size_bytes() as i64)
        .sum()
}

/// What to tell a user whose step needs `needed_bytes` per device where a device has
/// `available_bytes` (None: unknown), built as `spec` says: both figures, then each change that
/// would lower the need, with its flag: more devices (an FSDP mesh of the size the ratio asks
/// for), NF4 base weights, bf16, per-layer remat, a chunked loss, smaller microbatches or
/// batches, and `--offload` to host memory (with looped layers). One paragraph, no trailing newline; it does not say
/// which command failed (the caller does).
pub fn fit_advice(needed_bytes: i64, available_bytes: Option<i64>, spec: &StepSpec) -> String {
    fit_advice_on(Need::About(needed_bytes), available_bytes, spec, None)
}

/// What a step needs per device, as known.
#[derive(Clone, Copy, Debug)]
pub enum Need {
    /// About this many bytes (the compiler's figures).
    About(i64),
    /// At least this many: one allocation the plugin could not make (XLA's message).
    AtLeast(i64),
}

/// [`fit_advice`] for a step run by the plugin of `platform` (`cpu`, `cuda`, ...; None: any):
/// only the advice that applies there. On the CPU plugin, whose "devices" all share the host's
/// memory and which cannot offload, neither more devices nor `--offload` is offered.
pub fn fit_advice_on(
    need: Need,
    available_bytes: Option<i64>,
    spec: &StepSpec,
    platform: Option<&str>,
) -> String {
    let cpu = platform == Some("cpu");
    let (needed_bytes, what) = match need {
        Need::About(n) => (n, format!("it needs about {} per device", gib(n))),
        Need::AtLeast(n) => (
            n,
            format!(
                "it needs at least {} per device (XLA could not allocate a buffer of that size)",
                gib(n)
            ),
        ),
    };
    let mut s = match available_bytes {
        Some(a) if a > 0 => format!("{what} but a device has {} for it", gib(a)),
        _ => what,
    };
    let mut ways: Vec<String> = Vec::new();
    let devices = spec.mesh.as_ref().map_or(1, |m| m.devices());
    let fsdp = spec
        .mesh
        .as_ref()
        .and_then(|m| m.axes.iter().find(|(n, _)| n == "fsdp").map(|(_, s)| *s))
        .unwrap_or(1);
    let ratio = match available_bytes {
        Some(a) if a > 0 => (needed_bytes as f64 / a as f64).ceil().max(2.0) as i64,
        _ => 2,
    };
    let want = ((fsdp * ratio) as u64).next_power_of_two();
    if !cpu {
        ways.push(format!(
            "more devices: split the weights and the batch over them with --mesh fsdp={want} (this step runs on {devices})"
        ));
    }
    let params = spec.model.param_count();
    let weight_bytes = spec.dtype.size_bytes() as i64;
    // NF4 saves most of the weights' bytes: advice only where they are a good part of the need.
    if !spec.quant.is_nf4() && params * weight_bytes / devices >= needed_bytes / 10 {
        ways.push(format!(
            "--quant nf4: 4-bit base weights, about {} for the model's projections instead of {}",
            gib((params as f64 * 0.52) as i64 / devices),
            gib(params * weight_bytes / devices)
        ));
    }
    if weight_bytes > 2 {
        ways.push("--dtype bf16: half the weight and activation memory".into());
    }
    if spec.remat == Remat::None {
        ways.push(
            "--remat layer: keep only each layer's input for the backward pass, not every intermediate"
                .into(),
        );
    }
    if spec.remat == Remat::SaveProj {
        ways.push(
            "--remat layer (or auto): keep only each layer's input for the backward pass, not its projections' outputs"
                .into(),
        );
    }
    if spec.remat.scan() && spec.loss_chunk.is_none() && spec.seq >= 1024 {
        ways.push(format!(
            "--loss-chunk {}: the logits over the vocabulary a chunk of positions at a time",
            (spec.seq / 8).max(1)
        ));
    }
    if spec.mlp_chunk.is_none() && spec.context_size() == 1 && spec.seq >= 8192 {
        ways.push(format!(
            "--mlp-chunk {}: the MLP a tile of positions at a time, its [seq, {}] tensors never whole",
            crate::program::DEFAULT_MLP_CHUNK.min(spec.seq / 2),
            spec.model.intermediate_size
        ));
    }
    // Examples (rows, or a DPO step's pairs) per microbatch.
    let per_micro = spec.examples() / spec.grad_accum.max(1);
    if per_micro > 1 {
        ways.push(format!(
            "a smaller batch per microbatch: --grad-accum {} keeps the batch of {} and halves the activations (or a smaller batch)",
            spec.grad_accum * 2,
            spec.examples()
        ));
    } else {
        ways.push(format!("a shorter sequence than --seq {}", spec.seq));
    }
    if !cpu && spec.remat.scan() && !(spec.offload.frozen && spec.offload.activations) {
        let next = if spec.offload.activations {
            "all"
        } else {
            "activations"
        };
        ways.push(format!(
            "--offload {next} (or auto): keep the saved activations{} in host memory, copied in and out layer by layer",
            if next == "all" { " and the frozen weights" } else { "" }
        ));
    }
    s.push_str("; what would make it fit: ");
    s.push_str(&ways.join("; "));
    s
}

/// `e` unchanged unless the plugin ran out of memory; then a "does not fit" error with the
/// figures and [`fit_advice`], the plugin's message after it. `what` names what was compiled or
/// run ("the training step"); `args` is [`argument_bytes_per_device`] (what the device needs at
/// least, when the plugin's message gives no size); `available_bytes` is a device's memory, if
/// the plugin says it.
pub fn explain_out_of_memory(
    e: anyhow::Error,
    what: &str,
    args: i64,
    spec: &StepSpec,
    available_bytes: Option<i64>,
) -> anyhow::Error {
    explain_out_of_memory_on(e, what, args, spec, available_bytes, None)
}

/// [`explain_out_of_memory`] for a step run by the plugin of `platform` (None: any): the
/// figure is the plugin's own where its message gives one (the TPU compiler's temporaries plus
/// the arguments; else the allocation XLA could not make, at least), and the advice is what
/// applies to that plugin ([`fit_advice_on`]).
pub fn explain_out_of_memory_on(
    e: anyhow::Error,
    what: &str,
    args: i64,
    spec: &StepSpec,
    available_bytes: Option<i64>,
    platform: Option<&str>,
) -> anyhow::Error {
    if !is_out_of_memory(&e) {
        return e;
    }
    let raw = format!("{e:#}");
    let need = match tpu_temporaries_in_message(&raw) {
        Some(temporaries) => Need::About(temporaries + args),
        None => match bytes_in_message(&raw) {
            Some(b) if b > args => Need::AtLeast(b),
            _ => Need::About(args),
        },
    };
    anyhow::anyhow!(
        "{what} does not fit the device: {}\n(the plugin said: {raw})",
        fit_advice_on(need, available_bytes, spec, platform)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{LoraConfig, Projection};

    #[test]
    fn out_of_memory_messages_and_advice() {
        assert_eq!(
            bytes_in_message(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."
            ),
            Some(17179869184)
        );
        assert_eq!(
            bytes_in_message("Out of memory while trying to allocate 16.00GiB"),
            Some(16 << 30)
        );
        assert_eq!(bytes_in_message("no size here"), None);
        assert_eq!(
            bytes_in_message(
                "Error preparing computation: Out of memory allocating 2200150021784 bytes."
            ),
            Some(2200150021784)
        );
        let tpu = "PJRT_Compile failed (RESOURCE_EXHAUSTED): Ran out of memory on HBM, the total \
                   memory required for HLO temporaries (33.15G) exceeds available HBM (31.25G).";
        assert_eq!(
            tpu_temporaries_in_message(tpu),
            Some((33.15 * (1u64 << 30) as f64) as i64)
        );
        assert!(is_out_of_memory(&anyhow::anyhow!("{tpu}")));
        let e = anyhow::anyhow!("PJRT_Client_Compile failed (RESOURCE_EXHAUSTED): x");
        assert!(is_out_of_memory(&e));
        assert!(!is_out_of_memory(&anyhow::anyhow!("INVALID_ARGUMENT: y")));

        let (cfg, _) = crate::model::presets::resolve_model_config("llama-3.1-8b").unwrap();
        let lora = LoraConfig {
            r: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
        };
        let spec = StepSpec {
            remat: Remat::None,
            ..StepSpec::new(cfg, lora, 8, 2048, hlo::DType::F32)
        };
        let a = fit_advice(60 << 30, Some(40 << 30), &spec);
        assert!(
            a.contains("needs about 60.00 GiB per device but a device has 40.00 GiB"),
            "{a}"
        );
        for way in [
            "--mesh fsdp=2",
            "--quant nf4",
            "--dtype bf16",
            "--remat layer",
            "--grad-accum 2",
        ] {
            assert!(a.contains(way), "{way}: {a}");
        }
        // On the CPU plugin: neither more (virtual) devices nor offload, which it cannot do;
        // XLA's failed allocation is a lower bound.
        let looped = StepSpec {
            remat: Remat::Layer,
            ..spec.clone()
        };
        let a = fit_advice_on(Need::AtLeast(2 << 40), None, &looped, Some("cpu"));
        assert!(
            a.starts_with(
                "it needs at least 2048.00 GiB per device (XLA could not allocate a buffer of that size)"
            ),
            "{a}"
        );
        assert!(!a.contains("--mesh") && !a.contains("--offload"), "{a}");
        assert!(a.contains("--grad-accum 2"), "{a}");
        let a = fit_advice_on(Need::About(60 << 30), None, &looped, Some("cuda"));
        assert!(
            a.contains("--mesh fsdp=2") && a.contains("--offload activations"),
            "{a}"
        );
    }
}

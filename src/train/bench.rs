//! `xtrain bench`: time the training step on random weights (no checkpoint needed), and export
//! the same weights and batch so that peer implementations can be checked against it.

use crate::data::Batch;
use crate::device::runtime::Runtime;
use crate::device::trainer::Trainer;
use crate::model::lora::SplitMix;
use crate::program::{self, Program, Role, StepSpec};
use anyhow::Result;
use hlo::DType;
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// Random weights (uniform, std ~0.02; norms 1) under per-layer HF names: the same values as
/// [`random_program_weights`] makes in the program's layout (layer l of a stacked tensor is
/// elements l*n..(l+1)*n of its stream), so that an exported run and a timed run see one model.
pub fn random_weights(spec: &StepSpec, seed: u64) -> BTreeMap<String, HostTensor> {
    crate::model::tensors::frozen_weights(&spec.model)
        .into_iter()
        .map(|(name, shape)| {
            let n: i64 = shape.iter().product();
            // model.layers.<l>.<rest> -> (model.layers.*.<rest>, l)
            let (stacked, layer) = match name.strip_prefix("model.layers.") {
                Some(rest) => {
                    let (l, tail) = rest.split_once('.').expect("layer tensor name");
                    (format!("model.layers.*.{tail}"), l.parse::<u64>().unwrap())
                }
                None => (name.clone(), 0),
            };
            let stream = weight_stream(seed, &stacked);
            let v: Vec<f32> = (0..n as u64)
                .map(|i| weight_value(&name, stream, layer * n as u64 + i))
                .collect();
            (name, HostTensor::from_f32(&v, &shape))
        })
        .collect()
}

/// Each weight tensor's random stream, from its (stacked) name.
fn weight_stream(seed: u64, stacked_name: &str) -> u64 {
    // FNV-1a of the name
    let h = stacked_name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, c| {
        (h ^ c as u64).wrapping_mul(0x0100_0000_01B3)
    });
    seed ^ h
}

fn weight_value(name: &str, stream: u64, index: u64) -> f32 {
    if name.contains("norm") {
        1.0
    } else {
        (uniform_at(stream, index) * 0.0346) as f32
    }
}

/// One uniform value in [-1, 1) per (stream, index): a stateless hash, so that any thread can
/// fill any part of a tensor and the result does not depend on how the work was split.
fn uniform_at(stream: u64, index: u64) -> f64 {
    let mut z = stream
        .wrapping_mul(0xD134_2543_DE82_EF95)
        .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// Random frozen weights made directly in the program's layout and element types (stacked layers,
/// bf16 when the program takes bf16), on all cores: what large models need. Llama 3.1 8B in bf16
/// is 16 GB this way; the per-layer f32 tensors of [`random_weights`] would be 32 GB, stacked and
/// converted after. The same values as [`random_weights`].
pub fn random_program_weights(program: &Program, seed: u64) -> Result<Vec<HostTensor>> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    program
        .args
        .iter()
        .filter(|a| a.role == Role::Frozen)
        .map(|a| {
            let n: usize = a.shape.iter().product::<i64>() as usize;
            let ty = crate::formats::host::element_type(a.dtype);
            let width = match a.dtype {
                DType::F32 => 4,
                DType::BF16 | DType::F16 => 2,
                other => anyhow::bail!(
                    "random weights: `{}` is {other:?}; only float weights can be made at random \
                     (quantized programs take the host path)",
                    a.name
                ),
            };
            let stream = weight_stream(seed, &a.name);
            let mut bytes = vec![0u8; n * width];
            let per = n.div_ceil(threads).max(1 << 16);
            std::thread::scope(|scope| {
                for (c, chunk) in bytes.chunks_mut(per * width).enumerate() {
                    let dtype = a.dtype;
                    scope.spawn(move || {
                        let first = (c * per) as u64;
                        for (j, out) in chunk.chunks_exact_mut(width).enumerate() {
                            let v = weight_value(&a.name, stream, first + j as u64);
                            match dtype {
                                DType::F32 => out.copy_from_slice(&v.to_le_bytes()),
                                DType::BF16 => {
                                    out.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes())
                                }
                                _ => out.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                            }
                        }
                    });
                }
            });
            Ok(HostTensor {
                ty,
                dims: a.shape.clone(),
                bytes,
            })
        })
        .collect()
}

/// LoRA weights with nonzero B (so every gradient is nonzero and the peers' check means something).
pub fn random_lora(spec: &StepSpec, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = SplitMix(seed ^ 0xB);
    crate::model::tensors::lora_tensors(&spec.model, &spec.lora)
        .into_iter()
        .map(|t| {
            let n: i64 = t.shape.iter().product();
            let scale = if t.which == "A" {
                1.0 / (t.shape[1] as f64).sqrt()
            } else {
                0.01
            };
            let v: Vec<f32> = (0..n)
                .map(|_| ((rng.next_f64() * 2.0 - 1.0) * scale) as f32)
                .collect();
            (t.name, HostTensor::from_f32(&v, &t.shape))
        })
        .collect()
}

pub fn random_batch(spec: &StepSpec, seed: u64) -> Batch {
    let mut rng = SplitMix(seed ^ 0xBA7C);
    let n = (spec.batch * spec.seq) as usize;
    let ids: Vec<i32> = (0..n)
        .map(|_| (rng.next_u64() % spec.model.vocab_size as u64) as i32)
        .collect();
    let dims = [spec.batch, spec.seq];
    // A DPO step with --precompute-reference takes the reference's log-probabilities: any
    // values time it.
    let precomputed = spec.dpo.as_ref().is_some_and(|p| p.precompute_reference);
    Batch {
        input_ids: HostTensor::from_i32(&ids, &dims),
        labels: HostTensor::from_i32(&ids, &dims),
        attention_mask: HostTensor::from_i32(&vec![1; n], &dims),
        reference_logps: precomputed
            .then(|| HostTensor::from_f32(&vec![-1.0; spec.batch as usize], &[spec.batch])),
    }
}

/// Progress for the long parts of a large benchmark, on stderr (stdout carries the JSON result).
fn progress(msg: &str) {
    crate::esay!("xtrain bench: {msg}");
}

/// What `xtrain bench` measured.
#[derive(serde::Serialize)]
pub struct BenchResult {
    /// XLA's compile of the step.
    pub compile_s: f64,
    /// Copying the weights and the LoRA state to the device(s).
    pub upload_s: f64,
    /// [`model_flops_per_step`] of the benchmarked step.
    pub model_flops_per_step: f64,
    pub step_s: Vec<f64>,
    pub first_loss: f32,
    /// The loss before each step's update, warm-up steps included (the same batch every step).
    pub losses: Vec<f32>,
    pub tokens_per_step: i64,
    pub stablehlo_bytes: usize,
    /// The kernels compiled in place of composites (`--kernel`), as `composite vN -> kernel`.
    pub kernels: Vec<String>,
}

/// The step spec's model FLOPs (`program::flops`), named here too for the benchmarks' callers.
pub use crate::program::flops::model_flops_per_step;

/// Compile (no cache) on `rt` and run `warmup + steps` steps; optionally write the weights, LoRA
/// and batch to `export` (safetensors, HF/PEFT names) for peers.
pub fn run(
    rt: Runtime,
    spec: StepSpec,
    warmup: usize,
    steps: usize,
    export: Option<&Path>,
) -> Result<BenchResult> {
    let lora = random_lora(&spec, 1);
    let batch = random_batch(&spec, 1);
    let program = program::build_train_step(&spec)?;
    let bytes = program.text.len();
    let kernels = rt.kernel_text(&program)?.uses.clone();
    crate::device::kernels::announce(&kernels);
    let t0 = Instant::now();
    let frozen = if export.is_some() || spec.quant.is_nf4() {
        // Per-layer f32 weights under HF names: what peers read, and what the NF4 quantizer takes.
        let weights = random_weights(&spec, 1);
        if let Some(p) = export {
            let mut all = weights.clone();
            all.extend(lora.clone());
            all.insert("input_ids".into(), batch.input_ids.clone());
            all.insert("labels".into(), batch.labels.clone());
            all.insert("attention_mask".into(), batch.attention_mask.clone());
            crate::formats::safetensors::write(p, &all, &BTreeMap::new())?;
        }
        let names = program.frozen_shapes();
        crate::formats::host::to_program_layout(&names, &weights, spec.model.num_hidden_layers)?
    } else {
        random_program_weights(&program, 1)?
    };
    progress(&format!(
        "random weights: {:.2} GB in {:.1}s",
        frozen.iter().map(|t| t.bytes.len()).sum::<usize>() as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    ));
    let t0 = Instant::now();
    let mut trainer = Trainer::new(
        rt,
        spec.clone(),
        program,
        frozen,
        &lora,
        &BTreeMap::new(),
        false,
        false,
    )?;
    if spec
        .dpo
        .as_ref()
        .is_some_and(|p| p.reference == crate::program::Reference::Start)
    {
        // A DPO step against a starting adapter: another random one.
        trainer.set_reference(&random_lora(&spec, 2))?;
    }
    let compile_s = trainer.compile_s;
    let upload_s = t0.elapsed().as_secs_f64() - compile_s;
    progress(&format!(
        "compiled in {compile_s:.1}s, uploaded in {upload_s:.1}s; stepping"
    ));
    let mut times = Vec::new();
    let mut first_loss = f32::NAN;
    let mut losses = Vec::new();
    for i in 0..warmup + steps {
        let t = Instant::now();
        let (loss, _) = trainer.step(&batch, 1e-4)?;
        if i == 0 {
            first_loss = loss;
        }
        losses.push(loss);
        let took = t.elapsed().as_secs_f64();
        if i >= warmup {
            times.push(took);
        }
        let what = if i < warmup { "warm-up step" } else { "step" };
        progress(&format!(
            "{what} {}/{}: {took:.3}s, loss {loss:.4}",
            i + 1,
            warmup + steps
        ));
    }
    Ok(BenchResult {
        compile_s,
        upload_s,
        model_flops_per_step: model_flops_per_step(&spec),
        step_s: times,
        first_loss,
        losses,
        tokens_per_step: spec.batch * spec.seq,
        stablehlo_bytes: bytes,
        kernels: kernels.iter().map(|k| k.to_string()).collect(),
    })
}

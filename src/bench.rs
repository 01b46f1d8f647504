//! `xtrain bench`: time the training step on random weights (no checkpoint needed), and export
//! the same weights and batch so that peer implementations can be checked against it.

use crate::lora::SplitMix;
use crate::runtime::Runtime;
use crate::step::{self, Role, StepSpec};
use crate::train::{Batch, Trainer};
use anyhow::Result;
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// Random weights (uniform, std ~0.02; norms 1) under per-layer HF names.
pub fn random_weights(spec: &StepSpec, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = SplitMix(seed);
    step::frozen_weights(&spec.model)
        .into_iter()
        .map(|(name, shape)| {
            let n: i64 = shape.iter().product();
            let v: Vec<f32> = if name.contains("norm") {
                vec![1.0; n as usize]
            } else {
                (0..n)
                    .map(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.0346) as f32)
                    .collect()
            };
            (name, HostTensor::from_f32(&v, &shape))
        })
        .collect()
}

/// LoRA weights with nonzero B (so every gradient is nonzero and the peers' check means something).
pub fn random_lora(spec: &StepSpec, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = SplitMix(seed ^ 0xB);
    step::lora_tensors(&spec.model, &spec.lora)
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
    Batch {
        input_ids: HostTensor::from_i32(&ids, &dims),
        labels: HostTensor::from_i32(&ids, &dims),
        attention_mask: HostTensor::from_i32(&vec![1; n], &dims),
    }
}

/// What `xtrain bench` measured.
#[derive(serde::Serialize)]
pub struct BenchResult {
    pub compile_s: f64,
    pub step_s: Vec<f64>,
    pub first_loss: f32,
    pub tokens_per_step: i64,
    pub stablehlo_bytes: usize,
}

/// Compile (no cache) and run `warmup + steps` steps; optionally write the weights, LoRA and
/// batch to `export` (safetensors, HF/PEFT names) for peers.
pub fn run(
    spec: StepSpec,
    warmup: usize,
    steps: usize,
    export: Option<&Path>,
    plugin: Option<&str>,
) -> Result<BenchResult> {
    let weights = random_weights(&spec, 1);
    let lora = random_lora(&spec, 1);
    let batch = random_batch(&spec, 1);
    if let Some(p) = export {
        let mut all = weights.clone();
        all.extend(lora.clone());
        all.insert("input_ids".into(), batch.input_ids.clone());
        all.insert("labels".into(), batch.labels.clone());
        all.insert("attention_mask".into(), batch.attention_mask.clone());
        crate::safetensors::write(p, &all, &BTreeMap::new())?;
    }
    let program = step::build_train_step(&spec)?;
    let bytes = program.text.len();
    let names: Vec<(String, Vec<i64>)> = program
        .args
        .iter()
        .filter(|a| a.role == Role::Frozen)
        .map(|a| (a.name.clone(), a.shape.clone()))
        .collect();
    let frozen = crate::runtime::to_program_layout(&names, &weights, spec.model.num_hidden_layers)?;
    let rt = Runtime::open(plugin, Some(program.partitions))?;
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
    let compile_s = t0.elapsed().as_secs_f64();
    let mut times = Vec::new();
    let mut first_loss = f32::NAN;
    for i in 0..warmup + steps {
        let t = Instant::now();
        let (loss, _) = trainer.step(&batch, 1e-4)?;
        if i == 0 {
            first_loss = loss;
        }
        if i >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(BenchResult {
        compile_s,
        step_s: times,
        first_loss,
        tokens_per_step: spec.batch * spec.seq,
        stablehlo_bytes: bytes,
    })
}

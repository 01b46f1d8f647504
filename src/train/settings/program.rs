//! `ProgramSettings`: the settings a program dir fixes, by flag, from the spec it was built for
//! or from a run's options.

use super::run::{mesh_text, RunSettings};
use crate::model::lora::Projection;
use crate::program::{KeyBlocks, MlpChunks, Preference, ResultType, StepSpec};
use crate::train::options::TrainOptions;

/// The settings a program dir fixes, each field named as its flag (a subset of
/// [`RunSettings`]'s, written the same way): those of the step it was built for
/// ([`ProgramSettings::of_spec`]), compared with a run's ([`ProgramSettings::of_options`]). The
/// choices a run may leave to the program dir (`--remat auto`, `--offload auto`, `--key-block
/// auto`, `--mlp-chunk auto`) are None in a run's.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) struct ProgramSettings {
    lora_r: i64,
    lora_alpha: f64,
    lora_dropout: f64,
    lora_targets: String,
    betas: String,
    eps: f64,
    weight_decay: f64,
    max_grad_norm: f64,
    dtype: String,
    quant: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    remat: Option<String>,
    grad_accum: i64,
    loss_chunk: Option<i64>,
    attention_block: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    key_block: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mlp_chunk: Option<String>,
    attention_scores: String,
    matmul_result: String,
    keep_softmax_stats: bool,
    pin_mlp_activations: bool,
    mesh: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    offload: Option<String>,
    /// None for a `.safetensors` batch, which has the shape it has (checked against the
    /// program's later).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) batch_size: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) seq: Option<i64>,
    method: String,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    dpo: Option<DpoSettings>,
}

/// A DPO step's settings by flag (those of [`RunSettings`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
struct DpoSettings {
    beta: f64,
    dpo_loss: String,
    label_smoothing: f64,
    reference: String,
    precompute_reference: bool,
}

impl DpoSettings {
    fn of(p: &Preference) -> DpoSettings {
        DpoSettings {
            beta: p.beta,
            dpo_loss: p.dpo_loss.name().into(),
            label_smoothing: p.label_smoothing,
            reference: p.reference.name().into(),
            precompute_reference: p.precompute_reference,
        }
    }
}

fn method(dpo: Option<&Preference>) -> String {
    if dpo.is_some() { "dpo" } else { "sft" }.into()
}

impl ProgramSettings {
    /// The settings the program dir of `spec` fixes. The result types are said as they are in
    /// effect (with f32 compute, f32 and compute are one: f32).
    pub(super) fn of_spec(spec: &StepSpec) -> ProgramSettings {
        ProgramSettings {
            lora_r: spec.lora.r,
            lora_alpha: spec.lora.alpha,
            lora_dropout: spec.lora.dropout,
            lora_targets: Projection::list(&spec.lora.targets),
            betas: format!("{},{}", spec.adam.beta1, spec.adam.beta2),
            eps: spec.adam.eps,
            weight_decay: spec.adam.weight_decay,
            max_grad_norm: spec.adam.max_grad_norm,
            dtype: spec.dtype.mlir().to_string(),
            quant: spec.quant.name().to_string(),
            remat: Some(spec.remat.name().to_string()),
            grad_accum: spec.grad_accum,
            loss_chunk: spec.loss_chunk,
            attention_block: spec.attention_block,
            key_block: Some(spec.key_block.map_or("off".to_string(), |k| k.to_string())),
            mlp_chunk: Some(spec.mlp_chunk.map_or("off".to_string(), |n| n.to_string())),
            attention_scores: in_effect(spec.attention_scores, spec.dtype),
            matmul_result: in_effect(spec.matmul_result, spec.dtype),
            keep_softmax_stats: spec.keep_softmax_stats,
            pin_mlp_activations: spec.pin_mlp_activations,
            mesh: mesh_text(&spec.mesh),
            offload: Some(spec.offload.name().to_string()),
            batch_size: Some(spec.examples()),
            seq: Some(spec.seq),
            method: method(spec.dpo.as_ref()),
            dpo: spec.dpo.as_ref().map(DpoSettings::of),
        }
    }

    /// The same settings as the run `o` has them.
    pub(super) fn of_options(o: &TrainOptions) -> ProgramSettings {
        let s = &o.step;
        let run = RunSettings::of(o);
        ProgramSettings {
            lora_r: run.lora_r,
            lora_alpha: run.lora_alpha,
            lora_dropout: run.lora_dropout,
            lora_targets: run.lora_targets,
            betas: run.betas,
            eps: run.eps,
            weight_decay: run.weight_decay,
            max_grad_norm: run.max_grad_norm,
            dtype: run.dtype,
            quant: run.quant,
            remat: s.remat.map(|r| r.name().to_string()),
            grad_accum: run.grad_accum,
            loss_chunk: run.loss_chunk,
            attention_block: run.attention_block,
            key_block: (s.key_block != KeyBlocks::Auto).then_some(run.key_block),
            mlp_chunk: (s.mlp_chunk != MlpChunks::Auto).then_some(run.mlp_chunk),
            attention_scores: in_effect(s.attention_scores, s.dtype),
            matmul_result: in_effect(s.matmul_result, s.dtype),
            keep_softmax_stats: run.keep_softmax_stats,
            pin_mlp_activations: run.pin_mlp_activations,
            mesh: run.mesh,
            offload: s.offload.map(|o| o.name().to_string()),
            batch_size: Some(run.batch_size),
            seq: Some(run.seq),
            method: s.method.name().into(),
            // A run holds them whatever its method: a program dir's are taken by flag.
            dpo: Some(DpoSettings::of(&s.preference)),
        }
    }
}

/// A result-type flag's value as it is in effect with compute type `dtype`.
fn in_effect(r: ResultType, dtype: hlo::DType) -> String {
    r.in_effect(dtype).name().to_string()
}

//! [`StepOptions`]: the step as the command line gives it, and [`StepOptions::spec`], the one
//! way from options to a checked [`StepSpec`].

use super::attention::KeyBlocks;
use super::check::check_spec;
use super::memory::{Offload, Remat};
use super::mlp::MlpChunks;
use super::numerics::{Quant, ResultType, DEFAULT_ATTENTION_SCORES, DEFAULT_MATMUL_RESULT};
use super::step::{MeshPlan, StepSpec};
use crate::model::config::LlamaConfig;
use crate::model::lora::LoraConfig;
use crate::model::optim::AdamW;
use anyhow::Result;
use hlo::DType;

/// The step's settings as the command line gives them, before the model and the batch shape are
/// known: [`StepOptions::spec`] completes them into a [`StepSpec`]. Nothing here depends on the
/// plugin or target the program is for: every choice of the program's form has one default, for
/// every target, and a flag to change it.
#[derive(Clone, Debug)]
pub struct StepOptions {
    pub lora: LoraConfig,
    pub adam: AdamW,
    /// `--dtype`: weights, activations and matmuls in f32, or bf16 (mixed precision).
    pub dtype: DType,
    /// `--remat` when it names a policy; None for `auto` (see [`fit_choices`]).
    pub remat: Option<Remat>,
    /// `--grad-accum`: microbatches per step.
    pub grad_accum: i64,
    /// Device mesh and sharding rules (None: one device).
    pub mesh: Option<MeshPlan>,
    /// `--quant`: NF4 base weights (QLoRA), or as the checkpoint has them.
    pub quant: Quant,
    /// Compute the loss this many positions at a time (looped layers).
    pub loss_chunk: Option<i64>,
    pub attention_block: Option<i64>,
    /// `--key-block`: attention over key/value blocks, or every key at once.
    pub key_block: KeyBlocks,
    /// `--mlp-chunk`: the MLP in tiles of positions, or whole.
    pub mlp_chunk: MlpChunks,
    /// `--matmul-result`: the type bf16 matmuls give their result in.
    pub matmul_result: ResultType,
    /// `--attention-scores`: the type the attention scores are written in.
    pub attention_scores: ResultType,
    /// `--keep-softmax-stats`: remat layer keeps the softmax statistics.
    pub keep_softmax_stats: bool,
    /// `--pin-mlp-activations`: on a mesh, pin the MLP's hidden activations.
    pub pin_mlp_activations: bool,
    /// `--offload` when it names a choice (none, frozen, activations, all); None for `auto`,
    /// which the command decides once it knows the device's memory.
    pub offload: Option<Offload>,
    /// `--method`: supervised or preference training.
    pub method: super::preference::Method,
    /// Preference training's settings (`--beta`, `--dpo-loss`, ...), used with `--method dpo`
    /// (kept whatever the method, as the flags hold them).
    pub preference: super::preference::Preference,
}

impl StepOptions {
    /// The DPO settings in force: None with `--method sft`.
    pub fn dpo(&self) -> Option<&super::preference::Preference> {
        (self.method == super::preference::Method::Dpo).then_some(&self.preference)
    }
}

impl StepOptions {
    /// The result-type flags (`matmul-result`, `attention-scores`) set to other than their
    /// defaults with f32 compute, where they change nothing (every result is f32 then): each
    /// flag with the note that says so.
    pub fn idle_result_types(&self) -> Vec<(&'static str, String)> {
        if self.dtype != DType::F32 {
            return Vec::new();
        }
        [
            ("matmul-result", self.matmul_result, DEFAULT_MATMUL_RESULT),
            (
                "attention-scores",
                self.attention_scores,
                DEFAULT_ATTENTION_SCORES,
            ),
        ]
        .into_iter()
        .filter(|(_, value, default)| value != default)
        .map(|(flag, value, _)| {
            let note = format!(
                "--{flag} {} changes nothing with --dtype f32 (every result is f32 then); it is \
                 for --dtype bf16",
                value.name()
            );
            (flag, note)
        })
        .collect()
    }

    /// The spec of the step for `model` and batches of `batch` examples (rows, or with DPO
    /// pairs of two rows each) of `seq` tokens.
    pub fn spec(&self, model: LlamaConfig, batch: i64, seq: i64) -> Result<StepSpec> {
        let dtype = self.dtype;
        let context = self.mesh.as_ref().map_or(1, MeshPlan::context_size);
        let spec = StepSpec {
            model,
            lora: self.lora.clone(),
            adam: self.adam.clone(),
            batch: batch * if self.dpo().is_some() { 2 } else { 1 },
            seq,
            dtype,
            remat: self.remat.unwrap_or(Remat::Layer),
            grad_accum: self.grad_accum,
            mesh: self.mesh.clone(),
            quant: self.quant,
            loss_chunk: self.loss_chunk,
            attention_block: self.attention_block,
            key_block: self.key_block.resolve(seq, context),
            mlp_chunk: self.mlp_chunk.resolve(seq, context),
            // With f32 compute every result is f32 either way; the spec says so.
            matmul_result: ResultType::in_effect(self.matmul_result, dtype),
            attention_scores: ResultType::in_effect(self.attention_scores, dtype),
            keep_softmax_stats: self.keep_softmax_stats,
            pin_mlp_activations: self.pin_mlp_activations,
            offload: self.offload.unwrap_or(Offload::NONE),
            dpo: self.dpo().cloned(),
        };
        check_spec(&spec)?;
        Ok(spec)
    }
}

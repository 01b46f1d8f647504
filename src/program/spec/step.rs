//! [`StepSpec`]: everything a program is built for, and the mesh it is laid out on
//! ([`MeshPlan`]).

use super::memory::{Offload, Remat};
use super::numerics::{
    de_attention_scores, de_dtype, de_matmul_result, de_quant, ser_dtype, Quant, ResultType,
    DEFAULT_ATTENTION_SCORES, DEFAULT_MATMUL_RESULT,
};
use crate::model::config::LlamaConfig;
use crate::model::lora::LoraConfig;
use crate::model::optim::AdamW;
use hlo::DType;

/// What the program is built for. Each field is named as the flag that sets it (`--grad-accum`,
/// `--quant`, `--matmul-result`), and is written so in `manifest.json` (kebab-case). A manifest
/// of an earlier xtrain, which named some of them otherwise (`microbatches`, `nf4`,
/// `wide_matmul_results`, `weight_dtype` beside `compute_dtype`), still reads: the aliases below.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct StepSpec {
    pub model: LlamaConfig,
    pub lora: LoraConfig,
    pub adam: AdamW,
    /// Rows of the batch the step takes (all microbatches together).
    pub batch: i64,
    pub seq: i64,
    /// Element type of the frozen weights as the program takes them, and of activations and
    /// matmuls (an earlier xtrain wrote the same type twice, as `weight_dtype` and
    /// `compute_dtype`).
    #[serde(
        alias = "compute_dtype",
        serialize_with = "ser_dtype",
        deserialize_with = "de_dtype"
    )]
    pub dtype: DType,
    pub remat: Remat,
    /// Gradient accumulation: the batch is split into this many microbatches, looped inside
    /// the step, with one optimizer update.
    #[serde(alias = "microbatches")]
    pub grad_accum: i64,
    /// The device mesh and sharding rules (None: one device).
    #[serde(default)]
    pub mesh: Option<MeshPlan>,
    /// QLoRA: the projections' frozen weights as NF4 (4-bit NormalFloat, double-quantized
    /// scales), dequantized inside the step right before each matmul.
    #[serde(default, alias = "nf4", deserialize_with = "de_quant")]
    pub quant: Quant,
    /// With looped layers, compute the loss and its gradient this many positions at a time, so
    /// the [B, T, V] logits never exist whole (None: all at once; off by default, since on a
    /// mesh it did not lower the memory: docs/performance.md).
    #[serde(default, alias = "loss_chunk")]
    pub loss_chunk: Option<i64>,
    /// Query rows per causal attention block (blocks above the diagonal are skipped); None: the
    /// model's rule (`model::attention::query_block`: two blocks when the sequence is a multiple of
    /// 256, else one).
    #[serde(default, alias = "attention_block")]
    pub attention_block: Option<i64>,
    /// Attention over key/value blocks of this many tokens with the flash recurrence, its
    /// memory linear in the sequence (`--key-block`; see `model::flash`); None: every key at
    /// once, the queries in blocks of `attention_block`.
    #[serde(default, alias = "key_block")]
    pub key_block: Option<i64>,
    /// The MLP over tiles of this many positions, each recomputed in the backward pass, so that
    /// no [B, T, intermediate] tensor exists whole (`--mlp-chunk`; see `model::mlp_tiles`);
    /// None: the whole sequence at once. Left out of the manifest when None, as an xtrain
    /// before it wrote no such field (its manifests keep their settings hash).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_chunk: Option<i64>,
    /// The type bf16 matmuls give their result in: f32 (their accumulator, rounded to bf16 right
    /// after) or the compute type: the same arithmetic in another form (see
    /// [`crate::model::llama::Numerics::matmul_result`]). f32 with f32 compute.
    #[serde(
        default = "ResultType::compute",
        alias = "wide_matmul_results",
        deserialize_with = "de_matmul_result"
    )]
    pub matmul_result: ResultType,
    /// The type the attention scores are written in before the softmax: the compute type (bf16
    /// with bf16 compute, as Hugging Face's eager attention has them) or f32 (see
    /// [`crate::model::llama::Numerics::scores`]). f32 with f32 compute.
    #[serde(
        default = "ResultType::f32",
        alias = "narrow_attention_scores",
        deserialize_with = "de_attention_scores"
    )]
    pub attention_scores: ResultType,
    /// `--remat layer` also keeps each layer's softmax row max and sum, so the recomputation
    /// skips the row max's pass over the scores.
    #[serde(default, alias = "layer_keeps_softmax_stats")]
    pub keep_softmax_stats: bool,
    /// On a mesh, the MLP's hidden activations are pinned where the sharding rules put
    /// activations (see `model::llama::Llama::pin`) instead of left to the partitioner.
    #[serde(default, alias = "pin_mlp_activations")]
    pub pin_mlp_activations: bool,
    /// What the step keeps in host memory instead of the device's (looped layers only).
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// Preference training (`--method dpo`): the batch's rows are pairs of completions, chosen
    /// then rejected (`batch` counts rows, two per pair), and the step's loss is DPO's. None:
    /// supervised training (left out of the manifest, as an xtrain before it wrote nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dpo: Option<super::preference::Preference>,
}

impl StepSpec {
    /// How many devices split the sequence (see `model::context`): 1 without a context axis.
    pub fn context_size(&self) -> i64 {
        self.mesh.as_ref().map_or(1, MeshPlan::context_size)
    }

    /// The trips of each of a layer's attention loops over key/value blocks (None without key
    /// blocks): the causal block pairs (`model::flash`), or on a context axis the visits times
    /// the query blocks of a chunk (`model::context`).
    pub fn attention_loop_trips(&self) -> Option<i64> {
        let kb = self.key_block?;
        Some(match self.context_size() {
            1 => crate::model::flash::loop_trips(self.seq, kb),
            cp => crate::model::context::loop_trips(self.seq, cp, kb),
        })
    }

    /// One device, remat per layer, AdamW's defaults, no gradient accumulation, quantization,
    /// loss chunks or attention-block override, matmul results in the compute type: the plain
    /// step, for callers that set only what they need on top
    /// (`StepSpec { remat: Remat::None, ..StepSpec::new(..) }`).
    pub fn new(model: LlamaConfig, lora: LoraConfig, batch: i64, seq: i64, dtype: DType) -> Self {
        StepSpec {
            model,
            lora,
            adam: AdamW::default(),
            batch,
            seq,
            dtype,
            remat: Remat::Layer,
            grad_accum: 1,
            mesh: None,
            quant: Quant::None,
            loss_chunk: None,
            attention_block: None,
            key_block: None,
            mlp_chunk: None,
            // The results in the compute type (with f32 compute, f32 either way).
            matmul_result: ResultType::Compute,
            attention_scores: ResultType::F32,
            keep_softmax_stats: false,
            pin_mlp_activations: false,
            offload: Offload::NONE,
            dpo: None,
        }
    }

    /// Rows of the batch per example: two for preference pairs (chosen and rejected), one
    /// otherwise.
    pub fn rows_per_example(&self) -> i64 {
        if self.dpo.is_some() {
            2
        } else {
            1
        }
    }

    /// Examples per step as `--batch-size` counts them: pairs for DPO, else rows.
    pub fn examples(&self) -> i64 {
        self.batch / self.rows_per_example()
    }

    /// This spec with the program form's defaults (`--matmul-result`, `--attention-scores`) for
    /// its compute type, as the commands that take no such flags (`generate`) build it.
    pub fn with_default_form(self) -> StepSpec {
        StepSpec {
            matmul_result: ResultType::in_effect(DEFAULT_MATMUL_RESULT, self.dtype),
            attention_scores: ResultType::in_effect(DEFAULT_ATTENTION_SCORES, self.dtype),
            ..self
        }
    }
}

/// A device mesh and the logical-axis rules that place tensors on it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MeshPlan {
    pub axes: Vec<(String, i64)>,
    pub rules: crate::program::sharding::Rules,
}

impl MeshPlan {
    pub fn mesh(&self) -> hlo::Mesh {
        hlo::Mesh {
            axes: self.axes.clone(),
        }
    }

    pub fn devices(&self) -> i64 {
        self.mesh().device_count()
    }

    /// How many devices split the sequence: the product of the mesh axes the rules give the
    /// `length` axis (the `context` axis by default), 1 where there are none.
    pub fn context_size(&self) -> i64 {
        let mesh = self.mesh();
        self.rules.0.get("length").map_or(1, |axes| {
            axes.iter().filter_map(|a| mesh.axis_size(a)).product()
        })
    }

    /// The sharding of a tensor named `name` (its logical axes come from the name).
    pub fn sharding(&self, name: &str, shape: &[i64]) -> hlo::Sharding {
        let axes = crate::program::sharding::logical_axes(name, shape.len());
        self.rules.sharding(&axes, shape, &self.mesh())
    }
}

/// Activations are placed by the same rules as the arguments.
impl crate::model::llama::Placement for MeshPlan {
    fn place(&self, logical: &[&str], dims: &[i64]) -> hlo::Sharding {
        self.rules.sharding(logical, dims, &self.mesh())
    }

    fn mesh(&self) -> hlo::Mesh {
        MeshPlan::mesh(self)
    }
}

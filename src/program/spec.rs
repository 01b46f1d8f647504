//! What a program is built for: the model, LoRA, optimizer constants, batch shape, numerics,
//! remat policy, gradient accumulation and device mesh ([`StepSpec`]), checked before building.

use crate::model::config::LlamaConfig;
use crate::model::lora::LoraConfig;
use crate::model::optim::AdamW;
use crate::program::signature::{de_dtype, ser_dtype};
use anyhow::{bail, Result};
use hlo::DType;

/// How much of the forward pass the backward pass recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Remat {
    /// Layers unrolled, every intermediate kept (program size grows with depth).
    None,
    /// Layers looped; each layer's input kept, the rest recomputed in the backward loop.
    Layer,
    /// Layers looped; each layer's input and its frozen projections' outputs kept.
    SaveProj,
}

impl Remat {
    pub fn parse(s: &str) -> Result<Remat> {
        Ok(match s {
            "none" => Remat::None,
            "layer" => Remat::Layer,
            "save-proj" => Remat::SaveProj,
            _ => bail!("--remat must be none, layer or save-proj, got `{s}`"),
        })
    }

    /// Whether layers are a loop over stacked weights.
    pub fn scan(self) -> bool {
        self != Remat::None
    }
}

/// What the program is built for.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepSpec {
    pub model: LlamaConfig,
    pub lora: LoraConfig,
    pub adam: AdamW,
    /// Rows of the batch the step takes (all microbatches together).
    pub batch: i64,
    pub seq: i64,
    /// Element type of the frozen weights as the program takes them.
    #[serde(serialize_with = "ser_dtype", deserialize_with = "de_dtype")]
    pub weight_dtype: DType,
    /// Element type of activations and matmuls.
    #[serde(serialize_with = "ser_dtype", deserialize_with = "de_dtype")]
    pub compute_dtype: DType,
    pub remat: Remat,
    /// Gradient accumulation: the batch is split into this many microbatches, looped inside
    /// the step, with one optimizer update.
    pub microbatches: i64,
    /// The device mesh and sharding rules (None: one device).
    #[serde(default)]
    pub mesh: Option<MeshPlan>,
    /// QLoRA: the projections' frozen weights as NF4 (4-bit NormalFloat, double-quantized
    /// scales), dequantized inside the step right before each matmul.
    #[serde(default)]
    pub nf4: bool,
    /// With looped layers, compute the loss and its gradient this many positions at a time, so
    /// the [B, T, V] logits never exist whole (None: all at once). On one device this lowers the
    /// 8B step's temporaries (5.60 -> 4.32 GiB at 2048 tokens); with a mesh it measured slightly
    /// worse, so it is off by default.
    #[serde(default)]
    pub loss_chunk: Option<i64>,
    /// Query rows per causal attention block (blocks above the diagonal are skipped); None: 128
    /// when the sequence is a multiple of 128 longer than that, else the whole sequence.
    #[serde(default)]
    pub attention_block: Option<i64>,
    /// bf16 matmuls give their f32 accumulator, rounded to bf16 right after, instead of a bf16
    /// result: the same arithmetic, in the form XLA CPU runs on the CPU's native bf16 GEMM (see
    /// [`crate::model::llama::Numerics::matmul_result`]). Chosen by backend: on for CPU plugins.
    #[serde(default)]
    pub wide_matmul_results: bool,
}

impl StepSpec {
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
            weight_dtype: dtype,
            compute_dtype: dtype,
            remat: Remat::Layer,
            microbatches: 1,
            mesh: None,
            nf4: false,
            loss_chunk: None,
            attention_block: None,
            wide_matmul_results: false,
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

    /// The sharding of a tensor named `name` (its logical axes come from the name).
    pub fn sharding(&self, name: &str, shape: &[i64]) -> hlo::Sharding {
        let axes = crate::program::sharding::logical_axes(name, shape.len());
        self.rules.sharding(&axes, shape, &self.mesh())
    }
}

pub(super) fn check_spec(spec: &StepSpec) -> Result<()> {
    spec.lora.validate()?;
    if spec.microbatches < 1 || spec.batch % spec.microbatches != 0 {
        bail!(
            "--grad-accum {} must divide the batch size {}",
            spec.microbatches,
            spec.batch
        );
    }
    if let Some(r) = spec.attention_block {
        if r < 1 || spec.seq % r != 0 {
            bail!(
                "--attention-block {r} must be a positive divisor of the sequence length {}",
                spec.seq
            );
        }
    }
    Ok(())
}

//! What a program is built for: the model, LoRA, optimizer constants, batch shape, numerics,
//! remat policy, gradient accumulation and device mesh ([`StepSpec`]), checked before building;
//! and the same settings as the user gives them, before the model, the batch shape and the
//! platform are known ([`StepOptions`]).

use crate::model::config::LlamaConfig;
use crate::model::lora::LoraConfig;
use crate::model::optim::AdamW;
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
    /// Layers looped; each layer's input, its frozen projections' outputs, its attention output
    /// and its softmax's row max and sum kept.
    SaveProj,
}

impl Remat {
    pub fn parse(s: &str) -> Result<Remat> {
        Ok(match s {
            "none" => Remat::None,
            "layer" => Remat::Layer,
            "save-proj" => Remat::SaveProj,
            _ => bail!("--remat must be auto, none, layer or save-proj, got `{s}`"),
        })
    }

    /// `--remat` as given: None for `auto`, which the command decides once it knows the
    /// device's memory (see [`fit_choices`]).
    pub fn parse_choice(s: &str) -> Result<Option<Remat>> {
        match s {
            "auto" => Ok(None),
            other => Remat::parse(other).map(Some),
        }
    }

    /// The `--remat` value that gives this.
    pub fn name(self) -> &'static str {
        match self {
            Remat::None => "none",
            Remat::Layer => "layer",
            Remat::SaveProj => "save-proj",
        }
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
    /// The attention scores are written in the compute type (bf16 with bf16 compute, as Hugging
    /// Face's eager attention has them) instead of f32 before the softmax (see
    /// [`crate::model::llama::Numerics::scores`]). Chosen by backend: on for GPUs and TPUs.
    #[serde(default)]
    pub narrow_attention_scores: bool,
    /// The forward loop's stacks (each layer's input, save-proj's saved points) start
    /// uninitialized (XLA's `AllocateBuffer`) instead of filled with a constant, which the loop
    /// overwrites before the backward loop reads it. Chosen by backend: on for GPUs and TPUs,
    /// whose compilers implement it (see [`StepSpec::leaves_stacks_uninitialized`] for where
    /// it applies).
    #[serde(default)]
    pub uninitialized_stacks: bool,
    /// `--remat layer` also keeps each layer's softmax row max and sum, so the recomputation
    /// skips the row max's pass over the scores. Chosen by backend: on for TPUs only (see
    /// [`layer_remat_keeps_softmax_stats`]).
    #[serde(default)]
    pub layer_keeps_softmax_stats: bool,
    /// On a mesh, the MLP's hidden activations are pinned where the sharding rules put
    /// activations (see `model::llama::Llama::pin`). Chosen by backend: on for TPUs
    /// only (see [`pins_mlp_activations`]).
    #[serde(default)]
    pub pin_mlp_activations: bool,
    /// What the step keeps in host memory instead of the device's (looped layers only).
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
}

/// Host offload (XLA memory kinds; `pinned_host` memory that the device reads by DMA): the
/// frozen layer weights live in host memory and each layer's shard is copied to the device in
/// the layer loop just before use; the activations the backward pass needs (each layer's input,
/// and with `--remat save-proj` the projections' outputs) are written to host memory in the
/// forward loop and read back in the backward loop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Offload {
    pub frozen: bool,
    pub activations: bool,
}

impl Offload {
    pub const NONE: Offload = Offload {
        frozen: false,
        activations: false,
    };

    pub fn is_none(&self) -> bool {
        *self == Offload::NONE
    }

    /// `--offload` as given: none, frozen, activations or all (`auto` is decided by the command,
    /// which knows the device's memory).
    pub fn parse(s: &str) -> Result<Offload> {
        Ok(match s {
            "none" => Offload::NONE,
            "frozen" => Offload {
                frozen: true,
                activations: false,
            },
            "activations" => Offload {
                frozen: false,
                activations: true,
            },
            "all" => Offload {
                frozen: true,
                activations: true,
            },
            _ => bail!("--offload must be auto, none, frozen, activations or all, got `{s}`"),
        })
    }

    /// The `--offload` value that gives this.
    pub fn name(&self) -> &'static str {
        match (self.frozen, self.activations) {
            (false, false) => "none",
            (true, false) => "frozen",
            (false, true) => "activations",
            (true, true) => "all",
        }
    }

    /// What `--offload auto` tries, in order, until the step fits: nothing; the saved
    /// activations (a few GB moved per step); the frozen weights as well (every weight crosses
    /// the host link twice a step).
    pub const AUTO_ORDER: [Offload; 3] = [
        Offload::NONE,
        Offload {
            frozen: false,
            activations: true,
        },
        Offload {
            frozen: true,
            activations: true,
        },
    ];
}

/// What the command tries, in order, until the step fits the device's memory, for `--remat`
/// and `--offload` as given (None: `auto`): with `--remat auto`, save-proj first (the
/// backward pass recomputes no projection: in the TPU cost model the 8B bf16 step on
/// `tpu:v5p:2x2x1` at batch 16, blocks of 1024, takes 1.039 s with save-proj and 1.350 s with
/// layer, for 2.8 times the memory per chip: 39.41 against 14.27 GiB), then layer; with `--offload auto`, the offload choices of
/// [`Offload::AUTO_ORDER`] (for layer remat only: save-proj is tried without offload, or with
/// the one `--offload` names). Where the device's memory is not known the command takes
/// [`default_choice`] instead.
pub fn fit_choices(remat: Option<Remat>, offload: Option<Offload>) -> Vec<(Remat, Offload)> {
    let offloads = match offload {
        Some(o) => vec![o],
        None => Offload::AUTO_ORDER.to_vec(),
    };
    if remat == Some(Remat::None) {
        // Unrolled layers cannot offload (nothing is kept between loops): one choice.
        return vec![(Remat::None, offload.unwrap_or(Offload::NONE))];
    }
    let mut choices = Vec::new();
    if remat.is_none() {
        choices.push((Remat::SaveProj, offload.unwrap_or(Offload::NONE)));
    }
    let remat = remat.unwrap_or(Remat::Layer);
    choices.extend(offloads.into_iter().map(|o| (remat, o)));
    choices
}

/// What `--remat auto` and `--offload auto` are where the device's memory is not known (a CPU
/// plugin, `compile` without `--check --target`): remat per layer, nothing offloaded.
pub fn default_choice(remat: Option<Remat>, offload: Option<Offload>) -> (Remat, Offload) {
    (
        remat.unwrap_or(Remat::Layer),
        offload.unwrap_or(Offload::NONE),
    )
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
            narrow_attention_scores: false,
            uninitialized_stacks: false,
            layer_keeps_softmax_stats: false,
            pin_mlp_activations: false,
            offload: Offload::NONE,
        }
    }

    /// Whether the program's forward loop starts its stacks uninitialized: where the backend
    /// allows it ([`StepSpec::uninitialized_stacks`]), the layers are looped, and the stacks
    /// stay in device memory (XLA's host offloading is not known to place an `AllocateBuffer`
    /// in host memory, so offloaded stacks keep their fill). In the compiled looped step the TPU
    /// compiler drops the fill itself; in the unrolled 1- and 2-layer steps the cost model's
    /// estimate is made from it cannot (it does not see that every slot is written), and the
    /// fill was priced as part of each layer: on `tpu:v5p:2x2x1`, 8B save-proj at batch 16,
    /// 1.019 -> 0.998 s estimated, with the looped step's own cost analysis unchanged.
    pub fn leaves_stacks_uninitialized(&self) -> bool {
        self.uninitialized_stacks && self.remat.scan() && !self.offload.activations
    }

    /// The memory an argument is passed in: host memory for the stacked frozen layer weights
    /// when they are offloaded, else the device's own (None).
    pub fn arg_memory(&self, arg: &crate::program::TensorSpec) -> Option<hlo::MemoryKind> {
        (self.offload.frozen
            && arg.role == crate::program::Role::Frozen
            && arg.name.contains("layers.*."))
        .then_some(hlo::MemoryKind::PinnedHost)
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

/// Activations are placed by the same rules as the arguments.
impl crate::model::llama::Placement for MeshPlan {
    fn place(&self, logical: &[&str], dims: &[i64]) -> hlo::Sharding {
        self.rules.sharding(logical, dims, &self.mesh())
    }
}

pub(super) fn check_spec(spec: &StepSpec) -> Result<()> {
    spec.lora.validate()?;
    if !spec.offload.is_none() && !spec.remat.scan() {
        bail!(
            "--offload {} needs looped layers (--remat layer or save-proj): layers are copied to \
             and from host memory one at a time inside the layer loop",
            spec.offload.name()
        );
    }
    spec.adam.validate()?;
    if spec.batch < 1 {
        bail!("--batch must be at least 1, got {}", spec.batch);
    }
    if spec.seq < 2 {
        bail!(
            "--seq must be at least 2 (a token and the next one it predicts), got {}",
            spec.seq
        );
    }
    if spec.nf4 {
        check_nf4_blocks(&spec.model)?;
    }
    if let Some(m) = &spec.mesh {
        crate::program::sharding::check_axes(&m.axes, &m.rules)?;
        let mut tensors = crate::model::tensors::frozen_args(&spec.model, true);
        tensors.extend(
            crate::model::tensors::lora_args(&spec.model, &spec.lora, true)
                .into_iter()
                .map(|t| (t.name, t.shape)),
        );
        tensors.push(("input_ids".into(), vec![spec.batch, spec.seq]));
        crate::program::sharding::check_splits(&m.axes, &m.rules, &tensors)?;
    }
    if let Some(c) = spec.loss_chunk {
        if c < 1 || spec.seq % c != 0 {
            bail!(
                "--loss-chunk {c} must be a positive divisor of the sequence length {}",
                spec.seq
            );
        }
    }
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

/// NF4 quantizes each projection in blocks of [`crate::model::quant::BLOCK`] values: every
/// projection's size must be a multiple of it (the flag is refused here, before a builder
/// meets a shape it cannot split).
fn check_nf4_blocks(cfg: &LlamaConfig) -> Result<()> {
    let block = crate::model::quant::BLOCK as i64;
    for (kind, shape) in crate::model::tensors::layer_kinds(cfg) {
        let n: i64 = shape.iter().product();
        if crate::model::tensors::is_projection(kind) && n % block != 0 {
            bail!(
                "--quant nf4 quantizes in blocks of {block} values, but this model's `{kind}` has {} = {n} values, not a multiple of {block}; train it without --quant",
                shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
            );
        }
    }
    Ok(())
}

/// The step's settings as the command line gives them, before the model, the batch shape and the
/// platform the program is for are known: [`StepOptions::spec`] completes them into a
/// [`StepSpec`].
#[derive(Clone, Debug)]
pub struct StepOptions {
    pub lora: LoraConfig,
    pub adam: AdamW,
    /// `--dtype`: "f32" or "bf16" (weights, activations and matmuls).
    pub dtype: String,
    /// `--remat` when it names a policy; None for `auto` (see [`fit_choices`]).
    pub remat: Option<Remat>,
    /// Gradient accumulation: microbatches per step.
    pub microbatches: i64,
    /// Device mesh and sharding rules (None: one device).
    pub mesh: Option<MeshPlan>,
    /// QLoRA: NF4 base weights.
    pub nf4: bool,
    /// Compute the loss this many positions at a time (looped layers).
    pub loss_chunk: Option<i64>,
    pub attention_block: Option<i64>,
    /// `--matmul-result`: auto, f32 or compute (see [`wide_matmul_results`]).
    pub matmul_result: String,
    /// `--attention-scores`: auto, f32 or compute (see [`narrow_attention_scores`]).
    pub attention_scores: String,
    /// `--offload` when it names a choice (none, frozen, activations, all); None for `auto`,
    /// which the command decides once it knows the device's memory.
    pub offload: Option<Offload>,
}

impl StepOptions {
    /// The spec of the step for `model`, batches of `batch` x `seq` tokens, built for a plugin on
    /// `platform` (PJRT's platform name: cpu, cuda, rocm, tpu).
    pub fn spec(
        &self,
        model: LlamaConfig,
        batch: i64,
        seq: i64,
        platform: &str,
    ) -> Result<StepSpec> {
        let dtype = match self.dtype.as_str() {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            other => bail!("--dtype must be f32 or bf16, got `{other}`"),
        };
        if let Some(o) = self.offload.filter(|o| !o.is_none() && platform == "cpu") {
            bail!(
                "--offload {}: XLA's CPU compiler cannot place values in host memory (no \
                 annotate_device_placement: the CPU plugin's memory kinds device, pinned_host \
                 and unpinned_host are all the same RAM); offload is for GPUs and TPUs (compile \
                 for one with --target, e.g. cuda:h100:8)",
                o.name()
            );
        }
        let spec = StepSpec {
            model,
            lora: self.lora.clone(),
            adam: self.adam.clone(),
            batch,
            seq,
            weight_dtype: dtype,
            compute_dtype: dtype,
            remat: self.remat.unwrap_or(Remat::Layer),
            microbatches: self.microbatches,
            mesh: self.mesh.clone(),
            nf4: self.nf4,
            loss_chunk: self.loss_chunk,
            attention_block: self
                .attention_block
                .or_else(|| accelerator_attention_block(platform, seq)),
            wide_matmul_results: wide_matmul_results(&self.matmul_result, platform)?,
            // With f32 compute the scores are f32 either way; the spec says so.
            narrow_attention_scores: narrow_attention_scores(
                &self.attention_scores,
                platform,
                dtype,
            )?,
            uninitialized_stacks: allocates_uninitialized(platform),
            layer_keeps_softmax_stats: layer_remat_keeps_softmax_stats(platform),
            pin_mlp_activations: pins_mlp_activations(platform),
            offload: self.offload.unwrap_or(Offload::NONE),
        };
        check_spec(&spec)?;
        Ok(spec)
    }
}

/// The default query block of causal attention on a plugin whose platform is `platform`, where
/// it differs from [`crate::model::llama`]'s (an eighth of the sequence, at least 128; blocks
/// wholly above the diagonal are skipped). On GPUs, two blocks (halves: 3/4 of the scores
/// computed) when the sequence is a multiple of 256, else one; on TPUs, four (5/8 computed) when
/// it is a multiple of 512, else as on GPUs. Llama 3.1 8B, seq 2048:
/// - `cuda:h100:1`, batch 1 (`tools/aot-kernels`; JAX's same step: 202 kernels per layer, 2.92
///   GiB of temporaries): blocks of 256: 308 kernels, 1.69 GiB; 512: 234, 1.70 GiB; 1024: 198,
///   1.79 GiB; one block: 179, 2.07 GiB (the GPU compilers make each block's matmuls and
///   softmax kernels of their own);
/// - the TPU cost model's estimate (`compile --check`), bf16 scores: `tpu:v5p:2x2x1` batch 4,
///   blocks of 512: 390.8 ms per step, 1024: 392.3 ms; `tpu:v6e:2x2` batch 32, 512: 2.045 s,
///   1024: 2.127 s (v6e's HBM is a third of v5p's per FLOP, so the skipped scores count for
///   more); with f32 scores on v5p, 256: 446.5 ms; 512: 419.9; 1024: 412.0; one block: 419.8.
///
/// The CPU keeps eighths. `--attention-block` still chooses.
pub fn accelerator_attention_block(platform: &str, seq: i64) -> Option<i64> {
    match platform {
        "tpu" if seq % 512 == 0 => Some(seq / 4),
        "cuda" | "rocm" | "tpu" if seq % 256 == 0 => Some(seq / 2),
        "cuda" | "rocm" | "tpu" => Some(seq),
        _ => None,
    }
}

/// Whether the compiler of a plugin whose platform is `platform` implements XLA's
/// `AllocateBuffer` (a buffer left uninitialized), which [`StepSpec::uninitialized_stacks`]
/// needs: TPU and GPU compilers do; XLA CPU rejects the program ("No registered implementation
/// for untyped custom call to AllocateBuffer for Host").
pub fn allocates_uninitialized(platform: &str) -> bool {
    matches!(platform, "cuda" | "rocm" | "tpu")
}

/// Whether `--remat layer` keeps each layer's softmax statistics on a plugin whose platform is
/// `platform` ([`StepSpec::layer_keeps_softmax_stats`]): on TPUs, where the cost model has the
/// 8B step on `tpu:v5p:2x2x1` at 389.7 -> 387.1 ms (batch 4). Not on GPUs: there the compiler
/// fuses the softmax's max, exp and sum into one kernel either way, and saving the statistics
/// broke that fusion (`cuda:h100:1`, 8B batch 1: 200 -> 210 kernels per layer, the same bytes).
/// Not on the CPU, where it was not measured to help.
pub fn layer_remat_keeps_softmax_stats(platform: &str) -> bool {
    platform == "tpu"
}

/// Whether a step on a mesh pins the MLP's hidden activations on a plugin whose platform is
/// `platform` ([`StepSpec::pin_mlp_activations`]): on TPUs, where at one row per chip the
/// partitioner otherwise split F and paid all-to-alls to get back, and the cost model has the
/// 8B step on `tpu:v5p:2x2x1` at 387.1 -> 362.5 ms (batch 4) and the 70B step on
/// `tpu:v5p:2x2x2` at 2.504 -> 2.412 s (batch 8, for 22.67 -> 24.32 GiB per chip: the gate and
/// up weights are gathered instead of the activations). Not on GPUs, where nothing could be
/// timed and it costs memory the memory-bound recipes need (70B NF4 on `cuda:rtx4090:2`, batch
/// 2, `--offload all`: 3.12 -> 4.11 GiB of temporaries per device). Not on the CPU.
pub fn pins_mlp_activations(platform: &str) -> bool {
    platform == "tpu"
}

/// Whether bf16 matmuls give their f32 accumulator ([`StepSpec::wide_matmul_results`]) on a plugin
/// whose platform is `platform`: `choice` is `auto` (yes on `cpu`, whose XLA runs that form on the
/// CPU's bf16 GEMM and converts both operands of a bf16-result product to f32 instead: the
/// 8-layer benchmark step 1.25 -> 0.79 s; no elsewhere: a GPU's cuBLAS writes bf16 directly),
/// `f32` or `compute`. The one rule for `--matmul-result`, whichever command builds the program;
/// the platform is the one the opened plugin reports (`train`, `bench`, `generate`), or, for
/// `compile`, which opens none, the one its `--plugin` names.
pub fn wide_matmul_results(choice: &str, platform: &str) -> Result<bool> {
    match choice {
        "f32" => Ok(true),
        "compute" => Ok(false),
        "auto" => Ok(platform == "cpu"),
        other => bail!("--matmul-result must be auto, f32 or compute, got `{other}`"),
    }
}

/// Whether the attention scores are written in the compute type
/// ([`StepSpec::narrow_attention_scores`]) on a plugin whose platform is `platform`: `choice` is
/// `auto` (yes on `cuda`, `rocm` and `tpu`, where the scores are the step's largest activation
/// traffic: in the TPU cost model the 8B bf16 step on `tpu:v5p:2x2x1`, batch 4, goes from 412.0
/// to 392.3 ms and from 548 to 502 GB accessed per chip; no on `cpu`, whose bf16 program keeps
/// f32 scores as before), `f32` or `compute`. With f32 `compute` the scores are f32 either
/// way, and the spec says so (no), whatever the choice.
pub fn narrow_attention_scores(choice: &str, platform: &str, compute: DType) -> Result<bool> {
    let narrow = match choice {
        "f32" => false,
        "compute" => true,
        "auto" => matches!(platform, "cuda" | "rocm" | "tpu"),
        other => bail!("--attention-scores must be auto, f32 or compute, got `{other}`"),
    };
    Ok(narrow && compute == DType::BF16)
}

/// Element types in specs and manifests are written as MLIR names (`f32`, `bf16`, `ui8`).
pub(super) fn ser_dtype<S: serde::Serializer>(
    d: &DType,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.mlir())
}

pub(super) fn de_dtype<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<DType, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    DType::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown element type `{s}`")))
}

//! What a program is built for. A step's settings take three forms on their way from the command
//! line to the program, each for a reason:
//!
//! - `StepArgs` (the binary's `cli/args.rs`): the flags as clap parses them, shared by `train`,
//!   `compile` and `bench`, every value already typed (`--remat` is a policy or `auto`,
//!   `--dtype` an element type). It exists so that the library never sees clap; `options()`
//!   makes it a `StepOptions`, checking what needs several flags (the mesh against its sharding
//!   rules, LoRA, AdamW).
//! - [`StepOptions`]: the step as the user asked for it, before the model, the batch shape and
//!   the device are known: `--remat auto` and `--offload auto` are still open (None). It exists
//!   because a run learns its batch shape from its data and its remat and offload from the
//!   device only after its options are settled: it is what `train::options::TrainOptions`
//!   holds, what the settings a checkpoint or a program dir recorded are applied to, by flag
//!   (`train::settings`), and what [`fit_choices`] expands into the choices tried.
//! - [`StepSpec`]: everything the program is built for, complete and checked (`check_spec`):
//!   the model's config, the batch shape, one remat policy and one offload. The builders take
//!   only this, and the manifest records it, so that a program dir says exactly what its text
//!   is.
//!
//! [`StepOptions::spec`] is the one way from options to a spec.

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
    /// model's rule (`model::llama::query_block`: two blocks when the sequence is a multiple of
    /// 256, else one).
    #[serde(default, alias = "attention_block")]
    pub attention_block: Option<i64>,
    /// Attention over key/value blocks of this many tokens with the flash recurrence, its
    /// memory linear in the sequence (`--key-block`; see `model::flash`); None: every key at
    /// once, the queries in blocks of `attention_block`.
    #[serde(default, alias = "key_block")]
    pub key_block: Option<i64>,
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
}

/// `--quant`: the frozen projections as the checkpoint has them, or as NF4 (QLoRA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Quant {
    #[default]
    None,
    Nf4,
}

impl Quant {
    /// `--quant` as given.
    pub fn parse(s: &str) -> Result<Quant> {
        match s {
            "none" => Ok(Quant::None),
            "nf4" => Ok(Quant::Nf4),
            other => bail!("--quant must be nf4 or none, got `{other}`"),
        }
    }

    /// The `--quant` value that gives this.
    pub fn name(self) -> &'static str {
        match self {
            Quant::None => "none",
            Quant::Nf4 => "nf4",
        }
    }

    pub fn is_nf4(self) -> bool {
        self == Quant::Nf4
    }
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

    /// `--offload` as given: None for `auto`, which the command decides once it knows the
    /// device's memory (see [`fit_choices`]).
    pub fn parse_choice(s: &str) -> Result<Option<Offload>> {
        match s {
            "auto" => Ok(None),
            other => Offload::parse(other).map(Some),
        }
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
/// backward pass recomputes no projection, for about three times layer's memory), then layer;
/// with `--offload auto`, the offload choices of
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
            // The results in the compute type (with f32 compute, f32 either way).
            matmul_result: ResultType::Compute,
            attention_scores: ResultType::F32,
            keep_softmax_stats: false,
            pin_mlp_activations: false,
            offload: Offload::NONE,
        }
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
    if spec.seq > spec.model.max_position_embeddings {
        bail!(
            "--seq {} is longer than the model's max_position_embeddings {} (config.json): it was \
             not trained on positions past that; use --seq {} or less",
            spec.seq,
            spec.model.max_position_embeddings,
            spec.model.max_position_embeddings
        );
    }
    if spec.quant.is_nf4() {
        check_nf4_blocks(&spec.model)?;
    }
    check_lora_rank(spec)?;
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
        if spec.remat == Remat::None {
            bail!(
                "--loss-chunk {c} computes the loss in chunks after the looped layers; with \
                 --remat none the layers are unrolled and the loss is computed whole, so the \
                 flag would do nothing: give --remat layer or save-proj, or leave it out"
            );
        }
        if c < 1 || spec.seq % c != 0 {
            bail!(
                "--loss-chunk {c} must be a positive divisor of the sequence length {}",
                spec.seq
            );
        }
    }
    if spec.grad_accum < 1 {
        bail!("--grad-accum must be at least 1, got {}", spec.grad_accum);
    }
    if spec.batch % spec.grad_accum != 0 {
        bail!(
            "--grad-accum {} must divide the batch size {}",
            spec.grad_accum,
            spec.batch
        );
    }
    if spec.keep_softmax_stats && spec.remat == Remat::None {
        bail!(
            "--keep-softmax-stats is for --remat layer (save-proj keeps the statistics anyway); \
             with --remat none the backward pass recomputes nothing"
        );
    }
    if spec.pin_mlp_activations && spec.mesh.is_none() {
        bail!(
            "--pin-mlp-activations places activations on a device mesh, but this step runs on \
             one device; give --mesh (or a --target of several devices), or leave the flag out"
        );
    }
    check_attention_form(spec)?;
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

/// The attention's form: a key block, a context split and the query blocks of the whole-key
/// form that go together.
fn check_attention_form(spec: &StepSpec) -> Result<()> {
    if let Some(r) = spec.attention_block {
        if spec.context_size() > 1 {
            return Err(AttentionBlockUnused {
                block: r,
                why: "which a sequence split over the context axis does not use (it attends \
                      over key/value blocks: --key-block sets their size)"
                    .into(),
                other: String::new(),
            }
            .into());
        }
        if let Some(k) = spec.key_block {
            return Err(AttentionBlockUnused {
                block: r,
                why: format!(
                    "with key/value blocks of {k} (--key-block {k}, or auto above \
                     {KEY_BLOCKS_ABOVE} tokens) the query blocks are the key blocks"
                ),
                other: ", or --key-block off to keep every key at once".to_string(),
            }
            .into());
        }
    }
    if let Some(k) = spec.key_block {
        if k < 1 {
            bail!("--key-block must be a positive number of tokens, got {k}");
        }
    }
    let cp = spec.context_size();
    if cp > 1 {
        if spec.seq % (2 * cp) != 0 {
            bail!(
                "the mesh splits the sequence over {cp} devices, in 2 x {cp} chunks (two per \
                 device, so that the causal work is balanced): --seq {} must be a multiple of {}",
                spec.seq,
                2 * cp
            );
        }
        if spec.key_block.is_none() {
            bail!(
                "a sequence split over the context axis is attended over key/value blocks: give \
                 --key-block N or auto, not off"
            );
        }
    }
    Ok(())
}

/// `--attention-block N` where attention does not take query blocks of its own (a context axis,
/// key/value blocks): refused as a type of its own, so that a command can name where N came from
/// (a recipe, a checkpoint's run) before the refusal.
#[derive(Debug)]
pub struct AttentionBlockUnused {
    pub block: i64,
    /// Why the value is not used.
    pub why: String,
    /// The other way out, if any (", or ...").
    pub other: String,
}

impl std::fmt::Display for AttentionBlockUnused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--attention-block {} sets the query blocks of attention over every key at once, {}: \
             give --attention-block auto (or leave it out){}",
            self.block, self.why, self.other
        )
    }
}

impl std::error::Error for AttentionBlockUnused {}

impl AttentionBlockUnused {
    /// The refusal with where the value came from: `source` is "the recipe FILE gives",
    /// "checkpoint DIR's run has", ...
    pub fn from_source(&self, source: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{source} --attention-block {}, which sets the query blocks of attention over every \
             key at once, {}: give --attention-block auto{}",
            self.block,
            self.why,
            self.other
        )
    }
}

/// B A of rank r on a projection [out, in] has rank at most min(in, out): a larger r only adds
/// memory and time, and is refused naming the projection.
fn check_lora_rank(spec: &StepSpec) -> Result<()> {
    if let Some((target, most)) = spec
        .lora
        .targets
        .iter()
        .map(|&t| {
            let (i, o) = crate::model::tensors::projection_dims(&spec.model, t);
            (t, i.min(o))
        })
        .min_by_key(|(_, d)| *d)
    {
        if spec.lora.r > most {
            bail!(
            "--lora-r {} is larger than the adapted `{}` projection's smaller dimension ({most}): \
             an update B A of that shape has rank {most} at most, so the rest would only cost \
             memory and time; use --lora-r {most} or less",
            spec.lora.r,
            target.module()
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
}

/// The element type an intermediate result is given in: f32, or the step's compute type (bf16
/// with `--dtype bf16`; with f32 compute both are f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResultType {
    F32,
    Compute,
}

impl ResultType {
    fn f32() -> ResultType {
        ResultType::F32
    }

    fn compute() -> ResultType {
        ResultType::Compute
    }

    /// The type a result given as `self` has with compute type `dtype`: with f32 compute, f32
    /// and compute are one type, said as f32.
    pub fn in_effect(self, dtype: DType) -> ResultType {
        if dtype == DType::F32 {
            ResultType::F32
        } else {
            self
        }
    }

    /// The element type it is with compute type `compute`.
    pub fn dtype(self, compute: DType) -> DType {
        match self {
            ResultType::F32 => DType::F32,
            ResultType::Compute => compute,
        }
    }

    /// `--matmul-result` or `--attention-scores` (named by `flag`) as given.
    pub fn parse(flag: &str, s: &str) -> Result<ResultType> {
        match s {
            "f32" => Ok(ResultType::F32),
            "compute" => Ok(ResultType::Compute),
            other => bail!("--{flag} must be f32 or compute, got `{other}`"),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            ResultType::F32 => "f32",
            ResultType::Compute => "compute",
        }
    }
}

/// `--key-block`: attention over key/value blocks of N tokens with the flash recurrence (memory
/// linear in the sequence; see `model::flash`), every key at once (`off`: the queries in
/// blocks of `--attention-block`), or `auto`: [`KeyBlocks::resolve`]'s rule for the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyBlocks {
    Auto,
    Off,
    Size(i64),
}

/// The key/value block `--key-block auto` takes for long sequences.
pub use crate::model::flash::DEFAULT_KEY_BLOCK;
/// `--key-block auto` attends over key/value blocks for sequences longer than this.
pub const KEY_BLOCKS_ABOVE: i64 = 8192;

impl KeyBlocks {
    /// `--key-block` as given: a positive number of tokens, `off` or `auto`.
    pub fn parse(s: &str) -> Result<KeyBlocks> {
        match s {
            "auto" => Ok(KeyBlocks::Auto),
            "off" => Ok(KeyBlocks::Off),
            n => match n.parse::<i64>() {
                Ok(n) if n >= 1 => Ok(KeyBlocks::Size(n)),
                _ => {
                    bail!("--key-block must be a positive number of tokens, off or auto, got `{s}`")
                }
            },
        }
    }

    pub fn name(self) -> String {
        match self {
            KeyBlocks::Auto => "auto".into(),
            KeyBlocks::Off => "off".into(),
            KeyBlocks::Size(n) => n.to_string(),
        }
    }

    /// The key/value block for sequences of `seq` tokens (None: every key at once). `auto`
    /// takes [`DEFAULT_KEY_BLOCK`] above [`KEY_BLOCKS_ABOVE`] tokens, and every key at once up to
    /// it: at 8192 tokens every key at once still fits a GPU or TPU for 8B, and it was the faster
    /// form both on the CPU (1.15x) and by the TPU cost model (1.5x; docs/performance.md),
    /// while from 16384 on its [heads, T/2, T] score blocks outgrow a device (8B on one H100:
    /// 92 against 66 GiB). With the sequence split over a context axis (`context` > 1) `auto`
    /// always takes key blocks, the only form that splits it. One rule, whatever else is given:
    /// an `--attention-block` (a TPU recipe's) with auto's key blocks is refused by the spec's
    /// check, naming both, not taken as a reason to keep every key at once.
    pub fn resolve(self, seq: i64, context: i64) -> Option<i64> {
        match self {
            KeyBlocks::Size(n) => Some(n),
            KeyBlocks::Off => None,
            KeyBlocks::Auto if context > 1 || seq > KEY_BLOCKS_ABOVE => Some(DEFAULT_KEY_BLOCK),
            KeyBlocks::Auto => None,
        }
    }
}

/// `--matmul-result`'s default, for every target.
pub const DEFAULT_MATMUL_RESULT: ResultType = ResultType::F32;
/// `--attention-scores`' default, for every target.
pub const DEFAULT_ATTENTION_SCORES: ResultType = ResultType::Compute;

/// `--dtype` as given.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        other => bail!("--dtype must be f32 or bf16, got `{other}`"),
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

    /// The spec of the step for `model` and batches of `batch` x `seq` tokens.
    pub fn spec(&self, model: LlamaConfig, batch: i64, seq: i64) -> Result<StepSpec> {
        let dtype = self.dtype;
        let spec = StepSpec {
            model,
            lora: self.lora.clone(),
            adam: self.adam.clone(),
            batch,
            seq,
            dtype,
            remat: self.remat.unwrap_or(Remat::Layer),
            grad_accum: self.grad_accum,
            mesh: self.mesh.clone(),
            quant: self.quant,
            loss_chunk: self.loss_chunk,
            attention_block: self.attention_block,
            key_block: self
                .key_block
                .resolve(seq, self.mesh.as_ref().map_or(1, MeshPlan::context_size)),
            // With f32 compute every result is f32 either way; the spec says so.
            matmul_result: ResultType::in_effect(self.matmul_result, dtype),
            attention_scores: ResultType::in_effect(self.attention_scores, dtype),
            keep_softmax_stats: self.keep_softmax_stats,
            pin_mlp_activations: self.pin_mlp_activations,
            offload: self.offload.unwrap_or(Offload::NONE),
        };
        check_spec(&spec)?;
        Ok(spec)
    }
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

/// `quant`, or an earlier manifest's `nf4` (true or false).
fn de_quant<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Quant, D::Error> {
    use serde::Deserialize;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Written {
        Nf4(bool),
        Quant(Quant),
    }
    Ok(match Written::deserialize(d)? {
        Written::Nf4(true) => Quant::Nf4,
        Written::Nf4(false) => Quant::None,
        Written::Quant(q) => q,
    })
}

/// A result type, or an earlier manifest's bool that said it (`wide_matmul_results: true` is
/// f32, `narrow_attention_scores: true` the compute type); `yes` is the type a true said.
fn de_result_type<'de, D: serde::Deserializer<'de>>(
    d: D,
    yes: ResultType,
    no: ResultType,
) -> std::result::Result<ResultType, D::Error> {
    use serde::Deserialize;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Written {
        Said(bool),
        Type(ResultType),
    }
    Ok(match Written::deserialize(d)? {
        Written::Said(true) => yes,
        Written::Said(false) => no,
        Written::Type(t) => t,
    })
}

fn de_matmul_result<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<ResultType, D::Error> {
    de_result_type(d, ResultType::F32, ResultType::Compute)
}

fn de_attention_scores<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<ResultType, D::Error> {
    de_result_type(d, ResultType::Compute, ResultType::F32)
}

/// The step's options as `StepOptions::spec` completes and checks them, on the tiny model:
/// every refusal names its flag, and the program-form flags mean the same on every target.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::Projection;

    fn tiny() -> LlamaConfig {
        crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .expect("the tiny-llama3 preset")
    }

    /// The command line's defaults, as `xtrain train` and `compile` start from them.
    fn options(dtype: DType) -> StepOptions {
        StepOptions {
            lora: LoraConfig {
                r: 4,
                alpha: 8.0,
                dropout: 0.0,
                targets: Projection::ALL.to_vec(),
            },
            adam: AdamW::default(),
            dtype,
            remat: None,
            grad_accum: 1,
            mesh: None,
            quant: Quant::None,
            loss_chunk: None,
            attention_block: None,
            key_block: KeyBlocks::Auto,
            matmul_result: DEFAULT_MATMUL_RESULT,
            attention_scores: DEFAULT_ATTENTION_SCORES,
            keep_softmax_stats: false,
            pin_mlp_activations: false,
            offload: None,
        }
    }

    fn refused(o: &StepOptions, batch: i64, seq: i64) -> String {
        format!("{:#}", o.spec(tiny(), batch, seq).unwrap_err())
    }

    /// One rule for `--key-block auto`: an `--attention-block` (as a TPU recipe gives) does not
    /// turn auto's key blocks off above 8192 tokens (it did, silently, at 16k-32k); the two
    /// together are refused as a typed error, which says how to keep either form.
    #[test]
    fn an_attention_block_does_not_turn_auto_key_blocks_off() {
        let mut cfg = tiny();
        cfg.max_position_embeddings = 32768;
        let o = StepOptions {
            attention_block: Some(512),
            ..options(DType::BF16)
        };
        let e = o.spec(cfg.clone(), 1, 16384).unwrap_err();
        let unused = e.downcast_ref::<AttentionBlockUnused>().expect("typed");
        assert_eq!(unused.block, 512);
        let e = format!("{e:#}");
        assert!(
            e.contains("--attention-block 512 sets the query blocks")
                && e.contains("auto above 8192 tokens")
                && e.contains("give --attention-block auto")
                && e.contains("--key-block off"),
            "{e}"
        );
        // Up to 8192 tokens auto keeps every key at once, in the blocks asked for.
        assert_eq!(o.spec(cfg.clone(), 1, 8192).unwrap().key_block, None);
        let off = StepOptions {
            key_block: KeyBlocks::Off,
            ..o
        };
        assert_eq!(off.spec(cfg, 1, 16384).unwrap().attention_block, Some(512));
    }

    /// `--key-block auto`: every key at once up to 8192 tokens, blocks of 512 above, always
    /// blocks on a context axis; a size or `off` as given.
    #[test]
    fn key_blocks_resolve_by_the_sequence_and_the_context() {
        let auto = KeyBlocks::Auto;
        assert_eq!(auto.resolve(8192, 1), None);
        assert_eq!(auto.resolve(8193, 1), Some(DEFAULT_KEY_BLOCK));
        assert_eq!(auto.resolve(16, 2), Some(DEFAULT_KEY_BLOCK));
        assert_eq!(KeyBlocks::Size(64).resolve(16, 1), Some(64));
        assert_eq!(KeyBlocks::Off.resolve(131072, 1), None);
        for bad in ["0", "-3", "1.5", "nan", ""] {
            assert!(KeyBlocks::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(KeyBlocks::parse("off").unwrap(), KeyBlocks::Off);
        assert_eq!(KeyBlocks::parse("2048").unwrap().name(), "2048");
    }

    #[test]
    fn the_defaults_give_layer_remat_and_no_offload_where_memory_is_unknown() {
        let s = options(DType::F32).spec(tiny(), 4, 64).unwrap();
        assert_eq!((s.remat, s.offload), (Remat::Layer, Offload::NONE));
        assert_eq!(default_choice(None, None), (Remat::Layer, Offload::NONE));
    }

    #[test]
    fn auto_tries_save_proj_then_layer_with_growing_offload() {
        let activations = Offload::parse("activations").unwrap();
        let all = Offload::parse("all").unwrap();
        assert_eq!(
            fit_choices(None, None),
            [
                (Remat::SaveProj, Offload::NONE),
                (Remat::Layer, Offload::NONE),
                (Remat::Layer, activations),
                (Remat::Layer, all),
            ]
        );
        assert_eq!(
            fit_choices(Some(Remat::Layer), Some(all)),
            [(Remat::Layer, all)]
        );
        assert_eq!(
            fit_choices(Some(Remat::None), None),
            [(Remat::None, Offload::NONE)]
        );
    }

    #[test]
    fn remat_and_offload_names_parse_back_to_themselves() {
        for r in [Remat::None, Remat::Layer, Remat::SaveProj] {
            assert_eq!(Remat::parse(r.name()).unwrap(), r);
        }
        for o in Offload::AUTO_ORDER {
            assert_eq!(Offload::parse(o.name()).unwrap(), o);
        }
        assert_eq!(Remat::parse_choice("auto").unwrap(), None);
        let e = format!("{:#}", Remat::parse("layers").unwrap_err());
        assert!(e.contains("--remat") && e.contains("`layers`"), "{e}");
        let e = format!("{:#}", Offload::parse("cpu").unwrap_err());
        assert!(e.contains("--offload") && e.contains("`cpu`"), "{e}");
    }

    /// With f32 compute every result is f32, so the form flags change nothing and the spec
    /// says so; with bf16 the defaults are f32 matmul results and bf16 scores.
    #[test]
    fn the_result_types_follow_the_flags_only_with_bf16_compute() {
        let f32_spec = StepOptions {
            matmul_result: ResultType::F32,
            attention_scores: ResultType::Compute,
            ..options(DType::F32)
        }
        .spec(tiny(), 4, 64)
        .unwrap();
        let f32_ = ResultType::F32;
        assert_eq!(
            (f32_spec.matmul_result, f32_spec.attention_scores),
            (f32_, f32_)
        );
        let bf16 = options(DType::BF16).spec(tiny(), 4, 64).unwrap();
        assert_eq!(
            (bf16.matmul_result, bf16.attention_scores),
            (f32_, ResultType::Compute)
        );
        let plain = StepSpec::new(tiny(), options(DType::BF16).lora, 4, 64, DType::BF16);
        let generated = plain.with_default_form();
        assert_eq!(
            (generated.matmul_result, generated.attention_scores),
            (bf16.matmul_result, bf16.attention_scores)
        );
        let e = format!(
            "{:#}",
            ResultType::parse("matmul-result", "bf16").unwrap_err()
        );
        assert!(e.contains("--matmul-result") && e.contains("`bf16`"), "{e}");
    }

    #[test]
    fn sequences_shorter_than_two_or_past_the_models_positions_are_refused() {
        assert!(refused(&options(DType::F32), 4, 1).contains("--seq must be at least 2"));
        let e = refused(&options(DType::F32), 1, 131072 * 2);
        assert!(e.contains("--seq 262144") && e.contains("131072"), "{e}");
    }

    #[test]
    fn divisors_of_the_batch_and_the_sequence_are_checked() {
        let o = |f: &dyn Fn(&mut StepOptions)| {
            let mut o = options(DType::F32);
            f(&mut o);
            o
        };
        let e = refused(&o(&|o| o.loss_chunk = Some(24)), 4, 64);
        assert!(e.contains("--loss-chunk 24") && e.contains("64"), "{e}");
        let e = refused(
            &o(&|o| {
                o.loss_chunk = Some(16);
                o.remat = Some(Remat::None)
            }),
            4,
            64,
        );
        assert!(
            e.contains("--loss-chunk 16") && e.contains("--remat none"),
            "{e}"
        );
        let e = refused(&o(&|o| o.grad_accum = 3), 4, 64);
        assert!(
            e.contains("--grad-accum 3") && e.contains("batch size 4"),
            "{e}"
        );
        let e = refused(&o(&|o| o.grad_accum = 0), 4, 64);
        assert!(e.contains("--grad-accum must be at least 1"), "{e}");
        let e = refused(&o(&|o| o.attention_block = Some(48)), 4, 64);
        assert!(
            e.contains("--attention-block 48") && e.contains("64"),
            "{e}"
        );
        assert!(o(&|o| o.attention_block = Some(16))
            .spec(tiny(), 4, 64)
            .is_ok());
    }

    /// The tiny model's K and V projections are [32, 64]: rank 32 at most.
    #[test]
    fn a_rank_above_a_projections_smaller_dimension_is_refused() {
        let o = |r| StepOptions {
            lora: LoraConfig {
                r,
                ..options(DType::F32).lora
            },
            ..options(DType::F32)
        };
        let e = refused(&o(33), 4, 64);
        assert!(
            e.contains("--lora-r 33") && e.contains("(32)") && e.contains("k_proj"),
            "{e}"
        );
        assert!(o(32).spec(tiny(), 4, 64).is_ok());
    }

    #[test]
    fn softmax_statistics_need_remat_and_pins_need_a_mesh() {
        let stats = StepOptions {
            keep_softmax_stats: true,
            remat: Some(Remat::None),
            ..options(DType::F32)
        };
        assert!(refused(&stats, 4, 64).contains("--keep-softmax-stats"));
        let stats = StepOptions {
            remat: Some(Remat::Layer),
            ..stats
        };
        assert!(stats.spec(tiny(), 4, 64).unwrap().keep_softmax_stats);
        let pin = StepOptions {
            pin_mlp_activations: true,
            ..options(DType::F32)
        };
        assert!(refused(&pin, 4, 64).contains("--pin-mlp-activations"));
    }

    /// A model whose MLP projections have 100 x 36 values (not a multiple of the 64-value NF4
    /// block) is refused naming the tensor's size, before any builder meets it.
    #[test]
    fn nf4_refuses_a_projection_that_is_not_whole_blocks() {
        let mut cfg = tiny();
        (cfg.hidden_size, cfg.intermediate_size) = (36, 100);
        let o = StepOptions {
            quant: Quant::Nf4,
            ..options(DType::BF16)
        };
        let e = format!("{:#}", o.spec(cfg, 4, 64).unwrap_err());
        assert!(e.contains("--quant nf4") && e.contains("3600"), "{e}");
    }

    /// The trips the TPU estimate prices per layer, nb (NK + 1) per loop nest for nb blocks per
    /// query chunk and NK key blocks: on one device two chunks of the sequence (8k over blocks of
    /// 512: 8 x 17 = 136, the causal block pairs), on a context axis of 8 sixteen chunks (32k: 4
    /// blocks per chunk, 4 x 65 = 260; 128k: 16 x 257 = 4112); none without key blocks.
    #[test]
    fn attention_loop_trips_count_the_loops_trips() {
        let at = |seq: i64, mesh: Option<&str>, key_block: Option<i64>| {
            StepSpec {
                key_block,
                mesh: mesh.map(|m| MeshPlan {
                    axes: crate::program::sharding::parse_mesh(m).unwrap().axes,
                    rules: crate::program::sharding::Rules::default(),
                }),
                ..StepSpec::new(tiny(), options(DType::F32).lora, 1, seq, DType::F32)
            }
            .attention_loop_trips()
        };
        assert_eq!(at(8192, None, Some(512)), Some(136));
        assert_eq!(at(32768, Some("context=8"), Some(512)), Some(260));
        assert_eq!(at(131072, Some("context=8"), Some(512)), Some(4112));
        assert_eq!(at(8192, None, None), None);
    }
}

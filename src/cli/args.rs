//! The flags that shape the step program, shared by `train`, `compile` and `bench`, parsed into
//! the library's types at the edge (an unknown `--remat` is clap's error, not the library's);
//! [`StepArgs::options`] makes them the library's `StepOptions`. Why `StepArgs`, `StepOptions`
//! and `StepSpec` are three: `program/spec/`.

use anyhow::{bail, Context, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args;
use hlo::DType;
use std::path::PathBuf;
use xtrain::model::lora::{LoraConfig, Projection};
use xtrain::model::optim::AdamW;
use xtrain::model::preference::PairLoss;
use xtrain::program::{
    parse_dtype, KeyBlocks, Method, MlpChunks, Offload, Preference, Quant, Reference, Remat,
    ResultType, StepOptions, DEFAULT_ATTENTION_SCORES, DEFAULT_MATMUL_RESULT,
};

#[derive(Args)]
pub struct LoraArgs {
    /// LoRA rank r.
    #[arg(long, default_value_t = 16, help_heading = "LoRA")]
    pub lora_r: i64,
    /// LoRA alpha (scale = alpha / r).
    #[arg(long, default_value_t = 32.0, help_heading = "LoRA")]
    pub lora_alpha: f64,
    /// LoRA dropout probability on the adapter's input.
    #[arg(long, default_value_t = 0.0, help_heading = "LoRA")]
    pub lora_dropout: f64,
    /// Projections to adapt, among q,k,v,o,gate,up,down.
    #[arg(long, default_value = "q,k,v,o,gate,up,down", help_heading = "LoRA")]
    pub lora_targets: String,
}

impl LoraArgs {
    pub fn config(&self) -> Result<LoraConfig> {
        let c = LoraConfig {
            r: self.lora_r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets: Projection::parse_list(&self.lora_targets)?,
        };
        c.validate()?;
        Ok(c)
    }
}

/// What shapes the step program: numerics, optimizer constants, remat, accumulation.
#[derive(Args)]
pub struct StepArgs {
    /// AdamW betas, as b1,b2.
    #[arg(long, default_value = "0.9,0.999", help_heading = "Optimizer")]
    pub betas: String,
    /// AdamW epsilon (added after the bias-corrected square root, as torch does).
    #[arg(long, default_value_t = 1e-8, help_heading = "Optimizer")]
    pub eps: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0, help_heading = "Optimizer")]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = 0.0, help_heading = "Optimizer")]
    pub max_grad_norm: f64,
    #[command(flatten)]
    pub lora: LoraArgs,
    /// Precision: f32, or bf16 (bf16 weights and matmuls; f32 norms, softmax, loss, LoRA
    /// master weights and optimizer state).
    #[arg(long, default_value = "f32", value_parser = parse_dtype, help_heading = "Scale")]
    pub dtype: DType,
    /// What the backward pass recomputes: none (layers unrolled, everything kept), layer (keep
    /// each layer's input; its softmax statistics too with --keep-softmax-stats), save-proj (also keep the frozen
    /// projections' outputs, the attention output and the softmax's row statistics: only q.k
    /// and the softmax are recomputed), or
    /// auto (in `train` on a GPU or TPU and in `compile --check --target`: save-proj where the
    /// step then fits the device's memory, else layer; elsewhere layer)
    #[arg(long, default_value = "auto", value_parser = remat_or_auto, help_heading = "Scale")]
    pub remat: OrAuto<Remat>,
    /// Gradient accumulation: split each batch into this many microbatches inside the step.
    #[arg(long, default_value_t = 1, help_heading = "Scale")]
    pub grad_accum: i64,
    /// Device mesh, e.g. data=2,fsdp=4,tensor=1 (axes of size 1 are no-ops; devices are
    /// numbered row-major over the axes in this order).
    #[arg(long, help_heading = "Scale")]
    pub mesh: Option<String>,
    /// A file of `logical = mesh_axes` lines overriding the default sharding rules.
    #[arg(long, help_heading = "Scale")]
    pub sharding_rules: Option<PathBuf>,
    /// With looped layers, compute the loss and its gradient N positions at a time (less memory
    /// for long sequences and large vocabularies on one device); off (the default): the whole
    /// sequence at once.
    #[arg(long, value_name = "N|off", value_parser = loss_chunk_or_off, allow_negative_numbers = true, help_heading = "Scale")]
    pub loss_chunk: Option<LossChunk>,
    /// Query rows per block of causal attention over every key at once (blocks wholly above the
    /// diagonal are not computed); auto (or off): two blocks when the sequence is a multiple of
    /// 256, else one, the value to give over a recipe's or a resumed run's.
    #[arg(long, default_value = "auto", value_name = "N|auto|off", value_parser = attention_block_or_auto,
          allow_negative_numbers = true, help_heading = "Program form")]
    pub attention_block: OrAuto<i64>,
    /// Attention over key/value blocks of N tokens with the flash-attention recurrence, its
    /// memory linear in the sequence; off: every key at once; auto: 512 above 8192 tokens, else
    /// off.
    #[arg(long, default_value = "auto", value_name = "N|off|auto", value_parser = KeyBlocks::parse, allow_negative_numbers = true, help_heading = "Program form")]
    pub key_block: KeyBlocks,
    /// The MLP over tiles of N positions at a time, each recomputed in the backward pass, so
    /// that no [seq, intermediate] tensor exists whole (long sequences on one device); off: the
    /// whole sequence at once; auto: 4096 above 16384 tokens (without a context axis), else off.
    #[arg(long, default_value = "auto", value_name = "N|off|auto", value_parser = MlpChunks::parse, allow_negative_numbers = true, help_heading = "Program form")]
    pub mlp_chunk: MlpChunks,
    /// With --dtype bf16, the type matmuls give their result in before it is rounded to bf16:
    /// f32 (the accumulator; the form XLA CPU runs on the CPU's native bf16 GEMM) or compute
    /// (bf16). The arithmetic is the same (f32 accumulation, one rounding).
    #[arg(long, default_value = DEFAULT_MATMUL_RESULT.name(), value_parser = result_type(), help_heading = "Program form")]
    pub matmul_result: ResultType,
    /// With --dtype bf16, the type the attention scores (q.k) are written in before the
    /// softmax, which runs in f32: compute (bf16, as Hugging Face's eager attention has them)
    /// or f32.
    #[arg(long, default_value = DEFAULT_ATTENTION_SCORES.name(), value_parser = result_type(), help_heading = "Program form")]
    pub attention_scores: ResultType,
    /// With --remat layer, also keep each layer's softmax row max and sum (a few bytes per token
    /// and head), so that the recomputation skips one pass over the scores. save-proj always
    /// keeps them.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL",
          value_parser = clap::builder::BoolishValueParser::new(), help_heading = "Program form")]
    pub keep_softmax_stats: bool,
    /// On a device mesh, pin the MLP's hidden activations [B, T, F] where the sharding rules put
    /// activations, instead of leaving their placement to XLA's partitioner.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, value_name = "BOOL",
          value_parser = clap::builder::BoolishValueParser::new(), help_heading = "Program form")]
    pub pin_mlp_activations: bool,
    /// Quantize the projections' base weights at load: nf4 (QLoRA's 4-bit NormalFloat, blocks
    /// of 64, double-quantized scales), dequantized in the step right before each matmul.
    #[arg(long = "quant", id = "quant", value_name = "QUANT", default_value = "none", hide_default_value = true,
          action = clap::ArgAction::Set, value_parser = parse_quant, help_heading = "Scale")]
    pub quant: Quant,
    /// Keep in host memory instead of the device's: frozen (the frozen layer weights, each
    /// layer copied in just before use), activations (what the backward pass reads back), all,
    /// none, or auto (the least of these that makes the step fit the device; none on CPU and when
    /// the device's memory is not known).
    #[arg(long, default_value = "auto", value_parser = offload_or_auto)]
    pub offload: OrAuto<Offload>,
    #[command(flatten)]
    pub preference: PreferenceArgs,
}

/// The training method, and preference training's settings (`--method dpo`).
#[derive(Args)]
pub struct PreferenceArgs {
    /// sft: next-token loss on the examples' responses; dpo: preference training (DPO, as TRL's
    /// DPOTrainer) on pairs {"prompt", "chosen", "rejected"}, --batch-size counting pairs.
    #[arg(long, default_value = "sft", value_parser = ["sft", "dpo"], help_heading = "Preference")]
    pub method: String,
    /// DPO: how far the policy may move from the reference (higher: less), > 0 [default: 0.1].
    #[arg(long, allow_negative_numbers = true, help_heading = "Preference")]
    pub beta: Option<f64>,
    /// DPO: the pair loss, TRL's: sigmoid, ipo (over the log-ratios averaged per completion
    /// token) or hinge [default: sigmoid].
    #[arg(long, value_parser = ["sigmoid", "ipo", "hinge"], help_heading = "Preference")]
    pub dpo_loss: Option<String>,
    /// DPO with the sigmoid loss: cDPO's label smoothing, the chance that a pair's preference is
    /// flipped, in [0, 0.5) [default: 0].
    #[arg(long, allow_negative_numbers = true, help_heading = "Preference")]
    pub label_smoothing: Option<f64>,
    /// DPO: what the policy is compared with: base (the model without the adapter) or start
    /// (the --init-adapter as it was at step 0) [default: start with --init-adapter, else base].
    #[arg(long, value_parser = ["base", "start"], help_heading = "Preference")]
    pub reference: Option<String>,
    /// DPO: compute the reference's log-probabilities once over the data before training (TRL's
    /// precompute_ref_log_probs), so that the step runs no reference forward pass.
    #[arg(long, help_heading = "Preference")]
    pub precompute_reference: bool,
}

impl PreferenceArgs {
    /// `--method`; with sft, the DPO flags are refused (they would do nothing). Not where the
    /// method is still to come from a checkpoint (`train --resume` without `--method`): the
    /// recorded method settles them, and a flag that differs from the run's is refused there.
    pub fn method(&self, recorded: bool) -> Result<Method> {
        let method = Method::parse(&self.method)?;
        if method == Method::Sft && !recorded {
            let given = [
                ("--beta", self.beta.is_some()),
                ("--dpo-loss", self.dpo_loss.is_some()),
                ("--label-smoothing", self.label_smoothing.is_some()),
                ("--reference", self.reference.is_some()),
                ("--precompute-reference", self.precompute_reference),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                bail!(
                    "{flag} is a setting of preference training: give --method dpo, or leave \
                     {flag} out"
                );
            }
        }
        Ok(method)
    }

    /// The DPO settings: those given, TRL's defaults for the rest. `--reference` left out is
    /// base; `train` makes it start when it is given an initial adapter.
    pub fn preference(&self) -> Result<Preference> {
        let d = Preference::default();
        let p = Preference {
            beta: self.beta.unwrap_or(d.beta),
            dpo_loss: match &self.dpo_loss {
                Some(l) => PairLoss::parse(l).map_err(anyhow::Error::msg)?,
                None => d.dpo_loss,
            },
            label_smoothing: self.label_smoothing.unwrap_or(d.label_smoothing),
            reference: match &self.reference {
                Some(r) => Reference::parse(r)?,
                None => d.reference,
            },
            precompute_reference: self.precompute_reference,
        };
        p.validate()?;
        Ok(p)
    }
}

impl StepArgs {
    pub fn mesh(&self) -> Result<Option<xtrain::program::MeshPlan>> {
        if self.mesh.as_deref().is_some_and(|m| m.trim().is_empty()) {
            bail!("--mesh is empty: give its axes, such as --mesh fsdp=8, or leave it out to run on one device");
        }
        let Some(m) = &self.mesh else {
            if let Some(p) = &self.sharding_rules {
                bail!(
                    "--sharding-rules {} places tensors on a mesh: give --mesh too",
                    p.display()
                );
            }
            return Ok(None);
        };
        let mesh = xtrain::program::sharding::parse_mesh(m)?;
        if mesh.axes.is_empty() {
            return Ok(None);
        }
        xtrain::program::sharding::check_axes(&mesh.axes, &self.rules()?)?;
        Ok(Some(xtrain::program::MeshPlan {
            axes: mesh.axes,
            rules: self.rules()?,
        }))
    }

    /// The sharding rules: `--sharding-rules`, else the defaults.
    pub fn rules(&self) -> Result<xtrain::program::sharding::Rules> {
        match &self.sharding_rules {
            Some(p) => xtrain::formats::sharding_rules::read_rules(p),
            None => Ok(xtrain::program::sharding::Rules::default()),
        }
    }

    pub fn adam(&self) -> Result<AdamW> {
        let (beta1, beta2) = parse_betas(&self.betas)?;
        let adam = AdamW {
            beta1,
            beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            max_grad_norm: self.max_grad_norm,
        };
        adam.validate()?;
        Ok(adam)
    }

    /// The step options these flags give.
    pub fn options(&self) -> Result<StepOptions> {
        self.options_with(false)
    }

    /// [`StepArgs::options`], where `method_recorded` says the method is to be taken from a
    /// checkpoint (`train --resume` without `--method`).
    pub fn options_with(&self, method_recorded: bool) -> Result<StepOptions> {
        Ok(StepOptions {
            lora: self.lora.config()?,
            adam: self.adam()?,
            dtype: self.dtype,
            remat: self.remat.0,
            grad_accum: self.grad_accum,
            mesh: self.mesh()?,
            quant: self.quant,
            loss_chunk: self.loss_chunk.and_then(|c| c.0),
            attention_block: self.attention_block.0,
            key_block: self.key_block,
            mlp_chunk: self.mlp_chunk,
            matmul_result: self.matmul_result,
            attention_scores: self.attention_scores,
            keep_softmax_stats: self.keep_softmax_stats,
            pin_mlp_activations: self.pin_mlp_activations,
            offload: self.offload.0,
            method: self.preference.method(method_recorded)?,
            preference: self.preference.preference()?,
        })
    }
}

fn parse_betas(s: &str) -> Result<(f64, f64)> {
    let parts: Vec<&str> = s.split(',').collect();
    if parts.len() != 2 {
        bail!("--betas must be two numbers like 0.9,0.999, got `{s}`");
    }
    let p = |x: &str| {
        x.trim()
            .parse::<f64>()
            .with_context(|| format!("--betas: `{x}` is not a number"))
    };
    let (b1, b2) = (p(parts[0])?, p(parts[1])?);
    if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
        bail!("--betas must each be in [0, 1), got {b1},{b2}");
    }
    Ok((b1, b2))
}

/// A flag's value where it may be `auto`: None, decided by the command once it knows the
/// device's memory (`--remat`, `--offload`).
#[derive(Clone, Copy, Debug)]
pub struct OrAuto<T>(pub Option<T>);

fn remat_or_auto(s: &str) -> Result<OrAuto<Remat>> {
    Remat::parse_choice(s).map(OrAuto)
}

/// `--attention-block`: a positive number of query rows, or `auto` (also `off`) for the model's
/// rule.
fn attention_block_or_auto(s: &str) -> Result<OrAuto<i64>> {
    match s {
        "auto" | "off" => Ok(OrAuto(None)),
        n => match n.parse::<i64>() {
            Ok(n) if n >= 1 => Ok(OrAuto(Some(n))),
            _ => bail!(
                "--attention-block must be a positive number of query rows, auto or off, got `{s}`"
            ),
        },
    }
}

fn offload_or_auto(s: &str) -> Result<OrAuto<Offload>> {
    Offload::parse_choice(s).map(OrAuto)
}

/// `--loss-chunk` as given: a number of positions, or off (None).
#[derive(Clone, Copy, Debug)]
pub struct LossChunk(pub Option<i64>);

fn loss_chunk_or_off(s: &str) -> Result<LossChunk> {
    match s {
        "off" => Ok(LossChunk(None)),
        n => match n.parse::<i64>() {
            Ok(n) => Ok(LossChunk(Some(n))),
            Err(_) => bail!("--loss-chunk must be a number of positions or off, got `{s}`"),
        },
    }
}

/// `--quant`: whether the base weights are NF4.
fn parse_quant(s: &str) -> Result<Quant> {
    Quant::parse(s)
}

/// `--matmul-result` or `--attention-scores`: f32 or compute (clap lists them and refuses others).
fn result_type() -> impl TypedValueParser<Value = ResultType> {
    let [f32_, compute] = [ResultType::F32, ResultType::Compute];
    PossibleValuesParser::new([f32_.name(), compute.name()]).map(move |s| {
        if s == f32_.name() {
            f32_
        } else {
            compute
        }
    })
}

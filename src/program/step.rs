//! The whole training step as one StableHLO function:
//! forward + backward (LoRA parameters only) + AdamW, with the LoRA parameters and optimizer
//! moments donated and returned updated, plus the loss and the gradient norm.
//!
//! Argument order (each named in the program and in the manifest):
//! frozen weights (HF names) | LoRA A/B (PEFT names) | exp_avg.* | exp_avg_sq.* | step | lr |
//! input_ids | labels | attention_mask | [dropout_key]
//!
//! Layers are either unrolled (`--remat none`: XLA keeps every intermediate) or looped
//! (`stablehlo.while` over weights stacked along a leading layer axis, named `layers.*`): the
//! forward loop keeps each layer's input (and, with `save-proj`, the frozen projections'
//! outputs); the backward loop recomputes each layer from them and applies its vjp. Program size
//! does not grow with depth.

use crate::model::config::LlamaConfig;
use crate::model::llama::{
    layer_key, BaseWeights, LayerAdapters, LayerContext, LayerWeights, Llama, LoraPair, Numerics,
    Saves,
};
use crate::model::lora::{LoraConfig, Target};
use crate::model::loss::{cross_entropy_loss_and_grad, next_token_targets, token_cross_entropy};
use crate::model::optim::{AdamW, Slot};
use crate::model::tensors::{
    frozen_args_typed, is_projection, layer_kinds, lora_args, projection_dims,
};
use anyhow::{bail, Result};
use hlo::{Builder, DType, Module, ParamAttrs, Shape, Value};
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Frozen,
    Lora,
    AdamM,
    AdamV,
    Step,
    LearningRate,
    InputIds,
    Labels,
    AttentionMask,
    DropoutKey,
    Loss,
    GradNorm,
    Logits,
    TokenLoss,
}

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

/// One argument or result of a program.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<i64>,
    #[serde(serialize_with = "ser_dtype", deserialize_with = "de_dtype")]
    pub dtype: DType,
    pub role: Role,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: Vec<i64>, dtype: DType, role: Role) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            shape,
            dtype,
            role,
        }
    }
}

fn ser_dtype<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.mlir())
}

fn de_dtype<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<DType, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    DType::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown element type `{s}`")))
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

/// A built program: its text and its signature.
pub struct Program {
    pub text: String,
    pub args: Vec<TensorSpec>,
    pub results: Vec<TensorSpec>,
    /// Number of devices (SPMD partitions) it runs on.
    pub partitions: i64,
    /// The shape each device holds of each argument.
    pub arg_shard_dims: Vec<Vec<i64>>,
}

impl Program {
    /// (name, shape) of each frozen weight argument, in argument order: what the weight loaders
    /// and random initialisers fill.
    pub fn frozen_shapes(&self) -> Vec<(String, Vec<i64>)> {
        self.args
            .iter()
            .filter(|a| a.role == Role::Frozen)
            .map(|a| (a.name.clone(), a.shape.clone()))
            .collect()
    }

    pub fn new(
        text: String,
        args: Vec<TensorSpec>,
        results: Vec<TensorSpec>,
        spec: &StepSpec,
    ) -> Program {
        let arg_shard_dims = args
            .iter()
            .map(|a| match &spec.mesh {
                Some(m) => m
                    .sharding(&a.name, &a.shape)
                    .shard_dims(&a.shape, &m.mesh()),
                None => a.shape.clone(),
            })
            .collect();
        let partitions = spec.mesh.as_ref().map_or(1, |m| m.devices());
        Program {
            text,
            args,
            results,
            partitions,
            arg_shard_dims,
        }
    }

    /// The sharding of each argument (all replicated without a mesh).
    pub fn arg_shardings(&self, spec: &StepSpec) -> Vec<hlo::Sharding> {
        self.args.iter().map(|a| shard_of(spec, a)).collect()
    }

    pub fn result_shardings(&self, spec: &StepSpec) -> Vec<hlo::Sharding> {
        self.results.iter().map(|a| shard_of(spec, a)).collect()
    }
}

fn shard_of(spec: &StepSpec, a: &TensorSpec) -> hlo::Sharding {
    match &spec.mesh {
        Some(m) => m.sharding(&a.name, &a.shape),
        None => hlo::Sharding::replicated(a.shape.len()),
    }
}

/// Annotate parameters and results with their shardings and wrap the function in a module
/// that declares the mesh.
fn finish_module(
    name: &str,
    mut b: Builder,
    spec: &StepSpec,
    args: &[TensorSpec],
    results: &[TensorSpec],
    outs: &[(String, Value)],
) -> String {
    let params: Vec<Value> = b.func().params.iter().map(|p| p.value).collect();
    let mut func_results: Vec<hlo::FuncResult> = outs
        .iter()
        .map(|(n, v)| hlo::FuncResult {
            value: *v,
            name: n.clone(),
            sharding: None,
        })
        .collect();
    if let Some(m) = &spec.mesh {
        for (v, a) in params.iter().zip(args) {
            b.set_param_sharding(*v, Some(m.sharding(&a.name, &a.shape)));
        }
        for (r, spec_r) in func_results.iter_mut().zip(results) {
            r.sharding = Some(m.sharding(&spec_r.name, &spec_r.shape));
        }
    }
    let module = Module::new(name, b.finish_with(func_results));
    match &spec.mesh {
        Some(m) => module.with_mesh(m.mesh()).to_text(),
        None => module.to_text(),
    }
}

/// Frozen weights and LoRA values of a program, in argument order.
#[derive(Clone)]
struct ModelValues {
    frozen: Vec<Value>,
    lora: Vec<Value>,
}

impl ModelValues {
    fn flat(&self) -> Vec<Value> {
        self.frozen.iter().chain(&self.lora).copied().collect()
    }

    fn rebind(&self, flat: &[Value]) -> ModelValues {
        let n = self.frozen.len();
        ModelValues {
            frozen: flat[..n].to_vec(),
            lora: flat[n..n + self.lora.len()].to_vec(),
        }
    }
}

fn add_model_params(
    b: &mut Builder,
    spec: &StepSpec,
    with_lora: bool,
    args: &mut Vec<TensorSpec>,
) -> ModelValues {
    let stacked = spec.remat.scan();
    let mut frozen = Vec::new();
    for (name, shape, dtype) in frozen_args_typed(&spec.model, stacked, spec.nf4, spec.weight_dtype)
    {
        frozen.push(b.param(&name, Shape::new(&shape, dtype)));
        args.push(TensorSpec::new(name, shape, dtype, Role::Frozen));
    }
    let mut lora = Vec::new();
    if with_lora {
        for t in lora_args(&spec.model, &spec.lora, stacked) {
            lora.push(b.param(&t.name, Shape::new(&t.shape, DType::F32)));
            args.push(TensorSpec::new(t.name, t.shape, DType::F32, Role::Lora));
        }
    }
    ModelValues { frozen, lora }
}

fn add_batch_params(
    b: &mut Builder,
    spec: &StepSpec,
    args: &mut Vec<TensorSpec>,
) -> (Value, Value, Value) {
    let shape = vec![spec.batch, spec.seq];
    let mut p = |name: &str, role| {
        args.push(TensorSpec::new(name, shape.clone(), DType::S32, role));
        b.param(name, Shape::new(&shape, DType::S32))
    };
    (
        p("input_ids", Role::InputIds),
        p("labels", Role::Labels),
        p("attention_mask", Role::AttentionMask),
    )
}

fn scalar_param(b: &mut Builder, name: &str, role: Role, args: &mut Vec<TensorSpec>) -> Value {
    args.push(TensorSpec::new(name, vec![], DType::F32, role));
    b.param(name, Shape::scalar(DType::F32))
}

/// Slice layer `i` out of a stacked tensor [L, ...] -> [...].
fn layer_slice(b: &mut Builder, stacked: Value, i: Value) -> hlo::Result<Value> {
    let dims = b.dims(stacked).to_vec();
    let zero = b.scalar(0.0, DType::S32);
    let mut starts = vec![i];
    starts.extend(std::iter::repeat_n(zero, dims.len() - 1));
    let mut sizes = dims.clone();
    sizes[0] = 1;
    let s = b.dynamic_slice(stacked, &starts, &sizes)?;
    b.reshape(s, &dims[1..])
}

/// The element type a stack of per-layer values [L, ...] that a loop writes is kept in: bf16 and
/// f16 stacks are kept as their bits (u16), other types as they are. Writing a layer into a stack
/// is a dynamic-update-slice, and XLA CPU computes a bf16 one in f32: it converted the whole stack
/// to f32 and back on every layer instead of writing one slice in place (the 8-layer benchmark's
/// seven saved stacks: ~1.3 GB of memory traffic per step). On the bits the write is in place,
/// on every backend; the bitcasts cost nothing.
fn stack_type(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::U16,
        d => d,
    }
}

/// Layer `i` of a stack kept in [`stack_type`]`(dtype)`, as `dtype`.
fn layer_slice_as(b: &mut Builder, stacked: Value, i: Value, dtype: DType) -> hlo::Result<Value> {
    let s = layer_slice(b, stacked, i)?;
    b.bitcast_convert(s, dtype)
}

/// Write `v` [...] into layer `i` of a stacked tensor [L, ...] (a stack of bits, see
/// [`stack_type`], takes `v`'s bits).
fn layer_update(b: &mut Builder, stacked: Value, v: Value, i: Value) -> hlo::Result<Value> {
    let v = b.bitcast_convert(v, b.dtype(stacked))?;
    let mut dims = vec![1];
    dims.extend_from_slice(b.dims(v));
    let v = b.reshape(v, &dims)?;
    let zero = b.scalar(0.0, DType::S32);
    let mut starts = vec![i];
    starts.extend(std::iter::repeat_n(zero, dims.len() - 1));
    b.dynamic_update_slice(stacked, v, &starts)
}

/// A loop body's view of its invariants: stacked weights, stacked LoRA, the layer context and
/// dropout.
type LoopInvariants = (Vec<Value>, Vec<Value>, LayerContext, Option<(f64, Value)>);

/// The model's structure over a flat list of values.
struct Layout<'a> {
    spec: &'a StepSpec,
}

impl Layout<'_> {
    fn model(&self) -> Llama<'_> {
        Llama {
            cfg: &self.spec.model,
            num: Numerics {
                compute: self.spec.compute_dtype,
                attention_block: self.spec.attention_block,
                matmul_result: if self.spec.wide_matmul_results {
                    DType::F32
                } else {
                    self.spec.compute_dtype
                },
            },
        }
    }

    /// (embed, norm, lm_head) from the frozen values.
    fn ends(&self, frozen: &[Value]) -> (Value, Value, Value) {
        let n = frozen.len();
        if self.spec.model.tie_word_embeddings {
            (frozen[0], frozen[n - 1], frozen[0])
        } else {
            (frozen[0], frozen[n - 2], frozen[n - 1])
        }
    }

    /// How many argument values each of a layer's 9 weights takes (4 for an NF4 projection).
    fn kind_sizes(&self) -> Vec<usize> {
        layer_kinds(&self.spec.model)
            .iter()
            .map(|(k, _)| {
                if self.spec.nf4 && is_projection(k) {
                    4
                } else {
                    1
                }
            })
            .collect()
    }

    /// The frozen values of the layer weights (all layers, or the stacked ones): between the
    /// embedding and the final norm.
    fn layer_values<'v>(&self, frozen: &'v [Value]) -> &'v [Value] {
        let tail = if self.spec.model.tie_word_embeddings {
            1
        } else {
            2
        };
        &frozen[1..frozen.len() - tail]
    }

    /// One layer's weights from its values (per-layer, not stacked), dequantizing NF4
    /// projections right here, before their matmuls.
    fn layer_weights(&self, b: &mut Builder, w: &[Value]) -> hlo::Result<LayerWeights> {
        let mut dense = Vec::new();
        let mut at = 0;
        for ((kind, shape), n) in layer_kinds(&self.spec.model)
            .into_iter()
            .zip(self.kind_sizes())
        {
            let v = if n == 4 {
                b.scoped(kind, |b| {
                    crate::model::quant::dequantize_graph(
                        b,
                        &w[at..at + 4],
                        &shape,
                        self.spec.compute_dtype,
                    )
                })?
            } else {
                w[at]
            };
            dense.push(v);
            at += n;
        }
        let w = dense;
        Ok(LayerWeights {
            input_norm: w[0],
            q: w[1],
            k: w[2],
            v: w[3],
            o: w[4],
            post_norm: w[5],
            gate: w[6],
            up: w[7],
            down: w[8],
        })
    }

    fn adapters(&self, lora: &[Value]) -> LayerAdapters {
        if lora.is_empty() {
            return LayerAdapters::new();
        }
        self.spec
            .lora
            .targets
            .iter()
            .enumerate()
            .map(|(k, &t)| {
                (
                    t,
                    LoraPair {
                        a: lora[2 * k],
                        b: lora[2 * k + 1],
                    },
                )
            })
            .collect()
    }

    /// Logits with layers unrolled over per-layer weights.
    fn logits_unrolled(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        dropout: Option<(f64, Value)>,
        ids: Value,
        mask: Value,
    ) -> hlo::Result<Value> {
        let (embed, norm, lm_head) = self.ends(&m.frozen);
        let per_layer: usize = self.kind_sizes().iter().sum();
        let layers = self
            .layer_values(&m.frozen)
            .chunks(per_layer)
            .map(|w| self.layer_weights(b, w))
            .collect::<hlo::Result<_>>()?;
        let per_layer = 2 * self.spec.lora.targets.len();
        let lora: Vec<LayerAdapters> = if m.lora.is_empty() {
            Vec::new()
        } else {
            m.lora.chunks(per_layer).map(|c| self.adapters(c)).collect()
        };
        let w = BaseWeights {
            embed,
            layers,
            norm,
            lm_head,
        };
        self.model()
            .logits(b, &w, &lora, self.spec.lora.scale(), dropout, ids, mask)
    }

    /// Pin the batch dim of an activation [B, T, ...] to the mesh's batch sharding (a hint for
    /// the partitioner where the embedding gather would otherwise leave it guessing).
    fn constrain_batch(&self, b: &mut Builder, x: Value) -> hlo::Result<Value> {
        let Some(m) = &self.spec.mesh else {
            return Ok(x);
        };
        let dims = b.dims(x).to_vec();
        let mut logical = vec!["batch"];
        logical.extend(std::iter::repeat_n("none", dims.len() - 1));
        let sh = m.rules.sharding(&logical, &dims, &m.mesh());
        b.sharding_constraint(x, sh)
    }

    /// The names a remat policy saves in the forward loop.
    fn saved_names(&self) -> Vec<&'static str> {
        match self.spec.remat {
            Remat::SaveProj => Target::ALL.iter().map(|t| t.module()).collect(),
            _ => Vec::new(),
        }
    }

    /// Run layer `i` (a loop index) of the stacked model inside a loop body.
    #[allow(clippy::too_many_arguments)]
    fn layer_in_loop(
        &self,
        b: &mut Builder,
        i: Value,
        h: Value,
        stacked: &[Value],
        lora: &[Value],
        ctx: &LayerContext,
        dropout: Option<(f64, Value)>,
        saves: &mut Saves,
    ) -> hlo::Result<(Value, Vec<Value>)> {
        let w: Vec<Value> = stacked
            .iter()
            .map(|&s| layer_slice(b, s, i))
            .collect::<hlo::Result<_>>()?;
        let lw = b.scoped("layers", |b| self.layer_weights(b, &w))?;
        let lora_l: Vec<Value> = lora
            .iter()
            .map(|&s| layer_slice(b, s, i))
            .collect::<hlo::Result<_>>()?;
        let adapters = self.adapters(&lora_l);
        let mut ctx = ctx.clone();
        if let Some((p, key)) = dropout {
            ctx.dropout = Some((p, layer_key(b, key, i)?));
        }
        let out = b.scoped("layers", |b| {
            self.model().layer(b, h, &lw, &adapters, &mut ctx, saves)
        })?;
        Ok((out, lora_l))
    }

    /// Forward and backward for one (micro)batch: (loss share, gradients in LoRA arg order).
    /// `denom` is the number of valid targets in the whole batch, so that microbatch losses and
    /// gradients add up to those of the whole batch.
    #[allow(clippy::too_many_arguments)]
    fn loss_and_grads(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        labels: Value,
        mask: Value,
        key: Option<Value>,
        denom: Value,
    ) -> hlo::Result<(Value, Vec<Value>)> {
        let dropout = key.map(|k| (self.spec.lora.dropout, k));
        if !self.spec.remat.scan() {
            let logits = self.logits_unrolled(b, m, dropout, ids, mask)?;
            let targets = next_token_targets(b, labels)?;
            let (loss, dlogits) = cross_entropy_loss_and_grad(b, logits, targets, denom)?;
            let grads = b.vjp(&[(logits, dlogits)], &m.lora)?;
            return Ok((loss, grads));
        }
        let model = self.model();
        let l = self.spec.model.num_hidden_layers;
        let (embed, norm, lm_head) = self.ends(&m.frozen);
        let stacked = self.layer_values(&m.frozen).to_vec();
        let h0 = model.embed(b, embed, ids)?;
        let h0 = self.constrain_batch(b, h0)?;
        let ctx = model.context(b, mask, self.spec.lora.scale())?;
        let (bs, t, hd) = (b.dims(h0)[0], b.dims(h0)[1], b.dims(h0)[2]);
        let saved_names = self.saved_names();

        // Forward loop: carry (h, layer inputs [L,B,T,H], saved projections [L,B,T,out]...).
        let compute = self.spec.compute_dtype;
        // Every slot of a stack is written before it is read, so the fill does not matter; each
        // stack gets its own (0, 1, 2, ...) because XLA would otherwise merge the equal fills into
        // one broadcast and copy it into every stack of that shape before the loop (a full copy
        // of each: ~90 MB per f32 step on the benchmark).
        let inputs0 = b.full(0.0, Shape::new(&[l, bs, t, hd], stack_type(compute)));
        let mut carry = vec![h0, inputs0];
        for (i, name) in saved_names.iter().enumerate() {
            let target = Target::ALL.iter().find(|x| x.module() == *name).unwrap();
            let out = projection_dims(&self.spec.model, *target).1;
            let fill = (i + 1) as f64;
            carry.push(b.full(fill, Shape::new(&[l, bs, t, out], stack_type(compute))));
        }
        let mut inv: Vec<Value> = stacked.iter().chain(&m.lora).copied().collect();
        inv.extend([ctx.rope.0, ctx.rope.1, ctx.mask]);
        inv.extend(key);
        let (ns, nl) = (stacked.len(), m.lora.len());
        let unpack = |inv: &[Value]| -> LoopInvariants {
            let c = LayerContext {
                rope: (inv[ns + nl], inv[ns + nl + 1]),
                mask: inv[ns + nl + 2],
                lora_scale: self.spec.lora.scale(),
                dropout: None,
            };
            let d = key.map(|_| (self.spec.lora.dropout, inv[ns + nl + 3]));
            (inv[..ns].to_vec(), inv[ns..ns + nl].to_vec(), c, d)
        };
        let fwd = b.fori_loop(l, &carry, &inv, |bb, i, carry, inv| {
            let (stacked, lora, ctx, dropout) = unpack(inv);
            let mut recorded = Vec::new();
            let (h, _) = self.layer_in_loop(
                bb,
                i,
                carry[0],
                &stacked,
                &lora,
                &ctx,
                dropout,
                &mut Saves::Record(&mut recorded),
            )?;
            let mut next = vec![h, layer_update(bb, carry[1], carry[0], i)?];
            for (k, name) in saved_names.iter().enumerate() {
                let v = recorded
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| *v)
                    .expect("projection recorded");
                next.push(layer_update(bb, carry[2 + k], v, i)?);
            }
            Ok(next)
        })?;
        let (loss, dh) = match self.spec.loss_chunk {
            Some(chunk) => {
                self.chunked_loss_and_dh(b, fwd[0], norm, lm_head, labels, denom, chunk)?
            }
            None => {
                let logits = model.head(b, fwd[0], norm, lm_head)?;
                let targets = next_token_targets(b, labels)?;
                let (loss, dlogits) = cross_entropy_loss_and_grad(b, logits, targets, denom)?;
                let dh = b.vjp(&[(logits, dlogits)], &[fwd[0]])?[0];
                (loss, dh)
            }
        };

        // Backward loop, last layer first: carry (dh, gradient stacks); recompute, then vjp.
        let mut carry = vec![dh];
        for &v in &m.lora {
            carry.push(b.zeros_like(v));
        }
        let mut binv = fwd[1..].to_vec();
        binv.extend(&inv);
        let nsaved = fwd.len() - 1;
        let bwd = b.fori_loop(l, &carry, &binv, |bb, i, carry, binv| {
            let last = bb.scalar((l - 1) as f64, DType::S32);
            let idx = bb.sub(last, i)?;
            let h_in = layer_slice_as(bb, binv[0], idx, compute)?;
            let mut saved = BTreeMap::new();
            for (k, name) in saved_names.iter().enumerate() {
                let v = layer_slice_as(bb, binv[1 + k], idx, compute)?;
                saved.insert(name.to_string(), v);
            }
            let (stacked, lora, ctx, dropout) = unpack(&binv[nsaved..]);
            let (h_out, lora_l) = self.layer_in_loop(
                bb,
                idx,
                h_in,
                &stacked,
                &lora,
                &ctx,
                dropout,
                &mut Saves::Use(&saved),
            )?;
            let mut wrt = vec![h_in];
            wrt.extend(&lora_l);
            let g = bb.vjp(&[(h_out, carry[0])], &wrt)?;
            let mut next = vec![g[0]];
            for (k, &gk) in g[1..].iter().enumerate() {
                next.push(layer_update(bb, carry[1 + k], gk, idx)?);
            }
            Ok(next)
        })?;
        Ok((loss, bwd[1..].to_vec()))
    }

    /// The loss and its gradient with respect to the last hidden state, a chunk of the sequence
    /// at a time, so that the logits [B, T, V] (f32, and their softmax) never exist whole: each
    /// chunk's logits are computed, turned into its share of the loss and, straight away, into the
    /// gradient of that share (the loss's own cotangent is 1), then dropped.
    #[allow(clippy::too_many_arguments)]
    fn chunked_loss_and_dh(
        &self,
        b: &mut Builder,
        h: Value,
        norm: Value,
        lm_head: Value,
        labels: Value,
        denom: Value,
        chunk: i64,
    ) -> hlo::Result<(Value, Value)> {
        let (bs, t, hd) = (b.dims(h)[0], b.dims(h)[1], b.dims(h)[2]);
        let chunk = if chunk > 0 && t % chunk == 0 {
            chunk
        } else {
            t
        };
        let targets = next_token_targets(b, labels)?;
        let loss0 = b.scalar(0.0, DType::F32);
        // dh is written a chunk at a time: kept as bits, as a layer stack is (see stack_type).
        let dh0 = b.zeros(Shape::new(&[bs, t, hd], stack_type(b.dtype(h))));
        let out = b.scoped("loss_chunks", |b| {
            b.fori_loop(
                t / chunk,
                &[loss0, dh0],
                &[h, norm, lm_head, targets, denom],
                |bb, i, carry, inv| {
                    let c = bb.scalar(chunk as f64, DType::S32);
                    let start = bb.mul(i, c)?;
                    let zero = bb.scalar(0.0, DType::S32);
                    let hc = bb.dynamic_slice(inv[0], &[zero, start, zero], &[bs, chunk, hd])?;
                    let tc = bb.dynamic_slice(inv[3], &[zero, start], &[bs, chunk])?;
                    let logits = self.model().head(bb, hc, inv[1], inv[2])?;
                    let (share, dlogits) = cross_entropy_loss_and_grad(bb, logits, tc, inv[4])?;
                    let g = bb.vjp(&[(logits, dlogits)], &[hc])?[0];
                    let g = bb.bitcast_convert(g, bb.dtype(carry[1]))?;
                    let dh = bb.dynamic_update_slice(carry[1], g, &[zero, start, zero])?;
                    Ok(vec![bb.add(carry[0], share)?, dh])
                },
            )
        })?;
        let dh = b.bitcast_convert(out[1], b.dtype(h))?;
        Ok((out[0], dh))
    }

    /// max(1, number of valid targets): labels[:, 1:] != -100.
    fn denominator(&self, b: &mut Builder, labels: Value) -> hlo::Result<Value> {
        let t = b.dims(labels)[1];
        let next = b.slice_dim(labels, 1, 1, t)?;
        let ignore = b.full(-100.0, b.shape(next).clone());
        let valid = b.compare(next, ignore, hlo::CmpDir::Ne)?;
        let valid = b.convert(valid, DType::F32)?;
        let count = b.sum_all(valid)?;
        let one = b.scalar(1.0, DType::F32);
        b.max(count, one)
    }

    /// Loss and gradients of the whole batch, looping over microbatches when there are several.
    fn batch_loss_and_grads(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        labels: Value,
        mask: Value,
        key: Option<Value>,
    ) -> hlo::Result<(Value, Vec<Value>)> {
        let denom = self.denominator(b, labels)?;
        let micro = self.spec.microbatches;
        if micro <= 1 {
            return self.loss_and_grads(b, m, ids, labels, mask, key, denom);
        }
        let rows = self.spec.batch / micro;
        let t = self.spec.seq;
        let mut carry = vec![b.scalar(0.0, DType::F32)];
        for &v in &m.lora {
            carry.push(b.zeros_like(v));
        }
        let mut inv = m.flat();
        inv.extend([ids, labels, mask, denom]);
        inv.extend(key);
        let nm = m.frozen.len() + m.lora.len();
        let out = b.fori_loop(micro, &carry, &inv, |bb, i, carry, inv| {
            let mv = m.rebind(&inv[..nm]);
            let r = bb.scalar(rows as f64, DType::S32);
            let start = bb.mul(i, r)?;
            let zero = bb.scalar(0.0, DType::S32);
            let slice =
                |bb: &mut Builder, x: Value| bb.dynamic_slice(x, &[start, zero], &[rows, t]);
            let (ids, labels, mask) = (
                slice(bb, inv[nm])?,
                slice(bb, inv[nm + 1])?,
                slice(bb, inv[nm + 2])?,
            );
            // Each microbatch draws its own dropout masks: offset the key's first word.
            let key = match key {
                Some(_) => {
                    let k = inv[nm + 4];
                    let mi = bb.convert(i, DType::U64)?;
                    let mi = bb.reshape(mi, &[1])?;
                    let z = bb.zeros(Shape::new(&[1], DType::U64));
                    let off = bb.concatenate(&[mi, z], 0)?;
                    Some(bb.add(k, off)?)
                }
                None => None,
            };
            let (loss, grads) =
                self.loss_and_grads(bb, &mv, ids, labels, mask, key, inv[nm + 3])?;
            let mut next = vec![bb.add(carry[0], loss)?];
            for (k, g) in grads.into_iter().enumerate() {
                next.push(bb.add(carry[1 + k], g)?);
            }
            Ok(next)
        })?;
        Ok((out[0], out[1..].to_vec()))
    }

    /// The last hidden state h_L [B, T, H] (layers looped when the spec loops them).
    fn hidden(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        mask: Value,
    ) -> hlo::Result<Value> {
        let model = self.model();
        let (embed, _, _) = self.ends(&m.frozen);
        let h0 = model.embed(b, embed, ids)?;
        let ctx = model.context(b, mask, self.spec.lora.scale())?;
        if !self.spec.remat.scan() {
            let mut h = h0;
            let per_layer = 2 * self.spec.lora.targets.len();
            let per_layer_w: usize = self.kind_sizes().iter().sum();
            let none = LayerAdapters::new();
            for l in 0..self.spec.model.num_hidden_layers as usize {
                let lw = self.layer_weights(
                    b,
                    &self.layer_values(&m.frozen)[per_layer_w * l..per_layer_w * (l + 1)],
                )?;
                let adapters = if m.lora.is_empty() {
                    none.clone()
                } else {
                    self.adapters(&m.lora[per_layer * l..per_layer * (l + 1)])
                };
                let mut c = ctx.clone();
                h = b.scoped(&format!("layers.{l}"), |b| {
                    model.layer(b, h, &lw, &adapters, &mut c, &mut Saves::Off)
                })?;
            }
            return Ok(h);
        }
        let stacked = self.layer_values(&m.frozen).to_vec();
        let mut inv: Vec<Value> = stacked.iter().chain(&m.lora).copied().collect();
        inv.extend([ctx.rope.0, ctx.rope.1, ctx.mask]);
        let (ns, nl) = (stacked.len(), m.lora.len());
        let out = b.fori_loop(
            self.spec.model.num_hidden_layers,
            &[h0],
            &inv,
            |bb, i, carry, inv| {
                let c = LayerContext {
                    rope: (inv[ns + nl], inv[ns + nl + 1]),
                    mask: inv[ns + nl + 2],
                    lora_scale: self.spec.lora.scale(),
                    dropout: None,
                };
                let (h, _) = self.layer_in_loop(
                    bb,
                    i,
                    carry[0],
                    &inv[..ns],
                    &inv[ns..ns + nl],
                    &c,
                    None,
                    &mut Saves::Off,
                )?;
                Ok(vec![h])
            },
        )?;
        Ok(out[0])
    }

    /// Logits for a forward-only program.
    fn logits(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        mask: Value,
    ) -> hlo::Result<Value> {
        let h = self.hidden(b, m, ids, mask)?;
        let (_, norm, lm_head) = self.ends(&m.frozen);
        self.model().head(b, h, norm, lm_head)
    }
}

fn check_spec(spec: &StepSpec) -> Result<()> {
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

/// The training step program.
pub fn build_train_step(spec: &StepSpec) -> Result<Program> {
    check_spec(spec)?;
    let mut b = Builder::new("train_step");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, true, &mut args);
    let lora_args: Vec<TensorSpec> = args
        .iter()
        .filter(|a| a.role == Role::Lora)
        .cloned()
        .collect();
    // moments[i] = m of LoRA tensor i, moments[n + i] = its v; named as torch's state dict.
    let n = mv.lora.len();
    let mut moments = Vec::new();
    for (prefix, role) in [("exp_avg", Role::AdamM), ("exp_avg_sq", Role::AdamV)] {
        for src in &lora_args {
            let name = format!("{prefix}.{}", src.name);
            moments.push(b.param(&name, Shape::new(&src.shape, DType::F32)));
            args.push(TensorSpec::new(name, src.shape.clone(), DType::F32, role));
        }
    }
    let step = scalar_param(&mut b, "step", Role::Step, &mut args);
    let lr = scalar_param(&mut b, "lr", Role::LearningRate, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let key = if spec.lora.dropout > 0.0 {
        args.push(TensorSpec::new(
            "dropout_key",
            vec![2],
            DType::U64,
            Role::DropoutKey,
        ));
        Some(b.param("dropout_key", Shape::new(&[2], DType::U64)))
    } else {
        None
    };

    let layout = Layout { spec };
    let (loss, grads) = layout.batch_loss_and_grads(&mut b, &mv, ids, labels, mask, key)?;
    let slots: Vec<Slot> = (0..n)
        .map(|i| Slot {
            param: mv.lora[i],
            grad: grads[i],
            m: moments[i],
            v: moments[n + i],
        })
        .collect();
    // A step whose loss or gradient is not finite changes nothing: the state stays the last
    // good one, and the host decides whether to stop or go on.
    let (updated, grad_norm) = spec
        .adam
        .update_guarded(&mut b, &slots, step, lr, Some(loss))?;

    // Results: params, then m, then v (each aliasing its input), then loss and grad norm.
    let mut results = Vec::new();
    let mut outs: Vec<(String, Value)> = Vec::new();
    // (input, output) pairs: the updated params, m and v, in argument order.
    let pairs: Vec<(Value, Value)> = (0..n)
        .map(|i| (mv.lora[i], updated[i].param))
        .chain((0..n).map(|i| (moments[i], updated[i].m)))
        .chain((0..n).map(|i| (moments[n + i], updated[i].v)))
        .collect();
    let state_args = args
        .iter()
        .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV));
    for (a, &(input, output)) in state_args.zip(&pairs) {
        b.set_param_attrs(
            input,
            ParamAttrs {
                alias_output: Some(outs.len()),
                sharding: None,
            },
        );
        results.push(a.clone());
        outs.push((a.name.clone(), output));
    }
    for (name, v, role) in [
        ("loss", loss, Role::Loss),
        ("grad_norm", grad_norm, Role::GradNorm),
    ] {
        results.push(TensorSpec::new(name, vec![], DType::F32, role));
        outs.push((name.into(), v));
    }
    let text = finish_module("xtrain_train_step", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

/// A forward-only program: (logits [B,T,V], per-token CE [B,T], loss) with or without LoRA.
pub fn build_forward(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut b = Builder::new("forward");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, with_lora, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let layout = Layout { spec };
    let logits = layout.logits(&mut b, &mv, ids, mask)?;
    let (ce, _) = token_cross_entropy(&mut b, logits, labels)?;
    let denom = layout.denominator(&mut b, labels)?;
    let total = b.sum_all(ce)?;
    let loss = b.div(total, denom)?;
    let (bs, t, v) = (spec.batch, spec.seq, spec.model.vocab_size);
    let results = vec![
        TensorSpec::new("logits", vec![bs, t, v], DType::F32, Role::Logits),
        TensorSpec::new("token_loss", vec![bs, t], DType::F32, Role::TokenLoss),
        TensorSpec::new("loss", vec![], DType::F32, Role::Loss),
    ];
    let outs = vec![
        ("logits".to_string(), logits),
        ("token_loss".to_string(), ce),
        ("loss".to_string(), loss),
    ];
    let text = finish_module("xtrain_forward", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

/// A program returning the loss and the gradient of every LoRA tensor (for checking gradients
/// against a reference; the train step folds them into AdamW instead).
pub fn build_grad_program(spec: &StepSpec) -> Result<Program> {
    check_spec(spec)?;
    let mut b = Builder::new("grads");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, true, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let layout = Layout { spec };
    let (loss, grads) = layout.batch_loss_and_grads(&mut b, &mv, ids, labels, mask, None)?;
    let mut results = vec![TensorSpec::new("loss", vec![], DType::F32, Role::Loss)];
    let mut outs = vec![("loss".to_string(), loss)];
    for (a, g) in args.iter().filter(|a| a.role == Role::Lora).zip(&grads) {
        let name = format!("grad.{}", a.name);
        results.push(TensorSpec::new(
            name.clone(),
            a.shape.clone(),
            DType::F32,
            Role::Lora,
        ));
        outs.push((name, *g));
    }
    let text = finish_module("xtrain_grads", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

/// A program for generation: the logits [B, V] of the next token after position `positions[b]`
/// of each row (the head runs on those positions only).
pub fn build_next_token(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut b = Builder::new("next_token");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, with_lora, &mut args);
    let shape = vec![spec.batch, spec.seq];
    let ids = b.param("input_ids", Shape::new(&shape, DType::S32));
    args.push(TensorSpec::new(
        "input_ids",
        shape.clone(),
        DType::S32,
        Role::InputIds,
    ));
    let mask = b.param("attention_mask", Shape::new(&shape, DType::S32));
    args.push(TensorSpec::new(
        "attention_mask",
        shape.clone(),
        DType::S32,
        Role::AttentionMask,
    ));
    let pos = b.param("positions", Shape::new(&[spec.batch], DType::S32));
    args.push(TensorSpec::new(
        "positions",
        vec![spec.batch],
        DType::S32,
        Role::Step,
    ));
    let layout = Layout { spec };
    let h = layout.hidden(&mut b, &mv, ids, mask)?;
    // Pick h[b, positions[b], :] with a one-hot contraction over T.
    let t = spec.seq;
    let iota = b.iota(Shape::new(&[spec.batch, t], DType::S32), 1)?;
    let pb = b.broadcast_in_dim(pos, &[spec.batch, t], &[0])?;
    let hit = b.compare(iota, pb, hlo::CmpDir::Eq)?;
    let one_hot = b.convert(hit, spec.compute_dtype)?;
    let dims = hlo::DotDims {
        lhs_batch: vec![0],
        rhs_batch: vec![0],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let picked = b.dot_general(one_hot, h, dims, None, None)?;
    let picked = b.reshape(picked, &[spec.batch, 1, spec.model.hidden_size])?;
    let (_, norm, lm_head) = layout.ends(&mv.frozen);
    let logits = layout.model().head(&mut b, picked, norm, lm_head)?;
    let logits = b.reshape(logits, &[spec.batch, spec.model.vocab_size])?;
    let results = vec![TensorSpec::new(
        "logits",
        vec![spec.batch, spec.model.vocab_size],
        DType::F32,
        Role::Logits,
    )];
    let text = finish_module(
        "xtrain_next_token",
        b,
        spec,
        &args,
        &results,
        &[("logits".to_string(), logits)],
    );
    Ok(Program::new(text, args, results, spec))
}

/// An evaluation program: per-token loss [B, T] and whether the argmax prediction at each
/// position is the target [B, T] (1.0 or 0.0), teacher-forced. A row whose every target
/// position is right is exactly what greedy decoding would produce.
pub fn build_eval(spec: &StepSpec) -> Result<Program> {
    let mut b = Builder::new("eval");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, true, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let layout = Layout { spec };
    let logits = layout.logits(&mut b, &mv, ids, mask)?;
    let (ce, _) = token_cross_entropy(&mut b, logits, labels)?;
    let correct = b.scoped("accuracy", |b| {
        let (bs, t, v) = (spec.batch, spec.seq, spec.model.vocab_size);
        let dims = [bs, t, v];
        // argmax as the smallest index holding the maximum
        let m = b.reduce_max(logits, &[2])?;
        let mb = b.broadcast_in_dim(m, &dims, &[0, 1])?;
        let at_max = b.compare(logits, mb, hlo::CmpDir::Eq)?;
        let iota = b.iota(Shape::new(&dims, DType::S32), 2)?;
        let big = b.full(v as f64, Shape::new(&dims, DType::S32));
        let idx = b.select(at_max, iota, big)?;
        let argmax = b.reduce(idx, &[2], hlo::Combiner::Min)?;
        let next = b.slice_dim(labels, 1, 1, t)?;
        let ignore = b.scalar(-100.0, DType::S32);
        let targets = b.pad(next, ignore, &[0, 0], &[0, 1], &[0, 0])?;
        let hit = b.compare(argmax, targets, hlo::CmpDir::Eq)?;
        b.convert(hit, DType::F32)
    })?;
    let (bs, t) = (spec.batch, spec.seq);
    let results = vec![
        TensorSpec::new("token_loss", vec![bs, t], DType::F32, Role::TokenLoss),
        TensorSpec::new("token_correct", vec![bs, t], DType::F32, Role::TokenLoss),
    ];
    let outs = vec![
        ("token_loss".to_string(), ce),
        ("token_correct".to_string(), correct),
    ];
    let text = finish_module("xtrain_eval", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

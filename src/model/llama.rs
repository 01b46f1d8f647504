//! The forward pass of the Llama-architecture families (Llama 3.x, Qwen2/2.5, Qwen3, Mistral),
//! as a graph, written to read like the equations; the families differ only by the switches of
//! [`LlamaConfig`], which the attention reads (`attention.rs`: Qwen2's q/k/v biases, Qwen3's
//! per-head q/k norms):
//!
//! ```text
//! h_0   = E[ids]
//! a_l   = h_l + Attn_l(RMSNorm(h_l; g_l))          (GQA, RoPE, causal + padding mask)
//! h_l+1 = a_l + W_down(silu(W_gate x) * W_up x),   x = RMSNorm(a_l; g'_l)
//! logits = RMSNorm(h_L; g) W_head^T                (W_head = E when embeddings are tied)
//! loss  = sum_valid CE(logits[t], label[t+1]) / #valid      (HF: over the whole batch)
//! ```
//! Every projection `x W^T` may carry a LoRA term `(alpha/r) dropout(x) A^T B^T`.

use crate::model::config::LlamaConfig;
pub use crate::model::forward::{Numerics, Placement, Saves};
use crate::model::lora::Projection;
use crate::model::{context, dropout};
use hlo::{Builder, DType, DotDims, Result, Shape, Value};
use std::collections::BTreeMap;

/// A frozen attention projection: W [out, in] (HF layout) and, where the family has one, its
/// bias [out] (Qwen2's q, k and v).
#[derive(Clone, Copy, Debug)]
pub struct Linear {
    pub w: Value,
    pub bias: Option<Value>,
}

impl From<Value> for Linear {
    fn from(w: Value) -> Linear {
        Linear { w, bias: None }
    }
}

/// The frozen weights of one decoder layer (HF layout: projections are [out, in]).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Value,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    /// RMSNorm weights [D] of each query head and each key head, shared by the heads (Qwen3).
    pub q_norm: Option<Value>,
    pub k_norm: Option<Value>,
    pub post_norm: Value,
    pub gate: Value,
    pub up: Value,
    pub down: Value,
}

#[derive(Clone, Debug)]
pub struct BaseWeights {
    pub embed: Value,
    pub layers: Vec<LayerWeights>,
    pub norm: Value,
    /// The embedding itself when embeddings are tied.
    pub lm_head: Value,
}

/// One LoRA adapter pair: A [r, in], B [out, r].
#[derive(Clone, Copy, Debug)]
pub struct LoraPair {
    pub a: Value,
    pub b: Value,
}

/// One layer's adapters, by target.
pub type LayerAdapters = BTreeMap<Projection, LoraPair>;

/// What a layer shares with the others: RoPE tables, where each token's document starts, LoRA's
/// scale, dropout.
#[derive(Clone, Debug)]
pub struct LayerContext {
    /// cos and sin [B, T, D] at each token's position in its document.
    pub rope: (Value, Value),
    /// Where each token's document starts in its row, -1 for padding: [B, S] s32 (see
    /// [`Llama::context`]). The mask is built from it where the scores are (see `attention::attend`).
    pub doc_starts: Value,
    pub lora_scale: f64,
    /// (probability, this layer's key, see [`dropout::layer_key`]) when LoRA dropout is on.
    pub dropout: Option<(f64, Value)>,
    /// Where the rows of the projections' input start in the sequence (an s32 scalar) when the
    /// input is a tile of it (`--mlp-chunk`, see `model::mlp_tiles`), so that dropout
    /// draws each token's mask at its own position; None: the input is the whole sequence.
    pub tile_start: Option<Value>,
}

/// Builds the forward pass of one model config into a builder.
pub struct Llama<'a> {
    pub cfg: &'a LlamaConfig,
    pub num: Numerics,
    /// Where the step runs on a device mesh and pins activations (on TPUs: see
    /// `StepSpec::pin_mlp_activations`): how activations named by logical axes are placed on
    /// it (see [`Llama::pin`]). None on one device, or where nothing is pinned.
    pub placement: Option<&'a dyn Placement>,
    /// The mesh the step runs on (None on one device): the key-block attention runs per device
    /// on it, each device on its shard of the batch and heads (`model::flash::attend`).
    pub mesh: Option<&'a dyn Placement>,
    /// The sequence split over a mesh's `context` axis (see `model::context`); None on a mesh
    /// without one, or on one device.
    pub context: Option<ContextSplit<'a>>,
}

/// How many devices split the sequence, and the mesh they are on.
#[derive(Clone, Copy)]
pub struct ContextSplit<'a> {
    pub size: i64,
    pub placement: &'a dyn Placement,
}

/// `doc_starts` [B, T] with padding (-1) taken as a document starting at 0: where a token's
/// positions count from, and which keys a query may see (see `attention::attend`).
pub(super) fn starts_or_zero(b: &mut Builder, doc_starts: Value) -> Result<Value> {
    let zero = b.zeros(b.shape(doc_starts).clone());
    b.max(doc_starts, zero)
}

/// `x W^T` for x [.., in] and W [out, in], accumulating in f32 whatever the operand type; the
/// product is given in `result` and rounded to x's type (see [`Numerics::matmul_result`]).
fn linear(b: &mut Builder, x: Value, w: Value, result: DType) -> Result<Value> {
    affine(b, x, w, None, result)
}

/// [`linear`] plus `bias` [out] when given, added to the product before it is rounded to x's
/// type (as a GEMM's epilogue adds it).
fn affine(
    b: &mut Builder,
    x: Value,
    w: Value,
    bias: Option<Value>,
    result: DType,
) -> Result<Value> {
    // As one [tokens, in] x [in, out] GEMM: the batch and sequence dims folded together.
    let xd = b.dims(x).to_vec();
    let rows: i64 = xd[..xd.len() - 1].iter().product();
    let x2 = b.reshape(x, &[rows, xd[xd.len() - 1]])?;
    let dims = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![1],
        ..Default::default()
    };
    let mut y = b.dot_general(x2, w, dims, None, Some(result))?;
    let out = b.dims(w)[0];
    if let Some(bias) = bias {
        let bias = b.convert(bias, result)?;
        let bias = b.broadcast_in_dim(bias, &[rows, out], &[1])?;
        y = b.add(y, bias)?;
    }
    let y = b.convert(y, b.dtype(x))?;
    let mut yd = xd[..xd.len() - 1].to_vec();
    yd.push(out);
    b.reshape(y, &yd)
}

impl Llama<'_> {
    /// Pin `x`, whose dims are the logical axes `logical`, to its place on the mesh (nothing on
    /// one device). Left to itself, the partitioner may choose another layout for an
    /// intermediate than the one its neighbours have and pay collectives to move between them.
    fn pin(&self, b: &mut Builder, x: Value, logical: &[&str]) -> Result<Value> {
        let Some(p) = self.placement else {
            return Ok(x);
        };
        let sharding = p.place(logical, b.dims(x));
        if sharding.is_replicated() {
            return Ok(x);
        }
        b.sharding_constraint(x, sharding)
    }

    /// h_0 = E[ids]: [B, T, H] in the compute type.
    pub fn embed(&self, b: &mut Builder, embed: Value, ids: Value) -> Result<Value> {
        b.scoped("embed", |b| {
            let e = b.convert(embed, self.num.compute)?;
            let ids = match self.context {
                Some(cs) => context::to_balanced(b, ids, cs.size)?,
                None => ids,
            };
            let h = b.take_rows(e, ids)?;
            self.pin_sequence(b, h)
        })
    }

    /// With the sequence split over the context axis, `h` [B, T, H] pinned there (rows in
    /// balanced order); else `h`.
    fn pin_sequence(&self, b: &mut Builder, h: Value) -> Result<Value> {
        let Some(cs) = self.context else {
            return Ok(h);
        };
        let sharding = cs.placement.place(&["batch", "length", "none"], b.dims(h));
        b.sharding_constraint(h, sharding)
    }

    /// The last hidden state [B, T, H] with its rows in natural order (they are in balanced
    /// order inside the layers when the sequence is split over the context axis).
    pub fn in_natural_order(&self, b: &mut Builder, h: Value) -> Result<Value> {
        match self.context {
            Some(cs) => b.scoped("context", |b| context::to_natural(b, h, cs.size)),
            None => Ok(h),
        }
    }

    /// Where each token's document starts and the RoPE tables at each token's position in it,
    /// from `attention_mask` [B, T]: 0 for padding, and for a real token 1 + the index in its row
    /// where its document starts. A row of one document (a Hugging Face mask) is all 1 on its
    /// tokens; rows packed from several examples restart positions at each example, and each
    /// example attends only within itself (see `data::rows`).
    pub fn context(
        &self,
        b: &mut Builder,
        attention_mask: Value,
        lora_scale: f64,
    ) -> Result<LayerContext> {
        let doc_starts = b.scoped("mask", |b| {
            let mask = match self.context {
                Some(cs) => context::to_balanced(b, attention_mask, cs.size)?,
                None => attention_mask,
            };
            let one = b.full(1.0, b.shape(mask).clone());
            b.sub(mask, one)
        })?;
        let rope = b.scoped("rope", |b| {
            let positions = self.positions(b, doc_starts)?;
            self.rope_tables(b, positions)
        })?;
        Ok(LayerContext {
            rope,
            doc_starts,
            lora_scale,
            dropout: None,
            tile_start: None,
        })
    }

    /// One decoder layer: h + Attn(norm(h)), then + MLP(norm(.)).
    pub fn layer(
        &self,
        b: &mut Builder,
        h: Value,
        w: &LayerWeights,
        lora: &LayerAdapters,
        ctx: &mut LayerContext,
        saves: &mut Saves,
    ) -> Result<Value> {
        let h = self.pin_sequence(b, h)?;
        let x = b.scoped("input_norm", |b| self.rms_norm(b, h, w.input_norm))?;
        let attn = self.attention(b, x, w, lora, ctx, saves)?;
        let h = b.add(h, attn)?;
        let x = b.scoped("post_norm", |b| self.rms_norm(b, h, w.post_norm))?;
        let weights = [w.gate, w.up, w.down];
        let mlp = match self.mlp_tile(b.dims(x)[1]) {
            Some(n) => self.mlp_in_tiles(b, x, weights, lora, ctx, n)?,
            None => self.mlp(b, x, weights, lora, ctx, saves)?,
        };
        b.add(h, mlp)
    }

    /// logits = norm(h) W_head^T, in f32.
    pub fn head(&self, b: &mut Builder, h: Value, norm: Value, lm_head: Value) -> Result<Value> {
        let x = b.scoped("norm", |b| self.rms_norm(b, h, norm))?;
        b.scoped("lm_head", |b| {
            let head = b.convert(lm_head, self.num.compute)?;
            let logits = linear(b, x, head, self.num.matmul_result)?;
            b.convert(logits, DType::F32)
        })
    }

    /// Logits [B, T, V] (f32) for token ids [B, T] (s32) and a padding mask [B, T] (s32, 1 =
    /// real token), layers unrolled. `dropout_key` turns on LoRA dropout.
    #[allow(clippy::too_many_arguments)]
    pub fn logits(
        &self,
        b: &mut Builder,
        w: &BaseWeights,
        lora: &[LayerAdapters],
        lora_scale: f64,
        dropout: Option<(f64, Value)>,
        ids: Value,
        attention_mask: Value,
    ) -> Result<Value> {
        let mut h = self.embed(b, w.embed, ids)?;
        let mut ctx = self.context(b, attention_mask, lora_scale)?;
        let none = LayerAdapters::new();
        for (l, lw) in w.layers.iter().enumerate() {
            b.push_scope(&format!("layers.{l}"));
            if let Some((p, key)) = dropout {
                let idx = b.scalar(l as f64, DType::S32);
                ctx.dropout = Some((p, dropout::layer_key(b, key, idx)?));
            }
            h = self.layer(
                b,
                h,
                lw,
                lora.get(l).unwrap_or(&none),
                &mut ctx,
                &mut Saves::Off,
            )?;
            b.pop_scope();
        }
        let h = self.in_natural_order(b, h)?;
        self.head(b, h, w.norm, w.lm_head)
    }

    /// RMSNorm in f32: `g * x / sqrt(mean(x^2) + eps)`, back in the compute type.
    pub(super) fn rms_norm(&self, b: &mut Builder, x: Value, g: Value) -> Result<Value> {
        let dims = b.dims(x).to_vec();
        let last = dims.len() as i64 - 1;
        let x32 = b.convert(x, DType::F32)?;
        let sq = b.mul(x32, x32)?;
        let sum = b.reduce_sum(sq, &[last])?;
        let mean = b.mul_scalar(sum, 1.0 / dims[last as usize] as f64)?;
        let var = b.add_scalar(mean, self.cfg.rms_norm_eps)?;
        let inv = b.rsqrt(var)?;
        let inv = b.broadcast_in_dim(inv, &dims, &(0..last).collect::<Vec<_>>())?;
        let normed = b.mul(x32, inv)?;
        // HF casts back to the activation type before scaling by the weight.
        let normed = b.convert(normed, self.num.compute)?;
        let g = b.convert(g, self.num.compute)?;
        let g = b.broadcast_in_dim(g, &dims, &[last])?;
        b.mul(normed, g)
    }

    /// `x W^T (+ bias)` plus the layer's LoRA term for `target` when there is one: PEFT's
    /// `base_layer(x) + lora_B(lora_A(dropout(x))) * scale`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn project(
        &self,
        b: &mut Builder,
        target: Projection,
        x: Value,
        w: Linear,
        lora: &LayerAdapters,
        ctx: &mut LayerContext,
        saves: &mut Saves,
    ) -> Result<Value> {
        b.scoped(target.module(), |b| {
            let weight = b.convert(w.w, self.num.compute)?;
            let y = affine(b, x, weight, w.bias, self.num.matmul_result)?;
            let y = saves.point(b, target.module(), y)?;
            let Some(pair) = lora.get(&target).copied() else {
                return Ok(y);
            };
            let x_in = match ctx.dropout {
                Some((p, key)) => {
                    let (bs, t) = (b.dims(x)[0], b.dims(x)[1]);
                    let positions = self.natural_positions(b, Shape::new(&[bs, t], DType::S32))?;
                    let positions = match ctx.tile_start {
                        Some(start) => {
                            let start = b.broadcast_in_dim(start, &[bs, t], &[])?;
                            b.add(positions, start)?
                        }
                        None => positions,
                    };
                    dropout::apply(b, x, p, key, target, positions)?
                }
                None => x,
            };
            let a = b.convert(pair.a, self.num.compute)?;
            let bm = b.convert(pair.b, self.num.compute)?;
            // PEFT scales the adapter's output, (x A^T B^T) * s; scaling the rank-r activation
            // instead is the same product (exactly so in bf16 when s is a power of two, as it is
            // for the usual alpha = 2r) at r/out of the work, and it leaves the projection's
            // output cotangent with one consumer form fewer in the backward pass.
            let xa = linear(b, x_in, a, self.num.matmul_result)?;
            let xa = b.mul_scalar(xa, ctx.lora_scale)?;
            let xab = linear(b, xa, bm, self.num.matmul_result)?;
            b.add(y, xab)
        })
    }

    /// down(silu(gate x) * up x), each projection with its LoRA term, for `x` [B, T, H] and the
    /// frozen `[gate, up, down]`.
    pub(super) fn mlp(
        &self,
        b: &mut Builder,
        x: Value,
        [gate_w, up_w, down_w]: [Value; 3],
        lora: &LayerAdapters,
        ctx: &mut LayerContext,
        saves: &mut Saves,
    ) -> Result<Value> {
        // With --pin-mlp-activations, the MLP's hidden activations [B, T, F] are pinned where the
        // mesh puts activations (FSDP: split by batch). Left to itself, at a row per chip the
        // partitioner may gather the input over the batch, split F instead and move back with
        // all-to-alls around the down projection.
        let gate = self.project(b, Projection::Gate, x, gate_w.into(), lora, ctx, saves)?;
        let up = self.project(b, Projection::Up, x, up_w.into(), lora, ctx, saves)?;
        let gate = self.pin(b, gate, &["batch", "length", "mlp"])?;
        let up = self.pin(b, up, &["batch", "length", "mlp"])?;
        // silu(g) = g * sigmoid(g), one op in the compute type as torch's silu is: computed in
        // f32 and rounded once (rounding the sigmoid too would add an error HF does not have)
        let act = b.scoped("mlp", |b| {
            let g32 = b.convert(gate, DType::F32)?;
            let s = b.logistic(g32)?;
            let silu = b.mul(g32, s)?;
            let silu = b.convert(silu, self.num.compute)?;
            b.mul(silu, up)
        })?;
        self.project(b, Projection::Down, act, down_w.into(), lora, ctx, saves)
    }
}

/// The pieces of the layer on small inputs, each against the equation computed here directly
/// (the whole model is checked against Hugging Face in tests/oracle.rs). f32 throughout; the
/// tolerance, 1e-5 on values of order one, is a few f32 roundings of sums over at most 64 terms.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{max_diff, run, values};
    use pjrt::HostTensor;

    const TOL: f32 = 1e-5;

    fn tiny() -> LlamaConfig {
        crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .expect("the tiny-llama3 preset")
    }

    fn f32_param(b: &mut Builder, name: &str, dims: &[i64]) -> Value {
        b.param(name, Shape::new(dims, DType::F32))
    }

    #[test]
    fn rms_norm_is_g_times_x_over_the_root_mean_square() {
        let cfg = tiny();
        let h = cfg.hidden_size;
        let model = Llama {
            cfg: &cfg,
            num: Numerics::default(),
            placement: None,
            mesh: None,
            context: None,
        };
        let (x, g) = (values(3 * h as usize, 1), values(h as usize, 2));
        let mut b = Builder::new("main");
        let xv = f32_param(&mut b, "x", &[3, h]);
        let gv = f32_param(&mut b, "g", &[h]);
        let y = model.rms_norm(&mut b, xv, gv).unwrap();
        let got = run(
            b.finish(&[("y", y)]),
            &[
                HostTensor::from_f32(&x, &[3, h]),
                HostTensor::from_f32(&g, &[h]),
            ],
        )[0]
        .to_f32()
        .unwrap();
        let want: Vec<f32> = x
            .chunks(h as usize)
            .flat_map(|row| {
                let ms = row.iter().map(|v| (v * v) as f64).sum::<f64>() / h as f64;
                let inv = 1.0 / (ms + cfg.rms_norm_eps).sqrt();
                row.iter()
                    .zip(&g)
                    .map(move |(v, w)| (*v as f64 * inv) as f32 * w)
            })
            .collect();
        assert!(max_diff(&got, &want) <= TOL, "{}", max_diff(&got, &want));
    }

    /// Position p turns each pair (x_i, x_{i+D/2}) by p times the pair's frequency (the
    /// split-half layout of Hugging Face's `rotate_half`); position 0 leaves x as it is. The
    /// positions restart where a document starts: a row of two documents, tokens 0-1 and 2-4.
    #[test]
    fn rope_turns_each_split_half_pair_by_its_position_in_its_document() {
        let cfg = tiny();
        let d = cfg.head_dim;
        let (t, heads) = (5, 2);
        let model = Llama {
            cfg: &cfg,
            num: Numerics::default(),
            placement: None,
            mesh: None,
            context: None,
        };
        let dims = [1, t, heads, d];
        let x = values((t * heads * d) as usize, 3);
        let mut b = Builder::new("main");
        let xv = f32_param(&mut b, "x", &dims);
        let starts = b.param("doc_starts", Shape::new(&[1, t], DType::S32));
        let positions = model.positions(&mut b, starts).unwrap();
        let tables = model.rope_tables(&mut b, positions).unwrap();
        let y = model.apply_rope(&mut b, xv, tables).unwrap();
        let got = run(
            b.finish(&[("y", y)]),
            &[
                HostTensor::from_f32(&x, &dims),
                HostTensor::from_i32(&[0, 0, 2, 2, 2], &[1, t]),
            ],
        )[0]
        .to_f32()
        .unwrap();
        let position = [0, 1, 0, 1, 2];
        let inv = cfg.rope_inv_freq();
        let half = (d / 2) as usize;
        let mut want = x.clone();
        for (n, head) in x.chunks(d as usize).enumerate() {
            let p = position[n / heads as usize] as f64;
            for i in 0..half {
                let (c, s) = ((p * inv[i] as f64).cos(), (p * inv[i] as f64).sin());
                let (a, z) = (head[i] as f64, head[i + half] as f64);
                want[n * d as usize + i] = (a * c - z * s) as f32;
                want[n * d as usize + i + half] = (z * c + a * s) as f32;
            }
        }
        assert!(max_diff(&got, &want) <= TOL, "{}", max_diff(&got, &want));
        let first = (heads * d) as usize;
        assert_eq!(got[..first], x[..first], "position 0 is not turned");
        let third = 2 * first..3 * first;
        assert_eq!(
            got[third.clone()],
            x[third],
            "a document's first token is at position 0"
        );
    }
}

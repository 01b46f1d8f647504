//! The Llama 3.1 forward pass and loss, as a graph. Written to read like the equations:
//!
//! ```text
//! h_0   = E[ids]
//! a_l   = h_l + Attn_l(RMSNorm(h_l; g_l))          (GQA, RoPE, causal + padding mask)
//! h_l+1 = a_l + W_down(silu(W_gate x) * W_up x),   x = RMSNorm(a_l; g'_l)
//! logits = RMSNorm(h_L; g) W_head^T
//! loss  = sum_valid CE(logits[t], label[t+1]) / #valid      (HF: over the whole batch)
//! ```
//! Every projection `x W^T` may carry a LoRA term `(alpha/r) dropout(x) A^T B^T`.

use crate::model::config::LlamaConfig;
use crate::model::forward::mask_scores;
pub use crate::model::forward::{Numerics, Placement, Saves};
use crate::model::lora::Projection;
use crate::model::{context, dropout, flash};
use hlo::{Builder, DType, DotDims, Result, Shape, Value};
use std::collections::BTreeMap;

/// The frozen weights of one decoder layer (HF layout: projections are [out, in]).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Value,
    pub q: Value,
    pub k: Value,
    pub v: Value,
    pub o: Value,
    pub post_norm: Value,
    pub gate: Value,
    pub up: Value,
    pub down: Value,
}

impl LayerWeights {
    pub fn projection(&self, t: Projection) -> Value {
        match t {
            Projection::Q => self.q,
            Projection::K => self.k,
            Projection::V => self.v,
            Projection::O => self.o,
            Projection::Gate => self.gate,
            Projection::Up => self.up,
            Projection::Down => self.down,
        }
    }
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
    /// [`Llama::context`]). The mask is built from it where the scores are (see [`attend`]).
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

/// The save point of the attention's output [B, T, heads x D], the O projection's input.
pub const ATTENTION_OUTPUT: &str = "attn";

impl Llama<'_> {
    /// The softmax statistics of a layer's attention for batches of `bs` x `t` tokens: for each
    /// query block, the row max and the row sum, [B, KV, TB, G] in f32 (names and shapes), as
    /// [`softmax_parts_last`] marks them; over key blocks, the one statistic `m + log l` per row
    /// ([`flash::LSE`]). A few bytes per token and head, and what a recomputation
    /// needs to skip the softmax's two row reductions.
    pub fn softmax_stat_points(&self, bs: i64, t: i64) -> Vec<(String, Shape)> {
        let c = self.cfg;
        let kvh = c.num_key_value_heads;
        let g = c.num_attention_heads / kvh;
        if let Some(cs) = self.context {
            let kb = self.num.key_block.unwrap_or(flash::DEFAULT_KEY_BLOCK);
            let tb = context::key_block(t, cs.size, kb);
            let shape = context::lse_shape(bs, t, cs.size, kvh, g, tb);
            return vec![(flash::LSE.to_string(), shape)];
        }
        if let Some(kb) = self.num.key_block {
            let tb = flash::key_block(t, kb);
            return vec![(flash::LSE.to_string(), flash::lse_shape(bs, t, kvh, g, tb))];
        }
        let tb = query_block(t, self.num.attention_block);
        let shape = Shape::new(&[bs, kvh, tb, g], DType::F32);
        (0..t / tb)
            .flat_map(|i| ["max", "sum"].map(|s| (softmax_stat_name(s, i), shape.clone())))
            .collect()
    }

    /// The attention output's save point ([`ATTENTION_OUTPUT`]) and its shape.
    pub fn attention_output_point(&self, bs: i64, t: i64) -> (String, Shape) {
        let width = self.cfg.num_attention_heads * self.cfg.head_dim;
        (
            ATTENTION_OUTPUT.to_string(),
            Shape::new(&[bs, t, width], self.num.compute),
        )
    }
}

/// `doc_starts` [B, T] with padding (-1) taken as a document starting at 0: where a token's
/// positions count from, and which keys a query may see (see [`attend`]).
pub(super) fn starts_or_zero(b: &mut Builder, doc_starts: Value) -> Result<Value> {
    let zero = b.zeros(b.shape(doc_starts).clone());
    b.max(doc_starts, zero)
}

/// The save point of query block `block`'s softmax statistic `stat` (`max` or `sum`).
fn softmax_stat_name(stat: &str, block: i64) -> String {
    format!("attn.{stat}.{block}")
}

/// `x W^T` for x [.., in] and W [out, in], accumulating in f32 whatever the operand type; the
/// product is given in `result` and rounded to x's type (see [`Numerics::matmul_result`]).
fn linear(b: &mut Builder, x: Value, w: Value, result: DType) -> Result<Value> {
    // As one [tokens, in] x [in, out] GEMM: the batch and sequence dims folded together.
    let xd = b.dims(x).to_vec();
    let rows: i64 = xd[..xd.len() - 1].iter().product();
    let x2 = b.reshape(x, &[rows, xd[xd.len() - 1]])?;
    let dims = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![1],
        ..Default::default()
    };
    let y = b.dot_general(x2, w, dims, None, Some(result))?;
    let y = b.convert(y, b.dtype(x))?;
    let mut yd = xd[..xd.len() - 1].to_vec();
    yd.push(b.dims(w)[0]);
    b.reshape(y, &yd)
}

/// Query rows per attention block: the requested size when it divides the sequence; else two
/// blocks (halves: the block wholly above the diagonal is skipped, 3/4 of the scores computed)
/// when the sequence is a multiple of 256; else the whole sequence. One rule for every target:
/// each block is a matmul and a softmax of its own, so more blocks skip more of the scores but
/// make more kernels (see docs/performance.md for how this default was chosen).
pub fn query_block(t: i64, requested: Option<i64>) -> i64 {
    match requested {
        Some(r) if r > 0 && r <= t && t % r == 0 => r,
        Some(_) => t,
        None if t % 256 == 0 => t / 2,
        None => t,
    }
}

/// softmax(q k^T / sqrt(D), masked) v for q [B, TQ, KV, G, D] (the queries at positions
/// `start..start + TQ`), k and v [B, S, KV, D], `query_docs` [B, TQ] (where each query's document
/// starts, 0 for padding) and `key_docs` [B, S] (where each key's document starts, -1 for
/// padding): out [B, TQ, KV, G, D]. Query t sees key s when s <= t and s is in its document, which
/// for keys before t means `key_docs[s] >= query_docs[t]`; a padding query sees every earlier real
/// key, as with Hugging Face's masks. Softmax in f32; its row max and sum are save points
/// `attn.max.{block}` and `attn.sum.{block}` (see [`Llama::softmax_stat_points`]).
#[allow(clippy::too_many_arguments)]
fn attend(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    (query_docs, key_docs): (Value, Value),
    start: i64,
    d: i64,
    num: Numerics,
    block: i64,
    saves: &mut Saves,
) -> Result<Value> {
    // scores [B, KV, TQ, G, S] = q . k / sqrt(D)
    let dims = DotDims {
        lhs_batch: vec![0, 2],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![4],
        rhs_contract: vec![3],
    };
    let scores = b.dot_general(q, k, dims, None, Some(num.scores))?;
    let scores = b.convert(scores, DType::F32)?;
    let scores = b.mul_scalar(scores, 1.0 / (d as f64).sqrt())?;
    let sd = b.dims(scores).to_vec();
    // The mask is computed beside the scores rather than read: a [B, TQ, S] boolean tensor made
    // once per step would be a loop invariant that every block slices and copies.
    let (tq, s) = (sd[2], sd[4]);
    let q_pos = b.iota(Shape::new(&[tq, s], DType::S32), 0)?;
    let offset = b.full(start as f64, Shape::new(&[tq, s], DType::S32));
    let q_pos = b.add(q_pos, offset)?;
    let k_pos = b.iota(Shape::new(&[tq, s], DType::S32), 1)?;
    let scores = mask_scores(
        b,
        scores,
        (q_pos, k_pos),
        (query_docs, key_docs),
        &[0, 2, 4],
    )?;
    let (e, sum) = softmax_parts_last(b, scores, |stat| softmax_stat_name(stat, block), saves)?;
    // out [B, KV, TQ, G, D] = (e . v) / sum, normalized after the product as flash attention
    // does: the division is over [TQ, D] instead of [TQ, S], and the backward pass needs no
    // reduction over the [TQ, S] probabilities for the sum's gradient (dividing first, autodiff
    // would compute -rowsum(dprobs * probs) / sum). e is in (0, 1] (shifted by the row max), so
    // it rounds to bf16 as well as the probabilities do; the product stays f32 until it is
    // divided, so it is rounded once.
    let e = b.convert(e, num.compute)?;
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![4],
        rhs_contract: vec![1],
    };
    let unnormalized = b.dot_general(e, v, dims, None, Some(DType::F32))?;
    let ud = b.dims(unnormalized).to_vec();
    let sum = b.broadcast_in_dim(sum, &ud, &[0, 1, 2, 3])?;
    let out = b.div(unnormalized, sum)?;
    let out = b.convert(out, num.compute)?;
    b.transpose(out, &[0, 2, 1, 3, 4])
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
    fn rms_norm(&self, b: &mut Builder, x: Value, g: Value) -> Result<Value> {
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

    /// `x W^T` plus the layer's LoRA term for `target` when there is one.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn project(
        &self,
        b: &mut Builder,
        target: Projection,
        x: Value,
        w: Value,
        lora: &LayerAdapters,
        ctx: &mut LayerContext,
        saves: &mut Saves,
    ) -> Result<Value> {
        b.scoped(target.module(), |b| {
            let w = b.convert(w, self.num.compute)?;
            let y = linear(b, x, w, self.num.matmul_result)?;
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

    fn attention(
        &self,
        b: &mut Builder,
        x: Value,
        w: &LayerWeights,
        lora: &LayerAdapters,
        ctx: &mut LayerContext,
        saves: &mut Saves,
    ) -> Result<Value> {
        let (rope, doc_starts) = (ctx.rope, ctx.doc_starts);
        let c = self.cfg;
        let (bs, t) = (b.dims(x)[0], b.dims(x)[1]);
        let (kvh, d) = (c.num_key_value_heads, c.head_dim);
        let g = c.num_attention_heads / kvh;
        let q = self.project(b, Projection::Q, x, w.q, lora, ctx, saves)?;
        let k = self.project(b, Projection::K, x, w.k, lora, ctx, saves)?;
        let v = self.project(b, Projection::V, x, w.v, lora, ctx, saves)?;
        let attn = b.scoped("attn", |b| {
            // Query head j = kv * G + g uses kv head j / G, as HF's repeat_kv does.
            let q = b.reshape(q, &[bs, t, kvh, g, d])?;
            let k = b.reshape(k, &[bs, t, kvh, d])?;
            let v = b.reshape(v, &[bs, t, kvh, d])?;
            let q = self.apply_rope(b, q, rope)?;
            let k = self.apply_rope(b, k, rope)?;
            self.attend_sequence(b, [q, k, v], doc_starts, &mut *saves)
        })?;
        self.project(b, Projection::O, attn, w.o, lora, ctx, saves)
    }

    /// Causal attention over the whole sequence for q [B, T, KV, G, D], k and v [B, T, KV, D]
    /// (after RoPE) and `doc_starts` [B, T], in the form the step asks for: split over the
    /// context axis, over key/value blocks, or every key at once in query blocks. Returns
    /// [B, T, heads x D] after the save point [`ATTENTION_OUTPUT`].
    fn attend_sequence(
        &self,
        b: &mut Builder,
        [q, k, v]: [Value; 3],
        doc_starts: Value,
        saves: &mut Saves,
    ) -> Result<Value> {
        let (bs, t, d) = (b.dims(q)[0], b.dims(q)[1], self.cfg.head_dim);
        if let Some(cs) = self.context {
            let kb = self.num.key_block.unwrap_or(flash::DEFAULT_KEY_BLOCK);
            let tb = context::key_block(t, cs.size, kb);
            let at = (ATTENTION_OUTPUT, saves);
            let split = (cs.size, tb);
            return context::attend(b, q, k, v, doc_starts, split, self.num, at, cs.placement);
        }
        // A padding query sees what a query at a document's start would, and more: every
        // earlier real key (see [`attend`]).
        let query_docs = starts_or_zero(b, doc_starts)?;
        if let Some(kb) = self.num.key_block {
            let tb = flash::key_block(t, kb);
            let docs = (query_docs, doc_starts);
            let at = (ATTENTION_OUTPUT, saves);
            return flash::attend(b, q, k, v, docs, tb, self.num, at, self.mesh);
        }
        // Causal: the queries of block i see keys 0..(i+1)*TB only, so the blocks above the
        // diagonal, where every score is masked, are never computed (a quarter of the
        // attention work at 2 blocks, nearly half at many).
        let tb = query_block(t, self.num.attention_block);
        let mut outs = Vec::new();
        for i in 0..t / tb {
            let (start, seen) = (i * tb, (i + 1) * tb);
            let qi = b.slice_dim(q, 1, start, start + tb)?;
            let ki = b.slice_dim(k, 1, 0, seen)?;
            let vi = b.slice_dim(v, 1, 0, seen)?;
            let docs = (
                b.slice_dim(query_docs, 1, start, start + tb)?,
                b.slice_dim(doc_starts, 1, 0, seen)?,
            );
            outs.push(attend(b, qi, ki, vi, docs, start, d, self.num, i, saves)?);
        }
        let out = if outs.len() == 1 {
            outs[0]
        } else {
            b.concatenate(&outs, 1)?
        };
        let out = b.reshape(out, &[bs, t, self.cfg.num_attention_heads * d])?;
        saves.point(b, ATTENTION_OUTPUT, out)
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
        let gate = self.project(b, Projection::Gate, x, gate_w, lora, ctx, saves)?;
        let up = self.project(b, Projection::Up, x, up_w, lora, ctx, saves)?;
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
        self.project(b, Projection::Down, act, down_w, lora, ctx, saves)
    }
}

/// Softmax over the last dim (f32) in two parts, `(exp(x - max), sum)`, for the caller to divide
/// where it is cheapest; the max gets no gradient (the softmax does not depend on it). The row
/// max and the row sum are save points, named by `names("max")` and `names("sum")`:
/// a recomputation that is given both skips the two reductions over the row (a read of the
/// whole input each) and computes `exp(x - max)` in one pass; the gradient is the same, since it
/// flows into the recomputed sum.
pub fn softmax_parts_last(
    b: &mut Builder,
    x: Value,
    names: impl Fn(&str) -> String,
    saves: &mut Saves,
) -> Result<(Value, Value)> {
    let dims = b.dims(x).to_vec();
    let last = dims.len() as i64 - 1;
    let keep: Vec<i64> = (0..last).collect();
    let m = b.reduce_max(x, &[last])?;
    let m = b.stop_gradient(m);
    let m = saves.point(b, &names("max"), m)?;
    let m = b.broadcast_in_dim(m, &dims, &keep)?;
    let shifted = b.sub(x, m)?;
    let e = b.exp(shifted)?;
    let s = b.reduce_sum(e, &[last])?;
    let s = saves.point(b, &names("sum"), s)?;
    Ok((e, s))
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
    fn a_requested_query_block_is_taken_only_when_it_divides_the_sequence() {
        assert_eq!(query_block(64, Some(16)), 16);
        assert_eq!(query_block(64, Some(64)), 64);
        assert_eq!(query_block(64, Some(24)), 64);
        assert_eq!(query_block(64, Some(0)), 64);
        assert_eq!(query_block(64, Some(128)), 64);
    }

    #[test]
    fn the_default_query_block_halves_multiples_of_256_and_keeps_other_sequences_whole() {
        assert_eq!(query_block(512, None), 256);
        assert_eq!(query_block(8192, None), 4096);
        assert_eq!(query_block(384, None), 384);
        assert_eq!(query_block(64, None), 64);
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

    /// Grouped-query attention of a block of queries that starts mid-sequence, in a row packed
    /// from two documents (tokens 0-2 and 3-7) and a row of one document padded after 5
    /// tokens: against softmax(q.k / sqrt(D)) v over the keys each query may see, computed here
    /// in f64. A query sees the earlier keys of its own document; a padding query every earlier
    /// real key.
    #[test]
    fn attention_sees_only_earlier_keys_of_its_document_with_grouped_heads_and_a_block_offset() {
        let (bs, s, tq, start, kv, g, d) = (2usize, 8usize, 4usize, 4usize, 2usize, 2usize, 4);
        let starts: [i32; 16] = [0, 0, 0, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0, -1, -1, -1];
        let q = values(bs * tq * kv * g * d, 4);
        let k = values(bs * s * kv * d, 5);
        let v = values(bs * s * kv * d, 6);
        let query_docs: Vec<i32> = (0..bs)
            .flat_map(|bi| (start..start + tq).map(move |t| starts[bi * s + t].max(0)))
            .collect();
        let i = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
        let (qd, kd) = (i(&[bs, tq, kv, g, d]), i(&[bs, s, kv, d]));
        let mut b = Builder::new("main");
        let qv = f32_param(&mut b, "q", &qd);
        let kv_ = f32_param(&mut b, "k", &kd);
        let vv = f32_param(&mut b, "v", &kd);
        let qdocs = b.param("query_docs", Shape::new(&i(&[bs, tq]), DType::S32));
        let kdocs = b.param("key_docs", Shape::new(&i(&[bs, s]), DType::S32));
        let out = attend(
            &mut b,
            qv,
            kv_,
            vv,
            (qdocs, kdocs),
            start as i64,
            d as i64,
            Numerics::default(),
            0,
            &mut Saves::Off,
        )
        .unwrap();
        let got = run(
            b.finish(&[("out", out)]),
            &[
                HostTensor::from_f32(&q, &qd),
                HostTensor::from_f32(&k, &kd),
                HostTensor::from_f32(&v, &kd),
                HostTensor::from_i32(&query_docs, &i(&[bs, tq])),
                HostTensor::from_i32(&starts, &i(&[bs, s])),
            ],
        )[0]
        .to_f32()
        .unwrap();
        let mut want = vec![0f32; got.len()];
        for (bi, t, h, gi) in (0..bs).flat_map(|bi| {
            (0..tq)
                .flat_map(move |t| (0..kv).flat_map(move |h| (0..g).map(move |gi| (bi, t, h, gi))))
        }) {
            let qrow = &q[(((bi * tq + t) * kv + h) * g + gi) * d..][..d];
            let key = |j: usize| &k[((bi * s + j) * kv + h) * d..][..d];
            let doc = starts[bi * s + start + t];
            let seen: Vec<usize> = (0..=start + t)
                .filter(|&j| {
                    let key_doc = starts[bi * s + j];
                    key_doc >= 0 && (doc < 0 || key_doc == doc)
                })
                .collect();
            let scores: Vec<f64> = seen
                .iter()
                .map(|&j| {
                    let dot: f64 = qrow.iter().zip(key(j)).map(|(a, c)| (a * c) as f64).sum();
                    dot / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for e in 0..d {
                let o: f64 = seen
                    .iter()
                    .zip(&weights)
                    .map(|(&j, w)| w * v[((bi * s + j) * kv + h) * d + e] as f64)
                    .sum();
                want[(((bi * tq + t) * kv + h) * g + gi) * d + e] = (o / total) as f32;
            }
        }
        assert!(max_diff(&got, &want) <= TOL, "{}", max_diff(&got, &want));
    }

    /// The two parts divide to the softmax, and both statistics are recorded under their names.
    #[test]
    fn softmax_parts_divide_to_the_softmax_and_record_the_row_max_and_sum() {
        let (rows, n) = (3usize, 7usize);
        let x: Vec<f32> = values(rows * n, 7).iter().map(|v| 4.0 * v).collect();
        let mut b = Builder::new("main");
        let xv = f32_param(&mut b, "x", &[rows as i64, n as i64]);
        let mut recorded = Vec::new();
        let (e, sum) = softmax_parts_last(
            &mut b,
            xv,
            |stat| softmax_stat_name(stat, 3),
            &mut Saves::Record(&mut recorded),
        )
        .unwrap();
        let names: Vec<&str> = recorded.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["attn.max.3", "attn.sum.3"]);
        let sum = b
            .broadcast_in_dim(sum, &[rows as i64, n as i64], &[0])
            .unwrap();
        let p = b.div(e, sum).unwrap();
        let got = run(
            b.finish(&[("p", p)]),
            &[HostTensor::from_f32(&x, &[rows as i64, n as i64])],
        )[0]
        .to_f32()
        .unwrap();
        let want: Vec<f32> = x
            .chunks(n)
            .flat_map(|row| {
                let total: f64 = row.iter().map(|v| (*v as f64).exp()).sum();
                row.iter().map(move |v| ((*v as f64).exp() / total) as f32)
            })
            .collect();
        assert!(max_diff(&got, &want) <= TOL, "{}", max_diff(&got, &want));
    }
}

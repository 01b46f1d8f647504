//! Attention, as the equations have it: the layer's queries, keys and values from its
//! projections, turned by RoPE, and causal attention over each token's document in the form the
//! step asks for (every key at once in query blocks here; over key/value blocks in `flash`; split
//! over a mesh's context axis in `context`), then the output projection.
//!
//! ```text
//! q, k, v = x W_q^T + b_q, x W_k^T + b_k, x W_v^T + b_v   (each with its LoRA term;
//!                                                           biases: Qwen2)
//! q, k    = RMSNorm_D(q; g_q), RMSNorm_D(k; g_k)          (per head over its D dims: Qwen3)
//! q, k    = RoPE(q), RoPE(k)                  (positions within each token's document)
//! out     = softmax(q k^T / sqrt(D) + mask) v (GQA: query head j reads KV head j / G)
//! Attn(x) = out W_o^T
//! ```

use crate::model::forward::mask_scores;
use crate::model::forward::{Numerics, Saves};
use crate::model::llama::{starts_or_zero, LayerAdapters, LayerContext, LayerWeights, Llama};
use crate::model::lora::Projection;
use crate::model::{context, flash};
use hlo::{Builder, DType, DotDims, Result, Shape, Value};

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

/// The save point of query block `block`'s softmax statistic `stat` (`max` or `sum`).
fn softmax_stat_name(stat: &str, block: i64) -> String {
    format!("attn.{stat}.{block}")
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
    /// Attn(x) for the layer's normed input `x` [B, T, H]: q, k and v projected (each with its
    /// LoRA term), turned by RoPE at each token's position in its document, attended causally
    /// within each document, and projected back by O.
    pub(super) fn attention(
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
            // Qwen3: each head RMS-normed over its D dims, before RoPE.
            let q = self.head_norm(b, "q_norm", q, w.q_norm)?;
            let k = self.head_norm(b, "k_norm", k, w.k_norm)?;
            let q = self.apply_rope(b, q, rope)?;
            let k = self.apply_rope(b, k, rope)?;
            self.attend_sequence(b, [q, k, v], doc_starts, &mut *saves)
        })?;
        self.project(b, Projection::O, attn, w.o, lora, ctx, saves)
    }

    /// `x` [B, T, ..heads.., D] with each head RMS-normed over its D dims by `g` [D] (one weight
    /// shared by the heads), or `x` itself where the family has no such norm.
    fn head_norm(&self, b: &mut Builder, name: &str, x: Value, g: Option<Value>) -> Result<Value> {
        match g {
            Some(g) => b.scoped(name, |b| self.rms_norm(b, x, g)),
            None => Ok(x),
        }
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

/// The attention's pieces on small inputs, each against its equation computed here directly
/// (the whole model is checked against Hugging Face in tests/oracle.rs). f32 throughout; the
/// tolerance, 1e-5 on values of order one, is a few f32 roundings of sums over at most 64 terms.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{max_diff, run, values};
    use pjrt::HostTensor;

    const TOL: f32 = 1e-5;

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

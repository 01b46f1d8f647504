//! `cudnn`: the attention composites as cuDNN's fused flash attention on NVIDIA GPUs
//! (`__cudnn$fmhaSoftmax` forward, `__cudnn$fmhaSoftmaxBackward` backward), custom calls that
//! the CUDA plugin's compiler turns into cuDNN graphs (it needs the cuDNN library where it
//! compiles: the `nvidia-cudnn-cu13` wheel beside the plugin).
//!
//! What it covers, and why no more:
//! - **One device's whole sequence** (`chunks = 2`: no `context` axis). One device pads the
//!   sequence at its end to whole key blocks, so its two query chunks, one after the other, are
//!   the sequence itself (`padded_chunk = chunk`), and cuDNN's causal mask is the composite's
//!   position rule. Over a context axis each chunk is padded on its own, padding would sit
//!   between real tokens, and the chunks are not in order: refused.
//! - **One document per row, padding at its end** (`train --no-pack`, `bench`): cuDNN's
//!   causal mask does not see the composite's document starts. With padding only after a
//!   row's tokens, every real query sees exactly the keys the decomposition lets it see;
//!   padding queries see the padding keys before them as well (the decomposition hides them),
//!   but they feed no loss, so the loss and every gradient are the same. Rows packed with
//!   several documents would attend across documents: [`check_rows`] refuses such a batch
//!   before it reaches the device.
//! - **bf16 or f16, head dims up to 128 in multiples of 8**: what cuDNN's flash attention
//!   takes.
//!
//! Grouped heads go in as they are (cuDNN pairs query head h with key/value head h / G, the
//! composite's [KV, G] order). The row statistic cuDNN saves for its backward (the
//! log-sum-exp of each row's scaled scores) travels in the composites' `lse` operand, laid out
//! as the decomposition's; only this kernel's backward reads it.

use super::site::{backward_params, forward_params, Site};
use crate::model::flash::Operands;
use anyhow::{bail, Result};
use hlo::{Builder, DType, Func, Shape, Value};
use serde_json::json;

/// Sizes the kernel takes from the site: batch, key/value heads, groups, sequence, head dim,
/// and the element type of q.
struct Dims {
    b: i64,
    kv: i64,
    g: i64,
    t: i64,
    d: i64,
    dtype: DType,
    scale: f64,
}

/// Who computes the attention between the layout changes: cuDNN's library (custom calls the
/// CUDA compiler turns into cuDNN graphs), or plain StableHLO that computes what those calls
/// compute on the same operands and results (`cudnn-standin`, any plugin: the CPU checks the
/// kernel's layout changes, head grouping and row rule against the loops).
#[derive(Clone, Copy, PartialEq)]
enum Calls {
    Library,
    StandIn,
}

/// The site's sizes, or why cuDNN's causal kernel cannot stand in for it.
fn dims(site: &Site, calls: Calls) -> Result<Dims> {
    let a = &site.attributes;
    if a.chunks != 2 {
        bail!(
            "the sequence is cut over a context axis ({} chunks): cuDNN's causal mask \
             needs one device's whole sequence (run without a context axis, or without this kernel)",
            a.chunks
        );
    }
    let (c, cp) = (a.chunk, a.padded_chunk);
    if c != cp {
        bail!(
            "the sequence ({} tokens) is not a whole number of key blocks of {} in each half: \
             cuDNN's causal mask needs it unpadded (choose a --key-block that divides {c})",
            2 * c,
            a.block
        );
    }
    let q = site.q();
    let (b, kv, g, d) = (q.dims[0], a.kv_heads, a.groups(), a.head_dim);
    if calls == Calls::Library && !matches!(q.dtype, DType::BF16 | DType::F16) {
        bail!(
            "the attention runs in {}: cuDNN's flash attention takes bf16 or f16 (--dtype bf16)",
            q.dtype.mlir()
        );
    }
    if d > 128 || d % 8 != 0 {
        bail!("head dim {d}: cuDNN's flash attention takes multiples of 8 up to 128");
    }
    Ok(Dims {
        b,
        kv,
        g,
        t: 2 * cp,
        d,
        dtype: q.dtype,
        scale: a.scale,
    })
}

/// The backend config XLA's cuDNN attention calls read (fields as the CUDA plugin's
/// `CudnnfMHABackendConfig` names them): causal, no dropout, no bias, q/k/v as [B, T, N, D].
fn backend_config(dm: &Dims, backward: bool) -> String {
    let h = dm.kv * dm.g;
    let dims = |lc: i64, rc: i64, lb: [i64; 2], rb: [i64; 2]| {
        json!({
            "lhs_contracting_dimensions": [lc.to_string()],
            "rhs_contracting_dimensions": [rc.to_string()],
            "lhs_batch_dimensions": lb.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
            "rhs_batch_dimensions": rb.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
        })
    };
    let tensor_dims: Vec<String> = [dm.b, h, dm.t, dm.t]
        .iter()
        .map(|x| x.to_string())
        .collect();
    // Where the fixed values come from: the `algorithm` block (algo_id 0, tensor-op math, the
    // frontend's knobs 17 and 24) is the one JAX's cuDNN attention lowering
    // (jax/_src/cudnn/fused_attention_stablehlo.py) writes for every call; XLA builds the
    // cuDNN frontend graph itself and reads these as they are. The seed only feeds dropout,
    // which is off here (`dropout_rate` 0), so its value (42, JAX's default) changes nothing.
    let mut c = json!({
        "algorithm": {
            "algo_id": "0",
            "math_type": "TENSOR_OP_MATH",
            "tuning_knobs": {"17": "1", "24": "0"},
            "is_cudnn_frontend": true,
            "workspace_size": "0",
        },
        "fmha_scale": dm.scale,
        "intermediate_tensor_shape": {
            "element_type": if dm.dtype == DType::BF16 { "BF16" } else { "F16" },
            "dimensions": tensor_dims,
            "tuple_shapes": [],
            "layout": {
                "dim_level_types": [],
                "dim_unique": [],
                "dim_ordered": [],
                "minor_to_major": ["3", "2", "1", "0"],
                "tiles": [],
                "element_size_in_bits": "0",
                "memory_space": "0",
                "index_primitive_type": "PRIMITIVE_TYPE_INVALID",
                "pointer_primitive_type": "PRIMITIVE_TYPE_INVALID",
                "dynamic_shape_metadata_prefix_bytes": "0",
            },
            "is_dynamic_dimension": [false, false, false, false],
        },
        "is_flash_attention": true,
        "mask_type": "CAUSAL",
        "dropout_rate": 0.0,
        "seed": 42,
        "sliding_window_length": 0,
        "max_seg_per_batch": 1,
        "is_paged_attention": false,
    });
    // Q [B,T,N,D], K and V [B,S,N,D], P [B,N,T,S], O like Q: the six products of the
    // forward (bmm1 Q K^T, bmm2 P V) and backward passes, by their batch and contracting dims.
    let gemms = if backward {
        vec![
            (
                "bmm1_grad_gemm1_dot_dimension_numbers",
                dims(2, 1, [0, 1], [0, 2]),
            ),
            (
                "bmm1_grad_gemm2_dot_dimension_numbers",
                dims(3, 1, [0, 1], [0, 2]),
            ),
            (
                "bmm2_grad_gemm1_dot_dimension_numbers",
                dims(2, 1, [0, 1], [0, 2]),
            ),
            (
                "bmm2_grad_gemm2_dot_dimension_numbers",
                dims(3, 3, [0, 2], [0, 2]),
            ),
        ]
    } else {
        vec![
            ("bmm1_dot_dimension_numbers", dims(3, 3, [0, 2], [0, 2])),
            ("bmm2_dot_dimension_numbers", dims(3, 1, [0, 1], [0, 2])),
        ]
    };
    for (k, v) in gemms {
        c[k] = v;
    }
    json!({"operation_queue_id": "0", "cudnn_fmha_backend_config": c}).to_string()
}

const ROW_MAJOR_4: [i64; 4] = [3, 2, 1, 0];
/// [B, N, T, D] stored as [B, T, N, D]: how cuDNN writes its outputs.
const HEADS_INSIDE_4: [i64; 4] = [3, 1, 2, 0];

/// The composite's queries-like [B, KV, 2, Cp, G, D] as cuDNN's [B, T, KV G, D].
fn to_tokens_heads(b: &mut Builder, x: Value, dm: &Dims) -> Result<Value> {
    let x = b.transpose(x, &[0, 2, 3, 1, 4, 5])?;
    Ok(b.reshape(x, &[dm.b, dm.t, dm.kv * dm.g, dm.d])?)
}

/// cuDNN's [B, KV G, T, D] as the composite's [B, KV, 2, Cp, G, D].
fn from_heads_tokens(b: &mut Builder, x: Value, dm: &Dims) -> Result<Value> {
    let x = b.reshape(x, &[dm.b, dm.kv, dm.g, 2, dm.t / 2, dm.d])?;
    Ok(b.transpose(x, &[0, 1, 3, 4, 2, 5])?)
}

/// The composite's keys [B, KV, T, D] as cuDNN's [B, T, KV, D].
fn keys_to_tokens(b: &mut Builder, x: Value) -> Result<Value> {
    Ok(b.transpose(x, &[0, 2, 1, 3])?)
}

/// The composites' first three operands as cuDNN takes them: q [B, T, H, D], k and v
/// [B, T, KV, D].
fn qkv_tokens(b: &mut Builder, p: &Operands<Value>, dm: &Dims) -> Result<[Value; 3]> {
    Ok([
        to_tokens_heads(b, p.q, dm)?,
        keys_to_tokens(b, p.k)?,
        keys_to_tokens(b, p.v)?,
    ])
}

/// Forward: (q, k, v, query starts, key starts, chunk ids) -> (out, lse), by cuDNN.
pub(super) fn forward(site: &Site) -> Result<Func> {
    build_forward(site, Calls::Library)
}

/// Backward: (q, k, v, query starts, key starts, chunk ids, out, lse, dout) -> (dq, dk, dv),
/// by cuDNN.
pub(super) fn backward(site: &Site) -> Result<Func> {
    build_backward(site, Calls::Library)
}

/// [`forward`] with plain StableHLO in the library's place (`cudnn-standin`).
pub(super) fn stand_in_forward(site: &Site) -> Result<Func> {
    build_forward(site, Calls::StandIn)
}

/// [`backward`] with plain StableHLO in the library's place (`cudnn-standin`).
pub(super) fn stand_in_backward(site: &Site) -> Result<Func> {
    build_backward(site, Calls::StandIn)
}

fn build_forward(site: &Site, calls: Calls) -> Result<Func> {
    let dm = dims(site, calls)?;
    let mut b = Builder::new("cudnn_attention");
    let p = forward_params(&mut b, site)?;
    let h = dm.kv * dm.g;
    let [q, k, v] = qkv_tokens(&mut b, &p, &dm)?;
    let (out, stats) = match calls {
        Calls::Library => {
            let outs = b.custom_call(
                "__cudnn$fmhaSoftmax",
                &backend_config(&dm, false),
                &[
                    (q, ROW_MAJOR_4.to_vec()),
                    (k, ROW_MAJOR_4.to_vec()),
                    (v, ROW_MAJOR_4.to_vec()),
                ],
                &[
                    (
                        Shape::new(&[dm.b, h, dm.t, dm.d], dm.dtype),
                        HEADS_INSIDE_4.to_vec(),
                    ),
                    (Shape::new(&[dm.b, h, dm.t], DType::F32), vec![2, 1, 0]),
                    (Shape::new(&[0], DType::U8), vec![0]),
                ],
            )?;
            (outs[0], outs[1])
        }
        Calls::StandIn => stand_in::forward(&mut b, (q, k, v), &dm)?,
    };
    let out = from_heads_tokens(&mut b, out, &dm)?;
    let lse = b.reshape(stats, &[dm.b, dm.kv, dm.g, 2, dm.t / 2])?;
    let lse = b.transpose(lse, &[0, 1, 3, 4, 2])?;
    Ok(b.finish(&[("out", out), ("lse", lse)]))
}

fn build_backward(site: &Site, calls: Calls) -> Result<Func> {
    let dm = dims(site, calls)?;
    let mut b = Builder::new("cudnn_attention_grad");
    let p = backward_params(&mut b, site)?;
    let h = dm.kv * dm.g;
    let [q, k, v] = qkv_tokens(&mut b, &p.ins, &dm)?;
    let out = to_tokens_heads(&mut b, p.out, &dm)?;
    let dout = to_tokens_heads(&mut b, p.dout, &dm)?;
    let lse = b.transpose(p.lse, &[0, 1, 4, 2, 3])?;
    let lse = b.reshape(lse, &[dm.b, h, dm.t])?;
    let (dq, dk, dv) = match calls {
        Calls::Library => {
            let kv_shape = Shape::new(&[dm.b, dm.kv, dm.t, dm.d], dm.dtype);
            let outs = b.custom_call(
                "__cudnn$fmhaSoftmaxBackward",
                &backend_config(&dm, true),
                &[
                    (q, ROW_MAJOR_4.to_vec()),
                    (k, ROW_MAJOR_4.to_vec()),
                    (v, ROW_MAJOR_4.to_vec()),
                    (lse, vec![2, 1, 0]),
                    (dout, ROW_MAJOR_4.to_vec()),
                    (out, ROW_MAJOR_4.to_vec()),
                ],
                &[
                    (
                        Shape::new(&[dm.b, h, dm.t, dm.d], dm.dtype),
                        HEADS_INSIDE_4.to_vec(),
                    ),
                    (kv_shape.clone(), HEADS_INSIDE_4.to_vec()),
                    (kv_shape, HEADS_INSIDE_4.to_vec()),
                    (Shape::new(&[0], DType::U8), vec![0]),
                ],
            )?;
            (outs[0], outs[1], outs[2])
        }
        Calls::StandIn => stand_in::backward(&mut b, (q, k, v), (lse, dout, out), &dm)?,
    };
    let dq = from_heads_tokens(&mut b, dq, &dm)?;
    Ok(b.finish(&[("dq", dq), ("dk", dk), ("dv", dv)]))
}

/// What the two calls compute, in plain StableHLO on their operands and results as the
/// compiler sees them (logical shapes; the layouts only say how the library stores them):
/// causal attention whose query head h reads key/value head h / G, scaled scores, the row
/// statistic the natural log-sum-exp of each row's scaled scores. f32 inside.
mod stand_in {
    use super::Dims;
    use anyhow::Result;
    use hlo::{Builder, CmpDir, DType, DotDims, Shape, Value};

    /// Rows [B, T, KV, G, D] (queries, or the output's cotangent) against the keys' or values'
    /// [B, S, KV, D], per head: [B, KV, T, G, S].
    fn against_keys() -> DotDims {
        DotDims {
            lhs_batch: vec![0, 2],
            rhs_batch: vec![0, 2],
            lhs_contract: vec![4],
            rhs_contract: vec![3],
        }
    }

    /// Weights over the keys [B, KV, T, G, S] times values or keys [B, S, KV, D]: [B, KV, T, G, D].
    fn over_keys() -> DotDims {
        DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
            lhs_contract: vec![4],
            rhs_contract: vec![1],
        }
    }

    /// Scaled, causally masked scores [B, KV, T, G, S] f32 of q [B, T, H, D] against k
    /// [B, S, KV, D], and q as [B, T, KV, G, D].
    fn scores(b: &mut Builder, q: Value, k: Value, dm: &Dims) -> Result<(Value, Value)> {
        let q5 = b.reshape(q, &[dm.b, dm.t, dm.kv, dm.g, dm.d])?;
        let s = b.dot_general(q5, k, against_keys(), None, Some(DType::F32))?;
        let s = b.mul_scalar(s, dm.scale)?;
        let shape = Shape::new(&[dm.b, dm.kv, dm.t, dm.g, dm.t], DType::S32);
        let query = b.iota(shape.clone(), 2)?;
        let key = b.iota(shape, 4)?;
        let seen = b.compare(key, query, CmpDir::Le)?;
        let blocked = b.full(f32::MIN as f64, b.shape(s).clone());
        Ok((b.select(seen, s, blocked)?, q5))
    }

    /// [B, KV, T, G, D] as [B, H, T, D].
    fn heads_first(b: &mut Builder, x: Value, dm: &Dims) -> Result<Value> {
        let x = b.transpose(x, &[0, 1, 3, 2, 4])?;
        Ok(b.reshape(x, &[dm.b, dm.kv * dm.g, dm.t, dm.d])?)
    }

    /// The row statistic [B, H, T] as [B, KV, T, G], or back.
    fn stats_rows(b: &mut Builder, stats: Value, dm: &Dims) -> Result<Value> {
        let x = b.reshape(stats, &[dm.b, dm.kv, dm.g, dm.t])?;
        Ok(b.transpose(x, &[0, 1, 3, 2])?)
    }

    /// (q, k, v) -> (out [B, H, T, D], stats [B, H, T]).
    pub(super) fn forward(
        b: &mut Builder,
        (q, k, v): (Value, Value, Value),
        dm: &Dims,
    ) -> Result<(Value, Value)> {
        let (s, _) = scores(b, q, k, dm)?;
        let sd = b.dims(s).to_vec();
        let rows: Vec<i64> = (0..4).collect();
        let m = b.reduce_max(s, &[4])?;
        let mw = b.broadcast_in_dim(m, &sd, &rows)?;
        let shifted = b.sub(s, mw)?;
        let e = b.exp(shifted)?;
        let l = b.reduce_sum(e, &[4])?;
        let vf = b.convert(v, DType::F32)?;
        let ev = b.dot_general(e, vf, over_keys(), None, Some(DType::F32))?;
        let od = b.dims(ev).to_vec();
        let lw = b.broadcast_in_dim(l, &od, &rows)?;
        let out = b.div(ev, lw)?;
        let out = heads_first(b, out, dm)?;
        let out = b.convert(out, dm.dtype)?;
        let log_l = b.log(l)?;
        let lse = b.add(m, log_l)?;
        let lse = b.transpose(lse, &[0, 1, 3, 2])?;
        let stats = b.reshape(lse, &[dm.b, dm.kv * dm.g, dm.t])?;
        Ok((out, stats))
    }

    /// (q, k, v), (stats, dO, O) -> (dq [B, H, T, D], dk and dv [B, KV, T, D]).
    pub(super) fn backward(
        b: &mut Builder,
        (q, k, v): (Value, Value, Value),
        (stats, dout, out): (Value, Value, Value),
        dm: &Dims,
    ) -> Result<(Value, Value, Value)> {
        let (s, q5) = scores(b, q, k, dm)?;
        let sd = b.dims(s).to_vec();
        let rows: Vec<i64> = (0..4).collect();
        let lse = stats_rows(b, stats, dm)?;
        let lw = b.broadcast_in_dim(lse, &sd, &rows)?;
        let shifted = b.sub(s, lw)?;
        let probs = b.exp(shifted)?;
        let five = [dm.b, dm.t, dm.kv, dm.g, dm.d];
        let do5 = b.reshape(dout, &five)?;
        let o5 = b.reshape(out, &five)?;
        let do5 = b.convert(do5, DType::F32)?;
        let of = b.convert(o5, DType::F32)?;
        let prod = b.mul(do5, of)?;
        let delta = b.reduce_sum(prod, &[4])?;
        let delta = b.transpose(delta, &[0, 2, 1, 3])?;
        let vf = b.convert(v, DType::F32)?;
        let dp = b.dot_general(do5, vf, against_keys(), None, Some(DType::F32))?;
        let dw = b.broadcast_in_dim(delta, &sd, &rows)?;
        let centered = b.sub(dp, dw)?;
        let ds = b.mul(probs, centered)?;
        let ds = b.mul_scalar(ds, dm.scale)?;
        let over_queries = DotDims {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
            lhs_contract: vec![2, 3],
            rhs_contract: vec![1, 3],
        };
        let dv = b.dot_general(probs, do5, over_queries.clone(), None, Some(DType::F32))?;
        let qf = b.convert(q5, DType::F32)?;
        let dk = b.dot_general(ds, qf, over_queries, None, Some(DType::F32))?;
        let kf = b.convert(k, DType::F32)?;
        let dq = b.dot_general(ds, kf, over_keys(), None, Some(DType::F32))?;
        let dq = heads_first(b, dq, dm)?;
        Ok((
            b.convert(dq, dm.dtype)?,
            b.convert(dk, dm.dtype)?,
            b.convert(dv, dm.dtype)?,
        ))
    }
}

/// Refuse a batch whose rows this kernel would attend wrongly: a row must hold one document
/// (`attention_mask` 1 on its tokens, as a Hugging Face mask) with any padding (0) after it.
/// `mask` is [B, T] row-major.
pub fn check_rows(mask: &[i32], seq: usize) -> Result<()> {
    for (row, m) in mask.chunks(seq.max(1)).enumerate() {
        if let Some(t) = m.iter().position(|&x| x > 1) {
            bail!(
                "row {row} holds several documents (a second one starts at token {}): \
                 cuDNN's causal mask would let them attend to each other; give rows of one \
                 document each (--no-pack for JSONL or Parquet data; a pre-tokenized batch \
                 written so), or train without this kernel",
                m[t] - 1
            );
        }
        if let Some(first_pad) = m.iter().position(|&x| x == 0) {
            if let Some(t) = m[first_pad..].iter().position(|&x| x != 0) {
                bail!(
                    "row {row} has padding at token {first_pad} before a real token \
                     at {}: cuDNN's causal mask needs padding at the end of a row",
                    first_pad + t
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_one_document_with_padding_at_the_end_pass_and_others_are_named() {
        check_rows(&[1, 1, 1, 0, 1, 1, 1, 1], 4).unwrap();
        check_rows(&[0, 0, 0, 0], 4).unwrap();
        let e = check_rows(&[1, 1, 1, 1, 1, 1, 3, 3], 4)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("row 1 holds several documents (a second one starts at token 2)"),
            "{e}"
        );
        let e = check_rows(&[1, 0, 1, 1], 4).unwrap_err().to_string();
        assert!(
            e.contains("row 0 has padding at token 1 before a real token at 2"),
            "{e}"
        );
    }

    fn site(chunks: i64, c: i64, cp: i64, dtype: DType, d: i64) -> Site {
        let attributes = crate::model::flash::Attributes {
            block: 4,
            chunk: c,
            chunks,
            padded_chunk: cp,
            head_dim: d,
            kv_heads: 2,
            q_heads: 6,
            scale: 0.25,
            causal: crate::model::flash::CAUSAL_RULE.into(),
        };
        let q = Shape::new(&[1, 2, 2, cp, 3, d], dtype);
        let k = Shape::new(&[1, 2, chunks * cp, d], dtype);
        let i = |dims: &[i64]| Shape::new(dims, DType::S32);
        Site {
            attributes,
            params: vec![
                q,
                k.clone(),
                k,
                i(&[1, 2, cp]),
                i(&[1, chunks * cp]),
                i(&[2]),
            ],
            results: vec![],
        }
    }

    /// The forward's results are the decomposition's shapes (cuDNN's [B, H, T, D] turned back
    /// into [B, KV, 2, Cp, G, D]), and its backend config is what the compiler reads.
    #[test]
    fn the_forward_gives_the_composites_shapes_and_refuses_what_cudnn_cannot_do() {
        let f = forward(&site(2, 8, 8, DType::BF16, 16)).unwrap();
        let shapes: Vec<Shape> = f.results.iter().map(|r| f.shape(r.value).clone()).collect();
        assert_eq!(
            shapes,
            [
                Shape::new(&[1, 2, 2, 8, 3, 16], DType::BF16),
                Shape::new(&[1, 2, 2, 8, 3], DType::F32)
            ]
        );
        let config: serde_json::Value = serde_json::from_str(&backend_config(
            &dims(&site(2, 8, 8, DType::BF16, 16), Calls::Library).unwrap(),
            false,
        ))
        .unwrap();
        let c = &config["cudnn_fmha_backend_config"];
        assert_eq!(c["mask_type"], "CAUSAL");
        assert_eq!(c["fmha_scale"], 0.25);
        assert_eq!(
            c["intermediate_tensor_shape"]["dimensions"],
            serde_json::json!(["1", "6", "16", "16"])
        );
        let why = |s: Site| forward(&s).err().unwrap().to_string();
        assert!(why(site(4, 8, 8, DType::BF16, 16)).contains("context axis (4 chunks)"));
        assert!(why(site(2, 7, 8, DType::BF16, 16)).contains("not a whole number of key blocks"));
        assert!(why(site(2, 8, 8, DType::F32, 16)).contains("takes bf16 or f16"));
        assert!(why(site(2, 8, 8, DType::BF16, 12)).contains("multiples of 8 up to 128"));
    }
}

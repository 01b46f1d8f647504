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

use super::site::{params, Site, BACKWARD_OPERANDS, FORWARD_OPERANDS};
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

/// The site's sizes, or why cuDNN's causal kernel cannot stand in for it.
fn dims(site: &Site) -> Result<Dims> {
    let chunks = site.int("chunks")?;
    if chunks != 2 {
        bail!(
            "the sequence is cut over a context axis ({chunks} chunks): cuDNN's causal mask \
             needs one device's whole sequence (run without a context axis, or without --kernel cudnn)"
        );
    }
    let (c, cp) = (site.int("chunk")?, site.int("padded_chunk")?);
    if c != cp {
        bail!(
            "the sequence ({} tokens) is not a whole number of key blocks of {} in each half: \
             cuDNN's causal mask needs it unpadded (choose a --key-block that divides {c})",
            2 * c,
            site.int("block")?
        );
    }
    let q = &site.params[0];
    if q.rank() != 6 {
        bail!("q is {q}, not [B, KV, 2, Cp, G, D]");
    }
    let (b, kv, g, d) = (q.dims[0], q.dims[1], q.dims[4], q.dims[5]);
    if !matches!(q.dtype, DType::BF16 | DType::F16) {
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
        scale: site.float("scale")?,
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

/// Forward: (q, k, v, query starts, key starts, chunk ids) -> (out, lse).
pub(super) fn forward(site: &Site) -> Result<Func> {
    let dm = dims(site)?;
    let mut b = Builder::new("cudnn_attention");
    let p = params(&mut b, site, &FORWARD_OPERANDS)?;
    let h = dm.kv * dm.g;
    let q = to_tokens_heads(&mut b, p[0], &dm)?;
    let k = keys_to_tokens(&mut b, p[1])?;
    let v = keys_to_tokens(&mut b, p[2])?;
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
    let out = from_heads_tokens(&mut b, outs[0], &dm)?;
    let lse = b.reshape(outs[1], &[dm.b, dm.kv, dm.g, 2, dm.t / 2])?;
    let lse = b.transpose(lse, &[0, 1, 3, 4, 2])?;
    Ok(b.finish(&[("out", out), ("lse", lse)]))
}

/// Backward: (q, k, v, query starts, key starts, chunk ids, out, lse, dout) -> (dq, dk, dv).
pub(super) fn backward(site: &Site) -> Result<Func> {
    let dm = dims(site)?;
    let mut b = Builder::new("cudnn_attention_grad");
    let p = params(&mut b, site, &BACKWARD_OPERANDS)?;
    let h = dm.kv * dm.g;
    let q = to_tokens_heads(&mut b, p[0], &dm)?;
    let k = keys_to_tokens(&mut b, p[1])?;
    let v = keys_to_tokens(&mut b, p[2])?;
    let out = to_tokens_heads(&mut b, p[6], &dm)?;
    let dout = to_tokens_heads(&mut b, p[8], &dm)?;
    let lse = b.transpose(p[7], &[0, 1, 4, 2, 3])?;
    let lse = b.reshape(lse, &[dm.b, h, dm.t])?;
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
    let dq = from_heads_tokens(&mut b, outs[0], &dm)?;
    Ok(b.finish(&[("dq", dq), ("dk", outs[1]), ("dv", outs[2])]))
}

/// Refuse a batch whose rows this kernel would attend wrongly: a row must hold one document
/// (`attention_mask` 1 on its tokens, as a Hugging Face mask) with any padding (0) after it.
/// `mask` is [B, T] row-major.
pub fn check_rows(mask: &[i32], seq: usize) -> Result<()> {
    for (row, m) in mask.chunks(seq.max(1)).enumerate() {
        if let Some(t) = m.iter().position(|&x| x > 1) {
            bail!(
                "--kernel cudnn: row {row} holds several documents (a second one starts at token {}): \
                 cuDNN's causal mask would let them attend to each other; train with --no-pack, \
                 or without --kernel cudnn",
                m[t] - 1
            );
        }
        if let Some(first_pad) = m.iter().position(|&x| x == 0) {
            if let Some(t) = m[first_pad..].iter().position(|&x| x != 0) {
                bail!(
                    "--kernel cudnn: row {row} has padding at token {first_pad} before a real token \
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
        use super::super::site::AttrValue::*;
        let attributes = [
            ("chunks", Int(chunks)),
            ("chunk", Int(c)),
            ("padded_chunk", Int(cp)),
            ("block", Int(4)),
            ("scale", Float(0.25)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
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
            &dims(&site(2, 8, 8, DType::BF16, 16)).unwrap(),
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

//! `every-key`: attention over every key at once in plain StableHLO, for any platform. A
//! reference for the kernel mechanism and for the nested loops it replaces (tested against the
//! oracle on the CPU).

use super::site::{backward_params, forward_params, Site};
use crate::model::flash::{Attributes, Operands};
use crate::model::forward::mask_scores;
use anyhow::Result;
use hlo::{Builder, DType, DotDims, Func, Shape, Value};

/// Every query of the device's two chunks against every key: the masked scores
/// [B, KV, 2, Cp, G, NC Cp] f32, from the natural positions the chunk ids and sizes give (the
/// contract's causal rule, which `Site::of` checked).
fn all_scores(b: &mut Builder, p: &Operands<Value>, a: &Attributes) -> Result<Value> {
    let (q, k, qdocs, kdocs, ids) = (p.q, p.k, p.query_docs, p.key_docs, p.chunk_ids);
    let (c, cp, scale) = (a.chunk, a.padded_chunk, a.scale);
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![5],
        rhs_contract: vec![3],
    };
    let s = b.dot_general(q, k, dims, None, Some(DType::F32))?;
    let s = b.mul_scalar(s, scale)?;
    let sd = b.dims(s).to_vec();
    let nk = sd[5];
    // Query positions [2, Cp]: ids[slot] C + row; key positions [NK]: (y / Cp) C + y % Cp.
    let q_rows = b.iota(Shape::new(&[2, cp], DType::S32), 1)?;
    let ids_wide = b.broadcast_in_dim(ids, &[2, cp], &[0])?;
    let cv = b.full(c as f64, Shape::new(&[2, cp], DType::S32));
    let q_pos = b.mul(ids_wide, cv)?;
    let q_pos = b.add(q_pos, q_rows)?;
    let y = b.iota(Shape::new(&[nk], DType::S32), 0)?;
    let cpv = b.full(cp as f64, Shape::new(&[nk], DType::S32));
    let chunk = b.div(y, cpv)?;
    let row = b.rem(y, cpv)?;
    let cv = b.full(c as f64, Shape::new(&[nk], DType::S32));
    let k_pos = b.mul(chunk, cv)?;
    let k_pos = b.add(k_pos, row)?;
    // The rule of every attention form (`model::forward::mask_scores`), over the chunk slot.
    let q_pos = b.broadcast_in_dim(q_pos, &[2, cp, nk], &[0, 1])?;
    let k_pos = b.broadcast_in_dim(k_pos, &[2, cp, nk], &[2])?;
    let kdocs = b.broadcast_in_dim(kdocs, &[sd[0], 2, nk], &[0, 2])?;
    Ok(mask_scores(
        b,
        s,
        (q_pos, k_pos),
        (qdocs, kdocs),
        &[0, 2, 3, 5],
    )?)
}

/// Forward: (q, k, v, query starts, key starts, chunk ids) -> (out, lse).
pub(super) fn every_key_forward(site: &Site) -> Result<Func> {
    let mut b = Builder::new("every_key");
    let p = forward_params(&mut b, site)?;
    let compute = b.dtype(p.q);
    let s = all_scores(&mut b, &p, &site.attributes)?;
    let sd = b.dims(s).to_vec();
    let rows: Vec<i64> = (0..5).collect();
    let m = b.reduce_max(s, &[5])?;
    let mw = b.broadcast_in_dim(m, &sd, &rows)?;
    let shifted = b.sub(s, mw)?;
    let e = b.exp(shifted)?;
    let l = b.reduce_sum(e, &[5])?;
    let e = b.convert(e, compute)?;
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![5],
        rhs_contract: vec![2],
    };
    let ev = b.dot_general(e, p.v, dims, None, Some(DType::F32))?;
    let od = b.dims(ev).to_vec();
    let lw = b.broadcast_in_dim(l, &od, &rows)?;
    let out = b.div(ev, lw)?;
    let out = b.convert(out, compute)?;
    let log_l = b.log(l)?;
    let lse = b.add(m, log_l)?;
    Ok(b.finish(&[("out", out), ("lse", lse)]))
}

/// Backward: (q, k, v, query starts, key starts, chunk ids, out, lse, dout) -> (dq, dk, dv).
pub(super) fn every_key_backward(site: &Site) -> Result<Func> {
    let mut b = Builder::new("every_key_grad");
    let p = backward_params(&mut b, site)?;
    let (q, k, v) = (p.ins.q, p.ins.k, p.ins.v);
    let (out, lse, dout) = (p.out, p.lse, p.dout);
    let compute = b.dtype(q);
    let s = all_scores(&mut b, &p.ins, &site.attributes)?;
    let sd = b.dims(s).to_vec();
    let rows: Vec<i64> = (0..5).collect();
    let lw = b.broadcast_in_dim(lse, &sd, &rows)?;
    let shifted = b.sub(s, lw)?;
    let probs = b.exp(shifted)?;
    let of = b.convert(out, DType::F32)?;
    let df = b.convert(dout, DType::F32)?;
    let prod = b.mul(of, df)?;
    let delta = b.reduce_sum(prod, &[5])?;
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![5],
        rhs_contract: vec![3],
    };
    let dp = b.dot_general(dout, v, dims, None, Some(DType::F32))?;
    let dw = b.broadcast_in_dim(delta, &sd, &rows)?;
    let centered = b.sub(dp, dw)?;
    let ds = b.mul(probs, centered)?;
    let ds = b.mul_scalar(ds, site.attributes.scale)?;
    let ds = b.convert(ds, compute)?;
    let probs = b.convert(probs, compute)?;
    let over_queries = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![2, 3, 4],
        rhs_contract: vec![2, 3, 4],
    };
    let dv = b.dot_general(probs, dout, over_queries.clone(), None, Some(DType::F32))?;
    let dk = b.dot_general(ds, q, over_queries, None, Some(DType::F32))?;
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![5],
        rhs_contract: vec![2],
    };
    let dq = b.dot_general(ds, k, dims, None, Some(DType::F32))?;
    let dq = b.convert(dq, compute)?;
    let dk = b.convert(dk, b.dtype(k))?;
    let dv = b.convert(dv, b.dtype(v))?;
    Ok(b.finish(&[("dq", dq), ("dk", dk), ("dv", dv)]))
}

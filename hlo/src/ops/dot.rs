//! The generalised matrix product (`dot_general`, `matmul`) and its vjp rule.

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::{DType, Shape};

impl Builder {
    /// Generalised matrix product. Result dims: batch, then lhs free dims, then rhs free dims.
    /// `out` sets the result element type (e.g. f32 accumulation of bf16 operands).
    pub fn dot_general(
        &mut self,
        lhs: Value,
        rhs: Value,
        dims: DotDims,
        precision: Option<Precision>,
        out: Option<DType>,
    ) -> Result<Value> {
        let (l, r) = (self.shape(lhs).clone(), self.shape(rhs).clone());
        let ctx = format!("(lhs {l}, rhs {r})");
        if l.dtype != r.dtype {
            return err("dot_general", format!("operand element types differ {ctx}"));
        }
        if dims.lhs_batch.len() != dims.rhs_batch.len()
            || dims.lhs_contract.len() != dims.rhs_contract.len()
        {
            return err(
                "dot_general",
                format!("lhs and rhs must have as many batch and contracting dims {ctx}"),
            );
        }
        let check = |side: &str, s: &Shape, ds: &[i64]| -> Result<()> {
            for &d in ds {
                if d < 0 || d as usize >= s.rank() {
                    return err("dot_general", format!("{side} dim {d} out of range {ctx}"));
                }
            }
            Ok(())
        };
        for (side, s, ds) in [
            ("lhs batch", &l, &dims.lhs_batch),
            ("lhs contracting", &l, &dims.lhs_contract),
            ("rhs batch", &r, &dims.rhs_batch),
            ("rhs contracting", &r, &dims.rhs_contract),
        ] {
            check(side, s, ds)?;
        }
        for (kind, ls, rs) in [
            ("batch", &dims.lhs_batch, &dims.rhs_batch),
            ("contracting", &dims.lhs_contract, &dims.rhs_contract),
        ] {
            for (&a, &c) in ls.iter().zip(rs.iter()) {
                let (sa, sc) = (l.dims[a as usize], r.dims[c as usize]);
                if sa != sc {
                    return err(
                        "dot_general",
                        format!("lhs {kind} dim {a} has size {sa} but rhs {kind} dim {c} has size {sc} {ctx}"),
                    );
                }
            }
        }
        let mut out_dims: Vec<i64> = dims.lhs_batch.iter().map(|&d| l.dims[d as usize]).collect();
        for (i, &d) in l.dims.iter().enumerate() {
            let i = i as i64;
            if !dims.lhs_batch.contains(&i) && !dims.lhs_contract.contains(&i) {
                out_dims.push(d);
            }
        }
        for (i, &d) in r.dims.iter().enumerate() {
            let i = i as i64;
            if !dims.rhs_batch.contains(&i) && !dims.rhs_contract.contains(&i) {
                out_dims.push(d);
            }
        }
        let dtype = out.unwrap_or(l.dtype);
        Ok(self.push1(
            Op::DotGeneral { dims, precision },
            vec![lhs, rhs],
            Shape::new(&out_dims, dtype),
        ))
    }

    /// `a @ b`: contract the last dim of `a` with the first of `b`.
    pub fn matmul(&mut self, a: Value, b: Value) -> Result<Value> {
        let ra = self.rank(a) as i64;
        self.dot_general(
            a,
            b,
            DotDims {
                lhs_contract: vec![ra - 1],
                rhs_contract: vec![0],
                ..Default::default()
            },
            None,
            None,
        )
    }
}

fn free_dims(rank: usize, batch: &[i64], contract: &[i64]) -> Vec<i64> {
    (0..rank as i64)
        .filter(|d| !batch.contains(d) && !contract.contains(d))
        .collect()
}

/// Cotangent of one dot_general operand. `this`/`other` describe the operand to differentiate
/// and the other one; `g` has dims [batch, lhs free, rhs free]. `g_first` puts `g` on the lhs
/// of the product (right for the lhs operand), otherwise `other` goes first (right for the
/// rhs); either way the usual layouts come out without a transpose.
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_operand_vjp(
    b: &mut Builder,
    g: Value,
    other: Value,
    this_shape: &Shape,
    (this_batch, this_contract): (&[i64], &[i64]),
    (other_batch, other_contract): (&[i64], &[i64]),
    g_free_of_other: Vec<i64>,
    g_first: bool,
    precision: Option<Precision>,
    result_type: DType,
) -> Result<Value> {
    let other_rank = b.rank(other);
    let other_free = free_dims(other_rank, other_batch, other_contract);
    let nb = this_batch.len() as i64;
    let g_batch: Vec<i64> = (0..nb).collect();
    // Contract g's dims that belong to the other operand's free dims with those dims.
    let r = if g_first {
        let dims = DotDims {
            lhs_batch: g_batch,
            rhs_batch: other_batch.to_vec(),
            lhs_contract: g_free_of_other,
            rhs_contract: other_free,
        };
        b.dot_general(g, other, dims, precision, Some(result_type))?
    } else {
        let dims = DotDims {
            lhs_batch: other_batch.to_vec(),
            rhs_batch: g_batch,
            lhs_contract: other_free,
            rhs_contract: g_free_of_other,
        };
        b.dot_general(other, g, dims, precision, Some(result_type))?
    };
    let r = b.convert(r, this_shape.dtype)?;
    // r holds, after the batch dims, this operand's free dims (from g) and its contracting dims
    // (other's contracting dims, sorted by other's index), in an order that depends on g_first.
    let this_free = free_dims(this_shape.rank(), this_batch, this_contract);
    let mut other_c_sorted: Vec<(i64, i64)> = other_contract
        .iter()
        .zip(this_contract)
        .map(|(&o, &t)| (o, t))
        .collect();
    other_c_sorted.sort();
    let (free_base, contract_base) = if g_first {
        (nb, nb + this_free.len() as i64)
    } else {
        (nb + other_c_sorted.len() as i64, nb)
    };
    let mut pos = vec![0i64; this_shape.rank()];
    for (i, &d) in this_batch.iter().enumerate() {
        pos[d as usize] = i as i64;
    }
    for (i, &d) in this_free.iter().enumerate() {
        pos[d as usize] = free_base + i as i64;
    }
    for (i, &(_, t)) in other_c_sorted.iter().enumerate() {
        pos[t as usize] = contract_base + i as i64;
    }
    b.transpose(r, &pos)
}

pub(super) fn dot_vjp(
    b: &mut Builder,
    node: &Node,
    g: Value,
    needs: &[bool],
    dims: &DotDims,
    precision: Option<Precision>,
) -> Result<Vec<Option<Value>>> {
    let (lhs, rhs) = (node.inputs[0], node.inputs[1]);
    let (ls, rs) = (b.shape(lhs).clone(), b.shape(rhs).clone());
    // A product accumulated in a wider type (bf16 x bf16 -> f32) has a wide cotangent: round it
    // to the operands' type once, so both sides of each backward product match, and let the
    // backward products give their results in the wide type too, rounded to the operand's type
    // after (the same arithmetic as a narrow result; the form a backend whose native bf16 GEMM
    // writes f32, such as XLA CPU's, runs directly).
    let result_type = if b.dtype(g).bits() > ls.dtype.bits() {
        b.dtype(g)
    } else {
        ls.dtype
    };
    let g = b.convert(g, ls.dtype)?;
    let nb = dims.lhs_batch.len() as i64;
    let nlf = free_dims(ls.rank(), &dims.lhs_batch, &dims.lhs_contract).len() as i64;
    let nrf = free_dims(rs.rank(), &dims.rhs_batch, &dims.rhs_contract).len() as i64;
    let gl = if needs[0] {
        Some(dot_operand_vjp(
            b,
            g,
            rhs,
            &ls,
            (&dims.lhs_batch, &dims.lhs_contract),
            (&dims.rhs_batch, &dims.rhs_contract),
            (nb + nlf..nb + nlf + nrf).collect(),
            true,
            precision,
            result_type,
        )?)
    } else {
        None
    };
    let gr = if needs[1] {
        Some(dot_operand_vjp(
            b,
            g,
            lhs,
            &rs,
            (&dims.rhs_batch, &dims.rhs_contract),
            (&dims.lhs_batch, &dims.lhs_contract),
            (nb..nb + nlf).collect(),
            false,
            precision,
            result_type,
        )?)
    } else {
        None
    };
    Ok(vec![gl, gr])
}

//! Ops that move elements without computing on them (broadcast, reshape, transpose, slices,
//! concatenate, pad) and their vjp rules.

use super::dims_str;
use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::Shape;

impl Builder {
    /// Place `x`'s dims at positions `dims` of a tensor of `out_dims`, repeating along the rest.
    pub fn broadcast_in_dim(&mut self, x: Value, out_dims: &[i64], dims: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        if dims.len() != s.rank() {
            return err(
                "broadcast_in_dim",
                format!(
                    "{s} has rank {} but {} dims were mapped",
                    s.rank(),
                    dims.len()
                ),
            );
        }
        for (i, &d) in dims.iter().enumerate() {
            if d < 0 || d as usize >= out_dims.len() {
                return err(
                    "broadcast_in_dim",
                    format!(
                        "dim {d} out of range for result dims {}",
                        dims_str(out_dims)
                    ),
                );
            }
            if dims[..i].contains(&d) {
                return err("broadcast_in_dim", format!("dim {d} mapped twice"));
            }
            let (from, to) = (s.dims[i], out_dims[d as usize]);
            if from != 1 && from != to {
                return err(
                    "broadcast_in_dim",
                    format!(
                        "operand dim {i} has size {from} but result dim {d} has size {to} ({s} -> {})",
                        dims_str(out_dims)
                    ),
                );
            }
        }
        if s.dims == out_dims {
            return Ok(x);
        }
        Ok(self.push1(
            Op::BroadcastInDim {
                dims: dims.to_vec(),
            },
            vec![x],
            s.with_dims(out_dims),
        ))
    }

    /// Numpy-style broadcast: `x`'s dims align with the trailing dims of `out_dims`.
    pub fn broadcast_to(&mut self, x: Value, out_dims: &[i64]) -> Result<Value> {
        let r = self.rank(x);
        if r > out_dims.len() {
            return err(
                "broadcast_in_dim",
                format!(
                    "cannot broadcast {} to {}",
                    self.shape(x),
                    dims_str(out_dims)
                ),
            );
        }
        let offset = (out_dims.len() - r) as i64;
        let dims: Vec<i64> = (0..r as i64).map(|i| i + offset).collect();
        self.broadcast_in_dim(x, out_dims, &dims)
    }

    pub fn reshape(&mut self, x: Value, dims: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        let n: i64 = dims.iter().product();
        if n != s.element_count() || dims.iter().any(|&d| d < 0) {
            return err(
                "reshape",
                format!(
                    "cannot reshape {s} ({} elements) to {}",
                    s.element_count(),
                    dims_str(dims)
                ),
            );
        }
        if s.dims == dims {
            return Ok(x);
        }
        Ok(self.push1(Op::Reshape, vec![x], s.with_dims(dims)))
    }

    pub fn transpose(&mut self, x: Value, perm: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        let mut seen = vec![false; s.rank()];
        if perm.len() != s.rank()
            || perm.iter().any(|&p| {
                p < 0 || p as usize >= s.rank() || std::mem::replace(&mut seen[p as usize], true)
            })
        {
            return err(
                "transpose",
                format!("{} is not a permutation of the dims of {s}", dims_str(perm)),
            );
        }
        if perm.iter().enumerate().all(|(i, &p)| i as i64 == p) {
            return Ok(x);
        }
        let dims: Vec<i64> = perm.iter().map(|&p| s.dims[p as usize]).collect();
        Ok(self.push1(
            Op::Transpose {
                perm: perm.to_vec(),
            },
            vec![x],
            s.with_dims(&dims),
        ))
    }

    pub fn slice(
        &mut self,
        x: Value,
        start: &[i64],
        limit: &[i64],
        strides: &[i64],
    ) -> Result<Value> {
        let s = self.shape(x).clone();
        if start.len() != s.rank() || limit.len() != s.rank() || strides.len() != s.rank() {
            return err(
                "slice",
                format!(
                    "start/limit/strides must each have {} entries for {s}",
                    s.rank()
                ),
            );
        }
        let mut out = Vec::new();
        for i in 0..s.rank() {
            if start[i] < 0 || start[i] > limit[i] || limit[i] > s.dims[i] || strides[i] < 1 {
                return err(
                    "slice",
                    format!(
                        "dim {i}: [{}:{}:{}] is outside 0..{} of {s}",
                        start[i], limit[i], strides[i], s.dims[i]
                    ),
                );
            }
            out.push((limit[i] - start[i] + strides[i] - 1) / strides[i]);
        }
        Ok(self.push1(
            Op::Slice {
                start: start.to_vec(),
                limit: limit.to_vec(),
                strides: strides.to_vec(),
            },
            vec![x],
            s.with_dims(&out),
        ))
    }

    /// `x[.., from:to, ..]` along one dim (stride 1).
    pub fn slice_dim(&mut self, x: Value, dim: usize, from: i64, to: i64) -> Result<Value> {
        let d = self.dims(x).to_vec();
        let mut start = vec![0; d.len()];
        let mut limit = d.clone();
        start[dim] = from;
        limit[dim] = to;
        self.slice(x, &start, &limit, &vec![1; d.len()])
    }

    pub fn dynamic_slice(&mut self, x: Value, starts: &[Value], sizes: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        if starts.len() != s.rank() || sizes.len() != s.rank() {
            return err(
                "dynamic_slice",
                format!("{s} needs {} start indices and sizes", s.rank()),
            );
        }
        self.check_index_scalars("dynamic_slice", starts)?;
        for (i, (&size, &dim)) in sizes.iter().zip(&s.dims).enumerate() {
            if size < 0 || size > dim {
                return err(
                    "dynamic_slice",
                    format!("size {size} of dim {i} exceeds {s}"),
                );
            }
        }
        let mut inputs = vec![x];
        inputs.extend_from_slice(starts);
        Ok(self.push1(
            Op::DynamicSlice {
                sizes: sizes.to_vec(),
            },
            inputs,
            s.with_dims(sizes),
        ))
    }

    pub fn dynamic_update_slice(
        &mut self,
        x: Value,
        update: Value,
        starts: &[Value],
    ) -> Result<Value> {
        let (s, u) = (self.shape(x).clone(), self.shape(update).clone());
        if u.rank() != s.rank() || u.dtype != s.dtype || starts.len() != s.rank() {
            return err(
                "dynamic_update_slice",
                format!(
                    "update {u} and {} indices do not fit operand {s}",
                    starts.len()
                ),
            );
        }
        if u.dims.iter().zip(&s.dims).any(|(a, b)| a > b) {
            return err(
                "dynamic_update_slice",
                format!("update {u} is larger than operand {s}"),
            );
        }
        self.check_index_scalars("dynamic_update_slice", starts)?;
        let mut inputs = vec![x, update];
        inputs.extend_from_slice(starts);
        Ok(self.push1(Op::DynamicUpdateSlice, inputs, s))
    }

    fn check_index_scalars(&self, op: &'static str, idx: &[Value]) -> Result<()> {
        let t0 = idx.first().map(|&v| self.shape(v).clone());
        for &v in idx {
            let t = self.shape(v);
            if t.rank() != 0 || !t.dtype.is_int() || Some(t) != t0.as_ref() {
                return err(
                    op,
                    format!("start indices must be integer scalars of one type, got {t}"),
                );
            }
        }
        Ok(())
    }

    pub fn concatenate(&mut self, xs: &[Value], dim: i64) -> Result<Value> {
        let Some(&first) = xs.first() else {
            return err("concatenate", "needs at least one operand");
        };
        let s0 = self.shape(first).clone();
        if dim < 0 || dim as usize >= s0.rank() {
            return err("concatenate", format!("dim {dim} out of range for {s0}"));
        }
        let mut total = 0;
        for &x in xs {
            let s = self.shape(x);
            let same_other = s.rank() == s0.rank()
                && s.dtype == s0.dtype
                && (0..s.rank()).all(|i| i == dim as usize || s.dims[i] == s0.dims[i]);
            if !same_other {
                return err(
                    "concatenate",
                    format!("{s} does not fit with {s0} along dim {dim}"),
                );
            }
            total += s.dims[dim as usize];
        }
        if xs.len() == 1 {
            return Ok(first);
        }
        let mut dims = s0.dims.clone();
        dims[dim as usize] = total;
        Ok(self.push1(Op::Concatenate { dim }, xs.to_vec(), s0.with_dims(&dims)))
    }

    pub fn pad(
        &mut self,
        x: Value,
        value: Value,
        low: &[i64],
        high: &[i64],
        interior: &[i64],
    ) -> Result<Value> {
        let (s, pv) = (self.shape(x).clone(), self.shape(value).clone());
        if pv.rank() != 0 || pv.dtype != s.dtype {
            return err(
                "pad",
                format!("padding value must be a scalar of {s}'s type, got {pv}"),
            );
        }
        if low.len() != s.rank() || high.len() != s.rank() || interior.len() != s.rank() {
            return err(
                "pad",
                format!("low/high/interior must each have {} entries", s.rank()),
            );
        }
        let mut dims = Vec::new();
        for i in 0..s.rank() {
            let d = s.dims[i];
            let inner = if d > 0 { (d - 1) * interior[i] } else { 0 };
            let out = low[i] + high[i] + d + inner;
            if interior[i] < 0 || out < 0 {
                return err("pad", format!("dim {i} of {s} would have size {out}"));
            }
            dims.push(out);
        }
        Ok(self.push1(
            Op::Pad {
                low: low.to_vec(),
                high: high.to_vec(),
                interior: interior.to_vec(),
            },
            vec![x, value],
            s.with_dims(&dims),
        ))
    }
}

/// Sum `g` (shaped like a broadcast's result) back to the operand's shape.
pub(super) fn unbroadcast(
    b: &mut Builder,
    g: Value,
    operand: &Shape,
    dims: &[i64],
) -> Result<Value> {
    let out_rank = b.rank(g) as i64;
    let gd = b.dims(g).to_vec();
    // Result dims the operand did not have, and operand dims of size 1 that were repeated.
    let reduce: Vec<i64> = (0..out_rank)
        .filter(|d| match dims.iter().position(|x| x == d) {
            None => true,
            Some(i) => operand.dims[i] == 1 && gd[*d as usize] != 1,
        })
        .collect();
    let summed = b.reduce_sum(g, &reduce)?;
    // `summed` keeps the other result dims in increasing order; put them in operand order.
    let kept: Vec<i64> = (0..out_rank).filter(|d| !reduce.contains(d)).collect();
    let perm: Vec<i64> = dims
        .iter()
        .filter_map(|d| kept.iter().position(|k| k == d))
        .map(|p| p as i64)
        .collect();
    let t = b.transpose(summed, &perm)?;
    b.reshape(t, &operand.dims)
}

pub(crate) fn slice_vjp(
    b: &mut Builder,
    x: &Shape,
    g: Value,
    start: &[i64],
    strides: &[i64],
) -> Result<Value> {
    let zero = b.scalar(0.0, x.dtype);
    let gd = b.dims(g).to_vec();
    let interior: Vec<i64> = strides.iter().map(|s| s - 1).collect();
    let high: Vec<i64> = (0..x.rank())
        .map(|i| {
            let last = if gd[i] > 0 {
                start[i] + (gd[i] - 1) * strides[i] + 1
            } else {
                start[i]
            };
            x.dims[i] - last
        })
        .collect();
    b.pad(g, zero, start, &high, &interior)
}

pub(super) fn dynamic_update_slice_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    let starts = &node.inputs[2..];
    let gx = if needs[0] {
        let z = b.zeros_like(node.inputs[1]);
        Some(b.dynamic_update_slice(first, z, starts)?)
    } else {
        None
    };
    let gu = if needs[1] {
        let d = b.dims(node.inputs[1]).to_vec();
        Some(b.dynamic_slice(first, starts, &d)?)
    } else {
        None
    };
    let mut out = vec![gx, gu];
    out.extend(starts.iter().map(|_| None));
    Ok(out)
}

pub(super) fn concatenate_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
    dim: &i64,
) -> Result<Vec<Option<Value>>> {
    let mut at = 0;
    let mut out = Vec::new();
    for (i, &x) in node.inputs.iter().enumerate() {
        let n = b.dims(x)[*dim as usize];
        out.push(if needs[i] {
            Some(b.slice_dim(first, *dim as usize, at, at + n)?)
        } else {
            None
        });
        at += n;
    }
    Ok(out)
}

pub(super) fn pad_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
    low: &[i64],
    high: &[i64],
    interior: &[i64],
) -> Result<Vec<Option<Value>>> {
    let s = b.shape(node.inputs[0]).clone();
    let gd = b.dims(first).to_vec();
    let start: Vec<i64> = low.iter().map(|&l| l.max(0)).collect();
    let limit: Vec<i64> = (0..s.rank()).map(|i| gd[i] - high[i].max(0)).collect();
    let strides: Vec<i64> = interior.iter().map(|i| i + 1).collect();
    if low.iter().chain(high).any(|&p| p < 0) {
        return crate::builder::err("pad", "vjp of negative padding is not supported");
    }
    let gx = if needs[0] {
        Some(b.slice(first, &start, &limit, &strides)?)
    } else {
        None
    };
    let gv = if needs[1] {
        let total = b.sum_all(first)?;
        let inner = match gx {
            Some(v) => v,
            None => b.slice(first, &start, &limit, &strides)?,
        };
        let kept = b.sum_all(inner)?;
        Some(b.sub(total, kept)?)
    } else {
        None
    };
    Ok(vec![gx, gv])
}

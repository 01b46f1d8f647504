//! Indexed reads and writes (gather, scatter) and their vjp rules: each is the other's.

use super::dims_str;
use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::Shape;

impl Builder {
    pub fn gather(
        &mut self,
        operand: Value,
        indices: Value,
        dims: GatherDims,
        slice_sizes: &[i64],
    ) -> Result<Value> {
        let (s, idx) = (self.shape(operand).clone(), self.shape(indices).clone());
        if !idx.dtype.is_int() {
            return err("gather", format!("indices must be integers, got {idx}"));
        }
        if slice_sizes.len() != s.rank() {
            return err(
                "gather",
                format!(
                    "slice_sizes {} must have one entry per dim of {s}",
                    dims_str(slice_sizes)
                ),
            );
        }
        if slice_sizes
            .iter()
            .zip(&s.dims)
            .any(|(a, b)| a > b || *a < 0)
        {
            return err(
                "gather",
                format!("slice_sizes {} exceed {s}", dims_str(slice_sizes)),
            );
        }
        let ivd = dims.index_vector_dim as usize;
        let batch: Vec<i64> = idx
            .dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ivd)
            .map(|(_, &d)| d)
            .collect();
        let offsets: Vec<i64> = slice_sizes
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.collapsed_slice_dims.contains(&(*i as i64)))
            .map(|(_, &d)| d)
            .collect();
        if offsets.len() != dims.offset_dims.len() {
            return err(
                "gather",
                format!(
                    "{} offset dims for {} uncollapsed slice dims",
                    dims.offset_dims.len(),
                    offsets.len()
                ),
            );
        }
        let rank = batch.len() + offsets.len();
        let mut out = Vec::with_capacity(rank);
        let (mut bi, mut oi) = (0, 0);
        for i in 0..rank as i64 {
            if dims.offset_dims.contains(&i) {
                out.push(offsets[oi]);
                oi += 1;
            } else {
                out.push(batch[bi]);
                bi += 1;
            }
        }
        Ok(self.push1(
            Op::Gather {
                dims,
                slice_sizes: slice_sizes.to_vec(),
            },
            vec![operand, indices],
            s.with_dims(&out),
        ))
    }

    /// Rows of `table` [N, ...] picked by integer `ids` [...]: result [..ids dims, ...row dims].
    /// The embedding lookup.
    pub fn take_rows(&mut self, table: Value, ids: Value) -> Result<Value> {
        let (t, i) = (self.shape(table).clone(), self.shape(ids).clone());
        if t.rank() == 0 {
            return err("gather", format!("table must have rank >= 1, got {t}"));
        }
        let ir = i.rank() as i64;
        let mut slice = t.dims.clone();
        slice[0] = 1;
        let dims = GatherDims {
            offset_dims: (ir..ir + t.rank() as i64 - 1).collect(),
            collapsed_slice_dims: vec![0],
            start_index_map: vec![0],
            index_vector_dim: ir,
        };
        self.gather(table, ids, dims, &slice)
    }

    pub fn scatter(
        &mut self,
        operand: Value,
        indices: Value,
        updates: Value,
        dims: ScatterDims,
        combiner: Combiner,
    ) -> Result<Value> {
        let (s, idx, u) = (
            self.shape(operand).clone(),
            self.shape(indices).clone(),
            self.shape(updates).clone(),
        );
        if !idx.dtype.is_int() || u.dtype != s.dtype {
            return err(
                "scatter",
                format!("operand {s}, indices {idx}, updates {u}: types do not fit"),
            );
        }
        if combiner != Combiner::Add && combiner != Combiner::Replace {
            return err("scatter", "only add and replace combiners are supported");
        }
        let batch_rank = if dims.index_vector_dim as usize == idx.rank() {
            idx.rank()
        } else {
            idx.rank() - 1
        };
        if u.rank() != batch_rank + dims.update_window_dims.len() {
            return err(
                "scatter",
                format!(
                    "updates {u} do not match {} batch dims and {} window dims",
                    batch_rank,
                    dims.update_window_dims.len()
                ),
            );
        }
        Ok(self.push1(
            Op::Scatter { dims, combiner },
            vec![operand, indices, updates],
            s,
        ))
    }
}

pub(super) fn gather_vjp(
    b: &mut Builder,
    operand: &Shape,
    indices: Value,
    g: Value,
    dims: &GatherDims,
) -> Result<Value> {
    let zeros = b.zeros(operand.clone());
    let sd = ScatterDims {
        update_window_dims: dims.offset_dims.clone(),
        inserted_window_dims: dims.collapsed_slice_dims.clone(),
        scatter_dims_to_operand_dims: dims.start_index_map.clone(),
        index_vector_dim: dims.index_vector_dim,
    };
    b.scatter(zeros, indices, g, sd, Combiner::Add)
}

pub(super) fn scatter_vjp(
    b: &mut Builder,
    node: &Node,
    g: Value,
    needs: &[bool],
    dims: &ScatterDims,
    combiner: Combiner,
) -> Result<Vec<Option<Value>>> {
    let (indices, updates) = (node.inputs[1], node.inputs[2]);
    let operand_shape = b.shape(node.inputs[0]).clone();
    let gop = if needs[0] {
        Some(match combiner {
            Combiner::Add => g,
            _ => {
                let z = b.zeros_like(updates);
                b.scatter(g, indices, z, dims.clone(), Combiner::Replace)?
            }
        })
    } else {
        None
    };
    let gupd = if needs[2] {
        let ud = b.dims(updates).to_vec();
        let mut window = dims.update_window_dims.iter().map(|&d| ud[d as usize]);
        let slice: Vec<i64> = (0..operand_shape.rank() as i64)
            .map(|i| {
                if dims.inserted_window_dims.contains(&i) {
                    1
                } else {
                    window.next().unwrap_or(1)
                }
            })
            .collect();
        let gd = GatherDims {
            offset_dims: dims.update_window_dims.clone(),
            collapsed_slice_dims: dims.inserted_window_dims.clone(),
            start_index_map: dims.scatter_dims_to_operand_dims.clone(),
            index_vector_dim: dims.index_vector_dim,
        };
        Some(b.gather(g, indices, gd, &slice)?)
    } else {
        None
    };
    Ok(vec![gop, None, gupd])
}

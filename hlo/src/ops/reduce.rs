//! Reductions over dims (sum, max) and their vjp rule.

use super::dims_str;
use crate::builder::{err, Builder, Result};
use crate::graph::*;

impl Builder {
    pub fn reduce(&mut self, x: Value, dims: &[i64], combiner: Combiner) -> Result<Value> {
        let s = self.shape(x).clone();
        if combiner == Combiner::Replace {
            return err("reduce", "replace is not a reduction");
        }
        for (i, &d) in dims.iter().enumerate() {
            if d < 0 || d as usize >= s.rank() || dims[..i].contains(&d) {
                return err("reduce", format!("bad dims {} for {s}", dims_str(dims)));
            }
        }
        if dims.is_empty() {
            return Ok(x);
        }
        let init = match combiner {
            Combiner::Add => 0.0,
            Combiner::Max => f64::NEG_INFINITY,
            _ => f64::INFINITY,
        };
        let init = if s.dtype.is_float() {
            self.scalar(init, s.dtype)
        } else {
            let v = match combiner {
                Combiner::Add => 0.0,
                Combiner::Max => i32::MIN as f64,
                _ => i32::MAX as f64,
            };
            self.scalar(v, s.dtype)
        };
        let out: Vec<i64> = s
            .dims
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(&(*i as i64)))
            .map(|(_, &d)| d)
            .collect();
        Ok(self.push1(
            Op::Reduce {
                dims: dims.to_vec(),
                combiner,
            },
            vec![x, init],
            s.with_dims(&out),
        ))
    }

    pub fn reduce_sum(&mut self, x: Value, dims: &[i64]) -> Result<Value> {
        self.reduce(x, dims, Combiner::Add)
    }

    pub fn reduce_max(&mut self, x: Value, dims: &[i64]) -> Result<Value> {
        self.reduce(x, dims, Combiner::Max)
    }

    /// Sum of every element, as a scalar.
    pub fn sum_all(&mut self, x: Value) -> Result<Value> {
        let dims: Vec<i64> = (0..self.rank(x) as i64).collect();
        self.reduce_sum(x, &dims)
    }
}

pub(super) fn reduce_vjp(
    b: &mut Builder,
    node: &Node,
    g: Value,
    dims: &[i64],
    combiner: Combiner,
) -> Result<Option<Value>> {
    let x = node.inputs[0];
    let xs = b.shape(x).clone();
    let kept: Vec<i64> = (0..xs.rank() as i64)
        .filter(|d| !dims.contains(d))
        .collect();
    let gb = b.broadcast_in_dim(g, &xs.dims, &kept)?;
    Ok(Some(match combiner {
        Combiner::Add => gb,
        _ => {
            // The gradient goes to every element equal to the extreme value.
            let out = b.broadcast_in_dim(node.outputs[0], &xs.dims, &kept)?;
            let hit = b.compare(x, out, CmpDir::Eq)?;
            let zero = b.zeros_like(gb);
            b.select(hit, gb, zero)?
        }
    }))
}

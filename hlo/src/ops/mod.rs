//! Op constructors, each checking its operands and inferring its result type: one file per op
//! family, with the vjp rules autodiff uses for its ops beside them (`vjp` below dispatches to
//! them; the few one-line rules are written in its arms).
//!
//! A vjp rule gets the node (with the values it should read: recomputed ones inside a remat
//! region), the cotangent of each output, and which inputs need a gradient. It returns one
//! optional cotangent per input and must not emit work for inputs that need none.

mod control;
mod custom;
mod dot;
mod elementwise;
mod gather;
mod placement;
mod reduce;
mod shape;
mod sources;

pub(crate) use shape::slice_vjp;

use crate::builder::{Builder, Result};
use crate::graph::*;
use dot::dot_vjp;
use elementwise::{binary_vjp, clamp_vjp, select_vjp, unary_vjp};
use gather::{gather_vjp, scatter_vjp};
use reduce::reduce_vjp;
use shape::{concatenate_vjp, dynamic_update_slice_vjp, pad_vjp, unbroadcast};

fn dims_str(d: &[i64]) -> String {
    format!("{d:?}")
}

/// The vjp of one node. See the module docs for the contract.
pub(crate) fn vjp(
    b: &mut Builder,
    node: &Node,
    cts: &[Option<Value>],
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    let none = vec![None; node.inputs.len()];
    let g = |i: usize| cts[i];
    let first = match g(0) {
        Some(v) => v,
        None if matches!(node.op, Op::OptimizationBarrier) => b.zeros_like(node.outputs[0]),
        None => return Ok(none),
    };
    Ok(match &node.op {
        Op::Constant(_) | Op::Iota { .. } | Op::Compare(_) | Op::RngBitGenerator | Op::BitcastConvert | Op::StopGradient | Op::Uninitialized => none,
        Op::UseSaved => vec![Some(first), None],
        Op::CustomVjp(_) => unreachable!("autodiff applies a custom rule itself"),
        Op::Unary(u) => vec![unary_vjp(b, *u, node.inputs[0], node.outputs[0], first)?],
        Op::Binary(op) => binary_vjp(b, *op, (node.inputs[0], node.inputs[1]), node.outputs[0], first, needs)?,
        Op::Select => select_vjp(b, node, first, needs)?,
        Op::Clamp => clamp_vjp(b, node, first, needs)?,
        Op::Convert => {
            let dt = b.dtype(node.inputs[0]);
            vec![if dt.is_float() { Some(b.convert(first, dt)?) } else { None }]
        }
        Op::BroadcastInDim { dims } => {
            let s = b.shape(node.inputs[0]).clone();
            vec![Some(unbroadcast(b, first, &s, dims)?)]
        }
        Op::Reshape => {
            let d = b.dims(node.inputs[0]).to_vec();
            vec![Some(b.reshape(first, &d)?)]
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0i64; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p as usize] = i as i64;
            }
            vec![Some(b.transpose(first, &inv)?)]
        }
        // Slices along one dim do not come here from `vjp`: autodiff gathers their cotangents
        // per operand and concatenates those that tile it (`settle_bands` in autodiff.rs).
        Op::Slice { start, strides, .. } => {
            let s = b.shape(node.inputs[0]).clone();
            vec![Some(slice_vjp(b, &s, first, start, strides)?)]
        }
        Op::DynamicSlice { .. } => {
            let z = b.zeros_like(node.inputs[0]);
            let mut out = vec![Some(b.dynamic_update_slice(z, first, &node.inputs[1..])?)];
            out.extend(node.inputs[1..].iter().map(|_| None));
            out
        }
        Op::DynamicUpdateSlice => dynamic_update_slice_vjp(b, node, first, needs)?,
        Op::Concatenate { dim } => concatenate_vjp(b, node, first, needs, dim)?,
        Op::Pad { low, high, interior } => pad_vjp(b, node, first, needs, low, high, interior)?,
        Op::Gather { dims, .. } => {
            let s = b.shape(node.inputs[0]).clone();
            vec![if needs[0] { Some(gather_vjp(b, &s, node.inputs[1], first, dims)?) } else { None }, None]
        }
        Op::Scatter { dims, combiner } => scatter_vjp(b, node, first, needs, dims, *combiner)?,
        Op::DotGeneral { dims, precision } => dot_vjp(b, node, first, needs, dims, *precision)?,
        Op::Reduce { dims, combiner } => vec![reduce_vjp(b, node, first, dims, *combiner)?, None],
        Op::OptimizationBarrier => (0..node.inputs.len())
            .map(|i| match g(i) {
                Some(v) => Some(v),
                None if needs[i] => Some(b.zeros_like(node.outputs[i])),
                None => None,
            })
            .collect(),
        Op::ShardingConstraint(s) => vec![Some(b.sharding_constraint(first, s.clone())?)],
        // Where a value lives does not change it; its cotangent stays on the device.
        Op::Place(_) => vec![Some(first)],
        Op::While { .. } => {
            return crate::builder::err(
                "while",
                "has no generic vjp rule; differentiate the loop body and build the backward loop (see scan helpers)",
            )
        }
        Op::Composite(_) | Op::ManualComputation(_) | Op::CustomCall(_) => {
            return crate::builder::err(
                node.op.name(),
                "has no generic vjp rule; give the computation one with custom_vjp",
            )
        }
    })
}

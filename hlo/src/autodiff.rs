//! Reverse-mode autodiff as a builder transform.
//!
//! `grad(y, wrt)` walks the nodes that lie on a path from `wrt` to `y` in reverse and applies each
//! op's vjp rule (in `ops/`). Nodes off that path get no gradient work at all, so a frozen
//! weight (not in `wrt`) never gets a gradient computed. Nodes created inside
//! [`Builder::remat`] are recomputed from their region's inputs, passed through an
//! `optimization_barrier` together with the incoming cotangent, so the recomputation happens
//! in the backward pass and is not merged with the forward copy.
//!
//! Cotangents that reach a value through slices along one of its dims are gathered until the
//! value's cotangent is complete: slices that tile it (blocks, halves) then give one
//! concatenation rather than a zero-padded full-size copy per slice summed, which XLA would
//! otherwise recompute inside every consumer.

use crate::builder::{err, Builder, Result};
use crate::graph::{Node, Value};
use std::collections::HashMap;

impl Builder {
    /// Gradient of the scalar `y` with respect to each of `wrt`.
    pub fn grad(&mut self, y: Value, wrt: &[Value]) -> Result<Vec<Value>> {
        let s = self.shape(y).clone();
        if s.rank() != 0 || !s.dtype.is_float() {
            return err(
                "grad",
                format!("needs a float scalar to differentiate, got {s}"),
            );
        }
        let one = self.full_like(y, 1.0);
        self.vjp(&[(y, one)], wrt)
    }

    /// `(y, grads)`: the value itself and its gradient.
    pub fn value_and_grad(&mut self, y: Value, wrt: &[Value]) -> Result<(Value, Vec<Value>)> {
        Ok((y, self.grad(y, wrt)?))
    }

    /// Vector-Jacobian product: given (output, cotangent) seeds, the cotangent of each of `wrt`.
    pub fn vjp(&mut self, seeds: &[(Value, Value)], wrt: &[Value]) -> Result<Vec<Value>> {
        let end = self.f.nodes.len();
        let active_values = self.active_values(seeds, wrt, end);
        let active = |v: Value| active_values[v.index()];

        let mut ct: HashMap<Value, Value> = HashMap::new();
        let mut bands: HashMap<Value, Vec<Band>> = HashMap::new();
        for &(y, g) in seeds {
            if self.shape(y) != self.shape(g) {
                return err(
                    "vjp",
                    format!(
                        "seed cotangent {} does not match output {}",
                        self.shape(g),
                        self.shape(y)
                    ),
                );
            }
            accumulate(self, &mut ct, y, g)?;
        }
        let saved_remat = self.remat.take();
        let saved_scope = std::mem::take(&mut self.scope);
        let mut recomputed: HashMap<u32, HashMap<Value, Value>> = HashMap::new();

        let result = (|| -> Result<()> {
            for idx in (0..end).rev() {
                let node = self.f.nodes[idx].clone();
                if !node.outputs.iter().any(|&o| active(o)) {
                    continue;
                }
                // Bands fold into this node's output cotangents under the node's own name.
                self.scope = vec![match &node.loc {
                    Some(l) => format!("{l}.grad"),
                    None => "grad".to_string(),
                }];
                for &o in &node.outputs {
                    settle_bands(self, &mut ct, &mut bands, o)?;
                }
                let cts: Vec<Option<Value>> =
                    node.outputs.iter().map(|o| ct.get(o).copied()).collect();
                if cts.iter().all(|c| c.is_none()) {
                    continue;
                }
                let needs: Vec<bool> = node.inputs.iter().map(|&i| active(i)).collect();
                if !needs.iter().any(|&n| n) {
                    continue;
                }
                let view = match node.remat {
                    Some(r) => {
                        if let std::collections::hash_map::Entry::Vacant(slot) = recomputed.entry(r)
                        {
                            let tie: Vec<Value> = cts.iter().flatten().copied().collect();
                            slot.insert(self.recompute_region(r, end, &tie));
                        }
                        let map = &recomputed[&r];
                        let m = |v: &Value| *map.get(v).unwrap_or(v);
                        Node {
                            inputs: node.inputs.iter().map(m).collect(),
                            outputs: node.outputs.iter().map(m).collect(),
                            ..node.clone()
                        }
                    }
                    None => node.clone(),
                };
                if let (Some((dim, start)), Some(g)) = (band_of(self, &view), cts[0]) {
                    bands
                        .entry(node.inputs[0])
                        .or_default()
                        .push(Band { dim, start, g });
                    continue;
                }
                let grads = self.node_vjp(&view, &cts, &needs)?;
                for ((&input, g), need) in node.inputs.iter().zip(grads).zip(&needs) {
                    if let (Some(g), true) = (g, *need) {
                        accumulate(self, &mut ct, input, g)?;
                    }
                }
            }
            Ok(())
        })();
        self.remat = saved_remat;
        self.scope = saved_scope;
        result?;
        for &w in wrt {
            settle_bands(self, &mut ct, &mut bands, w)?;
        }
        Ok(wrt
            .iter()
            .map(|w| match ct.get(w) {
                Some(&g) => g,
                None => self.zeros_like(*w),
            })
            .collect())
    }

    /// The cotangents of `node`'s inputs from its outputs' (`cts`): by the op's vjp rule, or for
    /// a [`crate::graph::Op::CustomVjp`] by the rule it was given (nothing for the outputs it
    /// marks, which are its first inputs).
    fn node_vjp(
        &mut self,
        node: &Node,
        cts: &[Option<Value>],
        needs: &[bool],
    ) -> Result<Vec<Option<Value>>> {
        let crate::graph::Op::CustomVjp(id) = node.op else {
            return crate::ops::vjp(self, node, cts, needs);
        };
        let rule = self.vjp_rules[id as usize].clone();
        let n = node.outputs.len();
        let (outs, ins) = node.inputs.split_at(n);
        let mut grads = vec![None; n];
        grads.extend(rule(self, ins, outs, cts)?);
        Ok(grads)
    }

    /// The values a vjp must carry cotangents through: those that depend on some `wrt` (through
    /// float values only) and that some seed depends on, among the first `end` nodes' values.
    fn active_values(&self, seeds: &[(Value, Value)], wrt: &[Value], end: usize) -> Vec<bool> {
        let n_values = self.f.shapes.len();
        let float = |b: &Builder, v: Value| b.dtype(v).is_float();

        // Values that depend on some `wrt` (through float values only) ...
        let mut depends = vec![false; n_values];
        for &w in wrt {
            depends[w.index()] = true;
        }
        for node in &self.f.nodes[..end] {
            if node.inputs.iter().any(|v| depends[v.index()]) {
                for &o in &node.outputs {
                    depends[o.index()] = float(self, o);
                }
            }
        }
        // ... and that some seed depends on.
        let mut reaches = vec![false; n_values];
        for (y, _) in seeds {
            reaches[y.index()] = true;
        }
        for node in self.f.nodes[..end].iter().rev() {
            if node.outputs.iter().any(|v| reaches[v.index()]) {
                for &i in &node.inputs {
                    reaches[i.index()] = true;
                }
            }
        }
        depends
            .iter()
            .zip(&reaches)
            .map(|(d, r)| *d && *r)
            .collect()
    }

    /// Emit a copy of remat region `r` (nodes before `end`) reading its inputs through an
    /// optimization barrier that also holds `tie`. Returns original value -> recomputed value.
    fn recompute_region(&mut self, r: u32, end: usize, tie: &[Value]) -> HashMap<Value, Value> {
        let members: Vec<usize> = (0..end)
            .filter(|&i| self.f.nodes[i].remat == Some(r))
            .collect();
        let mut inside = std::collections::HashSet::new();
        for &i in &members {
            inside.extend(self.f.nodes[i].outputs.iter().copied());
        }
        let mut externals: Vec<Value> = Vec::new();
        for &i in &members {
            for &v in &self.f.nodes[i].inputs {
                if !inside.contains(&v) && !externals.contains(&v) {
                    externals.push(v);
                }
            }
        }
        let mut barrier_in = externals.clone();
        barrier_in.extend_from_slice(tie);
        let barrier_out = self.optimization_barrier(&barrier_in);
        let mut map: HashMap<Value, Value> = externals.iter().copied().zip(barrier_out).collect();
        for &i in &members {
            let node = self.f.nodes[i].clone();
            if matches!(
                node.op,
                crate::graph::Op::Constant(_) | crate::graph::Op::Iota { .. }
            ) {
                continue; // constants are free to rematerialise; XLA folds them
            }
            let inputs = node
                .inputs
                .iter()
                .map(|v| *map.get(v).unwrap_or(v))
                .collect();
            let outs = self.push_copy(&node, inputs);
            map.extend(node.outputs.iter().copied().zip(outs));
        }
        map
    }
}

fn accumulate(b: &mut Builder, ct: &mut HashMap<Value, Value>, v: Value, g: Value) -> Result<()> {
    let total = match ct.get(&v) {
        Some(&prev) => b.add(prev, g)?,
        None => g,
    };
    ct.insert(v, total);
    Ok(())
}

/// The cotangent of a stride-1 slice that cuts `x` along one dim only: rows `start..` of `dim`.
/// These are kept apart until `x`'s cotangent is complete, because pieces that tile `x` (query
/// blocks, the halves of RoPE) are then one concatenation instead of a zero-padded copy of `x`
/// per piece summed together.
struct Band {
    dim: usize,
    start: i64,
    g: Value,
}

/// `(dim, start)` when `node` is a stride-1 slice that cuts its operand along one dim only.
fn band_of(b: &Builder, node: &Node) -> Option<(usize, i64)> {
    let crate::graph::Op::Slice {
        start,
        limit,
        strides,
    } = &node.op
    else {
        return None;
    };
    let x = b.dims(node.inputs[0]);
    if strides.iter().any(|&s| s != 1) {
        return None;
    }
    let cut: Vec<usize> = (0..x.len())
        .filter(|&i| start[i] != 0 || limit[i] != x[i])
        .collect();
    match cut[..] {
        [dim] => Some((dim, start[dim])),
        _ => None,
    }
}

/// Fold the bands recorded for `x` into its cotangent: bands along one dim that do not overlap
/// become one concatenation (zeros in the gaps); otherwise each is padded to `x`'s shape and
/// added, as the slice's vjp rule does.
fn settle_bands(
    b: &mut Builder,
    ct: &mut HashMap<Value, Value>,
    bands: &mut HashMap<Value, Vec<Band>>,
    x: Value,
) -> Result<()> {
    let Some(mut pieces) = bands.remove(&x) else {
        return Ok(());
    };
    pieces.sort_by_key(|p| p.start);
    let dim = pieces[0].dim;
    let len = |b: &Builder, p: &Band| b.dims(p.g)[p.dim];
    let disjoint = pieces.iter().all(|p| p.dim == dim)
        && pieces
            .windows(2)
            .all(|w| w[0].start + len(b, &w[0]) <= w[1].start);
    let shape = b.shape(x).clone();
    if pieces.len() > 1 && disjoint {
        let mut parts = Vec::new();
        let mut at = 0;
        let gap = |b: &mut Builder, n: i64| {
            let mut d = shape.dims.clone();
            d[dim] = n;
            b.zeros(shape.with_dims(&d))
        };
        for p in &pieces {
            if p.start > at {
                parts.push(gap(b, p.start - at));
            }
            parts.push(p.g);
            at = p.start + len(b, p);
        }
        if at < shape.dims[dim] {
            parts.push(gap(b, shape.dims[dim] - at));
        }
        let whole = b.concatenate(&parts, dim as i64)?;
        return accumulate(b, ct, x, whole);
    }
    for p in pieces {
        let mut start = vec![0; shape.rank()];
        start[p.dim] = p.start;
        let padded = crate::ops::slice_vjp(b, &shape, p.g, &start, &vec![1; shape.rank()])?;
        accumulate(b, ct, x, padded)?;
    }
    Ok(())
}

//! Ops whose operands flow into a function of their own: composites (a named op and its
//! decomposition) and manual computations (a body written per device).

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::Shape;

impl Builder {
    /// `stablehlo.composite "name"`: `body` builds the decomposition from parameters shaped
    /// like `inputs` (named by them, for reading) and returns its results. A compiler inlines
    /// the decomposition; a target with its own implementation of `name` at `version` may put
    /// that in its place. The decomposition is built in a builder of its own that loops as
    /// this one does (rolled loops priced alike) but never unrolls.
    pub fn composite(
        &mut self,
        (name, version): (&str, i32),
        attributes: Vec<(String, Attr)>,
        inputs: &[(&str, Value)],
        body: impl FnOnce(&mut Builder, &[Value]) -> Result<Vec<Value>>,
    ) -> Result<Vec<Value>> {
        let mut bb = Builder::new(&format!("{name}.impl"));
        bb.scope = vec![name.to_string()];
        bb.trips_per_rolled_body = self.trips_per_rolled_body;
        let params: Vec<Value> = inputs
            .iter()
            .map(|(n, v)| bb.param(n, self.shape(*v).clone()))
            .collect();
        let outs = body(&mut bb, &params)?;
        if outs.is_empty() {
            return err(
                "composite",
                format!("{name}: the decomposition returns nothing"),
            );
        }
        let shapes: Vec<Shape> = outs.iter().map(|&v| bb.shape(v).clone()).collect();
        let named: Vec<(String, Value)> = outs
            .iter()
            .enumerate()
            .map(|(k, &v)| (format!("out{k}"), v))
            .collect();
        let refs: Vec<(&str, Value)> = named.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        let decomposition = bb.finish(&refs);
        let op = Op::Composite(Box::new(Composite {
            name: name.to_string(),
            version,
            attributes,
            decomposition,
        }));
        let ins = inputs.iter().map(|(_, v)| *v).collect();
        Ok(self.push(op, ins, shapes))
    }

    /// `sdy.manual_computation` over every axis of `mesh`: `body` gets each device's shard of
    /// the operands (cut as their shardings say) and returns each device's shard of the
    /// results, which `out_shardings` put together. Every dim a sharding splits must divide by
    /// its axes.
    pub fn manual_computation(
        &mut self,
        mesh: &Mesh,
        inputs: &[(Value, Sharding)],
        out_shardings: &[Sharding],
        body: impl FnOnce(&mut Builder, &[Value]) -> Result<Vec<Value>>,
    ) -> Result<Vec<Value>> {
        let split = |s: &Sharding, k: usize| -> i64 {
            s.dims[k]
                .iter()
                .map(|a| mesh.axis_size(a).unwrap_or(1))
                .product()
        };
        let mut bb = Builder::new("manual");
        bb.scope = self.scope.clone();
        bb.trips_per_rolled_body = self.trips_per_rolled_body;
        bb.unroll_loops = self.unroll_loops;
        let mut params = Vec::new();
        for (i, (v, s)) in inputs.iter().enumerate() {
            let global = self.shape(*v).clone();
            check_sharding(mesh, s, &global, &format!("operand {i}"))?;
            let dims: Vec<i64> = (0..global.rank())
                .map(|k| global.dims[k] / split(s, k))
                .collect();
            params.push(bb.param(&format!("local{i}"), Shape::new(&dims, global.dtype)));
        }
        let outs = body(&mut bb, &params)?;
        if outs.len() != out_shardings.len() {
            return err(
                "manual_computation",
                format!(
                    "the body returns {} values for {} out-shardings",
                    outs.len(),
                    out_shardings.len()
                ),
            );
        }
        let mut shapes = Vec::new();
        for (i, (&o, s)) in outs.iter().zip(out_shardings).enumerate() {
            let local = bb.shape(o).clone();
            if s.dims.len() != local.rank() {
                return err(
                    "manual_computation",
                    format!("result {i}: sharding of {} dims for {local}", s.dims.len()),
                );
            }
            let dims: Vec<i64> = (0..local.rank())
                .map(|k| local.dims[k] * split(s, k))
                .collect();
            shapes.push(Shape::new(&dims, local.dtype));
        }
        let named: Vec<(String, Value)> = outs
            .iter()
            .enumerate()
            .map(|(k, &v)| (format!("out{k}"), v))
            .collect();
        let refs: Vec<(&str, Value)> = named.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        let body = bb.finish(&refs);
        let op = Op::ManualComputation(Box::new(ManualComputation {
            in_shardings: inputs.iter().map(|(_, s)| s.clone()).collect(),
            out_shardings: out_shardings.to_vec(),
            manual_axes: mesh.axes.iter().map(|(n, _)| n.clone()).collect(),
            body,
        }));
        let ins = inputs.iter().map(|(v, _)| *v).collect();
        Ok(self.push(op, ins, shapes))
    }
}

fn check_sharding(mesh: &Mesh, s: &Sharding, shape: &Shape, what: &str) -> Result<()> {
    if s.dims.len() != shape.rank() {
        return err(
            "manual_computation",
            format!("{what}: sharding of {} dims for {shape}", s.dims.len()),
        );
    }
    for (k, axes) in s.dims.iter().enumerate() {
        let mut n = 1;
        for a in axes {
            let Some(size) = mesh.axis_size(a) else {
                return err(
                    "manual_computation",
                    format!("{what}: dim {k} is split over \"{a}\", which the mesh lacks"),
                );
            };
            n *= size;
        }
        if shape.dims[k] % n != 0 {
            return err(
                "manual_computation",
                format!("{what}: dim {k} of {shape} does not divide over {n} devices ({axes:?})"),
            );
        }
    }
    Ok(())
}

//! Control flow: `while` and the counted loops built on it, and the optimization barrier that
//! keeps computations apart. A loop has no generic vjp rule (see `vjp` in mod.rs).

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::{DType, Shape};

impl Builder {
    /// `while cond(state) { state = body(state) }`. `cond` and `body` are functions whose
    /// parameters have the types of `init`; cond returns `tensor<i1>`, body the new state.
    pub fn while_loop(&mut self, cond: Func, body: Func, init: &[Value]) -> Result<Vec<Value>> {
        let types: Vec<Shape> = init.iter().map(|&v| self.shape(v).clone()).collect();
        let check_params = |f: &Func, what: &str| -> Result<()> {
            let got: Vec<&Shape> = f.params.iter().map(|p| f.shape(p.value)).collect();
            if got.len() != types.len() || got.iter().zip(&types).any(|(a, b)| *a != b) {
                return err(
                    "while",
                    format!("{what} parameters {got:?} do not match the loop state {types:?}"),
                );
            }
            Ok(())
        };
        check_params(&cond, "cond")?;
        check_params(&body, "body")?;
        if cond.results.len() != 1
            || *cond.shape(cond.results[0].value) != Shape::scalar(DType::Pred)
        {
            return err("while", "cond must return one tensor<i1>");
        }
        let outs: Vec<&Shape> = body.results.iter().map(|r| body.shape(r.value)).collect();
        if outs.len() != types.len() || outs.iter().zip(&types).any(|(a, b)| *a != b) {
            return err(
                "while",
                format!("body results {outs:?} do not match the loop state {types:?}"),
            );
        }
        Ok(self.push(
            Op::While {
                cond: Box::new(cond),
                body: Box::new(body),
            },
            init.to_vec(),
            types,
        ))
    }

    /// `for i in 0..n { carry = body(i, carry, invariants) }` as a `stablehlo.while`. The body
    /// gets its own builder (regions are self-contained), the loop index (s32 scalar), the carry
    /// and the invariants; it returns the new carry (same types). Returns the final carry.
    /// With [`Builder::unroll_loops`] the body is emitted inline once per iteration instead.
    pub fn fori_loop(
        &mut self,
        n: i64,
        init: &[Value],
        invariants: &[Value],
        mut body: impl FnMut(&mut Builder, Value, &[Value], &[Value]) -> Result<Vec<Value>>,
    ) -> Result<Vec<Value>> {
        if self.unroll_loops {
            let nc = init.len();
            let mut carry = init.to_vec();
            for k in 0..n {
                let state: Vec<Value> = carry.iter().chain(invariants).copied().collect();
                let state = self.optimization_barrier(&state);
                let i = self.scalar(k as f64, DType::S32);
                carry = body(self, i, &state[..nc], &state[nc..])?;
                check_carry(&carry, nc)?;
            }
            return Ok(carry);
        }
        let counter = Shape::scalar(DType::S32);
        let state_types: Vec<Shape> = std::iter::once(counter.clone())
            .chain(
                init.iter()
                    .chain(invariants)
                    .map(|&v| self.shape(v).clone()),
            )
            .collect();
        let nc = init.len();

        let mut cb = Builder::new("cond");
        let params: Vec<Value> = state_types
            .iter()
            .enumerate()
            .map(|(k, s)| cb.param(&format!("s{k}"), s.clone()))
            .collect();
        let limit = cb.scalar(n as f64, DType::S32);
        let go = cb.compare(params[0], limit, CmpDir::Lt)?;
        let cond = cb.finish(&[("go", go)]);

        let mut bb = Builder::new("body");
        bb.scope = self.scope.clone();
        // A rolled loop nested in this one is priced as the outer ones are.
        bb.trips_per_rolled_body = self.trips_per_rolled_body;
        let params: Vec<Value> = state_types
            .iter()
            .enumerate()
            .map(|(k, s)| bb.param(&format!("s{k}"), s.clone()))
            .collect();
        let (i, carry, inv) = (params[0], &params[1..1 + nc], &params[1 + nc..]);
        let new_carry = body(&mut bb, i, carry, inv)?;
        check_carry(&new_carry, nc)?;
        let one = bb.scalar(1.0, DType::S32);
        let next = bb.add(i, one)?;
        let mut results = vec![("i".to_string(), next)];
        results.extend(
            new_carry
                .iter()
                .enumerate()
                .map(|(k, &v)| (format!("c{k}"), v)),
        );
        results.extend(inv.iter().enumerate().map(|(k, &v)| (format!("k{k}"), v)));
        let refs: Vec<(&str, Value)> = results.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        let body = bb.finish(&refs);

        let zero = self.scalar(0.0, DType::S32);
        let mut state = vec![zero];
        state.extend_from_slice(init);
        state.extend_from_slice(invariants);
        let out = self.while_loop(cond, body, &state)?;
        Ok(out[1..1 + nc].to_vec())
    }

    /// [`Builder::fori_loop`] as a `stablehlo.while` even where loops are unrolled: for loops
    /// inside a layer whose trip count grows with the sequence (attention's block pairs), which
    /// unrolled would make the program grow with it too.
    pub fn rolled_fori_loop(
        &mut self,
        n: i64,
        init: &[Value],
        invariants: &[Value],
        mut body: impl FnMut(&mut Builder, Value, &[Value], &[Value]) -> Result<Vec<Value>>,
    ) -> Result<Vec<Value>> {
        let unroll = std::mem::replace(&mut self.unroll_loops, false);
        let trips = self.trips_per_rolled_body;
        let out = if trips > 1 && n >= trips {
            // Pricing only (`price_rolled_loops`): `trips` trips per body.
            self.fori_loop(n / trips, init, invariants, |bb, i, carry, inv| {
                let k = bb.scalar(trips as f64, DType::S32);
                let first = bb.mul(i, k)?;
                let mut carry = carry.to_vec();
                for t in 0..trips {
                    let offset = bb.scalar(t as f64, DType::S32);
                    let at = bb.add(first, offset)?;
                    carry = body(bb, at, &carry, inv)?;
                }
                Ok(carry)
            })
        } else {
            self.fori_loop(n, init, invariants, body)
        };
        self.unroll_loops = unroll;
        out
    }

    /// Values that XLA may not move computations across (used to keep recomputation apart).
    pub fn optimization_barrier(&mut self, xs: &[Value]) -> Vec<Value> {
        if xs.is_empty() {
            return Vec::new();
        }
        let types = xs.iter().map(|&v| self.shape(v).clone()).collect();
        self.push(Op::OptimizationBarrier, xs.to_vec(), types)
    }
}

/// A loop body must give back as many values as the carry it was given.
fn check_carry(carry: &[Value], nc: usize) -> Result<()> {
    if carry.len() != nc {
        return err(
            "while",
            format!(
                "loop body returned {} values for a carry of {nc}",
                carry.len()
            ),
        );
    }
    Ok(())
}

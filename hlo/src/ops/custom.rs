//! Calls into a compiler's own library (`stablehlo.custom_call`): a kernel that one target
//! implements, e.g. cuDNN's fused attention on NVIDIA GPUs. Only a target's kernel (put in a
//! composite's place just before that target compiles, `xtrain::device::kernels`) emits one:
//! the one program every target shares never holds one. No gradient: the composite it stands
//! in for has a rule of its own.

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::Shape;

impl Builder {
    /// `stablehlo.custom_call @target(operands)` with `backend_config` (a string the target
    /// reads, e.g. JSON) and the layouts the call expects of each operand and result (minor to
    /// major dims; each a permutation of its shape's dims). Returns one value per result.
    pub fn custom_call(
        &mut self,
        target: &str,
        backend_config: &str,
        operands: &[(Value, Vec<i64>)],
        results: &[(Shape, Vec<i64>)],
    ) -> Result<Vec<Value>> {
        if target.is_empty() || target.contains(|c: char| c == '"' || c.is_whitespace()) {
            return err(
                "custom_call",
                format!("target {target:?} is not a symbol name"),
            );
        }
        if results.is_empty() {
            return err("custom_call", format!("@{target} returns nothing"));
        }
        let is_permutation = |layout: &[i64], rank: usize| {
            let mut seen = vec![false; rank];
            layout.len() == rank
                && layout.iter().all(|&d| {
                    let ok = d >= 0 && (d as usize) < rank && !seen[d as usize];
                    if ok {
                        seen[d as usize] = true;
                    }
                    ok
                })
        };
        for (k, (v, layout)) in operands.iter().enumerate() {
            let s = self.shape(*v);
            if !is_permutation(layout, s.rank()) {
                return err(
                    "custom_call",
                    format!("@{target}: operand {k} is {s}, its layout {layout:?} is not a permutation of its dims"),
                );
            }
        }
        for (k, (s, layout)) in results.iter().enumerate() {
            if !is_permutation(layout, s.rank()) {
                return err(
                    "custom_call",
                    format!("@{target}: result {k} is {s}, its layout {layout:?} is not a permutation of its dims"),
                );
            }
        }
        let op = Op::CustomCall(Box::new(CustomCall {
            target: target.to_string(),
            backend_config: backend_config.to_string(),
            operand_layouts: operands.iter().map(|(_, l)| l.clone()).collect(),
            result_layouts: results.iter().map(|(_, l)| l.clone()).collect(),
        }));
        let ins = operands.iter().map(|(v, _)| *v).collect();
        Ok(self.push(op, ins, results.iter().map(|(s, _)| s.clone()).collect()))
    }
}

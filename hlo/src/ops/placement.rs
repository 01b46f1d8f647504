//! Where a value lives: its memory (device or host) and its sharding over the mesh. Neither
//! changes the value, so the vjp rules (in `vjp`) pass the cotangent through.

use crate::builder::{err, Builder, Result};
use crate::graph::*;

impl Builder {
    /// `x`, placed in `memory` from here on: in host memory (offloaded) or back in the device's.
    /// XLA moves the bytes (asynchronously where it can) and keeps a loop-carried stack that is
    /// written with host-placed values in host memory.
    pub fn place(&mut self, x: Value, memory: MemoryKind) -> Value {
        let s = self.shape(x).clone();
        self.push1(Op::Place(memory), vec![x], s)
    }

    /// Ask the partitioner to lay `x` out as `sharding` here.
    pub fn sharding_constraint(&mut self, x: Value, sharding: Sharding) -> Result<Value> {
        let s = self.shape(x).clone();
        if sharding.dims.len() != s.rank() {
            return err(
                "sharding_constraint",
                format!(
                    "sharding has {} dims but {s} has {}",
                    sharding.dims.len(),
                    s.rank()
                ),
            );
        }
        Ok(self.push1(Op::ShardingConstraint(sharding), vec![x], s))
    }
}

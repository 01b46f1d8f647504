//! The training step and its sibling programs as StableHLO.

pub mod sharding;
pub mod step;

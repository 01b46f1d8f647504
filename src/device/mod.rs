//! Programs on a PJRT plugin's devices.

pub mod cache;
pub mod generate;
pub mod platform;
pub mod runtime;
pub mod shards;
pub mod trainer;

//! Programs on a PJRT plugin's devices.

pub mod generate;
pub mod runtime;
pub mod trainer;

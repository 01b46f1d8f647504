//! xtrain: the Llama 3.1 LoRA training step compiled as one StableHLO program and run on any
//! PJRT plugin. See README.md for the tour; `hlo` builds graphs, `pjrt` runs them.

pub mod data;
pub mod device;
pub mod formats;
pub mod model;
pub mod program;
pub mod train;

//! xtrain: the Llama 3.1 LoRA training step compiled as one StableHLO program and run on any
//! PJRT plugin. See README.md for the tour; `hlo` builds graphs, `pjrt` runs them.

pub mod assets;
pub mod bench;
pub mod config;
pub mod data;
pub mod fsutil;
pub mod generate;
pub mod gguf;
pub mod lora;
pub mod merge;
pub mod model;
pub mod optim;
pub mod peft;
pub mod plot;
pub mod program;
pub mod quant;
pub mod runtime;
pub mod safetensors;
pub mod sharding;
pub mod step;
pub mod text;
pub mod train;
pub mod weights;

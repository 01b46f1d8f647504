//! The model being fine-tuned.

pub mod config;
pub mod llama;
pub mod lora;
pub mod loss;
pub mod optim;
pub mod presets;
pub mod quant;
pub mod tensors;

//! The model being fine-tuned.

pub mod config;
pub mod llama;
pub mod lora;
pub mod optim;
pub mod quant;

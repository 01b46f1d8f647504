//! The model being fine-tuned, as equations and names: the Llama 3.1 configuration (a checkpoint's
//! `config.json` or a built-in preset), the names and shapes of its tensors and of a LoRA
//! adapter's (per layer, or stacked over layers), the forward pass and the loss as `hlo` graphs,
//! LoRA's definition, NF4 quantization and AdamW. It knows nothing of a program's argument order,
//! files of weights or devices: it may use `hlo` only, and everything else in the crate builds
//! on it.

pub mod attention;
pub mod config;
pub mod context;
pub mod dropout;
pub mod flash;
pub mod forward;
pub mod llama;
pub mod lora;
pub mod loss;
pub mod mlp_tiles;
pub mod optim;
pub mod preference;
pub mod presets;
pub mod quant;
mod rope;
pub mod tensors;

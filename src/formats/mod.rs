//! What xtrain reads and writes on disk, and host tensors in the forms those files and the
//! programs want: safetensors, Hugging Face checkpoints (frozen weights loaded in a program's
//! layout, NF4-quantized when asked), PEFT adapters, GGUF import (K-quants included) and export
//! (merged, or the adapter alone), merged checkpoints, program
//! directories (`train_step.mlir` + `manifest.json`), models by Hugging Face repo id in the hub
//! cache, and every write atomic (a temp file or directory renamed into place). It may use `program` (for the manifest's spec and signature)
//! and `model`; it knows nothing of devices or training.

pub mod adapter_base;
pub mod atomic;
pub mod gguf;
pub mod host;
pub mod hub;
pub mod merge;
pub mod outdir;
pub mod peft;
pub mod program_dir;
pub mod safetensors;
pub mod sharding_rules;
pub mod shell;
pub mod weights;

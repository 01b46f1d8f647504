//! Files xtrain reads and writes.

pub mod assets;
pub mod atomic;
pub mod gguf;
pub mod host;
pub mod merge;
pub mod peft;
pub mod program_dir;
pub mod safetensors;
pub mod weights;

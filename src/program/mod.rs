//! The programs, as StableHLO text: the whole training step as one function (forward, backward
//! through the LoRA parameters only, AdamW, with the LoRA parameters and moments donated and
//! returned updated, plus the loss and the gradient norm), and its siblings for gradients,
//! forward, evaluation and the next token. It owns what a program is built for ([`StepSpec`]),
//! its signature ([`Program`]), the argument layout, the sharding rules and the builders. It may
//! use `model` and `hlo`; it never reads files, touches a device or asks which plugin or target
//! the program is for, so the text is the same for every backend.
//!
//! Argument order (each named in the program and in the manifest):
//! frozen weights (HF names) | LoRA A/B (PEFT names) | exp_avg.* | exp_avg_sq.* | step | lr |
//! input_ids | labels | attention_mask | [dropout_key]
//!
//! Layers are either unrolled (`--remat none`: XLA keeps every intermediate) or looped
//! (`stablehlo.while` over weights stacked along a leading layer axis, named `layers.*`): the
//! forward loop keeps each layer's input (and, with `save-proj`, the frozen projections'
//! outputs); the backward loop recomputes each layer from them and applies its vjp. Program size
//! does not grow with depth.

mod build;
mod builder;
mod dpo;
pub mod flops;
mod form;
mod forward;
mod layout;
mod passes;
pub mod sharding;
mod signature;
mod spec;
pub mod spelling;

pub use build::{
    build_eval, build_forward, build_grad_program, build_next_token, build_train_step,
    build_train_step_priced, build_train_step_unrolled,
};
pub use dpo::build_sequence_logps;
pub use signature::{Program, Role, TensorSpec};
pub use spec::{
    default_choice, fit_choices, parse_dtype, AttentionBlockUnused, KeyBlocks, MeshPlan, Method,
    MlpChunks, Offload, Preference, Quant, Reference, Remat, ResultType, StepOptions, StepSpec,
    DEFAULT_ATTENTION_SCORES, DEFAULT_KEY_BLOCK, DEFAULT_MATMUL_RESULT, DEFAULT_MLP_CHUNK,
    KEY_BLOCKS_ABOVE, MLP_CHUNKS_ABOVE,
};

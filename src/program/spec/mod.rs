//! What a program is built for. A step's settings take three forms on their way from the command
//! line to the program, each for a reason:
//!
//! - `StepArgs` (the binary's `cli/args.rs`): the flags as clap parses them, shared by `train`,
//!   `compile` and `bench`, every value already typed (`--remat` is a policy or `auto`,
//!   `--dtype` an element type). It exists so that the library never sees clap; `options()`
//!   makes it a `StepOptions`, checking what needs several flags (the mesh against its sharding
//!   rules, LoRA, AdamW).
//! - [`StepOptions`]: the step as the user asked for it, before the model, the batch shape and
//!   the device are known: `--remat auto` and `--offload auto` are still open (None). It exists
//!   because a run learns its batch shape from its data and its remat and offload from the
//!   device only after its options are settled: it is what `train::options::TrainOptions`
//!   holds, what the settings a checkpoint or a program dir recorded are applied to, by flag
//!   (`train::settings`), and what [`fit_choices`] expands into the choices tried.
//! - [`StepSpec`]: everything the program is built for, complete and checked (`check_spec`):
//!   the model's config, the batch shape, one remat policy and one offload. The builders take
//!   only this, and the manifest records it, so that a program dir says exactly what its text
//!   is.
//!
//! [`StepOptions::spec`] is the one way from options to a spec.

mod attention;
mod check;
mod memory;
mod mlp;
mod numerics;
mod options;
mod preference;
mod step;

pub use attention::{AttentionBlockUnused, KeyBlocks, DEFAULT_KEY_BLOCK, KEY_BLOCKS_ABOVE};
pub(super) use check::check_spec;
pub use memory::{default_choice, fit_choices, Offload, Remat};
pub use mlp::{MlpChunks, DEFAULT_MLP_CHUNK, MLP_CHUNKS_ABOVE};
pub(super) use numerics::{de_dtype, ser_dtype};
pub use numerics::{
    parse_dtype, Quant, ResultType, DEFAULT_ATTENTION_SCORES, DEFAULT_MATMUL_RESULT,
};
pub use options::StepOptions;
pub use preference::{Method, Preference, Reference};
pub use step::{MeshPlan, StepSpec};

#[cfg(test)]
mod tests;

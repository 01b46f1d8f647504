//! Programs on a PJRT plugin's devices: opening a plugin (and what differs per platform),
//! compiling through the executable cache, host tensors to and from each device's shard, and the
//! two stateful users of compiled programs: the [`trainer::Trainer`] (a training step with its
//! weights and state on the devices, and evaluation on them) and [`generate::Forward`] (forward
//! and next-token programs, and decoding with them). It may use `program`, `formats`, `data`
//! and `model`. Plugins, clients and buffers are reached only from here: elsewhere `pjrt` gives
//! just its host tensor type (and xtrain's cache directory). Hardware that is not here is a
//! [`target::Target`] (`tpu:v5p:2x2x1`, `cuda:h100:8`), compiled for by [`aot`] with no client.

pub mod aot;
pub mod cache;
pub mod fit;
pub mod generate;
pub mod offload;
pub mod platform;
pub mod runtime;
pub mod shards;
pub mod target;
pub mod trainer;

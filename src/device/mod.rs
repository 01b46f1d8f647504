//! Programs on a PJRT plugin's devices, in four parts:
//!
//! - the live runtime, in this folder: opening a plugin ([`runtime`], and what differs per
//!   [`platform`]), compiling through the executable [`cache`], host tensors to and from each
//!   device's [`shards`], and the two stateful users of compiled programs: the
//!   [`trainer::Trainer`] (a training step with its weights and state on the devices, and
//!   evaluation on them) and [`generate::Forward`] (forward and next-token programs, and
//!   decoding with them);
//! - hardware that is not here ([`absent`]): a [`absent::Target`] (`tpu:v5p:2x2x1`,
//!   `cuda:h100:8`), the built-in descriptions of known hardware, and compiling for it with no
//!   client ([`absent::aot`]);
//! - memory policy ([`memory`]): whether a step fits a device, what would make it fit, and the
//!   remat and offload choices tried until one does;
//! - what a compiled step launches per run ([`launches`], read from its optimized HLO), and
//!   this machine's CPU plugin's matmul rate and cost per operation ([`peak`]), for
//!   `xtrain plan`'s time model;
//! - where a step lies across hosts ([`hosts`]): the run's mode (one host, `--virtual-hosts`,
//!   one process of several), which process holds which mesh position, and each host's share
//!   of a batch (the transport between the processes is `crate::cluster`).
//!
//! It may use `cluster`, `program`, `formats`, `data` and `model`. Plugins, clients and buffers are reached
//! only from here: elsewhere `pjrt` gives just its host tensor type (and xtrain's cache
//! directory).

pub mod absent;
pub mod cache;
pub mod dumps;
pub mod frozen;
pub mod generate;
pub mod hosts;
pub mod kernels;
pub mod launches;
pub mod memory;
pub mod peak;
pub mod platform;
pub mod plugins;
pub mod preference;
pub mod runtime;
pub mod shards;
pub mod trainer;

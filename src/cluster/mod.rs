//! The transport of a run of several processes, one per host, and nothing of the devices:
//! where this process stands in the run ([`launch`]: flags, or SLURM, torchrun, TPU VM and GKE
//! environments; [`address`]es), the run's key-value store (served by process 0 over TCP,
//! [`server`]; reached by every process, [`store`]; what they say, [`wire`]; the GPU plugins
//! exchange their ids through it), the [`rendezvous`] at the start, where every process checks
//! that the others run the same settings, and the shards process 0 [`gather`]s to write them.
//! Only the run's processes get in: each connection opens with a handshake keyed by the run's
//! secret ([`auth`], [`handshake`]), every byte after it is sealed ([`channel`]), and each
//! process writes only its own [`keys`], within its share. [`locks`] is the one policy on a
//! poisoned lock.
//!
//! It may use `data`, `formats`, `program` and `model` (it uses none of them today) and never
//! `device`: where the step's mesh lies and each host's share of a batch are the device's
//! (`device::hosts`), and reach this stage, not the other way round.

pub mod address;
pub mod auth;
pub mod channel;
pub mod gather;
pub mod handshake;
pub mod keys;
pub mod launch;
pub mod locks;
pub mod rendezvous;
pub mod server;
pub mod store;
pub mod wire;

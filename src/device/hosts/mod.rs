//! Runs of several processes, one per host: where this process stands in the run ([`launch`]:
//! flags, or SLURM, torchrun, TPU VM and GKE environments), the run's key-value store (served
//! by process 0 over TCP, [`server`]; reached by every process, [`store`]; what they say,
//! [`wire`]; the GPU plugins exchange their ids through it), the [`rendezvous`] at the start,
//! where every process checks that the others run the same settings, where the step's mesh
//! lies ([`place`]: which process holds which positions; `--virtual-hosts` in one process), each
//! host's [`share`] of a batch, and the shards process 0 [`gather`]s to write them.

pub mod gather;
pub mod launch;
pub mod place;
pub mod rendezvous;
pub mod server;
pub mod share;
pub mod store;
pub mod wire;

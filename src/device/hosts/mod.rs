//! Runs of several processes, one per host: where this process stands in the run ([`launch`]:
//! flags, or SLURM, torchrun, TPU VM and GKE environments), the run's key-value [`store`]
//! (served by process 0 over TCP; the GPU plugins exchange their ids through it), and the
//! [`rendezvous`] at the start, where every process checks that the others run the same
//! settings.

pub mod launch;
pub mod rendezvous;
pub mod share;
pub mod store;

//! Where a run's step lies across hosts, the device's side of a run of several processes (its
//! transport is `crate::cluster`): the run's mode and where each mesh position is ([`place`]:
//! [`place::Hosts`], one process, `--virtual-hosts` in one process, or one process of several)
//! and each host's [`share`] of a batch.

pub mod place;
pub mod share;

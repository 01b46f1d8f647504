//! Memory policy: whether a training step fits a device's memory, and what to do when it does
//! not. [`fit`] words what a step needs against what a device has and what would make it fit
//! (for every command that compiles or runs a step); [`offload`] is `--remat auto` and
//! `--offload auto` on a real device, with the host memory the offloaded part needs.

pub mod fit;
pub mod offload;

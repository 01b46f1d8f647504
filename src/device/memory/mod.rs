//! Memory policy: whether a training step fits a device's memory, and what to do when it does
//! not. [`fit`] words what a step needs against what a device has and what would make it fit
//! (for every command that compiles or runs a step); [`auto`] is the loop of `--remat auto` and
//! `--offload auto`, the choices tried in order until one fits, which [`offload::choose`] runs
//! on a real device (with the host memory the offloaded part needs) and `xtrain compile --check`
//! for its targets.

pub mod auto;
pub mod fit;
pub mod offload;

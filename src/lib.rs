//! xtrain: the Llama 3.1 LoRA training step compiled as one StableHLO program and run on any
//! PJRT plugin. `hlo` builds graphs, `pjrt` runs them; this crate's folders are the pipeline's
//! stages, each using only those listed before it (docs/architecture.md is the map):
//!
//! - [`model`]: the config, the tensors' names, the Llama graph, LoRA, NF4, AdamW;
//! - [`program`]: the training step and its sibling programs as StableHLO text;
//! - [`formats`]: files on disk (safetensors, checkpoints, adapters, GGUF, program dirs);
//! - [`data`]: JSONL examples to tokenized rows to batches;
//! - [`cluster`]: the transport of a run of several processes (launch, the run's store, the
//!   rendezvous, gathering shards), nothing of the devices;
//! - [`device`]: a PJRT plugin, compiled programs, the trainer's state on the devices;
//! - [`train`]: the recipes that put them together (`xtrain train`, `xtrain bench`);
//! - [`compile`]: `xtrain compile`, the step's program dir without weights, compiled with
//!   `--check` for this machine or for absent targets;
//! - [`plan`]: `xtrain plan`, the settings that fit a target and how fast, by compiling for it.
//!
//! [`words`] is how every stage words counts, spans, durations and sizes in its messages.
//!
//! The command line (`src/cli`) is the binary's, on top of all of them.

/// `println!` that does not panic when the reader has gone (`xtrain compile | head -1`): the
/// command goes on to its end, its files written whole, and the lines nobody reads are dropped.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// [`say!`] to stderr: `eprintln!` that does not panic when stderr's reader has gone
/// (`xtrain train ... 2>&1 | head`).
#[macro_export]
macro_rules! esay {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod cluster;
pub mod compile;
pub mod data;
pub mod device;
pub mod formats;
pub mod model;
pub mod plan;
pub mod program;
pub mod train;
pub mod words;

#[cfg(test)]
mod test_support;

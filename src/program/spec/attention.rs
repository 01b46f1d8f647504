//! The attention's form as the flags give it: key/value blocks ([`KeyBlocks`], `--key-block`)
//! and the refusal of query blocks where attention takes none ([`AttentionBlockUnused`]).

use anyhow::{bail, Result};

/// `--key-block`: attention over key/value blocks of N tokens with the flash recurrence (memory
/// linear in the sequence; see `model::flash`), every key at once (`off`: the queries in
/// blocks of `--attention-block`), or `auto`: [`KeyBlocks::resolve`]'s rule for the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyBlocks {
    Auto,
    Off,
    Size(i64),
}

/// The key/value block `--key-block auto` takes for long sequences.
pub use crate::model::flash::DEFAULT_KEY_BLOCK;
/// `--key-block auto` attends over key/value blocks for sequences longer than this.
pub const KEY_BLOCKS_ABOVE: i64 = 8192;

impl KeyBlocks {
    /// `--key-block` as given: a positive number of tokens, `off` or `auto`.
    pub fn parse(s: &str) -> Result<KeyBlocks> {
        match s {
            "auto" => Ok(KeyBlocks::Auto),
            "off" => Ok(KeyBlocks::Off),
            n => match n.parse::<i64>() {
                Ok(n) if n >= 1 => Ok(KeyBlocks::Size(n)),
                _ => {
                    bail!("--key-block must be a positive number of tokens, off or auto, got `{s}`")
                }
            },
        }
    }

    pub fn name(self) -> String {
        match self {
            KeyBlocks::Auto => "auto".into(),
            KeyBlocks::Off => "off".into(),
            KeyBlocks::Size(n) => n.to_string(),
        }
    }

    /// The key/value block for sequences of `seq` tokens (None: every key at once). `auto`
    /// takes [`DEFAULT_KEY_BLOCK`] above [`KEY_BLOCKS_ABOVE`] tokens, and every key at once up to
    /// it: at 8192 tokens every key at once still fits a GPU or TPU for 8B, and it was the faster
    /// form both on the CPU (1.15x) and by the TPU cost model (1.5x; docs/performance.md),
    /// while from 16384 on its [heads, T/2, T] score blocks outgrow a device (8B on one H100:
    /// 92 against 66 GiB). With the sequence split over a context axis (`context` > 1) `auto`
    /// always takes key blocks, the only form that splits it. One rule, whatever else is given:
    /// an `--attention-block` (a TPU recipe's) with auto's key blocks is refused by the spec's
    /// check, naming both, not taken as a reason to keep every key at once.
    pub fn resolve(self, seq: i64, context: i64) -> Option<i64> {
        match self {
            KeyBlocks::Size(n) => Some(n),
            KeyBlocks::Off => None,
            KeyBlocks::Auto if context > 1 || seq > KEY_BLOCKS_ABOVE => Some(DEFAULT_KEY_BLOCK),
            KeyBlocks::Auto => None,
        }
    }
}

/// `--attention-block N` where attention does not take query blocks of its own (a context axis,
/// key/value blocks): refused as a type of its own, so that a command can name where N came from
/// (a recipe, a checkpoint's run) before the refusal.
#[derive(Debug)]
pub struct AttentionBlockUnused {
    pub block: i64,
    /// Why the value is not used.
    pub why: String,
    /// The other way out, if any (", or ...").
    pub other: String,
}

impl std::fmt::Display for AttentionBlockUnused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--attention-block {} sets the query blocks of attention over every key at once, {}: \
             give --attention-block auto (or leave it out){}",
            self.block, self.why, self.other
        )
    }
}

impl std::error::Error for AttentionBlockUnused {}

impl AttentionBlockUnused {
    /// The refusal with where the value came from: `source` is "the recipe FILE gives",
    /// "checkpoint DIR's run has", ...
    pub fn from_source(&self, source: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{source} --attention-block {}, which sets the query blocks of attention over every \
             key at once, {}: give --attention-block auto{}",
            self.block,
            self.why,
            self.other
        )
    }
}

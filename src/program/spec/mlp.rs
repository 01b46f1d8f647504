//! The MLP's form as the flag gives it: `--mlp-chunk` ([`MlpChunks`]), its tiles of positions.

use anyhow::{bail, Result};

/// `--mlp-chunk`: the MLP over tiles of N positions at a time, whose backward pass recomputes
/// each tile (memory of the MLP's [B, T, intermediate] tensors cut to [B, N, intermediate];
/// see `model::mlp_tiles`), the whole sequence at once (`off`), or `auto`:
/// [`MlpChunks::resolve`]'s rule for the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpChunks {
    Auto,
    Off,
    Size(i64),
}

/// The positions per tile `--mlp-chunk auto` takes for long sequences: as many as an 8B
/// model's hidden size (what ALST's tiled MLP takes), so that each tile's matmuls are as large
/// as the model's square ones and its [N, intermediate] tensors are 112 MiB in bf16 for 8B.
pub const DEFAULT_MLP_CHUNK: i64 = 4096;
/// `--mlp-chunk auto` tiles the MLP for sequences longer than this.
pub const MLP_CHUNKS_ABOVE: i64 = 16384;

impl MlpChunks {
    /// `--mlp-chunk` as given: a positive number of positions, `off` or `auto`.
    pub fn parse(s: &str) -> Result<MlpChunks> {
        match s {
            "auto" => Ok(MlpChunks::Auto),
            "off" => Ok(MlpChunks::Off),
            n => match n.parse::<i64>() {
                Ok(n) if n >= 1 => Ok(MlpChunks::Size(n)),
                _ => bail!(
                    "--mlp-chunk must be a positive number of positions, off or auto, got `{s}`"
                ),
            },
        }
    }

    pub fn name(self) -> String {
        match self {
            MlpChunks::Auto => "auto".into(),
            MlpChunks::Off => "off".into(),
            MlpChunks::Size(n) => n.to_string(),
        }
    }

    /// The positions per MLP tile for sequences of `seq` tokens (None: the whole sequence).
    /// `auto` takes [`DEFAULT_MLP_CHUNK`] above [`MLP_CHUNKS_ABOVE`] tokens, where the MLP's
    /// [T, intermediate] tensors outgrow the rest of a layer's (at 32k of 8B each is 0.9 GiB,
    /// several alive at once), and the whole sequence up to it, where tiles would only add a
    /// loop and, under `--remat save-proj`, the recomputation of the MLP's projections. With the
    /// sequence split over a context axis (`context` > 1) `auto` keeps the MLP whole: each
    /// device already holds a part of the sequence, and a tile of a split sequence would be cut
    /// across devices. One rule, the same for every target.
    pub fn resolve(self, seq: i64, context: i64) -> Option<i64> {
        match self {
            MlpChunks::Size(n) => Some(n),
            MlpChunks::Off => None,
            MlpChunks::Auto if context == 1 && seq > MLP_CHUNKS_ABOVE => Some(DEFAULT_MLP_CHUNK),
            MlpChunks::Auto => None,
        }
    }
}

//! Models named on the command line: a Hugging Face model directory, or one of the configs built
//! into the binary (so that `--model llama-3.1-405b` works anywhere, with no checkpoint).

use crate::model::config::LlamaConfig;
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// Configs built into the binary, so `--model llama-3.1-405b` works anywhere.
pub const PRESETS: &[(&str, &str)] = &[
    (
        "llama-3.1-8b",
        include_str!("../../models/llama-3.1-8b/config.json"),
    ),
    (
        "llama-3.1-70b",
        include_str!("../../models/llama-3.1-70b/config.json"),
    ),
    (
        "llama-3.1-405b",
        include_str!("../../models/llama-3.1-405b/config.json"),
    ),
    (
        "tiny-llama3",
        include_str!("../../models/tiny-llama3/config.json"),
    ),
    (
        "bench-512",
        include_str!("../../models/bench-512/config.json"),
    ),
];

/// A model named on the command line: a directory with config.json, or a preset name.
pub fn resolve_model_config(model: &str) -> Result<(LlamaConfig, Option<PathBuf>)> {
    let p = Path::new(model);
    if p.is_dir() || p.is_file() {
        return Ok((LlamaConfig::load(p)?, p.is_dir().then(|| p.to_path_buf())));
    }
    if let Some((_, text)) = PRESETS.iter().find(|(n, _)| *n == model) {
        let json: serde_json::Value = serde_json::from_str(text)?;
        return Ok((LlamaConfig::from_json(&json)?, None));
    }
    let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
    bail!(
        "--model {model}: no such directory, and not a preset (presets: {})",
        names.join(", ")
    )
}

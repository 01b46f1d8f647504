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
    (
        "smollm2-135m",
        include_str!("../../models/smollm2-135m/config.json"),
    ),
];

/// Hugging Face repos whose `config.json` is a preset's (the Instruct releases share their base
/// model's architecture), so that `xtrain compile --model meta-llama/Llama-3.1-8B-Instruct` needs
/// neither the hub nor its cache.
pub const REPO_PRESETS: &[(&str, &str)] = &[
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Llama-3.1-70B", "llama-3.1-70b"),
    ("meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("meta-llama/Meta-Llama-3.1-70B", "llama-3.1-70b"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("meta-llama/Llama-3.1-405B", "llama-3.1-405b"),
    ("meta-llama/Llama-3.1-405B-Instruct", "llama-3.1-405b"),
    ("meta-llama/Meta-Llama-3.1-405B", "llama-3.1-405b"),
    ("meta-llama/Meta-Llama-3.1-405B-Instruct", "llama-3.1-405b"),
    ("HuggingFaceTB/SmolLM2-135M", "smollm2-135m"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
];

/// The preset whose config is that of Hugging Face repo `id`, if there is one.
pub fn preset_for_repo(id: &str) -> Option<&'static str> {
    REPO_PRESETS
        .iter()
        .find(|(r, _)| r.eq_ignore_ascii_case(id))
        .map(|(_, p)| *p)
}

/// Whether `name` is a built-in preset (a config without weights).
pub fn is_preset(name: &str) -> bool {
    PRESETS.iter().any(|(n, _)| *n == name)
}

/// A preset's config by name.
pub fn preset_config(name: &str) -> Result<Option<LlamaConfig>> {
    match PRESETS.iter().find(|(n, _)| *n == name) {
        Some((_, text)) => {
            let json: serde_json::Value = serde_json::from_str(text)?;
            Ok(Some(LlamaConfig::from_json(&json)?))
        }
        None => Ok(None),
    }
}

/// A model named on the command line: a directory with config.json, or a preset name.
pub fn resolve_model_config(model: &str) -> Result<(LlamaConfig, Option<PathBuf>)> {
    let p = Path::new(model);
    if p.is_dir() || p.is_file() {
        return Ok((LlamaConfig::load(p)?, p.is_dir().then(|| p.to_path_buf())));
    }
    if let Some(cfg) = preset_config(model)? {
        return Ok((cfg, None));
    }
    let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
    bail!(
        "--model {model}: no such directory, and not a preset (presets: {})",
        names.join(", ")
    )
}

//! Models named on the command line: a Hugging Face model directory, or one of the configs built
//! into the binary (so that `--model llama-3.1-405b` works anywhere, with no checkpoint): Llama
//! 3.1 8B/70B/405B, Llama 3.2 1B/3B (tied embeddings, RoPE factor 32), Llama 3.3 70B (3.1 70B's
//! architecture), SmolLM2-135M and the test and benchmark models.

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
        "llama-3.2-1b",
        include_str!("../../models/llama-3.2-1b/config.json"),
    ),
    (
        "llama-3.2-3b",
        include_str!("../../models/llama-3.2-3b/config.json"),
    ),
    (
        "llama-3.3-70b",
        include_str!("../../models/llama-3.3-70b/config.json"),
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
    ("meta-llama/Llama-3.2-1B", "llama-3.2-1b"),
    ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    ("meta-llama/Llama-3.2-3B", "llama-3.2-3b"),
    ("meta-llama/Llama-3.2-3B-Instruct", "llama-3.2-3b"),
    ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(name: &str) -> (LlamaConfig, i64) {
        let cfg = preset_config(name).unwrap().unwrap();
        let n = crate::model::tensors::frozen_weights(&cfg)
            .iter()
            .map(|(_, s)| s.iter().product::<i64>())
            .sum();
        (cfg, n)
    }

    /// Every repo id names a preset; the Llama 3.2 and 3.3 configs have the published shapes
    /// (parameter counts as the model cards give them: 1.24B, 3.21B, 70.6B).
    #[test]
    fn the_llama_3_2_and_3_3_presets_have_the_published_shapes() {
        for (repo, preset) in REPO_PRESETS {
            assert!(is_preset(preset), "{repo} -> {preset}");
            assert_eq!(preset_for_repo(&repo.to_lowercase()), Some(*preset));
        }
        let (one, n1) = params("llama-3.2-1b");
        assert_eq!(n1, 1_235_814_400);
        assert!(one.tie_word_embeddings);
        assert_eq!((one.head_dim, one.num_key_value_heads), (64, 8));
        assert_eq!(one.rope_scaling.as_ref().unwrap().factor, 32.0);
        let (three, n3) = params("llama-3.2-3b");
        assert_eq!(n3, 3_212_749_824);
        assert!(three.tie_word_embeddings);
        assert_eq!(three.head_dim, 128);
        assert_eq!(three.rope_scaling.as_ref().unwrap().factor, 32.0);
        // 3.3 70B is 3.1 70B's architecture.
        let (cfg, n) = params("llama-3.3-70b");
        assert_eq!(n, 70_553_706_496);
        assert_eq!(cfg, params("llama-3.1-70b").0);
    }
}

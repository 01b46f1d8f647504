//! Models named on the command line: a Hugging Face model directory, or one of the configs built
//! into the binary (so that `--model llama-3.1-405b` works anywhere, with no checkpoint): Llama
//! 3.1 8B/70B/405B, Llama 3.2 1B/3B (tied embeddings, RoPE factor 32), Llama 3.3 70B (3.1 70B's
//! architecture), Qwen2.5 0.5B-72B, Qwen3 0.6B-32B, Mistral 7B v0.3 and Mistral Nemo 12B (each
//! its released config.json; a sibling release whose config differs, an Instruct or a Base, has
//! a preset of its own), SmolLM2-135M and the test and benchmark models.

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
        "qwen2.5-0.5b",
        include_str!("../../models/qwen2.5-0.5b/config.json"),
    ),
    (
        "qwen2.5-1.5b",
        include_str!("../../models/qwen2.5-1.5b/config.json"),
    ),
    (
        "qwen2.5-1.5b-instruct",
        include_str!("../../models/qwen2.5-1.5b-instruct/config.json"),
    ),
    (
        "qwen2.5-3b",
        include_str!("../../models/qwen2.5-3b/config.json"),
    ),
    (
        "qwen2.5-7b",
        include_str!("../../models/qwen2.5-7b/config.json"),
    ),
    (
        "qwen2.5-7b-instruct",
        include_str!("../../models/qwen2.5-7b-instruct/config.json"),
    ),
    (
        "qwen2.5-14b",
        include_str!("../../models/qwen2.5-14b/config.json"),
    ),
    (
        "qwen2.5-14b-instruct",
        include_str!("../../models/qwen2.5-14b-instruct/config.json"),
    ),
    (
        "qwen2.5-32b",
        include_str!("../../models/qwen2.5-32b/config.json"),
    ),
    (
        "qwen2.5-32b-instruct",
        include_str!("../../models/qwen2.5-32b-instruct/config.json"),
    ),
    (
        "qwen2.5-72b",
        include_str!("../../models/qwen2.5-72b/config.json"),
    ),
    (
        "qwen2.5-72b-instruct",
        include_str!("../../models/qwen2.5-72b-instruct/config.json"),
    ),
    (
        "qwen3-0.6b",
        include_str!("../../models/qwen3-0.6b/config.json"),
    ),
    (
        "qwen3-0.6b-base",
        include_str!("../../models/qwen3-0.6b-base/config.json"),
    ),
    (
        "qwen3-1.7b",
        include_str!("../../models/qwen3-1.7b/config.json"),
    ),
    (
        "qwen3-1.7b-base",
        include_str!("../../models/qwen3-1.7b-base/config.json"),
    ),
    (
        "qwen3-4b",
        include_str!("../../models/qwen3-4b/config.json"),
    ),
    (
        "qwen3-4b-base",
        include_str!("../../models/qwen3-4b-base/config.json"),
    ),
    (
        "qwen3-8b",
        include_str!("../../models/qwen3-8b/config.json"),
    ),
    (
        "qwen3-8b-base",
        include_str!("../../models/qwen3-8b-base/config.json"),
    ),
    (
        "qwen3-14b",
        include_str!("../../models/qwen3-14b/config.json"),
    ),
    (
        "qwen3-14b-base",
        include_str!("../../models/qwen3-14b-base/config.json"),
    ),
    (
        "qwen3-32b",
        include_str!("../../models/qwen3-32b/config.json"),
    ),
    (
        "qwen3-32b-base",
        include_str!("../../models/qwen3-32b-base/config.json"),
    ),
    (
        "mistral-7b-v0.3",
        include_str!("../../models/mistral-7b-v0.3/config.json"),
    ),
    (
        "mistral-nemo-12b",
        include_str!("../../models/mistral-nemo-12b/config.json"),
    ),
    (
        "mistral-nemo-12b-instruct",
        include_str!("../../models/mistral-nemo-12b-instruct/config.json"),
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
    ("Qwen/Qwen2.5-0.5B", "qwen2.5-0.5b"),
    ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"),
    ("Qwen/Qwen2.5-1.5B", "qwen2.5-1.5b"),
    ("Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-1.5b-instruct"),
    ("Qwen/Qwen2.5-3B", "qwen2.5-3b"),
    ("Qwen/Qwen2.5-3B-Instruct", "qwen2.5-3b"),
    ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b-instruct"),
    ("Qwen/Qwen2.5-14B", "qwen2.5-14b"),
    ("Qwen/Qwen2.5-14B-Instruct", "qwen2.5-14b-instruct"),
    ("Qwen/Qwen2.5-32B", "qwen2.5-32b"),
    ("Qwen/Qwen2.5-32B-Instruct", "qwen2.5-32b-instruct"),
    ("Qwen/Qwen2.5-72B", "qwen2.5-72b"),
    ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b-instruct"),
    ("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
    ("Qwen/Qwen3-0.6B-Base", "qwen3-0.6b-base"),
    ("Qwen/Qwen3-1.7B", "qwen3-1.7b"),
    ("Qwen/Qwen3-1.7B-Base", "qwen3-1.7b-base"),
    ("Qwen/Qwen3-4B", "qwen3-4b"),
    ("Qwen/Qwen3-4B-Base", "qwen3-4b-base"),
    ("Qwen/Qwen3-8B", "qwen3-8b"),
    ("Qwen/Qwen3-8B-Base", "qwen3-8b-base"),
    ("Qwen/Qwen3-14B", "qwen3-14b"),
    ("Qwen/Qwen3-14B-Base", "qwen3-14b-base"),
    ("Qwen/Qwen3-32B", "qwen3-32b"),
    ("Qwen/Qwen3-32B-Base", "qwen3-32b-base"),
    ("mistralai/Mistral-7B-v0.3", "mistral-7b-v0.3"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b-v0.3"),
    ("mistralai/Mistral-Nemo-Base-2407", "mistral-nemo-12b"),
    (
        "mistralai/Mistral-Nemo-Instruct-2407",
        "mistral-nemo-12b-instruct",
    ),
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
    // Presets are lower case: `Llama-3.2-1B` is most likely `llama-3.2-1b`.
    let hint = names
        .iter()
        .find(|n| n.eq_ignore_ascii_case(model))
        .map(|n| format!("; did you mean --model {n}? (preset names are lower case)"))
        .unwrap_or_default();
    bail!(
        "--model {model}: no such directory, and not a preset{hint} (presets: {})",
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

    /// The Qwen2.5, Qwen3 and Mistral presets have the released shapes: parameter counts as the
    /// checkpoints hold them (tied embeddings counted once), the families' switches, and the
    /// fields where an Instruct or Base release differs from its sibling.
    #[test]
    fn the_family_presets_have_the_published_shapes() {
        use crate::model::config::Family;
        for (name, want, family, tie) in [
            ("qwen2.5-0.5b", 494_032_768, Family::Qwen2, true),
            ("qwen2.5-1.5b", 1_543_714_304, Family::Qwen2, true),
            ("qwen2.5-3b", 3_085_938_688, Family::Qwen2, true),
            ("qwen2.5-7b", 7_615_616_512, Family::Qwen2, false),
            ("qwen2.5-14b", 14_770_033_664, Family::Qwen2, false),
            ("qwen2.5-32b", 32_763_876_352, Family::Qwen2, false),
            ("qwen2.5-72b", 72_706_203_648, Family::Qwen2, false),
            ("qwen3-0.6b", 596_049_920, Family::Qwen3, true),
            ("qwen3-1.7b", 1_720_574_976, Family::Qwen3, true),
            ("qwen3-4b", 4_022_468_096, Family::Qwen3, true),
            ("qwen3-8b", 8_190_735_360, Family::Qwen3, false),
            ("qwen3-14b", 14_768_307_200, Family::Qwen3, false),
            ("qwen3-32b", 32_762_123_264, Family::Qwen3, false),
            ("mistral-7b-v0.3", 7_248_023_552, Family::Mistral, false),
            ("mistral-nemo-12b", 12_247_782_400, Family::Mistral, false),
        ] {
            let (cfg, n) = params(name);
            assert_eq!(n, want, "{name}");
            assert_eq!(cfg.param_count(), want, "{name}");
            assert_eq!(
                (cfg.family, cfg.tie_word_embeddings),
                (family, tie),
                "{name}"
            );
            assert_eq!(cfg.qkv_bias, family == Family::Qwen2, "{name}");
            assert_eq!(cfg.qk_norm, family == Family::Qwen3, "{name}");
            assert_eq!(
                (cfg.rope_theta, cfg.rope_scaling.clone(), cfg.sliding_window),
                (1e6, None, None),
                "{name}"
            );
            if family == Family::Qwen3 {
                assert_eq!(cfg.head_dim, 128, "{name}");
            }
        }
        let nemo = params("mistral-nemo-12b").0;
        assert_eq!(
            (nemo.head_dim, nemo.hidden_size / nemo.num_attention_heads),
            (128, 160)
        );
        assert_eq!(nemo.vocab_size, 131_072);
        assert_eq!(params("mistral-7b-v0.3").0.vocab_size, 32_768);
        // Where the releases differ: Qwen2.5's Instruct configs (positions, and the norm's eps
        // from 14B up), Qwen3's Base configs (positions), Nemo's Instruct (positions).
        let differs = |a: &str, b: &str| {
            let (x, y) = (params(a).0, params(b).0);
            (
                x.max_position_embeddings,
                y.max_position_embeddings,
                x.rms_norm_eps,
                y.rms_norm_eps,
            )
        };
        assert_eq!(
            differs("qwen2.5-14b", "qwen2.5-14b-instruct"),
            (131_072, 32_768, 1e-5, 1e-6)
        );
        assert_eq!(
            differs("qwen2.5-7b", "qwen2.5-7b-instruct"),
            (131_072, 32_768, 1e-6, 1e-6)
        );
        assert_eq!(
            differs("qwen3-8b", "qwen3-8b-base"),
            (40_960, 32_768, 1e-6, 1e-6)
        );
        assert_eq!(
            differs("mistral-nemo-12b", "mistral-nemo-12b-instruct"),
            (1_024_000, 131_072, 1e-5, 1e-5)
        );
        assert_eq!(
            preset_for_repo("Qwen/Qwen2.5-0.5B-Instruct"),
            Some("qwen2.5-0.5b")
        );
        assert_eq!(
            preset_for_repo("Qwen/Qwen2.5-7B-Instruct"),
            Some("qwen2.5-7b-instruct")
        );
        assert_eq!(preset_for_repo("Qwen/Qwen3-8B-Base"), Some("qwen3-8b-base"));
        assert_eq!(
            preset_for_repo("mistralai/Mistral-7B-Instruct-v0.3"),
            Some("mistral-7b-v0.3")
        );
    }
}

//! `--model` and `--revision`: a model directory, a built-in preset, or a Hugging Face repo id
//! found in (or downloaded into) the hub cache.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use xtrain::formats::hub::{self, Need};
use xtrain::model::config::LlamaConfig;
use xtrain::model::presets;

/// A model with its weights, for command `cmd` (`train`, `generate`, `merge`): the directory
/// itself, or the hub cache's snapshot of repo id `model` at `revision`. A preset's name is
/// refused as such: a preset is a config without weights.
pub fn model_dir(model: &Path, revision: Option<&str>, cmd: &str) -> Result<PathBuf> {
    let s = model.to_string_lossy();
    if model.exists() {
        if let Some(r) = revision {
            bail!(
                "--revision {r}: --model {} is a local path; --revision applies to a Hugging Face repo id",
                model.display()
            );
        }
        return Ok(model.to_path_buf());
    }
    if hub::is_repo_id(&s) {
        return hub::resolve(&s, revision, Need::Weights);
    }
    if presets::is_preset(&s) {
        bail!(
            "--model {s} is a built-in config without weights (usable by `xtrain compile` and \
             `xtrain bench`); `xtrain {cmd}` needs a model directory or a Hugging Face repo id \
             with weights"
        );
    }
    Ok(model.to_path_buf())
}

/// A model's config for building programs: a directory, a preset, or a repo id (its config.json
/// from the cache, else the preset of the repo it is, else downloaded).
pub fn model_config(model: &str, revision: Option<&str>) -> Result<LlamaConfig> {
    let p = Path::new(model);
    if p.exists() || presets::preset_config(model)?.is_some() {
        if let Some(r) = revision {
            bail!("--revision {r}: --model {model} is not a Hugging Face repo id");
        }
        return Ok(presets::resolve_model_config(model)?.0);
    }
    if !hub::is_repo_id(model) {
        return Ok(presets::resolve_model_config(model)?.0);
    }
    if let hub::Lookup::Found(dir) = hub::lookup(&hub::cache_dir(), model, revision, Need::Config)?
    {
        return LlamaConfig::load(&dir);
    }
    if let Some(name) = presets::preset_for_repo(model).filter(|_| revision.is_none()) {
        xtrain::esay!(
            "xtrain: {model} is not in the Hugging Face hub cache; using its built-in config ({name})"
        );
        return Ok(presets::preset_config(name)?.expect("REPO_PRESETS names presets"));
    }
    LlamaConfig::load(&hub::resolve(model, revision, Need::Config)?)
}

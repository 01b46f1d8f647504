//! PEFT LoRA adapters on disk: `adapter_config.json` + `adapter_model.safetensors`, with PEFT's
//! tensor names, loadable by `peft.PeftModel.from_pretrained`; and a fresh adapter, initialised as
//! PEFT initialises one.

use crate::formats::host::convert;
use crate::formats::safetensors::{self, SafeTensors};
use crate::model::config::LlamaConfig;
use crate::model::lora::{kaiming_uniform, LoraConfig, Projection, SplitMix};
use crate::model::tensors::lora_tensors;
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::collections::BTreeMap;
use std::path::Path;

/// PEFT's per-module overrides of an adapter's rank and alpha (`rank_pattern`, `alpha_pattern`):
/// each key is a regular expression matched, as PEFT matches it, against the end of a module's
/// name (`model.layers.3.self_attn.q_proj`) after a dot or from its start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Patterns {
    pub rank: Vec<(String, i64)>,
    pub alpha: Vec<(String, f64)>,
}

impl Patterns {
    pub fn is_empty(&self) -> bool {
        self.rank.is_empty() && self.alpha.is_empty()
    }

    /// The rank and alpha of `target` in `layer`: the pattern whose key matches its module,
    /// else the adapter's `r` and `lora_alpha`. Keys that match the same module with different
    /// values are refused (PEFT would take the first in the file's order).
    pub fn module(&self, lora: &LoraConfig, target: Projection, layer: i64) -> Result<(i64, f64)> {
        let module = format!(
            "model.layers.{layer}.{}.{}",
            target.block(),
            target.module()
        );
        fn pick<T: Copy + PartialEq + std::fmt::Debug>(
            what: &str,
            pattern: &[(String, T)],
            module: &str,
            default: T,
        ) -> Result<T> {
            let mut found: Option<(&str, T)> = None;
            for (key, v) in pattern {
                let re = regex::Regex::new(&format!("^(?:.*\\.)?(?:{key})$"))
                    .with_context(|| format!("`{what}` key `{key}` is not a regular expression"))?;
                if re.is_match(module) {
                    if let Some((k0, v0)) = found {
                        if v0 != *v {
                            bail!("`{what}` keys `{k0}` ({v0:?}) and `{key}` ({v:?}) both match {module}");
                        }
                    }
                    found = Some((key, *v));
                }
            }
            Ok(found.map_or(default, |(_, v)| v))
        }
        Ok((
            pick("rank_pattern", &self.rank, &module, lora.r)?,
            pick("alpha_pattern", &self.alpha, &module, lora.alpha)?,
        ))
    }
}

/// Read `adapter_config.json` for training from it (`--init-adapter`, `--resume`): one rank and
/// one alpha for every module, so an adapter with a `rank_pattern` or `alpha_pattern` is refused,
/// naming it (`xtrain generate` and `xtrain merge` honour them: [`load_adapter`]).
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    let (c, patterns) = read_config_and_patterns(dir)?;
    if !patterns.is_empty() {
        let path = dir.join("adapter_config.json");
        let mut what = Vec::new();
        if !patterns.rank.is_empty() {
            what.push(format!("`rank_pattern` {:?}", patterns.rank));
        }
        if !patterns.alpha.is_empty() {
            what.push(format!("`alpha_pattern` {:?}", patterns.alpha));
        }
        bail!(
            "{}: {} give some modules another rank or alpha than r={}, lora_alpha={}; training keeps one rank and one alpha for every module, so xtrain cannot train from this adapter (xtrain generate and xtrain merge honour the patterns)",
            path.display(),
            what.join(" and "),
            c.r,
            c.alpha
        );
    }
    Ok(c)
}

/// Read `adapter_config.json`: the adapter's rank, alpha, dropout and targets, and its
/// per-module patterns.
pub fn read_config_and_patterns(dir: &Path) -> Result<(LoraConfig, Patterns)> {
    let path = dir.join("adapter_config.json");
    let text = read_config_text(dir, &path)?;
    let j: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let field = |k: &str| j.get(k).filter(|v| !v.is_null());
    if let Some(t) = field("peft_type") {
        if t != "LORA" {
            bail!("{}: peft_type {t} is not LORA", path.display());
        }
    }
    for flag in ["use_dora", "use_rslora", "fan_in_fan_out"] {
        if field(flag).and_then(|v| v.as_bool()) == Some(true) {
            bail!("{}: `{flag}` = true is not supported", path.display());
        }
    }
    if let Some(l) =
        field("layers_to_transform").filter(|v| v.as_array().is_none_or(|a| !a.is_empty()))
    {
        bail!(
            "{}: `layers_to_transform` = {l} is not supported (xtrain adapts every layer)",
            path.display()
        );
    }
    // Whole modules or embedding rows trained beside the LoRA weights (often `lm_head` and
    // `embed_tokens`, which Llama 3.2 and SmolLM2 tie) would be silently dropped by a merge or
    // an export that reads only lora_A/lora_B.
    for key in ["modules_to_save", "trainable_token_indices"] {
        let given = |v: &&serde_json::Value| match v {
            serde_json::Value::Array(a) => !a.is_empty(),
            serde_json::Value::Object(o) => !o.is_empty(),
            _ => true,
        };
        if let Some(m) = field(key).filter(given) {
            bail!(
                "{}: `{key}` = {m} is not supported: xtrain reads the LoRA weights only, and \
                 what that trains beside them (full modules or embedding rows) would be lost",
                path.display()
            );
        }
    }
    let (r, alpha) = rank_and_alpha(&j, &path)?;
    let dropout = field("lora_dropout")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);
    let targets = target_modules(field("target_modules"), &path)?;
    let pattern = |key: &str| -> Result<Vec<(String, f64)>> {
        match field(key) {
            None => Ok(Vec::new()),
            Some(serde_json::Value::Object(m)) => m
                .iter()
                .map(|(k, v)| {
                    let v = v.as_f64().with_context(|| {
                        format!(
                            "{}: `{key}` maps `{k}` to {v}, not a number",
                            path.display()
                        )
                    })?;
                    Ok((k.clone(), v))
                })
                .collect(),
            Some(other) => bail!(
                "{}: `{key}` must be an object of module patterns, got {other}",
                path.display()
            ),
        }
    };
    let rank = pattern("rank_pattern")?
        .into_iter()
        .map(|(k, v)| {
            if v.fract() != 0.0 || v < 1.0 {
                bail!(
                    "{}: `rank_pattern` gives `{k}` rank {v}, not a positive integer",
                    path.display()
                );
            }
            Ok((k, v as i64))
        })
        .collect::<Result<_>>()?;
    let alphas = pattern("alpha_pattern")?;
    if let Some((k, v)) = alphas.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
        bail!(
            "{}: `alpha_pattern` gives `{k}` alpha {v}, not a positive number",
            path.display()
        );
    }
    let patterns = Patterns {
        rank,
        alpha: alphas,
    };
    Ok((
        LoraConfig {
            r,
            alpha,
            dropout,
            targets,
        },
        patterns,
    ))
}

/// `target_modules` as PEFT writes it: a list of module names, or "all-linear".
fn target_modules(given: Option<&serde_json::Value>, path: &Path) -> Result<Vec<Projection>> {
    Ok(match given {
        Some(serde_json::Value::Array(a)) => {
            let mut t: Vec<Projection> = a
                .iter()
                .map(|v| Projection::parse(v.as_str().unwrap_or("?")))
                .collect::<Result<_>>()
                .with_context(|| format!("in {}", path.display()))?;
            t.sort();
            t.dedup();
            t
        }
        // PEFT's word for every linear layer but the head: on Llama, the seven projections.
        Some(serde_json::Value::String(s)) if s == "all-linear" => Projection::ALL.to_vec(),
        Some(serde_json::Value::String(s)) => bail!(
            "{}: `target_modules` is the string {s:?}, which PEFT takes as a regular expression \
             over module names; xtrain reads a list of module names (or \"all-linear\"): write \
             it as a list, e.g. [\"q_proj\", \"v_proj\"]",
            path.display()
        ),
        _ => bail!(
            "{}: `target_modules` must be a list of module names",
            path.display()
        ),
    })
}

/// The text of `dir`'s adapter_config.json (`path`); where `dir` is a run's directory, the
/// error says where its adapter is.
fn read_config_text(dir: &Path, path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| {
        let inner = dir.join("adapter");
        match inner.join("adapter_config.json").is_file() {
            true => format!(
                "cannot read {} ({} looks like a run's directory: its adapter is {})",
                path.display(),
                dir.display(),
                inner.display()
            ),
            false => format!("cannot read {}", path.display()),
        }
    })
}

/// An adapter config's `r` and `lora_alpha`, refused where `train` would refuse them as flags.
fn rank_and_alpha(j: &serde_json::Value, path: &Path) -> Result<(i64, f64)> {
    let field = |k: &str| j.get(k).filter(|v| !v.is_null());
    let r = field("r")
        .and_then(|v| v.as_i64())
        .with_context(|| format!("{}: no integer `r`", path.display()))?;
    let alpha = field("lora_alpha")
        .and_then(|v| v.as_f64())
        .with_context(|| format!("{}: no `lora_alpha`", path.display()))?;
    // As `train` refuses these flags: a rank under 1 has no matrices, and alpha scales the
    // update by alpha / r (llama.cpp reads an alpha of 0 as a scale of 1, not 0).
    if r < 1 {
        bail!("{}: `r` = {r}: a LoRA rank is at least 1", path.display());
    }
    if !(alpha.is_finite() && alpha > 0.0) {
        bail!(
            "{}: `lora_alpha` = {alpha}: it must be a positive number (the update is scaled by \
             lora_alpha / r)",
            path.display()
        );
    }
    Ok((r, alpha))
}

/// Refuse an adapter tensor holding a value that is not finite (a checkpoint of a run that
/// blew up, a damaged file): training from it, merging or exporting it gives NaN everywhere.
fn finite(path: &Path, name: &str, values: &[f32]) -> Result<()> {
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        bail!(
            "{}: tensor `{name}` holds {} at element {i}: an adapter's values must be finite \
             (one saved from a run that blew up cannot be trained, merged or exported)",
            path.display(),
            values[i]
        );
    }
    Ok(())
}

/// ` its adapter_config.json names NAME as its base`, where it names one.
fn trained_on(config: &Path) -> String {
    std::fs::read_to_string(config)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|j| j["base_model_name_or_path"].as_str().map(String::from))
        .map_or(String::new(), |b| {
            format!(" its adapter_config.json names `{b}` as its base")
        })
}

/// Read an adapter's tensors for `cfg`, checking names and shapes; converted to f32.
pub fn read_tensors(
    dir: &Path,
    cfg: &LlamaConfig,
    lora: &LoraConfig,
) -> Result<BTreeMap<String, HostTensor>> {
    let path = dir.join("adapter_model.safetensors");
    let st = SafeTensors::open(&path)?;
    let mut out = BTreeMap::new();
    shallower(&st, cfg, &path, dir)?;
    for t in lora_tensors(cfg, lora) {
        let info = st.info(&t.name)?;
        if info.shape != t.shape {
            bail!(
                "{}: tensor `{}` has shape {:?} but rank {} on this model needs {:?} (an \
                 adapter trained on another model?{})",
                path.display(),
                t.name,
                info.shape,
                lora.r,
                t.shape,
                trained_on(&dir.join("adapter_config.json"))
            );
        }
        let values = convert(&st.read(&t.name)?, ElementType::F32)?;
        finite(&path, &t.name, &values.to_f32()?)?;
        out.insert(t.name.clone(), values);
    }
    if let Some(extra) = st.tensors.keys().find(|k| !out.contains_key(*k)) {
        let layer = extra
            .split_once(".layers.")
            .and_then(|(_, rest)| rest.split('.').next()?.parse::<i64>().ok());
        if let Some(l) = layer.filter(|&l| l >= cfg.num_hidden_layers) {
            bail!(
                "{}: tensor `{extra}` is for layer {l}, but the model has {} (an adapter \
                 trained on a deeper model?{})",
                path.display(),
                crate::words::count(cfg.num_hidden_layers as usize, "layer"),
                trained_on(&dir.join("adapter_config.json"))
            );
        }
        bail!(
            "{}: tensor `{extra}` is not part of a rank-{} adapter on {}",
            path.display(),
            lora.r,
            Projection::list(&lora.targets)
        );
    }
    Ok(out)
}

/// Refuse an adapter whose tensors stop at a layer short of the model's last (trained on a
/// shallower model), naming both depths.
fn shallower(st: &SafeTensors, cfg: &LlamaConfig, path: &Path, dir: &Path) -> Result<()> {
    let deepest = st
        .tensors
        .keys()
        .filter_map(|k| {
            let (_, rest) = k.split_once(".layers.")?;
            rest.split('.').next()?.parse::<i64>().ok()
        })
        .max();
    match deepest {
        Some(l) if l + 1 < cfg.num_hidden_layers => bail!(
            "{}: the adapter has tensors for {} only, but the model has {} (an adapter \
             trained on a shallower model?{})",
            path.display(),
            crate::words::count(l as usize + 1, "layer"),
            crate::words::count(cfg.num_hidden_layers as usize, "layer"),
            trained_on(&dir.join("adapter_config.json"))
        ),
        _ => Ok(()),
    }
}

/// An adapter's base model as PEFT records it: `base_model_name_or_path` and `revision`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseModel {
    pub name: String,
    /// The commit of a hub cache snapshot (None for a plain directory): what PEFT passes to
    /// `from_pretrained(revision=...)`, so that the adapter loads onto the weights it was
    /// trained on, not onto whatever `main` is then.
    pub revision: Option<String>,
}

/// What an adapter calls its base model (`base_model_name_or_path`), in a form another machine
/// can resolve: the Hugging Face repo id when the model directory is a snapshot in a hub cache
/// (`.../models--org--name/snapshots/<commit>/`, as `huggingface_hub` lays it out), with that
/// commit as the revision (a branch or tag given with `--revision` resolves to it); else the
/// directory's canonical absolute path (what `PeftModel`/`AutoPeftModel` can load on this
/// machine or one that mounts the same path).
pub fn base_model(model: &Path) -> BaseModel {
    let abs = std::fs::canonicalize(model).unwrap_or_else(|_| {
        std::env::current_dir()
            .map(|d| d.join(model))
            .unwrap_or_else(|_| model.to_path_buf())
    });
    let parts: Vec<String> = abs
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    for w in parts.windows(3) {
        if let Some(repo) = w[0].strip_prefix("models--") {
            if w[1] == "snapshots" && repo.contains("--") {
                let commit = w[2].len() == 40 && w[2].chars().all(|c| c.is_ascii_hexdigit());
                return BaseModel {
                    name: repo.replacen("--", "/", 1),
                    revision: commit.then(|| w[2].clone()),
                };
            }
        }
    }
    BaseModel {
        name: abs.to_string_lossy().into_owned(),
        revision: None,
    }
}

/// Write an adapter dir: both files atomically, into `dir` (created if needed).
pub fn write(
    dir: &Path,
    lora: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
    base_model: &BaseModel,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let targets: Vec<&str> = lora.targets.iter().map(|t| t.module()).collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model.name,
        "revision": base_model.revision,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": false,
        "use_dora": false,
    });
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::write(&dir.join("adapter_model.safetensors"), tensors, &meta)?;
    crate::formats::atomic::write_bytes_atomic(
        &dir.join("adapter_config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )
}

/// Load an adapter dir (config + tensors) for a model, to compute with (`xtrain generate`,
/// `xtrain merge`). PEFT's `rank_pattern` and `alpha_pattern` are honoured: each module's own
/// scale (alpha / r) is folded into its B, and every module is padded with zeros to the largest
/// rank, so the returned config (that rank, alpha equal to it: scale 1) computes exactly each
/// module's `(alpha_m / r_m) B_m A_m`. Without patterns the adapter comes back as stored.
pub fn load_adapter(
    dir: &Path,
    cfg: &LlamaConfig,
) -> Result<(LoraConfig, BTreeMap<String, HostTensor>)> {
    let (c, patterns) = read_config_and_patterns(dir)?;
    if patterns.is_empty() {
        let t = read_tensors(dir, cfg, &c).with_context(|| format!("adapter {}", dir.display()))?;
        return Ok((c, t));
    }
    let path = dir.join("adapter_model.safetensors");
    let st = SafeTensors::open(&path)?;
    let mut modules = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        for &t in &c.targets {
            let (r, alpha) = patterns.module(&c, t, l)?;
            modules.push((l, t, r, alpha));
        }
    }
    let r_max = modules.iter().map(|m| m.2).max().unwrap_or(c.r);
    let mut out = BTreeMap::new();
    for &(l, t, r, alpha) in &modules {
        let (inp, outd) = crate::model::tensors::projection_dims(cfg, t);
        let read = |which: &str, shape: [i64; 2]| -> Result<Vec<f32>> {
            let name = t.peft_name(l, which);
            let info = st.info(&name)?;
            if info.shape != shape {
                bail!(
                    "{}: tensor `{name}` has shape {:?} but rank {r} (r={}, rank_pattern {:?}) on this model needs {shape:?} (an adapter trained on another model?{})",
                    path.display(),
                    info.shape,
                    c.r,
                    patterns.rank,
                    trained_on(&dir.join("adapter_config.json"))
                );
            }
            let values = convert(&st.read(&name)?, ElementType::F32)?.to_f32()?;
            finite(&path, &name, &values)?;
            Ok(values)
        };
        let a = read("A", [r, inp])?;
        let b = read("B", [outd, r])?;
        let scale = (alpha / r as f64) as f32;
        let mut a_pad = a;
        a_pad.resize((r_max * inp) as usize, 0.0);
        let mut b_pad = vec![0.0f32; (outd * r_max) as usize];
        for o in 0..outd as usize {
            for k in 0..r as usize {
                b_pad[o * r_max as usize + k] = b[o * r as usize + k] * scale;
            }
        }
        out.insert(
            t.peft_name(l, "A"),
            HostTensor::from_f32(&a_pad, &[r_max, inp]),
        );
        out.insert(
            t.peft_name(l, "B"),
            HostTensor::from_f32(&b_pad, &[outd, r_max]),
        );
    }
    if let Some(extra) = st.tensors.keys().find(|k| !out.contains_key(*k)) {
        bail!(
            "{}: tensor `{extra}` is not part of an adapter on {:?}",
            path.display(),
            c.targets
        );
    }
    Ok((
        LoraConfig {
            r: r_max,
            alpha: r_max as f64,
            ..c
        },
        out,
    ))
}

/// Fresh LoRA weights: A Kaiming-uniform as PEFT, B zeros.
pub fn init_lora(cfg: &LlamaConfig, lora: &LoraConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = SplitMix(seed);
    lora_tensors(cfg, lora)
        .into_iter()
        .map(|t| {
            let values = if t.which == "A" {
                kaiming_uniform(&mut rng, t.shape[0], t.shape[1])
            } else {
                vec![0.0; (t.shape[0] * t.shape[1]) as usize]
            };
            (t.name, HostTensor::from_f32(&values, &t.shape))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_model_names_resolve_elsewhere() {
        let dir = std::env::temp_dir().join(format!("xtrain-base-{}", std::process::id()));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snap = dir
            .join("hub/models--meta-llama--Llama-3.1-8B/snapshots")
            .join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        assert_eq!(
            base_model(&snap),
            BaseModel {
                name: "meta-llama/Llama-3.1-8B".into(),
                revision: Some(commit.into())
            }
        );
        // A snapshot not named by a commit has no revision to record.
        let odd = dir.join("hub/models--meta-llama--Llama-3.1-8B/snapshots/0123abcd");
        std::fs::create_dir_all(&odd).unwrap();
        assert_eq!(base_model(&odd).revision, None);
        let plain = dir.join("my-model");
        std::fs::create_dir_all(&plain).unwrap();
        let BaseModel { name, revision } = base_model(&plain);
        assert!(Path::new(&name).is_absolute(), "{name}");
        assert!(name.ends_with("my-model"), "{name}");
        assert_eq!(revision, None);
        // A relative path becomes absolute.
        let rel = base_model(Path::new("no-such-dir")).name;
        assert!(Path::new(&rel).is_absolute(), "{rel}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A pattern key matches a module's name at its end, after a dot or from its start, as a
    /// regular expression; keys matching one module with different values are refused.
    #[test]
    fn patterns_match_as_peft_matches_them() {
        let lora = LoraConfig {
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: vec![Projection::Q, Projection::V],
        };
        let p = Patterns {
            rank: vec![
                ("q_proj".into(), 4),
                (r"model\.layers\.1\..*v_proj".into(), 2),
            ],
            alpha: vec![("self_attn.v_proj".into(), 64.0)],
        };
        assert_eq!(p.module(&lora, Projection::Q, 0).unwrap(), (4, 16.0));
        assert_eq!(p.module(&lora, Projection::V, 0).unwrap(), (8, 64.0));
        assert_eq!(p.module(&lora, Projection::V, 1).unwrap(), (2, 64.0));
        assert_eq!(p.module(&lora, Projection::K, 1).unwrap(), (8, 16.0));
        // `_proj` alone does not match the end of `q_proj` after a dot.
        let p = Patterns {
            rank: vec![("_proj".into(), 4)],
            alpha: vec![],
        };
        assert_eq!(p.module(&lora, Projection::Q, 0).unwrap(), (8, 16.0));
        let p = Patterns {
            rank: vec![],
            alpha: vec![("q_proj".into(), 1.0), ("self_attn.q_proj".into(), 2.0)],
        };
        let e = p.module(&lora, Projection::Q, 0).unwrap_err().to_string();
        assert!(
            e.contains("both match model.layers.0.self_attn.q_proj"),
            "{e}"
        );
    }
}

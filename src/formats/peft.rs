//! PEFT LoRA adapters on disk: `adapter_config.json` + `adapter_model.safetensors`, with PEFT's
//! tensor names, loadable by `peft.PeftModel.from_pretrained`; and a fresh adapter, initialised as
//! PEFT initialises one.

use crate::formats::host::convert;
use crate::formats::safetensors::{self, SafeTensors};
use crate::model::config::LlamaConfig;
use crate::model::lora::{kaiming_uniform, LoraConfig, SplitMix, Target};
use crate::model::tensors::lora_tensors;
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::collections::BTreeMap;
use std::path::Path;

/// Read `adapter_config.json`.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
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
    let r = field("r")
        .and_then(|v| v.as_i64())
        .with_context(|| format!("{}: no integer `r`", path.display()))?;
    let alpha = field("lora_alpha")
        .and_then(|v| v.as_f64())
        .with_context(|| format!("{}: no `lora_alpha`", path.display()))?;
    let dropout = field("lora_dropout")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);
    let targets = match field("target_modules") {
        Some(serde_json::Value::Array(a)) => {
            let mut t: Vec<Target> = a
                .iter()
                .map(|v| Target::parse(v.as_str().unwrap_or("?")))
                .collect::<Result<_>>()
                .with_context(|| format!("in {}", path.display()))?;
            t.sort();
            t.dedup();
            t
        }
        _ => bail!(
            "{}: `target_modules` must be a list of module names",
            path.display()
        ),
    };
    Ok(LoraConfig {
        r,
        alpha,
        dropout,
        targets,
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
    for t in lora_tensors(cfg, lora) {
        let info = st.info(&t.name)?;
        if info.shape != t.shape {
            bail!(
                "{}: tensor `{}` has shape {:?} but rank {} on this model needs {:?}",
                path.display(),
                t.name,
                info.shape,
                lora.r,
                t.shape
            );
        }
        out.insert(
            t.name.clone(),
            convert(&st.read(&t.name)?, ElementType::F32)?,
        );
    }
    if let Some(extra) = st.tensors.keys().find(|k| !out.contains_key(*k)) {
        bail!(
            "{}: tensor `{extra}` is not part of a rank-{} adapter on {}",
            path.display(),
            lora.r,
            Target::list(&lora.targets)
        );
    }
    Ok(out)
}

/// Write an adapter dir: both files atomically, into `dir` (created if needed).
pub fn write(
    dir: &Path,
    lora: &LoraConfig,
    tensors: &BTreeMap<String, HostTensor>,
    base_model: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let targets: Vec<&str> = lora.targets.iter().map(|t| t.module()).collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
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

/// Load an adapter dir (config + tensors) for a model.
pub fn load_adapter(
    dir: &Path,
    cfg: &LlamaConfig,
) -> Result<(LoraConfig, BTreeMap<String, HostTensor>)> {
    let c = read_config(dir)?;
    let t = read_tensors(dir, cfg, &c).with_context(|| format!("adapter {}", dir.display()))?;
    Ok((c, t))
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

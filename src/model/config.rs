//! The model configuration, read from a Hugging Face `config.json`.
//!
//! Both the Llama 3.1 form (top-level `rope_theta` + `rope_scaling`) and transformers 5's form
//! (`rope_parameters` holding both) are accepted. Values xtrain cannot honour are errors that name
//! the field, never silent defaults.

use anyhow::{bail, Context, Result};
use serde_json::Value as Json;
use std::path::Path;

/// Llama 3's frequency-dependent RoPE scaling.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: i64,
}

fn get<'a>(j: &'a Json, key: &str) -> Option<&'a Json> {
    j.get(key).filter(|v| !v.is_null())
}

fn int(j: &Json, key: &str) -> Result<i64> {
    let v = get(j, key).with_context(|| format!("field `{key}` is missing"))?;
    let n = v
        .as_i64()
        .with_context(|| format!("field `{key}` must be an integer, found {v}"))?;
    if n <= 0 {
        bail!("field `{key}` must be positive, found {n}");
    }
    Ok(n)
}

fn float(j: &Json, key: &str) -> Result<f64> {
    let v = get(j, key).with_context(|| format!("field `{key}` is missing"))?;
    v.as_f64()
        .with_context(|| format!("field `{key}` must be a number, found {v}"))
}

fn expect(j: &Json, key: &str, ok: impl Fn(&Json) -> bool, what: &str) -> Result<()> {
    if let Some(v) = get(j, key) {
        if !ok(v) {
            bail!("field `{key}` = {v} is not supported (xtrain supports {what})");
        }
    }
    Ok(())
}

impl LlamaConfig {
    /// Read `config.json` from a model directory (or the file itself).
    pub fn load(path: &Path) -> Result<LlamaConfig> {
        if !path.exists() {
            bail!("model directory {} does not exist", path.display());
        }
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        let json: Json = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", file.display()))?;
        LlamaConfig::from_json(&json).with_context(|| format!("in {}", file.display()))
    }

    pub fn from_json(j: &Json) -> Result<LlamaConfig> {
        if !j.is_object() {
            bail!("config must be a JSON object");
        }
        expect(j, "model_type", |v| v == "llama", "\"llama\"")?;
        expect(j, "hidden_act", |v| v == "silu", "\"silu\"")?;
        expect(j, "attention_bias", |v| v == false, "false")?;
        expect(j, "mlp_bias", |v| v == false, "false")?;
        expect(j, "pretraining_tp", |v| v == 1, "1")?;
        let hidden = int(j, "hidden_size")?;
        let heads = int(j, "num_attention_heads")?;
        let kv_heads = match get(j, "num_key_value_heads") {
            Some(_) => int(j, "num_key_value_heads")?,
            None => heads,
        };
        if heads % kv_heads != 0 {
            bail!("field `num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` ({kv_heads})");
        }
        let head_dim = match get(j, "head_dim") {
            Some(_) => int(j, "head_dim")?,
            None => {
                if hidden % heads != 0 {
                    bail!("field `hidden_size` ({hidden}) is not divisible by `num_attention_heads` ({heads}) and `head_dim` is not given");
                }
                hidden / heads
            }
        };
        if head_dim % 2 != 0 {
            bail!("field `head_dim` = {head_dim} must be even for rotary embeddings");
        }

        // RoPE: transformers 5 nests everything in `rope_parameters`; 4.x has `rope_theta` at the
        // top and the scaling in `rope_scaling`.
        let (theta, scaling) = match get(j, "rope_parameters") {
            Some(p) => (
                float(p, "rope_theta").context("in `rope_parameters`")?,
                Some(p),
            ),
            None => (
                get(j, "rope_theta").map_or(Ok(10000.0), |_| float(j, "rope_theta"))?,
                get(j, "rope_scaling"),
            ),
        };
        let rope_scaling = match scaling {
            None => None,
            Some(s) => {
                let field = if get(j, "rope_parameters").is_some() {
                    "rope_parameters"
                } else {
                    "rope_scaling"
                };
                let kind = get(s, "rope_type")
                    .or_else(|| get(s, "type"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                match kind {
                    "default" => None,
                    "llama3" => Some(Llama3Scaling {
                        factor: float(s, "factor").with_context(|| format!("in `{field}`"))?,
                        low_freq_factor: float(s, "low_freq_factor").with_context(|| format!("in `{field}`"))?,
                        high_freq_factor: float(s, "high_freq_factor").with_context(|| format!("in `{field}`"))?,
                        original_max_position_embeddings: float(s, "original_max_position_embeddings")
                            .with_context(|| format!("in `{field}`"))?,
                    }),
                    other => bail!(
                        "field `{field}.rope_type` = \"{other}\" is not supported (xtrain supports \"default\" and \"llama3\")"
                    ),
                }
            }
        };
        let tie = match get(j, "tie_word_embeddings") {
            None => false,
            Some(v) => v.as_bool().with_context(|| {
                format!("field `tie_word_embeddings` must be true or false, found {v}")
            })?,
        };
        Ok(LlamaConfig {
            vocab_size: int(j, "vocab_size")?,
            hidden_size: hidden,
            intermediate_size: int(j, "intermediate_size")?,
            num_hidden_layers: int(j, "num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: get(j, "rms_norm_eps").map_or(Ok(1e-6), |_| float(j, "rms_norm_eps"))?,
            rope_theta: theta,
            rope_scaling,
            tie_word_embeddings: tie,
            max_position_embeddings: get(j, "max_position_embeddings")
                .map_or(Ok(2048), |_| int(j, "max_position_embeddings"))?,
        })
    }

    /// Rotary inverse frequencies, one per pair of head dims, with llama3 scaling applied.
    /// Computed in f32 the way transformers does, so positions rotate identically.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as usize;
        let base = self.rope_theta as f32;
        let mut inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        if let Some(s) = &self.rope_scaling {
            let (factor, lo, hi, old) = (
                s.factor as f32,
                s.low_freq_factor as f32,
                s.high_freq_factor as f32,
                s.original_max_position_embeddings as f32,
            );
            let low_wavelen = old / lo;
            let high_wavelen = old / hi;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                *f = if wavelen < high_wavelen {
                    *f
                } else if wavelen > low_wavelen {
                    *f / factor
                } else {
                    let smooth = (old / wavelen - lo) / (hi - lo);
                    (1.0 - smooth) * *f / factor + smooth * *f
                };
            }
        }
        inv
    }

    /// Number of parameters of the base model.
    pub fn param_count(&self) -> i64 {
        let (h, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

//! The model configuration, read from a Hugging Face `config.json`: one configuration for the
//! Llama-architecture families xtrain trains (`model_type` `llama`, `qwen2`, `qwen3`, `mistral`),
//! whose differences are switches of [`LlamaConfig`]: biases on the q/k/v projections (Qwen2),
//! RMSNorm of each query and key head (Qwen3), an explicit head size, the RoPE kind, tied
//! embeddings and a sliding attention window.
//!
//! Both the 4.x form (top-level `rope_theta`, scaling in `rope_scaling`) and transformers 5's
//! form (`rope_parameters` holding both) are accepted. A field missing from config.json takes
//! the default transformers gives that family. Values xtrain cannot honour are errors that name
//! the field, never silent defaults; a model type xtrain does not train is refused with the
//! reason and the families it does.

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

/// The family a checkpoint is (config.json's `model_type`): what its files are called and
/// which defaults its config takes. The graph itself reads only the switches of
/// [`LlamaConfig`], never the family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    #[default]
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Mistral];

    /// config.json's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
        }
    }

    /// config.json's `architectures` entry for the causal LM.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
        }
    }

    pub fn is_llama(&self) -> bool {
        *self == Family::Llama
    }

    /// `max_position_embeddings` when config.json leaves it out (transformers' class default).
    fn default_positions(self) -> i64 {
        match self {
            Family::Llama => 2048,
            Family::Qwen2 | Family::Qwen3 => 32768,
            Family::Mistral => 131072,
        }
    }
}

/// `model_type`s of other architectures, each with what xtrain would need to train it.
const REFUSED: &[(&str, &str)] = &[
    ("gemma", "Gemma's GeGLU MLP, (1 + g) norms and scaled embeddings are not implemented"),
    ("gemma2", "Gemma 2's GeGLU MLP, extra norms, logit soft-capping and alternating sliding windows are not implemented"),
    ("gemma3", "Gemma 3's GeGLU MLP, extra norms, q/k norms and alternating sliding windows are not implemented"),
    ("gemma3_text", "Gemma 3's GeGLU MLP, extra norms, q/k norms and alternating sliding windows are not implemented"),
    ("phi3", "Phi-3's fused qkv_proj and gate_up_proj weights are not implemented"),
    ("phi", "Phi's parallel attention and MLP with LayerNorm are not implemented"),
    ("mixtral", "mixture-of-experts layers (a router over expert MLPs) are not implemented"),
    ("qwen2_moe", "mixture-of-experts layers (a router over expert MLPs) are not implemented"),
    ("qwen3_moe", "mixture-of-experts layers (a router over expert MLPs) are not implemented"),
    ("deepseek_v2", "mixture-of-experts layers and multi-head latent attention are not implemented"),
    ("deepseek_v3", "mixture-of-experts layers and multi-head latent attention are not implemented"),
    ("dbrx", "mixture-of-experts layers (a router over expert MLPs) are not implemented"),
    ("olmoe", "mixture-of-experts layers (a router over expert MLPs) are not implemented"),
    ("granitemoe", "mixture-of-experts layers (a router over expert MLPs) are not implemented"),
];

/// What xtrain trains, for messages.
pub const SUPPORTED: &str = "llama (Llama 2/3.x, SmolLM2), qwen2 (Qwen2, Qwen2.5), qwen3 (Qwen3 \
                             dense) and mistral (Mistral 7B, Mistral Nemo)";

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
    /// The family the checkpoint is (its `model_type`); left out of manifests for Llama.
    #[serde(default, skip_serializing_if = "Family::is_llama")]
    pub family: Family,
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
    /// The q, k and v projections add a bias (`q_proj.bias`, ...; Qwen2); o_proj has none.
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// Each query and key head is RMS-normed over its head_dim before RoPE, by one weight per
    /// layer shared by the heads (`q_norm.weight`, `k_norm.weight`; Qwen3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// A query sees at most this many keys back (itself included) in the layers that slide
    /// (Mistral v0.1's 4096; Qwen2's with `use_sliding_window`). The step is exact while a
    /// sequence is no longer than the window, and refuses longer ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<i64>,
}

fn is_false(b: &bool) -> bool {
    !*b
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

fn boolean(j: &Json, key: &str, default: bool) -> Result<bool> {
    match get(j, key) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .with_context(|| format!("field `{key}` must be true or false, found {v}")),
    }
}

fn expect(j: &Json, key: &str, ok: impl Fn(&Json) -> bool, what: &str) -> Result<()> {
    if let Some(v) = get(j, key) {
        if !ok(v) {
            bail!("field `{key}` = {v} is not supported (xtrain supports {what})");
        }
    }
    Ok(())
}

/// The family named by `model_type` (a config without one is taken as Llama's), or the refusal.
fn family(j: &Json) -> Result<Family> {
    let Some(v) = get(j, "model_type") else {
        return Ok(Family::Llama);
    };
    let name = v
        .as_str()
        .with_context(|| format!("field `model_type` must be a string, found {v}"))?;
    if let Some(f) = Family::ALL.iter().find(|f| f.model_type() == name) {
        return Ok(*f);
    }
    match REFUSED.iter().find(|(t, _)| *t == name) {
        Some((_, why)) => bail!(
            "field `model_type` = \"{name}\" is not supported: {why}. xtrain trains {SUPPORTED}"
        ),
        None => {
            bail!("field `model_type` = \"{name}\" is not supported. xtrain trains {SUPPORTED}")
        }
    }
}

/// The switches config.json may turn on that a family's graph does not have: refused by name.
fn check_switches(j: &Json, family: Family) -> Result<()> {
    expect(j, "hidden_act", |v| v == "silu", "\"silu\"")?;
    expect(j, "mlp_bias", |v| v == false, "false")?;
    expect(j, "pretraining_tp", |v| v == 1, "1")?;
    let why = match family {
        // Qwen2 always has q/k/v biases and reads no such field.
        Family::Qwen2 => return Ok(()),
        Family::Llama | Family::Mistral => {
            "this family's attention_bias puts a bias on all four \
                                           attention projections, o_proj included"
        }
        Family::Qwen3 => "Qwen3's attention_bias puts a bias on o_proj too",
    };
    if get(j, "attention_bias").is_some_and(|v| v != false) {
        bail!(
            "field `attention_bias` = {} is not supported: {why}, which xtrain does not \
             implement (xtrain supports false, and Qwen2's q/k/v biases)",
            j["attention_bias"]
        );
    }
    Ok(())
}

/// The sliding window as transformers applies it: Mistral's `sliding_window` (4096 when the field
/// is absent, none when it is null); Qwen2's and Qwen3's only with `use_sliding_window` and on
/// the layers from `max_window_layers` on (or those `layer_types` names `sliding_attention`).
fn sliding_window(j: &Json, family: Family, layers: i64) -> Result<Option<i64>> {
    let window = || int(j, "sliding_window").map(Some);
    match family {
        Family::Llama => Ok(None),
        Family::Mistral => match j.get("sliding_window") {
            None => Ok(Some(4096)),
            Some(Json::Null) => Ok(None),
            Some(_) => window(),
        },
        Family::Qwen2 | Family::Qwen3 => {
            let sliding_layers = match get(j, "layer_types") {
                Some(Json::Array(types)) => types
                    .iter()
                    .filter(|t| *t != "full_attention")
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(1),
                        _ => bail!("field `layer_types` holds {t}, which is neither \"full_attention\" nor \"sliding_attention\""),
                    })
                    .sum::<Result<i64>>()?,
                Some(v) => bail!("field `layer_types` must be a list, found {v}"),
                None => {
                    if !boolean(j, "use_sliding_window", false)? || get(j, "sliding_window").is_none() {
                        return Ok(None);
                    }
                    let from = get(j, "max_window_layers").map_or(Ok(28), |_| int(j, "max_window_layers"))?;
                    (layers - from).max(0)
                }
            };
            if sliding_layers == 0 {
                return Ok(None);
            }
            window()
        }
    }
}

/// RoPE's base and scaling: transformers 5 nests both in `rope_parameters`; 4.x has `rope_theta`
/// at the top and the scaling in `rope_scaling`.
fn rope(j: &Json) -> Result<(f64, Option<Llama3Scaling>)> {
    let (theta, scaling, field) = match get(j, "rope_parameters") {
        Some(p) => (
            get(p, "rope_theta")
                .map_or(Ok(10000.0), |_| float(p, "rope_theta"))
                .context("in `rope_parameters`")?,
            Some(p),
            "rope_parameters",
        ),
        None => (
            get(j, "rope_theta").map_or(Ok(10000.0), |_| float(j, "rope_theta"))?,
            get(j, "rope_scaling"),
            "rope_scaling",
        ),
    };
    let Some(s) = scaling else {
        return Ok((theta, None));
    };
    let kind = get(s, "rope_type")
        .or_else(|| get(s, "type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let f = |key: &str| float(s, key).with_context(|| format!("in `{field}`"));
    let scaling = match kind {
        "default" => None,
        "llama3" => Some(Llama3Scaling {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: f("original_max_position_embeddings")?,
        }),
        other => bail!(
            "field `{field}.rope_type` = \"{other}\" is not supported (xtrain supports \"default\" and \"llama3\")"
        ),
    };
    Ok((theta, scaling))
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
        let family = family(j)?;
        check_switches(j, family)?;
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
            // Qwen3's class default; the others divide the hidden size.
            None if family == Family::Qwen3 => 128,
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
        let (rope_theta, rope_scaling) = rope(j)?;
        let layers = int(j, "num_hidden_layers")?;
        Ok(LlamaConfig {
            family,
            vocab_size: int(j, "vocab_size")?,
            hidden_size: hidden,
            intermediate_size: int(j, "intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: get(j, "rms_norm_eps").map_or(Ok(1e-6), |_| float(j, "rms_norm_eps"))?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: boolean(j, "tie_word_embeddings", false)?,
            max_position_embeddings: get(j, "max_position_embeddings")
                .map_or(Ok(family.default_positions()), |_| {
                    int(j, "max_position_embeddings")
                })?,
            qkv_bias: family == Family::Qwen2,
            qk_norm: family == Family::Qwen3,
            sliding_window: sliding_window(j, family, layers)?,
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
        let mut layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

/// Each family's released config.json forms, read into the one configuration; the refusals.
#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(j: Json) -> Result<LlamaConfig> {
        LlamaConfig::from_json(&j)
    }

    /// Qwen2.5-0.5B's shape as released (4.x form, a sliding window that is off).
    fn qwen25() -> Json {
        json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "sliding_window": 32768, "use_sliding_window": false, "max_window_layers": 21,
            "tie_word_embeddings": true, "attention_dropout": 0.0})
    }

    #[test]
    fn qwen2_has_qkv_biases_and_its_window_only_with_use_sliding_window() {
        let c = read(qwen25()).unwrap();
        assert_eq!(c.family, Family::Qwen2);
        assert!(c.qkv_bias && !c.qk_norm && c.tie_word_embeddings);
        assert_eq!(
            (c.head_dim, c.sliding_window, c.rope_theta),
            (64, None, 1e6)
        );
        // transformers 5's form: rope_parameters and layer_types.
        let mut v5 = qwen25();
        let o = v5.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            json!({"rope_theta": 1000000.0, "rope_type": "default"}),
        );
        o.insert("layer_types".into(), json!(vec!["full_attention"; 24]));
        assert_eq!(read(v5).unwrap(), c);
        // On: the layers from max_window_layers slide.
        let mut on = qwen25();
        on["use_sliding_window"] = json!(true);
        assert_eq!(read(on.clone()).unwrap().sliding_window, Some(32768));
        on["max_window_layers"] = json!(24);
        assert_eq!(read(on).unwrap().sliding_window, None, "no layer slides");
        let mut types = qwen25();
        let mut lt = vec!["full_attention"; 24];
        lt[23] = "sliding_attention";
        types["layer_types"] = json!(lt);
        assert_eq!(read(types).unwrap().sliding_window, Some(32768));
    }

    #[test]
    fn qwen3_norms_query_and_key_heads_and_takes_head_dim_as_given() {
        let j = json!({"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
            "attention_bias": false, "sliding_window": null, "use_sliding_window": false,
            "max_window_layers": 28, "tie_word_embeddings": true, "hidden_act": "silu"});
        let c = read(j.clone()).unwrap();
        assert_eq!(c.family, Family::Qwen3);
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!((c.head_dim, c.sliding_window), (128, None));
        let mut no_dim = j.clone();
        no_dim.as_object_mut().unwrap().remove("head_dim");
        assert_eq!(read(no_dim).unwrap().head_dim, 128, "Qwen3's class default");
        let mut bias = j;
        bias["attention_bias"] = json!(true);
        let e = format!("{:#}", read(bias).unwrap_err());
        assert!(
            e.contains("`attention_bias` = true is not supported") && e.contains("o_proj"),
            "{e}"
        );
    }

    #[test]
    fn mistral_slides_only_where_its_config_says_and_4096_when_the_field_is_absent() {
        let nemo = json!({"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
            "sliding_window": null, "max_position_embeddings": 1024000, "hidden_act": "silu"});
        let c = read(nemo.clone()).unwrap();
        assert_eq!(c.family, Family::Mistral);
        assert_eq!((c.head_dim, c.sliding_window), (128, None));
        assert!(!c.qkv_bias && !c.qk_norm && !c.tie_word_embeddings);
        let mut v01 = nemo.clone();
        v01["sliding_window"] = json!(4096);
        assert_eq!(read(v01).unwrap().sliding_window, Some(4096));
        let mut absent = nemo;
        absent.as_object_mut().unwrap().remove("sliding_window");
        assert_eq!(read(absent).unwrap().sliding_window, Some(4096));
    }

    #[test]
    fn other_architectures_and_unimplemented_switches_are_refused_with_the_reason() {
        let llama = json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512});
        let with = |k: &str, v: Json| {
            let mut j = llama.clone();
            j[k] = v;
            format!("{:#}", read(j).unwrap_err())
        };
        for (ty, why) in [
            ("gemma2", "GeGLU"),
            ("phi3", "fused qkv_proj"),
            ("mixtral", "mixture-of-experts"),
            ("qwen3_moe", "mixture-of-experts"),
            ("falcon", "is not supported. xtrain trains"),
        ] {
            let e = with("model_type", json!(ty));
            assert!(e.contains(why) && e.contains(SUPPORTED), "{ty}: {e}");
        }
        let e = with("attention_bias", json!(true));
        assert!(
            e.contains("field `attention_bias` = true is not supported"),
            "{e}"
        );
        let e = with("mlp_bias", json!(true));
        assert!(
            e.contains("field `mlp_bias` = true is not supported"),
            "{e}"
        );
        assert_eq!(read(llama).unwrap().family, Family::Llama);
    }
}

//! `xtrain import-gguf`: a GGUF file of an architecture in [`super::arch::ARCHS`] as a Hugging
//! Face model directory (config.json, model.safetensors in f32, generation_config.json,
//! tokenizer.json, tokenizer_config.json). Everything is checked before a tensor is read (the
//! metadata, the vocabulary, every tensor's name and shape against the model the metadata
//! describes); then the tensors are dequantized, put back in Hugging Face's row order and
//! written one at a time, so memory holds about one tensor in f32, never the model.

use super::arch::{self, hf_name, Hparam, Kind, Missing, Toward, HPARAMS};
use super::ggml::{arch_key, hparam, key};
use super::read::{Gguf, Meta, TensorInfo};
use crate::model::config::{Family, LlamaConfig};
use anyhow::{bail, Context, Result};
use pjrt::ElementType;
use serde_json::{json, Value as Json};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

/// A hyperparameter's value in the file, if it has one of the kind's type. A float the file
/// holds in f32 (as llama.cpp writes them) is given as the shortest decimal that is that f32,
/// as config.json had it: 1e-06, not 9.99999997e-07.
fn hparam_value(g: &Gguf, arch: &str, h: &Hparam) -> Option<Json> {
    let m = g.get(&arch_key(arch, h.key))?;
    match h.kind {
        Kind::Int => m.as_i64().map(Json::from),
        Kind::Float => m.as_f64().map(|v| {
            let single = v as f32;
            match (single as f64 == v).then(|| single.to_string().parse::<f64>()) {
                Some(Ok(shortest)) => Json::from(shortest),
                _ => Json::from(v),
            }
        }),
    }
}

/// The architecture of a GGUF file and the family it imports as ([`arch::Arch::family_in`]),
/// with the reason where that is not the architecture's first family.
pub fn arch_and_family(g: &Gguf) -> Result<(&'static arch::Arch, (Family, Option<String>))> {
    let name = g.str(key::ARCHITECTURE).unwrap_or("");
    let Some(a) = arch::arch(name) else {
        bail!(
            "{} is `{name}`; xtrain imports {}",
            key::ARCHITECTURE,
            arch::arch_names()
        );
    };
    let names: Vec<&str> = [key::NAME, key::BASENAME]
        .iter()
        .filter_map(|k| g.str(k))
        .collect();
    let llama3_rope = g.tensor(arch::ROPE_FREQS).is_some();
    Ok((a, a.family_in(g.str(key::MODEL_TYPE), &names, llama3_rope)?))
}

/// The HF config of a GGUF file of one of [`arch::ARCHS`].
pub fn hf_config(g: &Gguf) -> Result<Json> {
    if g.str(key::TYPE) == Some("adapter") {
        bail!(
            "this is a LoRA adapter GGUF ({} = adapter), not a model: import-gguf converts \
             models; give the base model's GGUF (llama.cpp applies the adapter with --lora)",
            key::TYPE
        );
    }
    let (a, (family, _)) = arch_and_family(g)?;
    let mut c = json!({
        "architectures": [family.architecture()],
        "model_type": family.model_type(),
        "hidden_act": "silu",
        "mlp_bias": false,
    });
    // The switches of the family's config that llama.cpp's architecture fixes.
    match family {
        Family::Llama => c["attention_bias"] = json!(false),
        // llama.cpp's `llama` attends over the whole context; without the field transformers
        // would slide Mistral's attention over 4096 tokens.
        Family::Mistral => {
            c["attention_bias"] = json!(false);
            c["sliding_window"] = Json::Null;
        }
        Family::Qwen2 => c["use_sliding_window"] = json!(false),
        Family::Qwen3 => {
            c["attention_bias"] = json!(false);
            c["use_sliding_window"] = json!(false);
        }
    }
    // The key that gave each field, for a second key of the same field that disagrees.
    let mut given: BTreeMap<&str, String> = BTreeMap::new();
    for h in HPARAMS {
        let k = arch_key(a.name, h.key);
        match (hparam_value(g, a.name, h), c.get(h.field)) {
            (Some(v), Some(first)) if *first != v => bail!(
                "{k} = {v} but {} = {first}: xtrain's model has one {} for both (its heads rotate \
                 and give values over their whole width)",
                given[h.field],
                h.field
            ),
            (Some(v), None) => {
                c[h.field] = v;
                given.insert(h.field, k);
            }
            (None, None) => match h.missing {
                Missing::Refuse => {
                    bail!("GGUF metadata `{k}` is missing or not an integer")
                }
                Missing::Default(d) => {
                    c[h.field] = match h.kind {
                        Kind::Int => json!(d as i64),
                        Kind::Float => json!(d),
                    }
                }
                Missing::Derived => {}
            },
            _ => {}
        }
    }
    derive_missing(g, &mut c)?;
    if let Some(kind) = g
        .str(&arch_key(a.name, hparam::ROPE_SCALING_TYPE))
        .filter(|k| *k != "none")
    {
        bail!(
            "{} = {kind}: xtrain supports no RoPE scaling but Llama 3's (carried by the tensor \
             {}); the model would not be the same",
            arch_key(a.name, hparam::ROPE_SCALING_TYPE),
            arch::ROPE_FREQS
        );
    }
    c["tie_word_embeddings"] = json!(g.tensor("output.weight").is_none());
    c["torch_dtype"] = json!("float32");
    for (k, id_key) in [
        ("bos_token_id", key::BOS_ID),
        ("eos_token_id", key::EOS_ID),
        ("pad_token_id", key::PADDING_ID),
    ] {
        if let Some(v) = g.int(id_key) {
            c[k] = json!(v);
        }
    }
    if let Some(t) = g.tensor(arch::ROPE_FREQS) {
        c["rope_scaling"] = llama3_scaling(g, t, &c)?;
    }
    Ok(c)
}

/// The fields the file may leave to be derived: the KV heads (as many as the heads), a head's
/// width (the hidden size over the heads) and the vocabulary (the tokenizer's tokens).
fn derive_missing(g: &Gguf, c: &mut Json) -> Result<()> {
    let int = |c: &Json, f: &str| c.get(f).and_then(|v| v.as_i64()).unwrap_or(0);
    if c.get("num_key_value_heads").is_none() {
        c["num_key_value_heads"] = json!(int(c, "num_attention_heads"));
    }
    if c.get("head_dim").is_none() {
        c["head_dim"] = json!(int(c, "hidden_size") / int(c, "num_attention_heads").max(1));
    }
    if c.get("vocab_size").is_none() {
        match g.get(key::TOKENS) {
            Some(Meta::Array(a)) => c["vocab_size"] = json!(a.len()),
            _ => bail!("cannot tell the vocabulary size"),
        }
    }
    Ok(())
}

/// `rope_scaling` of config `c` from the per-frequency divisors llama.cpp's converter writes for
/// Llama 3's scaling (`rope_freqs.weight`): the divisor of the lowest frequencies is the factor,
/// and every divisor must be what Llama 3's published scaling with that factor gives (low and
/// high frequency factors 1 and 4 over an original context of 8,192; every Llama 3.1, 3.2 and
/// 3.3 model). Other divisors are refused: the imported model would rotate differently.
fn llama3_scaling(g: &Gguf, t: &TensorInfo, c: &Json) -> Result<Json> {
    let divisors = g
        .dequantize(t)
        .with_context(|| format!("tensor `{}`", t.name))?;
    let most = divisors.iter().copied().fold(f32::NAN, f32::max);
    // The divisor is the factor up to f32 rounding; published factors are whole numbers.
    let factor = if (most - most.round()).abs() <= 1e-4 * most.abs() {
        most.round() as f64
    } else {
        most as f64
    };
    let scaling = json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    });
    let mut with = c.clone();
    with["rope_scaling"] = scaling.clone();
    let cfg = LlamaConfig::from_json(&with)?;
    let want = arch::rope_freqs(&cfg).unwrap_or_default();
    // A NaN divisor is not close to anything (every comparison with NaN is false).
    let close = |got: f32, want: f32| (got - want).abs() <= 1e-4 * want.abs();
    let differs = (divisors.len() != want.len())
        .then_some(0)
        .or_else(|| (0..want.len()).find(|&i| !close(divisors[i], want[i])));
    if let Some(i) = differs {
        bail!(
            "tensor `{}` holds {} RoPE divisors, and they are not Llama 3's scaling with factor \
             {factor} (low and high frequency factors 1 and 4, original context 8192: {} \
             divisors, the {i}th {}; the file's is {}): xtrain cannot carry another scaling",
            t.name,
            divisors.len(),
            want.len(),
            want.get(i).copied().unwrap_or(f32::NAN),
            divisors.get(i).copied().unwrap_or(f32::NAN),
        );
    }
    Ok(scaling)
}

/// generation_config.json as transformers writes one from a model config: the special token
/// ids (the end-of-turn token too, when the GGUF names one other than end-of-sequence), so
/// `generate` stops where the model's own runtime stops.
pub fn hf_generation_config(g: &Gguf) -> Json {
    let mut c = json!({"_from_model_config": true});
    if let Some(b) = g.int(key::BOS_ID) {
        c["bos_token_id"] = json!(b);
    }
    match (g.int(key::EOS_ID), g.int(key::EOT_ID)) {
        (Some(e), Some(t)) if e != t => c["eos_token_id"] = json!([e, t]),
        (Some(e), _) | (None, Some(e)) => c["eos_token_id"] = json!(e),
        (None, None) => {}
    }
    if let Some(p) = g.int(key::PADDING_ID) {
        c["pad_token_id"] = json!(p);
    }
    c
}

/// Each tensor of the file that is a weight of the model `cfg` (Hugging Face's name, the
/// tensor), checked before any is read: every tensor has a Hugging Face name, every weight of
/// the model is there, each with the shape the model gives it, and no tensor is left over.
fn weights_of<'g>(
    g: &'g Gguf,
    cfg: &LlamaConfig,
    path: &Path,
) -> Result<Vec<(String, &'g TensorInfo)>> {
    let mut found = BTreeMap::new();
    for t in g.tensors.iter().filter(|t| t.name != arch::ROPE_FREQS) {
        let Some(name) = hf_name(&t.name) else {
            bail!(
                "{}: tensor `{}` has no place in the models xtrain trains (it maps {}), and \
                 leaving it out would change the model",
                path.display(),
                t.name,
                arch::gguf_names()
            );
        };
        found.insert(name, t);
    }
    let files = crate::model::tensors::frozen_weights(cfg);
    if let Some((missing, _)) = files.iter().find(|(n, _)| !found.contains_key(n)) {
        bail!("{}: no tensor for `{missing}`", path.display());
    }
    // Every tensor has the shape the config derived from the metadata gives it, and no tensor
    // is left over (a block past block_count, an output beside tied embeddings).
    let shapes: BTreeMap<&str, &Vec<i64>> = files.iter().map(|(n, s)| (n.as_str(), s)).collect();
    for (name, t) in &found {
        match shapes.get(name.as_str()) {
            None => bail!(
                "{}: tensor `{name}` is not part of the {} model its metadata describes ({} \
                 blocks, {} embeddings, {} q/k/v biases, {} q/k norms)",
                path.display(),
                cfg.family.model_type(),
                cfg.num_hidden_layers,
                if cfg.tie_word_embeddings {
                    "tied"
                } else {
                    "untied"
                },
                if cfg.qkv_bias { "with" } else { "no" },
                if cfg.qk_norm { "with" } else { "no" },
            ),
            Some(&want) if *want != t.hf_dims() => bail!(
                "{}: tensor `{name}` is {:?} but the metadata's model (hidden {}, heads {} of \
                 {}, kv heads {}, intermediate {}, vocabulary {}) needs {want:?}",
                path.display(),
                t.hf_dims(),
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.head_dim,
                cfg.num_key_value_heads,
                cfg.intermediate_size,
                cfg.vocab_size
            ),
            Some(_) => {}
        }
    }
    Ok(found.into_iter().collect())
}

/// One weight in f32, in Hugging Face's layout; a value that is not finite (NaN, infinite) is
/// refused, naming the tensor and the element: training from it fails at the first step.
fn hf_values(
    g: &Gguf,
    a: &arch::Arch,
    cfg: &LlamaConfig,
    name: &str,
    t: &TensorInfo,
) -> Result<Vec<f32>> {
    let values = g
        .dequantize(t)
        .with_context(|| format!("tensor `{}`", t.name))?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        bail!(
            "tensor `{}` ({name}): element {i} of {} (in the file's order) is {}, not a finite \
             number: the file is damaged or was written from a model that had diverged; xtrain \
             imports finite weights only",
            t.name,
            values.len(),
            values[i]
        );
    }
    Ok(a.reordered(cfg, name, values, &t.hf_dims(), Toward::Hf))
}

/// Write a Hugging Face model directory from a GGUF file: f32 weights (dequantized, q/k rows
/// in Hugging Face's order), config, generation config, tokenizer. The directory is written
/// whole under a temp name and put in place once complete: replacing whatever `out` held (a
/// sharded model's index and shards included) with [`Replace::Yes`], and only where `out` is
/// still free or empty with [`Replace::No`].
///
/// `progress(done, total)` after each tensor.
///
/// [`Replace::Yes`]: crate::formats::atomic::Replace::Yes
/// [`Replace::No`]: crate::formats::atomic::Replace::No
pub fn import(
    path: &Path,
    out: &Path,
    replace: crate::formats::atomic::Replace,
    mut progress: impl FnMut(usize, usize),
) -> Result<()> {
    let g = Gguf::open(path)?;
    let config = hf_config(&g).with_context(|| path.display().to_string())?;
    // Before the tensors (minutes for a large model): a vocabulary it cannot carry is refused.
    let (tokenizer, tconfig) =
        super::vocab::hf_tokenizer(&g).with_context(|| path.display().to_string())?;
    let cfg = LlamaConfig::from_json(&config)?;
    let a =
        arch::arch(g.str(key::ARCHITECTURE).unwrap_or_default()).context("checked by hf_config")?;
    let weights = weights_of(&g, &cfg, path)?;
    let table: Vec<(String, ElementType, Vec<i64>)> = weights
        .iter()
        .map(|(name, t)| (name.clone(), ElementType::F32, t.hf_dims()))
        .collect();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let total = weights.len();
    let mut done = 0;
    crate::formats::atomic::write_dir_atomic_as(out, replace, |tmp| {
        crate::formats::safetensors::write_streamed(
            &tmp.join("model.safetensors"),
            &table,
            &meta,
            |i| {
                let (name, t) = &weights[i];
                let values =
                    hf_values(&g, a, &cfg, name, t).with_context(|| path.display().to_string())?;
                done += 1;
                progress(done, total);
                Ok(Cow::Owned(
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ))
            },
        )?;
        let json = |name: &str, j: &Json, pretty: bool| {
            let text = if pretty {
                serde_json::to_string_pretty(j)?
            } else {
                serde_json::to_string(j)?
            };
            crate::formats::atomic::write_bytes_atomic(&tmp.join(name), text.as_bytes())
        };
        json("config.json", &config, true)?;
        json("tokenizer.json", &tokenizer, false)?;
        json("tokenizer_config.json", &tconfig, true)?;
        json("generation_config.json", &hf_generation_config(&g), true)
    })
}

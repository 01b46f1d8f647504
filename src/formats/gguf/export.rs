//! `xtrain export-gguf`: a model directory, with a LoRA adapter merged into it or on its own, as
//! a GGUF file llama.cpp (and Ollama, LM Studio) loads.
//!
//! The merged model: each weight read from the checkpoint as stored, in f32; an adapted
//! projection becomes W + (alpha/r) B A (per module with PEFT's rank and alpha patterns); for an
//! adapter trained with `--quant nf4` every projection is first replaced by its NF4 round trip,
//! the dequantized base the adapter was trained against. Then the llama.cpp layout: names
//! (`blk.N.attn_q.weight`...) and architecture (`llama` for Llama and Mistral, `qwen2`, `qwen3`:
//! [`super::arch`]), dims fastest first, for `llama` the rows of q and k per head reordered from
//! Hugging Face's two rotary halves to llama.cpp's interleaved pairs, llama3 RoPE scaling as the
//! per-frequency divisors `rope_freqs.weight`, a tied output left out (llama.cpp then reads
//! `token_embd`), and the tokenizer ([`super::vocab`]). Tensors are read, merged,
//! encoded and written one at a time, so memory holds about one tensor, never the model.
//!
//! The adapter alone (`--lora-only`): llama.cpp's LoRA adapter file, `general.type = adapter`,
//! `adapter.type = lora`, `adapter.lora.alpha`, and per adapted weight `<name>.lora_a` (PEFT's
//! A, [r, in]: dims [in, r]) and `<name>.lora_b` (PEFT's B, [out, r]: dims [r, out]), B's rows
//! of q and k reordered as the base's are, so that B A is reordered as W is.

use super::arch::{self, gguf_name, Kind, Toward, HPARAMS};
use super::ggml::{arch_key, key};
use super::write::{encode, write_gguf, TensorEntry, TensorType, Value};
use crate::formats::safetensors::WeightFiles;
use crate::model::config::LlamaConfig;
use crate::model::lora::{LoraConfig, Projection};
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What base weights an adapter was trained against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    /// The checkpoint's weights as stored.
    AsStored,
    /// Every projection NF4-quantized and dequantized (`train --quant nf4`).
    Nf4,
}

/// What to export.
pub struct ExportOptions<'a> {
    pub model: &'a Path,
    pub adapter: Option<&'a Path>,
    pub ty: TensorType,
    pub base: Base,
    pub lora_only: bool,
    /// Whether the file written may replace one at its path (`--overwrite`).
    pub replace: crate::formats::atomic::Replace,
}

/// What an export wrote.
pub struct Exported {
    pub tensors: usize,
    pub bytes: u64,
    /// The matrices written in f16 rather than the type asked for, whose rows are not a whole
    /// number of its blocks (llama.cpp's converter does the same).
    pub in_f16: Vec<String>,
}

/// The architecture a model is written as.
fn arch_of(cfg: &LlamaConfig) -> &'static arch::Arch {
    arch::arch_of(cfg.family)
}

/// The general and architecture metadata of a model: each of [`HPARAMS`] from config.json's
/// field of the same name.
fn model_metadata(cfg: &LlamaConfig, name: &str, ty: TensorType) -> Result<Vec<(String, Value)>> {
    let a = arch_of(cfg);
    let mut m = vec![
        (key::ARCHITECTURE.to_string(), Value::Str(a.name.into())),
        (key::NAME.to_string(), Value::Str(name.into())),
    ];
    if a.families.len() > 1 {
        let t = cfg.family.model_type();
        m.push((key::MODEL_TYPE.to_string(), Value::Str(t.into())));
    }
    m.extend([
        (key::FILE_TYPE.to_string(), Value::U32(ty.file_type())),
        (key::QUANTIZATION_VERSION.to_string(), Value::U32(2)),
    ]);
    let fields = serde_json::to_value(cfg)?;
    for h in HPARAMS {
        let v = &fields[h.field];
        let value = match h.kind {
            Kind::Int => v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .map(Value::U32),
            Kind::Float => v.as_f64().map(|v| Value::F32(v as f32)),
        };
        let value = value.with_context(|| {
            format!(
                "config field `{}` = {v} does not fit GGUF's `{}`",
                h.field, h.key
            )
        })?;
        m.push((arch_key(a.name, h.key), value));
    }
    Ok(m)
}

/// The type a tensor of `dims` (ggml order) is written as: vectors in f32 (as llama.cpp's
/// converter keeps them), matrices in `ty`, or in f16 where a row is not a whole number of
/// `ty`'s blocks.
fn tensor_type(dims: &[u64], ty: TensorType) -> TensorType {
    if dims.len() < 2 {
        TensorType::F32
    } else if ty.bytes(1, dims[0]).is_none() {
        TensorType::F16
    } else {
        ty
    }
}

/// The model's name for `general.name`: the directory's name (a hub snapshot's repo name).
fn model_name(model: &Path) -> String {
    let base = crate::formats::peft::base_model(model).name;
    Path::new(&base)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or(base)
}

/// Where one tensor of the merged file comes from.
enum Source {
    /// A checkpoint weight (Hugging Face name).
    Weight(String),
    /// llama3 RoPE divisors.
    RopeFreqs(Vec<f32>),
}

/// An adapter as merged or written: its config (one rank and alpha; patterns folded into B by
/// [`crate::formats::peft::load_adapter`]) and its tensors in f32.
type Adapter = (LoraConfig, BTreeMap<String, HostTensor>);

/// Which adapter module adapts `hf` (layer, target), if any.
fn adapted(lora: &LoraConfig, hf: &str) -> Option<(i64, Projection)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, _) = rest.split_once('.')?;
    let layer: i64 = layer.parse().ok()?;
    lora.targets
        .iter()
        .find(|t| t.weight_name(layer) == hf)
        .map(|&t| (layer, t))
}

/// One merged weight, in f32 and Hugging Face layout: as stored, NF4 round-tripped when the
/// base was, plus the adapter's (alpha/r) B A where it adapts it.
fn merged_weight(
    files: &WeightFiles,
    hf: &str,
    base: Base,
    adapter: Option<&Adapter>,
) -> Result<(Vec<f32>, Vec<i64>)> {
    let t = files.read(hf)?;
    files.release(hf);
    let dims = t.dims.clone();
    let mut w = crate::formats::host::convert(&t, ElementType::F32)?.to_f32()?;
    drop(t);
    let is_projection = hf.starts_with("model.layers.") && hf.ends_with("_proj.weight");
    if base == Base::Nf4 && is_projection {
        let nf4 = crate::model::quant::quantize(&w)
            .map_err(|e| anyhow::anyhow!("{hf}: {e}: the base checkpoint is damaged"))?;
        w = crate::model::quant::dequantize(&nf4);
    }
    if let Some((lora, tensors)) = adapter {
        if let Some((layer, target)) = adapted(lora, hf) {
            let a = tensors[&target.peft_name(layer, "A")].to_f32()?;
            let b = tensors[&target.peft_name(layer, "B")].to_f32()?;
            w = crate::formats::merge::merged(
                &w,
                &a,
                &b,
                dims[0] as usize,
                dims[1] as usize,
                lora.r as usize,
                lora.scale() as f32,
            );
        }
    }
    Ok((w, dims))
}

/// The merged model's tensor table and where each comes from, checked against the checkpoint
/// before anything is written.
fn merged_plan(
    cfg: &LlamaConfig,
    files: &WeightFiles,
    ty: TensorType,
) -> Result<(Vec<TensorEntry>, Vec<Source>)> {
    crate::formats::weights::check(files, cfg)?;
    let mut entries = Vec::new();
    let mut sources = Vec::new();
    let mut push = |name: String, hf_dims: &[i64], source: Source| {
        let dims: Vec<u64> = hf_dims.iter().rev().map(|&d| d as u64).collect();
        let ty = tensor_type(&dims, ty);
        entries.push(TensorEntry { name, dims, ty });
        sources.push(source);
    };
    let weights = crate::model::tensors::frozen_weights(cfg);
    let (first, rest) = weights.split_first().context("a model has weights")?;
    push(
        gguf_name(&first.0).context("embedding name")?,
        &first.1,
        Source::Weight(first.0.clone()),
    );
    if let Some(f) = arch::rope_freqs(cfg) {
        push(
            arch::ROPE_FREQS.into(),
            &[f.len() as i64],
            Source::RopeFreqs(f),
        );
    }
    for (hf, shape) in rest {
        let name = gguf_name(hf).with_context(|| format!("no llama.cpp name for `{hf}`"))?;
        push(name, shape, Source::Weight(hf.clone()));
    }
    Ok((entries, sources))
}

/// Whether the adapter's training record says it was trained with `--quant nf4`: its own
/// record of its base (`xtrain_base.json`, beside every adapter xtrain writes), else for an
/// adapter of an older xtrain a checkpoint's `trainer_state.json`, or a run's `adapter/` beside
/// the run's checkpoints (the latest one's). Returns the quant and the file that says it.
pub fn recorded_quant(adapter: &Path) -> Option<(String, PathBuf)> {
    if let Ok(Some((t, record))) = crate::formats::adapter_base::read_record(adapter) {
        return Some((t.quant, record));
    }
    let quant_in = |state: &Path| -> Option<String> {
        let text = std::fs::read_to_string(state).ok()?;
        let j: serde_json::Value = serde_json::from_str(&text).ok()?;
        j.pointer("/settings/quant")?.as_str().map(String::from)
    };
    let own = adapter.join("trainer_state.json");
    if let Some(q) = quant_in(&own) {
        return Some((q, own));
    }
    let run = adapter.canonicalize().ok()?.parent()?.to_path_buf();
    let mut checkpoints: Vec<(u64, PathBuf)> = std::fs::read_dir(&run)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            Some((step, e.path().join("trainer_state.json")))
        })
        .collect();
    checkpoints.sort();
    let (_, state) = checkpoints.pop()?;
    quant_in(&state).map(|q| (q, state))
}

/// What `merge` and `generate` say of an adapter whose record says it was trained on the NF4
/// base: they use the stored weights, which it did not see (export-gguf uses the NF4 base).
pub fn warn_if_trained_on_nf4(adapter: &Path, command: &str) {
    if let Some((q, record)) = recorded_quant(adapter).filter(|(q, _)| q == "nf4") {
        crate::esay!(
            "xtrain: warning: {} was trained on the {q} base ({}); {command} uses the stored \
             weights, which it did not see, so its outputs differ from training's a little \
             (`xtrain export-gguf` merges against the {q} base)",
            adapter.display(),
            record.display()
        );
    }
}

/// Write the merged model (with `opts.adapter` folded in, if any) to `out` as GGUF, atomically.
/// `progress(done, total, name)` after each tensor (an error from it, such as an interrupt,
/// abandons the file); `note` for what the user should know.
pub fn export_merged(
    opts: &ExportOptions,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize, &str) -> Result<()>,
    note: &mut dyn FnMut(String),
) -> Result<Exported> {
    let cfg = LlamaConfig::load(opts.model)?;
    let files = WeightFiles::open(opts.model)?;
    let adapter = match opts.adapter {
        Some(dir) => Some(crate::formats::peft::load_adapter(dir, &cfg)?),
        None => None,
    };
    if adapter.is_none() && opts.base == Base::Nf4 {
        note("writing the NF4 round trip of every projection (no adapter given)".into());
    }
    if let Some(window) = cfg.sliding_window {
        note(format!(
            "this model's attention slides over {window} tokens; llama.cpp's `{}` attends over \
             the whole context, so the two agree on contexts up to {window} tokens",
            arch_of(&cfg).name
        ));
    }
    let (entries, sources) = merged_plan(&cfg, &files, opts.ty)?;
    let mut meta = model_metadata(&cfg, &model_name(opts.model), opts.ty)?;
    meta.extend(super::vocab::tokenizer_metadata(
        opts.model,
        cfg.vocab_size as usize,
        note,
    )?);
    let total = entries.len();
    write_file(out, opts, &meta, &entries, |i| {
        let bytes = match &sources[i] {
            Source::RopeFreqs(f) => encode(f, entries[i].ty),
            Source::Weight(hf) => {
                let (w, dims) = merged_weight(&files, hf, opts.base, adapter.as_ref())?;
                let w = arch_of(&cfg).reordered(&cfg, hf, w, &dims, Toward::Gguf);
                let merged = adapter
                    .as_ref()
                    .is_some_and(|(l, _)| adapted(l, hf).is_some());
                let what = if merged {
                    "merged with the adapter"
                } else {
                    "as stored"
                };
                encoded(hf, what, &w, entries[i].ty)?
            }
        };
        progress(i + 1, total, &entries[i].name)?;
        Ok(bytes)
    })
}

/// Write `out` atomically: a temp file beside it, put in place once complete (renamed over `out`
/// with [`Replace::Yes`], linked where `out` is still free with [`Replace::No`]).
///
/// [`Replace::Yes`]: crate::formats::atomic::Replace::Yes
/// [`Replace::No`]: crate::formats::atomic::Replace::No
fn write_file(
    out: &Path,
    opts: &ExportOptions,
    meta: &[(String, Value)],
    entries: &[TensorEntry],
    data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<Exported> {
    let mut data = data;
    crate::formats::atomic::write_atomic_as(out, opts.replace, |w| {
        write_gguf(w, meta, entries, &mut data).map_err(|e| std::io::Error::other(format!("{e:#}")))
    })?;
    Ok(Exported {
        tensors: entries.len(),
        bytes: std::fs::metadata(out).map(|m| m.len()).unwrap_or(0),
        in_f16: entries
            .iter()
            .filter(|e| e.dims.len() >= 2 && e.ty != opts.ty)
            .map(|e| e.name.clone())
            .collect(),
    })
}

/// Write the adapter alone to `out` as llama.cpp's LoRA GGUF, atomically.
pub fn export_lora(
    opts: &ExportOptions,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize, &str) -> Result<()>,
) -> Result<Exported> {
    let dir = opts
        .adapter
        .context("--lora-only writes an adapter: give it with --adapter")?;
    let cfg = LlamaConfig::load(opts.model)?;
    let (lora, tensors) = crate::formats::peft::load_adapter(dir, &cfg)?;
    let a = arch_of(&cfg);
    let meta = vec![
        (key::ARCHITECTURE.to_string(), Value::Str(a.name.into())),
        (key::TYPE.to_string(), Value::Str("adapter".into())),
        (
            key::NAME.to_string(),
            Value::Str(format!("{} LoRA", model_name(opts.model))),
        ),
        (key::ADAPTER_TYPE.to_string(), Value::Str("lora".into())),
        (
            key::ADAPTER_LORA_ALPHA.to_string(),
            Value::F32(lora.alpha as f32),
        ),
        (key::FILE_TYPE.to_string(), Value::U32(opts.ty.file_type())),
    ];
    let mut entries = Vec::new();
    let mut sources = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        for &t in &lora.targets {
            let hf = t.weight_name(l);
            let base = gguf_name(&hf).context("a projection has a llama.cpp name")?;
            let (inp, outd) = crate::model::tensors::projection_dims(&cfg, t);
            for (which, suffix, dims) in [
                ("A", "lora_a", vec![inp as u64, lora.r as u64]),
                ("B", "lora_b", vec![lora.r as u64, outd as u64]),
            ] {
                let ty = tensor_type(&dims, opts.ty);
                entries.push(TensorEntry {
                    name: format!("{base}.{suffix}"),
                    dims,
                    ty,
                });
                // B's rows are W's rows: reordered as W is, so that B A is.
                let reordered_as = (which == "B").then(|| hf.clone());
                sources.push((t.peft_name(l, which), reordered_as));
            }
        }
    }
    if entries.is_empty() {
        bail!("{}: the adapter adapts no weight", dir.display());
    }
    let total = entries.len();
    write_file(out, opts, &meta, &entries, |i| {
        let (name, reordered_as) = &sources[i];
        let t = &tensors[name];
        let mut v = t.to_f32()?;
        if let Some(w) = reordered_as {
            v = a.reordered(&cfg, w, v, &t.dims, Toward::Gguf);
        }
        progress(i + 1, total, &entries[i].name)?;
        encoded(name, "in the adapter", &v, entries[i].ty)
    })
}

/// `values` of tensor `name` (`what`: as stored, merged, in the adapter) encoded as `ty`, or an
/// error that names the tensor and the element where a value is not finite or does not fit the
/// type (f16's largest is 65,504; q8_0 keeps each block's scale, its largest value over 127,
/// in f16): llama.cpp would compute garbage from the file without a word.
fn encoded(name: &str, what: &str, values: &[f32], ty: TensorType) -> Result<Vec<u8>> {
    const F16_MAX: f32 = 65504.0;
    let largest = match ty {
        TensorType::F16 => F16_MAX,
        TensorType::Q8_0 => F16_MAX * 127.0,
        _ => f32::MAX,
    };
    if let Some(i) = values.iter().position(|v| v.is_nan() || v.abs() > largest) {
        let v = values[i];
        if !v.is_finite() {
            bail!(
                "`{name}` {what}: element {i} is {v}, not a finite number; llama.cpp would \
                 compute garbage from it"
            );
        }
        bail!(
            "`{name}` {what}: element {i} is {v:e}, more than {} can hold; export with --type \
             bf16 or f32",
            ty.name()
        );
    }
    Ok(encode(values, ty))
}

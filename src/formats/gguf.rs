//! GGUF v3 (llama.cpp's file format): reading the header, metadata and tensors, dequantizing
//! F32/F16/BF16/Q8_0/Q4_0/Q4_1 here and Q5_0/Q5_1 and the K-quants Q2_K..Q6_K in
//! [`crate::formats::kquants`], and importing a Llama-architecture file as a Hugging Face model
//! directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use pjrt::HostTensor;
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

impl Meta {
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Meta::Int(v) => Some(*v),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Meta::Float(v) => Some(*v),
            Meta::Int(v) => Some(*v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Meta::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: dims[0] varies fastest (the row length).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Byte offset in the file.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row-major dims as Hugging Face writes them ([out, in] for a weight).
    pub fn hf_dims(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }
}

pub struct Gguf {
    pub version: u32,
    pub meta: BTreeMap<String, Meta>,
    pub tensors: Vec<TensorInfo>,
    data: Vec<u8>,
}

/// Block size and bytes per block of each supported ggml type.
fn type_layout(t: u32) -> Option<(u64, u64, &'static str)> {
    Some(match t {
        0 => (1, 4, "F32"),
        1 => (1, 2, "F16"),
        2 => (32, 18, "Q4_0"),
        3 => (32, 20, "Q4_1"),
        8 => (32, 34, "Q8_0"),
        30 => (1, 2, "BF16"),
        other => return crate::formats::kquants::layout(other),
    })
}

/// A tensor of a quantization xtrain does not read: the file is valid, its tensor is not ours.
#[derive(Debug)]
struct UnsupportedType {
    tensor: String,
    ggml_type: u32,
}

impl std::fmt::Display for UnsupportedType {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        // ggml's names of the types xtrain does not read (ggml.h's enum ggml_type).
        let name = match self.ggml_type {
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => "a type this xtrain does not know",
        };
        // What it reads, from the table that reads them.
        let reads: Vec<&str> = (0..64)
            .filter_map(|t| type_layout(t).map(|l| l.2))
            .collect();
        write!(
            f,
            "tensor `{}` is of ggml type {} ({name}), which xtrain does not read (it reads {}); \
             convert the original model again, or requantize with llama.cpp's llama-quantize, \
             to one of those (Q8_0 or Q4_K_M, say)",
            self.tensor,
            self.ggml_type,
            reads.join(", ")
        )
    }
}

impl std::error::Error for UnsupportedType {}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.pos.checked_add(n).is_none_or(|end| end > self.b.len()) {
            bail!(
                "unexpected end of file at byte {} (wanted {n} more bytes)",
                self.pos
            );
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > 1 << 30 {
            bail!("string of {n} bytes at byte {}", self.pos);
        }
        Ok(String::from_utf8_lossy(self.take(n as usize)?).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Meta> {
        Ok(match ty {
            0 => Meta::Int(self.take(1)?[0] as i64),
            1 => Meta::Int(self.take(1)?[0] as i8 as i64),
            2 => Meta::Int(u16::from_le_bytes(self.take(2)?.try_into()?) as i64),
            3 => Meta::Int(i16::from_le_bytes(self.take(2)?.try_into()?) as i64),
            4 => Meta::Int(self.u32()? as i64),
            5 => Meta::Int(self.u32()? as i32 as i64),
            6 => Meta::Float(f32::from_le_bytes(self.take(4)?.try_into()?) as f64),
            7 => Meta::Bool(self.take(1)?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 => {
                if depth > 4 {
                    bail!("arrays nested too deeply");
                }
                let inner = self.u32()?;
                let n = self.u64()?;
                if n > (self.b.len() - self.pos) as u64 {
                    bail!("array of {n} elements cannot fit in the file");
                }
                Meta::Array(
                    (0..n)
                        .map(|_| self.value(inner, depth + 1))
                        .collect::<Result<_>>()?,
                )
            }
            10 => Meta::Int(self.u64()? as i64),
            11 => Meta::Int(self.u64()? as i64),
            12 => Meta::Float(f64::from_le_bytes(self.take(8)?.try_into()?)),
            other => bail!("unknown metadata value type {other}"),
        })
    }
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf> {
        let data =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        Gguf::parse(data).map_err(|e| {
            let what = if e.is::<UnsupportedType>() {
                path.display().to_string()
            } else {
                format!("{} is not a valid GGUF file", path.display())
            };
            e.context(what)
        })
    }

    pub fn parse(data: Vec<u8>) -> Result<Gguf> {
        let mut c = Cursor { b: &data, pos: 0 };
        if c.take(4)? != b"GGUF" {
            bail!("bad magic (not GGUF)");
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not supported (2 or 3)");
        }
        let n_tensors = c.u64()?;
        let n_meta = c.u64()?;
        if n_tensors > 1 << 20 || n_meta > 1 << 20 {
            bail!("implausible counts: {n_tensors} tensors, {n_meta} metadata entries");
        }
        let mut meta = BTreeMap::new();
        for _ in 0..n_meta {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c
                .value(ty, 0)
                .with_context(|| format!("metadata `{key}`"))?;
            meta.insert(key, v);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()?;
            if nd > 4 {
                bail!("tensor `{name}` has {nd} dims");
            }
            let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let ggml_type = c.u32()?;
            let offset = c.u64()?;
            infos.push((name, dims, ggml_type, offset));
        }
        let align = meta
            .get("general.alignment")
            .and_then(|m| m.as_i64())
            .unwrap_or(32);
        if !(1..=1 << 20).contains(&align) || (align & (align - 1)) != 0 {
            bail!("general.alignment = {align} is not a power of two up to 1 MiB");
        }
        let align = align as usize;
        let start = c.pos.div_ceil(align) * align;
        let mut tensors = Vec::new();
        for (name, dims, ggml_type, offset) in infos {
            let offset = (start as u64)
                .checked_add(offset)
                .with_context(|| format!("tensor `{name}`: offset overflows"))?;
            let info = TensorInfo {
                name: name.clone(),
                dims,
                ggml_type,
                offset,
            };
            let Some((block, bytes, _)) = type_layout(ggml_type) else {
                return Err(UnsupportedType {
                    tensor: name,
                    ggml_type,
                }
                .into());
            };
            let n = info
                .dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .context("tensor size overflows")?;
            if n % block != 0 {
                bail!("tensor `{name}`: {n} elements is not a multiple of the block size {block}");
            }
            let end = (n / block)
                .checked_mul(bytes)
                .and_then(|len| info.offset.checked_add(len))
                .context("tensor end overflows")?;
            if end > data.len() as u64 {
                bail!(
                    "tensor `{name}` ends at byte {end} but the file has {} bytes (truncated?)",
                    data.len()
                );
            }
            tensors.push(info);
        }
        Ok(Gguf {
            version,
            meta,
            tensors,
            data,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Dequantize a tensor to f32 values in row-major (HF) order.
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        let (block, bytes, _) = type_layout(t.ggml_type).context("unsupported type")?;
        let n = t.elements() as usize;
        let raw = &self.data[t.offset as usize..(t.offset + t.elements() / block * bytes) as usize];
        let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
        let mut out = Vec::with_capacity(n);
        match t.ggml_type {
            0 => out.extend(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap())),
            ),
            1 => out.extend(raw.chunks_exact(2).map(h)),
            30 => out.extend(
                raw.chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            2 => {
                for blk in raw.chunks_exact(18) {
                    let d = h(&blk[0..2]);
                    let qs = &blk[2..18];
                    out.extend(qs.iter().map(|q| ((q & 0xF) as i32 - 8) as f32 * d));
                    out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
                }
            }
            3 => {
                for blk in raw.chunks_exact(20) {
                    let (d, m) = (h(&blk[0..2]), h(&blk[2..4]));
                    let qs = &blk[4..20];
                    out.extend(qs.iter().map(|q| (q & 0xF) as f32 * d + m));
                    out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
                }
            }
            8 => {
                for blk in raw.chunks_exact(34) {
                    let d = h(&blk[0..2]);
                    out.extend(blk[2..34].iter().map(|&q| q as i8 as f32 * d));
                }
            }
            other => crate::formats::kquants::dequantize(other, raw, &mut out),
        }
        Ok(out)
    }

    fn meta_i64(&self, key: &str) -> Result<i64> {
        self.meta
            .get(key)
            .and_then(|m| m.as_i64())
            .with_context(|| format!("GGUF metadata `{key}` is missing or not an integer"))
    }

    fn meta_f64(&self, key: &str) -> Option<f64> {
        self.meta.get(key).and_then(|m| m.as_f64())
    }
}

/// Undo llama.cpp's q/k row order: per head it stores rows as (pair, i) interleaved where HF has
/// (i, pair) halves. `rows` = heads * head_dim, each of `cols` values.
pub fn unpermute_qk(w: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let half = rows / heads / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for p in 0..2 {
                let src = ((h * half + i) * 2 + p) * cols;
                let dst = ((h * 2 + p) * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

fn hf_name(gguf: &str) -> Option<String> {
    if let Some(rest) = gguf.strip_prefix("blk.") {
        let (layer, kind) = rest.split_once('.')?;
        let hf = match kind {
            "attn_norm.weight" => "input_layernorm.weight",
            "attn_q.weight" => "self_attn.q_proj.weight",
            "attn_k.weight" => "self_attn.k_proj.weight",
            "attn_v.weight" => "self_attn.v_proj.weight",
            "attn_output.weight" => "self_attn.o_proj.weight",
            "ffn_norm.weight" => "post_attention_layernorm.weight",
            "ffn_gate.weight" => "mlp.gate_proj.weight",
            "ffn_up.weight" => "mlp.up_proj.weight",
            "ffn_down.weight" => "mlp.down_proj.weight",
            _ => return None,
        };
        return Some(format!("model.layers.{layer}.{hf}"));
    }
    Some(
        match gguf {
            "token_embd.weight" => "model.embed_tokens.weight",
            "output_norm.weight" => "model.norm.weight",
            "output.weight" => "lm_head.weight",
            _ => return None,
        }
        .to_string(),
    )
}

/// The HF config of a Llama-architecture GGUF file.
pub fn hf_config(g: &Gguf) -> Result<Json> {
    let arch = g
        .meta
        .get("general.architecture")
        .and_then(|m| m.as_str())
        .unwrap_or("");
    if g.meta.get("general.type").and_then(|m| m.as_str()) == Some("adapter") {
        bail!(
            "this is a LoRA adapter GGUF (general.type = adapter), not a model: import-gguf \
             converts models; give the base model's GGUF (llama.cpp applies the adapter with \
             --lora)"
        );
    }
    if arch != "llama" {
        bail!("general.architecture is `{arch}`; xtrain imports llama");
    }
    let heads = g.meta_i64("llama.attention.head_count")?;
    let hidden = g.meta_i64("llama.embedding_length")?;
    let int = |key: &str| g.meta.get(key).and_then(|m| m.as_i64());
    // A head's width: the key length where the file says it, else the rotary width (all of a
    // Llama head rotates), else the hidden size over the heads.
    let head_dim = int("llama.attention.key_length")
        .or(int("llama.rope.dimension_count"))
        .unwrap_or(hidden / heads.max(1));
    for key in ["llama.rope.dimension_count", "llama.attention.value_length"] {
        if let Some(d) = int(key).filter(|&d| d != head_dim) {
            bail!(
                "{key} = {d} but a head is {head_dim} wide: xtrain's Llama rotates (and values) \
                 the whole head"
            );
        }
    }
    if let Some(kind) = g
        .meta
        .get("llama.rope.scaling.type")
        .and_then(|m| m.as_str())
        .filter(|k| *k != "none")
    {
        bail!(
            "llama.rope.scaling.type = {kind}: xtrain supports no RoPE scaling but Llama 3's \
             (carried by the tensor rope_freqs.weight); the model would not be the same"
        );
    }
    let vocab = match g.meta.get("llama.vocab_size").and_then(|m| m.as_i64()) {
        Some(v) => v,
        None => match g.meta.get("tokenizer.ggml.tokens") {
            Some(Meta::Array(a)) => a.len() as i64,
            _ => bail!("cannot tell the vocabulary size"),
        },
    };
    let tied = g.tensor("output.weight").is_none();
    let mut c = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g.meta_i64("llama.feed_forward_length")?,
        "num_hidden_layers": g.meta_i64("llama.block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": g.meta.get("llama.attention.head_count_kv").and_then(|m| m.as_i64()).unwrap_or(heads),
        "head_dim": head_dim,
        "rms_norm_eps": g.meta_f64("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        "rope_theta": g.meta_f64("llama.rope.freq_base").unwrap_or(10000.0),
        "max_position_embeddings": g.meta.get("llama.context_length").and_then(|m| m.as_i64()).unwrap_or(2048),
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    });
    for (k, key) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(v) = g.meta.get(key).and_then(|m| m.as_i64()) {
            c[k] = json!(v);
        }
    }
    if let Some(t) = g.tensor("rope_freqs.weight") {
        c["rope_scaling"] = llama3_scaling(g, t, &c)?;
    }
    Ok(c)
}

/// llama.cpp's per-frequency RoPE divisors for llama3 scaling: the unscaled inverse frequency
/// over the scaled one, computed from the same f32 frequencies the model trains with.
pub fn rope_freqs(cfg: &crate::model::config::LlamaConfig) -> Option<Vec<f32>> {
    cfg.rope_scaling.as_ref()?;
    let plain = crate::model::config::LlamaConfig {
        rope_scaling: None,
        ..cfg.clone()
    }
    .rope_inv_freq();
    Some(
        plain
            .iter()
            .zip(cfg.rope_inv_freq())
            .map(|(p, s)| p / s)
            .collect(),
    )
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
    let cfg = crate::model::config::LlamaConfig::from_json(&with)?;
    let want = rope_freqs(&cfg).unwrap_or_default();
    let differs = (divisors.len() != want.len()).then_some(0).or_else(|| {
        (0..want.len()).find(|&i| (divisors[i] - want[i]).abs() > 1e-4 * want[i].abs())
    });
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
    let id = |key: &str| g.meta.get(key).and_then(|m| m.as_i64());
    let mut c = json!({"_from_model_config": true});
    if let Some(b) = id("tokenizer.ggml.bos_token_id") {
        c["bos_token_id"] = json!(b);
    }
    match (
        id("tokenizer.ggml.eos_token_id"),
        id("tokenizer.ggml.eot_token_id"),
    ) {
        (Some(e), Some(t)) if e != t => c["eos_token_id"] = json!([e, t]),
        (Some(e), _) | (None, Some(e)) => c["eos_token_id"] = json!(e),
        (None, None) => {}
    }
    if let Some(p) = id("tokenizer.ggml.padding_token_id") {
        c["pad_token_id"] = json!(p);
    }
    c
}

/// tokenizer.json (HF tokenizers' format) for a GGUF `gpt2`-style BPE vocabulary.
pub fn hf_tokenizer(g: &Gguf) -> Result<(Json, Json)> {
    let model = g
        .meta
        .get("tokenizer.ggml.model")
        .and_then(|m| m.as_str())
        .unwrap_or("");
    if model != "gpt2" {
        bail!("tokenizer.ggml.model is `{model}`; xtrain converts gpt2-style BPE vocabularies");
    }
    let strings = |key: &str| -> Result<Vec<String>> {
        match g.meta.get(key) {
            Some(Meta::Array(a)) => Ok(a
                .iter()
                .map(|m| m.as_str().unwrap_or_default().to_string())
                .collect()),
            _ => bail!("GGUF metadata `{key}` is missing"),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g.meta.get("tokenizer.ggml.token_type") {
        Some(Meta::Array(a)) => a.iter().map(|m| m.as_i64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    // Control (3) and user-defined (4) tokens are matched whole before BPE.
    let added: Vec<Json> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": types[i] == 3}))
        .collect();
    let pre_tokenizer = pre_tokenizer(g)?;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": bos_first(g, &tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    let tok = |key: &str| {
        g.meta
            .get(key)
            .and_then(|m| m.as_i64())
            .and_then(|i| tokens.get(i as usize))
            .cloned()
    };
    let mut config = json!({"model_max_length": g.meta.get("llama.context_length").and_then(|m| m.as_i64()).unwrap_or(2048)});
    if let Some(t) = g
        .meta
        .get("tokenizer.chat_template")
        .and_then(|m| m.as_str())
    {
        config["chat_template"] = json!(t);
    }
    if let Some(add) = g
        .meta
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|m| m.as_bool())
    {
        config["add_bos_token"] = json!(add);
    }
    for (k, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(t) = tok(key) {
            config[k] = json!(t);
        }
    }
    Ok((tokenizer, config))
}

/// Llama 3's pre-tokenizer split pattern (tokenizer.json's `Split` regex), which llama.cpp
/// calls `llama-bpe`.
pub const LLAMA3_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// tokenizer.json's `pre_tokenizer` for `tokenizer.ggml.pre`: how llama.cpp splits text before
/// BPE, which the vocabulary's merges were made for. A name xtrain does not know is refused:
/// another split gives other token ids than the model was trained on.
fn pre_tokenizer(g: &Gguf) -> Result<Json> {
    let pre = g
        .meta
        .get("tokenizer.ggml.pre")
        .and_then(|m| m.as_str())
        .unwrap_or("default");
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => byte_level(true),
        // SmolLM and StarCoder-style vocabularies split digits one by one before byte-level BPE.
        "smollm" | "starcoder" | "refact" | "smaug-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]})
        }
        // Llama 3's regex split (up to three digits a piece), then bytes without GPT-2's regex.
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
            byte_level(false)]}),
        other => bail!(
            "tokenizer.ggml.pre = {other}: xtrain knows how llama.cpp splits text for llama-bpe \
             (Llama 3), smollm/starcoder/refact/smaug-bpe and gpt-2/default, not this one; \
             another split would give other token ids than the model was trained on"
        ),
    })
}

/// tokenizer.json's `post_processor`: the BOS token before every text where the file says
/// `tokenizer.ggml.add_bos_token` (as Llama 3's tokenizer.json does), else none.
fn bos_first(g: &Gguf, tokens: &[String]) -> Json {
    let add = g
        .meta
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|m| m.as_bool())
        .unwrap_or(false);
    let bos = g
        .meta
        .get("tokenizer.ggml.bos_token_id")
        .and_then(|m| m.as_i64())
        .and_then(|i| Some((i, tokens.get(usize::try_from(i).ok()?)?)));
    match (add, bos) {
        (true, Some((id, token))) => {
            let special = |type_id: i64| json!({"SpecialToken": {"id": token, "type_id": type_id}});
            let seq = |id: &str, type_id: i64| json!({"Sequence": {"id": id, "type_id": type_id}});
            json!({
                "type": "TemplateProcessing",
                "single": [special(0), seq("A", 0)],
                "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
                "special_tokens": {token.as_str(): {"id": token, "ids": [id], "tokens": [token]}}
            })
        }
        _ => Json::Null,
    }
}

/// Write a Hugging Face model directory from a GGUF file: f32 weights (dequantized, q/k rows
/// in HF order), config, generation config, tokenizer. The directory is written whole under a
/// temp name and renamed into place, replacing whatever `out` held (a sharded model's index and
/// shards included).
pub fn import(
    path: &Path,
    out: &Path,
    replace: crate::formats::atomic::Replace,
    mut progress: impl FnMut(usize, usize),
) -> Result<()> {
    let g = Gguf::open(path)?;
    let config = hf_config(&g).with_context(|| path.display().to_string())?;
    // Before the tensors (minutes for a large model): a vocabulary it cannot carry is refused.
    let (tokenizer, tconfig) = hf_tokenizer(&g).with_context(|| path.display().to_string())?;
    let cfg = crate::model::config::LlamaConfig::from_json(&config)?;
    let (heads, kv) = (
        cfg.num_attention_heads as usize,
        cfg.num_key_value_heads as usize,
    );
    let mut tensors = BTreeMap::new();
    let total = g.tensors.len();
    for (i, t) in g.tensors.iter().enumerate() {
        if t.name == "rope_freqs.weight" {
            continue; // the config's rope_scaling (hf_config)
        }
        let Some(name) = hf_name(&t.name) else {
            bail!(
                "{}: tensor `{}` has no place in the Llama model xtrain trains (token_embd, \
                 output_norm, output, and per block attn_norm, attn_q/k/v/output, ffn_norm, \
                 ffn_gate/up/down weights): biases and q/k norms are other architectures, and \
                 leaving it out would change the model",
                path.display(),
                t.name
            );
        };
        let dims = t.hf_dims();
        let mut values = g
            .dequantize(t)
            .with_context(|| format!("tensor `{}`", t.name))?;
        if name.ends_with("q_proj.weight") {
            values = unpermute_qk(&values, heads, dims[0] as usize, dims[1] as usize);
        } else if name.ends_with("k_proj.weight") {
            values = unpermute_qk(&values, kv, dims[0] as usize, dims[1] as usize);
        }
        tensors.insert(name, HostTensor::from_f32(&values, &dims));
        progress(i + 1, total);
    }
    let files = crate::model::tensors::frozen_weights(&cfg);
    if let Some((missing, _)) = files.iter().find(|(n, _)| !tensors.contains_key(n)) {
        bail!("{}: no tensor for `{missing}`", path.display());
    }
    // Every tensor has the shape the config derived from the metadata gives it, and no tensor
    // is left over (a block past llama.block_count, an output beside tied embeddings).
    let shapes: BTreeMap<&str, &Vec<i64>> = files.iter().map(|(n, s)| (n.as_str(), s)).collect();
    for (name, t) in &tensors {
        match shapes.get(name.as_str()) {
            None => bail!(
                "{}: tensor `{name}` is not part of the model its metadata describes ({} \
                 blocks, {} embeddings)",
                path.display(),
                cfg.num_hidden_layers,
                if cfg.tie_word_embeddings {
                    "tied"
                } else {
                    "untied"
                }
            ),
            Some(&want) if *want != t.dims => bail!(
                "{}: tensor `{name}` is {:?} but the metadata's model (hidden {}, heads {} of \
                 {}, kv heads {}, intermediate {}, vocabulary {}) needs {want:?}",
                path.display(),
                t.dims,
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
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    crate::formats::atomic::write_dir_atomic_as(out, replace, |tmp| {
        crate::formats::safetensors::write(&tmp.join("model.safetensors"), &tensors, &meta)?;
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("config.json"),
            serde_json::to_string_pretty(&config)?.as_bytes(),
        )?;
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("tokenizer.json"),
            serde_json::to_string(&tokenizer)?.as_bytes(),
        )?;
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&tconfig)?.as_bytes(),
        )?;
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("generation_config.json"),
            serde_json::to_string_pretty(&hf_generation_config(&g))?.as_bytes(),
        )
    })
}

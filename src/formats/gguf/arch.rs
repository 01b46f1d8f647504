//! llama.cpp's architectures as xtrain maps them, each fact once and used both ways (export
//! reads these tables from the Hugging Face side, import from the GGUF side): which family is
//! written as which architecture, the tensor names, the q/k row order, the hyperparameter keys
//! against config.json's fields, and Llama 3's RoPE scaling as per-frequency divisors.
//!
//! llama.cpp's `llama` architecture rotates adjacent pairs of a head's values, so its converter
//! reorders the rows of q and k from Hugging Face's two halves ([`reorder_qk`]); `qwen2` and
//! `qwen3` rotate the two halves as Hugging Face does (NeoX-style RoPE) and keep the rows as
//! they are. Mistral is Llama's graph and is written as `llama`; a `llama` file imports as
//! Mistral where it says so ([`Arch::family_in`]).

use super::ggml::hparam;
use crate::model::config::{Family, LlamaConfig};

/// A llama.cpp architecture xtrain reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// llama.cpp's name (`general.architecture`, the prefix of its hyperparameter keys).
    pub name: &'static str,
    /// The families written as this architecture; a file of it imports as the first unless it
    /// says which ([`Arch::family_in`]).
    pub families: &'static [Family],
    /// Whether llama.cpp keeps the rows of q and k per head as interleaved pairs (its Llama
    /// RoPE rotates adjacent values), where Hugging Face keeps two halves: see [`reorder_qk`].
    pub permuted_qk: bool,
}

pub const LLAMA: Arch = Arch {
    name: "llama",
    families: &[Family::Llama, Family::Mistral],
    permuted_qk: true,
};

pub const QWEN2: Arch = Arch {
    name: "qwen2",
    families: &[Family::Qwen2],
    permuted_qk: false,
};

pub const QWEN3: Arch = Arch {
    name: "qwen3",
    families: &[Family::Qwen3],
    permuted_qk: false,
};

/// Every architecture xtrain reads and writes.
pub const ARCHS: &[Arch] = &[LLAMA, QWEN2, QWEN3];

/// The architecture llama.cpp calls `name`, if xtrain has it.
pub fn arch(name: &str) -> Option<&'static Arch> {
    ARCHS.iter().find(|a| a.name == name)
}

/// The architecture a family is written as.
pub fn arch_of(family: Family) -> &'static Arch {
    ARCHS
        .iter()
        .find(|a| a.families.contains(&family))
        .expect("every family has an architecture")
}

impl Arch {
    /// The family a file of this architecture imports as, by what else the file says:
    /// `model_type` (xtrain's export writes [`super::ggml::key::MODEL_TYPE`]), else the
    /// family a `names` entry (`general.name`, `general.basename`; llama.cpp's converter takes
    /// them from the checkpoint's name, "Mistral-7B-Instruct-v0.3") names, case aside, else
    /// the first. A family with no RoPE scaling is not chosen by name where the file carries
    /// Llama 3's (`llama3_rope`). Returns the family and, where it is not the first, why.
    pub fn family_in(
        &self,
        model_type: Option<&str>,
        names: &[&str],
        llama3_rope: bool,
    ) -> anyhow::Result<(Family, Option<String>)> {
        if let Some(t) = model_type {
            return match self.families.iter().find(|f| f.model_type() == t) {
                Some(&f) => Ok((f, Some(format!("{} = {t}", super::ggml::key::MODEL_TYPE)))),
                None => anyhow::bail!(
                    "{} = `{t}` is not a family llama.cpp's `{}` architecture holds ({})",
                    super::ggml::key::MODEL_TYPE,
                    self.name,
                    self.families
                        .iter()
                        .map(|f| f.model_type())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
        }
        for &f in &self.families[1..] {
            let says = |n: &&&str| n.to_ascii_lowercase().contains(f.model_type());
            if let Some(name) = names.iter().find(says).filter(|_| !llama3_rope) {
                return Ok((f, Some(format!("the file's name is \"{name}\""))));
            }
        }
        Ok((self.families[0], None))
    }
}

/// The names of [`ARCHS`], for messages.
pub fn arch_names() -> String {
    ARCHS.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
}

/// Per block: (Hugging Face's name after `model.layers.N.`, llama.cpp's after `blk.N.`).
const BLOCK_NAMES: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// Outside the blocks: (Hugging Face's name, llama.cpp's).
const MODEL_NAMES: &[(&str, &str)] = &[
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// llama.cpp's per-frequency RoPE divisors of Llama 3's scaling (not a checkpoint weight).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The other side's name of `name`: `from` and `to` pick the columns of the tables (0 for
/// Hugging Face, 1 for llama.cpp), and the block prefixes go with them.
fn renamed(name: &str, from: usize, to: usize) -> Option<String> {
    let prefix = ["model.layers.", "blk."];
    if let Some(rest) = name.strip_prefix(prefix[from]) {
        let (layer, kind) = rest.split_once('.')?;
        let row = BLOCK_NAMES.iter().find(|r| [r.0, r.1][from] == kind)?;
        return Some(format!("{}{layer}.{}", prefix[to], [row.0, row.1][to]));
    }
    let row = MODEL_NAMES.iter().find(|r| [r.0, r.1][from] == name)?;
    Some([row.0, row.1][to].to_string())
}

/// llama.cpp's tensor names xtrain maps, for messages.
pub fn gguf_names() -> String {
    let model = MODEL_NAMES.iter().map(|r| r.1.to_string());
    let block = BLOCK_NAMES.iter().map(|r| format!("blk.N.{}", r.1));
    model
        .chain([ROPE_FREQS.to_string()])
        .chain(block)
        .collect::<Vec<_>>()
        .join(", ")
}

/// llama.cpp's name of a Hugging Face weight.
pub fn gguf_name(hf: &str) -> Option<String> {
    renamed(hf, 0, 1)
}

/// Hugging Face's name of a llama.cpp tensor.
pub fn hf_name(gguf: &str) -> Option<String> {
    renamed(gguf, 1, 0)
}

impl Arch {
    /// The heads whose rows this architecture reorders in the Hugging Face tensor `hf` (see
    /// [`reorder_qk`]): q's and k's (weights and biases) where [`Arch::permuted_qk`], else none.
    pub fn reordered_heads(&self, cfg: &LlamaConfig, hf: &str) -> Option<usize> {
        let q = ["self_attn.q_proj.weight", "self_attn.q_proj.bias"];
        let k = ["self_attn.k_proj.weight", "self_attn.k_proj.bias"];
        if !self.permuted_qk {
            None
        } else if q.iter().any(|n| hf.ends_with(n)) {
            Some(cfg.num_attention_heads as usize)
        } else if k.iter().any(|n| hf.ends_with(n)) {
            Some(cfg.num_key_value_heads as usize)
        } else {
            None
        }
    }

    /// `values` of the Hugging Face tensor `hf` (`dims` as Hugging Face writes them), in the
    /// other side's row order where this architecture reorders it, else as they are.
    pub fn reordered(
        &self,
        cfg: &LlamaConfig,
        hf: &str,
        values: Vec<f32>,
        dims: &[i64],
        to: Toward,
    ) -> Vec<f32> {
        match self.reordered_heads(cfg, hf) {
            Some(heads) => {
                let rows = dims[0] as usize;
                reorder_qk(&values, heads, rows, values.len() / rows.max(1), to)
            }
            None => values,
        }
    }
}

/// Which way [`reorder_qk`] goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Toward {
    Gguf,
    Hf,
}

/// The rows of q or k (`heads` heads of `rows / heads` rows, each of `cols` values) in the other
/// side's order. Within a head, Hugging Face's row (half p, i) is llama.cpp's row (i, p): the
/// two values rotated together are half a head apart in one and adjacent in the other.
pub fn reorder_qk(w: &[f32], heads: usize, rows: usize, cols: usize, to: Toward) -> Vec<f32> {
    let half = rows / heads / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for p in 0..2 {
            for i in 0..half {
                let hf = ((h * 2 + p) * half + i) * cols;
                let gguf = ((h * half + i) * 2 + p) * cols;
                let (src, dst) = match to {
                    Toward::Gguf => (hf, gguf),
                    Toward::Hf => (gguf, hf),
                };
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// How a hyperparameter is typed in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// u32 in the files xtrain writes; any integer type read.
    Int,
    /// f32 written; any number read.
    Float,
}

/// What import does when a file lacks a hyperparameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Missing {
    Refuse,
    /// llama.cpp's default.
    Default(f64),
    /// Derived from others (the importer says how).
    Derived,
}

/// A hyperparameter: its key after the architecture's name and config.json's field.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hparam {
    pub key: &'static str,
    pub field: &'static str,
    pub kind: Kind,
    pub missing: Missing,
}

const fn hp(key: &'static str, field: &'static str, kind: Kind, missing: Missing) -> Hparam {
    Hparam {
        key,
        field,
        kind,
        missing,
    }
}

/// The hyperparameters every architecture here writes and reads. Several keys of one field (a
/// head's width) must agree; the first present one gives the field.
pub const HPARAMS: &[Hparam] = &[
    hp(
        hparam::VOCAB_SIZE,
        "vocab_size",
        Kind::Int,
        Missing::Derived,
    ),
    hp(
        hparam::CONTEXT_LENGTH,
        "max_position_embeddings",
        Kind::Int,
        Missing::Default(2048.0),
    ),
    hp(
        hparam::EMBEDDING_LENGTH,
        "hidden_size",
        Kind::Int,
        Missing::Refuse,
    ),
    hp(
        hparam::BLOCK_COUNT,
        "num_hidden_layers",
        Kind::Int,
        Missing::Refuse,
    ),
    hp(
        hparam::FEED_FORWARD_LENGTH,
        "intermediate_size",
        Kind::Int,
        Missing::Refuse,
    ),
    hp(
        hparam::HEAD_COUNT,
        "num_attention_heads",
        Kind::Int,
        Missing::Refuse,
    ),
    hp(
        hparam::HEAD_COUNT_KV,
        "num_key_value_heads",
        Kind::Int,
        Missing::Derived,
    ),
    hp(hparam::KEY_LENGTH, "head_dim", Kind::Int, Missing::Derived),
    hp(
        hparam::VALUE_LENGTH,
        "head_dim",
        Kind::Int,
        Missing::Derived,
    ),
    hp(
        hparam::ROPE_DIMENSION_COUNT,
        "head_dim",
        Kind::Int,
        Missing::Derived,
    ),
    hp(
        hparam::RMS_EPS,
        "rms_norm_eps",
        Kind::Float,
        Missing::Default(1e-5),
    ),
    hp(
        hparam::ROPE_FREQ_BASE,
        "rope_theta",
        Kind::Float,
        Missing::Default(10000.0),
    ),
];

/// llama.cpp's per-frequency RoPE divisors for llama3 scaling ([`ROPE_FREQS`]): the unscaled
/// inverse frequency over the scaled one, computed from the same f32 frequencies the model
/// trains with. None for a model without the scaling.
pub fn rope_freqs(cfg: &LlamaConfig) -> Option<Vec<f32>> {
    cfg.rope_scaling.as_ref()?;
    let plain = LlamaConfig {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reordering_toward_gguf_is_undone_toward_hf() {
        let (heads, head_dim, cols) = (3, 8, 5);
        let w: Vec<f32> = (0..heads * head_dim * cols).map(|i| i as f32).collect();
        let p = reorder_qk(&w, heads, heads * head_dim, cols, Toward::Gguf);
        assert_ne!(p, w);
        assert_eq!(reorder_qk(&p, heads, heads * head_dim, cols, Toward::Hf), w);
        // Head 0's row 1 of GGUF is its second half's first row in Hugging Face's order.
        assert_eq!(
            p[cols..2 * cols],
            w[(head_dim / 2) * cols..(head_dim / 2 + 1) * cols]
        );
    }

    #[test]
    fn each_name_maps_back_to_itself() {
        for hf in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.11.self_attn.k_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
        ] {
            let g = gguf_name(hf).unwrap();
            assert_eq!(hf_name(&g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_proj.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            hf_name("blk.0.attn_q.bias").as_deref(),
            Some("model.layers.0.self_attn.q_proj.bias")
        );
        assert_eq!(
            gguf_name("model.layers.5.self_attn.k_norm.weight").as_deref(),
            Some("blk.5.attn_k_norm.weight")
        );
        assert_eq!(hf_name("blk.0.attn_qkv.weight"), None);
        assert_eq!(gguf_name("model.layers.x"), None);
    }

    #[test]
    fn rope_freqs_divide_the_plain_frequencies_into_the_scaled_ones() {
        let cfg = crate::model::presets::preset_config("llama-3.1-8b")
            .unwrap()
            .unwrap();
        let f = rope_freqs(&cfg).unwrap();
        assert_eq!(f.len(), 64);
        // High frequencies unscaled, low ones divided by the factor (8).
        assert_eq!(f[0], 1.0);
        assert!((f[63] - 8.0).abs() < 1e-4, "{}", f[63]);
        let tiny = crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .unwrap();
        assert_eq!(rope_freqs(&tiny).is_some(), tiny.rope_scaling.is_some());
    }

    #[test]
    fn a_llama_file_imports_as_mistral_where_it_says_so() {
        let family = |t, names: &[&str], rope| LLAMA.family_in(t, names, rope).unwrap().0;
        assert_eq!(family(Some("mistral"), &["model"], false), Family::Mistral);
        assert_eq!(family(Some("llama"), &["Mistral-x"], false), Family::Llama);
        assert_eq!(
            family(None, &["Mistral-Nemo-Instruct-2407"], false),
            Family::Mistral
        );
        assert_eq!(family(None, &["x", "Mistral"], false), Family::Mistral);
        assert_eq!(family(None, &["Meta-Llama-3.1-8B"], false), Family::Llama);
        assert_eq!(family(None, &[], false), Family::Llama);
        // Llama 3's RoPE scaling is not Mistral's, whatever the name.
        assert_eq!(family(None, &["mistral-ish"], true), Family::Llama);
        let e = LLAMA.family_in(Some("qwen2"), &[], false).unwrap_err();
        assert!(e.to_string().contains("llama, mistral"), "{e}");
        assert_eq!(
            QWEN2.family_in(None, &["Mistral"], false).unwrap().0,
            Family::Qwen2
        );
    }
}

//! The tensors of a checkpoint (any of the Llama-architecture families) and of a LoRA adapter: Hugging Face and PEFT names and
//! shapes, per layer (`model.layers.3.mlp.up_proj.weight`) or stacked over layers with a leading
//! layer axis (`model.layers.*.mlp.up_proj.weight`, as a looped program takes them), and the parts
//! an NF4-quantized weight is passed as.

use crate::model::config::LlamaConfig;
use crate::model::lora::{LoraConfig, Projection};
use hlo::DType;

/// The frozen tensors of one layer: HF name within the layer (`self_attn.q_proj.weight`) and
/// shape, in checkpoint order. Qwen2 adds the q/k/v biases (`self_attn.q_proj.bias`, ...), Qwen3
/// the per-head norms (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, [head_dim]).
pub fn layer_kinds(cfg: &LlamaConfig) -> Vec<(&'static str, Vec<i64>)> {
    let (h, f, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let q = cfg.num_attention_heads * d;
    let kv = cfg.num_key_value_heads * d;
    let mut out = vec![("input_layernorm.weight", vec![h])];
    for (name, bias, rows, cols) in [
        ("self_attn.q_proj.weight", "self_attn.q_proj.bias", q, h),
        ("self_attn.k_proj.weight", "self_attn.k_proj.bias", kv, h),
        ("self_attn.v_proj.weight", "self_attn.v_proj.bias", kv, h),
    ] {
        out.push((name, vec![rows, cols]));
        if cfg.qkv_bias {
            out.push((bias, vec![rows]));
        }
    }
    out.push(("self_attn.o_proj.weight", vec![h, q]));
    if cfg.qk_norm {
        out.push(("self_attn.q_norm.weight", vec![d]));
        out.push(("self_attn.k_norm.weight", vec![d]));
    }
    out.extend([
        ("post_attention_layernorm.weight", vec![h]),
        ("mlp.gate_proj.weight", vec![f, h]),
        ("mlp.up_proj.weight", vec![f, h]),
        ("mlp.down_proj.weight", vec![h, f]),
    ]);
    out
}

/// The frozen weights a Llama checkpoint must contain, with their shapes (HF names).
pub fn frozen_weights(cfg: &LlamaConfig) -> Vec<(String, Vec<i64>)> {
    frozen_args(cfg, false)
}

/// The frozen weights as a program takes them: per layer, or stacked as `model.layers.*.<kind>`
/// with a leading layer axis.
pub fn frozen_args(cfg: &LlamaConfig, stacked: bool) -> Vec<(String, Vec<i64>)> {
    let (h, v, l) = (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    if stacked {
        for (kind, shape) in layer_kinds(cfg) {
            let mut s = vec![l];
            s.extend(shape);
            out.push((format!("model.layers.*.{kind}"), s));
        }
    } else {
        for layer in 0..l {
            for (kind, shape) in layer_kinds(cfg) {
                out.push((format!("model.layers.{layer}.{kind}"), shape));
            }
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out
}

/// Whether a layer tensor (a kind, or a full name) is a projection's weight matrix: what NF4
/// quantizes (biases and norms stay as they are).
pub fn is_projection(kind: &str) -> bool {
    kind.ends_with("_proj.weight")
}

/// The parts an NF4 weight of `n` elements is passed as: (suffix, dims, dtype).
pub fn nf4_parts(n: i64) -> Vec<(&'static str, Vec<i64>, DType)> {
    let nb = n / crate::model::quant::BLOCK as i64;
    let nsb = crate::model::quant::scale_blocks(n as usize) as i64;
    vec![
        ("nf4", vec![n / 2], DType::U8),
        ("absmax_q", vec![nb], DType::S8),
        ("absmax_scale", vec![nsb], DType::F32),
        ("absmax_mean", vec![], DType::F32),
    ]
}

/// The frozen arguments of a program with their element types: like [`frozen_args`], but each
/// projection weight becomes its NF4 parts (`<name>.nf4`, `.absmax_q`, `.absmax_scale`,
/// `.absmax_mean`) when `nf4`.
pub fn frozen_args_typed(
    cfg: &LlamaConfig,
    stacked: bool,
    nf4: bool,
    dense: DType,
) -> Vec<(String, Vec<i64>, DType)> {
    let mut out = Vec::new();
    for (name, shape) in frozen_args(cfg, stacked) {
        let kind_is_proj = name.starts_with("model.layers.") && is_projection(&name);
        if nf4 && kind_is_proj {
            let (lead, inner) = if stacked {
                (vec![shape[0]], &shape[1..])
            } else {
                (vec![], &shape[..])
            };
            let n: i64 = inner.iter().product();
            for (suffix, dims, dt) in nf4_parts(n) {
                let mut d = lead.clone();
                d.extend(dims);
                out.push((format!("{name}.{suffix}"), d, dt));
            }
        } else {
            out.push((name, shape, dense));
        }
    }
    out
}

/// The name of layer `layer`'s slice of a stacked (`layers.*`) tensor.
pub fn layer_name(stacked: &str, layer: i64) -> String {
    stacked.replace("layers.*.", &format!("layers.{layer}."))
}

/// (in, out) features of a projection.
pub fn projection_dims(cfg: &LlamaConfig, t: Projection) -> (i64, i64) {
    let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    match t {
        Projection::Q => (h, q),
        Projection::K | Projection::V => (h, kv),
        Projection::O => (q, h),
        Projection::Gate | Projection::Up => (h, f),
        Projection::Down => (f, h),
    }
}

/// One LoRA tensor: where it sits and its PEFT name and shape.
#[derive(Clone, Debug)]
pub struct LoraTensor {
    /// The layer, or None for a stacked tensor holding every layer.
    pub layer: Option<i64>,
    pub target: Projection,
    /// "A" or "B"
    pub which: &'static str,
    pub name: String,
    pub shape: Vec<i64>,
}

/// Every LoRA tensor of a PEFT adapter, per layer (layer, target, A then B).
pub fn lora_tensors(cfg: &LlamaConfig, lora: &LoraConfig) -> Vec<LoraTensor> {
    lora_args(cfg, lora, false)
}

/// The LoRA tensors as a program takes them: per layer, or stacked per target (`layers.*`).
pub fn lora_args(cfg: &LlamaConfig, lora: &LoraConfig, stacked: bool) -> Vec<LoraTensor> {
    let mut out = Vec::new();
    let layers: Vec<Option<i64>> = if stacked {
        vec![None]
    } else {
        (0..cfg.num_hidden_layers).map(Some).collect()
    };
    for layer in layers {
        for &target in &lora.targets {
            let (i, o) = projection_dims(cfg, target);
            for (which, shape) in [("A", vec![lora.r, i]), ("B", vec![o, lora.r])] {
                let (name, shape) = match layer {
                    Some(l) => (target.peft_name(l, which), shape),
                    None => {
                        let mut s = vec![cfg.num_hidden_layers];
                        s.extend(shape);
                        (
                            target.peft_name(0, which).replace("layers.0.", "layers.*."),
                            s,
                        )
                    }
                };
                out.push(LoraTensor {
                    layer,
                    target,
                    which,
                    name,
                    shape,
                });
            }
        }
    }
    out
}

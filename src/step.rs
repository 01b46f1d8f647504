//! The whole training step as one StableHLO function:
//! forward + backward (LoRA parameters only) + AdamW, with the LoRA parameters and optimizer
//! moments donated and returned updated, plus the loss and the gradient norm.
//!
//! Argument order (each named in the program and in the manifest):
//! frozen weights (HF names) | LoRA A/B (PEFT names) | exp_avg.* | exp_avg_sq.* | step | lr |
//! input_ids | labels | attention_mask | [dropout_key]

use crate::config::LlamaConfig;
use crate::lora::{LoraConfig, Target};
use crate::model::{
    causal_lm_loss, Adapters, BaseWeights, LayerWeights, Llama, LoraPair, Numerics,
};
use crate::optim::{AdamW, Slot};
use anyhow::Result;
use hlo::{Builder, DType, Module, ParamAttrs, Shape, Value};
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Frozen,
    Lora,
    AdamM,
    AdamV,
    Step,
    LearningRate,
    InputIds,
    Labels,
    AttentionMask,
    DropoutKey,
    Loss,
    GradNorm,
    Logits,
    TokenLoss,
}

/// One argument or result of a program.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<i64>,
    #[serde(serialize_with = "ser_dtype")]
    pub dtype: DType,
    pub role: Role,
}

fn ser_dtype<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.mlir())
}

/// What the program is built for.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StepSpec {
    pub model: LlamaConfig,
    pub lora: LoraConfig,
    pub adam: AdamW,
    pub batch: i64,
    pub seq: i64,
    /// Element type of the frozen weights as the program takes them.
    #[serde(serialize_with = "ser_dtype")]
    pub weight_dtype: DType,
    /// Element type of activations and matmuls.
    #[serde(serialize_with = "ser_dtype")]
    pub compute_dtype: DType,
}

/// A built program: its text and its signature.
pub struct Program {
    pub text: String,
    pub args: Vec<TensorSpec>,
    pub results: Vec<TensorSpec>,
}

/// The frozen weights a Llama checkpoint must contain, with their shapes, in program order.
pub fn frozen_weights(cfg: &LlamaConfig) -> Vec<(String, Vec<i64>)> {
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![f, h]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![f, h]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![h, f]));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out
}

/// (in, out) features of a projection.
pub fn projection_dims(cfg: &LlamaConfig, t: Target) -> (i64, i64) {
    let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    match t {
        Target::Q => (h, q),
        Target::K | Target::V => (h, kv),
        Target::O => (q, h),
        Target::Gate | Target::Up => (h, f),
        Target::Down => (f, h),
    }
}

/// One LoRA tensor: where it sits and its PEFT name and shape.
#[derive(Clone, Debug)]
pub struct LoraTensor {
    pub layer: i64,
    pub target: Target,
    /// "A" or "B"
    pub which: &'static str,
    pub name: String,
    pub shape: Vec<i64>,
}

/// Every LoRA tensor in program order (layer, target, A then B).
pub fn lora_tensors(cfg: &LlamaConfig, lora: &LoraConfig) -> Vec<LoraTensor> {
    let mut out = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for &target in &lora.targets {
            let (i, o) = projection_dims(cfg, target);
            for (which, shape) in [("A", vec![lora.r, i]), ("B", vec![o, lora.r])] {
                out.push(LoraTensor {
                    layer,
                    target,
                    which,
                    name: target.peft_name(layer, which),
                    shape,
                });
            }
        }
    }
    out
}

/// Parameters of the model part of a program, shared by the train step and the forward pass.
struct ModelParams {
    weights: BaseWeights,
    adapters: Adapters,
    lora_values: Vec<Value>,
}

fn add_model_params(
    b: &mut Builder,
    spec: &StepSpec,
    with_lora: bool,
    args: &mut Vec<TensorSpec>,
) -> ModelParams {
    let cfg = &spec.model;
    let mut by_name: BTreeMap<String, Value> = BTreeMap::new();
    for (name, shape) in frozen_weights(cfg) {
        let v = b.param(&name, Shape::new(&shape, spec.weight_dtype));
        args.push(TensorSpec {
            name: name.clone(),
            shape,
            dtype: spec.weight_dtype,
            role: Role::Frozen,
        });
        by_name.insert(name, v);
    }
    let w = |n: String| by_name[&n];
    let layers = (0..cfg.num_hidden_layers)
        .map(|l| {
            let p = format!("model.layers.{l}");
            LayerWeights {
                input_norm: w(format!("{p}.input_layernorm.weight")),
                q: w(format!("{p}.self_attn.q_proj.weight")),
                k: w(format!("{p}.self_attn.k_proj.weight")),
                v: w(format!("{p}.self_attn.v_proj.weight")),
                o: w(format!("{p}.self_attn.o_proj.weight")),
                post_norm: w(format!("{p}.post_attention_layernorm.weight")),
                gate: w(format!("{p}.mlp.gate_proj.weight")),
                up: w(format!("{p}.mlp.up_proj.weight")),
                down: w(format!("{p}.mlp.down_proj.weight")),
            }
        })
        .collect();
    let embed = w("model.embed_tokens.weight".into());
    let weights = BaseWeights {
        embed,
        layers,
        norm: w("model.norm.weight".into()),
        lm_head: if cfg.tie_word_embeddings {
            embed
        } else {
            w("lm_head.weight".into())
        },
    };
    let mut adapters = Adapters {
        layers: vec![BTreeMap::new(); cfg.num_hidden_layers as usize],
        scale: spec.lora.scale(),
        dropout: None,
    };
    let mut lora_values = Vec::new();
    if with_lora {
        let tensors = lora_tensors(cfg, &spec.lora);
        for pair in tensors.chunks(2) {
            let a = b.param(&pair[0].name, Shape::new(&pair[0].shape, DType::F32));
            let bv = b.param(&pair[1].name, Shape::new(&pair[1].shape, DType::F32));
            for t in pair {
                args.push(TensorSpec {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: DType::F32,
                    role: Role::Lora,
                });
            }
            adapters.layers[pair[0].layer as usize].insert(pair[0].target, LoraPair { a, b: bv });
            lora_values.extend([a, bv]);
        }
    }
    ModelParams {
        weights,
        adapters,
        lora_values,
    }
}

fn add_batch_params(
    b: &mut Builder,
    spec: &StepSpec,
    args: &mut Vec<TensorSpec>,
) -> (Value, Value, Value) {
    let shape = vec![spec.batch, spec.seq];
    let mut p = |name: &str, role| {
        args.push(TensorSpec {
            name: name.into(),
            shape: shape.clone(),
            dtype: DType::S32,
            role,
        });
        b.param(name, Shape::new(&shape, DType::S32))
    };
    (
        p("input_ids", Role::InputIds),
        p("labels", Role::Labels),
        p("attention_mask", Role::AttentionMask),
    )
}

fn scalar_param(b: &mut Builder, name: &str, role: Role, args: &mut Vec<TensorSpec>) -> Value {
    args.push(TensorSpec {
        name: name.into(),
        shape: vec![],
        dtype: DType::F32,
        role,
    });
    b.param(name, Shape::scalar(DType::F32))
}

/// The training step program.
pub fn build_train_step(spec: &StepSpec) -> Result<Program> {
    spec.lora.validate()?;
    let mut b = Builder::new("train_step");
    let mut args = Vec::new();
    let mut mp = add_model_params(&mut b, spec, true, &mut args);
    let n = mp.lora_values.len();
    let lora_args: Vec<TensorSpec> = args
        .iter()
        .filter(|a| a.role == Role::Lora)
        .cloned()
        .collect();
    // moments[i] = m of LoRA tensor i, moments[n + i] = its v; named as torch's state dict.
    let mut moments = Vec::new();
    for (prefix, role) in [("exp_avg", Role::AdamM), ("exp_avg_sq", Role::AdamV)] {
        for src in &lora_args {
            let name = format!("{prefix}.{}", src.name);
            moments.push(b.param(&name, Shape::new(&src.shape, DType::F32)));
            args.push(TensorSpec {
                name,
                shape: src.shape.clone(),
                dtype: DType::F32,
                role,
            });
        }
    }
    let step = scalar_param(&mut b, "step", Role::Step, &mut args);
    let lr = scalar_param(&mut b, "lr", Role::LearningRate, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    if spec.lora.dropout > 0.0 {
        args.push(TensorSpec {
            name: "dropout_key".into(),
            shape: vec![2],
            dtype: DType::U64,
            role: Role::DropoutKey,
        });
        let key = b.param("dropout_key", Shape::new(&[2], DType::U64));
        mp.adapters.dropout = Some((spec.lora.dropout, key));
    }

    let model = Llama {
        cfg: &spec.model,
        num: Numerics {
            compute: spec.compute_dtype,
        },
    };
    let logits = model.logits(&mut b, &mp.weights, &mut mp.adapters, ids, mask)?;
    let (loss, _, _) = causal_lm_loss(&mut b, logits, labels)?;
    let grads = b.grad(loss, &mp.lora_values)?;
    let slots: Vec<Slot> = (0..n)
        .map(|i| Slot {
            param: mp.lora_values[i],
            grad: grads[i],
            m: moments[i],
            v: moments[n + i],
        })
        .collect();
    let (updated, grad_norm) = spec.adam.update(&mut b, &slots, step, lr)?;

    // Results: params, then m, then v (each aliasing its input), then loss and grad norm.
    let m_args: Vec<TensorSpec> = args
        .iter()
        .filter(|a| a.role == Role::AdamM)
        .cloned()
        .collect();
    let v_args: Vec<TensorSpec> = args
        .iter()
        .filter(|a| a.role == Role::AdamV)
        .cloned()
        .collect();
    let mut results = Vec::new();
    let mut outs: Vec<(String, Value)> = Vec::new();
    for (k, group) in [&lora_args, &m_args, &v_args].iter().enumerate() {
        for (i, spec_i) in group.iter().enumerate() {
            let v = match k {
                0 => updated[i].param,
                1 => updated[i].m,
                _ => updated[i].v,
            };
            let input = match k {
                0 => mp.lora_values[i],
                _ => moments[(k - 1) * n + i],
            };
            b.set_param_attrs(
                input,
                ParamAttrs {
                    alias_output: Some(outs.len()),
                    sharding: None,
                },
            );
            results.push(spec_i.clone());
            outs.push((spec_i.name.clone(), v));
        }
    }
    for (name, v, role) in [
        ("loss", loss, Role::Loss),
        ("grad_norm", grad_norm, Role::GradNorm),
    ] {
        results.push(TensorSpec {
            name: name.into(),
            shape: vec![],
            dtype: DType::F32,
            role,
        });
        outs.push((name.into(), v));
    }
    let refs: Vec<(&str, Value)> = outs.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    let func = b.finish(&refs);
    Ok(Program {
        text: Module::new("xtrain_train_step", func).to_text(),
        args,
        results,
    })
}

/// A forward-only program: (logits [B,T,V], per-token CE [B,T], loss) with or without LoRA.
pub fn build_forward(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut b = Builder::new("forward");
    let mut args = Vec::new();
    let mut mp = add_model_params(&mut b, spec, with_lora, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let model = Llama {
        cfg: &spec.model,
        num: Numerics {
            compute: spec.compute_dtype,
        },
    };
    let logits = model.logits(&mut b, &mp.weights, &mut mp.adapters, ids, mask)?;
    let (loss, ce, _) = causal_lm_loss(&mut b, logits, labels)?;
    let (bs, t, v) = (spec.batch, spec.seq, spec.model.vocab_size);
    let results = vec![
        TensorSpec {
            name: "logits".into(),
            shape: vec![bs, t, v],
            dtype: DType::F32,
            role: Role::Logits,
        },
        TensorSpec {
            name: "token_loss".into(),
            shape: vec![bs, t],
            dtype: DType::F32,
            role: Role::TokenLoss,
        },
        TensorSpec {
            name: "loss".into(),
            shape: vec![],
            dtype: DType::F32,
            role: Role::Loss,
        },
    ];
    let func = b.finish(&[("logits", logits), ("token_loss", ce), ("loss", loss)]);
    Ok(Program {
        text: Module::new("xtrain_forward", func).to_text(),
        args,
        results,
    })
}

/// A program returning the loss and the gradient of every LoRA tensor (for checking gradients
/// against a reference; the train step folds them into AdamW instead).
pub fn build_grad_program(spec: &StepSpec) -> Result<Program> {
    let mut b = Builder::new("grads");
    let mut args = Vec::new();
    let mut mp = add_model_params(&mut b, spec, true, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let model = Llama {
        cfg: &spec.model,
        num: Numerics {
            compute: spec.compute_dtype,
        },
    };
    let logits = model.logits(&mut b, &mp.weights, &mut mp.adapters, ids, mask)?;
    let (loss, _, _) = causal_lm_loss(&mut b, logits, labels)?;
    let grads = b.grad(loss, &mp.lora_values)?;
    let mut results = vec![TensorSpec {
        name: "loss".into(),
        shape: vec![],
        dtype: DType::F32,
        role: Role::Loss,
    }];
    let mut outs = vec![("loss".to_string(), loss)];
    for (a, g) in args.iter().filter(|a| a.role == Role::Lora).zip(&grads) {
        let name = format!("grad.{}", a.name);
        results.push(TensorSpec {
            name: name.clone(),
            shape: a.shape.clone(),
            dtype: DType::F32,
            role: Role::Lora,
        });
        outs.push((name, *g));
    }
    let refs: Vec<(&str, Value)> = outs.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    Ok(Program {
        text: Module::new("xtrain_grads", b.finish(&refs)).to_text(),
        args,
        results,
    })
}

//! The argument layout: which program argument is which weight of the model. [`Layout`] maps
//! the flat list of parameter values (frozen weights per layer or stacked, NF4 parts, LoRA A/B)
//! onto the model's structure (the parameters are declared in that order by
//! `ProgramBuilder::model_params`), and the helpers
//! here read and write one layer of a stacked tensor.

use crate::model::llama::{
    LayerAdapters, LayerContext, LayerWeights, Linear, Llama, LoraPair, Numerics,
};
use crate::model::tensors::{is_projection, layer_kinds};
use crate::program::spec::StepSpec;
use hlo::{Builder, DType, MemoryKind, Value};
use std::collections::BTreeMap;

/// Frozen weights and LoRA values of a program, in argument order.
#[derive(Clone)]
pub(super) struct ModelValues {
    pub(super) frozen: Vec<Value>,
    pub(super) lora: Vec<Value>,
}

impl ModelValues {
    pub(super) fn flat(&self) -> Vec<Value> {
        self.frozen.iter().chain(&self.lora).copied().collect()
    }

    pub(super) fn rebind(&self, flat: &[Value]) -> ModelValues {
        let n = self.frozen.len();
        ModelValues {
            frozen: flat[..n].to_vec(),
            lora: flat[n..n + self.lora.len()].to_vec(),
        }
    }
}

/// Slice layer `i` out of a stacked tensor [L, ...] -> [...].
pub(super) fn layer_slice(b: &mut Builder, stacked: Value, i: Value) -> hlo::Result<Value> {
    let dims = b.dims(stacked).to_vec();
    let zero = b.scalar(0.0, DType::S32);
    let mut starts = vec![i];
    starts.extend(std::iter::repeat_n(zero, dims.len() - 1));
    let mut sizes = dims.clone();
    sizes[0] = 1;
    let s = b.dynamic_slice(stacked, &starts, &sizes)?;
    b.reshape(s, &dims[1..])
}

/// The element type a stack of per-layer values [L, ...] that a loop writes is kept in: bf16 and
/// f16 stacks are kept as their bits (u16), other types as they are. Writing a layer into a stack
/// is a dynamic-update-slice, and XLA CPU computes a bf16 one in f32: it converted the whole stack
/// to f32 and back on every layer instead of writing one slice in place. On the bits the write
/// is in place, on every backend; the bitcasts cost nothing.
pub(super) fn stack_type(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::U16,
        d => d,
    }
}

/// Layer `i` of a stack kept in [`stack_type`]`(dtype)`, as `dtype`. A stack in host memory
/// (`on_host`) has the slice moved to the device before its bits are read as `dtype` (XLA's host
/// offloading follows slices and reshapes of a host buffer, not type changes).
pub(super) fn layer_slice_from(
    b: &mut Builder,
    stacked: Value,
    i: Value,
    dtype: DType,
    on_host: bool,
) -> hlo::Result<Value> {
    let s = layer_slice(b, stacked, i)?;
    let s = if on_host {
        b.place(s, MemoryKind::Device)
    } else {
        s
    };
    b.bitcast_convert(s, dtype)
}

/// Write `v` [...] into layer `i` of a stacked tensor [L, ...] (a stack of bits, see
/// [`stack_type`], takes `v`'s bits).
pub(super) fn layer_update(
    b: &mut Builder,
    stacked: Value,
    v: Value,
    i: Value,
) -> hlo::Result<Value> {
    layer_update_to(b, stacked, v, i, false)
}

/// [`layer_update`] of a stack that lives in host memory when `on_host`: `v` is moved there
/// (after its bits are taken on the device) and the write lands in host memory.
pub(super) fn layer_update_to(
    b: &mut Builder,
    stacked: Value,
    v: Value,
    i: Value,
    on_host: bool,
) -> hlo::Result<Value> {
    let v = b.bitcast_convert(v, b.dtype(stacked))?;
    let v = if on_host {
        b.place(v, MemoryKind::PinnedHost)
    } else {
        v
    };
    let mut dims = vec![1];
    dims.extend_from_slice(b.dims(v));
    let v = b.reshape(v, &dims)?;
    let zero = b.scalar(0.0, DType::S32);
    let mut starts = vec![i];
    starts.extend(std::iter::repeat_n(zero, dims.len() - 1));
    b.dynamic_update_slice(stacked, v, &starts)
}

/// A loop body's view of its invariants: stacked weights, stacked LoRA, the layer context and
/// dropout.
pub(super) type LoopInvariants = (Vec<Value>, Vec<Value>, LayerContext, Option<(f64, Value)>);

/// The model's structure over a flat list of values.
pub(super) struct Layout<'a> {
    pub(super) spec: &'a StepSpec,
}

impl Layout<'_> {
    pub(super) fn model(&self) -> Llama<'_> {
        Llama {
            cfg: &self.spec.model,
            num: Numerics {
                compute: self.spec.dtype,
                attention_block: self.spec.attention_block,
                key_block: self.spec.key_block,
                matmul_result: self.spec.matmul_result.dtype(self.spec.dtype),
                scores: self.spec.attention_scores.dtype(self.spec.dtype),
                mlp_chunk: self.spec.mlp_chunk,
            },
            placement: self
                .spec
                .mesh
                .as_ref()
                .filter(|_| self.spec.pin_mlp_activations)
                .map(|m| m as &dyn crate::model::llama::Placement),
            mesh: self
                .spec
                .mesh
                .as_ref()
                .filter(|m| m.devices() > 1)
                .map(|m| m as &dyn crate::model::llama::Placement),
            context: self
                .spec
                .mesh
                .as_ref()
                .filter(|_| self.spec.context_size() > 1)
                .map(|m| crate::model::llama::ContextSplit {
                    size: self.spec.context_size(),
                    placement: m as &dyn crate::model::llama::Placement,
                }),
        }
    }

    /// (embed, norm, lm_head) from the frozen values.
    pub(super) fn ends(&self, frozen: &[Value]) -> (Value, Value, Value) {
        let n = frozen.len();
        if self.spec.model.tie_word_embeddings {
            (frozen[0], frozen[n - 1], frozen[0])
        } else {
            (frozen[0], frozen[n - 2], frozen[n - 1])
        }
    }

    /// How many argument values each of a layer's weights takes (4 for an NF4 projection).
    pub(super) fn kind_sizes(&self) -> Vec<usize> {
        layer_kinds(&self.spec.model)
            .iter()
            .map(|(k, _)| {
                if self.spec.quant.is_nf4() && is_projection(k) {
                    4
                } else {
                    1
                }
            })
            .collect()
    }

    /// The frozen values of the layer weights (all layers, or the stacked ones): between the
    /// embedding and the final norm.
    pub(super) fn layer_values<'v>(&self, frozen: &'v [Value]) -> &'v [Value] {
        let tail = if self.spec.model.tie_word_embeddings {
            1
        } else {
            2
        };
        &frozen[1..frozen.len() - tail]
    }

    /// One layer's weights from its values (per-layer, not stacked), dequantizing NF4
    /// projections right here, before their matmuls.
    pub(super) fn layer_weights(&self, b: &mut Builder, w: &[Value]) -> hlo::Result<LayerWeights> {
        let mut by_kind = BTreeMap::new();
        let mut at = 0;
        for ((kind, shape), n) in layer_kinds(&self.spec.model)
            .into_iter()
            .zip(self.kind_sizes())
        {
            let v = if n == 4 {
                b.scoped(kind.trim_end_matches(".weight"), |b| {
                    crate::model::quant::dequantize_graph(
                        b,
                        &w[at..at + 4],
                        &shape,
                        self.spec.dtype,
                    )
                })?
            } else {
                w[at]
            };
            by_kind.insert(kind, v);
            at += n;
        }
        let get = |kind: &str| by_kind.get(kind).copied();
        let linear = |name: &str| Linear {
            w: by_kind[format!("self_attn.{name}.weight").as_str()],
            bias: get(&format!("self_attn.{name}.bias")),
        };
        Ok(LayerWeights {
            input_norm: by_kind["input_layernorm.weight"],
            q: linear("q_proj"),
            k: linear("k_proj"),
            v: linear("v_proj"),
            o: linear("o_proj"),
            q_norm: get("self_attn.q_norm.weight"),
            k_norm: get("self_attn.k_norm.weight"),
            post_norm: by_kind["post_attention_layernorm.weight"],
            gate: by_kind["mlp.gate_proj.weight"],
            up: by_kind["mlp.up_proj.weight"],
            down: by_kind["mlp.down_proj.weight"],
        })
    }

    pub(super) fn adapters(&self, lora: &[Value]) -> LayerAdapters {
        if lora.is_empty() {
            return LayerAdapters::new();
        }
        self.spec
            .lora
            .targets
            .iter()
            .enumerate()
            .map(|(k, &t)| {
                (
                    t,
                    LoraPair {
                        a: lora[2 * k],
                        b: lora[2 * k + 1],
                    },
                )
            })
            .collect()
    }
}

//! What the forward pass's pieces share (`llama`, and the attention forms in `flash` and
//! `context`): the numerics, the remat policy's save points, and how an activation named by
//! logical axes is placed on a device mesh.

use hlo::{Builder, DType, Result, Value};
use std::collections::BTreeMap;

/// Named intermediates a remat policy keeps from the forward pass (the frozen projections'
/// outputs): recorded in the forward pass, substituted when the backward pass recomputes.
pub enum Saves<'a> {
    Off,
    Record(&'a mut Vec<(String, Value)>),
    Use(&'a BTreeMap<String, Value>),
}

impl Saves<'_> {
    pub(crate) fn point(&mut self, b: &mut Builder, name: &str, v: Value) -> Result<Value> {
        match self {
            Saves::Off => Ok(v),
            Saves::Record(list) => {
                list.push((name.to_string(), v));
                Ok(v)
            }
            Saves::Use(map) => match map.get(name) {
                Some(&saved) => b.use_saved(v, saved),
                None => Ok(v),
            },
        }
    }
}

/// Numerics of the forward pass.
#[derive(Clone, Copy, Debug)]
pub struct Numerics {
    /// Element type of activations and matmul operands (f32, or bf16 for mixed precision).
    pub compute: DType,
    /// Query rows per causal attention block (see `llama::query_block`); None: the default rule.
    pub attention_block: Option<i64>,
    /// Attention over key/value blocks of this many tokens with the flash recurrence (see
    /// `model::flash`), instead of every key at once; None: every key at once.
    pub key_block: Option<i64>,
    /// Element type matmuls give their result in before it is rounded to `compute`: `compute`
    /// itself, or f32 (the accumulator). The arithmetic is the same either way (products are
    /// accumulated in f32 and rounded once; kernels may sum in another order); the form is for
    /// the backend: XLA CPU runs bf16 x bf16 -> f32 on the CPU's native bf16 GEMM but converts
    /// both operands of a bf16 -> bf16 product to f32 first, while a GPU's cuBLAS writes bf16
    /// directly.
    pub matmul_result: DType,
    /// Element type the attention scores q.k are written in before the softmax (which runs in
    /// f32 either way): f32, or the compute type as Hugging Face's eager attention has them in
    /// bf16 (its matmul gives bf16; its softmax upcasts). Unlike `matmul_result` this is a
    /// numerics choice, not a form: the scores are rounded once more. It halves the bytes of the
    /// step's largest activations ([B, heads, T, T] per layer, written and read several times
    /// in the forward, recomputed and backward passes).
    pub scores: DType,
}

impl Numerics {
    /// f32 or bf16 compute with matmul results in the compute type.
    pub fn new(compute: DType) -> Numerics {
        Numerics {
            compute,
            attention_block: None,
            key_block: None,
            matmul_result: compute,
            scores: DType::F32,
        }
    }
}

impl Default for Numerics {
    fn default() -> Self {
        Numerics::new(DType::F32)
    }
}

/// How a tensor whose dims are named by logical axes (`batch`, `length`, `mlp`, ...) is placed on
/// the step's device mesh (implemented by the program's mesh and sharding rules).
pub trait Placement {
    fn place(&self, logical: &[&str], dims: &[i64]) -> hlo::Sharding;
}

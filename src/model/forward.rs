//! What the forward pass's pieces share (`llama`, and the attention forms in `flash` and
//! `context`): the numerics, the remat policy's save points, and how an activation named by
//! logical axes is placed on a device mesh.

use hlo::{Builder, CmpDir, DType, Result, Shape, Value};
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
    /// Query rows per causal attention block (see `attention::query_block`); None: the default rule.
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
    /// Positions per tile of the MLP (`--mlp-chunk`, see `model::mlp_tiles`): the MLP runs over
    /// this many positions at a time, so that no [B, T, intermediate] tensor exists whole;
    /// None: over the whole sequence at once.
    pub mlp_chunk: Option<i64>,
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
            mlp_chunk: None,
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
    /// The mesh the shardings name (for computations written per device).
    fn mesh(&self) -> hlo::Mesh;
}

/// `scores` (f32) with the lowest f32 wherever a query may not see a key: a key later than its
/// query, or one before the query's document (each form of attention: `attention::attend`, and the
/// loops of `flash` and `context`).
///
/// `q_pos` and `k_pos` are the natural positions [..., TQ, TK] of the queries and keys the
/// scores pair (leading dims shared by the batch, e.g. the context dimension); `query_docs`
/// [B, ..., TQ] is each query's document start (0 for padding, which sees from the start) and
/// `key_docs` [B, ..., TK] each key's (-1 for padding, before every document). `into` places the
/// mask's dims [B, ..., TQ, TK] among the scores'.
pub fn mask_scores(
    b: &mut Builder,
    scores: Value,
    (q_pos, k_pos): (Value, Value),
    (query_docs, key_docs): (Value, Value),
    into: &[i64],
) -> Result<Value> {
    let causal = b.compare(k_pos, q_pos, CmpDir::Le)?;
    let mut mask = vec![b.dims(query_docs)[0]];
    mask.extend_from_slice(b.dims(causal));
    let m = mask.len() as i64;
    let causal = b.broadcast_in_dim(causal, &mask, &(1..m).collect::<Vec<_>>())?;
    let query_docs = b.broadcast_in_dim(query_docs, &mask, &(0..m - 1).collect::<Vec<_>>())?;
    let key_dims: Vec<i64> = (0..m - 2).chain([m - 1]).collect();
    let key_docs = b.broadcast_in_dim(key_docs, &mask, &key_dims)?;
    let in_document = b.compare(key_docs, query_docs, CmpDir::Ge)?;
    let allowed = b.and(causal, in_document)?;
    let sd = b.dims(scores).to_vec();
    let allowed = b.broadcast_in_dim(allowed, &sd, into)?;
    let blocked = b.full(f32::MIN as f64, Shape::new(&sd, DType::F32));
    b.select(allowed, scores, blocked)
}

//! The work a training step must do, counted from its spec: what MFU and the benchmarks' FLOP/s
//! divide by.

use crate::model::lora::Projection;
use crate::program::StepSpec;

/// Model FLOPs of one training step, the count MFU and the benchmarks' FLOP/s use (work the step
/// must do, no recomputation counted; a multiply-add is 2 FLOPs):
/// - the frozen matmuls forward, `2 P` per token, and the activation gradients through them,
///   another `2 P` (P = every projection's in x out, all layers, plus the LM head's hidden x
///   vocab; the frozen weights get no gradients);
/// - causal attention as full T x T (as is usual for MFU): `QK^T` and `PV` are `4 T d` per head
///   and token forward, twice that backward;
/// - LoRA: `2 r (in + out)` per token and adapted projection forward, twice that backward.
pub fn model_flops_per_step(spec: &StepSpec) -> f64 {
    let c = &spec.model;
    let (l, t) = (c.num_hidden_layers as f64, spec.seq as f64);
    let tokens = (spec.batch * spec.seq) as f64;
    let per_layer: i64 = Projection::ALL
        .iter()
        .map(|&tg| {
            let (i, o) = crate::model::tensors::projection_dims(c, tg);
            i * o
        })
        .sum();
    let p = l * per_layer as f64 + (c.hidden_size * c.vocab_size) as f64;
    let attention = l * 4.0 * t * (c.num_attention_heads * c.head_dim) as f64;
    let lora_per_layer: i64 = spec
        .lora
        .targets
        .iter()
        .map(|&tg| {
            let (i, o) = crate::model::tensors::projection_dims(c, tg);
            spec.lora.r * (i + o)
        })
        .sum();
    let lora = l * 2.0 * lora_per_layer as f64;
    tokens * (4.0 * p + 3.0 * attention + 3.0 * lora)
}

//! What `xtrain plan` knows before it compiles: a lower bound of a step's device memory, to
//! skip compiles that cannot fit, and a model of its time, to rank the settings on GPUs (where
//! XLA gives no time) and to order the compiles on every target. The model is stated in
//! [`MODEL`] and in docs/usage.md, and is never presented as a measurement. It stands on the
//! device's rates ([`Rates`]: a GPU's data-sheet peak and a stated cost per kernel launch; this
//! machine's CPU plugin measured), and says so where it has none.

use crate::model::lora::Projection;
use crate::model::tensors::projection_dims;
use crate::program::{Program, Remat, StepSpec};

/// The model of a step's time, as `plan` says it.
pub const MODEL: &str = "model, not a measurement: the step's matmul and attention FLOPs \
     (forward, recomputation by the remat policy and the MLP's tiles, backward through the \
     activations and LoRA) at the devices' dense peak (a GPU's bf16 data-sheet figure; this \
     machine's CPU plugin measured on a 1024^3 matmul), plus the operations the compiled step \
     launches (each loop body once per trip) at a cost each (a GPU kernel launch: 5 us; the \
     CPU plugin: measured on a chain of small matmuls), plus host<->device copies of \
     offloaded weights and activations at 25 GB/s (PCIe 4.0 x16), plus FSDP's weight gathers \
     and tensor parallelism's activation reductions at 100 GB/s between devices, added with no \
     overlap";

/// Host link and device interconnect of [`MODEL`], bytes per second.
const HOST_LINK: f64 = 25e9;
const DEVICE_LINK: f64 = 100e9;

/// A GPU's cost per launched kernel in [`MODEL`]: a CUDA or HIP launch and XLA's own work
/// around it, a few microseconds.
pub const GPU_LAUNCH_S: f64 = 5e-6;

/// What the model stands on for a target: its devices' peak and cost per launched operation,
/// and where they came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Rates {
    pub tflops_per_device: f64,
    pub per_launch_s: f64,
    pub source: String,
}

/// A step's modelled time, in parts.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Modelled {
    pub seconds: f64,
    pub compute_s: f64,
    /// The compiled step's launches times the cost of one (0 before it is compiled).
    pub launch_s: f64,
    pub host_s: f64,
    pub interconnect_s: f64,
}

impl Modelled {
    /// The part that takes longest: what binds the step's time.
    pub fn binding(&self) -> &'static str {
        let parts = [
            (self.compute_s, "compute"),
            (self.launch_s, "launches"),
            (self.host_s, "host link"),
            (self.interconnect_s, "interconnect"),
        ];
        parts
            .iter()
            .fold(
                (f64::MIN, "compute"),
                |m, &(s, n)| if s > m.0 { (s, n) } else { m },
            )
            .1
    }

    /// The same with the compiled step's `launches` at `per_launch_s` each.
    pub fn with_launches(self, launches: f64, per_launch_s: f64) -> Modelled {
        let launch_s = launches * per_launch_s;
        Modelled {
            seconds: self.seconds - self.launch_s + launch_s,
            launch_s,
            ..self
        }
    }
}

/// Bytes per device of host memory that the step's program needs at least: its arguments held
/// in host memory (offloaded frozen weights).
pub fn host_lower_bound_bytes(spec: &StepSpec, program: &Program) -> i64 {
    program
        .args
        .iter()
        .zip(&program.arg_shard_dims)
        .filter(|(a, _)| a.memory(spec).is_some())
        .map(|(a, d)| d.iter().product::<i64>() * a.dtype.size_bytes() as i64)
        .sum()
}

/// Bytes per device that the step's program needs at least, whatever the compiler does: its
/// arguments held in device memory; with looped layers and activations kept on the device, the
/// stack of every layer's input ([L, B, T, H]); and with attention over every key at once
/// (`--key-block off`), the scores of its smallest query block; each split at most over every
/// device.
pub fn lower_bound_bytes(spec: &StepSpec, program: &Program) -> i64 {
    let args: i64 = program
        .args
        .iter()
        .zip(&program.arg_shard_dims)
        .filter(|(a, _)| a.memory(spec).is_none())
        .map(|(a, d)| d.iter().product::<i64>() * a.dtype.size_bytes() as i64)
        .sum();
    let stack = match spec.remat.scan() && !spec.offload.activations {
        true => layer_inputs_bytes(spec) / program.partitions.max(1),
        false => 0,
    };
    let scores = match spec.key_block {
        None => smallest_scores_bytes(spec) / program.partitions.max(1),
        Some(_) => 0,
    };
    args + stack + scores
}

/// The scores of attention's smallest query block without key blocks, all devices together:
/// [rows, heads, block, block] in the scores' type (the first query block sees as many keys as
/// it has rows; later ones more). A matmul's result that a row-wise softmax then reads whole,
/// which the compilers write out (they fuse no matmul into a reduction over its result).
fn smallest_scores_bytes(spec: &StepSpec) -> i64 {
    let c = &spec.model;
    let rows = spec.batch / spec.grad_accum.max(1);
    let block = crate::model::attention::query_block(spec.seq, spec.attention_block);
    let size = spec.attention_scores.dtype(spec.dtype).size_bytes() as i64;
    rows * c.num_attention_heads * block * block * size
}

/// The layer-input stack of one microbatch, all devices together.
fn layer_inputs_bytes(spec: &StepSpec) -> i64 {
    let c = &spec.model;
    let rows = spec.batch / spec.grad_accum.max(1);
    c.num_hidden_layers * rows * spec.seq * c.hidden_size * spec.dtype.size_bytes() as i64
}

/// The frozen layer weights' bytes per device, and those held in host memory.
fn frozen_bytes(spec: &StepSpec, program: &Program) -> (i64, i64) {
    let mut all = 0;
    let mut host = 0;
    for (a, d) in program.args.iter().zip(&program.arg_shard_dims) {
        if a.role != crate::program::Role::Frozen || !a.name.contains("layers.") {
            continue;
        }
        let bytes = d.iter().product::<i64>() * a.dtype.size_bytes() as i64;
        all += bytes;
        if a.memory(spec).is_some() {
            host += bytes;
        }
    }
    (all, host)
}

/// The step's FLOPs, all devices together (see [`MODEL`]).
pub fn step_flops(spec: &StepSpec) -> f64 {
    let c = &spec.model;
    let tokens = (spec.batch * spec.seq) as f64;
    let params = |ps: &[Projection]| -> f64 {
        ps.iter()
            .map(|&p| {
                let (i, o) = projection_dims(c, p);
                (i * o) as f64
            })
            .sum()
    };
    let layer = params(&Projection::ALL);
    let mlp = params(&[Projection::Gate, Projection::Up, Projection::Down]);
    let tiled = spec.mlp_chunk.is_some_and(|n| n < spec.seq);
    // The frozen projections recomputed in the backward pass, in parameters.
    let recomputed = match spec.remat {
        Remat::None => 0.0,
        Remat::Layer => layer,
        Remat::SaveProj if tiled => mlp,
        Remat::SaveProj => 0.0,
    };
    let l = c.num_hidden_layers as f64;
    let matmuls = 2.0 * tokens * l * (2.0 * layer + recomputed);
    let lora: f64 = spec
        .lora
        .targets
        .iter()
        .map(|&p| {
            let (i, o) = projection_dims(c, p);
            (spec.lora.r * (i + o)) as f64
        })
        .sum();
    // Forward, recomputation, backward through the input and both factors' gradients.
    let lora = 2.0 * tokens * l * lora * 5.0;
    // Causal attention: q.k and p.v over half the keys on average, forward once, backward
    // (with the scores recomputed) 2.5 times that, plus the remat policy's recomputation.
    let heads = (c.num_attention_heads * c.head_dim) as f64;
    let forward = 2.0 * (spec.batch as f64) * (spec.seq as f64).powi(2) * heads;
    let again = match spec.remat {
        Remat::None => 0.0,
        Remat::Layer => 1.0,
        Remat::SaveProj => 0.5,
    };
    let attention = l * forward * (1.0 + 2.5 + again);
    let head = 4.0 * tokens * (c.hidden_size * c.vocab_size) as f64;
    matmuls + lora + attention + head
}

/// The modelled time of `spec`'s step on its devices of `peak_tflops` each, before its launches
/// are known (see [`MODEL`], [`Modelled::with_launches`]).
pub fn modelled(spec: &StepSpec, program: &Program, peak_tflops: f64) -> Modelled {
    let devices = program.partitions.max(1) as f64;
    let compute_s = step_flops(spec) / devices / (peak_tflops * 1e12);
    let micro = spec.grad_accum.max(1) as f64;
    let (frozen, on_host) = frozen_bytes(spec, program);
    // Offloaded weights come in for the forward pass and the backward one, each microbatch;
    // offloaded activations go out once and come back once.
    let mut host = 2.0 * micro * on_host as f64;
    if spec.offload.activations && spec.remat.scan() {
        let split = batch_and_sequence_split(spec) as f64;
        host += 2.0 * micro * layer_inputs_bytes(spec) as f64 / split;
    }
    let axis = |name: &str| {
        spec.mesh.as_ref().map_or(1, |m| {
            m.axes
                .iter()
                .filter(|(a, _)| a == name)
                .map(|(_, n)| *n)
                .product::<i64>()
        }) as f64
    };
    let (fsdp, tensor, context) = (axis("fsdp"), axis("tensor"), axis("context"));
    // The weights are split over the fsdp and context axes alike (program::sharding's rules), so
    // both gather each layer's weights for the forward pass and the backward one; tensor
    // parallelism reduces two activations per layer in the forward, recomputed and backward
    // passes; a context axis also gathers each layer's keys and values (forward, recomputed)
    // and reduces their gradients (backward).
    let gathers = 2.0 * micro * frozen as f64 * (fsdp * context - 1.0);
    let c = &spec.model;
    let rows = (spec.batch as f64 / micro) / (devices / tensor);
    let activation = rows * (spec.seq * c.hidden_size * spec.dtype.size_bytes() as i64) as f64;
    let reductions = match tensor > 1.0 {
        true => {
            micro * 3.0 * 2.0 * c.num_hidden_layers as f64 * activation * 2.0 * (tensor - 1.0)
                / tensor
        }
        false => 0.0,
    };
    let key_values = match context > 1.0 {
        true => {
            let kv_width = (2 * c.num_key_value_heads * c.head_dim) as f64 / tensor;
            let rows_here = (spec.batch as f64 / micro) / (devices / (tensor * context));
            let bytes = rows_here * spec.seq as f64 * kv_width * spec.dtype.size_bytes() as f64;
            micro * 3.0 * c.num_hidden_layers as f64 * bytes * (context - 1.0) / context
        }
        false => 0.0,
    };
    let interconnect_s = (gathers + reductions + key_values) / DEVICE_LINK;
    let host_s = host / HOST_LINK;
    Modelled {
        seconds: compute_s + host_s + interconnect_s,
        compute_s,
        launch_s: 0.0,
        host_s,
        interconnect_s,
    }
}

/// Devices the layer-input stack is split over: the mesh's batch and sequence axes.
fn batch_and_sequence_split(spec: &StepSpec) -> i64 {
    spec.mesh.as_ref().map_or(1, |m| {
        m.axes
            .iter()
            .filter(|(a, _)| a != "tensor")
            .map(|(_, n)| *n)
            .product()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::LoraConfig;

    fn eight_b(seq: i64, remat: Remat) -> StepSpec {
        let model = crate::model::presets::preset_config("llama-3.1-8b")
            .unwrap()
            .expect("the 8B preset");
        let lora = LoraConfig {
            r: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
        };
        StepSpec {
            remat,
            ..StepSpec::new(model, lora, 1, seq, hlo::DType::BF16)
        }
    }

    /// 8B at 2048 tokens: the projections' 6.98e9 parameters (the whole model less the
    /// embeddings and head) give 2 x 2048 x 6.98e9 = 2.86e13 FLOPs a pass; with remat per
    /// layer three passes, the head's 4 x 2048 x 4096 x 128256 and the rest small.
    #[test]
    fn the_flops_are_the_passes_over_the_projections_and_the_head() {
        let f = step_flops(&eight_b(2048, Remat::Layer));
        let passes = 3.0 * 2.0 * 2048.0 * 6.98e9;
        let head = 4.0 * 2048.0 * 4096.0 * 128256.0;
        assert!(f > passes + head && f < 1.1 * (passes + head), "{f:e}");
        assert!(step_flops(&eight_b(2048, Remat::SaveProj)) < f);
        let tiled = StepSpec {
            mlp_chunk: Some(512),
            ..eight_b(2048, Remat::SaveProj)
        };
        assert!(step_flops(&tiled) > step_flops(&eight_b(2048, Remat::SaveProj)));
    }
}

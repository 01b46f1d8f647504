//! What a built program is: its StableHLO text and its signature, every argument and result
//! named, shaped, typed and given a role (what the runner feeds it or reads from it).

use crate::program::spec::{de_dtype, ser_dtype, StepSpec};
use hlo::DType;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
    /// The largest |LoRA weight| a training step's update computed: not finite when the update
    /// was refused (the state kept its old values).
    MaxWeight,
    /// The largest change of a LoRA weight the update computed.
    MaxUpdate,
    /// The largest |LoRA weight| before the update. The update was refused (kept the old state)
    /// when the largest change is more than `model::optim::BLOWN_UP` times this.
    MaxWeightBefore,
    Logits,
    TokenLoss,
    /// A LoRA tensor of the reference adapter of a DPO step (`--reference start`): the adapter
    /// the run started from, frozen, named `reference.<PEFT name>`.
    ReferenceLora,
    /// Each row's completion log-probability under the reference [rows], an argument of a DPO
    /// step built with `--precompute-reference`, or a result of a DPO step.
    ReferenceLogps,
    /// Each row's completion log-probability under the policy [rows] (a result).
    Logps,
}

/// One argument or result of a program.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<i64>,
    #[serde(serialize_with = "ser_dtype", deserialize_with = "de_dtype")]
    pub dtype: DType,
    pub role: Role,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, shape: Vec<i64>, dtype: DType, role: Role) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            shape,
            dtype,
            role,
        }
    }

    /// The memory this argument is passed in, in a program built for `spec`: host memory for
    /// the stacked frozen layer weights when they are offloaded, else the device's own (None).
    pub fn memory(&self, spec: &StepSpec) -> Option<hlo::MemoryKind> {
        (spec.offload.frozen && self.role == Role::Frozen && self.name.contains("layers.*."))
            .then_some(hlo::MemoryKind::PinnedHost)
    }
}

/// A built program: its text and its signature.
#[derive(Clone)]
pub struct Program {
    pub text: String,
    pub args: Vec<TensorSpec>,
    pub results: Vec<TensorSpec>,
    /// Number of devices (SPMD partitions) it runs on.
    pub partitions: i64,
    /// The shape each device holds of each argument.
    pub arg_shard_dims: Vec<Vec<i64>>,
}

impl Program {
    /// (name, shape) of each frozen weight argument, in argument order: what the weight loaders
    /// and random initialisers fill.
    pub fn frozen_shapes(&self) -> Vec<(String, Vec<i64>)> {
        self.args
            .iter()
            .filter(|a| a.role == Role::Frozen)
            .map(|a| (a.name.clone(), a.shape.clone()))
            .collect()
    }

    pub fn new(
        text: String,
        args: Vec<TensorSpec>,
        results: Vec<TensorSpec>,
        spec: &StepSpec,
    ) -> Program {
        let arg_shard_dims = args
            .iter()
            .map(|a| match &spec.mesh {
                Some(m) => m
                    .sharding(&a.name, &a.shape)
                    .shard_dims(&a.shape, &m.mesh()),
                None => a.shape.clone(),
            })
            .collect();
        let partitions = spec.mesh.as_ref().map_or(1, |m| m.devices());
        Program {
            text,
            args,
            results,
            partitions,
            arg_shard_dims,
        }
    }

    /// The sharding of each argument (all replicated without a mesh).
    pub fn arg_shardings(&self, spec: &StepSpec) -> Vec<hlo::Sharding> {
        self.args.iter().map(|a| shard_of(spec, a)).collect()
    }

    pub fn result_shardings(&self, spec: &StepSpec) -> Vec<hlo::Sharding> {
        self.results.iter().map(|a| shard_of(spec, a)).collect()
    }
}

fn shard_of(spec: &StepSpec, a: &TensorSpec) -> hlo::Sharding {
    match &spec.mesh {
        Some(m) => m.sharding(&a.name, &a.shape),
        None => hlo::Sharding::replicated(a.shape.len()),
    }
}

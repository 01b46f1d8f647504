//! `xla.CompileOptionsProto`, the serialized compile options `PJRT_Client_Compile` takes.
//!
//! Only the fields xtrain sets are declared; protobuf skips the rest. Field numbers come from
//! `xla/pjrt/proto/compile_options.proto` and `xla/xla.proto`.

use std::collections::BTreeMap;

#[derive(Clone, PartialEq, prost::Message)]
pub struct CompileOptionsProto {
    #[prost(message, optional, tag = "3")]
    pub executable_build_options: Option<ExecutableBuildOptionsProto>,
    /// XLA debug options by name (e.g. `xla_dump_to`), applied on top of the plugin's defaults.
    /// A BTreeMap so the serialized bytes (part of the executable cache key) are deterministic.
    #[prost(btree_map = "string, message", tag = "7")]
    pub env_option_overrides: BTreeMap<String, OptionOverrideProto>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExecutableBuildOptionsProto {
    #[prost(int64, tag = "1")]
    pub device_ordinal: i64,
    #[prost(int64, tag = "4")]
    pub num_replicas: i64,
    #[prost(int64, tag = "5")]
    pub num_partitions: i64,
    #[prost(bool, tag = "6")]
    pub use_spmd_partitioning: bool,
    #[prost(message, optional, tag = "9")]
    pub device_assignment: Option<DeviceAssignmentProto>,
    /// Let the partitioner choose the outputs' shardings (per output; one `true` applies to all).
    #[prost(bool, repeated, tag = "12")]
    pub allow_spmd_sharding_propagation_to_output: Vec<bool>,
    #[prost(bool, tag = "19")]
    pub use_shardy_partitioner: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DeviceAssignmentProto {
    #[prost(int32, tag = "1")]
    pub replica_count: i32,
    #[prost(int32, tag = "2")]
    pub computation_count: i32,
    #[prost(message, repeated, tag = "3")]
    pub computation_devices: Vec<ComputationDevice>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ComputationDevice {
    #[prost(int64, repeated, tag = "1")]
    pub replica_device_ids: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct OptionOverrideProto {
    #[prost(oneof = "OptionValue", tags = "1, 2, 3, 4")]
    pub value: Option<OptionValue>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum OptionValue {
    #[prost(string, tag = "1")]
    String(String),
    #[prost(bool, tag = "2")]
    Bool(bool),
    #[prost(int64, tag = "3")]
    Int(i64),
    #[prost(double, tag = "4")]
    Double(f64),
}

/// What a caller chooses about a compilation. Turned into `CompileOptionsProto` bytes by
/// [`CompileOptions::to_bytes`], which always sets `num_replicas` and `num_partitions`: a plugin
/// given neither aborts the process instead of returning an error.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    pub num_replicas: i64,
    pub num_partitions: i64,
    /// SPMD partitioning with the Shardy partitioner (needed for `sdy.sharding` annotations).
    pub spmd: bool,
    /// Device ids, one per partition, in partition order. Empty: the plugin's default assignment.
    pub device_ids: Vec<i64>,
    /// Let the partitioner choose the shardings of outputs the program leaves open (JAX sets
    /// this; without it such outputs come back replicated).
    pub propagate_output_shardings: bool,
    /// XLA debug option overrides, e.g. `("xla_dump_to", String("/tmp/dump"))`.
    pub overrides: BTreeMap<String, OptionValue>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            spmd: false,
            device_ids: Vec::new(),
            propagate_output_shardings: false,
            overrides: BTreeMap::new(),
        }
    }
}

impl CompileOptions {
    /// Options for an SPMD program over `device_ids.len()` partitions (one replica).
    pub fn spmd(device_ids: Vec<i64>) -> Self {
        CompileOptions::default().partitioned_over(device_ids)
    }

    /// These options, for an SPMD program partitioned over `device_ids` (one replica); the
    /// other settings (overrides, layouts) are kept.
    pub fn partitioned_over(mut self, device_ids: Vec<i64>) -> Self {
        self.num_partitions = device_ids.len() as i64;
        self.spmd = device_ids.len() > 1;
        self.device_ids = device_ids;
        self
    }

    pub fn with_override(mut self, name: &str, value: OptionValue) -> Self {
        self.overrides.insert(name.to_string(), value);
        self
    }

    pub fn to_proto(&self) -> CompileOptionsProto {
        let device_assignment = if self.device_ids.is_empty() {
            None
        } else {
            Some(DeviceAssignmentProto {
                replica_count: self.num_replicas as i32,
                computation_count: self.device_ids.len() as i32,
                computation_devices: self
                    .device_ids
                    .iter()
                    .map(|&id| ComputationDevice {
                        replica_device_ids: vec![id],
                    })
                    .collect(),
            })
        };
        CompileOptionsProto {
            executable_build_options: Some(ExecutableBuildOptionsProto {
                device_ordinal: -1,
                num_replicas: self.num_replicas.max(1),
                num_partitions: self.num_partitions.max(1),
                use_spmd_partitioning: self.spmd,
                device_assignment,
                allow_spmd_sharding_propagation_to_output: if self.propagate_output_shardings {
                    vec![true]
                } else {
                    Vec::new()
                },
                use_shardy_partitioner: self.spmd,
            }),
            env_option_overrides: self
                .overrides
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        OptionOverrideProto {
                            value: Some(v.clone()),
                        },
                    )
                })
                .collect(),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(&self.to_proto())
    }
}

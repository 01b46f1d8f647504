//! The hardware `--target` knows by name: TPU generations and GPU descriptions, read from a
//! table (`builtin.toml`, compiled into the binary) the first time one is asked for, and each
//! GPU written as the GpuTargetConfigProto text its plugin takes.

use crate::device::absent::Platform;
use anyhow::{bail, Result};
use std::sync::OnceLock;

/// A GPU's compute architecture as XLA's GPU compilers take it.
#[derive(Clone, Debug, PartialEq)]
pub enum GpuArch {
    /// NVIDIA compute capability (major, minor).
    Cuda(u32, u32),
    /// AMD GCN architecture name with its features.
    Rocm(String),
}

/// A GPU described from its public specification, in the terms of XLA's `GpuDeviceInfoProto`
/// (`builtin.toml` says what each field is). Memory sizes are what the driver reports as the
/// device's total memory.
#[derive(Clone, Debug)]
pub struct GpuModel {
    /// The name used in `--target` (`cuda:<name>:<count>`).
    pub name: String,
    /// The device kind as the driver reports it (what a PJRT client on the real GPU calls it).
    pub kind: String,
    pub arch: GpuArch,
    /// Streaming multiprocessors (NVIDIA) or compute units (AMD).
    pub cores: u32,
    pub memory_bytes: i64,
    pub bandwidth_bytes_per_s: i64,
    pub l2_bytes: i64,
    pub clock_ghz: f64,
    pub threads_per_warp: u32,
    pub threads_per_core: u32,
    pub fpus_per_core: u32,
    pub shared_per_block: u32,
    pub shared_per_block_optin: u32,
    pub shared_per_core: u32,
    pub registers_per_core: u32,
    pub registers_per_block: u32,
    /// Dense bf16 matrix throughput (TFLOP/s), for model-FLOPs utilisation figures.
    pub peak_bf16_tflops: f64,
    /// Host memory per GPU in its usual machine: `xtrain plan`'s default budget.
    pub host_memory_bytes: i64,
}

/// A TPU generation as libtpu names it, with its dense bf16 throughput per chip (TFLOP/s).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpuGeneration {
    pub name: String,
    pub peak_bf16_tflops_per_chip: f64,
    /// Host memory per chip, GiB: `xtrain plan`'s default budget (builtin.toml says why).
    pub host_memory_gib_per_chip: i64,
    /// Chips in the generation's largest slice (a full pod).
    pub max_chips: i64,
}

/// The built-in GPU descriptions, in the table's order.
pub fn gpus() -> &'static [GpuModel] {
    &builtin().gpus
}

/// The TPU generations, in the table's order.
pub fn tpus() -> &'static [TpuGeneration] {
    &builtin().tpus
}

/// The table, as written in the binary.
const TABLE: &str = include_str!("builtin.toml");

struct Builtin {
    tpus: Vec<TpuGeneration>,
    gpus: Vec<GpuModel>,
}

fn builtin() -> &'static Builtin {
    static BUILTIN: OnceLock<Builtin> = OnceLock::new();
    // The table is part of the binary, and its unit test reads it: it cannot fail here.
    BUILTIN.get_or_init(|| read_table(TABLE).expect("builtin.toml is a valid table"))
}

/// `builtin.toml` as written: `[[tpu]]` and `[[gpu]]` rows.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    tpu: Vec<TpuGeneration>,
    gpu: Vec<GpuRow>,
}

/// A `[[gpu]]` row: sizes in the units its names say, and one of the two architectures.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuRow {
    name: String,
    kind: String,
    cuda_compute_capability: Option<[u32; 2]>,
    rocm_gcn_arch: Option<String>,
    cores: u32,
    memory_mib: i64,
    bandwidth_bytes_per_s: i64,
    l2_mib: i64,
    clock_ghz: f64,
    threads_per_warp: u32,
    threads_per_core: u32,
    fpus_per_core: u32,
    shared_per_block_kib: u32,
    shared_per_block_optin_kib: u32,
    shared_per_core_kib: u32,
    registers_per_core: u32,
    registers_per_block: u32,
    peak_bf16_tflops: f64,
    host_memory_gib: i64,
}

fn read_table(text: &str) -> Result<Builtin> {
    let table: Table = toml::from_str(text)?;
    let mut gpus = Vec::new();
    for g in table.gpu {
        let arch = match (g.cuda_compute_capability, g.rocm_gcn_arch) {
            (Some([major, minor]), None) => GpuArch::Cuda(major, minor),
            (None, Some(name)) => GpuArch::Rocm(name),
            _ => bail!(
                "GPU `{}`: give either cuda_compute_capability or rocm_gcn_arch",
                g.name
            ),
        };
        if gpus
            .iter()
            .any(|o: &GpuModel| o.name == g.name && o.arch == arch)
        {
            bail!("GPU `{}` is described twice", g.name);
        }
        gpus.push(GpuModel {
            name: g.name,
            kind: g.kind,
            arch,
            cores: g.cores,
            memory_bytes: g.memory_mib << 20,
            bandwidth_bytes_per_s: g.bandwidth_bytes_per_s,
            l2_bytes: g.l2_mib << 20,
            clock_ghz: g.clock_ghz,
            threads_per_warp: g.threads_per_warp,
            threads_per_core: g.threads_per_core,
            fpus_per_core: g.fpus_per_core,
            shared_per_block: g.shared_per_block_kib * 1024,
            shared_per_block_optin: g.shared_per_block_optin_kib * 1024,
            shared_per_core: g.shared_per_core_kib * 1024,
            registers_per_core: g.registers_per_core,
            registers_per_block: g.registers_per_block,
            peak_bf16_tflops: g.peak_bf16_tflops,
            host_memory_bytes: g.host_memory_gib << 30,
        });
    }
    Ok(Builtin {
        tpus: table.tpu,
        gpus,
    })
}

impl GpuModel {
    /// The platform whose plugin compiles for this GPU.
    pub fn platform(&self) -> Platform {
        match self.arch {
            GpuArch::Cuda(..) => Platform::Cuda,
            GpuArch::Rocm(_) => Platform::Rocm,
        }
    }

    /// The description in the text form of XLA's `GpuTargetConfigProto`, using only fields the
    /// pinned plugins know (an unknown field fails the plugin's parse).
    pub fn target_config(&self) -> String {
        let (arch, platform, dnn) = match &self.arch {
            GpuArch::Cuda(major, minor) => (
                format!("cuda_compute_capability {{ major: {major} minor: {minor} }}"),
                "CUDA",
                // cuDNN 9, which the CUDA 13 plugins are built against.
                "dnn_version_info { major: 9 minor: 8 patch: 0 }",
            ),
            GpuArch::Rocm(name) => (
                format!("rocm_compute_capability {{ gcn_arch_name: \"{name}\" }}"),
                "ROCM",
                "dnn_version_info { major: 3 minor: 5 patch: 0 }",
            ),
        };
        format!(
            "gpu_device_info {{\n  {arch}\n  threads_per_block_limit: 1024\n  \
             threads_per_warp: {}\n  shared_memory_per_block: {}\n  \
             shared_memory_per_block_optin: {}\n  shared_memory_per_core: {}\n  \
             threads_per_core_limit: {}\n  core_count: {}\n  fpus_per_core: {}\n  \
             block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n  \
             block_dim_limit_z: 65535\n  memory_bandwidth: {}\n  l2_cache_size: {}\n  \
             clock_rate_ghz: {}\n  device_memory_size: {}\n  registers_per_core_limit: {}\n  \
             registers_per_block_limit: {}\n}}\nplatform_name: \"{platform}\"\n{dnn}\n\
             device_description_str: \"{}\"\n",
            self.threads_per_warp,
            self.shared_per_block,
            self.shared_per_block_optin,
            self.shared_per_core,
            self.threads_per_core,
            self.cores,
            self.fpus_per_core,
            self.bandwidth_bytes_per_s,
            self.l2_bytes,
            self.clock_ghz,
            self.memory_bytes,
            self.registers_per_core,
            self.registers_per_block,
            self.kind,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table reads, and every built-in GPU's description passes the checks a
    /// `--target-config` file gets.
    #[test]
    fn every_builtin_description_parses() {
        let table = read_table(TABLE).unwrap();
        assert!(!table.tpus.is_empty() && !table.gpus.is_empty());
        for g in &table.gpus {
            crate::device::absent::config_file::check(&g.target_config(), g.platform())
                .unwrap_or_else(|e| panic!("{}: {e:#}", g.name));
        }
        let h100 = table.gpus.iter().find(|g| g.name == "h100").unwrap();
        assert_eq!(
            (h100.memory_bytes, h100.shared_per_block_optin),
            (81559 << 20, 227 * 1024)
        );
    }

    #[test]
    fn a_row_names_one_architecture() {
        let row = |arch: &str| {
            format!(
                "tpu = []\n[[gpu]]\nname = \"x\"\nkind = \"X\"\n{arch}cores = 1\nmemory_mib = 1\n\
                 bandwidth_bytes_per_s = 1\nl2_mib = 1\nclock_ghz = 1.0\nthreads_per_warp = 32\n\
                 threads_per_core = 1\nfpus_per_core = 1\nshared_per_block_kib = 1\n\
                 shared_per_block_optin_kib = 1\nshared_per_core_kib = 1\nregisters_per_core = 1\n\
                 registers_per_block = 1\npeak_bf16_tflops = 1.0\nhost_memory_gib = 64\n"
            )
        };
        assert!(read_table(&row("cuda_compute_capability = [9, 0]\n")).is_ok());
        for arch in [
            "",
            "cuda_compute_capability = [9, 0]\nrocm_gcn_arch = \"gfx942\"\n",
        ] {
            let e = read_table(&row(arch)).err().unwrap().to_string();
            assert!(
                e.contains("either cuda_compute_capability or rocm_gcn_arch"),
                "{e}"
            );
        }
    }
}

//! The device side: a PJRT client, compiled programs, host <-> device tensors.

use crate::formats::host::element_type;
use crate::program::Program;
use anyhow::{bail, Context, Result};
use pjrt::{
    Buffer, Client, ClientOptions, CompileOptions, Device, ElementType, Executable, HostTensor,
    Plugin,
};

/// What each device must be given: every argument's element type and shard shape.
pub fn expected_inputs(program: &Program) -> Vec<(ElementType, Vec<i64>)> {
    program
        .args
        .iter()
        .zip(&program.arg_shard_dims)
        .map(|(a, d)| (element_type(a.dtype), d.clone()))
        .collect()
}

/// On the CPU plugin, device memory is the process's heap, and XLA allocates each execution's
/// temporaries (hundreds of MB for a training step) with malloc and frees them after it. glibc
/// serves blocks that large with fresh mmaps, and the worker threads' own arenas give memory back
/// on free, so every step page-faults its temporaries in again: 120k faults (470 MB of zeroed
/// pages) per step on the benchmark workload, about 0.1 s of 1.3 s. One arena that never unmaps
/// or trims keeps those pages for the next step (31k faults per step; `tools/bench` shows the
/// time). Must run before the plugin starts its threads, and before any other threads have
/// made arenas of their own: `xtrain bench` makes its random weights on all cores first, and
/// with the policy set only when the plugin was opened, the step page-faulted 200k times again
/// (f32; bf16 55k). [`prepare_host_memory`] sets it at the start of a command. The memory is
/// kept, not leaked: the next step reuses it, and the high-water mark is what XLA's figures
/// already say the step needs.
fn keep_freed_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes glibc's allocation policy; it is called once, before
            // the plugin's threads exist, and its failure (a 0 return) leaves the defaults.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, 1);
                libc::mallopt(libc::M_MMAP_MAX, 0);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            }
        });
    }
}

/// The share of GPU memory the CUDA/ROCm plugins may use: 0.9 (theirs is 0.75), or
/// `$XTRAIN_GPU_MEMORY_FRACTION`.
fn gpu_memory_fraction() -> Result<f32> {
    match std::env::var("XTRAIN_GPU_MEMORY_FRACTION") {
        Err(_) => Ok(0.9),
        Ok(v) => match v.trim().parse::<f32>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
            _ => bail!("XTRAIN_GPU_MEMORY_FRACTION must be a number in (0, 1], got `{v}`"),
        },
    }
}

/// Whether bf16 matmuls should give their f32 accumulator (`StepSpec::wide_matmul_results`):
/// `choice` is `auto` (yes for a CPU plugin, whose XLA runs that form on the CPU's bf16 GEMM
/// and converts both operands of a bf16-result product to f32 instead: the 8-layer benchmark
/// step 1.25 -> 0.79 s; no for GPUs, whose cuBLAS writes bf16 directly), `f32` or `compute`.
/// `plugin` is named as for [`Runtime::open`]; nothing is loaded or installed to decide.
pub fn wide_matmul_results(choice: &str, plugin: Option<&str>) -> Result<bool> {
    match choice {
        "f32" => Ok(true),
        "compute" => Ok(false),
        "auto" => Ok(names_cpu_plugin(plugin)),
        other => bail!("--matmul-result must be auto, f32 or compute, got `{other}`"),
    }
}

/// Whether `plugin` (as named for [`Runtime::open`], `$XTRAIN_PLUGIN` or else `cpu`) is the CPU
/// plugin, by its name alone: nothing is loaded or installed.
fn names_cpu_plugin(plugin: Option<&str>) -> bool {
    let env = std::env::var("XTRAIN_PLUGIN").ok();
    let name = plugin.or(env.as_deref()).unwrap_or("cpu");
    let file = std::path::Path::new(name)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    name == "cpu" || file.contains("cpu")
}

/// Call first thing in a command that will run on `plugin`, before it starts any threads: for
/// the CPU plugin, sets the allocation policy its steps need (see `keep_freed_host_memory`).
pub fn prepare_host_memory(plugin: Option<&str>) {
    if names_cpu_plugin(plugin) {
        keep_freed_host_memory();
    }
}

/// A PJRT client on one backend.
pub struct Runtime {
    pub client: Client,
    pub devices: Vec<Device>,
}

impl Runtime {
    /// Open the plugin (`cpu`, `cuda`, ..., a path, or `$XTRAIN_PLUGIN`; the CPU plugin is
    /// installed on first use) and create a client. `cpu_devices` sets the CPU plugin's number
    /// of virtual devices.
    pub fn open(plugin: Option<&str>, cpu_devices: Option<i64>) -> Result<Runtime> {
        let path = pjrt::discover::resolve_or_install(plugin)?;
        let name = path.to_string_lossy();
        // The same rule by name as `xtrain`'s commands use before they start (the policy must be
        // set before the plugin's threads exist, so its platform name comes too late).
        let cpu = names_cpu_plugin(Some(&name));
        let gpu = name.contains("cuda") || name.contains("rocm");
        if cpu {
            keep_freed_host_memory();
        }
        let plugin = Plugin::load(&path)?;
        let options = match cpu_devices {
            Some(n) if cpu => ClientOptions::cpu_device_count(n),
            _ if gpu => ClientOptions::gpu_memory_fraction(gpu_memory_fraction()?),
            _ => ClientOptions::default(),
        };
        let client = plugin
            .client(&options)
            .with_context(|| format!("cannot create a client for {}", path.display()))?;
        let devices = client.devices()?;
        if devices.is_empty() {
            bail!("the plugin {} reports no devices", path.display());
        }
        Ok(Runtime { client, devices })
    }

    /// Whether this backend wants bf16 matmuls to give their f32 accumulator (see
    /// [`wide_matmul_results`]).
    pub fn prefers_wide_matmul_results(&self) -> bool {
        self.client.platform_name().unwrap_or_default() == "cpu"
    }

    /// The options xtrain compiles with on this backend, on top of the caller's.
    ///
    /// On CPU, XLA computes bf16 matmuls in f32 and its while-loop invariant code motion then
    /// hoists the f32 conversion of a whole stacked weight out of the layer loop: 3x the weight
    /// memory. xtrain already builds loop-invariant values outside its loops, so the pass is off.
    /// XLA CPU's tree reduction rewriter splits every long reduction (the softmax over the
    /// vocabulary, RMSNorm's mean) into a chain of reduce-windows that cannot take their producer
    /// into the same loop; without it the step was 1-3% faster in three A/B runs on the benchmark
    /// (same loss to the last bit there; the oracle tests pass), so it is off too.
    pub fn options(&self, base: &CompileOptions) -> CompileOptions {
        let mut o = base.clone();
        if self.client.platform_name().unwrap_or_default() == "cpu"
            && !o.overrides.contains_key("xla_disable_hlo_passes")
        {
            o = o.with_override(
                "xla_disable_hlo_passes",
                pjrt::OptionValue::String(
                    "while-loop-invariant-code-motion,tree_reduction_rewriter".into(),
                ),
            );
        }
        o
    }

    /// Compile a program (on as many devices as it has partitions), checking its arguments on
    /// every execute.
    pub fn compile(&self, program: &Program, options: &CompileOptions) -> Result<Executable> {
        let mut options = self.options(options);
        if program.partitions > 1 {
            if (self.devices.len() as i64) < program.partitions {
                bail!(
                    "the program needs {} devices but the plugin has {}",
                    program.partitions,
                    self.devices.len()
                );
            }
            let ids: Vec<i64> = self.devices[..program.partitions as usize]
                .iter()
                .map(|d| d.id().map(|i| i as i64))
                .collect::<std::result::Result<_, _>>()?;
            let spmd = CompileOptions::spmd(ids);
            options.num_partitions = spmd.num_partitions;
            options.spmd = true;
            options.device_ids = spmd.device_ids;
        }
        let mut exe = self
            .client
            .compile(&program.text, &options)
            .context("XLA could not compile the program")?;
        exe.expect_inputs(expected_inputs(program));
        Ok(exe)
    }

    pub fn upload(&self, t: &HostTensor) -> Result<Buffer> {
        Ok(self.client.to_device(t, &self.devices[0])?)
    }

    /// Upload each device's shard of `t` (one buffer per partition). Only the shard is copied to
    /// each device.
    pub fn upload_sharded(
        &self,
        t: &HostTensor,
        sharding: &hlo::Sharding,
        mesh: Option<&hlo::Mesh>,
    ) -> Result<Vec<Buffer>> {
        let Some(mesh) = mesh else {
            return Ok(vec![self.upload(t)?]);
        };
        (0..mesh.device_count() as usize)
            .map(|p| {
                let (starts, sizes) =
                    crate::program::sharding::shard_box(&t.dims, sharding, mesh, p);
                let shard = crate::program::sharding::slice(t, &starts, &sizes);
                Ok(self.client.to_device(&shard, &self.devices[p])?)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--matmul-result auto` is decided from the plugin's name alone: the f32-result form for
    /// the CPU plugin (by name or by its file), the bf16-result form for accelerators.
    #[test]
    fn auto_matmul_result_follows_the_plugin_name() {
        for (plugin, wide) in [
            ("cpu", true),
            ("/root/.cache/xtrain/plugins/cpu/xla_cpu_pjrt.so", true),
            ("cuda", false),
            ("rocm", false),
            ("tpu", false),
            (
                "/site-packages/jax_plugins/xla_cuda13/xla_cuda_plugin.so",
                false,
            ),
        ] {
            assert_eq!(
                wide_matmul_results("auto", Some(plugin)).unwrap(),
                wide,
                "{plugin}"
            );
            assert!(wide_matmul_results("f32", Some(plugin)).unwrap());
            assert!(!wide_matmul_results("compute", Some(plugin)).unwrap());
        }
        let e = wide_matmul_results("bf16", Some("cpu")).unwrap_err();
        assert!(e.to_string().contains("auto, f32 or compute"), "{e}");
    }
}

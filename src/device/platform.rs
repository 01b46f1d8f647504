//! What xtrain does differently per backend, decided before or as a plugin is opened: the CPU
//! plugin's host memory policy, the GPU plugins' memory fraction, and the matmul form of
//! `--matmul-result auto`.

use anyhow::{bail, Result};

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
pub(super) fn keep_freed_host_memory() {
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
pub(super) fn gpu_memory_fraction() -> Result<f32> {
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
/// `plugin` is named as for [`Runtime::open`](crate::device::runtime::Runtime::open); nothing is loaded or installed to decide.
pub fn wide_matmul_results(choice: &str, plugin: Option<&str>) -> Result<bool> {
    match choice {
        "f32" => Ok(true),
        "compute" => Ok(false),
        "auto" => Ok(names_cpu_plugin(plugin)),
        other => bail!("--matmul-result must be auto, f32 or compute, got `{other}`"),
    }
}

/// Whether `plugin` (as named for [`Runtime::open`](crate::device::runtime::Runtime::open), `$XTRAIN_PLUGIN` or else `cpu`) is the CPU
/// plugin, by its name alone: nothing is loaded or installed.
pub(super) fn names_cpu_plugin(plugin: Option<&str>) -> bool {
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

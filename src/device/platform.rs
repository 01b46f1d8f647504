//! What xtrain does differently per backend, decided before or as a plugin is opened: the CPU
//! plugin's host memory policy, the GPU plugins' memory fraction, libtpu's environment, and the
//! offload the CPU cannot run. None of it changes the program's text.

use anyhow::{bail, Result};

/// On the CPU plugin, device memory is the process's heap, and XLA allocates each execution's
/// temporaries (hundreds of MB for a training step) with malloc and frees them after it. glibc
/// serves blocks that large with fresh mmaps, and the worker threads' own arenas give memory back
/// on free, so every step page-faults its temporaries in again. One arena that never unmaps or
/// trims keeps those pages for the next step (docs/performance.md has the page faults and
/// times). Must run before the plugin starts its threads, and before any other threads have
/// made arenas of their own (`xtrain bench` makes its random weights on all cores first).
/// [`prepare_host_memory`] sets it at the start of a command. The memory is kept, not leaked:
/// the next step reuses it, and the high-water mark is what XLA's figures already say the step
/// needs.
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
            KEPT.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
}

/// Whether [`keep_freed_host_memory`]'s policy is in force.
static KEPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Run `load` (uploading the frozen weights shard by shard) with blocks of 1 MiB and more
/// mapped fresh and unmapped when freed, then put [`keep_freed_host_memory`]'s policy back.
/// Under that policy a freed shard stays in the heap, and the next shard and the device buffers
/// (on the CPU plugin, host memory too), of other sizes, fit its hole only in part, and the
/// peak while loading grows by such holes. The device buffers made meanwhile keep their own
/// mappings, which the steps only read.
pub(super) fn while_loading<T>(load: impl FnOnce() -> T) -> T {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if KEPT.load(std::sync::atomic::Ordering::SeqCst) {
        // SAFETY: as above; mallopt may be called while other threads allocate (glibc takes
        // its lock), and these parameters only decide how later blocks are obtained: a block
        // is freed the way it was obtained whatever they are then.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
            libc::mallopt(libc::M_MMAP_MAX, 1 << 20);
        }
        let out = load();
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0);
        }
        return out;
    }
    load()
}

/// The share of GPU memory the CUDA/ROCm plugins may use: 0.9 (theirs is 0.75), or
/// `$XTRAIN_GPU_MEMORY_FRACTION`.
pub(crate) fn gpu_memory_fraction() -> Result<f32> {
    match std::env::var("XTRAIN_GPU_MEMORY_FRACTION") {
        Err(_) => Ok(0.9),
        Ok(v) => match v.trim().parse::<f32>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
            _ => bail!("XTRAIN_GPU_MEMORY_FRACTION must be a number in (0, 1], got `{v}`"),
        },
    }
}

/// The platform (PJRT's name: `cpu`, `cuda`, `rocm`, `tpu`) of the plugin `plugin` names, as
/// named for `Runtime::open` (`$XTRAIN_PLUGIN` or else
/// `cpu` when None), from the name alone: one of those names is that platform, and a path is
/// the first of them its file name contains (`xla_cpu_pjrt.so`: cpu; `xla_cuda_plugin.so`: cuda),
/// else "unknown". Nothing is loaded or installed: what `xtrain compile` builds for (it writes a
/// program for a plugin that need not be on this machine), and how the CPU plugin's needs are
/// known before its client exists. Commands that open the plugin ask it
/// (`Runtime::platform`).
pub fn named_platform(plugin: Option<&str>) -> &'static str {
    const PLATFORMS: [&str; 4] = ["cpu", "cuda", "rocm", "tpu"];
    let env = std::env::var("XTRAIN_PLUGIN").ok();
    let name = plugin.or(env.as_deref()).unwrap_or("cpu");
    if let Some(p) = PLATFORMS.iter().find(|p| **p == name) {
        return p;
    }
    let file = std::path::Path::new(name)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    PLATFORMS
        .iter()
        .find(|p| file.contains(*p))
        .copied()
        .unwrap_or("unknown")
}

/// Call first thing in a command that will run on `plugin`, before it starts any threads: for
/// the CPU plugin, sets the allocation policy its steps need (see `keep_freed_host_memory`).
pub fn prepare_host_memory(plugin: Option<&str>) {
    if named_platform(plugin) == "cpu" {
        keep_freed_host_memory();
    }
}

static VERBOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the command was run with `-v`: the plugins' own logging is then shown (set once, by
/// the command line, before any plugin loads).
pub fn set_verbose(verbose: bool) {
    VERBOSE.store(verbose, std::sync::atomic::Ordering::Relaxed);
}

/// See [`set_verbose`].
pub fn verbose() -> bool {
    VERBOSE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Run `f` with the process's stderr sent to /dev/null unless `verbose`: the GPU plugins log a
/// few lines while they load (absl's "before InitializeLog" warning, "Could not find cuda
/// drivers") whatever `TF_CPP_MIN_LOG_LEVEL` says, and a deviceless compile expects no driver.
/// Their errors come back as PJRT errors, which are printed as usual.
pub fn quiet_unless<T>(verbose: bool, f: impl FnOnce() -> T) -> T {
    if verbose {
        return f();
    }
    // SAFETY: plain descriptor juggling on fd 2; the saved descriptor is restored and closed
    // whatever `f` returns (a panic inside `f` would leave stderr silenced, but `f` is a load).
    unsafe {
        let saved = libc::dup(2);
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
        if saved < 0 || null < 0 {
            return f();
        }
        libc::dup2(null, 2);
        libc::close(null);
        let out = f();
        libc::dup2(saved, 2);
        libc::close(saved);
        out
    }
}

/// Whether this machine has TPU chips (a TPU VM exposes them as `/dev/accel*` or through VFIO).
/// Without them, libtpu asked for a client spends ~30 s per setting querying a cloud metadata
/// server that is not there; it is then only good for compiling for absent TPUs.
pub fn has_tpu_devices() -> bool {
    let any = |dir: &str, prefix: &str| {
        std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with(prefix))
            })
            .unwrap_or(false)
    };
    any("/dev", "accel") || any("/dev/vfio", "")
}

/// libtpu, compiling for a TPU that is not here, must not ask the cloud metadata server for the
/// machine's TPU (it retries each key for ~29 s) and logs to files and stderr unless told; any
/// accelerator type silences it (it need not match the target). Values the user set win.
pub fn prepare_libtpu_env(verbose: bool) {
    let mut vars = vec![
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", "v5p-8"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        // libtpu takes /tmp/libtpu_lockfile so that one process owns the chips; with none to
        // own, two compiles at once (or a test run) must not fail on it.
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ];
    if !verbose {
        vars.push(("TPU_LOG_DIR", "disabled"));
        vars.push(("TPU_STDERR_LOG_LEVEL", "3"));
        vars.push(("TPU_MIN_LOG_LEVEL", "3"));
    }
    for (k, v) in vars {
        if std::env::var_os(k).is_none() {
            std::env::set_var(k, v);
        }
    }
}

/// The compile option xtrain retries a GPU compile with when XLA's Triton GEMM emitter cannot
/// tile one of the program's dots (the CUDA and ROCm plugins of JAX 0.10.2 fail so on some small
/// or odd shapes, e.g. a LoRA gradient dot of f32[128, 16] in a model split by `fsdp=2`, with
/// "Couldn't find output tile sizes that satisfy ..."): the matmuls become the vendor library's
/// GEMM calls (cuBLAS, hipBLASLt). Only the compile is changed, never the program.
pub const TRITON_GEMM_OFF: &str = "xla_gpu_enable_triton_gemm";

/// Whether a compile error is the Triton GEMM emitter's failure to tile a dot
/// ([`TRITON_GEMM_OFF`] avoids it).
pub fn is_gemm_tiling_failure(e: &anyhow::Error) -> bool {
    format!("{e:#}").contains("Couldn't find output tile sizes")
}

/// `options` with the Triton GEMM emitter off ([`TRITON_GEMM_OFF`]), and the words that say so.
pub fn without_triton_gemm(options: &pjrt::CompileOptions) -> (pjrt::CompileOptions, String) {
    (
        options
            .clone()
            .with_override(TRITON_GEMM_OFF, pjrt::OptionValue::Bool(false)),
        format!("{TRITON_GEMM_OFF}=false"),
    )
}

/// Refuse a step that keeps values in host memory on a plugin of `platform` that cannot place
/// them there: XLA's CPU compiler has no `annotate_device_placement` (its memory kinds device,
/// pinned_host and unpinned_host are all the same RAM), so such a program fails inside it with
/// "Side-effect ops cannot be replicated" or worse. `what` names where the step came from.
pub fn check_offload(platform: &str, offload: crate::program::Offload, what: &str) -> Result<()> {
    if offload.is_none() || platform != "cpu" {
        return Ok(());
    }
    bail!(
        "{what} keeps values in host memory (--offload {}), but XLA's CPU compiler cannot place \
         values in host memory (no annotate_device_placement: the CPU plugin's memory kinds are \
         all the same RAM); offload is for GPUs and TPUs (compile for one with --target, e.g. \
         cuda:h100:8); on the CPU use --offload none",
        offload.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offload is refused by name on the CPU plugin, before XLA sees it, and allowed elsewhere.
    #[test]
    fn offload_is_refused_on_the_cpu_only() {
        use crate::program::Offload;
        for name in ["frozen", "activations", "all"] {
            let o = Offload::parse(name).unwrap();
            let e = check_offload("cpu", o, "this step")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("--offload {name}")) && e.contains("--target"),
                "{e}"
            );
            for platform in ["cuda", "rocm", "tpu"] {
                check_offload(platform, o, "this step").unwrap();
            }
        }
        check_offload("cpu", Offload::NONE, "this step").unwrap();
    }

    /// Plugins are known by name or by file.
    #[test]
    fn plugins_are_known_by_name_or_file() {
        for (plugin, platform) in [
            ("cpu", "cpu"),
            ("/root/.cache/xtrain/plugins/cpu/xla_cpu_pjrt.so", "cpu"),
            ("cuda", "cuda"),
            (
                "/site-packages/jax_plugins/xla_cuda13/xla_cuda_plugin.so",
                "cuda",
            ),
            ("rocm", "rocm"),
            ("tpu", "tpu"),
            ("/opt/other.so", "unknown"),
        ] {
            assert_eq!(named_platform(Some(plugin)), platform, "{plugin}");
        }
    }
}

//! Compiling for a [`Target`] that is not here: its plugin describes the devices (a topology),
//! compiles the program on that description with no client, and reports the compiler's own
//! figures (memory per device, host memory, for TPUs its cost analysis) and the serialized
//! executable that a client on the real hardware loads (`train --program`). The facts this rests
//! on (call sequence, options, traps) are in docs/plugins.md and docs/targets.md.

use crate::device::absent::{Platform, Target};
use crate::program::{Program, StepSpec};
use anyhow::{bail, Context, Result};
use pjrt::{CompileOptions, DeviceDescription, MemoryStats, OptionValue, Plugin, Topology, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// A target's plugin and its description of the target's devices.
pub struct TargetDevices {
    pub target: Target,
    pub plugin: Arc<Plugin>,
    topology: Topology,
    pub devices: Vec<DeviceDescription>,
    pub platform_version: String,
    /// Kernels put in place of the program's composites before it is compiled (`--kernel`).
    pub kernels: Vec<&'static crate::device::kernels::Kernel>,
}

/// What compiling a program for a target gave.
pub struct TargetBuild {
    pub stats: MemoryStats,
    pub compile_s: f64,
    /// The compiler's cost analysis, per device (TPU only): `flops`, `bytes accessed`,
    /// `optimal_seconds`, ...
    pub cost: Option<Vec<(String, f64)>>,
    /// Calls the cost model priced at -1 s ([`unpriced_calls`]), already added back to the
    /// cost's `optimal_seconds`.
    pub unpriced_calls: usize,
    /// The optimized HLO as text, and XLA's memory-usage report, from the compiler's dump.
    pub optimized_hlo: Option<String>,
    pub memory_report: Option<String>,
    pub executable: Vec<u8>,
    /// Compile options beyond xtrain's usual ones that this compile needed (`name=value`; see
    /// [`crate::device::platform::TRITON_GEMM_OFF`]).
    pub extra_options: Vec<String>,
    /// The kernels that replaced composites of the program (`--kernel`).
    pub kernels: Vec<crate::device::kernels::KernelUse>,
}

/// The plugin file for a target: `--plugin` if given (it must be of the target's platform),
/// else the known plugin of that name, installed into the cache on first use.
fn plugin_path(target: &Target, plugin: Option<&str>) -> Result<PathBuf> {
    let want = target.platform.plugin();
    if let Some(p) = plugin {
        let named = crate::device::platform::named_platform(Some(p));
        if named != want && named != "unknown" {
            bail!(
                "--target {} is compiled by the {want} plugin, but --plugin {p} is a {named} plugin; \
                 drop --plugin or give a {want} one",
                target.spec
            );
        }
        return Ok(pjrt::discover::resolve(Some(p))?);
    }
    match pjrt::discover::resolve(Some(want)) {
        Ok(p) => Ok(p),
        Err(pjrt::discover::DiscoverError::NotFound { .. }) => {
            Ok(pjrt::discover::install_announced(want)?)
        }
        Err(e) => Err(e.into()),
    }
}

impl TargetDevices {
    /// Load the target's plugin and describe its devices.
    pub fn open(target: &Target, plugin: Option<&str>, verbose: bool) -> Result<TargetDevices> {
        let path = plugin_path(target, plugin)?;
        if target.platform == Platform::Tpu {
            crate::device::platform::prepare_libtpu_env(verbose);
        }
        let plugin = crate::device::platform::quiet_unless(verbose, || Plugin::load(&path))
            .map_err(|e| match target.platform {
                Platform::Rocm if e.to_string().contains("cannot open shared object") => {
                    anyhow::anyhow!(
                "{e}\nThe ROCm plugin links the ROCm 7 runtime libraries (libamdhip64.so.7, \
                 librocprofiler-sdk.so.1, ...), which a ROCm host has in /opt/rocm/lib and PyPI \
                 does not ship. Compile for ROCm on a machine with ROCm 7 installed (xtrain's own \
                 tests use stand-ins built by tools/rocm-standins instead)."
            )
                }
                _ => e.into(),
            })?;
        if target.platform == Platform::Cuda {
            let missing = pjrt::discover::missing_cuda_tools(plugin.path(), None);
            if !missing.is_empty() {
                let list: Vec<String> = missing
                    .iter()
                    .map(|(p, wheel)| format!("{} (from the {wheel} wheel)", p.display()))
                    .collect();
                bail!(
                    "compiling for a CUDA GPU that is not here needs NVIDIA's ptxas and libdevice \
                     beside the plugin; missing: {}. Run `xtrain plugins install cuda`, which \
                     fetches them, or pip-install those wheels next to the plugin",
                    list.join(", ")
                );
            }
        }
        let topology = plugin
            .topology(&target.topology_name, &target.create_options)
            .map_err(|e| match target.platform {
                Platform::Tpu => anyhow::anyhow!(
                    "libtpu refused the TPU topology `{}` (--target {}): {e}\nxtrain wants \
                     tpu:<generation>:<chips>, the chips as libtpu lays out slices: 2 or 3 sizes \
                     that its hosts of 2x2 chips divide (tpu:v5e:2x2, tpu:v5e:4x4, tpu:v5p:2x2x1, \
                     tpu:v5p:4x4x4, tpu:v6e:16x16), or one chip (tpu:v5e:1x1)",
                    target.topology_name,
                    target.spec
                ),
                _ => anyhow::anyhow!(
                    "the {} plugin refused the target {}: {e}",
                    target.platform.plugin(),
                    target.spec
                ),
            })?;
        let platform = topology.platform_name()?;
        let want = match target.platform {
            Platform::Tpu => "tpu",
            Platform::Cuda => "cuda",
            Platform::Rocm => "rocm",
        };
        if platform != want {
            bail!(
                "the plugin {} is a {platform} plugin; --target {} needs a {want} one",
                path.display(),
                target.spec
            );
        }
        let devices = topology.devices()?;
        if devices.is_empty() {
            bail!("the {want} plugin describes no devices for {}", target.spec);
        }
        let platform_version = topology.platform_version().unwrap_or_default();
        Ok(TargetDevices {
            target: target.clone(),
            plugin,
            topology,
            devices,
            platform_version,
            kernels: Vec::new(),
        })
    }

    /// Hosts (processes) the devices are spread over.
    pub fn hosts(&self) -> i64 {
        self.devices
            .iter()
            .map(|d| d.process_index as i64)
            .max()
            .unwrap_or(0)
            + 1
    }

    pub fn device_kind(&self) -> &str {
        &self.devices[0].kind
    }

    /// Memory per device as the plugin describes it.
    pub fn memory_per_device(&self) -> Option<i64> {
        self.devices[0]
            .attributes
            .iter()
            .find(|(k, _)| k == "device_memory_bytes_limit")
            .and_then(|(_, v)| match v {
                Value::Int(b) => Some(*b),
                _ => None,
            })
    }

    /// What XLA may allocate of a device's memory when the step runs: on a GPU the share xtrain's
    /// runtime gives the plugin's allocator (`gpu_memory_fraction`: 90%, or
    /// `$XTRAIN_GPU_MEMORY_FRACTION`; the rest is the CUDA/ROCm context's and the libraries'), on
    /// a TPU all of it. Whether a step fits is decided against this, as `train` decides it on the
    /// device from the allocator's own limit.
    pub fn usable_memory_per_device(&self) -> Result<Option<i64>> {
        let Some(bytes) = self.memory_per_device() else {
            return Ok(None);
        };
        Ok(Some(match self.target.platform {
            Platform::Tpu => bytes,
            Platform::Cuda | Platform::Rocm => {
                (bytes as f64 * crate::device::platform::gpu_memory_fraction()? as f64) as i64
            }
        }))
    }

    /// Dense bf16 throughput per device (a TPU chip may hold two devices), TFLOP/s.
    pub fn peak_bf16_tflops_per_device(&self) -> Option<f64> {
        let per_chip = self.target.peak_bf16_tflops_per_chip?;
        Some(per_chip * self.target.chips as f64 / self.devices.len() as f64)
    }

    /// Compile `program` for every device of the target. `dump` keeps XLA's dumps there (else
    /// they go to a temporary directory, read for the optimized HLO and removed).
    pub fn compile(&self, program: &Program, dump: Option<&Path>) -> Result<TargetBuild> {
        let (text, kernels) = match self.kernels.is_empty() {
            true => (program.text.clone(), Vec::new()),
            false => crate::device::kernels::replace(&program.text, &self.kernels)?,
        };
        crate::device::kernels::announce(&kernels);
        let program = &Program {
            text,
            ..program.clone()
        };
        let n = self.devices.len() as i64;
        if program.partitions != n {
            bail!(
                "the program is for {} device(s) (its mesh) but --target {} has {n}; use a mesh \
                 of {n} devices (without --mesh: fsdp={n})",
                program.partitions,
                self.target.spec
            );
        }
        let temp;
        let dump_dir = match dump {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .with_context(|| format!("cannot create {}", d.display()))?;
                d.to_path_buf()
            }
            None => {
                temp = crate::device::dumps::DumpDir::new()?;
                temp.path().to_path_buf()
            }
        };
        let options = self.options(&dump_dir);
        let t0 = Instant::now();
        let failed = |e: pjrt::Error| {
            anyhow::Error::from(e).context(format!(
                "the {} compiler could not compile the program for {}",
                self.target.platform.plugin(),
                self.target.spec
            ))
        };
        let mut extra_options = Vec::new();
        let exe = match self
            .topology
            .compile(&program.text, &options)
            .map_err(failed)
        {
            Err(e)
                if self.target.platform != Platform::Tpu
                    && crate::device::platform::is_gemm_tiling_failure(&e) =>
            {
                let (options, said) = crate::device::platform::without_triton_gemm(&options);
                crate::esay!(
                    "xtrain: the {} compiler's Triton GEMM emitter could not tile a matmul of \
                     this program ({}); compiling again with {said} (its matmuls become the \
                     vendor library's GEMM calls; the program is the same)",
                    self.target.platform.plugin(),
                    format!("{e:#}")
                        .split("satisfy hlo: ")
                        .nth(1)
                        .and_then(|s| s.split(" dot(").next())
                        .unwrap_or("a dot")
                );
                extra_options.push(said);
                self.topology
                    .compile(&program.text, &options)
                    .map_err(failed)?
            }
            r => r?,
        };
        let compile_s = t0.elapsed().as_secs_f64();
        let stats = exe.memory_stats()?;
        let executable = exe.serialize()?;
        let (optimized_hlo, memory_report) = read_dump(&dump_dir);
        let unpriced = optimized_hlo.as_deref().map_or(0, unpriced_calls);
        let cost = exe.cost_analysis().ok().map(|c| {
            c.into_iter()
                .filter(|(k, _)| !k.contains('{'))
                .filter_map(|(k, v)| v.as_f64().map(|x| (k, x)))
                .map(|(k, x)| match k.as_str() {
                    "optimal_seconds" => (k, x + unpriced as f64),
                    _ => (k, x),
                })
                .collect()
        });
        Ok(TargetBuild {
            stats,
            compile_s,
            cost,
            unpriced_calls: unpriced,
            optimized_hlo,
            memory_report,
            executable,
            extra_options,
            kernels,
        })
    }

    /// Compile options for the whole target: one partition per device in the topology's order
    /// (libtpu crashed on a 64-chip slice without an explicit assignment), outputs' shardings
    /// left to the partitioner where the program leaves them open, and XLA's dumps as text.
    fn options(&self, dump_dir: &Path) -> CompileOptions {
        let ids: Vec<i64> = self.devices.iter().map(|d| d.id as i64).collect();
        let mut o = if ids.len() > 1 {
            CompileOptions::spmd(ids)
        } else {
            CompileOptions::default()
        };
        o.propagate_output_shardings = true;
        o.with_override(
            "xla_dump_to",
            OptionValue::String(dump_dir.to_string_lossy().into()),
        )
        .with_override("xla_dump_hlo_as_text", OptionValue::Bool(true))
    }
}

/// Calls in an optimized TPU module that libtpu 0.0.42.1's cost model prices at exactly -1 s
/// each: `ConcatBitcast`, the custom call that joins the views of a buffer fetched in async
/// slices, and `PrepareAsyncCallStart` / `PrepareAsyncCallDone`, the bracket around an async
/// call (the call inside is priced). They move no data themselves, and their -1 s is a "no cost
/// known" value summed in as if a time: the v6e steps' negative `optimal_seconds` are the
/// ConcatBitcasts, to the call, and a long-context JAX step's -2 s its one bracket
/// (docs/performance.md). So each is added back, i.e. priced at 0, and the output says how many
/// were.
pub fn unpriced_calls(optimized_hlo: &str) -> usize {
    UNPRICED_CALLS
        .iter()
        .map(|c| {
            optimized_hlo
                .matches(&format!("custom_call_target=\"{c}\""))
                .count()
        })
        .sum()
}

/// The custom calls [`unpriced_calls`] counts.
const UNPRICED_CALLS: [&str; 3] = [
    "ConcatBitcast",
    "PrepareAsyncCallStart",
    "PrepareAsyncCallDone",
];

/// A TPU compiler's estimate of a looped step, which its cost analysis cannot give directly: it
/// counts a loop body once. Built from unrolled programs of the same step with 1 and 2 layers:
/// c(L) = c(1) + (L - 1) (c(2) - c(1)). A step whose attention loops over key/value blocks keeps
/// those loops in the unrolled programs (unrolled they would grow with the sequence); their body
/// is priced per trip from two more programs whose loop bodies hold two trips each
/// ([`LoopPricing`]).
pub struct Estimate {
    pub layers: i64,
    /// The cost model's `optimal_seconds` of the unrolled 1- and 2-layer steps (with
    /// [`unpriced_calls`] added back).
    pub unrolled_seconds: [f64; 2],
    /// The cost analysis's `flops` and `bytes accessed` of the same two steps.
    pub unrolled_flops: [f64; 2],
    pub unrolled_bytes_accessed: [f64; 2],
    /// The unpriced calls added back in each.
    pub unpriced_calls: [usize; 2],
    /// For a step with attention loops: how their trips are priced.
    pub loops: Option<LoopPricing>,
}

/// The attention loops' bodies priced per trip: the same 1- and 2-layer figures of steps whose
/// loop bodies hold two trips. One trip of a layer's loops costs the growth of the per-layer
/// figure, (c2(2) - c2(1)) - (c(2) - c(1)), and each loop runs `trips` times.
pub struct LoopPricing {
    pub trips: i64,
    pub seconds: [f64; 2],
    pub flops: [f64; 2],
    pub bytes_accessed: [f64; 2],
}

impl Estimate {
    /// c(L) = c(1) + (L - 1) (c(2) - c(1)) of a figure of the two unrolled steps, plus, with
    /// attention loops, the trips the cost model left out: L (trips - 1) x one trip's cost.
    fn extrapolated(&self, unrolled: [f64; 2], two_trips: Option<[f64; 2]>) -> f64 {
        let per_layer = unrolled[1] - unrolled[0];
        let looped = unrolled[0] + (self.layers - 1) as f64 * per_layer;
        match (&self.loops, two_trips) {
            (Some(l), Some(two)) => {
                looped + (self.layers * (l.trips - 1)) as f64 * self.trip(unrolled, two)
            }
            _ => looped,
        }
    }

    /// One trip of a layer's attention loops: the per-layer figure's growth when each loop body
    /// holds a second trip.
    fn trip(&self, unrolled: [f64; 2], two: [f64; 2]) -> f64 {
        (two[1] - two[0]) - (unrolled[1] - unrolled[0])
    }

    /// The whole step's `optimal_seconds` (a time only where [`Estimate::has_time`] says so).
    pub fn seconds(&self) -> f64 {
        self.extrapolated(
            self.unrolled_seconds,
            self.loops.as_ref().map(|l| l.seconds),
        )
    }

    /// The whole step's FLOPs per device.
    pub fn flops(&self) -> f64 {
        self.extrapolated(self.unrolled_flops, self.loops.as_ref().map(|l| l.flops))
    }

    /// The whole step's bytes accessed per device.
    pub fn bytes_accessed(&self) -> f64 {
        let two = self.loops.as_ref().map(|l| l.bytes_accessed);
        self.extrapolated(self.unrolled_bytes_accessed, two)
    }

    /// With attention loops, the cost model's `optimal_seconds` of one trip of a layer's loops.
    pub fn trip_seconds(&self) -> Option<f64> {
        let l = self.loops.as_ref()?;
        Some(self.trip(self.unrolled_seconds, l.seconds))
    }

    /// Whether the cost model gave times to extrapolate: positive ones, once its unpriced calls
    /// are added back ([`unpriced_calls`]; without that, every v6e step measured came out
    /// negative), and growing with the layers.
    pub fn has_time(&self) -> bool {
        self.unrolled_seconds
            .iter()
            .chain([&self.seconds()])
            .chain(self.trip_seconds().as_ref())
            .all(|s| s.is_finite() && *s > 0.0)
    }
}

impl TargetDevices {
    /// Estimate the whole step's time, FLOPs and bytes per device from unrolled 1- and 2-layer
    /// versions of `spec` (TPU targets: the only compiler here with a cost analysis).
    /// The time is a time only where [`Estimate::has_time`] says so. With
    /// `XTRAIN_ESTIMATE_DUMP=DIR` XLA's dumps of the two unrolled compiles are kept in
    /// `DIR/layers-1` and `DIR/layers-2` (the optimized HLO behind the estimate, for finding
    /// what a change moved; `tools/hlo-kernels.py` reads it).
    pub fn estimate(&self, spec: &StepSpec) -> Result<Estimate> {
        let (costs, unpriced) = self.unrolled_costs(spec, 1)?;
        let loops = match spec.attention_loop_trips() {
            Some(trips) if trips > 1 => {
                let (two, _) = self.unrolled_costs(spec, 2)?;
                Some(LoopPricing {
                    trips,
                    seconds: [two[0].0, two[1].0],
                    flops: [two[0].1, two[1].1],
                    bytes_accessed: [two[0].2, two[1].2],
                })
            }
            _ => None,
        };
        Ok(Estimate {
            layers: spec.model.num_hidden_layers,
            unrolled_seconds: [costs[0].0, costs[1].0],
            unrolled_flops: [costs[0].1, costs[1].1],
            unrolled_bytes_accessed: [costs[0].2, costs[1].2],
            unpriced_calls: unpriced,
            loops,
        })
    }

    /// (optimal_seconds, flops, bytes accessed) of the unrolled 1- and 2-layer steps whose
    /// attention loops hold `trips` trips per body, and their unpriced calls.
    #[allow(clippy::type_complexity)]
    fn unrolled_costs(
        &self,
        spec: &StepSpec,
        trips: i64,
    ) -> Result<(Vec<(f64, f64, f64)>, [usize; 2])> {
        let mut costs = Vec::new();
        let mut unpriced = [0; 2];
        for layers in [1, 2] {
            let mut small = spec.clone();
            small.model.num_hidden_layers = layers;
            let program = crate::program::build_train_step_priced(&small, trips)?;
            let dump = std::env::var_os("XTRAIN_ESTIMATE_DUMP").map(|d| {
                let name = match trips {
                    1 => format!("layers-{layers}"),
                    _ => format!("layers-{layers}-trips-{trips}"),
                };
                PathBuf::from(d).join(name)
            });
            let build = self.compile(&program, dump.as_deref())?;
            unpriced[layers as usize - 1] = build.unpriced_calls;
            let cost = build
                .cost
                .context("the compiler gave no cost analysis for the unrolled step")?;
            let get = |k: &str| {
                cost.iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| *v)
                    .with_context(|| format!("the cost analysis has no `{k}`"))
            };
            costs.push((
                get("optimal_seconds")?,
                get("flops")?,
                get("bytes accessed")?,
            ));
        }
        Ok((costs, unpriced))
    }
}

/// The optimized module and its memory report from an XLA dump directory: the largest
/// `*after_optimizations.txt` (the step; small helper modules are dumped too).
pub fn read_dump(dir: &Path) -> (Option<String>, Option<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (None, None);
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with("after_optimizations.txt") {
            let size = e.metadata().map(|m| m.len()).unwrap_or(0);
            if best.as_ref().is_none_or(|(s, _)| size > *s) {
                best = Some((size, e.path()));
            }
        }
    }
    let Some((_, path)) = best else {
        return (None, None);
    };
    let report = PathBuf::from(path.to_string_lossy().replace(
        "after_optimizations.txt",
        "after_optimizations-memory-usage-report.txt",
    ));
    (
        std::fs::read_to_string(&path).ok(),
        std::fs::read_to_string(report).ok(),
    )
}

#[cfg(test)]
mod tests {
    use super::{unpriced_calls, Estimate};

    /// The calls are counted from the optimized module's text, wherever they are (a loop body
    /// too: the cost analysis counts its one copy); other custom calls are priced.
    #[test]
    fn concat_bitcasts_and_async_call_brackets_are_the_unpriced_calls() {
        let hlo = r#"
  %custom-call.8 = bf16[1,2048,4096]{2,1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast", backend_config={}
  %custom-call.9 = bf16[8]{0} custom-call(%p), custom_call_target="AllocateBuffer"
  %custom-call.10 = bf16[1,2048,4096]{2,1,0} custom-call(%a, %b), custom_call_target="ConcatBitcast"
  %custom-call.11 = () custom-call(), custom_call_target="PrepareAsyncCallStart"
  %custom-call.12 = () custom-call(%t), custom_call_target="PrepareAsyncCallDone"
"#;
        assert_eq!(unpriced_calls(hlo), 4);
        assert_eq!(unpriced_calls("%x = f32[] add(%a, %b)"), 0);
    }

    fn estimate(unrolled: [f64; 2], layers: i64) -> Estimate {
        Estimate {
            layers,
            unrolled_seconds: unrolled,
            unrolled_flops: [1.0; 2],
            unrolled_bytes_accessed: [1.0; 2],
            unpriced_calls: [0; 2],
            loops: None,
        }
    }

    /// With attention loops, each layer's loops are priced at `trips` times one trip, a trip
    /// being the per-layer growth when the loop bodies hold two: 1 layer 0.05 s, 2 layers 0.09 s
    /// (0.04 s per layer, its loops counted once); with two trips per body 0.06 and 0.11 s (one
    /// trip more: 0.01 s). 32 layers of 10 trips: 0.05 + 31 x 0.04 + 32 x 9 x 0.01 = 4.17 s.
    #[test]
    fn attention_loops_are_priced_per_trip() {
        let mut e = estimate([0.05, 0.09], 32);
        e.loops = Some(super::LoopPricing {
            trips: 10,
            seconds: [0.06, 0.11],
            flops: [1.0; 2],
            bytes_accessed: [1.0; 2],
        });
        assert!((e.seconds() - 4.17).abs() < 1e-9, "{}", e.seconds());
        assert!((e.trip_seconds().unwrap() - 0.01).abs() < 1e-12);
        assert!(e.has_time());
        // A second trip that costs nothing, or less, is no price: no time.
        e.loops.as_mut().unwrap().seconds = [0.05, 0.09];
        assert!(!e.has_time());
    }

    /// A step time is given only from positive times: libtpu's negative `optimal_seconds` on
    /// v6e (-41.0 s for the 8B step) must not become an estimate, nor a growth that
    /// extrapolates below zero.
    #[test]
    fn an_estimate_has_a_time_only_from_positive_times() {
        assert!(estimate([0.05, 0.09], 32).has_time());
        assert!(!estimate([-45.8, 0.09], 32).has_time());
        assert!(!estimate([0.05, -1.0], 32).has_time());
        assert!(!estimate([0.09, 0.05], 32).has_time());
        assert!(!estimate([f64::NAN, 0.05], 32).has_time());
    }
}

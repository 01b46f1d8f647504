//! What `xtrain plan` compiles with: a target that is not here (`--target`, its plugin's
//! description of the devices, as `compile --target --check` does), or this machine's plugin (the
//! CPU, with `--devices` virtual devices, as `compile --check` without a target does: what CI
//! plans on).

use super::cost::{Rates, GPU_LAUNCH_S};
use super::search::Budget;
use super::search::{Compiled, Figures};
use crate::device::absent::aot::TargetDevices;
use crate::device::absent::{Platform, Target};
use crate::device::memory::offload::mem_total;
use crate::device::runtime::Runtime;
use crate::program::{Program, StepSpec};
use crate::words::{count, gib};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The host memory per device assumed for a GPU described by a `--target-config` file, whose
/// class is not known: a consumer card's desktop (the least of `builtin.toml`'s classes).
pub const UNKNOWN_GPU_HOST_BYTES: i64 = 64 << 30;

/// The compiler a plan asks.
pub enum Backend {
    Absent(Box<TargetDevices>),
    Here(Here),
}

/// This machine's plugin: a runtime for each number of devices a step is compiled for (one
/// runtime per mesh size, opened once).
pub struct Here {
    plugin: Option<String>,
    devices: i64,
    runtimes: BTreeMap<i64, Runtime>,
    /// The CPU plugin's rates, once measured.
    measured: Option<Rates>,
}

impl Backend {
    /// `--target` (with `--target-config`) when given, else this machine's plugin with
    /// `devices` devices.
    pub fn open(
        target: Option<&str>,
        target_config: Option<&Path>,
        plugin: Option<&str>,
        devices: i64,
        verbose: bool,
    ) -> Result<Backend> {
        if devices < 1 {
            bail!("--devices must be at least 1, got {devices}");
        }
        let Some(target) = target else {
            let here = Here {
                plugin: plugin.map(str::to_string),
                devices,
                runtimes: BTreeMap::new(),
                measured: None,
            };
            return Ok(Backend::Here(here));
        };
        if devices != 1 {
            bail!(
                "--devices is for planning on this machine's plugin; --target {target} says \
                 its devices"
            );
        }
        let target = Target::parse(target, target_config)?;
        let t = TargetDevices::open(&target, plugin, verbose)?;
        crate::compile::target::print_target(&t)?;
        Ok(Backend::Absent(Box::new(t)))
    }

    /// The target as the table and plan.json name it.
    pub fn name(&self) -> String {
        match self {
            Backend::Absent(t) => t.target.spec.clone(),
            Backend::Here(h) => format!(
                "this machine's {} plugin ({})",
                crate::device::platform::named_platform(h.plugin.as_deref()),
                count(h.devices as usize, "device")
            ),
        }
    }

    /// `--target` as a recipe's `[compile]` table gives it (None: this machine).
    pub fn target_flag(&self) -> Option<String> {
        match self {
            Backend::Absent(t) => Some(t.target.spec.clone()),
            Backend::Here(_) => None,
        }
    }

    /// The plugin `xtrain train` runs the plan's pick with: the target's (`plugin`, the
    /// target's plugin file, where given), or this machine's where it is not the CPU's
    /// (train's default).
    pub fn train_plugin(&self, plugin: Option<&str>) -> Option<String> {
        match self {
            Backend::Absent(t) => Some(plugin.unwrap_or(t.target.platform.plugin()).to_string()),
            Backend::Here(h) => {
                let named = crate::device::platform::named_platform(h.plugin.as_deref());
                (named != "cpu").then(|| h.plugin.clone().unwrap_or(named.to_string()))
            }
        }
    }

    pub fn devices(&self) -> i64 {
        match self {
            Backend::Absent(t) => t.devices.len() as i64,
            Backend::Here(h) => h.devices,
        }
    }

    pub fn is_tpu(&self) -> bool {
        matches!(self, Backend::Absent(t) if t.target.platform == Platform::Tpu)
    }

    /// Whether steps may keep values in host memory (not on the CPU plugin: `--offload none`
    /// is the only value searched there).
    pub fn can_offload(&self) -> bool {
        match self {
            Backend::Absent(_) => true,
            Backend::Here(h) => {
                crate::device::platform::named_platform(h.plugin.as_deref()) != "cpu"
            }
        }
    }

    /// Whether the plan compiles with this machine's plugin.
    pub fn is_here(&self) -> bool {
        matches!(self, Backend::Here(_))
    }

    /// A device's memory, where known: the target's, or on this machine's CPU plugin (whose
    /// devices' memory is the host's RAM, shared by them) this machine's memory over its
    /// devices.
    pub fn device_memory(&self) -> Result<Option<Budget>> {
        Ok(match self {
            Backend::Absent(t) => t.memory_per_device().map(|bytes| Budget {
                bytes,
                source: format!("a {}", t.device_kind()),
            }),
            Backend::Here(h) => h.cpu_share(),
        })
    }

    /// The device memory XLA may use per device, where known (see [`Backend::device_memory`]).
    pub fn usable_memory(&self) -> Result<Option<Budget>> {
        Ok(match self {
            Backend::Absent(t) => t.usable_memory_per_device()?.map(|bytes| Budget {
                bytes,
                source: "what the device gives XLA".into(),
            }),
            Backend::Here(h) => h.cpu_share(),
        })
    }

    /// The host memory per device a plan assumes by default: this machine's over its devices;
    /// for a target, its device class's usual machine (`builtin.toml`), or for a GPU described
    /// by a file a consumer card's desktop.
    pub fn host_memory(&self) -> Budget {
        match self {
            Backend::Absent(t) => match t.target.host_memory_per_chip {
                Some(chip) => {
                    let bytes = chip * t.target.chips / t.devices.len().max(1) as i64;
                    Budget {
                        bytes,
                        source: format!(
                            "the host memory usual for {} machines, {} per device",
                            t.device_kind(),
                            gib(bytes)
                        ),
                    }
                }
                None => Budget {
                    bytes: UNKNOWN_GPU_HOST_BYTES,
                    source: format!(
                        "a GPU described by --target-config: a consumer card's desktop, {}",
                        gib(UNKNOWN_GPU_HOST_BYTES)
                    ),
                },
            },
            Backend::Here(h) => match mem_total() {
                Some(total) => Budget {
                    bytes: total / h.devices,
                    source: format!(
                        "this machine's memory, {} over {}",
                        gib(total),
                        count(h.devices as usize, "device")
                    ),
                },
                None => Budget {
                    bytes: UNKNOWN_GPU_HOST_BYTES,
                    source: format!(
                        "this machine's memory is not known (no /proc/meminfo): {} assumed",
                        gib(UNKNOWN_GPU_HOST_BYTES)
                    ),
                },
            },
        }
    }

    /// What the time model stands on, where anything: a known target's dense bf16 peak per
    /// device (and a GPU's cost per kernel launch; a TPU runs its step as one program), or this
    /// machine's CPU plugin measured for `dtype`; None for a GPU described by a file or a GPU
    /// plugin here, whose peak is not known.
    pub fn rates(&mut self, dtype: hlo::DType) -> Result<Option<Rates>> {
        match self {
            Backend::Absent(t) => Ok(t.peak_bf16_tflops_per_device().map(|peak| Rates {
                tflops_per_device: peak,
                per_launch_s: match t.target.platform {
                    Platform::Tpu => 0.0,
                    Platform::Cuda | Platform::Rocm => GPU_LAUNCH_S,
                },
                source: format!(
                    "{}'s dense bf16 peak, {peak:.0} TFLOP/s per device",
                    t.target.spec
                ),
            })),
            Backend::Here(h) => h.rates(dtype),
        }
    }

    /// Compile a step: its memory figures, or that it does not fit (the TPU compiler refuses
    /// what exceeds the chip).
    pub fn compile(&mut self, program: &Program) -> Result<Compiled> {
        match self {
            Backend::Absent(t) => match t.compile(program, None) {
                Ok(b) => Ok(Compiled::Figures(Figures {
                    device_bytes: b.stats.total_bytes(),
                    host_bytes: b.stats.host_total_bytes(),
                    compile_s: b.compile_s,
                    launches: b
                        .optimized_hlo
                        .as_deref()
                        .and_then(crate::device::launches::launches),
                })),
                Err(e) if crate::device::memory::fit::is_out_of_memory(&e) => {
                    Ok(Compiled::OutOfMemory)
                }
                Err(e) => Err(e),
            },
            Backend::Here(h) => h.compile(program),
        }
    }

    /// The TPU compiler's estimate of the whole step, seconds (None elsewhere, or where its
    /// cost model gives no time).
    pub fn estimate(&self, spec: &StepSpec) -> Result<Option<f64>> {
        match self {
            Backend::Absent(t) if self.is_tpu() => {
                let e = t.estimate(spec)?;
                Ok(e.has_time().then(|| e.seconds()))
            }
            _ => Ok(None),
        }
    }
}

impl Here {
    /// On the CPU plugin, this machine's memory over the plan's devices (None elsewhere: a GPU
    /// here says its memory only once opened).
    fn cpu_share(&self) -> Option<Budget> {
        let cpu = crate::device::platform::named_platform(self.plugin.as_deref()) == "cpu";
        let total = mem_total().filter(|_| cpu)?;
        Some(Budget {
            bytes: total / self.devices,
            source: format!(
                "this machine's memory, {} over {}",
                gib(total),
                count(self.devices as usize, "device")
            ),
        })
    }

    /// This machine's CPU plugin measured (once) for steps in `dtype`, on one device; None
    /// for another plugin here, whose peak is not known.
    fn rates(&mut self, dtype: hlo::DType) -> Result<Option<Rates>> {
        let named = crate::device::platform::named_platform(self.plugin.as_deref());
        if named != "cpu" {
            return Ok(None);
        }
        if let Some(r) = &self.measured {
            return Ok(Some(r.clone()));
        }
        crate::esay!("xtrain: plan: measuring this machine's CPU plugin for the time model");
        let rt = self.runtime(1)?;
        let m = crate::device::peak::measure_cpu(rt, dtype)?;
        // The devices of one CPU share its cores.
        let rates = Rates {
            tflops_per_device: m.matmul_tflops / self.devices as f64,
            per_launch_s: m.per_launch_s,
            source: format!(
                "this machine's CPU plugin, measured: {:.0} GFLOP/s on a {} matmul (shared by \
                 {}), {:.1} us per launched operation",
                m.matmul_tflops * 1e3,
                dtype.mlir(),
                count(self.devices as usize, "device"),
                m.per_launch_s * 1e6
            ),
        };
        self.measured = Some(rates.clone());
        Ok(Some(rates))
    }

    /// The runtime of `n` devices, opened once.
    fn runtime(&mut self, n: i64) -> Result<&Runtime> {
        if !self.runtimes.contains_key(&n) {
            let rt = Runtime::open(self.plugin.as_deref(), Some(n))?;
            self.runtimes.insert(n, rt);
        }
        Ok(&self.runtimes[&n])
    }

    fn compile(&mut self, program: &Program) -> Result<Compiled> {
        let n = program.partitions.max(1);
        if n > self.devices {
            bail!(
                "a step of the plan wants {n} devices, and the plan has {}",
                self.devices
            );
        }
        let dump = crate::device::dumps::DumpDir::new()?;
        let rt = self.runtime(n)?;
        let t0 = std::time::Instant::now();
        let exe = rt.compile_dumping(program, Some(dump.path()));
        let compile_s = t0.elapsed().as_secs_f64();
        let optimized = crate::device::absent::aot::read_dump(dump.path()).0;
        drop(dump);
        let m = exe?.memory_stats()?;
        Ok(Compiled::Figures(Figures {
            device_bytes: m.total_bytes(),
            host_bytes: m.host_total_bytes(),
            compile_s,
            launches: optimized
                .as_deref()
                .and_then(crate::device::launches::launches),
        }))
    }
}

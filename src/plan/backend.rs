//! What `xtrain plan` compiles with: a target that is not here (`--target`, its plugin's
//! description of the devices, as `compile --target --check` does), or this machine's plugin (the
//! CPU, with `--devices` virtual devices, as `compile --check` without a target does: what CI
//! plans on).

use super::search::{Compiled, Figures};
use crate::device::absent::aot::TargetDevices;
use crate::device::absent::{Platform, Target};
use crate::device::runtime::Runtime;
use crate::program::{Program, StepSpec};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::Path;

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
                "this machine's {} plugin ({} device{})",
                crate::device::platform::named_platform(h.plugin.as_deref()),
                h.devices,
                if h.devices == 1 { "" } else { "s" }
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

    /// The device memory XLA may use per device, where the plugin says it.
    pub fn usable_memory(&self) -> Result<Option<i64>> {
        match self {
            Backend::Absent(t) => t.usable_memory_per_device(),
            // The CPU plugin's "device memory" is the host's RAM, shared by its devices: a
            // plan here is given its limit.
            Backend::Here(_) => Ok(None),
        }
    }

    /// Dense bf16 TFLOP/s per device for the time model: the target's where known; on this
    /// machine 1 (the model then only orders the points, and says so by its unit).
    pub fn peak_tflops(&self) -> f64 {
        match self {
            Backend::Absent(t) => t.peak_bf16_tflops_per_device().unwrap_or(100.0),
            Backend::Here(_) => 1.0,
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
    fn compile(&mut self, program: &Program) -> Result<Compiled> {
        let n = program.partitions.max(1);
        if n > self.devices {
            bail!(
                "a step of the plan wants {n} devices, and the plan has {}",
                self.devices
            );
        }
        if !self.runtimes.contains_key(&n) {
            let rt = Runtime::open(self.plugin.as_deref(), Some(n))?;
            self.runtimes.insert(n, rt);
        }
        let rt = &self.runtimes[&n];
        let t0 = std::time::Instant::now();
        let exe = rt.compile_dumping(program, None)?;
        let compile_s = t0.elapsed().as_secs_f64();
        let m = exe.memory_stats()?;
        Ok(Compiled::Figures(Figures {
            device_bytes: m.total_bytes(),
            host_bytes: m.host_total_bytes(),
            compile_s,
        }))
    }
}

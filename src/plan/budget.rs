//! The memory a plan fits its points into, per device, and where each figure came from, as the
//! plan states it: the device memory (what the target's devices give XLA, or
//! `--memory-limit-gib`, never more than a device has) and the host memory (what a step may keep
//! in host memory: this machine's memory on its own plugin; for a target that is not here the
//! usual machine of its device class, `builtin.toml`'s `host_memory_gib`; or
//! `--host-memory-limit-gib`). A plan never assumes more host memory than a real machine has.

use super::backend::Backend;
pub use super::search::Budget;
use crate::words::gib;
use anyhow::{bail, Result};

/// The device memory a point must fit, per device: `--memory-limit-gib`, refused above what a
/// device has, else what the target's devices give XLA (on this machine's CPU plugin, whose
/// devices' memory is the host's: this machine's memory over its devices).
pub fn device(backend: &Backend, given: Option<i64>) -> Result<Budget> {
    let name = backend.name();
    let has = backend.device_memory()?;
    match (given, has) {
        (Some(l), Some(has)) if l > has.bytes => bail!(
            "--memory-limit-gib {}: more than a device of {name} has ({}: {}); give at most {}, \
             or leave it out for what the device gives XLA",
            gib_flag_text(l),
            has.source,
            gib(has.bytes),
            gib(has.bytes)
        ),
        (Some(l), _) => Ok(Budget {
            bytes: l,
            source: "--memory-limit-gib".into(),
        }),
        (None, _) => match backend.usable_memory()? {
            Some(b) => Ok(b),
            None => {
                bail!("{name} does not say how much memory a device has; give --memory-limit-gib")
            }
        },
    }
}

/// The host memory a point may use per device: `--host-memory-limit-gib` (refused above this
/// machine's memory when planning on this machine), else the target's default.
pub fn host(backend: &Backend, given: Option<i64>) -> Result<Budget> {
    let default = backend.host_memory();
    match given {
        Some(h) if backend.is_here() && h > default.bytes => bail!(
            "--host-memory-limit-gib {}: more than this machine has per device ({}: {})",
            gib_flag_text(h),
            default.source,
            gib(default.bytes)
        ),
        Some(h) => Ok(Budget {
            bytes: h,
            source: "--host-memory-limit-gib".into(),
        }),
        None => Ok(Budget {
            source: format!("{}; --host-memory-limit-gib to change it", default.source),
            ..default
        }),
    }
}

/// A byte count as the `--...-gib` flag that gives it (`60`, `0.5`).
fn gib_flag_text(bytes: i64) -> String {
    let g = bytes as f64 / (1u64 << 30) as f64;
    format!("{}", (g * 1000.0).round() / 1000.0)
}

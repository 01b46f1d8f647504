//! `--remat auto` and `--offload auto` on a real device: the first remat policy and the least
//! host offload (see `program::Offload`) that make the step fit the device's memory, decided from
//! the compiler's own figures before any weight is loaded (the loop is `auto`'s), and whether
//! this host has the memory the offloaded part needs.

use crate::device::memory::auto::{first_that_fits, Choice};
use crate::device::runtime::Runtime;
use crate::program::{Program, Remat, StepSpec};
use crate::words::gib;
use anyhow::{bail, Result};

/// Compile the step with each of `choices` (remat policy, offload) in turn (through the
/// executable cache, so the one chosen is not compiled again; [`first_that_fits`]) and return
/// the first that fits the device's memory, after checking that this host has the memory its
/// offloaded part needs. `build` makes the spec and program for a choice; where the device does not say how much
/// memory it has, `unknown_memory` is built. (`--remat auto` and `--offload auto` pass
/// [`crate::program::fit_choices`] and [`crate::program::default_choice`]; explicit choices
/// are checked the same way, before any weight is loaded.)
pub fn choose(
    rt: &mut Runtime,
    choices: &[Choice],
    unknown_memory: Choice,
    build: impl Fn(Choice) -> Result<(StepSpec, Program)>,
    use_cache: bool,
) -> Result<(StepSpec, Program)> {
    let Some(limit) = rt.devices[0].info()?.memory_bytes else {
        return build(unknown_memory);
    };
    let mut needed = Vec::new();
    let several = choices.len() > 1;
    let taken = first_that_fits(choices, build, |(_, program), (remat, offload), next| {
        let compiled = crate::device::cache::compile_cached(
            rt,
            program,
            &pjrt::CompileOptions::default(),
            use_cache,
        );
        let (exe, _) = match compiled {
            Ok(c) => c,
            // A TPU compiler refuses a step that does not fit its HBM (GPU compilers compile it
            // and report the memory): try the next choice.
            Err(e) if next.is_some() && crate::device::memory::fit::is_out_of_memory(&e) => {
                needed.push(format!(
                    "--remat {} --offload {}: refused by the compiler ({e:#})",
                    remat.name(),
                    offload.name()
                ));
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let m = exe.memory_stats()?;
        if m.total_bytes() > limit {
            needed.push(format!(
                "--remat {} --offload {}: {}",
                remat.name(),
                offload.name(),
                gib(m.total_bytes())
            ));
            return Ok(false);
        }
        // The trainer takes this executable instead of compiling the step again.
        rt.prebuilt = Some(crate::device::runtime::Prebuilt {
            program_sha256: crate::formats::program_dir::sha256_hex(program.text.as_bytes()),
            executable: exe.serialize()?,
            from: String::new(),
        });
        let host = if offload.is_none() {
            String::new()
        } else {
            format!(" ({} of host memory per device)", gib(m.host_total_bytes()))
        };
        if !offload.is_none() || several {
            crate::esay!(
                "xtrain: the step needs {} per device with --remat {} --offload {}{host}, of {}",
                gib(m.total_bytes()),
                remat.name(),
                offload.name(),
                gib(limit)
            );
        }
        if !offload.is_none() {
            check_host_memory(m.host_total_bytes() * rt.devices.len() as i64)?;
        }
        Ok(true)
    })?;
    if let Some((_, step)) = taken {
        return Ok(step);
    }
    // What lowers it, less what was just tried.
    let mut ways = vec!["more devices (--mesh)", "--quant nf4"];
    if choices.iter().all(|c| !c.1.frozen || !c.1.activations) {
        ways.push("--offload activations|frozen|all");
    }
    if choices.iter().all(|c| c.0 != Remat::Layer) {
        ways.push("--remat layer");
    }
    ways.push("a smaller batch or --seq");
    bail!(
        "the step does not fit the device's {} (needed per device: {}); what lowers it: {}",
        gib(limit),
        needed.join(", "),
        ways.join(", ")
    )
}

/// Refuse, before loading starts, a run whose offloaded weights and activations need more host
/// memory than this machine has available.
pub fn check_host_memory(needed: i64) -> Result<()> {
    let Some(available) = mem_available() else {
        return Ok(());
    };
    if needed > available {
        bail!(
            "host offload needs {:.1} GiB of host memory on this machine for the weights and \
             activations kept there, but only {:.1} GiB is available (MemAvailable in \
             /proc/meminfo); use more hosts, --quant nf4, or --offload activations",
            needed as f64 / (1u64 << 30) as f64,
            available as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn mem_available() -> Option<i64> {
    meminfo("MemAvailable")
}

/// This machine's memory (`MemTotal` from /proc/meminfo), in bytes.
pub fn mem_total() -> Option<i64> {
    meminfo("MemTotal")
}

/// A field of /proc/meminfo, in bytes.
fn meminfo(field: &str) -> Option<i64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kib: i64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

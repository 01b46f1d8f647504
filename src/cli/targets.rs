//! `xtrain targets`: the known targets and the built-in GPU descriptions.

use anyhow::{bail, Result};
use xtrain::words::gib;

/// `xtrain targets [NAME]`.
pub fn targets(name: Option<&str>) -> Result<()> {
    use xtrain::device::absent::{gpus, tpus, GpuArch};
    let Some(name) = name else {
        xtrain::say!(
            "TPU slices (libtpu's layouts, e.g. 2x2, 2x2x1, 4x4x4, 16x16; 1x1 for one chip):"
        );
        for t in tpus() {
            xtrain::say!(
                "  tpu:{}:<chips>  {} TFLOP/s bf16 per chip",
                t.name,
                t.peak_bf16_tflops_per_chip
            );
        }
        xtrain::say!(
            "GPUs (<count> per host, or <hosts>x<per host>; --target-config FILE for others):"
        );
        for g in gpus() {
            let arch = match &g.arch {
                GpuArch::Cuda(a, b) => format!("sm_{a}{b}"),
                GpuArch::Rocm(n) => n.split(':').next().unwrap_or(n).to_string(),
            };
            let platform = g.platform().plugin();
            xtrain::say!(
                "  {platform}:{}:<count>  {} ({arch}, {} {}, {}, {:.1} TB/s, {} TFLOP/s bf16)",
                g.name,
                g.kind,
                g.cores,
                if platform == "cuda" { "SMs" } else { "CUs" },
                gib(g.memory_bytes),
                g.bandwidth_bytes_per_s as f64 / 1e12,
                g.peak_bf16_tflops
            );
        }
        return Ok(());
    };
    let (platform, device) = name.split_once(':').unwrap_or(("", name));
    let device = device.split(':').next().unwrap_or(device);
    if platform == "tpu" {
        // libtpu knows its chips: a TPU target is its generation and its slice's layout.
        let Some(t) = tpus().iter().find(|t| t.name == device) else {
            bail!(
                "`{name}`: unknown TPU generation `{device}`; known: {}",
                xtrain::device::absent::known_targets()
            );
        };
        xtrain::say!(
            "tpu:{}:<chips>  {} TFLOP/s bf16 per chip. TPUs need no description (libtpu knows \
             each generation): compile with --target tpu:{}:<chips>, the slice's layout as \
             libtpu names it (e.g. tpu:{}:2x2; 1x1 for one chip)",
            t.name,
            t.peak_bf16_tflops_per_chip,
            t.name,
            t.name
        );
        return Ok(());
    }
    let Some(g) = gpus()
        .iter()
        .find(|g| g.name == device && g.platform().plugin() == platform)
    else {
        bail!(
            "`{name}` is not a built-in GPU (TPUs need no description); known: {}",
            xtrain::device::absent::known_targets()
        );
    };
    // Not print!: a reader that has gone (`| head`) is not a panic (see xtrain::say!).
    let _ = std::io::Write::write_all(&mut std::io::stdout(), g.target_config().as_bytes());
    Ok(())
}

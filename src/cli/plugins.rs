//! `xtrain plugins`: list the PJRT plugins found here, or install one into xtrain's cache.

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum PluginAction {
    /// Install a plugin into xtrain's cache from its pinned pip wheels: cpu (xla-cpu-pjrt), tpu
    /// (libtpu), cuda (jax-cuda13-pjrt with NVIDIA's ptxas and libdevice, to compile for absent
    /// GPUs), rocm (jax-rocm7-pjrt; it loads on hosts with ROCm 7).
    Install { name: String },
}

pub fn plugins(action: Option<PluginAction>, verbose: bool) -> Result<()> {
    if let Some(PluginAction::Install { name }) = action {
        let path = xtrain::device::plugins::install(&name)?;
        xtrain::say!("installed {}", path.display());
        return Ok(());
    }
    let found = xtrain::device::plugins::survey(verbose);
    if found.is_empty() {
        xtrain::say!("no PJRT plugins found; run `xtrain plugins install cpu`");
        return Ok(());
    }
    for f in found {
        xtrain::say!("{} ({}): {}", f.name, f.source, f.path.display());
        let p = match f.loaded {
            Err(e) => {
                xtrain::say!("  cannot load: {e}");
                continue;
            }
            Ok(p) => p,
        };
        let (major, minor) = p.api_version;
        xtrain::say!("  PJRT C API {major}.{minor}");
        match p.client {
            None => xtrain::say!("  no TPU on this machine (no /dev/accel*): it compiles for absent TPUs (`xtrain compile --target tpu:...`)"),
            Some(Err(e)) => xtrain::say!("  no client: {e}"),
            Some(Ok(c)) => {
                let version = c
                    .version
                    .map(|v| format!(" (version {v})"))
                    .unwrap_or_default();
                xtrain::say!(
                    "  platform {}{version}, {} devices",
                    c.platform,
                    c.devices.len()
                );
                for (id, kind, memory) in c.devices {
                    let mem = memory
                        .map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64))
                        .unwrap_or_default();
                    xtrain::say!("    device {id}: {kind}{mem}");
                }
            }
        }
    }
    Ok(())
}

//! `xtrain plugins`: list the PJRT plugins found here, or install one into xtrain's cache.

use anyhow::{bail, Result};
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
        if !pjrt::discover::KNOWN.iter().any(|k| k.name == name) {
            bail!("unknown plugin `{name}`: xtrain installs cpu, tpu, cuda or rocm");
        }
        let path = pjrt::discover::install_announced(&name)?;
        println!("installed {}", path.display());
        return Ok(());
    }
    let found = pjrt::discover::find_all();
    if found.is_empty() {
        println!("no PJRT plugins found; run `xtrain plugins install cpu`");
        return Ok(());
    }
    for f in found {
        println!("{} ({}): {}", f.name, f.source, f.path.display());
        let no_tpu = f.name == "tpu" && !xtrain::device::platform::has_tpu_devices();
        if no_tpu {
            xtrain::device::platform::prepare_libtpu_env(verbose);
        }
        let loaded =
            xtrain::device::platform::quiet_unless(verbose, || pjrt::Plugin::load(&f.path));
        match loaded {
            Err(e) => println!("  cannot load: {e}"),
            Ok(p) => {
                let (major, minor) = p.api_version();
                println!("  PJRT C API {major}.{minor}");
                if no_tpu {
                    println!("  no TPU on this machine (no /dev/accel*): it compiles for absent TPUs (`xtrain compile --target tpu:...`)");
                    continue;
                }
                let client = xtrain::device::platform::quiet_unless(verbose, || {
                    p.client(&pjrt::ClientOptions::default())
                });
                match client {
                    Err(e) => println!("  no client: {e}"),
                    Ok(c) => {
                        let devices = c.devices().unwrap_or_default();
                        let name = c.platform_name().unwrap_or_default();
                        // The CPU plugin's version string is its name again ("cpu"): say it
                        // only when it says something.
                        let version = c.platform_version().unwrap_or_default().trim().to_string();
                        let version = if version.is_empty() || version == name {
                            String::new()
                        } else {
                            format!(" (version {version})")
                        };
                        println!("  platform {name}{version}, {} devices", devices.len());
                        for d in devices {
                            if let Ok(info) = d.info() {
                                let mem = info
                                    .memory_bytes
                                    .map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64))
                                    .unwrap_or_default();
                                println!("    device {}: {}{mem}", info.id, info.kind);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

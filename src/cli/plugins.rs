//! `xtrain plugins`: list the PJRT plugins found here, or install the CPU one.

use anyhow::{bail, Result};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum PluginAction {
    /// Install a plugin into xtrain's cache (only `cpu` is installable: the xla-cpu-pjrt wheel).
    Install { name: String },
}

pub fn plugins(action: Option<PluginAction>) -> Result<()> {
    if let Some(PluginAction::Install { name }) = action {
        if name != "cpu" {
            bail!("only the CPU plugin can be installed by xtrain; for `{name}` install its wheel with pip (see README)");
        }
        let path = pjrt::discover::install_cpu()?;
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
        match pjrt::Plugin::load(&f.path) {
            Err(e) => println!("  cannot load: {e}"),
            Ok(p) => {
                let (major, minor) = p.api_version();
                println!("  PJRT C API {major}.{minor}");
                match p.client(&pjrt::ClientOptions::default()) {
                    Err(e) => println!("  no client: {e}"),
                    Ok(c) => {
                        let devices = c.devices().unwrap_or_default();
                        println!(
                            "  platform {} {}, {} devices",
                            c.platform_name().unwrap_or_default(),
                            c.platform_version().unwrap_or_default(),
                            devices.len()
                        );
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

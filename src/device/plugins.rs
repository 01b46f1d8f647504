//! `xtrain plugins`: the PJRT plugins found on this machine, each loaded (and, where its devices
//! are here, opened) to say what it is; and a plugin installed into xtrain's cache. The command
//! line prints what this returns: plugins are opened only here, in `device`.

use anyhow::{bail, Result};
use std::path::PathBuf;

/// A plugin found on this machine, and what loading it said.
pub struct FoundPlugin {
    pub name: String,
    /// Where it was found: "site-packages" or "cache".
    pub source: String,
    pub path: PathBuf,
    /// The plugin as loaded, or why it did not load.
    pub loaded: std::result::Result<LoadedPlugin, String>,
}

/// A loaded plugin: its PJRT C API version and its client.
pub struct LoadedPlugin {
    pub api_version: (i32, i32),
    /// Its client and devices, or why it has none; None for libtpu on a machine without TPUs
    /// (it compiles for absent TPUs there, and opens no client).
    pub client: Option<std::result::Result<ClientInfo, String>>,
}

/// A plugin's client: its platform and devices.
pub struct ClientInfo {
    pub platform: String,
    /// The platform's version where it says more than its name (the CPU plugin's is "cpu").
    pub version: Option<String>,
    /// Each device: id, kind and memory in bytes where known.
    pub devices: Vec<(i64, String, Option<i64>)>,
}

/// Install plugin `name` (cpu, tpu, cuda or rocm) into xtrain's cache from its pinned wheels.
pub fn install(name: &str) -> Result<PathBuf> {
    if !pjrt::discover::KNOWN.iter().any(|k| k.name == name) {
        bail!("unknown plugin `{name}`: xtrain installs cpu, tpu, cuda or rocm");
    }
    Ok(pjrt::discover::install_announced(name)?)
}

/// Every plugin found on this machine, loaded and opened to say what it is.
pub fn survey(verbose: bool) -> Vec<FoundPlugin> {
    pjrt::discover::find_all()
        .into_iter()
        .map(|f| FoundPlugin {
            loaded: load(f.name, &f.path, verbose),
            name: f.name.to_string(),
            source: f.source.to_string(),
            path: f.path,
        })
        .collect()
}

fn load(
    name: &str,
    path: &std::path::Path,
    verbose: bool,
) -> std::result::Result<LoadedPlugin, String> {
    use crate::device::platform::{has_tpu_devices, prepare_libtpu_env, quiet_unless};
    let no_tpu = name == "tpu" && !has_tpu_devices();
    if no_tpu {
        prepare_libtpu_env(verbose);
    }
    let p = quiet_unless(verbose, || pjrt::Plugin::load(path)).map_err(|e| e.to_string())?;
    let (major, minor) = p.api_version();
    let client = (!no_tpu).then(|| {
        let c = quiet_unless(verbose, || p.client(&pjrt::ClientOptions::default()))
            .map_err(|e| e.to_string())?;
        let platform = c.platform_name().unwrap_or_default();
        let version = c.platform_version().unwrap_or_default().trim().to_string();
        let devices = c
            .devices()
            .unwrap_or_default()
            .iter()
            .filter_map(|d| d.info().ok())
            .map(|i| (i.id as i64, i.kind, i.memory_bytes))
            .collect();
        Ok(ClientInfo {
            version: (!version.is_empty() && version != platform).then_some(version),
            platform,
            devices,
        })
    });
    Ok(LoadedPlugin {
        api_version: (major, minor),
        client,
    })
}

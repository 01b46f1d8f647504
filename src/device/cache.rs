//! The on-disk cache of compiled executables, and the executables `xtrain compile --check`
//! leaves in a program dir.

use crate::device::runtime::{expected_inputs, Runtime};
use crate::program::Program;
use anyhow::Result;
use pjrt::{CompileOptions, Executable};
use sha2::{Digest, Sha256};

/// Compile through the on-disk executable cache: the key covers the program text, the compile
/// options and the plugin (path, API version, platform version), so a second run loads the
/// serialized executable instead of compiling. Returns (executable, loaded from cache).
pub fn compile_cached(
    rt: &Runtime,
    program: &Program,
    options: &CompileOptions,
    use_cache: bool,
) -> Result<(Executable, bool)> {
    let plugin = rt.client.plugin();
    let (major, minor) = plugin.api_version();
    let mut key = Sha256::new();
    key.update(program.text.as_bytes());
    key.update(rt.options(options).to_bytes());
    key.update(plugin.path().to_string_lossy().as_bytes());
    key.update(
        format!(
            "{major}.{minor}/{}",
            rt.client.platform_version().unwrap_or_default()
        )
        .as_bytes(),
    );
    let key: String = key.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let path = pjrt::discover::cache_dir()
        .join("executables")
        .join(format!("{key}.pjrt"));
    let expected = expected_inputs(program);
    if let Some(p) = &rt.prebuilt {
        if p.program_sha256 == crate::formats::program_dir::sha256_hex(program.text.as_bytes()) {
            match rt.client.deserialize(&p.executable) {
                Ok(mut exe) => {
                    if !p.from.is_empty() {
                        eprintln!("xtrain: loaded the step compiled {}", p.from);
                    }
                    exe.expect_inputs(expected);
                    return Ok((exe, true));
                }
                Err(e) => eprintln!(
                    "xtrain: recompiling the step: the plugin cannot load the one compiled {}: {e}",
                    p.from
                ),
            }
        }
    }
    if use_cache {
        if let Ok(bytes) = std::fs::read(&path) {
            if let Ok(mut exe) = rt.client.deserialize(&bytes) {
                exe.expect_inputs(expected);
                return Ok((exe, true));
            }
        }
    }
    let exe = rt.compile(program, options)?;
    if use_cache {
        if let Ok(bytes) = exe.serialize() {
            let _ = std::fs::create_dir_all(path.parent().unwrap());
            // A cache that cannot be written only costs a recompile next time.
            let _ = crate::formats::atomic::write_bytes_atomic(&path, &bytes);
        }
    }
    Ok((exe, false))
}

/// An executable compiled before the trainer asks for one (a program dir's, or the one
/// `--offload` was decided with), for the program whose text has `program_sha256`.
pub struct Prebuilt {
    pub program_sha256: String,
    pub executable: Vec<u8>,
    /// Where it comes from, for messages ("by `xtrain compile` for cuda:h100:8 (DIR/...)");
    /// empty: say nothing.
    pub from: String,
}

/// Whether a program dir's build was compiled for this runtime's plugin and devices: the same
/// platform, plugin API version and device kind, and no more devices than there are. `Err` says
/// why not, naming both sides.
pub fn matches(rt: &Runtime, build: &crate::formats::program_dir::Build) -> Result<(), String> {
    let platform = rt.platform();
    let (major, minor) = rt.client.plugin().api_version();
    let api = format!("{major}.{minor}");
    let kind = rt.devices[0]
        .info()
        .map(|i| i.kind)
        .unwrap_or_else(|_| "?".into());
    let here = format!(
        "this machine has {} x {kind} on the {platform} plugin (PJRT C API {api})",
        rt.devices.len()
    );
    let there = format!(
        "its executable is for {} ({} x {} on the {} plugin, PJRT C API {})",
        build.target, build.devices, build.device_kind, build.platform, build.plugin_api
    );
    if platform != build.platform
        || api != build.plugin_api
        || kind != build.device_kind
        || (rt.devices.len() as i64) < build.devices
    {
        return Err(format!("{there}, but {here}"));
    }
    Ok(())
}

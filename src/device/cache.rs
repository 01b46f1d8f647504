//! The on-disk cache of compiled executables, and the executables `xtrain compile --check`
//! leaves in a program dir.

use crate::device::runtime::{expected_inputs, Runtime};
use crate::program::Program;
use anyhow::Result;
use pjrt::{CompileOptions, Executable};
use sha2::{Digest, Sha256};

/// Compile through the on-disk executable cache: the key covers the program text, the compile
/// options and the plugin (path, API version, platform version), so a second run loads the
/// serialized executable instead of compiling; of several compiling the same key at once, one
/// compiles and the others load its executable. Returns (executable, loaded from cache).
pub fn compile_cached(
    rt: &Runtime,
    program: &Program,
    options: &CompileOptions,
    use_cache: bool,
) -> Result<(Executable, bool)> {
    // A process of a run of several compiles its own: the key says nothing of the device
    // assignment across processes, and every host would write the same entry on a shared home.
    let use_cache = use_cache && rt.hosts.holds_all();
    let plugin = rt.client.plugin();
    let (major, minor) = plugin.api_version();
    let mut key = Sha256::new();
    key.update(rt.kernel_text(program)?.text.as_bytes());
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
                        crate::esay!("xtrain: loaded the step compiled {}", p.from);
                    }
                    exe.expect_inputs(expected);
                    return Ok((exe, true));
                }
                Err(e) => crate::esay!(
                    "xtrain: recompiling the step: the plugin cannot load the one compiled {}: {e}",
                    p.from
                ),
            }
        }
    }
    let load = |path: &std::path::Path| -> Option<Executable> {
        let mut exe = rt.client.deserialize(&std::fs::read(path).ok()?).ok()?;
        exe.expect_inputs(expected.clone());
        Some(exe)
    };
    if !use_cache {
        return Ok((rt.compile(program, options)?, false));
    }
    if let Some(exe) = load(&path) {
        return Ok((exe, true));
    }
    // One compile per key at a time: another process or thread compiling the same step
    // finishes first and this one loads what it wrote. A cache that cannot be locked or written
    // only costs compiling again.
    let _lock = pjrt::once::Lock::exclusive(&pjrt::once::lock_path(&path), || {
        crate::esay!(
            "xtrain: another xtrain is compiling the same step; waiting to load its executable"
        )
    })
    .ok();
    if let Some(exe) = load(&path) {
        return Ok((exe, true));
    }
    let exe = rt.compile(program, options)?;
    if let Ok(bytes) = exe.serialize() {
        let _ = crate::formats::atomic::write_bytes_atomic(&path, &bytes);
    }
    Ok((exe, false))
}

/// Whether a program dir's build was compiled for this runtime's plugin and devices: the same
/// platform, plugin API version and device kind, and no more devices than there are. `Err` says
/// what the build is for; [`describe`] says what this machine has.
pub fn matches(rt: &Runtime, build: &crate::formats::program_dir::Build) -> Result<(), String> {
    let (platform, api, kind) = here(rt);
    if platform != build.platform
        || api != build.plugin_api
        || kind != build.device_kind
        || (rt.devices.len() as i64) < build.devices
    {
        return Err(format!(
            "{} is {} x {} on the {} plugin (PJRT C API {})",
            build.target, build.devices, build.device_kind, build.platform, build.plugin_api
        ));
    }
    Ok(())
}

/// What this runtime runs on, in the words of [`matches`].
pub fn describe(rt: &Runtime) -> String {
    let (platform, api, kind) = here(rt);
    format!(
        "{} x {kind} on the {platform} plugin (PJRT C API {api})",
        rt.devices.len()
    )
}

/// (platform, plugin API version, device kind) of a runtime.
fn here(rt: &Runtime) -> (String, String, String) {
    let (major, minor) = rt.client.plugin().api_version();
    let kind = rt.devices[0]
        .info()
        .map(|i| i.kind)
        .unwrap_or_else(|_| "?".into());
    (rt.platform(), format!("{major}.{minor}"), kind)
}

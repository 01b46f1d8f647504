//! The on-disk cache of compiled executables.

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

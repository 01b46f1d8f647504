//! A GPU described in a file (`--target-config`): XLA's GpuTargetConfigProto in text form, as in
//! XLA's `gpu_specs` folder, checked before a plugin sees it (the plugin's own parser would say
//! neither where nor what is wrong).

use crate::device::absent::text_proto;
use crate::device::absent::Platform;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Read a GPU description file (`--target-config`), checked by [`check`]; errors name the file.
pub(super) fn read_target_config(file: &Path, platform: Platform) -> Result<String> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read --target-config {}", file.display()))?;
    check(&text, platform)
        .map_err(|e| anyhow::anyhow!("--target-config {}: {e:#}", file.display()))?;
    Ok(text)
}

/// Check a GPU description: that it is for the target's platform and that the fields XLA sizes
/// the device by are there and make sense (a syntax error names its line).
pub(super) fn check(text: &str, platform: Platform) -> Result<()> {
    let fields = text_proto::parse(text)
        .map_err(|e| anyhow::anyhow!("{e} (expected a GpuTargetConfigProto in text form)"))?;
    let named = text_proto::get(&fields, "platform_name").map(|f| match &f.value {
        text_proto::Value::Scalar(s) => s.to_ascii_lowercase(),
        _ => String::new(),
    });
    let want = platform.plugin();
    match named.as_deref() {
        Some(p) if p == want => {}
        Some(p) => {
            bail!("platform_name is \"{p}\" but the target is a {want} GPU")
        }
        None => bail!(
            "no `platform_name: \"{}\"` line (a GpuTargetConfigProto in \
             text form, as in XLA's xla/tools/hlo_opt/gpu_specs/)",
            want.to_ascii_uppercase()
        ),
    }
    let Some(info) = text_proto::get(&fields, "gpu_device_info") else {
        bail!("no gpu_device_info block (a GpuTargetConfigProto in text form)");
    };
    let info_fields = info.value.fields();
    let (arch, arch_example) = match platform {
        Platform::Rocm => (
            "rocm_compute_capability",
            "rocm_compute_capability { gcn_arch_name: \"gfx942:sramecc+:xnack-\" }",
        ),
        _ => (
            "cuda_compute_capability",
            "cuda_compute_capability { major: 9 minor: 0 }",
        ),
    };
    let arch_given = text_proto::get(info_fields, arch).is_some_and(|f| {
        let inner = f.value.fields();
        match platform {
            Platform::Rocm => text_proto::get(inner, "gcn_arch_name").is_some(),
            _ => text_proto::get(inner, "major").is_some(),
        }
    });
    if !arch_given {
        bail!(
            "gpu_device_info (line {}) has no {arch}: XLA compiles for a \
             GPU architecture and cannot without one; add e.g. `{arch_example}` (`xtrain targets \
             {want}:<name>` prints a built-in description to start from)",
            info.line
        );
    }
    for (name, what) in [
        ("device_memory_size", "the device's memory in bytes"),
        ("core_count", "the number of SMs or compute units"),
    ] {
        let Some(f) = text_proto::get(info_fields, name) else {
            bail!(
                "gpu_device_info (line {}) has no {name} ({what})",
                info.line
            );
        };
        match text_proto::int(f) {
            Ok(v) if v > 0 => {}
            Ok(v) => bail!(
                "line {}: {name} is {v}, but it must be {what}, a positive \
                 number",
                f.line
            ),
            Err(why) => bail!("line {}: {name}: {why}", f.line),
        }
    }
    Ok(())
}

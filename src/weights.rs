//! Loading a checkpoint's frozen weights, each checked against the config by name and shape.

use crate::config::LlamaConfig;
use crate::runtime::convert;
use crate::safetensors::WeightFiles;
use crate::step::frozen_weights;
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::path::Path;

/// Check that the checkpoint in `dir` has every tensor the config needs, with the right shape
/// and a float dtype, before anything is loaded.
pub fn check(files: &WeightFiles, cfg: &LlamaConfig) -> Result<()> {
    for (name, shape) in frozen_weights(cfg) {
        let (info, path) = files.info(&name)?;
        if info.shape != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?} but the config needs {shape:?}",
                path.display(),
                info.shape
            );
        }
        if !matches!(
            info.dtype,
            ElementType::F32 | ElementType::BF16 | ElementType::F16
        ) {
            bail!(
                "{}: tensor `{name}` has dtype {:?}; xtrain reads f32, bf16 and f16 weights",
                path.display(),
                info.dtype
            );
        }
    }
    Ok(())
}

/// Read every frozen weight, in program order, converted to `dtype`. `progress` is called after
/// each tensor with (done, total).
pub fn load(
    dir: &Path,
    cfg: &LlamaConfig,
    dtype: ElementType,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<HostTensor>> {
    let files = WeightFiles::open(dir)?;
    check(&files, cfg)?;
    let names = frozen_weights(cfg);
    let total = names.len();
    names
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let t = files.read(name)?;
            let t = convert(&t, dtype).with_context(|| format!("converting `{name}`"))?;
            progress(i + 1, total);
            Ok(t)
        })
        .collect()
}

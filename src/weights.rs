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

/// Read the frozen weights a program takes (`args`: names and shapes, stacked `layers.*` names
/// assembled from their layers), converted to `dtype`. `progress` is called after each
/// checkpoint tensor with (done, total).
pub fn load(
    dir: &Path,
    cfg: &LlamaConfig,
    args: &[(String, Vec<i64>)],
    dtype: ElementType,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<HostTensor>> {
    let files = WeightFiles::open(dir)?;
    check(&files, cfg)?;
    let total = frozen_weights(cfg).len();
    let mut done = 0;
    let mut read = |name: &str| -> Result<HostTensor> {
        let t =
            convert(&files.read(name)?, dtype).with_context(|| format!("converting `{name}`"))?;
        done += 1;
        progress(done, total);
        Ok(t)
    };
    args.iter()
        .map(|(name, _)| {
            if name.contains("layers.*.") {
                let parts: Vec<HostTensor> = (0..cfg.num_hidden_layers)
                    .map(|l| read(&crate::step::layer_name(name, l)))
                    .collect::<Result<_>>()?;
                crate::runtime::stack(&parts)
            } else {
                read(name)
            }
        })
        .collect()
}

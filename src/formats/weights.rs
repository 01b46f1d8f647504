//! Loading a checkpoint's frozen weights, each checked against the config by name and shape.

use crate::formats::host::convert;
use crate::formats::safetensors::WeightFiles;
use crate::model::config::LlamaConfig;
use crate::model::tensors::frozen_weights;
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
    check_layer_count(files, cfg)
}

/// Refuse a checkpoint with more layers than the config says: a config edited (or copied from a
/// smaller model) would silently train a truncated model.
fn check_layer_count(files: &WeightFiles, cfg: &LlamaConfig) -> Result<()> {
    let layers = files
        .names()
        .filter_map(|n| {
            n.strip_prefix("model.layers.")?
                .split('.')
                .next()?
                .parse::<i64>()
                .ok()
        })
        .max()
        .map_or(0, |l| l + 1);
    if layers > cfg.num_hidden_layers {
        bail!(
            "{}: the checkpoint has {layers} layers (model.layers.0 to model.layers.{}), but config.json says num_hidden_layers = {}; fix the config (or use the config that came with these weights)",
            files.dir.display(),
            layers - 1,
            cfg.num_hidden_layers
        );
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
        let t = files.read(name)?;
        done += 1;
        progress(done, total);
        Ok(t)
    };
    // NF4 parts come four in a row per weight; quantize once and hand out the parts.
    let mut quantized: Option<(String, Vec<HostTensor>)> = None;
    let nf4_suffixes = ["nf4", "absmax_q", "absmax_scale", "absmax_mean"];
    let mut out = Vec::new();
    for (name, _) in args {
        let (base, suffix) = name.rsplit_once('.').unwrap_or((name, ""));
        if let Some(part) = nf4_suffixes.iter().position(|s| *s == suffix) {
            if quantized.as_ref().is_none_or(|(b, _)| b != base) {
                let layers: Vec<String> = if base.contains("layers.*.") {
                    (0..cfg.num_hidden_layers)
                        .map(|l| crate::model::tensors::layer_name(base, l))
                        .collect()
                } else {
                    vec![base.to_string()]
                };
                let mut per_part: Vec<Vec<HostTensor>> = vec![Vec::new(); 4];
                for l in &layers {
                    let w = convert(&read(l)?, ElementType::F32)?.to_f32()?;
                    let q = crate::model::quant::quantize(&w);
                    per_part[0].push(HostTensor::from_u8(&q.packed, &[q.packed.len() as i64]));
                    per_part[1].push(HostTensor::from_i8(&q.scales, &[q.scales.len() as i64]));
                    per_part[2].push(HostTensor::from_f32(
                        &q.scale_absmax,
                        &[q.scale_absmax.len() as i64],
                    ));
                    per_part[3].push(HostTensor::from_f32(&[q.mean], &[]));
                }
                let parts = per_part
                    .into_iter()
                    .map(|p| {
                        if base.contains("layers.*.") {
                            crate::formats::host::stack(&p)
                        } else {
                            Ok(p.into_iter().next().unwrap())
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                quantized = Some((base.to_string(), parts));
            }
            out.push(quantized.as_ref().unwrap().1[part].clone());
        } else if name.contains("layers.*.") {
            let parts: Vec<HostTensor> = (0..cfg.num_hidden_layers)
                .map(|l| {
                    convert(&read(&crate::model::tensors::layer_name(name, l))?, dtype)
                        .with_context(|| format!("converting `{name}`"))
                })
                .collect::<Result<_>>()?;
            out.push(crate::formats::host::stack(&parts)?);
        } else {
            out.push(convert(&read(name)?, dtype).with_context(|| format!("converting `{name}`"))?);
        }
    }
    Ok(out)
}

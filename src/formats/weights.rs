//! A checkpoint's frozen weights, checked against the config by name and shape, and read for a
//! program one device's shard at a time ([`FrozenWeights`]): each shard is cut straight out of
//! the memory-mapped safetensors files (only the rows and columns that device holds), converted
//! (or NF4-quantized, weight by weight) to the program's element type, and the file's pages are
//! released before the next tensor. Whoever uploads the shards (`device::trainer`) frees each
//! one after its upload, so the host memory loading takes is the shard at hand, never the whole
//! checkpoint.

use crate::formats::host::{convert, slice_bytes};
use crate::formats::safetensors::WeightFiles;
use crate::model::config::LlamaConfig;
use crate::model::tensors::{frozen_weights, layer_name, nf4_parts};
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

/// Where a program's frozen arguments come from, one device's shard at a time.
pub trait FrozenWeights {
    /// The box (`starts`, `sizes`) of frozen argument `k` (the `k`-th frozen argument of the
    /// program, named `name`, of full shape `shape`) in element type `ty`.
    fn shard(
        &mut self,
        k: usize,
        name: &str,
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<HostTensor>;

    /// Every shard of argument `k` has been taken: what was kept for it can go.
    fn done(&mut self, _k: usize) {}
}

/// Weights already in host memory, in the program's layout (random weights, tests): each is
/// freed once its shards are taken.
impl FrozenWeights for Vec<HostTensor> {
    fn shard(
        &mut self,
        k: usize,
        name: &str,
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<HostTensor> {
        let t = self
            .get(k)
            .context("fewer weights than the program takes")?;
        if t.dims != shape {
            bail!(
                "weight `{name}` is {:?}, the program takes {shape:?}",
                t.dims
            );
        }
        let part = if sizes == shape {
            t.clone()
        } else {
            slice_bytes(&t.bytes, t.ty, &t.dims, starts, sizes)
        };
        if part.ty == ty {
            Ok(part)
        } else {
            convert(&part, ty)
        }
    }

    fn done(&mut self, k: usize) {
        if let Some(t) = self.get_mut(k) {
            t.bytes = Vec::new();
        }
    }
}

/// The suffixes of an NF4 weight's parts, in the order [`crate::model::quant`] gives them.
const NF4_SUFFIXES: [&str; 4] = ["nf4", "absmax_q", "absmax_scale", "absmax_mean"];

/// A checkpoint directory's frozen weights, opened (mapped, headers and shapes checked) and read
/// as asked.
pub struct CheckpointWeights {
    files: WeightFiles,
    layers: i64,
    /// The NF4 parts of the weight quantized last (stacked over layers when it is), by its name:
    /// its four parts are four arguments in a row.
    nf4: Option<(String, Vec<HostTensor>)>,
    /// Told `None` when the first shard is asked for, then `Some(k)` as argument `k` is done.
    progress: Box<dyn FnMut(Option<usize>)>,
    started: bool,
}

impl CheckpointWeights {
    pub fn open(dir: &Path, cfg: &LlamaConfig) -> Result<CheckpointWeights> {
        let files = WeightFiles::open(dir)?;
        check(&files, cfg)?;
        Ok(CheckpointWeights {
            files,
            layers: cfg.num_hidden_layers,
            nf4: None,
            progress: Box::new(|_| {}),
            started: false,
        })
    }

    /// Call `f` with `None` when loading starts (the first shard is asked for), then with
    /// `Some(k)` as each argument `k` is done.
    pub fn on_progress(mut self, f: impl FnMut(Option<usize>) + 'static) -> CheckpointWeights {
        self.progress = Box::new(f);
        self
    }

    /// The bytes of the largest tensor in the checkpoint's files (of those the config needs),
    /// in its file's dtype.
    pub fn largest_tensor_bytes(&self, cfg: &LlamaConfig) -> u64 {
        frozen_weights(cfg)
            .iter()
            .filter_map(|(n, _)| self.files.info(n).ok().map(|(i, _)| i.len))
            .max()
            .unwrap_or(0)
    }

    /// The box of checkpoint tensor `name` (as stored: one layer's), converted to `ty`; the
    /// file's pages it touched are released.
    fn read_box(
        &self,
        name: &str,
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<HostTensor> {
        let (info, path) = self.files.info(name)?;
        if info.shape.len() != sizes.len() {
            bail!(
                "{}: tensor `{name}` has shape {:?}, the program takes {} dims",
                path.display(),
                info.shape,
                sizes.len()
            );
        }
        let part = slice_bytes(
            self.files.bytes(name)?,
            info.dtype,
            &info.shape,
            starts,
            sizes,
        );
        self.files.release(name);
        if part.ty == ty {
            Ok(part)
        } else {
            convert(&part, ty).with_context(|| format!("converting `{name}`"))
        }
    }

    /// The NF4 parts of `base` (a per-layer or a stacked name), quantized layer by layer.
    fn quantize(&self, base: &str) -> Result<Vec<HostTensor>> {
        let layers: Vec<String> = if base.contains("layers.*.") {
            (0..self.layers).map(|l| layer_name(base, l)).collect()
        } else {
            vec![base.to_string()]
        };
        let mut per_part: Vec<Vec<HostTensor>> = vec![Vec::new(); 4];
        for l in &layers {
            let w = convert(&self.files.read(l)?, ElementType::F32)?.to_f32()?;
            let q = crate::model::quant::quantize(&w).map_err(|e| {
                anyhow::anyhow!(
                    "tensor `{l}`: {e}; the checkpoint is damaged or was saved after a diverged run"
                )
            })?;
            drop(w);
            per_part[0].push(HostTensor::from_u8(&q.packed, &[q.packed.len() as i64]));
            per_part[1].push(HostTensor::from_i8(&q.scales, &[q.scales.len() as i64]));
            per_part[2].push(HostTensor::from_f32(
                &q.scale_absmax,
                &[q.scale_absmax.len() as i64],
            ));
            per_part[3].push(HostTensor::from_f32(&[q.mean], &[]));
        }
        per_part
            .into_iter()
            .map(|p| {
                if base.contains("layers.*.") {
                    crate::formats::host::stack(&p)
                } else {
                    Ok(p.into_iter().next().unwrap())
                }
            })
            .collect()
    }
}

impl FrozenWeights for CheckpointWeights {
    fn shard(
        &mut self,
        _k: usize,
        name: &str,
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<HostTensor> {
        if !self.started {
            self.started = true;
            (self.progress)(None);
        }
        let (base, suffix) = name.rsplit_once('.').unwrap_or((name, ""));
        if let Some(part) = NF4_SUFFIXES.iter().position(|s| *s == suffix) {
            if self.nf4.as_ref().is_none_or(|(b, _)| b != base) {
                self.nf4 = None;
                self.nf4 = Some((base.to_string(), self.quantize(base)?));
            }
            let t = &self.nf4.as_ref().unwrap().1[part];
            if t.dims != shape {
                bail!("`{name}` is {:?}, the program takes {shape:?}", t.dims);
            }
            let s = slice_bytes(&t.bytes, t.ty, &t.dims, starts, sizes);
            return if s.ty == ty { Ok(s) } else { convert(&s, ty) };
        }
        if name.contains("layers.*.") {
            if shape.first() != Some(&self.layers) {
                bail!(
                    "`{name}` is {shape:?} but the model has {} layers",
                    self.layers
                );
            }
            let n: i64 = sizes.iter().product();
            let mut bytes = Vec::with_capacity(n as usize * ty.size_bytes());
            for l in starts[0]..starts[0] + sizes[0] {
                let part = self.read_box(&layer_name(name, l), &starts[1..], &sizes[1..], ty)?;
                bytes.extend_from_slice(&part.bytes);
            }
            return Ok(HostTensor {
                ty,
                dims: sizes.to_vec(),
                bytes,
            });
        }
        let (info, path) = self.files.info(name)?;
        if info.shape != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?}, the program takes {shape:?}",
                path.display(),
                info.shape
            );
        }
        self.read_box(name, starts, sizes, ty)
    }

    fn done(&mut self, k: usize) {
        (self.progress)(Some(k));
    }
}

/// Read the frozen weights a program takes (`args`: names and shapes, stacked `layers.*` names
/// assembled from their layers) whole, dense ones converted to `dtype` (NF4 parts in their own
/// types). `progress` is called after each argument with (done, total). This holds every
/// weight in host memory at once: what tests and one-device tools want; `xtrain train` streams
/// shards instead ([`CheckpointWeights`] as [`FrozenWeights`]).
pub fn load(
    dir: &Path,
    cfg: &LlamaConfig,
    args: &[(String, Vec<i64>)],
    dtype: ElementType,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<HostTensor>> {
    let mut c = CheckpointWeights::open(dir, cfg)?;
    let nf4_types: Vec<(&str, ElementType)> = nf4_parts(1)
        .into_iter()
        .map(|(s, _, d)| (s, crate::formats::host::element_type(d)))
        .collect();
    args.iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let suffix = name.rsplit_once('.').map_or("", |(_, s)| s);
            let ty = nf4_types
                .iter()
                .find(|(s, _)| *s == suffix)
                .map_or(dtype, |(_, t)| *t);
            let t = c.shard(k, name, shape, &vec![0; shape.len()], shape, ty)?;
            c.done(k);
            progress(k + 1, args.len());
            Ok(t)
        })
        .collect()
}

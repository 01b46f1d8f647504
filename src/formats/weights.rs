//! A checkpoint's frozen weights, checked against the config by name and shape, and read for a
//! program one device's shard at a time ([`FrozenWeights`]): each shard is cut straight out of
//! the memory-mapped safetensors files (only the rows and columns that device holds; the pages
//! mapped in with one call, timed as reading), converted to the program's element type (layers
//! of a stacked argument appended to one buffer), or NF4-quantized weight by weight on every
//! core straight from the mapped bytes into the stacked parts, and the file's pages are released
//! before the next tensor. Whoever uploads the shards (`device::frozen`) frees each one after
//! its upload (or hands it to the plugin as the device buffer), so the host memory loading takes
//! is a few shards at hand, never the whole checkpoint.

use crate::formats::host::{convert, slice_bytes, slice_bytes_into, widen_into};
use crate::formats::safetensors::WeightFiles;
use crate::model::config::LlamaConfig;
use crate::model::quant;
use crate::model::tensors::{frozen_weights, layer_name, nf4_parts};
use anyhow::{bail, Context, Result};
use pjrt::{AlignedHost, ElementType, HostTensor};
use std::path::Path;
use std::time::Instant;

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

    /// [`FrozenWeights::shard`] in memory aligned for the plugin to take as the device
    /// buffer's own ([`pjrt::AlignedHost`]; copied there unless the reader writes it there).
    fn shard_aligned(
        &mut self,
        k: usize,
        name: &str,
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<AlignedHost> {
        let t = self.shard(k, name, shape, starts, sizes, ty)?;
        Ok(AlignedHost::from_tensor(t))
    }

    /// Every shard of argument `k` has been taken: what was kept for it can go.
    fn done(&mut self, _k: usize) {}

    /// What reading has cost so far (zero where the weights were in memory already).
    fn figures(&self) -> ReadFigures {
        ReadFigures::default()
    }
}

/// Where a reader's time went, for the figures a load reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReadFigures {
    /// Seconds mapping the files' pages in: the checkpoint's bytes read.
    pub read_s: f64,
    /// Bytes of the files mapped in (a box's span: from its first byte to its last).
    pub read_bytes: u64,
    /// Seconds cutting each device's box out of the mapped bytes, converting it to the
    /// program's element type and stacking layers, and the bytes of those boxes as stored.
    pub convert_s: f64,
    pub convert_bytes: u64,
    /// Seconds NF4-quantizing (on every core), and the bytes quantized as stored.
    pub quantize_s: f64,
    pub quantize_bytes: u64,
}

impl ReadFigures {
    /// The figures of several readers (one per host of this process) together.
    pub fn sum(all: impl IntoIterator<Item = ReadFigures>) -> ReadFigures {
        all.into_iter()
            .fold(ReadFigures::default(), |a, b| ReadFigures {
                read_s: a.read_s + b.read_s,
                read_bytes: a.read_bytes + b.read_bytes,
                convert_s: a.convert_s + b.convert_s,
                convert_bytes: a.convert_bytes + b.convert_bytes,
                quantize_s: a.quantize_s + b.quantize_s,
                quantize_bytes: a.quantize_bytes + b.quantize_bytes,
            })
    }
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
    /// its four parts are four arguments in a row. A part asked for whole is handed over (None
    /// after), not copied.
    nf4: Option<(String, Vec<Option<HostTensor>>)>,
    /// Told `None` when the first shard is asked for, then `Some(k)` as argument `k` is done.
    progress: Box<dyn FnMut(Option<usize>)>,
    started: bool,
    figures: ReadFigures,
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
            figures: ReadFigures::default(),
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

    /// Map in the pages of the box (`starts`, `sizes`) of tensor `name` (from the first byte of
    /// the box to its last), timed as reading.
    fn read_pages(&mut self, name: &str, shape: &[i64], at: &[i64], n: &[i64], es: u64) -> u64 {
        let t = Instant::now();
        let (first, last) = box_span(shape, at, n);
        let (first, last) = (first * es, last * es);
        self.files.populate(name, first as usize, last as usize);
        self.figures.read_s += t.elapsed().as_secs_f64();
        self.figures.read_bytes += last - first;
        last - first
    }

    /// The box of checkpoint tensor `name` (as stored: one layer's), converted to `ty` and
    /// appended to `out`; the file's pages it touched are released.
    fn read_box_into(
        &mut self,
        name: &str,
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let (info, path) = self.files.info(name)?;
        let (shape, dtype) = (info.shape.clone(), info.dtype);
        if shape.len() != sizes.len() {
            bail!(
                "{}: tensor `{name}` has shape {shape:?}, the program takes {} dims",
                path.display(),
                sizes.len()
            );
        }
        let read = self.read_pages(name, &shape, starts, sizes, dtype.size_bytes() as u64);
        self.figures.convert_bytes += read;
        let t = Instant::now();
        let bytes = self.files.bytes(name)?;
        if dtype == ty {
            slice_bytes_into(bytes, dtype, &shape, starts, sizes, out);
        } else {
            let part = slice_bytes(bytes, dtype, &shape, starts, sizes);
            if !widen_into(&part.bytes, dtype, ty, out) {
                let c = convert(&part, ty).with_context(|| format!("converting `{name}`"))?;
                out.extend_from_slice(&c.bytes);
            }
        }
        self.files.release(name);
        self.figures.convert_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// The NF4 parts of `base` (a per-layer or a stacked name), quantized layer by layer on
    /// every core straight from the mapped file into the stacked parts.
    fn quantize(&mut self, base: &str) -> Result<Vec<HostTensor>> {
        let stacked = base.contains("layers.*.");
        let layers: Vec<String> = if stacked {
            (0..self.layers).map(|l| layer_name(base, l)).collect()
        } else {
            vec![base.to_string()]
        };
        let (info, path) = self.files.info(&layers[0])?;
        let shape = info.shape.clone();
        let n = shape.iter().product::<i64>() as usize;
        if !n.is_multiple_of(quant::BLOCK) {
            bail!(
                "{}: tensor `{}` has {n} values, not a multiple of NF4's blocks of {}",
                path.display(),
                layers[0],
                quant::BLOCK
            );
        }
        let (nb, nsb) = (quant::blocks(n), quant::scale_blocks(n));
        let count = layers.len();
        let mut packed = vec![0u8; count * n / 2];
        let mut scales = vec![0i8; count * nb];
        let mut scale_absmax = vec![0f32; count * nsb];
        let mut means = vec![0f32; count];
        let mut absmax = vec![0f32; nb];
        for (l, name) in layers.iter().enumerate() {
            let (info, path) = self.files.info(name)?;
            let (dtype, path) = (info.dtype, path.to_path_buf());
            if info.shape != shape {
                bail!(
                    "{}: tensor `{name}` has shape {:?}, `{}` has {shape:?}",
                    path.display(),
                    info.shape,
                    layers[0]
                );
            }
            let zeros = vec![0; shape.len()];
            let read = self.read_pages(name, &shape, &zeros, &shape, dtype.size_bytes() as u64);
            self.figures.quantize_bytes += read;
            let t = Instant::now();
            let bytes = self.files.bytes(name)?;
            let codes = &mut packed[l * n / 2..(l + 1) * n / 2];
            let threads = quant::encode::threads();
            let encoded = match dtype {
                ElementType::BF16 => {
                    quant::encode::encode_into(n, threads, bf16_blocks(bytes), codes, &mut absmax)
                }
                ElementType::F32 => {
                    quant::encode::encode_into(n, threads, f32_blocks(bytes), codes, &mut absmax)
                }
                ElementType::F16 => {
                    quant::encode::encode_into(n, threads, f16_blocks(bytes), codes, &mut absmax)
                }
                other => bail!(
                    "{}: tensor `{name}` has dtype {other:?}; NF4 quantizes f32, bf16 and f16",
                    path.display()
                ),
            };
            encoded.map_err(|e| {
                anyhow::anyhow!(
                    "{}: tensor `{name}`: {} ({e}); the checkpoint is damaged or was saved after a \
                     diverged run",
                    path.display(),
                    at_index(&shape, e.index)
                )
            })?;
            means[l] = quant::encode::double_quantize(
                &absmax,
                &mut scales[l * nb..(l + 1) * nb],
                &mut scale_absmax[l * nsb..(l + 1) * nsb],
            );
            self.files.release(name);
            self.figures.quantize_s += t.elapsed().as_secs_f64();
        }
        let lead: Vec<i64> = if stacked { vec![count as i64] } else { vec![] };
        let dims = |inner: Option<usize>| -> Vec<i64> {
            let mut d = lead.clone();
            d.extend(inner.map(|i| i as i64));
            d
        };
        Ok(vec![
            HostTensor {
                ty: ElementType::U8,
                dims: dims(Some(n / 2)),
                bytes: packed,
            },
            HostTensor::from_i8(&scales, &dims(Some(nb))),
            HostTensor::from_f32(&scale_absmax, &dims(Some(nsb))),
            HostTensor::from_f32(&means, &dims(None)),
        ])
    }

    /// The box of NF4 part `name` (`<weight>.<part>`: the weight quantized now unless it was
    /// the last one quantized), in `ty`.
    fn nf4_box(
        &mut self,
        (name, part): (&str, usize),
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<HostTensor> {
        let base = name.rsplit_once('.').map_or(name, |(b, _)| b);
        let cached = self
            .nf4
            .as_ref()
            .is_some_and(|(b, parts)| b == base && parts[part].is_some());
        if !cached {
            self.nf4 = None;
            let parts = self.quantize(base)?;
            self.nf4 = Some((base.to_string(), parts.into_iter().map(Some).collect()));
        }
        let slot = &mut self.nf4.as_mut().unwrap().1[part];
        let t = slot.as_ref().unwrap();
        if t.dims != shape {
            bail!("`{name}` is {:?}, the program takes {shape:?}", t.dims);
        }
        let whole = sizes == shape && starts.iter().all(|&s| s == 0);
        let s = if whole {
            slot.take().unwrap()
        } else {
            slice_bytes(&t.bytes, t.ty, &t.dims, starts, sizes)
        };
        if s.ty == ty {
            Ok(s)
        } else {
            convert(&s, ty)
        }
    }
}

/// The first and one past the last element (row-major offsets) of the box (`starts`, `sizes`)
/// of a tensor of shape `shape`; (0, 0) for an empty box.
fn box_span(shape: &[i64], starts: &[i64], sizes: &[i64]) -> (u64, u64) {
    if sizes.contains(&0) {
        return (0, 0);
    }
    let offset = |idx: &mut dyn Iterator<Item = i64>| -> u64 {
        idx.zip(shape).fold(0i64, |o, (i, &d)| o * d + i).max(0) as u64
    };
    let first = offset(&mut starts.iter().copied());
    let last = offset(&mut starts.iter().zip(sizes).map(|(s, z)| s + z - 1));
    (first, last + 1)
}

/// Element `index` of a row-major tensor of shape `shape`, said with its coordinates.
fn at_index(shape: &[i64], index: usize) -> String {
    let mut rest = index as i64;
    let mut coords = vec![0i64; shape.len()];
    for (c, &d) in coords.iter_mut().zip(shape).rev() {
        *c = rest % d.max(1);
        rest /= d.max(1);
    }
    let coords: Vec<String> = coords.iter().map(|c| c.to_string()).collect();
    format!("element {index} (index [{}])", coords.join(", "))
}

/// NF4 blocks of little-endian bf16 bytes, widened to f32 (exactly).
fn bf16_blocks(bytes: &[u8]) -> impl Fn(usize, &mut [f32; quant::BLOCK]) + Sync + '_ {
    move |b, out| {
        let src = &bytes[b * quant::BLOCK * 2..(b + 1) * quant::BLOCK * 2];
        for (o, v) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = f32::from_bits((u16::from_le_bytes([v[0], v[1]]) as u32) << 16);
        }
    }
}

/// NF4 blocks of little-endian f32 bytes.
fn f32_blocks(bytes: &[u8]) -> impl Fn(usize, &mut [f32; quant::BLOCK]) + Sync + '_ {
    move |b, out| {
        let src = &bytes[b * quant::BLOCK * 4..(b + 1) * quant::BLOCK * 4];
        for (o, v) in out.iter_mut().zip(src.chunks_exact(4)) {
            *o = f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
        }
    }
}

/// NF4 blocks of little-endian f16 bytes, widened to f32 (exactly).
fn f16_blocks(bytes: &[u8]) -> impl Fn(usize, &mut [f32; quant::BLOCK]) + Sync + '_ {
    move |b, out| {
        let src = &bytes[b * quant::BLOCK * 2..(b + 1) * quant::BLOCK * 2];
        for (o, v) in out.iter_mut().zip(src.chunks_exact(2)) {
            *o = half::f16::from_bits(u16::from_le_bytes([v[0], v[1]])).to_f32();
        }
    }
}

impl CheckpointWeights {
    /// The box of (non-NF4) argument `name` appended to `bytes` (empty, or an aligned buffer's
    /// padding): a stacked argument's layers one after another.
    fn shard_bytes(
        &mut self,
        name: &str,
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
        mut bytes: Vec<u8>,
    ) -> Result<Vec<u8>> {
        if name.contains("layers.*.") {
            if shape.first() != Some(&self.layers) {
                bail!(
                    "`{name}` is {shape:?} but the model has {} layers",
                    self.layers
                );
            }
            for l in starts[0]..starts[0] + sizes[0] {
                let layer = layer_name(name, l);
                self.read_box_into(&layer, &starts[1..], &sizes[1..], ty, &mut bytes)?;
            }
            return Ok(bytes);
        }
        let (info, path) = self.files.info(name)?;
        if info.shape != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?}, the program takes {shape:?}",
                path.display(),
                info.shape
            );
        }
        self.read_box_into(name, starts, sizes, ty, &mut bytes)?;
        Ok(bytes)
    }

    /// Which NF4 part `name` is, if it is one; the first call says loading has started.
    fn start(&mut self, name: &str) -> Option<usize> {
        if !self.started {
            self.started = true;
            (self.progress)(None);
        }
        let suffix = name.rsplit_once('.').map_or("", |(_, s)| s);
        NF4_SUFFIXES.iter().position(|s| *s == suffix)
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
        if let Some(part) = self.start(name) {
            return self.nf4_box((name, part), shape, starts, sizes, ty);
        }
        let n: i64 = sizes.iter().product();
        let bytes = Vec::with_capacity(n as usize * ty.size_bytes());
        let bytes = self.shard_bytes(name, shape, starts, sizes, ty, bytes)?;
        Ok(HostTensor {
            ty,
            dims: sizes.to_vec(),
            bytes,
        })
    }

    fn shard_aligned(
        &mut self,
        _k: usize,
        name: &str,
        shape: &[i64],
        starts: &[i64],
        sizes: &[i64],
        ty: ElementType,
    ) -> Result<AlignedHost> {
        if let Some(part) = self.start(name) {
            let t = self.nf4_box((name, part), shape, starts, sizes, ty)?;
            return Ok(AlignedHost::from_tensor(t));
        }
        let n: i64 = sizes.iter().product();
        let bytes = AlignedHost::buffer(n as usize * ty.size_bytes());
        let bytes = self.shard_bytes(name, shape, starts, sizes, ty, bytes)?;
        Ok(AlignedHost::from_buffer(ty, sizes, bytes)?)
    }

    fn done(&mut self, k: usize) {
        (self.progress)(Some(k));
    }

    fn figures(&self) -> ReadFigures {
        self.figures
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

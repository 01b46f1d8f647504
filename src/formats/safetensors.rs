//! Safetensors files, read and written with the `safetensors` crate (the format's reference
//! implementation): a little-endian u64 header length, a JSON header naming every tensor's dtype,
//! shape and byte range, then the data.
//!
//! Reading memory-maps the file (`memmap2`) and hands the map to the crate, which parses and
//! validates the header (offsets contiguous, each tensor's bytes matching its dtype and shape,
//! the data covering the file exactly) without touching the data; a tensor's pages are read
//! only when it is used, and [`SafeTensors::release`] gives them back, so reading a checkpoint
//! tensor by tensor never holds more than the tensor at hand in memory. Around the crate are
//! our own checks and messages: a short file, a header that does not fit, a truncated file
//! naming the first tensor whose data is missing, an unsupported dtype naming the tensor, and
//! `model.safetensors.index.json` (which the crate does not read) naming missing shards.
//!
//! Writing lays the file out as the crate does (tensors by dtype alignment, largest first, then
//! by name; the header is the crate's `Metadata`, padded with spaces to 8 bytes) and streams it
//! through [`crate::formats::atomic::write_atomic`] (temp file, fsync, rename, directory fsync):
//! the crate's own `serialize_to_file` renames without an fsync, and its `serialize` builds the
//! whole file in memory first.
//!
//! A mapped file that another process truncates while it is read would fault (SIGBUS): xtrain
//! never writes over a file it has mapped (every write is a rename of a new file).

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use pjrt::{ElementType, HostTensor};
use safetensors::tensor::{Dtype, Metadata, SafeTensorError, TensorInfo as StInfo};
use safetensors::SafeTensors as Parsed;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The element type of a safetensors dtype, if xtrain has one.
fn element_type(d: Dtype) -> Option<ElementType> {
    Some(match d {
        Dtype::BOOL => ElementType::Pred,
        Dtype::I8 => ElementType::S8,
        Dtype::I32 => ElementType::S32,
        Dtype::I64 => ElementType::S64,
        Dtype::U8 => ElementType::U8,
        Dtype::U16 => ElementType::U16,
        Dtype::U32 => ElementType::U32,
        Dtype::U64 => ElementType::U64,
        Dtype::F16 => ElementType::F16,
        Dtype::BF16 => ElementType::BF16,
        Dtype::F32 => ElementType::F32,
        Dtype::F64 => ElementType::F64,
        _ => return None,
    })
}

/// The name safetensors (and its Python readers) give an element type: `F32`, `I64`, ...
pub fn dtype_name(ty: ElementType) -> String {
    format!("{:?}", st_dtype(ty))
}

fn st_dtype(ty: ElementType) -> Dtype {
    match ty {
        ElementType::Pred => Dtype::BOOL,
        ElementType::S8 => Dtype::I8,
        ElementType::S32 => Dtype::I32,
        ElementType::S64 => Dtype::I64,
        ElementType::U8 => Dtype::U8,
        ElementType::U16 => Dtype::U16,
        ElementType::U32 => Dtype::U32,
        ElementType::U64 => Dtype::U64,
        ElementType::F16 => Dtype::F16,
        ElementType::BF16 => Dtype::BF16,
        ElementType::F32 => Dtype::F32,
        ElementType::F64 => Dtype::F64,
    }
}

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: ElementType,
    pub shape: Vec<i64>,
    /// Absolute byte offset in the file.
    pub offset: u64,
    pub len: u64,
}

/// An open (memory-mapped) safetensors file with a checked header.
pub struct SafeTensors {
    pub path: PathBuf,
    /// The whole file, mapped (read-only).
    map: Mmap,
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
}

impl SafeTensors {
    pub fn open(path: &Path) -> Result<SafeTensors> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let size = file.metadata()?.len();
        let fail = |m: String| anyhow::anyhow!("{}: {m}", path.display());
        if size < 8 {
            return Err(fail(format!(
                "file is {size} bytes, too short for a safetensors header"
            )));
        }
        // SAFETY: the map is read-only and xtrain never writes a file in place (every write is
        // a new file renamed over the old one), so the mapped bytes do not change under us;
        // another program truncating the file meanwhile would fault, as for any mapped file.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        let header_len = u64::from_le_bytes(map[..8].try_into().unwrap());
        let (n, meta) =
            Parsed::read_metadata(&map).map_err(|e| fail(explain(e, &map, header_len, size)))?;
        let data_start = 8 + n as u64;
        let mut tensors = BTreeMap::new();
        for (name, info) in meta.tensors() {
            let dtype = element_type(info.dtype).ok_or_else(|| {
                fail(format!(
                    "tensor `{name}`: unsupported dtype {:?}",
                    info.dtype
                ))
            })?;
            let (start, end) = info.data_offsets;
            tensors.insert(
                name,
                TensorInfo {
                    dtype,
                    shape: info.shape.iter().map(|&d| d as i64).collect(),
                    offset: data_start + start as u64,
                    len: (end - start) as u64,
                },
            );
        }
        let metadata = meta
            .metadata()
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(SafeTensors {
            path: path.to_path_buf(),
            map,
            tensors,
            metadata,
        })
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .with_context(|| format!("{}: no tensor named `{name}`", self.path.display()))
    }

    /// A tensor's bytes, in the file's layout (row-major, little-endian), straight from the map:
    /// its pages are read as they are touched. [`SafeTensors::release`] gives them back.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.info(name)?;
        Ok(&self.map[info.offset as usize..(info.offset + info.len) as usize])
    }

    /// Drop the pages of `name` that reading it mapped in (the file stays in the page cache, and
    /// reading the tensor again maps them in again): what keeps reading a checkpoint tensor by
    /// tensor from growing the process's memory by the whole checkpoint.
    pub fn release(&self, name: &str) {
        if let Ok(info) = self.info(name) {
            if info.len > 0 {
                // SAFETY: MADV_DONTNEED on a read-only shared file mapping only drops this
                // process's page table entries; later reads fault the file's pages in again.
                let _ = unsafe {
                    self.map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        info.offset as usize,
                        info.len as usize,
                    )
                };
            }
        }
    }

    /// Map in the pages of bytes `start..end` of tensor `name` now, in one call
    /// (`MADV_POPULATE_READ`), rather than one fault per page as they are touched: the read
    /// of a tensor, timed apart from what is done with its bytes. A kernel without it (before
    /// Linux 5.14) says no, and the pages fault in as they are touched, as before.
    pub fn populate(&self, name: &str, start: usize, end: usize) {
        if let Ok(info) = self.info(name) {
            let end = end.min(info.len as usize);
            if start < end {
                let _ = self.map.advise_range(
                    memmap2::Advice::PopulateRead,
                    info.offset as usize + start,
                    end - start,
                );
            }
        }
    }

    /// A tensor as a host tensor (a copy; the mapped pages are released).
    pub fn read(&self, name: &str) -> Result<HostTensor> {
        let info = self.info(name)?;
        let t = HostTensor {
            ty: info.dtype,
            dims: info.shape.clone(),
            bytes: self.bytes(name)?.to_vec(),
        };
        self.release(name);
        Ok(t)
    }
}

/// The crate's error, said with the file's numbers; a truncated file names the first tensor
/// whose data is missing.
fn explain(e: SafeTensorError, map: &[u8], header_len: u64, size: u64) -> String {
    match e {
        SafeTensorError::HeaderTooLarge | SafeTensorError::InvalidHeaderLength => format!(
            "header length {header_len} does not fit in the {size}-byte file (truncated or not safetensors)"
        ),
        SafeTensorError::InvalidHeader(e) => format!("header is not valid UTF-8 ({e})"),
        SafeTensorError::InvalidHeaderDeserialization(e) => {
            format!("header is not valid JSON ({e})")
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            let header = &map[8..8 + header_len as usize];
            let data = size - 8 - header_len;
            match serde_json::from_slice::<Metadata>(header) {
                Ok(meta) => {
                    let mut by_end: Vec<(String, usize)> = meta
                        .tensors()
                        .into_iter()
                        .map(|(n, i)| (n, i.data_offsets.1))
                        .collect();
                    by_end.sort_by_key(|(_, end)| *end);
                    match by_end.iter().find(|(_, end)| *end as u64 > data) {
                        Some((name, end)) => format!(
                            "tensor `{name}`: data ends at byte {} but the file has {size} bytes (truncated?)",
                            8 + header_len + *end as u64
                        ),
                        None => format!(
                            "the tensors end at byte {} but the file has {size} bytes (trailing bytes: not a safetensors file?)",
                            8 + header_len + meta.data_len() as u64
                        ),
                    }
                }
                Err(e) => format!("header is not valid ({e})"),
            }
        }
        SafeTensorError::TensorInvalidInfo => {
            // Name the tensor whose byte range does not fit its dtype and shape.
            let header = &map[8..8 + header_len as usize];
            let entries: BTreeMap<String, serde_json::Value> =
                serde_json::from_slice(header).unwrap_or_default();
            let bad = entries.into_iter().find_map(|(name, v)| {
                let info: StInfo = serde_json::from_value(v).ok()?;
                let n = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                let need = n.and_then(|n| n.checked_mul(info.dtype.bitsize() / 8));
                let (s, e) = info.data_offsets;
                (need != e.checked_sub(s)).then(|| {
                    format!(
                        "tensor `{name}`: {:?}{:?} needs {} bytes but data_offsets [{s}, {e}] span {}",
                        info.dtype,
                        info.shape,
                        need.map_or("too many".into(), |b| b.to_string()),
                        e.saturating_sub(s)
                    )
                })
            });
            bad.unwrap_or_else(|| "a tensor's dtype and shape do not match its data_offsets".into())
        }
        SafeTensorError::InvalidOffset(name) => format!(
            "tensor `{name}`: its data_offsets do not start where the previous tensor's end (holes or overlaps)"
        ),
        e => format!("not a valid safetensors file ({e})"),
    }
}

/// Write tensors to `path` atomically (a crash leaves the old file or none), laid out as the
/// `safetensors` crate lays them out.
pub fn write(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let list: Vec<(&String, &HostTensor)> = tensors.iter().collect();
    let table: Vec<(String, ElementType, Vec<i64>)> = list
        .iter()
        .map(|(n, t)| (n.to_string(), t.ty, t.dims.clone()))
        .collect();
    write_streamed(path, &table, metadata, |i| {
        Ok(Cow::Borrowed(&list[i].1.bytes))
    })
}

/// [`write`] a tensor at a time: `tensors` is the table (name, element type, dims), and
/// `data(i)` gives the bytes of its entry `i` when the file reaches it, so that a writer need
/// not hold every tensor at once. An error from `data` abandons the file and is returned as it
/// is; bytes of another length than the entry's are an error naming the tensor.
pub fn write_streamed<'a>(
    path: &Path,
    tensors: &[(String, ElementType, Vec<i64>)],
    metadata: &BTreeMap<String, String>,
    mut data: impl FnMut(usize) -> Result<Cow<'a, [u8]>>,
) -> Result<()> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&l, &r| {
        let ((ln, lt, _), (rn, rt, _)) = (&tensors[l], &tensors[r]);
        st_dtype(*rt).cmp(&st_dtype(*lt)).then_with(|| ln.cmp(rn))
    });
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0usize;
    for &i in &order {
        let (name, ty, dims) = &tensors[i];
        let count = dims.iter().product::<i64>().max(0) as usize;
        let end = offset + ty.byte_size(count);
        infos.push((
            name.to_string(),
            StInfo {
                dtype: st_dtype(*ty),
                shape: dims.iter().map(|&d| d as usize).collect(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let meta = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<HashMap<_, _>>()
    });
    let meta = Metadata::new(meta, infos.clone())
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut header = serde_json::to_vec(&meta)?;
    // Pad the header to 8 bytes so tensor data is aligned, as the crate does.
    header.resize(header.len().next_multiple_of(8), b' ');
    // An error of `data` (a tensor's, not the file's) is kept whole to be returned as it is.
    let mut failed = None;
    let written = crate::formats::atomic::write_atomic(path, |f| {
        f.write_all(&(header.len() as u64).to_le_bytes())?;
        f.write_all(&header)?;
        for (&i, (name, info)) in order.iter().zip(&infos) {
            let (start, end) = info.data_offsets;
            let bytes = match data(i) {
                Ok(b) if b.len() == end - start => b,
                Ok(b) => {
                    let (_, ty, dims) = &tensors[i];
                    let e = anyhow::anyhow!(
                        "tensor `{name}`: {ty:?}{dims:?} needs {} bytes but has {}",
                        end - start,
                        b.len()
                    );
                    failed = Some(e);
                    return Err(std::io::Error::other("a tensor's bytes"));
                }
                Err(e) => {
                    failed = Some(e);
                    return Err(std::io::Error::other("a tensor's bytes"));
                }
            };
            f.write_all(&bytes)?;
        }
        Ok(())
    });
    match failed {
        Some(e) => Err(e),
        None => written,
    }
}

/// The weights of a model directory: `model.safetensors`, or shards listed in
/// `model.safetensors.index.json`.
pub struct WeightFiles {
    files: Vec<SafeTensors>,
    /// tensor name -> index into `files`
    index: BTreeMap<String, usize>,
    pub dir: PathBuf,
}

impl WeightFiles {
    pub fn open(dir: &Path) -> Result<WeightFiles> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no `weight_map` object", index_path.display()))?;
            let mut shard_ids: BTreeMap<String, usize> = BTreeMap::new();
            for (tensor, shard) in map {
                let shard = shard.as_str().with_context(|| {
                    format!("{}: `{tensor}` maps to a non-string", index_path.display())
                })?;
                let id = match shard_ids.get(shard) {
                    Some(&id) => id,
                    None => {
                        let p = dir.join(shard);
                        if !p.is_file() {
                            bail!(
                                "{} maps `{tensor}` to shard {shard}, which does not exist",
                                index_path.display()
                            );
                        }
                        files.push(SafeTensors::open(&p)?);
                        shard_ids.insert(shard.to_string(), files.len() - 1);
                        files.len() - 1
                    }
                };
                if !files[id].tensors.contains_key(tensor) {
                    bail!(
                        "{} maps `{tensor}` to {shard}, but that shard has no such tensor",
                        index_path.display()
                    );
                }
                index.insert(tensor.clone(), id);
            }
        } else if single.is_file() {
            let f = SafeTensors::open(&single)?;
            for name in f.tensors.keys() {
                index.insert(name.clone(), 0);
            }
            files.push(f);
        } else if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        } else {
            bail!(
                "{} has neither model.safetensors nor model.safetensors.index.json",
                dir.display()
            );
        }
        Ok(WeightFiles {
            files,
            index,
            dir: dir.to_path_buf(),
        })
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    fn file(&self, name: &str) -> Result<&SafeTensors> {
        let id = self.index.get(name).with_context(|| {
            format!(
                "{}: the checkpoint has no tensor `{name}`",
                self.dir.display()
            )
        })?;
        Ok(&self.files[*id])
    }

    pub fn info(&self, name: &str) -> Result<(&TensorInfo, &Path)> {
        let f = self.file(name)?;
        Ok((&f.tensors[name], &f.path))
    }

    /// See [`SafeTensors::bytes`].
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        self.file(name)?.bytes(name)
    }

    /// See [`SafeTensors::release`].
    pub fn release(&self, name: &str) {
        if let Ok(f) = self.file(name) {
            f.release(name);
        }
    }

    /// [`SafeTensors::populate`] in the file that holds `name`.
    pub fn populate(&self, name: &str, start: usize, end: usize) {
        if let Ok(f) = self.file(name) {
            f.populate(name, start, end);
        }
    }

    pub fn read(&self, name: &str) -> Result<HostTensor> {
        self.file(name)?.read(name)
    }
}

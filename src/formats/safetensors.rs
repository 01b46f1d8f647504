//! Safetensors files: a little-endian u64 header length, a JSON header naming every tensor's
//! dtype, shape and byte range, then the data. Reading checks every header entry before any
//! tensor is used; writing is atomic (temp file, fsync, rename).

use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Headers larger than this are refused (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

pub fn dtype_from_name(name: &str) -> Option<ElementType> {
    Some(match name {
        "BOOL" => ElementType::Pred,
        "I8" => ElementType::S8,
        "I32" => ElementType::S32,
        "I64" => ElementType::S64,
        "U8" => ElementType::U8,
        "U16" => ElementType::U16,
        "U32" => ElementType::U32,
        "U64" => ElementType::U64,
        "F16" => ElementType::F16,
        "BF16" => ElementType::BF16,
        "F32" => ElementType::F32,
        "F64" => ElementType::F64,
        _ => return None,
    })
}

pub fn dtype_name(ty: ElementType) -> &'static str {
    match ty {
        ElementType::Pred => "BOOL",
        ElementType::S8 => "I8",
        ElementType::S32 => "I32",
        ElementType::S64 => "I64",
        ElementType::U8 => "U8",
        ElementType::U16 => "U16",
        ElementType::U32 => "U32",
        ElementType::U64 => "U64",
        ElementType::F16 => "F16",
        ElementType::BF16 => "BF16",
        ElementType::F32 => "F32",
        ElementType::F64 => "F64",
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

/// An open safetensors file with a checked header.
pub struct SafeTensors {
    pub path: PathBuf,
    file: File,
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
        let mut len = [0u8; 8];
        file.read_exact_at(&mut len, 0)?;
        let header_len = u64::from_le_bytes(len);
        if header_len > MAX_HEADER || 8 + header_len > size {
            return Err(fail(format!(
                "header length {header_len} does not fit in the {size}-byte file (truncated or not safetensors)"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8)?;
        let json: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| fail(format!("header is not valid JSON ({e})")))?;
        let obj = json
            .as_object()
            .ok_or_else(|| fail("header is not a JSON object".into()))?;
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, entry) in obj {
            if name == "__metadata__" {
                if let Some(m) = entry.as_object() {
                    for (k, v) in m {
                        metadata.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                    }
                }
                continue;
            }
            let bad = |what: &str| fail(format!("tensor `{name}`: {what}"));
            let dtype_s = entry
                .get("dtype")
                .and_then(|d| d.as_str())
                .ok_or_else(|| bad("no dtype"))?;
            let dtype = dtype_from_name(dtype_s)
                .ok_or_else(|| bad(&format!("unsupported dtype {dtype_s}")))?;
            let shape: Vec<i64> = entry
                .get("shape")
                .and_then(|s| s.as_array())
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| d.as_i64().filter(|&d| d >= 0))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("shape must be non-negative integers"))?;
            let offsets: Vec<u64> = entry
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .ok_or_else(|| bad("no data_offsets"))?
                .iter()
                .map(|d| d.as_u64())
                .collect::<Option<_>>()
                .ok_or_else(|| bad("data_offsets must be non-negative integers"))?;
            if offsets.len() != 2 || offsets[0] > offsets[1] {
                return Err(bad(&format!("bad data_offsets {offsets:?}")));
            }
            let elements = shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
            let expected = elements.and_then(|n| n.checked_mul(dtype.size_bytes() as u64));
            if expected != Some(offsets[1] - offsets[0]) {
                return Err(bad(&format!(
                    "{dtype_s}{shape:?} needs {} bytes but data_offsets {offsets:?} span {}",
                    expected.map_or("too many".into(), |e| e.to_string()),
                    offsets[1] - offsets[0]
                )));
            }
            if data_start + offsets[1] > size {
                return Err(bad(&format!(
                    "data ends at byte {} but the file has {size} bytes (truncated?)",
                    data_start + offsets[1]
                )));
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    dtype,
                    shape,
                    offset: data_start + offsets[0],
                    len: offsets[1] - offsets[0],
                },
            );
        }
        Ok(SafeTensors {
            path: path.to_path_buf(),
            file,
            tensors,
            metadata,
        })
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .with_context(|| format!("{}: no tensor named `{name}`", self.path.display()))
    }

    pub fn read(&self, name: &str) -> Result<HostTensor> {
        let info = self.info(name)?;
        let mut bytes = vec![0u8; info.len as usize];
        self.file
            .read_exact_at(&mut bytes, info.offset)
            .with_context(|| format!("{}: reading `{name}`", self.path.display()))?;
        Ok(HostTensor {
            ty: info.dtype,
            dims: info.shape.clone(),
            bytes,
        })
    }
}

/// Write tensors (in name order) to `path` atomically: a crash leaves the old file or none.
pub fn write(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata)?);
    }
    let mut offset = 0u64;
    for (name, t) in tensors {
        let end = offset + t.bytes.len() as u64;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype_name(t.ty), "shape": t.dims, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text = serde_json::to_vec(&serde_json::Value::Object(header))?;
    // Pad the header to 8 bytes so tensor data is aligned, as the reference writer does.
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    crate::formats::atomic::write_atomic(path, |f| {
        f.write_all(&(text.len() as u64).to_le_bytes())?;
        f.write_all(&text)?;
        for t in tensors.values() {
            f.write_all(&t.bytes)?;
        }
        Ok(())
    })
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

    pub fn info(&self, name: &str) -> Result<(&TensorInfo, &Path)> {
        let id = self.index.get(name).with_context(|| {
            format!(
                "{}: the checkpoint has no tensor `{name}`",
                self.dir.display()
            )
        })?;
        let f = &self.files[*id];
        Ok((&f.tensors[name], &f.path))
    }

    pub fn read(&self, name: &str) -> Result<HostTensor> {
        let id = self.index.get(name).with_context(|| {
            format!(
                "{}: the checkpoint has no tensor `{name}`",
                self.dir.display()
            )
        })?;
        self.files[*id].read(name)
    }
}

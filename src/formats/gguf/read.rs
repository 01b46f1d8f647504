//! Reading GGUF (llama.cpp's file format), versions 2 and 3: the header, the metadata and the
//! tensor table, checked against the file's length, and each tensor dequantized to f32 on
//! demand (F32/F16/BF16/Q8_0/Q4_0/Q4_1 here, Q5_0/Q5_1 and the K-quants Q2_K..Q6_K in
//! [`super::kquants`]). A file is mapped, not read: a tensor's bytes are paged in when it is
//! dequantized, so reading a model holds about one tensor in f32 at a time.

use super::ggml::{self, ValueType};
use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::path::Path;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

impl Meta {
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Meta::Int(v) => Some(*v),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Meta::Float(v) => Some(*v),
            Meta::Int(v) => Some(*v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Meta::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Meta::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: dims[0] varies fastest (the row length).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Byte offset in the file.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row-major dims as Hugging Face writes them ([out, in] for a weight).
    pub fn hf_dims(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }
}

/// A file's bytes: mapped ([`Gguf::open`]) or held ([`Gguf::parse`]).
enum Bytes {
    Mapped(Mmap),
    Held(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Held(v) => v,
        }
    }
}

pub struct Gguf {
    pub version: u32,
    pub meta: BTreeMap<String, Meta>,
    pub tensors: Vec<TensorInfo>,
    data: Bytes,
}

/// A tensor of a quantization xtrain does not read: the file is valid, its tensor is not ours.
#[derive(Debug)]
struct UnsupportedType {
    tensor: String,
    ggml_type: u32,
}

impl std::fmt::Display for UnsupportedType {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let name =
            ggml::ggml_type(self.ggml_type).map_or("a type this xtrain does not know", |t| t.name);
        let reads = ggml::read_type_names();
        write!(
            f,
            "tensor `{}` is of ggml type {} ({name}), which xtrain does not read (it reads {}); \
             convert the original model again, or requantize with llama.cpp's llama-quantize, \
             to one of those (Q8_0 or Q4_K_M, say)",
            self.tensor,
            self.ggml_type,
            reads.join(", ")
        )
    }
}

impl std::error::Error for UnsupportedType {}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.pos.checked_add(n).is_none_or(|end| end > self.b.len()) {
            bail!(
                "unexpected end of file at byte {} (wanted {n} more bytes)",
                self.pos
            );
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > 1 << 30 {
            bail!("string of {n} bytes at byte {}", self.pos);
        }
        Ok(String::from_utf8_lossy(self.take(n as usize)?).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Meta> {
        let Some(ty) = ValueType::from_id(ty) else {
            bail!("unknown metadata value type {ty}");
        };
        Ok(match ty {
            ValueType::U8 => Meta::Int(self.take(1)?[0] as i64),
            ValueType::I8 => Meta::Int(self.take(1)?[0] as i8 as i64),
            ValueType::U16 => Meta::Int(u16::from_le_bytes(self.take(2)?.try_into()?) as i64),
            ValueType::I16 => Meta::Int(i16::from_le_bytes(self.take(2)?.try_into()?) as i64),
            ValueType::U32 => Meta::Int(self.u32()? as i64),
            ValueType::I32 => Meta::Int(self.u32()? as i32 as i64),
            ValueType::F32 => Meta::Float(f32::from_le_bytes(self.take(4)?.try_into()?) as f64),
            ValueType::Bool => Meta::Bool(self.take(1)?[0] != 0),
            ValueType::Str => Meta::Str(self.string()?),
            ValueType::Array => {
                if depth > 4 {
                    bail!("arrays nested too deeply");
                }
                let inner = self.u32()?;
                let n = self.u64()?;
                if n > (self.b.len() - self.pos) as u64 {
                    bail!("array of {n} elements cannot fit in the file");
                }
                Meta::Array(
                    (0..n)
                        .map(|_| self.value(inner, depth + 1))
                        .collect::<Result<_>>()?,
                )
            }
            ValueType::U64 | ValueType::I64 => Meta::Int(self.u64()? as i64),
            ValueType::F64 => Meta::Float(f64::from_le_bytes(self.take(8)?.try_into()?)),
        })
    }
}

impl Gguf {
    /// Map and parse the file at `path`.
    pub fn open(path: &Path) -> Result<Gguf> {
        if path.is_dir() {
            bail!("{} is a directory, not a GGUF file", path.display());
        }
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        // SAFETY: the map is read-only; xtrain replaces files it writes by renaming new ones
        // over them, so these bytes do not change under us (another program truncating the
        // file meanwhile would fault, as for any mapped file).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        Gguf::parse_bytes(Bytes::Mapped(map)).map_err(|e| {
            let what = if e.is::<UnsupportedType>() {
                path.display().to_string()
            } else {
                format!("{} is not a valid GGUF file", path.display())
            };
            e.context(what)
        })
    }

    /// Parse a whole file held in memory.
    pub fn parse(data: Vec<u8>) -> Result<Gguf> {
        Gguf::parse_bytes(Bytes::Held(data))
    }

    fn parse_bytes(data: Bytes) -> Result<Gguf> {
        let mut c = Cursor { b: &data, pos: 0 };
        if c.take(4)? != b"GGUF" {
            bail!("bad magic (not GGUF)");
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not supported (2 or 3)");
        }
        let n_tensors = c.u64()?;
        let n_meta = c.u64()?;
        if n_tensors > 1 << 20 || n_meta > 1 << 20 {
            bail!("implausible counts: {n_tensors} tensors, {n_meta} metadata entries");
        }
        let mut meta = BTreeMap::new();
        for _ in 0..n_meta {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c
                .value(ty, 0)
                .with_context(|| format!("metadata `{key}`"))?;
            meta.insert(key, v);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()?;
            if nd > 4 {
                bail!("tensor `{name}` has {nd} dims");
            }
            let dims = (0..nd).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let ggml_type = c.u32()?;
            let offset = c.u64()?;
            infos.push((name, dims, ggml_type, offset));
        }
        let align = meta
            .get(ggml::key::ALIGNMENT)
            .and_then(|m| m.as_i64())
            .unwrap_or(32);
        if !(1..=1 << 20).contains(&align) || (align & (align - 1)) != 0 {
            bail!("general.alignment = {align} is not a power of two up to 1 MiB");
        }
        let align = align as usize;
        let start = c.pos.div_ceil(align) * align;
        let mut tensors = Vec::new();
        for (name, dims, ggml_type, offset) in infos {
            let offset = (start as u64)
                .checked_add(offset)
                .with_context(|| format!("tensor `{name}`: offset overflows"))?;
            let info = TensorInfo {
                name: name.clone(),
                dims,
                ggml_type,
                offset,
            };
            let Some(ggml::Layout { block, bytes }) = ggml::layout(ggml_type) else {
                return Err(UnsupportedType {
                    tensor: name,
                    ggml_type,
                }
                .into());
            };
            let n = info
                .dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .context("tensor size overflows")?;
            if n % block != 0 {
                bail!("tensor `{name}`: {n} elements is not a multiple of the block size {block}");
            }
            let end = (n / block)
                .checked_mul(bytes)
                .and_then(|len| info.offset.checked_add(len))
                .context("tensor end overflows")?;
            if end > data.len() as u64 {
                bail!(
                    "tensor `{name}` ends at byte {end} but the file has {} bytes (truncated?)",
                    data.len()
                );
            }
            tensors.push(info);
        }
        Ok(Gguf {
            version,
            meta,
            tensors,
            data,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Dequantize a tensor to f32 values in row-major (HF) order.
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        let ggml::Layout { block, bytes } =
            ggml::layout(t.ggml_type).context("unsupported type")?;
        let n = t.elements() as usize;
        let raw = &self.data[t.offset as usize..(t.offset + t.elements() / block * bytes) as usize];
        let h = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
        let mut out = Vec::with_capacity(n);
        match t.ggml_type {
            ggml::F32 => out.extend(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap())),
            ),
            ggml::F16 => out.extend(raw.chunks_exact(2).map(h)),
            ggml::BF16 => out.extend(
                raw.chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            ggml::Q4_0 => {
                for blk in raw.chunks_exact(18) {
                    let d = h(&blk[0..2]);
                    let qs = &blk[2..18];
                    out.extend(qs.iter().map(|q| ((q & 0xF) as i32 - 8) as f32 * d));
                    out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
                }
            }
            ggml::Q4_1 => {
                for blk in raw.chunks_exact(20) {
                    let (d, m) = (h(&blk[0..2]), h(&blk[2..4]));
                    let qs = &blk[4..20];
                    out.extend(qs.iter().map(|q| (q & 0xF) as f32 * d + m));
                    out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
                }
            }
            ggml::Q8_0 => {
                for blk in raw.chunks_exact(34) {
                    let d = h(&blk[0..2]);
                    out.extend(blk[2..34].iter().map(|&q| q as i8 as f32 * d));
                }
            }
            other => super::kquants::dequantize(other, raw, &mut out),
        }
        Ok(out)
    }

    /// Metadata `key`, if the file has it.
    pub fn get(&self, key: &str) -> Option<&Meta> {
        self.meta.get(key)
    }

    /// Metadata `key` as an integer, if it is one.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.get(key).and_then(|m| m.as_i64())
    }

    /// Metadata `key` as a string, if it is one.
    pub fn str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|m| m.as_str())
    }

    /// Metadata `key` as a bool, if it is one.
    pub fn bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(|m| m.as_bool())
    }
}

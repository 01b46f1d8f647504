//! Writing GGUF v3 (llama.cpp's file format): typed metadata, the tensor table, and the tensor
//! data streamed one tensor at a time (the table's offsets are computed from the shapes and
//! types first, so no tensor is held longer than it takes to write it), each encoded as F32,
//! F16, BF16 or Q8_0 the way llama.cpp's own converter encodes them.
//!
//! The layout: `GGUF`, version 3, the tensor count and metadata count (u64); each metadata entry
//! as a string key, a u32 value type and the value; each tensor as its name, dimension count,
//! dims fastest-varying first (a Hugging Face `[out, in]` weight is `[in, out]`), ggml type and
//! the offset of its data from the start of the data section; padding to `general.alignment`
//! (32); then the data, each tensor starting at a multiple of the alignment. The numbers are
//! [`super::ggml`]'s.

use super::ggml::{self, ValueType};
use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use std::io::Write;

/// The alignment of the data section and of each tensor in it (llama.cpp's default; written as
/// `general.alignment`).
pub const ALIGNMENT: u64 = 32;

/// A metadata value, typed as llama.cpp reads it (its loader refuses a key of another type).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

/// The tensor types xtrain writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl TensorType {
    pub const ALL: [TensorType; 4] = [
        TensorType::F32,
        TensorType::F16,
        TensorType::BF16,
        TensorType::Q8_0,
    ];

    /// ggml's type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            TensorType::F32 => ggml::F32,
            TensorType::F16 => ggml::F16,
            TensorType::Q8_0 => ggml::Q8_0,
            TensorType::BF16 => ggml::BF16,
        }
    }

    fn ggml(self) -> &'static ggml::GgmlType {
        ggml::ggml_type(self.ggml_id()).expect("a written type is in ggml's table")
    }

    /// ggml's layout of the type.
    pub fn layout(self) -> ggml::Layout {
        self.ggml()
            .layout
            .expect("a written type is one xtrain reads")
    }

    /// The name `--type` takes (ggml's, in lower case).
    pub fn name(self) -> String {
        self.ggml().name.to_ascii_lowercase()
    }

    pub fn parse(s: &str) -> Result<TensorType> {
        let lower = s.to_ascii_lowercase();
        if let Some(t) = TensorType::ALL.into_iter().find(|t| t.name() == lower) {
            return Ok(t);
        }
        let ours = TensorType::ALL.map(|t| t.name()).join(", ");
        // A name of llama.cpp's quantizations (Q4_K_M, IQ4_XS, TQ1_0...): how to get one.
        if ["q", "iq", "tq"].iter().any(|p| lower.starts_with(p)) {
            let upper = s.to_ascii_uppercase();
            bail!(
                "--type {s}: xtrain writes {ours}; for {upper}, export f16 and quantize that \
                 file with llama.cpp's own tool: `llama-quantize model-f16.gguf \
                 model-{lower}.gguf {upper}`"
            );
        }
        bail!("--type {s}: choose {ours}")
    }

    /// `general.file_type` of a file whose matrices are of this type (llama.cpp's
    /// `LLAMA_FTYPE_ALL_F32`, `MOSTLY_F16`, `MOSTLY_Q8_0`, `MOSTLY_BF16`).
    pub fn file_type(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q8_0 => 7,
            TensorType::BF16 => 32,
        }
    }

    /// The bytes of a tensor of `n` values, or None when `row` (the fastest dim) is not a
    /// whole number of blocks.
    pub fn bytes(self, n: u64, row: u64) -> Option<u64> {
        let ggml::Layout { block, bytes } = self.layout();
        row.is_multiple_of(block).then(|| n / block * bytes)
    }
}

/// One tensor of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    /// ggml order: dims[0] varies fastest.
    pub dims: Vec<u64>,
    pub ty: TensorType,
}

impl TensorEntry {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    pub fn byte_len(&self) -> u64 {
        self.ty
            .bytes(self.elements(), self.dims[0])
            .expect("checked when the entry was made")
    }
}

fn put_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn put_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    let ty = |w: &mut dyn Write, t: ValueType| w.write_all(&t.id().to_le_bytes());
    match v {
        Value::U32(x) => {
            ty(w, ValueType::U32)?;
            w.write_all(&x.to_le_bytes())
        }
        Value::I32(x) => {
            ty(w, ValueType::I32)?;
            w.write_all(&x.to_le_bytes())
        }
        Value::F32(x) => {
            ty(w, ValueType::F32)?;
            w.write_all(&x.to_le_bytes())
        }
        Value::Bool(x) => {
            ty(w, ValueType::Bool)?;
            w.write_all(&[*x as u8])
        }
        Value::Str(s) => {
            ty(w, ValueType::Str)?;
            put_str(w, s)
        }
        Value::Strs(list) => {
            ty(w, ValueType::Array)?;
            ty(w, ValueType::Str)?;
            w.write_all(&(list.len() as u64).to_le_bytes())?;
            list.iter().try_for_each(|s| put_str(w, s))
        }
        Value::I32s(list) => {
            ty(w, ValueType::Array)?;
            ty(w, ValueType::I32)?;
            w.write_all(&(list.len() as u64).to_le_bytes())?;
            list.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
        Value::F32s(list) => {
            ty(w, ValueType::Array)?;
            ty(w, ValueType::F32)?;
            w.write_all(&(list.len() as u64).to_le_bytes())?;
            list.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
    }
}

/// Counts the bytes written through it, for the padding.
struct Counted<W> {
    w: W,
    n: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.w.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

impl<W: Write> Counted<W> {
    fn pad(&mut self) -> std::io::Result<()> {
        let pad = self.n.next_multiple_of(ALIGNMENT) - self.n;
        self.write_all(&vec![0u8; pad as usize])
    }
}

/// Write a whole GGUF file to `w`: the metadata, the table of `tensors`, then each tensor's
/// bytes as `data(i)` returns them (in table order, one at a time). `general.alignment` is added
/// to the metadata. A tensor whose bytes are not as long as its table entry says is an error
/// naming it.
pub fn write_gguf(
    w: impl Write,
    meta: &[(String, Value)],
    tensors: &[TensorEntry],
    mut data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let mut w = Counted { w, n: 0 };
    let io = |e: std::io::Error| anyhow::Error::from(e);
    w.write_all(b"GGUF").map_err(io)?;
    w.write_all(&3u32.to_le_bytes()).map_err(io)?;
    w.write_all(&(tensors.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&(meta.len() as u64 + 1).to_le_bytes())
        .map_err(io)?;
    put_str(&mut w, ggml::key::ALIGNMENT).map_err(io)?;
    put_value(&mut w, &Value::U32(ALIGNMENT as u32)).map_err(io)?;
    for (k, v) in meta {
        put_str(&mut w, k).map_err(io)?;
        put_value(&mut w, v).map_err(io)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut w, &t.name).map_err(io)?;
        w.write_all(&(t.dims.len() as u32).to_le_bytes())
            .map_err(io)?;
        for d in &t.dims {
            w.write_all(&d.to_le_bytes()).map_err(io)?;
        }
        w.write_all(&t.ty.ggml_id().to_le_bytes()).map_err(io)?;
        w.write_all(&offset.to_le_bytes()).map_err(io)?;
        offset = (offset + t.byte_len()).next_multiple_of(ALIGNMENT);
    }
    w.pad().map_err(io)?;
    for (i, t) in tensors.iter().enumerate() {
        let bytes = data(i).with_context(|| format!("tensor `{}`", t.name))?;
        if bytes.len() as u64 != t.byte_len() {
            bail!(
                "tensor `{}`: {} bytes of data where its {} shape {:?} takes {}",
                t.name,
                bytes.len(),
                t.ty.name(),
                t.dims,
                t.byte_len()
            );
        }
        w.write_all(&bytes).map_err(io)?;
        w.pad().map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(())
}

/// Encode f32 values (a whole number of rows) as `ty`: F16 and BF16 rounded to nearest even,
/// Q8_0 as ggml's reference quantizer does it (per block of 32: d = absmax / 127 stored as f16,
/// each value round(x / d) half away from zero as an i8).
pub fn encode(values: &[f32], ty: TensorType) -> Vec<u8> {
    match ty {
        TensorType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        TensorType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        TensorType::BF16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        TensorType::Q8_0 => {
            let mut out = Vec::with_capacity(values.len() / 32 * 34);
            for block in values.chunks(32) {
                let amax = block.iter().fold(0f32, |m, &x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_file_reads_back_with_the_importers_reader() {
        let meta = vec![
            (
                "general.architecture".to_string(),
                Value::Str("llama".into()),
            ),
            ("llama.block_count".to_string(), Value::U32(2)),
            ("x.f".to_string(), Value::F32(0.5)),
            (
                "x.toks".to_string(),
                Value::Strs(vec!["a".into(), "bc".into()]),
            ),
            ("x.types".to_string(), Value::I32s(vec![1, 3])),
        ];
        let values: Vec<f32> = (0..64).map(|i| i as f32 / 7.0 - 4.0).collect();
        let tensors = vec![
            TensorEntry {
                name: "a".into(),
                dims: vec![3],
                ty: TensorType::F32,
            },
            TensorEntry {
                name: "b".into(),
                dims: vec![32, 2],
                ty: TensorType::Q8_0,
            },
            TensorEntry {
                name: "c".into(),
                dims: vec![32, 2],
                ty: TensorType::F16,
            },
        ];
        let mut file = Vec::new();
        write_gguf(&mut file, &meta, &tensors, |i| {
            Ok(match i {
                0 => encode(&[1.0, 2.0, 3.0], TensorType::F32),
                1 => encode(&values, TensorType::Q8_0),
                _ => encode(&values, TensorType::F16),
            })
        })
        .unwrap();
        let g = crate::formats::gguf::read::Gguf::parse(file).unwrap();
        assert_eq!(g.meta["llama.block_count"].as_i64(), Some(2));
        assert_eq!(g.meta["x.f"].as_f64(), Some(0.5));
        let a = g.dequantize(g.tensor("a").unwrap()).unwrap();
        assert_eq!(a, vec![1.0, 2.0, 3.0]);
        let b = g.dequantize(g.tensor("b").unwrap()).unwrap();
        for (blk, (x, y)) in values.chunks(32).zip(b.chunks(32)).enumerate() {
            let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (p, q) in x.iter().zip(y) {
                // Half a step, plus the f16 rounding of the step times 127.
                assert!(
                    (p - q).abs() <= 0.5 * step + 127.0 * step / 1024.0,
                    "{blk}: {p} {q}"
                );
            }
        }
        let c = g.dequantize(g.tensor("c").unwrap()).unwrap();
        for (p, q) in values.iter().zip(&c) {
            assert_eq!(*q, f16::from_f32(*p).to_f32());
        }
    }

    #[test]
    fn a_wrong_length_of_data_is_refused_naming_the_tensor() {
        let tensors = vec![TensorEntry {
            name: "w".into(),
            dims: vec![4],
            ty: TensorType::F32,
        }];
        let e = write_gguf(Vec::new(), &[], &tensors, |_| Ok(vec![0; 8])).unwrap_err();
        assert!(format!("{e:#}").contains("tensor `w`"), "{e:#}");
    }
}

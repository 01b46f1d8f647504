//! Host tensors (`pjrt::HostTensor`) in the forms files and programs want: element types
//! converted (floats rounded to nearest even, integers range-checked), per-layer tensors stacked
//! along a leading layer axis and split again, and named tensors put in a program's argument
//! layout (`layers.*` names assembled from their layers) and back.

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use hlo::DType;
use pjrt::{ElementType, HostTensor};
use std::collections::BTreeMap;

pub fn element_type(d: DType) -> ElementType {
    match d {
        DType::Pred => ElementType::Pred,
        DType::S8 => ElementType::S8,
        DType::S32 => ElementType::S32,
        DType::S64 => ElementType::S64,
        DType::U8 => ElementType::U8,
        DType::U16 => ElementType::U16,
        DType::U32 => ElementType::U32,
        DType::U64 => ElementType::U64,
        DType::F16 => ElementType::F16,
        DType::BF16 => ElementType::BF16,
        DType::F32 => ElementType::F32,
        DType::F64 => ElementType::F64,
    }
}

/// Convert a host tensor's element type: between float types (rounding to nearest even), and
/// from any integer type to s32 (checking the range).
pub fn convert(t: &HostTensor, to: ElementType) -> Result<HostTensor> {
    if t.ty == to {
        return Ok(t.clone());
    }
    let floats = |v: Vec<f32>| -> HostTensor {
        match to {
            ElementType::F32 => HostTensor::from_f32(&v, &t.dims),
            ElementType::BF16 => HostTensor::from_bf16(
                &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
                &t.dims,
            ),
            ElementType::F16 => HostTensor::from_f16(
                &v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
                &t.dims,
            ),
            _ => unreachable!(),
        }
    };
    match (t.ty, to) {
        (
            ElementType::F32 | ElementType::BF16 | ElementType::F16,
            ElementType::F32 | ElementType::BF16 | ElementType::F16,
        ) => Ok(floats(t.to_f32_lossy()?)),
        (ElementType::F64, ElementType::F32) => {
            Ok(floats(t.to_f64()?.iter().map(|&x| x as f32).collect()))
        }
        (ElementType::S64, ElementType::S32) => {
            let v = t.to_i64()?;
            let out: Vec<i32> = v
                .iter()
                .map(|&x| {
                    i32::try_from(x)
                        .map_err(|_| anyhow::anyhow!("value {x} does not fit in 32 bits"))
                })
                .collect::<Result<_>>()?;
            Ok(HostTensor::from_i32(&out, &t.dims))
        }
        (ElementType::U8 | ElementType::S8 | ElementType::U32, ElementType::S32) => {
            let v: Vec<i32> = match t.ty {
                ElementType::U8 => t.to_u8()?.iter().map(|&x| x as i32).collect(),
                ElementType::S8 => t.to_i8()?.iter().map(|&x| x as i32).collect(),
                _ => t.to_u32()?.iter().map(|&x| x as i32).collect(),
            };
            Ok(HostTensor::from_i32(&v, &t.dims))
        }
        (from, to) => bail!("cannot convert {from:?} to {to:?}"),
    }
}

/// Stack tensors of one type and shape along a new leading axis.
pub fn stack(parts: &[HostTensor]) -> Result<HostTensor> {
    let first = parts.first().context("nothing to stack")?;
    let mut bytes = Vec::with_capacity(first.bytes.len() * parts.len());
    for p in parts {
        if p.ty != first.ty || p.dims != first.dims {
            bail!(
                "cannot stack {:?}{:?} with {:?}{:?}",
                p.ty,
                p.dims,
                first.ty,
                first.dims
            );
        }
        bytes.extend_from_slice(&p.bytes);
    }
    let mut dims = vec![parts.len() as i64];
    dims.extend_from_slice(&first.dims);
    Ok(HostTensor {
        ty: first.ty,
        dims,
        bytes,
    })
}

/// Split a tensor along its leading axis.
pub fn unstack(t: &HostTensor) -> Vec<HostTensor> {
    let n = t.dims[0] as usize;
    let chunk = t.bytes.len() / n.max(1);
    t.bytes
        .chunks(chunk.max(1))
        .take(n)
        .map(|c| HostTensor {
            ty: t.ty,
            dims: t.dims[1..].to_vec(),
            bytes: c.to_vec(),
        })
        .collect()
}

/// Per-layer tensors (PEFT/HF names with `layers.N.`) in the layout a program takes: stacked
/// names (`layers.*.`) are assembled from their layers; `prefix` is prepended to the lookups
/// (e.g. "exp_avg."). `layers` is the number of layers.
pub fn to_program_layout(
    names: &[(String, Vec<i64>)],
    per_layer: &BTreeMap<String, HostTensor>,
    layers: i64,
) -> Result<Vec<HostTensor>> {
    names
        .iter()
        .map(|(name, shape)| {
            let t = if name.contains("layers.*.") {
                let parts: Vec<HostTensor> = (0..layers)
                    .map(|l| {
                        let n = crate::model::tensors::layer_name(name, l);
                        per_layer
                            .get(&n)
                            .cloned()
                            .with_context(|| format!("missing tensor `{n}`"))
                    })
                    .collect::<Result<_>>()?;
                stack(&parts)?
            } else {
                per_layer
                    .get(name)
                    .cloned()
                    .with_context(|| format!("missing tensor `{name}`"))?
            };
            if &t.dims != shape {
                bail!("`{name}` is {:?}, the program needs {shape:?}", t.dims);
            }
            Ok(t)
        })
        .collect()
}

/// The inverse of [`to_program_layout`]: program-layout tensors back to per-layer names.
pub fn from_program_layout(named: Vec<(String, HostTensor)>) -> BTreeMap<String, HostTensor> {
    let mut out = BTreeMap::new();
    for (name, t) in named {
        if name.contains("layers.*.") {
            for (l, part) in unstack(&t).into_iter().enumerate() {
                out.insert(crate::model::tensors::layer_name(&name, l as i64), part);
            }
        } else {
            out.insert(name, t);
        }
    }
    out
}

/// Elements of `from` (little-endian bytes `src`) widened to `to` and appended to `out`, where
/// that is exact and needs no intermediate tensor: bf16 or f16 to f32. False (nothing appended)
/// for any other pair, which [`convert`] does.
pub fn widen_into(src: &[u8], from: ElementType, to: ElementType, out: &mut Vec<u8>) -> bool {
    let widen: fn([u8; 2]) -> f32 = match (from, to) {
        (ElementType::BF16, ElementType::F32) => {
            |b| f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
        }
        (ElementType::F16, ElementType::F32) => |b| f16::from_bits(u16::from_le_bytes(b)).to_f32(),
        _ => return false,
    };
    out.reserve(src.len() * 2);
    out.extend(
        src.chunks_exact(2)
            .flat_map(|v| widen([v[0], v[1]]).to_le_bytes()),
    );
    true
}

/// The box (`starts`, `sizes`) of a row-major tensor of type `ty` and shape `dims` whose bytes
/// are `src`, as a tensor of shape `sizes`: one device's shard, read straight out of a mapped
/// file.
pub fn slice_bytes(
    src: &[u8],
    ty: ElementType,
    dims: &[i64],
    starts: &[i64],
    sizes: &[i64],
) -> HostTensor {
    let n: i64 = sizes.iter().product();
    let mut bytes = Vec::with_capacity(n as usize * ty.size_bytes());
    slice_bytes_into(src, ty, dims, starts, sizes, &mut bytes);
    HostTensor {
        ty,
        dims: sizes.to_vec(),
        bytes,
    }
}

/// [`slice_bytes`] appended to `out` (a stacked tensor assembled layer by layer in one buffer).
pub fn slice_bytes_into(
    src: &[u8],
    ty: ElementType,
    dims: &[i64],
    starts: &[i64],
    sizes: &[i64],
    out: &mut Vec<u8>,
) {
    let es = ty.size_bytes();
    let r = dims.len();
    let mut k = r;
    while k > 0 && sizes[k - 1] == dims[k - 1] && starts[k - 1] == 0 {
        k -= 1;
    }
    let n: i64 = sizes.iter().product();
    if k == 0 {
        out.extend_from_slice(&src[..n as usize * es]);
        return;
    }
    let inner: i64 = dims[k..].iter().product();
    let run = (sizes[k - 1] * inner) as usize * es;
    let mut strides = vec![1i64; r];
    for i in (0..r.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let outer: i64 = sizes[..k - 1].iter().product();
    let mut idx = vec![0i64; k - 1];
    for _ in 0..outer {
        let mut off = starts[k - 1] * strides[k - 1];
        for d in 0..k - 1 {
            off += (starts[d] + idx[d]) * strides[d];
        }
        let off = off as usize * es;
        out.extend_from_slice(&src[off..off + run]);
        for d in (0..k - 1).rev() {
            idx[d] += 1;
            if idx[d] < sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every box of a 3-d tensor equals the elements picked one by one.
    #[test]
    fn slice_bytes_takes_the_box() {
        let dims = [3i64, 4, 5];
        let t = HostTensor::from_f32(&(0..60).map(|v| v as f32).collect::<Vec<_>>(), &dims);
        for (starts, sizes) in [
            ([0i64, 0, 0], [3i64, 4, 5]),
            ([1, 0, 0], [2, 4, 5]),
            ([0, 2, 0], [3, 2, 5]),
            ([0, 0, 3], [3, 4, 2]),
            ([2, 1, 1], [1, 3, 3]),
            ([0, 0, 0], [0, 4, 5]),
        ] {
            let got = slice_bytes(&t.bytes, t.ty, &dims, &starts, &sizes);
            let mut want = Vec::new();
            for a in starts[0]..starts[0] + sizes[0] {
                for b in starts[1]..starts[1] + sizes[1] {
                    for c in starts[2]..starts[2] + sizes[2] {
                        want.push((a * 20 + b * 5 + c) as f32);
                    }
                }
            }
            assert_eq!(got.dims, sizes.to_vec());
            assert_eq!(got.to_f32().unwrap(), want, "{starts:?} {sizes:?}");
        }
        let s = HostTensor::from_f32(&[7.0], &[]);
        assert_eq!(slice_bytes(&s.bytes, s.ty, &[], &[], &[]), s);
    }

    /// Widening bf16 and f16 in place gives what `convert` gives, bit for bit.
    #[test]
    fn widening_equals_convert() {
        let values: Vec<f32> = (0..2000)
            .map(|i| ((i as f32) - 1000.0) * 0.37e-3 * (1.0 + (i % 13) as f32).powi(5))
            .chain([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 6e-8, 1e-40])
            .collect();
        let f = HostTensor::from_f32(&values, &[values.len() as i64]);
        for ty in [ElementType::BF16, ElementType::F16] {
            let narrow = convert(&f, ty).unwrap();
            let mut out = Vec::new();
            assert!(widen_into(&narrow.bytes, ty, ElementType::F32, &mut out));
            assert_eq!(
                out,
                convert(&narrow, ElementType::F32).unwrap().bytes,
                "{ty:?}"
            );
        }
        assert!(!widen_into(
            &f.bytes,
            ElementType::F32,
            ElementType::BF16,
            &mut Vec::new()
        ));
    }
}

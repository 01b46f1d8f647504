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

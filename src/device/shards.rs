//! Host tensors cut into the shards each device holds under a sharding, and put back together
//! from them (the host side of a sharded program's arguments and results).

use crate::program::sharding::shard_box;
use anyhow::{bail, Result};
use hlo::{Mesh, Sharding};
use pjrt::HostTensor;

/// Copy the box (starts, sizes) out of a row-major tensor.
pub fn slice(t: &HostTensor, starts: &[i64], sizes: &[i64]) -> HostTensor {
    if sizes == t.dims.as_slice() {
        return t.clone();
    }
    let es = t.ty.size_bytes();
    let n: i64 = sizes.iter().product();
    let mut out = Vec::with_capacity(n as usize * es);
    copy_box(&t.dims, starts, sizes, es, &mut |src, len| {
        out.extend_from_slice(&t.bytes[src..src + len])
    });
    HostTensor {
        ty: t.ty,
        dims: sizes.to_vec(),
        bytes: out,
    }
}

/// Write `part` into the box at `starts` of `full`; an error where it does not fit there (its
/// type, rank, extent or bytes), as a shard from another process might not.
pub fn place(full: &mut HostTensor, part: &HostTensor, starts: &[i64]) -> Result<()> {
    let fits = part.ty == full.ty
        && part.dims.len() == full.dims.len()
        && starts.len() == full.dims.len()
        && (0..full.dims.len()).all(|k| {
            starts[k] >= 0 && part.dims[k] >= 0 && starts[k] + part.dims[k] <= full.dims[k]
        })
        && part.bytes.len() as i64
            == part.dims.iter().product::<i64>() * part.ty.size_bytes() as i64;
    if !fits {
        bail!(
            "a shard {:?}{:?} ({} bytes) does not fit at {starts:?} of a {:?}{:?} tensor",
            part.ty,
            part.dims,
            part.bytes.len(),
            full.ty,
            full.dims
        );
    }
    let es = full.ty.size_bytes();
    let mut offset = 0;
    let dims = full.dims.clone();
    let bytes = &mut full.bytes;
    copy_box(&dims, starts, &part.dims, es, &mut |dst, len| {
        bytes[dst..dst + len].copy_from_slice(&part.bytes[offset..offset + len]);
        offset += len;
    });
    Ok(())
}

/// Visit the contiguous runs (byte offset in the full tensor, byte length) of a box, in order.
fn copy_box(
    dims: &[i64],
    starts: &[i64],
    sizes: &[i64],
    es: usize,
    f: &mut dyn FnMut(usize, usize),
) {
    let r = dims.len();
    if r == 0 {
        f(0, es);
        return;
    }
    let mut strides = vec![1i64; r];
    for i in (0..r - 1).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let run = sizes[r - 1] as usize * es;
    let rows: i64 = sizes[..r - 1].iter().product();
    let mut idx = vec![0i64; r - 1];
    for _ in 0..rows {
        let mut off = starts[r - 1];
        for k in 0..r - 1 {
            off += (starts[k] + idx[k]) * strides[k];
        }
        f(off as usize * es, run);
        for k in (0..r - 1).rev() {
            idx[k] += 1;
            if idx[k] < sizes[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// Reassemble a tensor from per-partition shards (one per mesh position); each shard is
/// checked against the box its position holds (the first shard's element type, the box's
/// shape) before it is used: an error names the position.
pub fn unshard(
    shards: &[HostTensor],
    dims: &[i64],
    sharding: &Sharding,
    mesh: &Mesh,
) -> Result<HostTensor> {
    let Some(first) = shards.first() else {
        bail!("no shards to put together");
    };
    if first.dims == dims {
        return Ok(first.clone());
    }
    let n: i64 = dims.iter().product();
    let mut full = HostTensor {
        ty: first.ty,
        dims: dims.to_vec(),
        bytes: vec![0; n as usize * first.ty.size_bytes()],
    };
    for (p, s) in shards.iter().enumerate() {
        let (starts, sizes) = shard_box(dims, sharding, mesh, p);
        if s.ty != first.ty || s.dims != sizes {
            bail!(
                "mesh position {p}'s shard is {:?}{:?}, but the position holds {:?}{sizes:?}",
                s.ty,
                s.dims,
                first.ty
            );
        }
        place(&mut full, s, &starts)?;
    }
    Ok(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::sharding::parse_mesh;

    #[test]
    fn slices_and_places_round_trip() {
        let t = HostTensor::from_f32(&(0..24).map(|v| v as f32).collect::<Vec<_>>(), &[2, 3, 4]);
        let mesh = parse_mesh("a=2,b=2").unwrap();
        let sh = Sharding {
            dims: vec![vec![], vec![], vec!["a".into(), "b".into()]],
        };
        let shards: Vec<HostTensor> = (0..4)
            .map(|p| {
                let (s, z) = shard_box(&t.dims, &sh, &mesh, p);
                slice(&t, &s, &z)
            })
            .collect();
        assert_eq!(shards[1].dims, vec![2, 3, 1]);
        assert_eq!(
            shards[1].to_f32().unwrap(),
            vec![1.0, 5.0, 9.0, 13.0, 17.0, 21.0]
        );
        assert_eq!(unshard(&shards, &t.dims, &sh, &mesh).unwrap(), t);
    }

    /// A shard of the wrong shape (self-consistent: its bytes match its dims) or type is
    /// refused naming its position, never written out of bounds.
    #[test]
    fn a_shard_that_does_not_fit_its_box_is_refused() {
        let t = HostTensor::from_f32(&(0..8).map(|v| v as f32).collect::<Vec<_>>(), &[2, 4]);
        let mesh = parse_mesh("a=2").unwrap();
        let sh = Sharding {
            dims: vec![vec![], vec!["a".into()]],
        };
        let good: Vec<HostTensor> = (0..2)
            .map(|p| {
                let (s, z) = shard_box(&t.dims, &sh, &mesh, p);
                slice(&t, &s, &z)
            })
            .collect();
        let mut wide = good.clone();
        wide[1] = HostTensor::from_f32(&[0.0; 6], &[2, 3]);
        let e = unshard(&wide, &t.dims, &sh, &mesh).unwrap_err().to_string();
        assert!(e.contains("mesh position 1's shard is F32[2, 3]"), "{e}");
        let mut typed = good.clone();
        typed[1] = HostTensor::from_i32(&[0; 4], &[2, 2]);
        assert!(unshard(&typed, &t.dims, &sh, &mesh).is_err());
        let mut full = t.clone();
        let e = place(&mut full, &wide[1], &[0, 2]).unwrap_err().to_string();
        assert!(e.contains("does not fit at [0, 2]"), "{e}");
    }
}

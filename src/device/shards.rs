//! Host tensors cut into the shards each device holds under a sharding, and put back together
//! from them (the host side of a sharded program's arguments and results).

use crate::program::sharding::shard_box;
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

/// Write `part` into the box at `starts` of `full`.
pub fn place(full: &mut HostTensor, part: &HostTensor, starts: &[i64]) {
    let es = full.ty.size_bytes();
    let mut offset = 0;
    let dims = full.dims.clone();
    let bytes = &mut full.bytes;
    copy_box(&dims, starts, &part.dims, es, &mut |dst, len| {
        bytes[dst..dst + len].copy_from_slice(&part.bytes[offset..offset + len]);
        offset += len;
    });
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

/// Reassemble a tensor from per-partition shards.
pub fn unshard(
    shards: &[HostTensor],
    dims: &[i64],
    sharding: &Sharding,
    mesh: &Mesh,
) -> HostTensor {
    let first = &shards[0];
    if first.dims == dims {
        return first.clone();
    }
    let n: i64 = dims.iter().product();
    let mut full = HostTensor {
        ty: first.ty,
        dims: dims.to_vec(),
        bytes: vec![0; n as usize * first.ty.size_bytes()],
    };
    for (p, s) in shards.iter().enumerate() {
        let (starts, _) = shard_box(dims, sharding, mesh, p);
        place(&mut full, s, &starts);
    }
    full
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
        assert_eq!(unshard(&shards, &t.dims, &sh, &mesh), t);
    }
}

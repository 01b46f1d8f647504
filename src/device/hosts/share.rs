//! Each host's share of a step, from the step's sharding: which devices a host holds, which
//! rows of a batch they need, and a batch tensor uploaded as separate hosts would upload it
//! (each host its own rows, each of its devices its box within them). `xtrain train
//! --virtual-hosts P` (a test mode) splits one process's devices into P such hosts; the frozen
//! weights are read the same way by `device::trainer`, one reader per host, each asked only for
//! its own devices' boxes.

use crate::device::runtime::Runtime;
use crate::program::sharding::shard_box;
use anyhow::{bail, Result};
use pjrt::{Buffer, HostTensor};

/// The rows (dim 0: `start, count`) of a tensor of `dims` that `devices` hold under `sharding`:
/// the rows one host's loader must produce. Its devices' rows form one range (whole batch rows
/// are never split across hosts by a contiguous device split of the mesh); where they would not,
/// the range covering them is taken.
pub fn rows_held(
    dims: &[i64],
    sharding: &hlo::Sharding,
    mesh: &hlo::Mesh,
    devices: &[usize],
) -> (i64, i64) {
    let boxes = devices.iter().map(|&p| shard_box(dims, sharding, mesh, p));
    let (lo, hi) = boxes.fold((i64::MAX, i64::MIN), |(lo, hi), (s, z)| {
        (lo.min(s[0]), hi.max(s[0] + z[0]))
    });
    (lo, hi - lo)
}

/// Upload a batch tensor as the hosts `groups` (this process's, each with its mesh positions)
/// would, each from its own loader's batch (`tensors`: one per host, or one that every host
/// loaded alike; each the whole batch, as every host's loader yields it in the same order):
/// host `g` keeps only the rows its devices hold, and each of its devices gets its box cut from
/// those rows. The result is one buffer per position this process holds, in [`Runtime::held`]
/// order: its hosts' argument lists, joined for one execute.
pub fn upload_by_host(
    rt: &Runtime,
    tensors: &[&HostTensor],
    sharding: &hlo::Sharding,
    mesh: &hlo::Mesh,
    groups: &[Vec<usize>],
) -> Result<Vec<Buffer>> {
    if tensors.len() != 1 && tensors.len() != groups.len() {
        bail!(
            "{} loaders' batches for {} hosts in this process",
            tensors.len(),
            groups.len()
        );
    }
    let held = rt.held(mesh.device_count() as usize);
    let mut per_slot: Vec<Option<Buffer>> = held.iter().map(|_| None).collect();
    for (g, devices) in groups.iter().enumerate() {
        let t = tensors[g.min(tensors.len() - 1)];
        let (first, count) = if t.dims.is_empty() {
            (0, 0)
        } else {
            rows_held(&t.dims, sharding, mesh, devices)
        };
        // The host's own rows: all it has of this batch.
        let mine = if t.dims.is_empty() {
            t.clone()
        } else {
            let mut starts = vec![0; t.dims.len()];
            let mut sizes = t.dims.clone();
            starts[0] = first;
            sizes[0] = count;
            crate::device::shards::slice(t, &starts, &sizes)
        };
        for &p in devices {
            let (mut starts, sizes) = shard_box(&t.dims, sharding, mesh, p);
            if let Some(s) = starts.first_mut() {
                *s -= first;
            }
            let shard = crate::device::shards::slice(&mine, &starts, &sizes);
            if let Some(k) = held.iter().position(|q| *q == p) {
                per_slot[k] = Some(rt.upload_to(&shard, p, None)?);
            }
        }
    }
    per_slot
        .into_iter()
        .zip(&held)
        .map(|(b, p)| match b {
            Some(b) => Ok(b),
            None => bail!("mesh position {p} belongs to none of this process's hosts"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(mesh: &str) -> crate::program::MeshPlan {
        crate::program::MeshPlan {
            axes: crate::program::sharding::parse_mesh(mesh).unwrap().axes,
            rules: Default::default(),
        }
    }

    #[test]
    fn a_host_loads_only_the_rows_its_devices_hold() {
        let fsdp = plan("fsdp=4");
        let rows = fsdp.sharding("input_ids", &[8, 16]);
        assert_eq!(rows_held(&[8, 16], &rows, &fsdp.mesh(), &[0, 1]), (0, 4));
        assert_eq!(rows_held(&[8, 16], &rows, &fsdp.mesh(), &[2, 3]), (4, 4));
        // Tensor parallelism replicates the batch over its axis: both hosts need every row.
        let tensor = plan("tensor=4");
        let rows = tensor.sharding("input_ids", &[8, 16]);
        assert_eq!(rows_held(&[8, 16], &rows, &tensor.mesh(), &[2, 3]), (0, 8));
    }
}

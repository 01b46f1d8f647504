//! Where a step's mesh lies: which device each mesh position is (the compile's device
//! assignment, by global device id), which positions each host holds, and which hosts this
//! process runs; and the run's mode as one value ([`Hosts`]): one process alone runs every
//! position; `--virtual-hosts P` runs P hosts in one process (the stand-in for a run of
//! several); a process of a run of several runs its own host. The runtime uploads, compiles and
//! executes through this alone, and the trainer reads results whole through it, so the same
//! code serves all three.

use crate::cluster::gather::{Gather, StoreGather, VirtualHosts};
use anyhow::{bail, Context, Result};
use pjrt::HostTensor;
use std::time::Duration;

/// How this process runs the step's mesh: the run's mode, decided as the plugin opens
/// (`train::hosts::open`) and matched wherever the modes differ.
pub enum Hosts {
    /// One process, one host: every mesh position is here, device `p` at position `p`.
    One,
    /// `--virtual-hosts P`: this process runs P hosts, which hand their shards of a result to
    /// host 0 through a store of their own on loopback, as separate hosts would.
    Virtual {
        placement: DeviceMap,
        gather: VirtualHosts,
    },
    /// One process of a run of several: its own host's positions; the shards the others hold
    /// reach process 0 through the run's store.
    Processes {
        placement: DeviceMap,
        gather: StoreGather,
    },
}

impl Hosts {
    /// `--virtual-hosts hosts` over the devices `ids` (in mesh order), with a store of their
    /// own on loopback that waits `timeout` for a host's shards.
    pub fn virtual_hosts(ids: Vec<i64>, hosts: usize, timeout: Duration) -> Result<Hosts> {
        let placement = DeviceMap::in_one_process(ids, hosts)?;
        let gather = VirtualHosts::start(&placement.hosts, timeout)?;
        Ok(Hosts::Virtual { placement, gather })
    }

    /// Where the mesh positions lie, when they are split into hosts.
    pub fn placement(&self) -> Option<&DeviceMap> {
        match self {
            Hosts::One => None,
            Hosts::Virtual { placement, .. } | Hosts::Processes { placement, .. } => {
                Some(placement)
            }
        }
    }

    /// The mesh positions (of a step over `devices`) this process holds, in the order of its
    /// argument lists.
    pub fn held(&self, devices: usize) -> Vec<usize> {
        match self.placement() {
            Some(p) => p.held(),
            None => (0..devices).collect(),
        }
    }

    /// Which of this process's devices mesh position `p` is.
    pub fn slot(&self, p: usize) -> Result<usize> {
        match self.placement() {
            None => Ok(p),
            Some(placed) => placed.slot(p).with_context(|| {
                format!("mesh position {p} is held by another process of the run")
            }),
        }
    }

    /// The hosts this process runs, each with its positions (none for one host: every position
    /// is its one host's).
    pub fn local_hosts(&self) -> Vec<Vec<usize>> {
        self.placement()
            .map(|p| p.local_hosts())
            .unwrap_or_default()
    }

    /// Whether this process holds every mesh position (what it compiles is the whole step's,
    /// and may be cached).
    pub fn holds_all(&self) -> bool {
        match self {
            Hosts::One | Hosts::Virtual { .. } => true,
            Hosts::Processes { placement, .. } => placement.holds_all(),
        }
    }

    /// Every mesh position's shard of a result from this process's (`mine`, one per position it
    /// holds, in [`Hosts::held`] order): its own with one host; gathered on host 0 (process 0)
    /// otherwise, None on the other processes, which write nothing. What another process sent
    /// is checked against the box its position holds where it is put together
    /// (`device::shards::unshard`).
    pub fn whole(&self, mine: Vec<HostTensor>) -> Result<Option<Vec<HostTensor>>> {
        let (placement, gather): (&DeviceMap, &dyn Gather) = match self {
            Hosts::One => return Ok(Some(mine)),
            Hosts::Virtual { placement, gather } => (placement, gather),
            Hosts::Processes { placement, gather } => (placement, gather),
        };
        gather.all(
            placement.held().into_iter().zip(mine).collect(),
            &placement.hosts,
        )
    }
}

/// The step's devices by mesh position, split into hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap {
    /// The global device id at each mesh position (what the step is compiled for).
    pub ids: Vec<i64>,
    /// Each host's mesh positions, in order (together: every position, once).
    pub hosts: Vec<Vec<usize>>,
    /// The hosts this process runs: every one with `--virtual-hosts`, its own in a run of
    /// several processes.
    pub here: Vec<usize>,
}

impl DeviceMap {
    /// One process with every device (`ids`, in mesh order), as `hosts` hosts of equal size:
    /// host `g` holds positions `g*n .. (g+1)*n`, as each host of a slice holds its own chips.
    /// One host for a plain run; several for `--virtual-hosts`.
    pub fn in_one_process(ids: Vec<i64>, hosts: usize) -> Result<DeviceMap> {
        let groups = device_groups(ids.len(), hosts)?;
        Ok(DeviceMap {
            ids,
            here: (0..groups.len()).collect(),
            hosts: groups,
        })
    }

    /// A run of several processes: `devices` are the client's global devices (id, process
    /// index), in the plugin's order; `me` is this process's index. Mesh positions go to the
    /// processes in order of their index (each process's devices in the plugin's order), so
    /// that each host holds a contiguous run of positions whatever its devices' ids are (TPU
    /// ids are not contiguous per host). The step must span every device, the same number on
    /// every process.
    pub fn of_processes(
        devices: &[(i64, usize)],
        partitions: usize,
        me: usize,
    ) -> Result<DeviceMap> {
        if devices.len() != partitions {
            bail!(
                "the step is compiled for {partitions} devices, but the run's processes have {} \
                 together: a step across processes runs on all of them (a mesh over every host's \
                 devices)",
                devices.len()
            );
        }
        let mut processes: Vec<usize> = devices.iter().map(|d| d.1).collect();
        processes.sort_unstable();
        processes.dedup();
        let Some(here) = processes.iter().position(|p| *p == me) else {
            bail!("none of the run's {partitions} devices belongs to this process ({me})");
        };
        let mut ids = Vec::with_capacity(partitions);
        let mut hosts = Vec::with_capacity(processes.len());
        for p in &processes {
            let first = ids.len();
            ids.extend(devices.iter().filter(|d| d.1 == *p).map(|d| d.0));
            hosts.push((first..ids.len()).collect::<Vec<usize>>());
        }
        let counts: Vec<usize> = hosts.iter().map(|h| h.len()).collect();
        if counts.iter().any(|c| *c != counts[0]) {
            let each: Vec<String> = processes
                .iter()
                .zip(&counts)
                .map(|(p, c)| format!("process {p}: {c}"))
                .collect();
            bail!(
                "the run's processes hold different numbers of devices ({}): every host must \
                 give the step the same number",
                each.join(", ")
            );
        }
        Ok(DeviceMap {
            ids,
            hosts,
            here: vec![here],
        })
    }

    /// The mesh positions this process holds, in order: what its argument lists are for.
    pub fn held(&self) -> Vec<usize> {
        self.here
            .iter()
            .flat_map(|g| self.hosts[*g].iter().copied())
            .collect()
    }

    /// Where mesh position `p` is among [`DeviceMap::held`] (None: another process holds it).
    pub fn slot(&self, p: usize) -> Option<usize> {
        self.held().iter().position(|q| *q == p)
    }

    /// Whether this process holds every position (it can read any result whole).
    pub fn holds_all(&self) -> bool {
        self.here.len() == self.hosts.len()
    }

    /// The hosts this process runs, each with its positions (what each host's loader and
    /// reader are for).
    pub fn local_hosts(&self) -> Vec<Vec<usize>> {
        self.here.iter().map(|g| self.hosts[*g].clone()).collect()
    }
}

/// The devices of each of `hosts` hosts over `devices` devices, in order: host `g` holds devices
/// `g*n .. (g+1)*n` (`n = devices / hosts`), as each host of a slice holds its own chips.
pub fn device_groups(devices: usize, hosts: usize) -> Result<Vec<Vec<usize>>> {
    if hosts == 0 || !devices.is_multiple_of(hosts) {
        bail!(
            "--virtual-hosts {hosts} must divide the step's {} (each virtual host holds the \
             same number)",
            crate::words::count(devices, "device")
        );
    }
    let n = devices / hosts;
    Ok((0..hosts).map(|g| (g * n..(g + 1) * n).collect()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_split_into_equal_hosts_in_order() {
        assert_eq!(device_groups(4, 2).unwrap(), vec![vec![0, 1], vec![2, 3]]);
        let e = device_groups(4, 3).unwrap_err().to_string();
        assert!(
            e.contains("--virtual-hosts 3 must divide the step's 4 devices"),
            "{e}"
        );
    }

    #[test]
    fn one_process_holds_every_position() {
        let p = DeviceMap::in_one_process(vec![0, 1, 2, 3], 2).unwrap();
        assert_eq!(p.hosts, vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(p.held(), vec![0, 1, 2, 3]);
        assert!(p.holds_all());
        assert_eq!(p.slot(3), Some(3));
    }

    #[test]
    fn processes_hold_contiguous_positions_whatever_their_ids() {
        // Two TPU hosts whose chips' ids interleave (0, 1, 4, 5 on one; 2, 3, 6, 7 on the other),
        // listed by the plugin in id order.
        let devices: Vec<(i64, usize)> = [0, 1, 2, 3, 4, 5, 6, 7]
            .iter()
            .map(|&id| (id, if id % 4 < 2 { 0 } else { 1 }))
            .collect();
        let zero = DeviceMap::of_processes(&devices, 8, 0).unwrap();
        let one = DeviceMap::of_processes(&devices, 8, 1).unwrap();
        assert_eq!(zero.ids, vec![0, 1, 4, 5, 2, 3, 6, 7]);
        assert_eq!(
            zero.ids, one.ids,
            "every process compiles the same assignment"
        );
        assert_eq!(zero.held(), vec![0, 1, 2, 3]);
        assert_eq!(one.held(), vec![4, 5, 6, 7]);
        assert_eq!(one.slot(5), Some(1));
        assert_eq!(one.slot(0), None);
        assert!(!one.holds_all());
        assert_eq!(one.local_hosts(), vec![vec![4, 5, 6, 7]]);
    }

    #[test]
    fn a_step_must_span_every_device_equally() {
        let devices = [(0, 0), (1, 0), (2, 1), (3, 1)];
        let e = DeviceMap::of_processes(&devices, 2, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("compiled for 2 devices, but the run's processes have 4"),
            "{e}"
        );
        let uneven = [(0, 0), (1, 0), (2, 0), (3, 1)];
        let e = DeviceMap::of_processes(&uneven, 4, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("process 0: 3, process 1: 1"), "{e}");
    }
}

//! Where a step's mesh lies: which device each mesh position is (the compile's device
//! assignment, by global device id), which positions each host holds, and which hosts this
//! process runs. One process alone runs every position; `--virtual-hosts P` runs P hosts in one
//! process (the stand-in for a run of several); a process of a run of several runs its own host.
//! The trainer uploads, executes and reads back through this alone, so the same code serves all
//! three.

use anyhow::{bail, Result};

/// The step's devices by mesh position, split into hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The global device id at each mesh position (what the step is compiled for).
    pub ids: Vec<i64>,
    /// Each host's mesh positions, in order (together: every position, once).
    pub hosts: Vec<Vec<usize>>,
    /// The hosts this process runs: every one with `--virtual-hosts`, its own in a run of
    /// several processes.
    pub here: Vec<usize>,
}

impl Placement {
    /// One process with every device (`ids`, in mesh order), as `hosts` hosts of equal size:
    /// host `g` holds positions `g*n .. (g+1)*n`, as each host of a slice holds its own chips.
    /// One host for a plain run; several for `--virtual-hosts`.
    pub fn in_one_process(ids: Vec<i64>, hosts: usize) -> Result<Placement> {
        let groups = super::share::device_groups(ids.len(), hosts)?;
        Ok(Placement {
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
    ) -> Result<Placement> {
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
        Ok(Placement {
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

    /// Where mesh position `p` is among [`Placement::held`] (None: another process holds it).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_holds_every_position() {
        let p = Placement::in_one_process(vec![0, 1, 2, 3], 2).unwrap();
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
        let zero = Placement::of_processes(&devices, 8, 0).unwrap();
        let one = Placement::of_processes(&devices, 8, 1).unwrap();
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
        let e = Placement::of_processes(&devices, 2, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("compiled for 2 devices, but the run's processes have 4"),
            "{e}"
        );
        let uneven = [(0, 0), (1, 0), (2, 0), (3, 1)];
        let e = Placement::of_processes(&uneven, 4, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("process 0: 3, process 1: 1"), "{e}");
    }
}

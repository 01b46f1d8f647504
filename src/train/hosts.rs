//! `xtrain train` as one process of a run of several (one per host): the processes meet through
//! the store process 0 serves, check that they all run the same settings (before any plugin is
//! opened), open the plugin's client across the run through the store, and train: the same run
//! as one process's (`super::run_in`), with the step placed over every process's devices
//! (`device::hosts::place`), each process uploading only its own devices' weight slices and
//! batch rows and executing its own argument lists, the LoRA state gathered through the store
//! for checkpoints, and process 0 alone writing the output dir. A checkpoint counts once every
//! process has passed a barrier after it and process 0 has marked it committed
//! (`checkpoint::commit_across`).
//!
//! The CPU plugin's collectives stay within one process: on it the processes meet and then stop,
//! saying so. `--virtual-hosts` runs the same placement, uploads and execute in one process.

use crate::cluster::gather::StoreGather;
use crate::cluster::launch::Launch;
use crate::cluster::rendezvous::{self, Peers, Settings};
use crate::cluster::wire::StoreError;
use crate::device::platform::named_platform;
use crate::device::runtime::{InRun, Runtime};
use crate::train::finish;
use crate::train::options::TrainOptions;
use crate::train::output::RunDir;
use anyhow::{bail, Result};
use serde_json::json;
use std::sync::{Arc, Mutex};

/// The run's output dir as process 0 holds it (None on the others).
pub(super) type Out = Option<Arc<Mutex<RunDir>>>;

/// Join the run `launch` describes as one of its processes (every process runs this with the same
/// command): meet, agree, refuse what cannot run, and claim `--out` on process 0. `notes`: what
/// the settings taken from a checkpoint or program dir were (said by process 0). The run then
/// trains as a one-process run does (`run_in`, with the returned team) and ends with [`end`].
pub(super) fn meet(
    opts: &TrainOptions,
    launch: &Launch,
    notes: Vec<String>,
) -> Result<(Team, Out)> {
    let name = launch.name();
    let peers = rendezvous::join(launch, {
        let (name, out) = (name.clone(), opts.out.clone());
        move |why| {
            // A step with a lost peer never completes (its collectives wait forever): end now,
            // from this side thread without running exit handlers (the step's threads may be
            // inside the plugin), the message flushed first.
            crate::esay!("error: {}", ending(&why, &name, &out));
            let _ = std::io::Write::flush(&mut std::io::stderr());
            signal_hook::low_level::exit(1);
        }
    })?;
    crate::esay!(
        "xtrain: {name} joined the run at {} ({})",
        launch
            .coordinator
            .as_ref()
            .map_or(String::new(), |c| c.to_string()),
        launch.source
    );
    if let Err(e) = peers.agree(&settings(opts, launch)?) {
        // A lost peer reads the same whichever thread saw it first.
        let lost = e
            .downcast_ref::<StoreError>()
            .map(|e| ending(&e.to_string(), &name, &opts.out));
        peers.leave();
        return Err(lost.map_or(e, anyhow::Error::msg));
    }
    crate::esay!(
        "xtrain: {name}: all {} processes run the same settings",
        launch.processes
    );
    if let Some(dir) = &opts.program {
        // A multi-host program dir runs with one process per host it was compiled for.
        let builds = crate::formats::program_dir::read_builds(dir)?;
        let what = format!("program dir {}", dir.display());
        if let Err(e) = check_hosts(&builds, launch.processes, &what) {
            peers.leave();
            return Err(e);
        }
    }
    let platform = named_platform(opts.plugin.as_deref());
    if platform == "cpu" {
        // Every process reaches this: they leave together, none is reported lost.
        let _ = peers.barrier("cpu-refused");
        peers.leave();
        bail!(
            "the CPU plugin cannot run a step across processes: its collectives stay within one \
             process, so {} processes cannot share one step on it. Run across hosts with a \
             CUDA, ROCm or TPU plugin (--plugin cuda|rocm|tpu), or train on this host alone \
             (without --num-processes; the CPU plugin makes as many devices as --mesh asks for), \
             or try the per-host split in one process with --virtual-hosts",
            launch.processes
        );
    }
    // Process 0 alone claims --out and writes there; the others write nothing.
    let out = match launch.process_id {
        0 => {
            crate::formats::outdir::refuse_inputs_inside("--out", &opts.out, &opts.inputs())?;
            let out = RunDir::claim(&opts.out, opts.resume.as_deref(), opts.overwrite)?;
            for n in notes {
                crate::esay!("xtrain: note: {n}");
            }
            Some(Arc::new(Mutex::new(out)))
        }
        _ => None,
    };
    Ok((Team { peers }, out))
}

/// End this process's part in the run: leave it together once every process has finished its
/// steps, or, after an error, leave so that the others are told this process is gone; then say
/// how the run ended (process 0, which settles `--out`).
pub(super) fn end(
    opts: &TrainOptions,
    team: Team,
    out: Out,
    finished: Result<finish::Finished>,
) -> Result<()> {
    let Team { peers } = team;
    if finished.is_ok() {
        // Every process finished its steps: none is left waiting when process 0's store closes.
        peers.barrier("finished")?;
        peers.leave();
    } else {
        // Dropped without leaving: the others are told this process is gone, and end.
        drop(peers);
    }
    match out {
        Some(out) => finish::end(opts, &mut finish::locked(&out), finished),
        None => finished.map(|_| ()),
    }
}

/// This process's part in a run of several, as the run uses it: where it stands, its client
/// opened through the store, the gathering of the shards others hold, and the barriers of a
/// checkpoint's commit.
pub(super) struct Team {
    peers: Peers,
}

impl Team {
    pub fn process(&self) -> usize {
        self.peers.launch.process_id
    }

    /// Open the plugin's client across the run through the store (as node `K` of `P`) and place
    /// a step of `devices` over every process's devices.
    pub fn open(&self, opts: &TrainOptions, devices: i64) -> Result<Runtime> {
        let launch = &self.peers.launch;
        let platform = named_platform(opts.plugin.as_deref());
        let store = self.peers.store.scope(&format!("pjrt/{platform}"));
        let mut rt = Runtime::open_in(
            opts.plugin.as_deref(),
            None,
            Some(InRun {
                store: Arc::new(store),
                node_id: launch.process_id,
                num_nodes: launch.processes,
                visible_devices: visible_devices()?,
            }),
        )?;
        let global = rt.client.global_devices()?.len();
        if global == rt.devices.len() && launch.processes > 1 {
            // Decided from what the client spans, not the plugin's name (a renamed CPU plugin
            // opens as "a run" in which each process computes everything alone). Every process
            // sees the same, and they stop together.
            let _ = self.peers.barrier("client-alone");
            bail!(
                "the {} client spans only this process's {}: its collectives stay within one \
                 process, so {} processes cannot share one step on it (the CPU plugin is such a \
                 plugin). Run across hosts with a CUDA, ROCm or TPU plugin, or train on one host",
                rt.platform(),
                crate::words::count(global, "device"),
                launch.processes
            );
        }
        crate::esay!(
            "xtrain: {}: the {} client spans {global} devices, {} of them here",
            launch.name(),
            rt.platform(),
            rt.devices.len()
        );
        rt.place_across_processes(devices.max(1) as usize, self.gather())?;
        if let Some(placed) = rt.hosts.placement() {
            let held = placed.held();
            crate::esay!(
                "xtrain: {}: this host holds mesh {} of {}",
                launch.name(),
                crate::words::span(&held, "position"),
                placed.ids.len()
            );
        }
        Ok(rt)
    }

    /// How the trainer gets the shards of the LoRA state (and evaluation's results) that the
    /// other processes hold: through the store.
    fn gather(&self) -> StoreGather {
        StoreGather::new(self.peers.store.clone(), self.peers.launch.init_timeout)
    }
}

impl crate::train::checkpoint::Team for Team {
    fn process(&self) -> usize {
        self.peers.launch.process_id
    }

    fn processes(&self) -> usize {
        self.peers.launch.processes
    }

    fn barrier(&self, name: &str) -> Result<()> {
        self.peers.barrier(name)
    }
}

/// Open the plugin for a step over `devices` devices, placed as the run's mode says: the one
/// place where [`Hosts`](crate::device::hosts::place::Hosts) is decided. A process of a run of
/// several (`team`) opens its client through the run's store and places the step over every
/// process's devices; `--virtual-hosts P` splits this process's devices into P hosts with a
/// store of their own; else one host runs every position.
pub(super) fn open(opts: &TrainOptions, team: Option<&Team>, devices: i64) -> Result<Runtime> {
    let devices = devices.max(1);
    match (team, opts.launch.virtual_hosts) {
        (Some(team), _) => team.open(opts, devices),
        (None, None) => Runtime::open(opts.plugin.as_deref(), Some(devices)),
        (None, Some(hosts)) => {
            let mut rt = Runtime::open(opts.plugin.as_deref(), Some(devices))?;
            let timeout = opts
                .launch
                .init_timeout
                .unwrap_or(crate::cluster::launch::DEFAULT_INIT_TIMEOUT);
            rt.place_virtual_hosts(hosts, devices as usize, timeout)?;
            crate::esay!(
                "xtrain: --virtual-hosts {hosts}: each host hands its shards of the LoRA state \
                 and of evaluations to host 0 through a store of their own, as a run's hosts do"
            );
            Ok(rt)
        }
    }
}

/// What a process says as it ends because another is gone: a resume where a committed
/// checkpoint exists in `out` (as this host sees it), else a new start.
fn ending(why: &str, name: &str, out: &std::path::Path) -> String {
    match crate::train::checkpoint::latest_checkpoint(out) {
        Some(c) => format!(
            "{why}. Ending {name} too; once every host is up, resume the run from its newest \
             committed checkpoint with --resume {}",
            c.display()
        ),
        None => format!(
            "{why}. Ending {name} too; no checkpoint of the run was committed yet: start it \
             again once every host is up"
        ),
    }
}

/// What every process must agree on: every setting by flag, the number of processes, the
/// program dir's program (by hash) and xtrain's version.
fn settings(opts: &TrainOptions, launch: &Launch) -> Result<Settings> {
    let mut s: Settings = crate::train::settings::of_run(opts).into_iter().collect();
    s.insert("num-processes".into(), json!(launch.processes));
    s.insert("xtrain-version".into(), json!(env!("CARGO_PKG_VERSION")));
    // What each host reads: the same data file (a copy that differs in size or at either end
    // is named before any step), and the same checkpoint's step.
    if opts.data.path.is_file() {
        s.insert(
            "data-file".into(),
            json!(data_fingerprint(&opts.data.path)?),
        );
    }
    if let Some(dir) = &opts.resume {
        let state = crate::train::checkpoint::read_state(dir)?;
        s.insert("resumed-step".into(), json!(state.step));
    }
    if let Some(dir) = &opts.program {
        let (program, _) = crate::formats::program_dir::read_dir(dir)?;
        s.insert(
            "program-sha256".into(),
            json!(crate::formats::program_dir::sha256_hex(
                program.text.as_bytes()
            )),
        );
    }
    Ok(s)
}

/// `BYTES bytes, sha256 HASH`: the data file's size and a hash of its first and last MiB (the
/// whole file may be gigabytes; a copy cut short, or another file, differs at one end).
fn data_fingerprint(path: &std::path::Path) -> Result<String> {
    use sha2::Digest;
    use std::io::{Read, Seek, SeekFrom};
    const MIB: u64 = 1 << 20;
    let read = |what: &str, e: std::io::Error| {
        anyhow::anyhow!(
            "cannot read the data file {} ({what}): {}",
            path.display(),
            crate::cluster::wire::io_words(&e)
        )
    };
    let mut f = std::fs::File::open(path).map_err(|e| read("open", e))?;
    let size = f.metadata().map_err(|e| read("size", e))?.len();
    let mut hash = sha2::Sha256::new();
    let mut head = Vec::new();
    (&mut f)
        .take(MIB)
        .read_to_end(&mut head)
        .map_err(|e| read("first MiB", e))?;
    hash.update(&head);
    if size > MIB {
        f.seek(SeekFrom::Start(size.saturating_sub(MIB).max(MIB)))
            .map_err(|e| read("last MiB", e))?;
        let mut tail = Vec::new();
        f.read_to_end(&mut tail).map_err(|e| read("last MiB", e))?;
        hash.update(&tail);
    }
    Ok(format!("{size} bytes, sha256 {:x}", hash.finalize()))
}

/// A program dir compiled for several hosts runs with one process per host: a run with another
/// number of processes is refused naming the dir's builds. A dir compiled for one host (or with
/// no builds) leaves the mesh to be checked against the devices once the plugin is open.
pub fn check_hosts(
    builds: &[crate::formats::program_dir::Build],
    processes: usize,
    what: &str,
) -> Result<()> {
    let compiled: Vec<(&str, i64, i64)> = builds
        .iter()
        .map(|b| (b.target.as_str(), b.devices, b.hosts))
        .collect();
    hosts_agree(&compiled, processes, what)
}

/// [`check_hosts`] on each build's (target, devices, hosts).
fn hosts_agree(compiled: &[(&str, i64, i64)], processes: usize, what: &str) -> Result<()> {
    let multi: Vec<&(&str, i64, i64)> = compiled.iter().filter(|b| b.2 > 1).collect();
    if multi.is_empty() || multi.iter().any(|b| b.2 == processes as i64) {
        return Ok(());
    }
    let named: Vec<String> = multi
        .iter()
        .map(|(t, d, h)| format!("{t} ({d} devices on {h} hosts)"))
        .collect();
    bail!(
        "{what} was compiled for {}, but this run has {processes} processes: start one process \
         per host (--num-processes {})",
        named.join(", "),
        multi[0].2
    )
}

/// `XTRAIN_VISIBLE_DEVICES=0,1`: which of this host's GPUs the process takes (the GPU plugins'
/// `visible_devices`); all where unset.
fn visible_devices() -> Result<Option<Vec<i64>>> {
    let Ok(text) = std::env::var("XTRAIN_VISIBLE_DEVICES") else {
        return Ok(None);
    };
    let ids: std::result::Result<Vec<i64>, _> =
        text.split(',').map(|s| s.trim().parse::<i64>()).collect();
    match ids {
        Ok(ids) if !ids.is_empty() && ids.iter().all(|i| *i >= 0) => Ok(Some(ids)),
        _ => bail!("XTRAIN_VISIBLE_DEVICES={text:?}: expected GPU indices such as 0 or 0,1"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multi_host_dir_runs_with_one_process_per_host() {
        let h100 = [("cuda:h100:2x8", 16, 2)];
        hosts_agree(&h100, 2, "program dir p").unwrap();
        let e = hosts_agree(&h100, 4, "program dir p")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "program dir p was compiled for cuda:h100:2x8 (16 devices on 2 hosts), but this run \
             has 4 processes: start one process per host (--num-processes 2)"
        );
        // A pod slice among single-host builds: the run's count must match the slice's.
        let mixed = [("cuda:h100:8", 8, 1), ("tpu:v5p:4x4x4", 64, 16)];
        hosts_agree(&mixed, 16, "d").unwrap();
        assert!(hosts_agree(&mixed, 2, "d").is_err());
        // One-host builds (or none) say nothing about the number of processes.
        hosts_agree(&[("cuda:h100:8", 8, 1)], 2, "d").unwrap();
        hosts_agree(&[], 3, "d").unwrap();
    }
}

//! `xtrain train` as one process of a run of several (one per host): the processes meet through
//! the store process 0 serves, check that they all run the same settings (before any plugin is
//! opened), and then open the plugin's client across the run through the store.
//!
//! What runs today: the rendezvous and its refusals, the CPU plugin's refusal (its collectives
//! stay within one process), and on a GPU or TPU plugin the client created through the store
//! and the step compiled over every process's devices. Executing the step across processes
//! (argument lists for this process's devices, per-host loading, the checkpoint commit) is not
//! built yet, and the run stops there, saying so.

use crate::device::hosts::launch::Launch;
use crate::device::hosts::rendezvous::{self, Peers, Settings};
use crate::device::hosts::wire::StoreError;
use crate::device::platform::named_platform;
use crate::device::runtime::{InRun, Runtime};
use crate::model::config::LlamaConfig;
use crate::train::options::TrainOptions;
use anyhow::{bail, Result};
use serde_json::json;

/// Run `opts` as one process of the run `launch` describes. Every process runs this with the
/// same command; it returns an error in every case today (see the module docs).
pub fn run(opts: &TrainOptions, cfg: &LlamaConfig, launch: &Launch) -> Result<()> {
    let name = launch.name();
    let peers = rendezvous::join(launch, {
        let name = name.clone();
        move |why| {
            // A step with a lost peer never completes (its collectives wait forever): end now.
            eprintln!("error: {}", ending(&why, &name));
            std::process::exit(1);
        }
    })?;
    eprintln!(
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
            .map(|e| ending(&e.to_string(), &name));
        peers.leave();
        return Err(lost.map_or(e, anyhow::Error::msg));
    }
    eprintln!(
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
             (without --num-processes; the CPU plugin makes as many devices as --mesh asks for)",
            launch.processes
        );
    }
    compile_across(opts, cfg, peers)
}

/// What a process says as it ends because another is gone.
fn ending(why: &str, name: &str) -> String {
    format!(
        "{why}. Ending {name} too; resume the run from its newest checkpoint with --resume once \
         every host is up"
    )
}

/// What every process must agree on: every setting by flag, the number of processes, the
/// program dir's program (by hash) and xtrain's version.
fn settings(opts: &TrainOptions, launch: &Launch) -> Result<Settings> {
    let mut s: Settings = crate::train::settings::of_run(opts).into_iter().collect();
    s.insert("num-processes".into(), json!(launch.processes));
    s.insert("xtrain-version".into(), json!(env!("CARGO_PKG_VERSION")));
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

/// Open the plugin's client across the run through the store, and compile the step over every
/// process's devices; then stop, since running it across processes is not built yet.
fn compile_across(opts: &TrainOptions, cfg: &LlamaConfig, peers: Peers) -> Result<()> {
    let launch = peers.launch.clone();
    let platform = named_platform(opts.plugin.as_deref());
    let (program, spec) = match &opts.program {
        Some(dir) => crate::formats::program_dir::read_dir_for_model(dir, cfg, &opts.model)?,
        None => {
            let (remat, offload) =
                crate::program::default_choice(opts.step.remat, opts.step.offload);
            let mut step = opts.step.clone();
            step.remat = Some(remat);
            step.offload = Some(offload);
            let spec = step.spec(cfg.clone(), opts.data.batch_size, opts.data.seq)?;
            (crate::program::build_train_step(&spec)?, spec)
        }
    };
    let store = peers.store.scope(&format!("pjrt/{platform}"));
    let rt = Runtime::open_in(
        opts.plugin.as_deref(),
        None,
        Some(InRun {
            store: std::sync::Arc::new(store),
            node_id: launch.process_id,
            num_nodes: launch.processes,
            visible_devices: visible_devices()?,
        }),
    )?;
    let global = rt.client.global_devices()?.len();
    eprintln!(
        "xtrain: {}: the {} client spans {global} devices, {} of them here",
        launch.name(),
        rt.platform(),
        rt.devices.len()
    );
    let _exe = rt.compile_plain(&program)?;
    eprintln!(
        "xtrain: {}: compiled the step over {} devices (--remat {}, --offload {})",
        launch.name(),
        program.partitions,
        spec.remat.name(),
        spec.offload.name()
    );
    peers.barrier("compiled")?;
    peers.leave();
    bail!(
        "{}: the step compiled across the run's {} processes, but running it across processes \
         (each host's share of the arguments, loading and checkpoints) is not built yet",
        launch.name(),
        launch.processes
    )
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

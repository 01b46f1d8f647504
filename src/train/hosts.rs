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
            eprintln!(
                "error: {why}. Ending {name} too; resume the run from its newest checkpoint \
                 with --resume once every host is up"
            );
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
        peers.leave();
        return Err(e);
    }
    eprintln!(
        "xtrain: {name}: all {} processes run the same settings",
        launch.processes
    );
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
        Some(dir) => {
            let (program, spec) =
                crate::formats::program_dir::read_dir_for_model(dir, cfg, &opts.model)?;
            let builds = crate::formats::program_dir::read_builds(dir)?;
            check_hosts(
                &builds,
                launch.processes,
                &format!("program dir {}", dir.display()),
            )?;
            (program, spec)
        }
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
    let _exe = rt.compile(&program, &pjrt::CompileOptions::default())?;
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

/// A program dir compiled for several hosts runs with as many processes as it has hosts.
pub fn check_hosts(
    builds: &[crate::formats::program_dir::Build],
    processes: usize,
    what: &str,
) -> Result<()> {
    let wrong: Vec<String> = builds
        .iter()
        .filter(|b| b.hosts > 1 && b.hosts != processes as i64)
        .map(|b| format!("{} ({} devices on {} hosts)", b.target, b.devices, b.hosts))
        .collect();
    if !wrong.is_empty() && !builds.iter().any(|b| b.hosts == processes as i64) {
        bail!(
            "{what} was compiled for {}, but this run has {processes} processes: start one \
             process per host (--num-processes {})",
            wrong.join(", "),
            builds.iter().find(|b| b.hosts > 1).map_or(1, |b| b.hosts)
        );
    }
    Ok(())
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

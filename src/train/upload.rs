//! The step compiled (or loaded from the cache) and the weights and starting state uploaded, as
//! the run shows it: a spinner while compiling, a bar of the bytes while loading, then how long
//! loading took and the peak host memory while loading.

use crate::device::hosts::place::Hosts;
use crate::device::memory::fit::{argument_bytes_per_device, explain_out_of_memory_on};
use crate::device::runtime::Runtime;
use crate::device::trainer::Trainer;
use crate::formats::weights::CheckpointWeights;
use crate::program::{self, Program, StepSpec};
use crate::train::checkpoint::Checkpoint;
use crate::train::options::TrainOptions;
use crate::train::progress;
use anyhow::Result;
use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;

/// When loading started and the host memory the process held then (`VmRSS`).
type LoadStart = (Instant, Option<u64>);

/// Compile the step (or load it from the cache), then upload the weights (read shard by shard
/// from the checkpoint: a bar shows the bytes) and the starting state. Says how long loading
/// took and the peak host memory while loading (`VmHWM`; on the CPU plugin the devices' buffers
/// are host memory too), unless `--log-every 0`.
pub(super) fn compile_and_upload(
    opts: &TrainOptions,
    rt: Runtime,
    spec: StepSpec,
    program: Program,
    weights: CheckpointWeights,
    start: &Checkpoint,
) -> Result<Trainer> {
    let available = device_memory(&rt);
    let platform = rt.platform();
    let (spec_, args) = (spec.clone(), argument_bytes_per_device(&program));
    let frozen: Vec<(String, u64)> = program
        .args
        .iter()
        .filter(|a| a.role == program::Role::Frozen)
        .map(|a| {
            let n: i64 = a.shape.iter().product();
            (a.name.clone(), n as u64 * a.dtype.size_bytes() as u64)
        })
        .collect();
    let total: u64 = frozen.iter().map(|(_, b)| b).sum();
    let largest = weights.largest_tensor_bytes(&spec.model);
    let shown = opts.log_every > 0;
    let compiling = (shown && !opts.verbose).then(|| progress::spinner("compiling the step"));
    // When loading started, and the host memory then.
    let started: Rc<Cell<Option<LoadStart>>> = Rc::new(Cell::new(None));
    let loading = progress::bytes("loading weights", total);
    let weights = {
        let (started, loading, compiling) = (started.clone(), loading.clone(), compiling.clone());
        weights.on_progress(move |event| match event {
            None => {
                if let Some(c) = &compiling {
                    progress::clear(c);
                }
                // The peak from here on is loading's.
                progress::reset_peak();
                started.set(Some((Instant::now(), progress::resident_bytes())));
                loading.reset_elapsed();
                loading.reset_eta();
                if shown {
                    progress::show(&loading);
                }
            }
            Some(k) => loading.inc(frozen.get(k).map_or(0, |(_, b)| *b)),
        })
    };
    if opts.verbose {
        crate::esay!("xtrain: compiling the step (Ctrl-C abandons the compile)");
    }
    // One reader of the checkpoint per host this process runs (several with --virtual-hosts),
    // each asked only for its own devices' boxes (the first also drives the bar).
    let hosts = rt.hosts.local_hosts();
    let mut readers = vec![weights];
    for _ in 1..hosts.len() {
        readers.push(CheckpointWeights::open(&opts.model, &spec.model)?);
    }
    let trainer = Trainer::new_on_hosts(
        rt,
        spec,
        program,
        readers,
        &start.lora,
        &start.moments,
        opts.use_cache,
        opts.verbose,
    );
    // Done or failed: no bar stays drawn under what is said next.
    if let Some(c) = &compiling {
        progress::clear(c);
    }
    progress::clear(&loading);
    let mut trainer = trainer.map_err(|e| {
        explain_out_of_memory_on(
            e,
            "the training step",
            args,
            &spec_,
            available,
            Some(&platform),
        )
    })?;
    say_loaded(opts, &trainer, started.get(), &hosts, (total, largest));
    trainer.dropout_seed = opts.seed;
    trainer.step = start.state.step;
    Ok(trainer)
}

/// Say what loading did: a progress line like the steps' (quiet with --log-every 0) with where
/// its time went and the host memory it took, and with several hosts what each read of the
/// `total` bytes of frozen weights (`largest`: the largest tensor's bytes).
fn say_loaded(
    opts: &TrainOptions,
    trainer: &Trainer,
    started: Option<LoadStart>,
    hosts: &[Vec<usize>],
    (total, largest): (u64, u64),
) {
    if let Some((t0, before)) = started.filter(|_| opts.log_every > 0 || opts.verbose) {
        let devices = trainer.program.partitions.max(1);
        let peak_bytes = progress::peak_bytes();
        if opts.verbose {
            // Exact figures, for tests and benchmarks (tests/loading.rs).
            crate::esay!(
                "xtrain: loading bytes: peak {} before {} weights {total} largest {largest}",
                peak_bytes.unwrap_or(0),
                before.unwrap_or(0)
            );
        }
        let peak = peak_bytes.map_or("unknown".into(), progress::gib);
        let before = before.map_or("unknown".into(), progress::gib);
        let secs = t0.elapsed().as_secs_f64();
        crate::esay!(
            "xtrain: loaded {} of weights (as the step holds them) onto {} in {secs:.2}s, {:.2} \
             GiB/s; the checkpoint's largest tensor, as stored: {}",
            progress::gib(total),
            crate::words::count(devices as usize, "device"),
            total as f64 / (1u64 << 30) as f64 / secs.max(1e-9),
            progress::gib(largest),
        );
        crate::esay!("xtrain: {}", loading_split(&trainer.loading));
        crate::esay!(
            "xtrain: peak host memory while loading {peak} (VmHWM; {before} before loading)"
        );
    }
    for (devices, read) in hosts.iter().zip(&trainer.frozen_bytes_read) {
        let (which, placed) = match &trainer.rt.hosts {
            Hosts::One => break,
            Hosts::Virtual { placement, .. } => ("virtual", placement),
            Hosts::Processes { placement, .. } => ("this", placement),
        };
        let g = placed.hosts.iter().position(|h| h == devices).unwrap_or(0);
        crate::esay!(
            "xtrain: {which} host {g} of {} ({}) read {read} of the {total} bytes of frozen \
             weights",
            placed.hosts.len(),
            crate::words::span(devices, "device"),
        );
    }
}

/// Where loading's time went, as one line, each part with its own bytes and rate: reading the
/// files (the bytes mapped in), converting (the bytes of the boxes converted, as stored),
/// quantizing (the bytes quantized, as stored), and uploading (the bytes put on the devices).
/// They overlap (two threads, the quantizing on every core), so their sum may exceed the load's
/// time.
fn loading_split(f: &crate::device::frozen::LoadFigures) -> String {
    // Under a hundredth of a second (a zero-copy upload) a rate says nothing.
    let rate = |bytes: u64, s: f64| {
        if s >= 0.01 {
            format!("{:.2} GiB/s", bytes as f64 / (1u64 << 30) as f64 / s)
        } else {
            "-".to_string()
        }
    };
    let read = f.read.read_bytes;
    let mut parts = vec![
        format!(
            "read {:.2}s ({} of files, {})",
            f.read.read_s,
            progress::gib(read),
            rate(read, f.read.read_s)
        ),
        format!(
            "convert {:.2}s ({}, {})",
            f.read.convert_s,
            progress::gib(f.read.convert_bytes),
            rate(f.read.convert_bytes, f.read.convert_s)
        ),
    ];
    if f.read.quantize_s > 0.0 {
        parts.push(format!(
            "quantize {:.2}s ({}, {})",
            f.read.quantize_s,
            progress::gib(f.read.quantize_bytes),
            rate(f.read.quantize_bytes, f.read.quantize_s)
        ));
    }
    parts.push(format!(
        "upload {:.2}s ({} to the devices, {})",
        f.upload_s,
        progress::gib(f.uploaded),
        rate(f.uploaded, f.upload_s)
    ));
    let handed = if f.handed_over > 0 {
        format!(
            "; the plugin took {} without a copy",
            progress::gib(f.handed_over)
        )
    } else {
        String::new()
    };
    format!("loading: {} (overlapped){handed}", parts.join(", "))
}

/// The memory of the plugin's first device, if it says.
pub(super) fn device_memory(rt: &Runtime) -> Option<i64> {
    rt.devices.first()?.info().ok()?.memory_bytes
}

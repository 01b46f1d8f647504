//! Recipes: `xtrain train` ([`run`]), a fine-tuning run a person can read top to bottom, and
//! `xtrain bench` ([`bench`](mod@bench)). A run loads the model's config, reads the data, plans the step
//! (or takes a compiled program dir) for the plugin, decides where training starts (fresh, an
//! initial adapter, or a checkpoint), loads the frozen weights, compiles and uploads, then loops:
//! step, log, evaluate, checkpoint; and saves the adapter and the loss curve at the end. It owns
//! the run's options, schedule, checkpoints, metrics and plot. It may use everything below it
//! (`device`, `data`, `formats`, `program`, `model`); only the command line uses it.

pub mod bench;
pub mod checkpoint;
pub mod log;
pub mod options;
pub mod output;
pub mod plot;
pub mod progress;
pub mod schedule;
pub mod settings;
mod start;
pub mod tensorboard;

use crate::data::{Batch, Source, TrainingData};
use crate::device::memory::fit::{argument_bytes_per_device, explain_out_of_memory_on};
use crate::device::runtime::Runtime;
use crate::device::trainer::Trainer;
use crate::formats::weights::CheckpointWeights;
use crate::model::config::LlamaConfig;
use crate::program::{self, Program, StepSpec};
use crate::train::checkpoint::{
    resume_command, save_adapter, save_checkpoint, Checkpoint, TrainerState,
};
use crate::train::log::Metrics;
use crate::train::options::TrainOptions;
use crate::train::output::RunDir;
use crate::train::schedule::Schedule;
use anyhow::{bail, Context, Result};
use std::cell::Cell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// `xtrain train`: build (or load) the step, then train on the data, logging metrics,
/// evaluating, checkpointing and exporting the adapter.
pub fn run(opts: &TrainOptions) -> Result<()> {
    let interrupted = stop_on_signals()?;
    opts.validate_values()?;
    let mut opts = opts.clone();
    // What the settings taken from a checkpoint or a program dir were: said once the run starts.
    let mut notes = Vec::new();
    opts.settle_length(&mut notes)?;
    settings::take_recorded_paths(&mut opts, &mut notes)?;
    let cfg = LlamaConfig::load(&opts.model)?;
    settings::settle(&mut opts, &cfg, &mut notes)?;
    opts.validate()?;
    let opts = &opts;
    crate::formats::outdir::refuse_inputs_inside(&opts.out, &opts.inputs())?;
    let mut out = RunDir::claim(&opts.out, opts.resume.as_deref(), opts.overwrite)?;
    for n in notes {
        eprintln!("xtrain: {n}");
    }
    match run_in(opts, &cfg, &interrupted) {
        Ok(Finished::Complete) => out.complete(),
        Ok(Finished::Stopped(dir)) => {
            eprintln!(
                "xtrain: stopped after step {} (--stop-after); continue with `{}`",
                dir.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("checkpoint-"))
                    .unwrap_or("?"),
                resume_command(&dir)
            );
            if let Some(note) = out.stopped() {
                eprintln!("xtrain: {note}");
            }
            Ok(())
        }
        Ok(Finished::Interrupted(saved)) => {
            match saved {
                Some(dir) => eprintln!(
                    "\nxtrain: interrupted; saved {} (continue with `{}`)",
                    dir.display(),
                    resume_command(&dir)
                ),
                None => {
                    let again = opts
                        .resume
                        .as_ref()
                        .map(|c| format!(" (continue with `{}`)", resume_command(c)))
                        .unwrap_or_default();
                    eprintln!(
                        "\nxtrain: interrupted before a step was taken; nothing new to save{again}"
                    );
                }
            }
            if let Some(note) = out.failed() {
                eprintln!("xtrain: {note}");
            }
            std::process::exit(130);
        }
        Err(e) => match out.failed() {
            Some(note) => Err(anyhow::anyhow!("{e:#}\n({note})")),
            None => Err(e),
        },
    }
}

/// How a run's invocation ended, short of an error.
enum Finished {
    /// The last step was taken; the adapter is saved.
    Complete,
    /// `--stop-after` ended it early, with this checkpoint.
    Stopped(PathBuf),
    /// A signal ended it, with this checkpoint (None: before any step was taken).
    Interrupted(Option<PathBuf>),
}

/// The run once its options are settled and its output dir is claimed.
fn run_in(opts: &TrainOptions, cfg: &LlamaConfig, interrupted: &AtomicBool) -> Result<Finished> {
    let stop = || interrupted.load(Ordering::SeqCst);
    let data = crate::data::load(&opts.data, &opts.model, cfg)?;
    if stop() {
        return Ok(Finished::Interrupted(None));
    }
    let (rt, spec, program) = plan(opts, cfg, data.batch, data.seq)?;
    let schedule = schedule(opts, &data.source);
    if schedule.warmup > schedule.total {
        eprintln!(
            "xtrain: warning: --warmup {} is longer than the run ({} steps): the learning rate rises to {:e} at the last step and never reaches --lr {:e}",
            schedule.warmup,
            schedule.total,
            schedule.at(schedule.total),
            schedule.lr
        );
    }
    let start = start::starting_point(opts, cfg, &spec.lora, &schedule, &data)?;
    let weights = load_weights(opts, cfg)?;
    if stop() {
        return Ok(Finished::Interrupted(None));
    }
    let trainer = compile_and_upload(opts, rt, spec, program, weights, &start)?;
    let (_, _, state) = start;
    let TrainingData {
        source,
        eval_batches,
        batch,
        seq,
    } = data;
    let tokens_per_step = batch * seq;
    let resumed_at = opts.resume.is_some().then_some(state.step);
    let mut metrics = Metrics::open(&opts.out, resumed_at, tokens_per_step)?;
    metrics.mfu_seconds = opts.peak_tflops.map(|peak| {
        let spec = &trainer.spec;
        let devices = spec.mesh.as_ref().map_or(1, |m| m.devices()) as f64;
        bench::model_flops_per_step(spec) / (peak * 1e12 * devices)
    });
    let mut run = Run {
        opts,
        metrics,
        tokens_per_step,
        trainer,
        state,
        source,
        eval_batches,
        base: crate::formats::peft::base_model(&opts.model),
        skipped: 0,
    };
    if stop() {
        return Ok(Finished::Interrupted(None));
    }
    if run.state.step == 0 {
        run.evaluate(0)?;
    }
    let first = run.state.step;
    let finished = run.train(interrupted)?;
    let taken = run.state.step - first;
    if run.skipped > 0 {
        eprintln!(
            "xtrain: skipped {} of {taken} steps (--skip-nonfinite-steps: their loss, gradient or update was not finite or blew the weights up; metrics.jsonl marks them `nonfinite`)",
            run.skipped
        );
        if run.skipped == taken {
            bail!(
                "every step {} was skipped ({taken} of {taken}): nothing was trained, so no adapter is written; lower --lr (or look at the data) and start again",
                if first > 0 {
                    format!("since step {first}")
                } else {
                    "of the run".to_string()
                }
            );
        }
    }
    match finished {
        Some(done) => Ok(done),
        None => {
            run.evaluate(run.state.step)?;
            run.save()?;
            Ok(Finished::Complete)
        }
    }
}

/// SIGINT/SIGTERM set the returned flag: the run stops at the next safe point (after the current
/// step, with a checkpoint; or before the first step, once the data, the compile or the first
/// evaluation is done). A second signal ends the process at once (exit code 130).
fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(sig, 130, interrupted.clone())
            .context("cannot install signal handlers")?;
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install signal handlers")?;
    }
    // A signal handler cannot print; this thread says what the first signal does.
    let flag = interrupted.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if flag.load(Ordering::SeqCst) {
            eprintln!(
                "\nxtrain: stopping at the next safe point (press Ctrl-C again to quit at once)"
            );
            break;
        }
    });
    Ok(interrupted)
}

/// The executable of a program dir's builds that was compiled for this plugin and these
/// devices, if one was; otherwise the dir's program text is compiled here, and the reason is
/// said. Either way the program is the dir's own text.
fn prebuilt(
    rt: &Runtime,
    dir: &std::path::Path,
    program: &Program,
) -> Result<Option<crate::device::runtime::Prebuilt>> {
    use crate::formats::program_dir;
    let builds = program_dir::read_builds(dir)?;
    let mut why_not = Vec::new();
    for build in &builds {
        match crate::device::cache::matches(rt, build) {
            Ok(()) => {
                let executable = program_dir::read_executable(dir, build)?;
                return Ok(Some(crate::device::runtime::Prebuilt {
                    program_sha256: program_dir::sha256_hex(program.text.as_bytes()),
                    executable,
                    from: format!(
                        "by `xtrain compile` for {} ({})",
                        build.target,
                        dir.join(&build.executable).display()
                    ),
                }));
            }
            Err(why) => why_not.push(why),
        }
    }
    if !builds.is_empty() {
        eprintln!(
            "xtrain: compiling {} here, the same program (this machine has {}; its executables \
             are for other devices: {})",
            dir.join("train_step.mlir").display(),
            crate::device::cache::describe(rt),
            why_not.join("; ")
        );
    }
    Ok(None)
}

/// Open the plugin and plan the step: take it from a program dir (checking that it was built for
/// this model and batch), or build it for the plugin's platform. A CPU plugin gets as many
/// virtual devices as the mesh needs; an accelerator plugin has what it has, and compiling
/// checks that there are enough.
pub fn plan(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    batch: i64,
    seq: i64,
) -> Result<(Runtime, StepSpec, Program)> {
    let open = |devices: i64| Runtime::open(opts.plugin.as_deref(), Some(devices.max(1)));
    if let Some(dir) = &opts.program {
        let (program, spec) = crate::formats::program_dir::read_dir(dir)?;
        if &spec.model != cfg {
            bail!(
                "program dir {} was built for another model (its config differs from {})",
                dir.display(),
                opts.model.display()
            );
        }
        if (spec.batch, spec.seq) != (batch, seq) {
            bail!(
                "program dir {} takes batches of {}x{} but the data gives {batch}x{seq}",
                dir.display(),
                spec.batch,
                spec.seq
            );
        }
        let mut rt = open(program.partitions)?;
        let builds = crate::formats::program_dir::read_builds(dir)?;
        one_process(
            &rt.platform(),
            rt.devices.len(),
            program.partitions,
            &builds,
            &format!("program dir {}", dir.display()),
        )?;
        crate::device::platform::check_offload(
            &rt.platform(),
            spec.offload,
            &format!("program dir {}", dir.display()),
        )?;
        rt.prebuilt = prebuilt(&rt, dir, &program)?;
        eprintln!(
            "xtrain: program dir {}: --remat {}, --offload {} (as it was compiled)",
            dir.display(),
            spec.remat.name(),
            spec.offload.name()
        );
        return Ok((rt, spec, program));
    }
    let devices = opts.step.mesh.as_ref().map_or(1, |m| m.devices());
    let mut rt = open(devices)?;
    one_process(
        &rt.platform(),
        rt.devices.len(),
        devices,
        &[],
        &format!(
            "--mesh {}",
            opts.step.mesh.as_ref().map_or(String::new(), |m| m
                .axes
                .iter()
                .map(|(a, n)| format!("{a}={n}"))
                .collect::<Vec<_>>()
                .join(","))
        ),
    )?;
    let spec = opts.step.spec(cfg.clone(), batch, seq)?;
    if let Some(o) = opts.step.offload {
        crate::device::platform::check_offload(&rt.platform(), o, "this step")?;
    }
    let choices = crate::program::fit_choices(opts.step.remat, opts.step.offload);
    if rt.platform() != "cpu" && (choices.len() > 1 || !choices[0].1.is_none()) {
        // On an accelerator: the first of save-proj and layer remat (--remat auto) and the least
        // offload (--offload auto) that fits its memory, or the ones asked for, checked against
        // the device's and the host's memory before any weight loads.
        let (spec, program) = crate::device::memory::offload::choose(
            &mut rt,
            &choices,
            crate::program::default_choice(opts.step.remat, opts.step.offload),
            |(remat, offload)| {
                let s = StepSpec {
                    remat,
                    offload,
                    ..spec.clone()
                };
                let p = program::build_train_step(&s)?;
                Ok((s, p))
            },
            opts.use_cache,
        )?;
        return Ok((rt, spec, program));
    }
    let program = program::build_train_step(&spec)?;
    Ok((rt, spec, program))
}

/// `xtrain train` is one process, on the devices its plugin gives it: a step whose mesh needs
/// more (`what`: a program dir compiled for several hosts, such as `tpu:v5p:4x4x2` or
/// `cuda:h100:2x8`, or a `--mesh` larger than this host) is refused before anything is loaded,
/// rather than failing inside the plugin. `builds` are the program dir's (its multi-host
/// targets are named). The CPU plugin makes as many devices as asked, so it never refuses.
pub fn one_process(
    platform: &str,
    devices: usize,
    partitions: i64,
    builds: &[crate::formats::program_dir::Build],
    what: &str,
) -> Result<()> {
    if partitions <= devices as i64 {
        return Ok(());
    }
    let hosts: Vec<String> = builds
        .iter()
        .filter(|b| b.hosts > 1)
        .map(|b| format!("{} ({} devices on {} hosts)", b.target, b.devices, b.hosts))
        .collect();
    let compiled = if hosts.is_empty() {
        String::new()
    } else {
        format!(" It was compiled for {}.", hosts.join(", "))
    };
    bail!(
        "{what} needs {partitions} devices, but this process has {devices} ({platform}).{compiled} \
         `xtrain train` runs as one process on one host's devices: training across several \
         hosts (one process per host) is not supported. Train on a mesh of at most {devices} \
         devices (e.g. --mesh fsdp={devices}, with --quant nf4 or --offload where the model \
         does not fit), or compile for one host (`xtrain compile --target \
         <platform>:<device>:<count>`)"
    )
}

/// The learning-rate schedule over the run's steps (`--steps`, or `--epochs` over the data).
fn schedule(opts: &TrainOptions, source: &Source) -> Schedule {
    let total = if opts.steps > 0 {
        opts.steps
    } else {
        source.steps_per_epoch() * opts.epochs.max(1)
    };
    Schedule {
        lr: opts.lr,
        warmup: opts.warmup,
        kind: opts.schedule.clone(),
        min_ratio: opts.min_lr_ratio,
        total,
    }
}

/// When loading started and the host memory the process held then (`VmRSS`).
type LoadStart = (Instant, Option<u64>);

/// The checkpoint's frozen weights, opened and checked against the config; they are read one
/// device's shard at a time as they are uploaded ([`compile_and_upload`]).
fn load_weights(opts: &TrainOptions, cfg: &LlamaConfig) -> Result<CheckpointWeights> {
    CheckpointWeights::open(&opts.model, cfg)
}

/// Compile the step (or load it from the cache), then upload the weights (read shard by shard
/// from the checkpoint: a bar shows the bytes) and the starting state. Says how long loading
/// took and the peak host memory while loading (`VmHWM`; on the CPU plugin the devices' buffers
/// are host memory too), unless `--log-every 0`.
fn compile_and_upload(
    opts: &TrainOptions,
    rt: Runtime,
    spec: StepSpec,
    program: Program,
    weights: CheckpointWeights,
    (lora, moments, state): &Checkpoint,
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
    let trainer = Trainer::new(
        rt,
        spec,
        program,
        weights,
        lora,
        moments,
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
    // A progress line like the steps' (quiet with --log-every 0).
    if let Some((t0, before)) = started.get().filter(|_| opts.log_every > 0 || opts.verbose) {
        let devices = trainer.program.partitions.max(1);
        let peak_bytes = progress::peak_bytes();
        if opts.verbose {
            // Exact figures, for tests and benchmarks (tests/loading.rs).
            eprintln!(
                "xtrain: loading bytes: peak {} before {} weights {total} largest {largest}",
                peak_bytes.unwrap_or(0),
                before.unwrap_or(0)
            );
        }
        let peak = peak_bytes.map_or("unknown".into(), progress::gib);
        let before = before.map_or("unknown".into(), progress::gib);
        eprintln!(
            "xtrain: loaded {} of weights onto {devices} device{} in {:.1}s (largest tensor {})",
            progress::gib(total),
            if devices == 1 { "" } else { "s" },
            t0.elapsed().as_secs_f64(),
            progress::gib(largest),
        );
        eprintln!("xtrain: peak host memory while loading {peak} (VmHWM; {before} before loading)");
    }
    trainer.dropout_seed = opts.seed;
    trainer.step = state.step;
    Ok(trainer)
}

/// The memory of the plugin's first device, if it says.
fn device_memory(rt: &Runtime) -> Option<i64> {
    rt.devices.first()?.info().ok()?.memory_bytes
}

/// The progress of the loop: a bar on a terminal (its message updated every `--log-every`
/// steps), else a plain line every `--log-every` steps.
struct Shown {
    bar: Option<indicatif::ProgressBar>,
    start: Instant,
    first_step: u64,
}

impl Shown {
    fn show(&self, step: u64, total: u64, every: bool, loss: f32, tokens_per_s: f64, lr: f64) {
        let Some(bar) = &self.bar else { return };
        let what = format!("loss {loss:.4} lr {lr:.2e} {tokens_per_s:.0} tok/s");
        if progress::drawn() {
            bar.set_position(step);
            if every {
                bar.set_message(what);
            }
        } else if every {
            let done = (step + 1 - self.first_step) as f64;
            let eta = self.start.elapsed().as_secs_f64() / done * (total - step) as f64;
            eprintln!("step {step}/{total} {what} eta {eta:.0}s");
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            progress::leave(bar);
        }
    }
}

/// A run under way: the trainer, where training stands, the data, and what it writes.
struct Run<'a> {
    opts: &'a TrainOptions,
    trainer: Trainer,
    state: TrainerState,
    source: Source,
    eval_batches: Vec<Batch>,
    metrics: Metrics,
    /// The base model as adapters name it.
    base: crate::formats::peft::BaseModel,
    tokens_per_step: i64,
    /// Steps of this invocation skipped by `--skip-nonfinite-steps`.
    skipped: u64,
}

impl Run<'_> {
    /// The loop: one optimizer step per batch until the last step (or `--stop-after`), with
    /// progress, evaluation and checkpoints as asked. Returns None when the last step was
    /// taken; else how the invocation ended early: `--stop-after` or a signal, each after a
    /// checkpoint of the step reached.
    fn train(&mut self, interrupted: &AtomicBool) -> Result<Option<Finished>> {
        let first = self.state.step;
        let total = self.state.schedule.total;
        let stop_at = self
            .opts
            .stop_after
            .map_or(total, |n| (self.state.step + n).min(total));
        let shown = Shown {
            bar: (self.opts.log_every > 0).then(|| progress::steps(self.state.step, total)),
            start: Instant::now(),
            first_step: self.state.step + 1,
        };
        while self.state.step < stop_at {
            if interrupted.load(Ordering::SeqCst) {
                shown.finish();
                if self.state.step == first {
                    return Ok(Some(Finished::Interrupted(None)));
                }
                let dir = self.save_checkpoint()?;
                return Ok(Some(Finished::Interrupted(Some(dir))));
            }
            if let Err(e) = self.step(&shown) {
                shown.finish();
                return Err(e);
            }
        }
        shown.finish();
        if self.state.step < total {
            let dir = self.checkpoint_dir();
            let saved = self.opts.save_every > 0
                && self.state.step.is_multiple_of(self.opts.save_every)
                && dir.is_dir();
            if !saved {
                self.save_checkpoint()?;
            }
            return Ok(Some(Finished::Stopped(dir)));
        }
        Ok(None)
    }

    /// One step: run it on the next batch, then log it, evaluate and checkpoint as asked. A step
    /// whose loss or gradient is not finite changed nothing (the program's finite guard): it is
    /// skipped with `--skip-nonfinite-steps`, else the run stops with the last good state saved.
    fn step(&mut self, shown: &Shown) -> Result<()> {
        let opts = self.opts;
        let total = self.state.schedule.total;
        let step = self.state.step + 1;
        let batch = self
            .source
            .next(opts.seed, &mut self.state.epoch, &mut self.state.position);
        let lr = self.state.schedule.at(step);
        let t0 = Instant::now();
        let (loss, grad_norm) = self.trainer.step(&batch, lr).map_err(|e| {
            let t = &self.trainer;
            let available = device_memory(&t.rt);
            let args = argument_bytes_per_device(&t.program);
            let platform = t.rt.platform();
            explain_out_of_memory_on(
                e,
                "the training step",
                args,
                &t.spec,
                available,
                Some(&platform),
            )
        })?;
        let dt = t0.elapsed().as_secs_f64();
        self.state.step = step;
        let largest = self.trainer.last_max_weight.unwrap_or(0.0);
        let blown_up = self.trainer.last_update_blew_up();
        if !loss.is_finite() || !grad_norm.is_finite() || !largest.is_finite() || blown_up {
            self.metrics.nonfinite(step, loss, grad_norm)?;
            let what = if !(loss.is_finite() && grad_norm.is_finite()) {
                format!("the loss is {loss} and the gradient norm {grad_norm}")
            } else if !largest.is_finite() {
                format!("the loss ({loss}) and gradient norm ({grad_norm}) are finite but the update is not (it would make a LoRA weight {largest}, at lr {lr})")
            } else {
                let (moved, before) = self.trainer.last_update.unwrap_or_default();
                format!(
                    "the update blows the LoRA weights up: it would move one by {moved:.3e}, more than {} times the largest LoRA weight before it ({before:.3e}), at lr {lr:e} (lower --lr)",
                    crate::model::optim::BLOWN_UP
                )
            };
            if !opts.skip_nonfinite {
                self.state.step = step - 1;
                let dir = self.save_checkpoint()?;
                bail!("step {step}: {what}; stopped without applying it. The last good state (before step {step}) is in {} (--skip-nonfinite-steps skips such steps instead)", dir.display());
            }
            self.skipped += 1;
            progress::say(&format!("xtrain: step {step}: {what}; step skipped"));
            return Ok(());
        }
        self.metrics
            .step(step, loss, grad_norm, lr, self.state.epoch, dt)?;
        if opts.log_every > 0 {
            let tokens_per_s = self.tokens_per_step as f64 / dt;
            let every = step.is_multiple_of(opts.log_every) || step == total;
            shown.show(step, total, every, loss, tokens_per_s, lr);
        }
        if opts.eval_every > 0 && step.is_multiple_of(opts.eval_every) && step != total {
            self.evaluate(step)?;
        }
        if opts.save_every > 0 && step.is_multiple_of(opts.save_every) {
            self.save_checkpoint()?;
            let (lora_now, _) = self.trainer.state_to_host()?;
            save_adapter(
                &opts.out.join(format!("step-{step}")),
                &self.trainer.spec.lora,
                &lora_now,
                &self.base,
            )?;
        }
        Ok(())
    }

    /// Loss and exact-match accuracy on the held-out batches (if any), logged at `step`.
    fn evaluate(&mut self, step: u64) -> Result<()> {
        if self.eval_batches.is_empty() {
            return Ok(());
        }
        let r = self.trainer.evaluate(&self.eval_batches)?;
        self.metrics.eval(step, &r)
    }

    /// `OUT/checkpoint-<step>` of the current step.
    fn checkpoint_dir(&self) -> PathBuf {
        self.opts
            .out
            .join(format!("checkpoint-{}", self.state.step))
    }

    /// Save `OUT/checkpoint-<step>` for the current step.
    fn save_checkpoint(&self) -> Result<PathBuf> {
        let dir = self.checkpoint_dir();
        save_checkpoint(&dir, &self.trainer, &self.state, &self.base)?;
        Ok(dir)
    }

    /// The trained adapter in `OUT/adapter`, and the loss curve in `OUT/loss.png`.
    fn save(&self) -> Result<()> {
        let (lora_now, _) = self.trainer.state_to_host()?;
        save_adapter(
            &self.opts.out.join("adapter"),
            &self.trainer.spec.lora,
            &lora_now,
            &self.base,
        )?;
        if self.opts.plot {
            let path = self.opts.out.join("loss.png");
            let lora = &self.trainer.spec.lora;
            let title = format!(
                "{}: LoRA r={}, alpha {} ({})",
                self.opts
                    .model
                    .file_name()
                    .map_or(self.base.name.clone(), |n| n.to_string_lossy().into()),
                lora.r,
                lora.alpha,
                self.opts.out.display()
            );
            crate::train::plot::loss_curve(
                &path,
                &self.metrics.history,
                &self.metrics.eval_accuracy,
                &title,
            )?;
            eprintln!("xtrain: loss curve in {}", path.display());
        }
        Ok(())
    }
}

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
pub mod plot;
pub mod schedule;

use crate::data::{Batch, Source, TrainingData};
use crate::device::runtime::Runtime;
use crate::device::trainer::Trainer;
use crate::formats::host::element_type;
use crate::formats::peft::init_lora;
use crate::model::config::LlamaConfig;
use crate::model::lora::LoraConfig;
use crate::program::{self, Program, StepSpec};
use crate::train::checkpoint::{
    load_checkpoint, save_adapter, save_checkpoint, Checkpoint, TrainerState,
};
use crate::train::log::{Metrics, Progress};
use crate::train::options::TrainOptions;
use crate::train::schedule::Schedule;
use anyhow::{bail, Context, Result};
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// `xtrain train`: build (or load) the step, then train on the data, logging metrics,
/// evaluating, checkpointing and exporting the adapter.
pub fn run(opts: &TrainOptions) -> Result<()> {
    let interrupted = stop_on_signals()?;
    let cfg = LlamaConfig::load(&opts.model)?;
    check_out_dir(&opts.out)?;
    let data = crate::data::load(&opts.data, &opts.model, &cfg)?;
    let (rt, spec, program) = plan(opts, &cfg, data.batch, data.seq)?;
    let schedule = schedule(opts, &data.source);
    let start = starting_point(opts, &cfg, &spec.lora, &schedule)?;
    let weights = load_weights(opts, &cfg, &spec, &program)?;
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
    let mut run = Run {
        opts,
        metrics: Metrics::open(&opts.out, resumed_at, tokens_per_step)?,
        tokens_per_step,
        trainer,
        state,
        source,
        eval_batches,
        base: opts.model.to_string_lossy().to_string(),
    };
    if run.state.step == 0 {
        run.evaluate(0)?;
    }
    run.train(&interrupted)?;
    run.evaluate(run.state.step)?;
    run.save()
}

/// SIGINT/SIGTERM set the returned flag; the loop saves a checkpoint after the current step and
/// exits.
fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install signal handlers")?;
    }
    Ok(interrupted)
}

/// Fail before any work if the output dir cannot be written.
fn check_out_dir(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create output dir {}", out.display()))?;
    let probe = out.join(".xtrain-write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("output dir {} is not writable", out.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The executable a program dir holds, if it was compiled for this plugin and these devices;
/// otherwise the step is compiled here, and the reason is said.
fn prebuilt(
    rt: &Runtime,
    dir: &std::path::Path,
    program: &Program,
) -> Result<Option<crate::device::cache::Prebuilt>> {
    let Some((build, executable)) = crate::formats::program_dir::read_build(dir)? else {
        return Ok(None);
    };
    if let Err(why) = crate::device::cache::matches(rt, &build) {
        eprintln!(
            "xtrain: compiling the step of {} here: {why}",
            dir.display()
        );
        return Ok(None);
    }
    Ok(Some(crate::device::cache::Prebuilt {
        program_sha256: crate::formats::program_dir::sha256_hex(program.text.as_bytes()),
        executable,
        from: format!(
            "by `xtrain compile` for {} ({})",
            build.target,
            dir.join(crate::formats::program_dir::EXECUTABLE_FILE)
                .display()
        ),
    }))
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
        rt.prebuilt = prebuilt(&rt, dir, &program)?;
        return Ok((rt, spec, program));
    }
    let mut rt = open(opts.step.mesh.as_ref().map_or(1, |m| m.devices()))?;
    let spec = opts.step.spec(cfg.clone(), batch, seq, &rt.platform())?;
    if rt.platform() != "cpu" && opts.step.offload != Some(crate::program::Offload::NONE) {
        // On an accelerator: the least offload that fits its memory (--offload auto), or the one
        // asked for, checked against the device's and the host's memory before any weight loads.
        let choices = match opts.step.offload {
            Some(o) => vec![o],
            None => crate::program::Offload::AUTO_ORDER.to_vec(),
        };
        let (spec, program) = crate::device::offload::choose(
            &mut rt,
            &choices,
            |offload| {
                let s = StepSpec {
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

/// Where training starts: a checkpoint (`--resume`, trained with the same seed), or step 0 with
/// the adapter of `--init-adapter` (which must be the one the flags describe) or a fresh one.
fn starting_point(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    lora_cfg: &LoraConfig,
    schedule: &Schedule,
) -> Result<Checkpoint> {
    let (lora, moments, mut state) = match &opts.resume {
        Some(dir) => {
            let (w, m, st) = load_checkpoint(dir, cfg, lora_cfg)?;
            if st.seed != opts.seed {
                bail!(
                    "checkpoint {} was trained with --seed {}; resume with the same seed",
                    dir.display(),
                    st.seed
                );
            }
            (w, m, st)
        }
        None => {
            let w = match &opts.init_adapter {
                Some(dir) => initial_adapter(dir, cfg, lora_cfg)?,
                None => init_lora(cfg, lora_cfg, opts.seed),
            };
            (
                w,
                BTreeMap::new(),
                TrainerState {
                    step: 0,
                    epoch: 0,
                    position: 0,
                    seed: opts.seed,
                    schedule: schedule.clone(),
                },
            )
        }
    };
    state.schedule = schedule.clone();
    Ok((lora, moments, state))
}

/// The tensors of `--init-adapter`, refused unless its rank, alpha and targets are the flags'.
fn initial_adapter(
    dir: &Path,
    cfg: &LlamaConfig,
    lora_cfg: &LoraConfig,
) -> Result<BTreeMap<String, HostTensor>> {
    let c = crate::formats::peft::read_config(dir)?;
    if c.r != lora_cfg.r || c.targets != lora_cfg.targets || (c.alpha - lora_cfg.alpha).abs() > 1e-9
    {
        bail!(
            "--init-adapter {} has r={}, alpha={}, targets {:?}, but the flags ask for r={}, alpha={}, targets {:?}",
            dir.display(), c.r, c.alpha, c.targets, lora_cfg.r, lora_cfg.alpha, lora_cfg.targets
        );
    }
    crate::formats::peft::read_tensors(dir, cfg, lora_cfg)
}

/// The frozen weights from the checkpoint, in the program's layout and element type.
fn load_weights(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    spec: &StepSpec,
    program: &Program,
) -> Result<Vec<HostTensor>> {
    let frozen = program.frozen_shapes();
    let t_load = Instant::now();
    let weights = crate::formats::weights::load(
        &opts.model,
        cfg,
        &frozen,
        element_type(spec.weight_dtype),
        |_, _| {},
    )?;
    if opts.verbose {
        eprintln!(
            "xtrain: loaded {} weight tensors in {:.1}s",
            frozen.len(),
            t_load.elapsed().as_secs_f64()
        );
    }
    Ok(weights)
}

/// Compile the step (or load it from the cache) and upload the weights and the starting state.
fn compile_and_upload(
    opts: &TrainOptions,
    rt: Runtime,
    spec: StepSpec,
    program: Program,
    weights: Vec<HostTensor>,
    (lora, moments, state): &Checkpoint,
) -> Result<Trainer> {
    let mut trainer = Trainer::new(
        rt,
        spec,
        program,
        weights,
        lora,
        moments,
        opts.use_cache,
        opts.verbose,
    )?;
    trainer.dropout_seed = opts.seed;
    trainer.step = state.step;
    Ok(trainer)
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
    base: String,
    tokens_per_step: i64,
}

impl Run<'_> {
    /// The loop: one optimizer step per batch until the last step (or `--stop-after`), with
    /// progress, evaluation and checkpoints as asked. A signal ends it after the current step
    /// with a checkpoint (exit code 130).
    fn train(&mut self, interrupted: &AtomicBool) -> Result<()> {
        let progress = Progress {
            start: Instant::now(),
            tty: true,
            first_step: self.state.step + 1,
        };
        let total = self.state.schedule.total;
        let stop_at = self
            .opts
            .stop_after
            .map_or(total, |n| (self.state.step + n).min(total));
        while self.state.step < stop_at {
            if interrupted.load(Ordering::SeqCst) {
                let dir = self.save_checkpoint()?;
                eprintln!(
                    "\nxtrain: interrupted after step {}; saved {} (continue with --resume {})",
                    self.state.step,
                    dir.display(),
                    dir.display()
                );
                std::process::exit(130);
            }
            self.step(&progress)?;
        }
        Ok(())
    }

    /// One step: run it on the next batch, then log it, evaluate and checkpoint as asked. A step
    /// whose loss or gradient is not finite changed nothing (the program's finite guard): it is
    /// skipped with `--skip-nonfinite-steps`, else the run stops with the last good state saved.
    fn step(&mut self, progress: &Progress) -> Result<()> {
        let opts = self.opts;
        let total = self.state.schedule.total;
        let step = self.state.step + 1;
        let batch = self
            .source
            .next(opts.seed, &mut self.state.epoch, &mut self.state.position);
        let lr = self.state.schedule.at(step);
        let t0 = Instant::now();
        let (loss, grad_norm) = self.trainer.step(&batch, lr)?;
        let dt = t0.elapsed().as_secs_f64();
        self.state.step = step;
        if !loss.is_finite() || !grad_norm.is_finite() {
            self.metrics.nonfinite(step, loss, grad_norm)?;
            if !opts.skip_nonfinite {
                self.state.step = step - 1;
                let dir = self.save_checkpoint()?;
                bail!("step {step}: the loss is {loss} and the gradient norm {grad_norm}; stopped without applying it. The last good state is in {} (--skip-nonfinite-steps skips such steps instead)", dir.display());
            }
            eprintln!("xtrain: step {step}: non-finite loss {loss} / gradient norm {grad_norm}; step skipped");
            return Ok(());
        }
        self.metrics
            .step(step, loss, grad_norm, lr, self.state.epoch, dt)?;
        if opts.log_every > 0 && (step.is_multiple_of(opts.log_every) || step == total) {
            let tokens_per_s = self.tokens_per_step as f64 / dt;
            progress.show(step, total, loss, tokens_per_s, lr);
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

    /// `OUT/checkpoint-<step>` for the current step.
    fn save_checkpoint(&self) -> Result<PathBuf> {
        let dir = self
            .opts
            .out
            .join(format!("checkpoint-{}", self.state.step));
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
            crate::train::plot::loss_curve(&path, &self.metrics.history)?;
            eprintln!("xtrain: loss curve in {}", path.display());
        }
        Ok(())
    }
}

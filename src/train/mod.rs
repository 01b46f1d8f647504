//! Recipes: `xtrain train` ([`run`]), a fine-tuning run a person can read top to bottom, and
//! `xtrain bench` ([`bench`](mod@bench)). A run loads the model's config, reads the data, prepares the step
//! (or takes a compiled program dir) for the plugin, decides where training starts (fresh, an
//! initial adapter, or a checkpoint), loads the frozen weights, compiles and uploads, then loops:
//! step, log, evaluate, checkpoint; and saves the adapter and the loss curve at the end. It owns
//! the run's options, schedule, checkpoints, metrics and plot. It may use everything below it
//! (`device`, `data`, `formats`, `program`, `model`); only the command line uses it.

pub mod bench;
pub mod checkpoint;
mod finish;
mod hosts;
pub mod log;
pub mod options;
pub mod output;
pub mod plot;
mod preference;
mod prepare;
pub mod progress;
pub mod schedule;
pub mod settings;
mod start;
pub mod tensorboard;
mod upload;

pub use prepare::{one_process, prepare};

use crate::data::{Batch, Source, TrainingData};
use crate::device::memory::fit::{argument_bytes_per_device, explain_out_of_memory_on};
use crate::device::trainer::Trainer;
use crate::formats::weights::CheckpointWeights;
use crate::model::config::LlamaConfig;
use crate::train::checkpoint::{save_adapter, save_checkpoint, TrainerState};
use crate::train::finish::Finished;
use crate::train::log::Metrics;
use crate::train::options::TrainOptions;
use crate::train::output::RunDir;
use crate::train::schedule::Schedule;
use anyhow::{bail, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// `xtrain train`: build (or load) the step, then train on the data, logging metrics,
/// evaluating, checkpointing and exporting the adapter.
pub fn run(opts: &TrainOptions) -> Result<()> {
    let signals = finish::stop_on_signals()?;
    opts.validate_values()?;
    let mut opts = opts.clone();
    // What the settings taken from a checkpoint or a program dir were: said once the run starts.
    let mut notes = Vec::new();
    opts.settle_length(&mut notes)?;
    settings::take_recorded_paths(&mut opts, &mut notes)?;
    let cfg = LlamaConfig::load(&opts.model)?;
    settings::settle(&mut opts, &cfg, &mut notes)?;
    opts.validate()?;
    signals.set_out(&opts.out);
    for (flag, note) in opts.step.idle_result_types() {
        if opts.given(flag) {
            notes.push(note);
        }
    }
    let opts = &opts;
    let launch = crate::cluster::launch::from_environment(&opts.launch)?;
    for n in &launch.notes {
        crate::esay!("xtrain: note: {n}");
    }
    if let Some(w) = launch.warning() {
        crate::esay!("xtrain: {w}");
    }
    if !launch.is_single() {
        signals.end_at_once(launch.name());
        // Before the output dir is claimed: process 0 alone will write there.
        let (team, out) = hosts::meet(opts, &launch, notes)?;
        let finished = run_in(opts, &cfg, &signals, out.as_ref(), Some(&team));
        return hosts::end(opts, team, out, finished);
    }
    crate::formats::outdir::refuse_inputs_inside("--out", &opts.out, &opts.inputs())?;
    let out = RunDir::claim(&opts.out, opts.resume.as_deref(), opts.overwrite)?;
    // Shared with what abandons the compile on a signal (see finish::abandon).
    let out = Arc::new(Mutex::new(out));
    for n in notes {
        crate::esay!("xtrain: note: {n}");
    }
    let finished = run_in(opts, &cfg, &signals, Some(&out), None);
    let mut out = finish::locked(&out);
    finish::end(opts, &mut out, finished)
}

/// The run once its options are settled and its output dir is claimed (by this process: `out`;
/// None in a process of a run of several other than process 0, which writes nothing). `team`:
/// this process's part in a run of several.
fn run_in(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    signals: &finish::Signals,
    out: Option<&Arc<Mutex<RunDir>>>,
    team: Option<&hosts::Team>,
) -> Result<Finished> {
    // Time to the first step counts from here: reading the data, planning, compiling, loading.
    let began = Instant::now();
    let stop = || signals.stop() && team.is_none();
    let data = crate::data::load(&opts.data, &opts.model, cfg)?;
    let data_s = began.elapsed().as_secs_f64();
    if stop() {
        return Ok(Finished::Interrupted(None));
    }
    let (rt, spec, program) = prepare::prepare_with(opts, cfg, data.batch, data.seq, |devices| {
        hosts::open(opts, team, devices)
    })
    .map_err(|e| opts.name_the_source(e))?;
    if spec.key_block.is_some() {
        // The attention's form decides its speed and memory at long context: said as compile
        // says it.
        crate::esay!("xtrain: form: {}", spec.form());
    }
    let schedule = schedule(opts, &data.source);
    warn_about_the_schedule(opts, &schedule);
    let start = start::starting_point(opts, cfg, &spec.lora, &schedule, &data)?;
    if opts.resume.is_some() && start.state.step >= schedule.total && team.is_none() {
        // Complete: the adapter is written again from the checkpoint, without loading the
        // weights or compiling the step for nothing (minutes on a large model).
        let base = crate::formats::peft::base_model(&opts.model);
        save_adapter(&opts.out.join("adapter"), &spec, &start.lora, &base)?;
        return Ok(Finished::Complete);
    }
    let weights = load_weights(opts, cfg)?;
    if stop() {
        return Ok(Finished::Interrupted(None));
    }
    let abandon: finish::Abandon = match out {
        Some(out) => finish::abandon(opts, out, "compiling the step and loading the weights"),
        None => Box::new(|| signal_hook::low_level::exit(finish::interrupted_code())),
    };
    let mut trainer = signals.abandonable(abandon, || {
        upload::compile_and_upload(opts, rt, spec, program, weights, &start)
    })?;
    let state = start.state;
    let TrainingData {
        mut source,
        eval_batches,
        batch,
        seq,
    } = data;
    let reference_logps =
        preference::reference(&mut trainer, start.reference.as_ref(), &mut source)?;
    let tokens_per_step = batch * seq * trainer.spec.rows_per_example();
    let resumed_at = opts.resume.is_some().then_some(state.step);
    // Only process 0 of a run of several writes metrics (every process reads the same loss).
    let writes = team.is_none_or(|t| t.process() == 0);
    let mut metrics = match writes {
        true => Some(Metrics::open(&opts.out, resumed_at, tokens_per_step)?),
        false => None,
    };
    if let Some(metrics) = &mut metrics {
        let mut before = before_first_step(&trainer);
        before["data_s"] = data_s.into();
        metrics.first_step = Some((began, before));
        metrics.mfu_seconds = opts.peak_tflops.map(|peak| {
            let spec = &trainer.spec;
            let devices = spec.mesh.as_ref().map_or(1, |m| m.devices()) as f64;
            crate::program::flops::model_flops_per_step(spec) / (peak * 1e12 * devices)
        });
    }
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
        team,
        loaders: Vec::new(),
        reference: start.reference,
    };
    for _ in 1..opts.launch.virtual_hosts.unwrap_or(1) {
        let mut source = crate::data::load(&opts.data, &opts.model, cfg)?.source;
        if let Some(logps) = &reference_logps {
            source.set_reference(logps)?;
        }
        run.loaders.push(Loader {
            source,
            epoch: run.state.epoch,
            position: run.state.position,
        });
    }
    if stop() {
        return Ok(Finished::Interrupted(None));
    }
    if run.state.step == 0 {
        run.evaluate_first()?;
    }
    let first = run.state.step;
    let finished = run.train(&signals.interrupted)?;
    let taken = run.state.step - first;
    finish::check_skipped(run.skipped, taken, first)?;
    match finished {
        Some(done) => Ok(done),
        None => {
            run.evaluate(run.state.step)?;
            run.save()?;
            Ok(Finished::Complete)
        }
    }
}

/// The warnings about what the flags make of the run's schedule: a warmup or checkpoint interval
/// longer than the run, and an lr of 0.
fn warn_about_the_schedule(opts: &TrainOptions, schedule: &Schedule) {
    if schedule.warmup > schedule.total {
        crate::esay!(
            "xtrain: warning: --warmup {} is longer than the run ({} steps): the learning rate rises to {:e} at the last step and never reaches --lr {:e}",
            schedule.warmup,
            schedule.total,
            schedule.at(schedule.total),
            schedule.lr
        );
    }
    if opts.lr == 0.0 {
        crate::esay!(
            "xtrain: warning: --lr 0: every update is zero, so the adapter leaves the run as it \
             came (the run only measures the loss)"
        );
    }
    if opts.save_every > schedule.total {
        crate::esay!(
            "xtrain: warning: --save-every {} is longer than the run ({} steps): no checkpoint is written along the way (Ctrl-C still writes one; a killed run starts over)",
            opts.save_every, schedule.total
        );
    }
}

/// What a blown-up update's message advises: `--lr`, and the weight decay when it is large
/// enough to move a weight by more than itself each step (lr x decay of it).
fn what_to_lower(opts: &TrainOptions) -> String {
    let decay = opts.step.adam.weight_decay;
    if decay * opts.lr > 1.0 {
        format!(
            "lower --weight-decay {decay:e}: at lr {:e} it moves each weight by more than itself",
            opts.lr
        )
    } else {
        "lower --lr".to_string()
    }
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

/// The checkpoint's frozen weights, opened and checked against the config; they are read one
/// device's shard at a time as they are uploaded (`upload::compile_and_upload`).
fn load_weights(opts: &TrainOptions, cfg: &LlamaConfig) -> Result<CheckpointWeights> {
    CheckpointWeights::open(&opts.model, cfg)
}

/// Where the time before the first step went: loading the frozen weights (and its split into
/// reading, converting or quantizing, and uploading, which overlap) and compiling the step (or
/// loading it from the executable cache). `metrics.jsonl` keeps it in the first step's line.
fn before_first_step(t: &Trainer) -> serde_json::Value {
    let l = &t.loading;
    serde_json::json!({
        "load_s": l.wall_s,
        "read_s": l.read.read_s,
        "convert_s": l.read.convert_s,
        "quantize_s": l.read.quantize_s,
        "upload_s": l.upload_s,
        "compile_s": t.compile_s,
        "compile": if t.compile_cached { "cache hit" } else { "compiled" },
    })
}

/// The progress of the loop: a bar on a terminal (its message updated every `--log-every`
/// steps), else a plain line every `--log-every` steps.
struct Shown {
    bar: Option<indicatif::ProgressBar>,
    start: Instant,
    first_step: u64,
}

impl Shown {
    #[allow(clippy::too_many_arguments)]
    fn show(
        &self,
        step: u64,
        total: u64,
        every: bool,
        loss: f32,
        tokens_per_s: f64,
        lr: f64,
        pairs: &str,
    ) {
        let Some(bar) = &self.bar else { return };
        let what = format!("loss {loss:.4}{pairs} lr {lr:.2e} {tokens_per_s:.0} tok/s");
        if progress::drawn() {
            bar.set_position(step);
            if every {
                bar.set_message(what);
            }
        } else if every {
            let done = (step + 1 - self.first_step) as f64;
            let eta = self.start.elapsed().as_secs_f64() / done * (total - step) as f64;
            crate::esay!("step {step}/{total} {what} eta {eta:.0}s");
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
    /// None in a process of a run of several other than process 0.
    metrics: Option<Metrics>,
    /// The base model as adapters name it.
    base: crate::formats::peft::BaseModel,
    tokens_per_step: i64,
    /// Steps of this invocation skipped by `--skip-nonfinite-steps`.
    skipped: u64,
    /// This process's part in a run of several (None: a run of one process).
    team: Option<&'a hosts::Team>,
    /// `--virtual-hosts P`: the loaders of hosts 1..P, each reading the data itself as a
    /// separate host would (host 0's is `source`).
    loaders: Vec<Loader>,
    /// A DPO run's reference adapter (`--reference start`), kept in its checkpoints.
    reference: Option<std::collections::BTreeMap<String, pjrt::HostTensor>>,
}

/// A host's own loader of the training rows, and where it stands in them.
struct Loader {
    source: Source,
    epoch: u64,
    position: u64,
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
            if interrupted.load(Ordering::SeqCst) && self.team.is_some() {
                // The processes of a run cannot agree on a step to stop at: this one ends now,
                // and the others with it (they see it leave).
                shown.finish();
                bail!(
                    "interrupted at step {}: a run of several processes stops at once; resume \
                     it from its newest committed checkpoint with --resume",
                    self.state.step
                );
            }
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
            // Every process of a run of several decides alike, whatever its file system shows
            // (saving gathers from all of them).
            let saved = self.opts.save_every > 0
                && self.state.step.is_multiple_of(self.opts.save_every)
                && (self.team.is_some() || dir.is_dir());
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
        // Where the data stood before this step's batch: a step that is not applied is not
        // taken, and a checkpoint saved for it resumes with this batch.
        let before = (self.state.epoch, self.state.position);
        let batch = self
            .source
            .next(opts.seed, &mut self.state.epoch, &mut self.state.position);
        let mut batches = vec![batch];
        for (g, h) in self.loaders.iter_mut().enumerate() {
            batches.push(h.source.next(opts.seed, &mut h.epoch, &mut h.position));
            if (h.epoch, h.position) != (self.state.epoch, self.state.position) {
                bail!(
                    "virtual host {}'s loader is at epoch {} row {}, host 0's at epoch {} row {}: \
                     every host must read the data in the same order",
                    g + 1,
                    h.epoch,
                    h.position,
                    self.state.epoch,
                    self.state.position
                );
            }
        }
        let lr = self.state.schedule.at(step);
        let t0 = Instant::now();
        let on_hosts: Vec<&Batch> = batches.iter().collect();
        let (loss, grad_norm) = self.trainer.step_on_hosts(&on_hosts, lr).map_err(|e| {
            let t = &self.trainer;
            let available = upload::device_memory(&t.rt);
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
            if let Some(m) = &mut self.metrics {
                m.nonfinite(step, loss, grad_norm)?;
            }
            let what = if !(loss.is_finite() && grad_norm.is_finite()) {
                format!("the loss is {loss} and the gradient norm {grad_norm}")
            } else if !largest.is_finite() {
                format!("the loss ({loss}) and gradient norm ({grad_norm}) are finite but the update is not (it would make a LoRA weight {largest}, at lr {lr})")
            } else {
                let (moved, before) = self.trainer.last_update.unwrap_or_default();
                format!(
                    "the update blows the LoRA weights up: it would move one by {moved:.3e}, more than {} times the largest LoRA weight before it ({before:.3e}), at lr {lr:e} ({})",
                    crate::model::optim::BLOWN_UP,
                    what_to_lower(opts)
                )
            };
            if !opts.skip_nonfinite {
                self.state.step = step - 1;
                (self.state.epoch, self.state.position) = before;
                for h in &mut self.loaders {
                    (h.epoch, h.position) = before;
                }
                let dir = self.save_checkpoint()?;
                bail!(
                    "step {step}: {what}; stopped without applying it. The last good state \
                     (before step {step}) is in {dir}: `--resume {dir}` continues with the same \
                     settings, and a new run from it with others (a lower --lr) takes \
                     `--init-adapter {dir}` and another --out (--skip-nonfinite-steps skips such \
                     steps instead)",
                    dir = crate::formats::shell::path(&dir)
                );
            }
            self.skipped += 1;
            progress::say(&format!("xtrain: step {step}: {what}; step skipped"));
            return Ok(());
        }
        let pairs = preference::step_metrics(&self.trainer, &batches[0])?;
        if let Some(m) = &mut self.metrics {
            m.step(
                step,
                loss,
                grad_norm,
                lr,
                self.state.epoch,
                dt,
                pairs.as_ref(),
            )?;
        }
        if opts.log_every > 0 {
            let tokens_per_s = self.tokens_per_step as f64 / dt;
            let every = step.is_multiple_of(opts.log_every) || step == total;
            let extra = preference::shown(pairs.as_ref());
            shown.show(step, total, every, loss, tokens_per_s, lr, &extra);
        }
        if opts.eval_every > 0 && step.is_multiple_of(opts.eval_every) && step != total {
            self.evaluate(step)?;
        }
        if opts.save_every > 0 && step.is_multiple_of(opts.save_every) {
            self.save_checkpoint()?;
            let Some((lora_now, _)) = self.trainer.state_on_host()? else {
                return Ok(());
            };
            save_adapter(
                &opts.out.join(format!("step-{step}")),
                &self.trainer.spec,
                &lora_now,
                &self.base,
            )?;
        }
        Ok(())
    }

    /// Loss and exact-match accuracy on the held-out batches (if any), logged at `step`.
    /// The step-0 evaluation, part of the time to the first step (on a large held-out set
    /// most of it): said apart, as `eval_s` in the first step's line.
    fn evaluate_first(&mut self) -> Result<()> {
        let t0 = Instant::now();
        self.evaluate(0)?;
        if let Some((_, before)) = self.metrics.as_mut().and_then(|m| m.first_step.as_mut()) {
            before["eval_s"] = t0.elapsed().as_secs_f64().into();
        }
        Ok(())
    }

    fn evaluate(&mut self, step: u64) -> Result<()> {
        if self.eval_batches.is_empty() {
            return Ok(());
        }
        if self.trainer.spec.dpo.is_some() {
            let m = self.trainer.evaluate_pairs(&self.eval_batches)?;
            return match &mut self.metrics {
                Some(metrics) => metrics.eval_pairs(step, &m),
                None => Ok(()),
            };
        }
        match (
            self.trainer.evaluate(&self.eval_batches)?,
            &mut self.metrics,
        ) {
            (Some(r), Some(m)) => m.eval(step, &r),
            _ => Ok(()),
        }
    }

    /// This process's part in a run of several, as a checkpoint's writers.
    fn team(&self) -> Option<&dyn checkpoint::Team> {
        self.team.map(|t| t as &dyn checkpoint::Team)
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
        save_checkpoint(
            &dir,
            &self.trainer,
            &self.state,
            &self.base,
            self.team(),
            self.reference.as_ref(),
        )?;
        Ok(dir)
    }

    /// The trained adapter in `OUT/adapter`, and the loss curve in `OUT/loss.png`.
    fn save(&self) -> Result<()> {
        let Some((lora_now, _)) = self.trainer.state_on_host()? else {
            return Ok(());
        };
        let Some(metrics) = &self.metrics else {
            return Ok(());
        };
        save_adapter(
            &self.opts.out.join("adapter"),
            &self.trainer.spec,
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
                &metrics.history,
                &metrics.eval_accuracy,
                &title,
            )?;
            crate::esay!("xtrain: loss curve in {}", path.display());
        }
        Ok(())
    }
}

//! The training loop: compile the step once, upload the frozen weights once, then feed batches,
//! log metrics and write PEFT adapters.

pub mod bench;
pub mod checkpoint;
pub mod log;
pub mod options;
pub mod plot;
pub mod schedule;

use crate::data::{mask_repeats, read_rows, Batch, Row, Source};
use crate::device::runtime::Runtime;
use crate::device::trainer::{EvalResult, Trainer};
use crate::formats::host::element_type;
use crate::formats::peft::init_lora;
use crate::model::config::LlamaConfig;
use crate::program::{self, Program, StepSpec};
use crate::train::checkpoint::{load_checkpoint, save_adapter, save_checkpoint, TrainerState};
use crate::train::log::Progress;
use crate::train::options::TrainOptions;
use crate::train::schedule::Schedule;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

/// `xtrain train`: build (or load) the step, then train on the data, logging metrics,
/// evaluating, checkpointing and exporting the adapter.
pub fn run(opts: &TrainOptions) -> Result<()> {
    // SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the current step and exits.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install signal handlers")?;
    }
    let cfg = LlamaConfig::load(&opts.model)?;
    // Fail before any work if the output dir cannot be written.
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create output dir {}", opts.out.display()))?;
    let probe = opts.out.join(".xtrain-write-test");
    std::fs::write(&probe, b"ok")
        .with_context(|| format!("output dir {} is not writable", opts.out.display()))?;
    let _ = std::fs::remove_file(&probe);

    let is_batch_file = opts.data.extension().is_some_and(|e| e == "safetensors");
    let (mut source, eval_batches, seq) = if is_batch_file {
        let batch = Batch::from_safetensors(&opts.data)?;
        batch.check_vocab(cfg.vocab_size)?;
        let seq = batch.dims().1;
        (Source::Fixed(batch), Vec::new(), seq)
    } else {
        let tok = crate::data::text::TextTokenizer::load(&opts.model)?;
        if tok.vocab_size() as i64 > cfg.vocab_size {
            bail!(
                "the tokenizer has {} tokens but the model's vocabulary is {}",
                tok.vocab_size(),
                cfg.vocab_size
            );
        }
        let examples = read_rows(&opts.data, &tok, opts.skip_bad_lines, opts.train_on_prompt)?;
        let (train_ex, eval_ex) = match &opts.eval_data {
            Some(p) => (
                examples,
                read_rows(p, &tok, opts.skip_bad_lines, opts.train_on_prompt)?,
            ),
            None => crate::data::split_eval(&examples, opts.eval_fraction),
        };
        let seq = opts.seq as usize;
        let (rows, report) =
            crate::data::make_rows(&train_ex, seq, opts.pack, tok.pad_id, opts.strict_length)?;
        if report.truncated > 0 {
            eprintln!(
                "xtrain: truncated {} examples to --seq {seq}",
                report.truncated
            );
        }
        if rows.len() < opts.batch_size as usize {
            bail!(
                "{} gives {} rows of {seq} tokens, fewer than one batch of {}",
                opts.data.display(),
                rows.len(),
                opts.batch_size
            );
        }
        // Eval rows are never packed, so that each row is one example (accuracy is per example).
        let (eval_rows, _) = crate::data::make_rows(&eval_ex, seq, false, tok.pad_id, false)?;
        let b = opts.batch_size as usize;
        let eval_batches: Vec<Batch> = eval_rows
            .chunks(b)
            .map(|c| {
                let mut refs: Vec<&Row> = c.iter().collect();
                while refs.len() < b {
                    refs.push(&c[0]); // pad the last batch by repeating; repeated rows are skipped below
                }
                crate::data::batch(&refs)
            })
            .collect();
        let eval_batches = mask_repeats(eval_batches, eval_rows.len(), b);
        (
            Source::Rows {
                rows,
                batch: b,
                order: None,
            },
            eval_batches,
            seq as i64,
        )
    };
    let bs = match &source {
        Source::Fixed(b) => b.dims().0,
        Source::Rows { batch, .. } => *batch as i64,
    };
    let (spec, program) = plan(opts, &cfg, bs, seq)?;
    let lora_cfg = spec.lora.clone();
    let total = if opts.steps > 0 {
        opts.steps
    } else {
        source.steps_per_epoch() * opts.epochs.max(1)
    };
    let schedule = Schedule {
        lr: opts.lr,
        warmup: opts.warmup,
        kind: opts.schedule.clone(),
        min_ratio: opts.min_lr_ratio,
        total,
    };

    let (lora, moments, mut state) = match &opts.resume {
        Some(dir) => {
            let (w, m, st) = load_checkpoint(dir, &cfg, &lora_cfg)?;
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
                Some(dir) => {
                    let c = crate::formats::peft::read_config(dir)?;
                    if c.r != lora_cfg.r
                        || c.targets != lora_cfg.targets
                        || (c.alpha - lora_cfg.alpha).abs() > 1e-9
                    {
                        bail!(
                            "--init-adapter {} has r={}, alpha={}, targets {:?}, but the flags ask for r={}, alpha={}, targets {:?}",
                            dir.display(), c.r, c.alpha, c.targets, lora_cfg.r, lora_cfg.alpha, lora_cfg.targets
                        );
                    }
                    crate::formats::peft::read_tensors(dir, &cfg, &lora_cfg)?
                }
                None => init_lora(&cfg, &lora_cfg, opts.seed),
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

    let frozen = program.frozen_shapes();
    let t_load = Instant::now();
    let weights = crate::formats::weights::load(
        &opts.model,
        &cfg,
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
    // A CPU plugin gets as many virtual devices as the mesh needs; an accelerator plugin has
    // what it has, and compiling checks that there are enough.
    let rt = Runtime::open(opts.plugin.as_deref(), Some(program.partitions.max(1)))?;
    let mut trainer = Trainer::new(
        rt,
        spec,
        program,
        weights,
        &lora,
        &moments,
        opts.use_cache,
        opts.verbose,
    )?;
    trainer.dropout_seed = opts.seed;
    trainer.step = state.step;

    // metrics.jsonl: on resume keep the lines up to the checkpoint's step.
    let metrics_path = opts.out.join("metrics.jsonl");
    let mut kept = String::new();
    if opts.resume.is_some() {
        if let Ok(old) = std::fs::read_to_string(&metrics_path) {
            for line in old.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
                if v.get("step")
                    .and_then(|s| s.as_u64())
                    .is_some_and(|s| s <= state.step)
                {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
    }
    std::fs::write(&metrics_path, &kept)
        .with_context(|| format!("cannot write {}", metrics_path.display()))?;
    let mut metrics = std::fs::OpenOptions::new()
        .append(true)
        .open(&metrics_path)?;
    let base = opts.model.to_string_lossy().to_string();
    let mut history: Vec<(u64, f64, Option<f64>)> = Vec::new();

    let log_eval = |trainer: &mut Trainer,
                    metrics: &mut std::fs::File,
                    step: u64|
     -> Result<Option<EvalResult>> {
        if eval_batches.is_empty() {
            return Ok(None);
        }
        let r = trainer.evaluate(&eval_batches)?;
        writeln!(
            metrics,
            "{}",
            serde_json::json!({"step": step, "eval_loss": r.loss, "eval_accuracy": r.accuracy, "eval_rows": r.rows})
        )?;
        eprintln!(
            "eval at step {step}: loss {:.4}, exact-match accuracy {:.1}% of {} rows",
            r.loss,
            100.0 * r.accuracy,
            r.rows
        );
        Ok(Some(r))
    };
    if state.step == 0 {
        if let Some(r) = log_eval(&mut trainer, &mut metrics, 0)? {
            history.push((0, f64::NAN, Some(r.loss)));
        }
    }
    let progress = Progress {
        start: Instant::now(),
        tty: true,
        first_step: state.step + 1,
    };
    let tokens_per_step = bs * seq;
    let stop_at = opts
        .stop_after
        .map_or(total, |n| (state.step + n).min(total));
    let mut recent: Vec<f32> = Vec::new();
    while state.step < stop_at {
        if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
            let dir = opts.out.join(format!("checkpoint-{}", state.step));
            save_checkpoint(&dir, &trainer, &state, &base)?;
            eprintln!(
                "\nxtrain: interrupted after step {}; saved {} (continue with --resume {})",
                state.step,
                dir.display(),
                dir.display()
            );
            std::process::exit(130);
        }
        let step = state.step + 1;
        let batch = source.next(opts.seed, &mut state.epoch, &mut state.position);
        let lr = schedule.at(step);
        let t0 = Instant::now();
        let (loss, grad_norm) = trainer.step(&batch, lr)?;
        let dt = t0.elapsed().as_secs_f64();
        state.step = step;
        if !loss.is_finite() || !grad_norm.is_finite() {
            // The step left the state as it was (see the program's finite guard).
            writeln!(
                metrics,
                "{}",
                serde_json::json!({"step": step, "nonfinite": true, "loss": loss.to_string(), "grad_norm": grad_norm.to_string()})
            )?;
            if !opts.skip_nonfinite {
                state.step = step - 1;
                let dir = opts.out.join(format!("checkpoint-{}", state.step));
                save_checkpoint(&dir, &trainer, &state, &base)?;
                bail!("step {step}: the loss is {loss} and the gradient norm {grad_norm}; stopped without applying it. The last good state is in {} (--skip-nonfinite-steps skips such steps instead)", dir.display());
            }
            eprintln!("xtrain: step {step}: non-finite loss {loss} / gradient norm {grad_norm}; step skipped");
            continue;
        }
        if recent.len() >= 5 {
            let mean = recent.iter().sum::<f32>() / recent.len() as f32;
            if loss > 2.0 * mean + 1.0 {
                eprintln!("xtrain: loss spike at step {step}: {loss:.4} against a recent mean of {mean:.4}");
                writeln!(
                    metrics,
                    "{}",
                    serde_json::json!({"step": step, "loss_spike": loss, "recent_mean": mean})
                )?;
            }
        }
        recent.push(loss);
        if recent.len() > 20 {
            recent.remove(0);
        }
        writeln!(
            metrics,
            "{}",
            serde_json::json!({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "epoch": state.epoch, "tokens": tokens_per_step, "step_time_s": dt})
        )?;
        metrics.flush()?;
        history.push((step, loss as f64, None));
        if opts.log_every > 0 && (step % opts.log_every == 0 || step == total) {
            progress.show(step, total, loss, tokens_per_step as f64 / dt, lr);
        }
        if opts.eval_every > 0 && step % opts.eval_every == 0 && step != total {
            if let Some(r) = log_eval(&mut trainer, &mut metrics, step)? {
                history.push((step, f64::NAN, Some(r.loss)));
            }
        }
        if opts.save_every > 0 && step % opts.save_every == 0 {
            save_checkpoint(
                &opts.out.join(format!("checkpoint-{step}")),
                &trainer,
                &state,
                &base,
            )?;
            let (lora_now, _) = trainer.state_to_host()?;
            save_adapter(
                &opts.out.join(format!("step-{step}")),
                &lora_cfg,
                &lora_now,
                &base,
            )?;
        }
    }
    if let Some(r) = log_eval(&mut trainer, &mut metrics, state.step)? {
        history.push((state.step, f64::NAN, Some(r.loss)));
    }
    let (lora_now, _) = trainer.state_to_host()?;
    save_adapter(&opts.out.join("adapter"), &lora_cfg, &lora_now, &base)?;
    if opts.plot {
        let path = opts.out.join("loss.png");
        crate::train::plot::loss_curve(&path, &history)?;
        eprintln!("xtrain: loss curve in {}", path.display());
    }
    Ok(())
}

/// Build the step spec for a model and batch shape from the options, or take it from a program
/// dir (checking that the program was built for this model and batch).
pub fn plan(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    batch: i64,
    seq: i64,
) -> Result<(StepSpec, Program)> {
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
        return Ok((spec, program));
    }
    let dtype = match opts.dtype.as_str() {
        "f32" => hlo::DType::F32,
        "bf16" => hlo::DType::BF16,
        other => bail!("--dtype must be f32 or bf16, got `{other}`"),
    };
    let spec = StepSpec {
        model: cfg.clone(),
        lora: opts.lora.clone(),
        adam: opts.adam.clone(),
        batch,
        seq,
        weight_dtype: dtype,
        compute_dtype: dtype,
        remat: opts.remat,
        microbatches: opts.microbatches,
        mesh: opts.mesh.clone(),
        nf4: opts.nf4,
        loss_chunk: opts.loss_chunk,
        attention_block: opts.attention_block,
        wide_matmul_results: crate::device::platform::wide_matmul_results(
            &opts.matmul_result,
            opts.plugin.as_deref(),
        )?,
    };
    let program = program::build_train_step(&spec)?;
    Ok((spec, program))
}

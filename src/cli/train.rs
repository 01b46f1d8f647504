//! `xtrain train`: the flags, turned into [`TrainOptions`] for [`xtrain::train::run`].

use crate::cli::args::StepArgs;
use anyhow::{bail, Result};
use clap::Args;
use std::collections::BTreeSet;
use std::path::PathBuf;
use xtrain::data::{Columns, DataOptions};
use xtrain::train::options::TrainOptions;

#[derive(Args)]
pub struct TrainArgs {
    /// A TOML recipe whose keys are these flags (`lora_r = 16`, `no_pack = true`); flags on the
    /// command line override it (see recipes/).
    #[arg(long, value_name = "FILE", help_heading = "Model")]
    #[allow(dead_code)] // read before parsing, by config::expand
    pub config: Option<PathBuf>,
    /// The model: a Hugging Face model directory (config.json + safetensors [+ tokenizer.json for
    /// text]), or a repo id (org/name) found in the Hugging Face hub cache, else downloaded into it.
    #[arg(long, help_heading = "Model")]
    pub model: Option<PathBuf>,
    /// With a repo id: the branch, tag or commit (default main).
    #[arg(long, help_heading = "Model")]
    pub revision: Option<String>,
    /// Training data: a .jsonl or .parquet file ({"text"}, alpaca {"instruction","input","output"}
    /// or chat {"messages"} rows), or a .safetensors file with one pre-tokenized batch
    /// (input_ids, labels, attention_mask) used for every step.
    #[arg(long, help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// The Parquet column (or JSONL key) that holds plain text (default `text`).
    #[arg(long, help_heading = "Data")]
    pub text_column: Option<String>,
    /// The Parquet column (or JSONL key) that holds chat messages (default `messages`).
    #[arg(long, help_heading = "Data")]
    pub messages_column: Option<String>,
    /// Start from this PEFT adapter instead of a fresh one.
    #[arg(long, help_heading = "Model")]
    pub init_adapter: Option<PathBuf>,
    /// Continue from a checkpoint dir (OUT/checkpoint-N): adapter, optimizer state, step, data
    /// position, and every setting of its run (model, data, eval data, output dir, schedule,
    /// cadence of saving and evaluation...): `xtrain train --resume DIR` alone continues the run
    /// exactly as if it had not stopped.
    #[arg(long, help_heading = "Model")]
    pub resume: Option<PathBuf>,
    /// Number of optimizer steps (0 = --epochs over the data).
    #[arg(long, default_value_t = 0, help_heading = "Schedule")]
    pub steps: u64,
    /// Passes over the data when --steps is 0.
    #[arg(long, default_value_t = 1, help_heading = "Schedule")]
    pub epochs: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-4, help_heading = "Optimizer")]
    pub lr: f64,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 0, help_heading = "Schedule")]
    pub warmup: u64,
    /// Learning-rate decay after warmup: constant, linear or cosine.
    #[arg(long, default_value = "constant", help_heading = "Schedule")]
    pub schedule: String,
    /// Where a linear or cosine decay heads, as a fraction of --lr (the rate of the step after
    /// the last).
    #[arg(long, default_value_t = 0.0, help_heading = "Schedule")]
    pub min_lr_ratio: f64,
    #[command(flatten)]
    pub step: StepArgs,
    /// Rows per optimizer step, all microbatches and devices together (JSONL or Parquet
    /// data; also --batch, --global-batch); preference pairs with --method dpo.
    #[arg(
        long,
        alias = "batch",
        alias = "global-batch",
        default_value_t = 8,
        help_heading = "Data"
    )]
    pub batch_size: i64,
    /// Tokens per row (JSONL or Parquet data).
    #[arg(long, default_value_t = 512, help_heading = "Data")]
    pub seq: i64,
    /// Pad each example to its own row instead of packing several per row.
    #[arg(long, help_heading = "Data")]
    pub no_pack: bool,
    /// Also put the loss on the prompt tokens (default: response tokens only).
    #[arg(long, help_heading = "Data")]
    pub train_on_prompt: bool,
    /// Skip JSONL lines or Parquet rows that are not valid examples (counted) instead of
    /// stopping.
    #[arg(long, help_heading = "Data")]
    pub skip_bad_lines: bool,
    /// Stop on an example longer than --seq instead of truncating it.
    #[arg(long, help_heading = "Data")]
    pub strict_length: bool,
    /// Hold out this fraction of the examples for evaluation (ignored with --eval-data).
    #[arg(long, default_value_t = 0.0, help_heading = "Data")]
    pub eval_fraction: f64,
    /// A separate JSONL or Parquet file to evaluate on.
    #[arg(long, help_heading = "Data")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate every N steps (and at the start and the end).
    #[arg(long, default_value_t = 0, help_heading = "Schedule")]
    pub eval_every: u64,
    /// Run a program directory from `xtrain compile` instead of building the step here.
    #[arg(long, help_heading = "Model")]
    pub program: Option<PathBuf>,
    /// Compile even if a cached executable exists.
    #[arg(long, help_heading = "Model")]
    pub no_cache: bool,
    /// Stop this invocation after N steps (checkpoints as usual), e.g. to time-box a session and
    /// continue later with --resume.
    #[arg(long, help_heading = "Schedule")]
    pub stop_after: Option<u64>,
    /// On a non-finite loss or gradient, skip the step (its update is never applied) instead of
    /// stopping.
    #[arg(long, help_heading = "Output")]
    pub skip_nonfinite_steps: bool,
    /// Write a checkpoint (OUT/checkpoint-K) and the adapter (OUT/step-K) every K steps.
    #[arg(long, default_value_t = 0, help_heading = "Output")]
    pub save_every: u64,
    /// Print progress every N steps. 0: no progress (no bars, step lines or loading lines);
    /// evaluation results, notes on what the run sets up (data, settings taken, output dir),
    /// warnings, loss spikes, the summary and errors are still printed.
    #[arg(long, default_value_t = 1, help_heading = "Output")]
    pub log_every: u64,
    /// Do not draw OUT/loss.png.
    #[arg(long, help_heading = "Output")]
    pub no_plot: bool,
    /// One device's peak TFLOP/s at the step's dtype (e.g. 989 for an H100's dense bf16): with
    /// it, the model FLOPs utilization is logged as train/mfu.
    #[arg(long, help_heading = "Output")]
    pub peak_tflops: Option<f64>,
    /// Output directory (metrics.jsonl, checkpoints, adapters, loss.png). One that holds a
    /// previous run is continued only with --resume, replaced only with --overwrite.
    #[arg(long, help_heading = "Output")]
    pub out: Option<PathBuf>,
    /// Start afresh in an --out that holds a previous run (or other files): they are set aside
    /// and deleted once this run completes.
    #[arg(long, help_heading = "Output")]
    pub overwrite: bool,
    /// Seed for LoRA initialisation, data order and dropout.
    #[arg(long, default_value_t = 0, help_heading = "Output")]
    pub seed: u64,
    /// PJRT plugin: cpu, cuda, rocm, tpu or a path to a plugin .so (default: $XTRAIN_PLUGIN or cpu).
    #[arg(long, help_heading = "Model")]
    pub plugin: Option<String>,
    /// A kernel to compile in place of the composite ops it implements (repeatable), e.g.
    /// `every-key`: attention over every key at once instead of the key-block loops. The
    /// program's text is unchanged; the run says what was replaced.
    #[arg(long = "kernel", value_name = "NAME", help_heading = "Model")]
    pub kernel: Vec<String>,
    /// Processes in the run, one per host (default: from SLURM, torchrun's WORLD_SIZE, a TPU
    /// VM's worker list or $XTRAIN_NUM_PROCESSES; else 1). Every process runs the same command.
    #[arg(long, help_heading = "Hosts")]
    pub num_processes: Option<usize>,
    /// This process's index, 0 to --num-processes - 1 (default: SLURM_PROCID, RANK,
    /// TPU_WORKER_ID, JOB_COMPLETION_INDEX or $XTRAIN_PROCESS_ID). Process 0 serves the run's
    /// store and writes its outputs.
    #[arg(long, help_heading = "Hosts")]
    pub process_id: Option<usize>,
    /// HOST:PORT where process 0 serves the run's store (default: the first SLURM node,
    /// MASTER_ADDR:MASTER_PORT, the first TPU worker or $XTRAIN_COORDINATOR; port 8476 where
    /// the launcher names only a host).
    #[arg(long, value_name = "HOST:PORT", help_heading = "Hosts")]
    pub coordinator: Option<String>,
    /// Seconds a process waits for the others (at the start and at each barrier) before it
    /// stops, naming who did not come.
    #[arg(long, value_name = "SECS", help_heading = "Hosts")]
    pub init_timeout: Option<u64>,
    /// Test mode: one process whose devices (the --mesh) are split into P virtual hosts, each
    /// reading only the weight slices and batch rows its own devices hold, as separate hosts
    /// would; the run equals the one-host run.
    #[arg(long, value_name = "P", help_heading = "Hosts")]
    pub virtual_hosts: Option<usize>,
    /// A file holding the run's secret, which every process must be given (default:
    /// $XTRAIN_RUN_TOKEN). Make one with `openssl rand -hex 32`; the secret is never printed.
    #[arg(long, value_name = "FILE", help_heading = "Hosts")]
    pub run_token_file: Option<std::path::PathBuf>,
    /// Run without a secret on a network address: only for a network that the run's hosts
    /// alone can reach (anyone who reaches the coordinator can join, read or end the run).
    #[arg(long, help_heading = "Hosts")]
    pub trusted_network: bool,
    /// ADDR or ADDR:PORT where process 0 serves the run's store, when the --coordinator address
    /// the others reach is not one of its host's own (a NAT, a load balancer).
    #[arg(long, value_name = "ADDR", help_heading = "Hosts")]
    pub coordinator_bind: Option<String>,
}

pub fn train(
    a: TrainArgs,
    verbose: bool,
    explicit: BTreeSet<String>,
    recipe: Option<(PathBuf, BTreeSet<String>)>,
) -> Result<()> {
    if let Some(p) = a.peak_tflops.filter(|p| !(p.is_finite() && *p > 0.0)) {
        bail!("--peak-tflops must be a positive number of TFLOP/s, got {p}");
    }
    if a.resume.is_none() {
        let missing: Vec<&str> = [
            ("--model", a.model.is_none()),
            ("--data", a.data.is_none()),
            ("--out", a.out.is_none()),
        ]
        .iter()
        .filter(|(_, m)| *m)
        .map(|(f, _)| *f)
        .collect();
        if !missing.is_empty() {
            bail!(
                "{} {} needed (or --resume a checkpoint, whose run records them)",
                missing.join(", "),
                if missing.len() == 1 { "is" } else { "are" }
            );
        }
    }
    let model = match &a.model {
        Some(m) => crate::cli::model::model_dir(m, a.revision.as_deref(), "train")?,
        None => PathBuf::new(),
    };
    let mut step = a
        .step
        .options_with(a.resume.is_some() && !explicit.contains("method"))?;
    // TRL's reference for a model that arrives with an adapter: a frozen copy of it.
    if a.step.preference.reference.is_none() && a.init_adapter.is_some() {
        step.preference.reference = xtrain::program::Reference::Start;
    }
    let opts = TrainOptions {
        data: DataOptions {
            path: a.data.unwrap_or_default(),
            batch_size: a.batch_size,
            seq: a.seq,
            pack: !a.no_pack,
            train_on_prompt: a.train_on_prompt,
            skip_bad_lines: a.skip_bad_lines,
            strict_length: a.strict_length,
            eval_fraction: a.eval_fraction,
            eval_data: a.eval_data,
            columns: Columns::new(a.text_column, a.messages_column),
            pairs: step.dpo().is_some(),
        },
        sharding_rules: a.step.sharding_rules.clone(),
        step,
        model,
        init_adapter: a.init_adapter,
        steps: a.steps,
        epochs: a.epochs,
        lr: a.lr,
        warmup: a.warmup,
        schedule: a.schedule,
        min_lr_ratio: a.min_lr_ratio,
        program: a.program,
        use_cache: !a.no_cache,
        eval_every: a.eval_every,
        save_every: a.save_every,
        resume: a.resume,
        out: a.out.unwrap_or_default(),
        overwrite: a.overwrite,
        seed: a.seed,
        plugin: a.plugin,
        kernels: a.kernel,
        verbose,
        log_every: a.log_every,
        plot: !a.no_plot,
        peak_tflops: a.peak_tflops,
        stop_after: a.stop_after,
        skip_nonfinite: a.skip_nonfinite_steps,
        explicit,
        recipe,
        taken_from: Default::default(),
        launch: xtrain::cluster::launch::LaunchFlags {
            num_processes: a.num_processes,
            process_id: a.process_id,
            coordinator: a.coordinator,
            init_timeout: a.init_timeout.map(std::time::Duration::from_secs),
            virtual_hosts: a.virtual_hosts,
            run_token_file: a.run_token_file,
            trusted_network: a.trusted_network,
            coordinator_bind: a.coordinator_bind,
        },
    };
    xtrain::train::run(&opts)
}

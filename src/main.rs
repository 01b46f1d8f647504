//! The `xtrain` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use xtrain::model::lora::{LoraConfig, Target};
use xtrain::model::optim::AdamW;
use xtrain::program::{Remat, StepSpec};

#[derive(Parser)]
#[command(
    name = "xtrain",
    version,
    about = "Fine-tune Llama 3.1 with LoRA as one compiled StableHLO program on any PJRT backend"
)]
struct Cli {
    /// Say more (also XLA's own logs).
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the PJRT plugins found on this machine, or install one.
    Plugins {
        #[command(subcommand)]
        action: Option<PluginAction>,
    },
    /// Train LoRA adapters.
    Train(Box<TrainArgs>),
    /// Build the training step program (StableHLO + manifest) without weights; --check also
    /// compiles it and prints XLA's memory figures.
    Compile(Box<CompileArgs>),
    /// Convert a llama.cpp GGUF file into a Hugging Face model directory.
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// Output model directory.
        #[arg(long)]
        out: PathBuf,
    },
    /// Generate text from a prompt, with or without a LoRA adapter.
    Generate(GenerateArgs),
    /// Time the training step on random weights (`--init random`: no checkpoint needed) and
    /// print the figures as JSON; --export writes the weights and batch for peer checks.
    Bench(Box<BenchArgs>),
    /// Fold a LoRA adapter into the base weights and write a complete HF checkpoint.
    Merge {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        adapter: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Args)]
struct BenchArgs {
    /// A model directory's config or a preset (the standard workload is bench-512).
    #[arg(long, default_value = "bench-512")]
    model: String,
    /// Weights: only `random` (no checkpoint).
    #[arg(long, default_value = "random")]
    init: String,
    #[arg(long, default_value_t = 4)]
    batch: i64,
    #[arg(long, default_value_t = 256)]
    seq: i64,
    #[command(flatten)]
    step: StepArgs,
    /// Steps timed after the warm-up.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Write the weights, LoRA and batch here (safetensors) for peer implementations.
    #[arg(long)]
    export: Option<PathBuf>,
    #[arg(long)]
    plugin: Option<String>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Hugging Face model directory (with tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// A PEFT adapter directory to apply.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The user message (rendered with the model's chat template unless --raw).
    #[arg(long)]
    prompt: String,
    /// Use the prompt as raw text, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Context length of the compiled program (prompt + new tokens must fit).
    #[arg(long, default_value_t = 256)]
    context: i64,
    #[arg(long)]
    plugin: Option<String>,
}

#[derive(Subcommand)]
enum PluginAction {
    /// Install a plugin into xtrain's cache (only `cpu` is installable: the xla-cpu-pjrt wheel).
    Install { name: String },
}

#[derive(Args)]
struct LoraArgs {
    /// LoRA rank r.
    #[arg(long, default_value_t = 16)]
    lora_r: i64,
    /// LoRA alpha (scale = alpha / r).
    #[arg(long, default_value_t = 32.0)]
    lora_alpha: f64,
    /// LoRA dropout probability on the adapter's input.
    #[arg(long, default_value_t = 0.0)]
    lora_dropout: f64,
    /// Projections to adapt, among q,k,v,o,gate,up,down.
    #[arg(long, default_value = "q,k,v,o,gate,up,down")]
    lora_targets: String,
}

impl LoraArgs {
    fn config(&self) -> Result<LoraConfig> {
        let c = LoraConfig {
            r: self.lora_r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets: Target::parse_list(&self.lora_targets)?,
        };
        c.validate()?;
        Ok(c)
    }
}

/// What shapes the step program: numerics, optimizer constants, remat, accumulation.
#[derive(Args)]
struct StepArgs {
    /// AdamW betas, as b1,b2.
    #[arg(long, default_value = "0.9,0.999")]
    betas: String,
    /// AdamW epsilon (added after the bias-corrected square root, as torch does).
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    #[arg(long, default_value_t = 0.0)]
    max_grad_norm: f64,
    #[command(flatten)]
    lora: LoraArgs,
    /// Precision: f32, or bf16 (bf16 weights and matmuls; f32 norms, softmax, loss, LoRA
    /// master weights and optimizer state).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// What the backward pass recomputes: none (layers unrolled, everything kept), layer (keep
    /// each layer's input), save-proj (also keep the frozen projections' outputs).
    #[arg(long, default_value = "layer")]
    remat: String,
    /// Gradient accumulation: split each batch into this many microbatches inside the step.
    #[arg(long, default_value_t = 1)]
    grad_accum: i64,
    /// Device mesh, e.g. data=2,fsdp=4,tensor=1 (axes of size 1 are no-ops; devices are
    /// numbered row-major over the axes in this order).
    #[arg(long)]
    mesh: Option<String>,
    /// A file of `logical = mesh_axes` lines overriding the default sharding rules.
    #[arg(long)]
    sharding_rules: Option<PathBuf>,
    /// With looped layers, compute the loss and its gradient N positions at a time (less memory
    /// for long sequences and large vocabularies on one device).
    #[arg(long)]
    loss_chunk: Option<i64>,
    /// Query rows per block of causal attention (blocks wholly above the diagonal are not
    /// computed); default 128 when the sequence is a longer multiple of 128, else no blocking.
    #[arg(long)]
    attention_block: Option<i64>,
    /// With --dtype bf16, the type matmuls give their result in before it is rounded to bf16:
    /// f32 (the accumulator: XLA CPU runs this form on the CPU's native bf16 GEMM), compute
    /// (bf16, what a GPU's cuBLAS writes), or auto (f32 for a CPU plugin, else compute). The
    /// arithmetic is the same (f32 accumulation, one rounding); the speed differs.
    #[arg(long, default_value = "auto")]
    matmul_result: String,
    /// Quantize the projections' base weights at load: nf4 (QLoRA's 4-bit NormalFloat, blocks
    /// of 64, double-quantized scales), dequantized in the step right before each matmul.
    #[arg(long)]
    quant: Option<String>,
}

impl StepArgs {
    fn nf4(&self) -> Result<bool> {
        match self.quant.as_deref() {
            None | Some("none") => Ok(false),
            Some("nf4") => Ok(true),
            Some(other) => bail!("--quant must be nf4 or none, got `{other}`"),
        }
    }

    fn mesh(&self) -> Result<Option<xtrain::program::MeshPlan>> {
        let Some(m) = &self.mesh else {
            return Ok(None);
        };
        let mesh = xtrain::program::sharding::parse_mesh(m)?;
        if mesh.axes.is_empty() {
            return Ok(None);
        }
        let rules = match &self.sharding_rules {
            Some(p) => xtrain::program::sharding::Rules::load(p)?,
            None => xtrain::program::sharding::Rules::default(),
        };
        Ok(Some(xtrain::program::MeshPlan {
            axes: mesh.axes,
            rules,
        }))
    }

    fn adam(&self) -> Result<AdamW> {
        let (beta1, beta2) = parse_betas(&self.betas)?;
        Ok(AdamW {
            beta1,
            beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            max_grad_norm: self.max_grad_norm,
        })
    }

    fn spec(
        &self,
        model: xtrain::model::config::LlamaConfig,
        batch: i64,
        seq: i64,
        plugin: Option<&str>,
    ) -> Result<StepSpec> {
        let dtype = match self.dtype.as_str() {
            "f32" => hlo::DType::F32,
            "bf16" => hlo::DType::BF16,
            other => bail!("--dtype must be f32 or bf16, got `{other}`"),
        };
        Ok(StepSpec {
            model,
            lora: self.lora.config()?,
            adam: self.adam()?,
            batch,
            seq,
            weight_dtype: dtype,
            compute_dtype: dtype,
            remat: Remat::parse(&self.remat)?,
            microbatches: self.grad_accum,
            mesh: self.mesh()?,
            nf4: self.nf4()?,
            loss_chunk: self.loss_chunk,
            attention_block: self.attention_block,
            wide_matmul_results: xtrain::device::platform::wide_matmul_results(
                &self.matmul_result,
                plugin,
            )?,
        })
    }
}

#[derive(Args)]
struct CompileArgs {
    /// A Hugging Face model directory, or a preset: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b,
    /// tiny-llama3.
    #[arg(long)]
    model: String,
    /// Rows per step (all microbatches together).
    #[arg(long, default_value_t = 1)]
    batch: i64,
    /// Tokens per row.
    #[arg(long, default_value_t = 2048)]
    seq: i64,
    #[command(flatten)]
    step: StepArgs,
    /// Program directory to write (train_step.mlir, manifest.json).
    #[arg(long)]
    out: PathBuf,
    /// Also compile it with the plugin and print XLA's memory figures and the compile time.
    #[arg(long)]
    check: bool,
    /// With --check: write XLA's optimized HLO here.
    #[arg(long)]
    xla_dump: Option<PathBuf>,
    /// PJRT plugin the program is for (cpu, cuda, rocm, tpu or a path; default $XTRAIN_PLUGIN or
    /// cpu): --check compiles with it, and `--matmul-result auto` picks the matmul form for it.
    #[arg(long)]
    plugin: Option<String>,
}

#[derive(Args)]
struct TrainArgs {
    /// Hugging Face model directory (config.json + safetensors [+ tokenizer.json for text]).
    #[arg(long)]
    model: PathBuf,
    /// Training data: a .jsonl file ({"text"}, alpaca {"instruction","input","output"} or chat
    /// {"messages"} rows), or a .safetensors file with one pre-tokenized batch (input_ids,
    /// labels, attention_mask) used for every step.
    #[arg(long)]
    data: PathBuf,
    /// Start from this PEFT adapter instead of a fresh one.
    #[arg(long)]
    init_adapter: Option<PathBuf>,
    /// Continue from a checkpoint dir (OUT/checkpoint-N): adapter, optimizer state, step, data
    /// position. The run continues exactly as if it had not stopped.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Number of optimizer steps (0 = --epochs over the data).
    #[arg(long, default_value_t = 0)]
    steps: u64,
    /// Passes over the data when --steps is 0.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-4)]
    lr: f64,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Learning-rate decay after warmup: constant, linear or cosine.
    #[arg(long, default_value = "constant")]
    schedule: String,
    /// The learning rate at the last step, as a fraction of --lr (linear/cosine).
    #[arg(long, default_value_t = 0.0)]
    min_lr_ratio: f64,
    #[command(flatten)]
    step: StepArgs,
    /// Rows per step (JSONL data).
    #[arg(long, default_value_t = 8)]
    batch_size: i64,
    /// Tokens per row (JSONL data).
    #[arg(long, default_value_t = 512)]
    seq: i64,
    /// Pad each example to its own row instead of packing several per row.
    #[arg(long)]
    no_pack: bool,
    /// Also put the loss on the prompt tokens (default: response tokens only).
    #[arg(long)]
    train_on_prompt: bool,
    /// Skip JSONL lines that are not valid examples (counted) instead of stopping.
    #[arg(long)]
    skip_bad_lines: bool,
    /// Stop on an example longer than --seq instead of truncating it.
    #[arg(long)]
    strict_length: bool,
    /// Hold out this fraction of the examples for evaluation (ignored with --eval-data).
    #[arg(long, default_value_t = 0.0)]
    eval_fraction: f64,
    /// A separate JSONL file to evaluate on.
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Evaluate every N steps (and at the start and the end).
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Run a program directory from `xtrain compile` instead of building the step here.
    #[arg(long)]
    program: Option<PathBuf>,
    /// Compile even if a cached executable exists.
    #[arg(long)]
    no_cache: bool,
    /// Stop this invocation after N steps (checkpoints as usual), e.g. to time-box a session and
    /// continue later with --resume.
    #[arg(long)]
    stop_after: Option<u64>,
    /// On a non-finite loss or gradient, skip the step (its update is never applied) instead of
    /// stopping.
    #[arg(long)]
    skip_nonfinite_steps: bool,
    /// Write a checkpoint (OUT/checkpoint-K) and the adapter (OUT/step-K) every K steps.
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// Print progress every N steps (0 = never).
    #[arg(long, default_value_t = 1)]
    log_every: u64,
    /// Do not draw OUT/loss.png.
    #[arg(long)]
    no_plot: bool,
    /// Output directory (metrics.jsonl, checkpoints, adapters, loss.png).
    #[arg(long)]
    out: PathBuf,
    /// Seed for LoRA initialisation, data order and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// PJRT plugin: cpu, cuda, rocm, tpu or a path to a plugin .so (default: $XTRAIN_PLUGIN or cpu).
    #[arg(long)]
    plugin: Option<String>,
}

fn parse_betas(s: &str) -> Result<(f64, f64)> {
    let parts: Vec<&str> = s.split(',').collect();
    if parts.len() != 2 {
        bail!("--betas must be two numbers like 0.9,0.999, got `{s}`");
    }
    let p = |x: &str| {
        x.trim()
            .parse::<f64>()
            .with_context(|| format!("--betas: `{x}` is not a number"))
    };
    let (b1, b2) = (p(parts[0])?, p(parts[1])?);
    if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
        bail!("--betas must each be in [0, 1), got {b1},{b2}");
    }
    Ok((b1, b2))
}

fn plugins(action: Option<PluginAction>) -> Result<()> {
    if let Some(PluginAction::Install { name }) = action {
        if name != "cpu" {
            bail!("only the CPU plugin can be installed by xtrain; for `{name}` install its wheel with pip (see README)");
        }
        let path = pjrt::discover::install_cpu()?;
        println!("installed {}", path.display());
        return Ok(());
    }
    let found = pjrt::discover::find_all();
    if found.is_empty() {
        println!("no PJRT plugins found; run `xtrain plugins install cpu`");
        return Ok(());
    }
    for f in found {
        println!("{} ({}): {}", f.name, f.source, f.path.display());
        match pjrt::Plugin::load(&f.path) {
            Err(e) => println!("  cannot load: {e}"),
            Ok(p) => {
                let (major, minor) = p.api_version();
                println!("  PJRT C API {major}.{minor}");
                match p.client(&pjrt::ClientOptions::default()) {
                    Err(e) => println!("  no client: {e}"),
                    Ok(c) => {
                        let devices = c.devices().unwrap_or_default();
                        println!(
                            "  platform {} {}, {} devices",
                            c.platform_name().unwrap_or_default(),
                            c.platform_version().unwrap_or_default(),
                            devices.len()
                        );
                        for d in devices {
                            if let Ok(info) = d.info() {
                                let mem = info
                                    .memory_bytes
                                    .map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64))
                                    .unwrap_or_default();
                                println!("    device {}: {}{mem}", info.id, info.kind);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn train(a: TrainArgs, verbose: bool) -> Result<()> {
    if !["constant", "linear", "cosine"].contains(&a.schedule.as_str()) {
        bail!(
            "--schedule must be constant, linear or cosine, got `{}`",
            a.schedule
        );
    }
    let opts = xtrain::train::options::TrainOptions {
        model: a.model,
        data: a.data,
        init_adapter: a.init_adapter,
        steps: a.steps,
        epochs: a.epochs,
        lr: a.lr,
        warmup: a.warmup,
        schedule: a.schedule,
        min_lr_ratio: a.min_lr_ratio,
        adam: a.step.adam()?,
        lora: a.step.lora.config()?,
        dtype: a.step.dtype.clone(),
        remat: Remat::parse(&a.step.remat)?,
        microbatches: a.step.grad_accum,
        program: a.program,
        use_cache: !a.no_cache,
        batch_size: a.batch_size,
        seq: a.seq,
        pack: !a.no_pack,
        train_on_prompt: a.train_on_prompt,
        skip_bad_lines: a.skip_bad_lines,
        strict_length: a.strict_length,
        eval_fraction: a.eval_fraction,
        eval_data: a.eval_data,
        eval_every: a.eval_every,
        save_every: a.save_every,
        resume: a.resume,
        out: a.out,
        seed: a.seed,
        plugin: a.plugin,
        verbose,
        log_every: a.log_every,
        plot: !a.no_plot,
        stop_after: a.stop_after,
        mesh: a.step.mesh()?,
        nf4: a.step.nf4()?,
        skip_nonfinite: a.skip_nonfinite_steps,
        loss_chunk: a.step.loss_chunk,
        attention_block: a.step.attention_block,
        matmul_result: a.step.matmul_result,
    };
    xtrain::train::run(&opts)
}

fn import_gguf(file: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let t0 = std::time::Instant::now();
    let mut shown = 0;
    xtrain::formats::gguf::import(file, out, |done, total| {
        let pct = done * 100 / total.max(1);
        if pct >= shown + 10 || done == total {
            shown = pct;
            eprintln!("importing {}: {pct}% of {total} tensors", file.display());
        }
    })?;
    println!(
        "wrote {} in {:.1}s",
        out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn generate(a: GenerateArgs) -> Result<()> {
    let cfg = xtrain::model::config::LlamaConfig::load(&a.model)?;
    let tok = xtrain::data::text::TextTokenizer::load(&a.model)?;
    let text = if a.raw {
        a.prompt.clone()
    } else {
        tok.render_chat(
            &[xtrain::data::text::Message {
                role: "user".into(),
                content: a.prompt.clone(),
            }],
            true,
        )?
    };
    let ids = tok.encode(&text)?;
    let adapter = match &a.adapter {
        Some(d) => Some(xtrain::formats::peft::load_adapter(d, &cfg)?),
        None => None,
    };
    let rt = xtrain::device::runtime::Runtime::open(a.plugin.as_deref(), Some(1))?;
    let f = xtrain::device::generate::Forward::new(
        &rt,
        &cfg,
        &a.model,
        adapter.as_ref().map(|(c, t)| (c, t)),
        xtrain::device::generate::Kind::NextToken,
        1,
        a.context,
        hlo::DType::F32,
    )?;
    let out = xtrain::device::generate::generate(
        &f,
        &ids,
        a.max_new_tokens,
        a.temperature,
        a.seed,
        tok.eos_id,
    )?;
    println!("{}", tok.decode(&out)?);
    Ok(())
}

fn bench(a: BenchArgs) -> Result<()> {
    if a.init != "random" {
        bail!("--init must be random");
    }
    let (cfg, _) = xtrain::model::presets::resolve_model_config(&a.model)?;
    let spec = a.step.spec(cfg, a.batch, a.seq, a.plugin.as_deref())?;
    let r = xtrain::train::bench::run(
        spec,
        a.warmup,
        a.steps,
        a.export.as_deref(),
        a.plugin.as_deref(),
    )?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

fn gib(b: i64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn compile(a: CompileArgs, verbose: bool) -> Result<()> {
    let (cfg, _) = xtrain::model::presets::resolve_model_config(&a.model)?;
    let spec = a.step.spec(cfg, a.batch, a.seq, a.plugin.as_deref())?;
    let t0 = std::time::Instant::now();
    let program = xtrain::program::build_train_step(&spec)?;
    let build_s = t0.elapsed().as_secs_f64();
    let manifest = xtrain::formats::program_dir::write_dir(&a.out, &program, &spec)?;
    let arg_bytes: i64 = manifest.args.iter().map(|t| t.bytes).sum();
    println!(
        "wrote {} ({} bytes of StableHLO, {} arguments, built in {:.3}s) and manifest.json",
        a.out.join("train_step.mlir").display(),
        program.text.len(),
        program.args.len(),
        build_s
    );
    println!(
        "arguments: {} ({} parameters in the base model)",
        gib(arg_bytes),
        spec.model.param_count()
    );
    if !a.check {
        return Ok(());
    }
    if let Some(m) = &spec.mesh {
        let order: Vec<String> = (0..m.devices() as usize)
            .map(|p| {
                let c = xtrain::program::sharding::coords(&m.mesh(), p);
                let coords: Vec<String> = m
                    .axes
                    .iter()
                    .map(|(n, _)| format!("{n}={}", c[n]))
                    .collect();
                format!("device {p}: {}", coords.join(" "))
            })
            .collect();
        println!(
            "mesh {:?}, {} devices; {}",
            m.axes,
            m.devices(),
            order.join("; ")
        );
        let est = xtrain::program::sharding::estimate(&spec, &program);
        println!("xtrain's estimate per device: arguments {}, temporaries ~{} (saved layer inputs and one layer's working set)", gib(est.0), gib(est.1));
    } else {
        let est = xtrain::program::sharding::estimate(&spec, &program);
        println!("xtrain's estimate: arguments {}, temporaries ~{} (saved layer inputs and one layer's working set)", gib(est.0), gib(est.1));
    }
    let rt = xtrain::device::runtime::Runtime::open(a.plugin.as_deref(), Some(program.partitions))?;
    let mut options = pjrt::CompileOptions::default();
    if let Some(dir) = &a.xla_dump {
        std::fs::create_dir_all(dir)?;
        options = options.with_override(
            "xla_dump_to",
            pjrt::OptionValue::String(dir.to_string_lossy().into()),
        );
        options = options.with_override("xla_dump_hlo_as_text", pjrt::OptionValue::Bool(true));
    }
    let t0 = std::time::Instant::now();
    let exe = rt.compile(&program, &options)?;
    let compile_s = t0.elapsed().as_secs_f64();
    let m = exe.memory_stats()?;
    if verbose {
        eprintln!("{m:?}");
    }
    println!(
        "XLA compile: {compile_s:.2}s on {}",
        rt.client.platform_name()?
    );
    println!(
        "per device: arguments {}, outputs {} ({} aliased to arguments), temporaries {}, code {}",
        gib(m.argument_bytes),
        gib(m.output_bytes),
        gib(m.alias_bytes),
        gib(m.temp_bytes),
        gib(m.generated_code_bytes)
    );
    println!(
        "per device total (arguments + non-aliased outputs + temporaries): {}",
        gib(m.total_bytes())
    );
    if let Some(dir) = &a.xla_dump {
        println!("XLA's HLO dumps: {}", dir.display());
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    pjrt::set_verbose(cli.verbose);
    // Before any command starts threads (weights are made and read on all cores).
    let runs_on = match &cli.command {
        Command::Train(a) => Some(a.plugin.as_deref()),
        Command::Compile(a) => Some(a.plugin.as_deref()),
        Command::Generate(a) => Some(a.plugin.as_deref()),
        Command::Bench(a) => Some(a.plugin.as_deref()),
        _ => None,
    };
    if let Some(plugin) = runs_on {
        xtrain::device::platform::prepare_host_memory(plugin);
    }
    let result = match cli.command {
        Command::Plugins { action } => plugins(action),
        Command::Train(a) => train(*a, cli.verbose),
        Command::Compile(a) => compile(*a, cli.verbose),
        Command::ImportGguf { file, out } => import_gguf(&file, &out),
        Command::Generate(a) => generate(a),
        Command::Bench(a) => bench(*a),
        Command::Merge {
            model,
            adapter,
            out,
        } => xtrain::formats::merge::merge(&model, &adapter, &out)
            .map(|_| println!("wrote {}", out.display())),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

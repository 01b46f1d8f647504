//! The `xtrain` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use xtrain::lora::{LoraConfig, Target};
use xtrain::optim::AdamW;

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

#[derive(Args)]
struct TrainArgs {
    /// Hugging Face model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Training data: a .safetensors file with a pre-tokenized batch (input_ids, labels,
    /// attention_mask), used for every step.
    #[arg(long)]
    data: PathBuf,
    /// Start from this PEFT adapter instead of a fresh one.
    #[arg(long)]
    init_adapter: Option<PathBuf>,
    /// Number of optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Learning rate.
    #[arg(long, default_value_t = 2e-4)]
    lr: f64,
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
    /// Write the adapter every K steps to OUT/step-K (0 = only at the end, to OUT/adapter).
    #[arg(long, default_value_t = 0)]
    save_every: u64,
    /// Print a progress line every N steps (0 = never).
    #[arg(long, default_value_t = 10)]
    log_every: u64,
    /// Output directory (metrics.jsonl, adapters).
    #[arg(long)]
    out: PathBuf,
    /// Seed for LoRA initialisation and dropout.
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
    let (beta1, beta2) = parse_betas(&a.betas)?;
    let opts = xtrain::train::TrainOptions {
        model: a.model,
        data: a.data,
        init_adapter: a.init_adapter,
        steps: a.steps,
        lr: a.lr,
        adam: AdamW {
            beta1,
            beta2,
            eps: a.eps,
            weight_decay: a.weight_decay,
            max_grad_norm: a.max_grad_norm,
        },
        lora: a.lora.config()?,
        save_every: a.save_every,
        out: a.out,
        seed: a.seed,
        plugin: a.plugin,
        verbose,
        log_every: a.log_every,
    };
    xtrain::train::train_on_batch(&opts)
}

fn main() {
    let cli = Cli::parse();
    pjrt::set_verbose(cli.verbose);
    let result = match cli.command {
        Command::Plugins { action } => plugins(action),
        Command::Train(a) => train(*a, cli.verbose),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

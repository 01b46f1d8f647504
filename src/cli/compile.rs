//! `xtrain compile`: build the step program and write its directory; with `--check`, compile it
//! and print XLA's memory figures.

use crate::cli::args::StepArgs;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use xtrain::device::platform::named_platform;
use xtrain::program::{MeshPlan, Program};

#[derive(Args)]
pub struct CompileArgs {
    /// A Hugging Face model directory, or a preset: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b,
    /// tiny-llama3.
    #[arg(long)]
    pub model: String,
    /// Rows per step (all microbatches together).
    #[arg(long, default_value_t = 1)]
    pub batch: i64,
    /// Tokens per row.
    #[arg(long, default_value_t = 2048)]
    pub seq: i64,
    #[command(flatten)]
    pub step: StepArgs,
    /// Program directory to write (train_step.mlir, manifest.json).
    #[arg(long)]
    pub out: PathBuf,
    /// Also compile it with the plugin and print XLA's memory figures and the compile time.
    #[arg(long)]
    pub check: bool,
    /// With --check: write XLA's optimized HLO here.
    #[arg(long)]
    pub xla_dump: Option<PathBuf>,
    /// PJRT plugin the program is for (cpu, cuda, rocm, tpu or a path; default $XTRAIN_PLUGIN or
    /// cpu): --check compiles with it, and `--matmul-result auto` picks the matmul form for it.
    #[arg(long)]
    pub plugin: Option<String>,
}

fn gib(b: i64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn compile(a: CompileArgs, verbose: bool) -> Result<()> {
    let (cfg, _) = xtrain::model::presets::resolve_model_config(&a.model)?;
    let platform = named_platform(a.plugin.as_deref());
    let spec = a.step.options()?.spec(cfg, a.batch, a.seq, platform)?;
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
        print_device_order(m);
    }
    check(&a, &program, verbose)
}

/// The mesh and which device sits where on it.
fn print_device_order(m: &MeshPlan) {
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
}

/// `--check`: compile the program with the plugin and print XLA's figures per device.
fn check(a: &CompileArgs, program: &Program, verbose: bool) -> Result<()> {
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
    let exe = rt.compile(program, &options)?;
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

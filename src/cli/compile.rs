//! `xtrain compile`: build the step program and write its directory; with `--check`, compile it
//! (with this machine's plugin, or for `--target` hardware that need not be here) and print the
//! compiler's memory figures.

use crate::cli::args::StepArgs;
use crate::cli::target::{check_target, print_target, record, Compiler};
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use xtrain::device::aot::{TargetBuild, TargetDevices};
use xtrain::device::platform::named_platform;
use xtrain::device::target::Target;
use xtrain::formats::program_dir::{self, Manifest};
use xtrain::program::{default_choice, fit_choices, MeshPlan, Offload, Program, Remat, StepSpec};

#[derive(Args)]
pub struct CompileArgs {
    /// A TOML recipe whose keys are these flags (`lora_r = 16`); flags on the command line
    /// override it (see recipes/).
    #[arg(long, value_name = "FILE")]
    #[allow(dead_code)] // read before parsing, by config::expand
    pub config: Option<PathBuf>,
    /// A Hugging Face model directory, a preset (llama-3.1-8b, llama-3.1-70b, llama-3.1-405b,
    /// smollm2-135m, tiny-llama3), or a repo id (org/name; its config.json only).
    #[arg(long)]
    pub model: String,
    /// With a repo id: the branch, tag or commit (default main).
    #[arg(long)]
    pub revision: Option<String>,
    /// Rows per step (all microbatches together).
    #[arg(long, alias = "batch-size", default_value_t = 1)]
    pub batch: i64,
    /// Tokens per row.
    #[arg(long, default_value_t = 2048)]
    pub seq: i64,
    #[command(flatten)]
    pub step: StepArgs,
    /// Program directory to write (train_step.mlir, manifest.json): new or empty (see
    /// --overwrite).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace what --out holds (an earlier program, or anything else) once the new program
    /// directory is complete.
    #[arg(long)]
    pub overwrite: bool,
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
    /// Hardware to compile for, which need not be here: tpu:<generation>:<chips> (tpu:v5p:2x2x1,
    /// tpu:v5e:2x2, tpu:v6e:16x16), cuda:<gpu>:<count> or rocm:<gpu>:<count> with <count> per
    /// host or <hosts>x<per host> (cuda:h100:8, cuda:h100:2x8, rocm:mi300x:8). Without --mesh the
    /// mesh is FSDP over all its devices.
    #[arg(long)]
    pub target: Option<String>,
    /// With a cuda: or rocm: --target: describe the GPU with this file (XLA's
    /// GpuTargetConfigProto in text form) instead of a built-in description.
    #[arg(long)]
    pub target_config: Option<PathBuf>,
    /// With --check for a TPU: skip the whole-step estimate (two more compiles, of unrolled 1- and
    /// 2-layer steps).
    #[arg(long)]
    pub no_estimate: bool,
    /// Where the program dir is written while it is built (beside `out`, moved there once
    /// complete); None: `out` itself.
    #[arg(skip)]
    pub stage: Option<PathBuf>,
}

impl CompileArgs {
    /// The directory the program and its build are written to now (see [`CompileArgs::stage`]);
    /// messages name `out`, where they will be.
    pub(super) fn dir(&self) -> &std::path::Path {
        self.stage.as_deref().unwrap_or(&self.out)
    }
}

/// Bytes in GiB, or MiB / KiB for small programs (the tiny test model), so no figure reads 0.00.
pub(super) use xtrain::device::fit::gib;

/// Seconds, or milliseconds / microseconds for small ones.
pub(super) fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.2} us", s * 1e6)
    }
}

pub fn compile(mut a: CompileArgs, verbose: bool) -> Result<()> {
    let cfg = crate::cli::model::model_config(&a.model, a.revision.as_deref())?;
    if a.target_config.is_some() && a.target.is_none() {
        bail!("--target-config describes the GPU of a --target; give --target cuda:<name>:<count> or rocm:<name>:<count> too");
    }
    let target = match &a.target {
        Some(t) => Some(TargetDevices::open(
            &Target::parse(t, a.target_config.as_deref())?,
            a.plugin.as_deref(),
            verbose,
        )?),
        None => None,
    };
    let mut options = a.step.options()?;
    let platform = match &target {
        Some(t) => t.target.platform.plugin(),
        None => named_platform(a.plugin.as_deref()),
    };
    if let Some(t) = &target {
        let n = t.devices.len() as i64;
        match &options.mesh {
            None if n > 1 => {
                options.mesh = Some(MeshPlan {
                    axes: vec![("fsdp".into(), n)],
                    rules: a.step.rules()?,
                })
            }
            None => {}
            Some(m) if m.devices() != n => bail!(
                "--mesh {} has {} devices but --target {} has {n}; give a mesh of {n} devices \
                 (or leave --mesh out: fsdp={n})",
                a.step.mesh.as_deref().unwrap_or_default(),
                m.devices(),
                t.target.spec
            ),
            Some(_) => {}
        }
    }
    a.out = xtrain::formats::outdir::check_writable_dir(&a.out, a.overwrite, &[])?;
    // The program dir is built beside `--out` and moved into place only once complete (the
    // program and, with --check, its build): a compile that fails or is interrupted leaves what
    // `--out` held as it was (a killed one's staging dir is removed by the next writer).
    let stage = xtrain::formats::atomic::staging_dir(&a.out)?;
    a.stage = Some(stage.clone());
    let result = compile_choices(&a, &cfg, &options, target.as_ref(), platform, verbose);
    a.stage = None;
    match result {
        Ok(()) => xtrain::formats::atomic::replace_dir_with(&a.out, &stage),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&stage);
            Err(e)
        }
    }
}

/// Write the step's program dir (into [`CompileArgs::dir`]) for each remat and offload choice in
/// turn, and with `--check` compile it, until one fits or none is left.
fn compile_choices(
    a: &CompileArgs,
    cfg: &xtrain::model::config::LlamaConfig,
    options: &xtrain::program::StepOptions,
    target: Option<&TargetDevices>,
    platform: &str,
    verbose: bool,
) -> Result<()> {
    // `--remat auto` and `--offload auto` try the choices in order until the step fits the
    // target's devices; without a target's memory to fit, remat per layer and no offload.
    let choices: Vec<(Remat, Offload)> = if target.is_some() && a.check {
        fit_choices(options.remat, options.offload)
    } else {
        vec![default_choice(options.remat, options.offload)]
    };
    if let Some(t) = target {
        print_target(t)?;
    }
    for (k, &(remat, offload)) in choices.iter().enumerate() {
        let spec = StepSpec {
            remat,
            offload,
            ..options.spec(cfg.clone(), a.batch, a.seq, platform)?
        };
        let (program, mut manifest) = write_program(a, &spec)?;
        if k == 0 {
            if let Some(m) = &spec.mesh {
                print_device_order(m);
            }
        }
        if !a.check {
            return Ok(());
        }
        let Some(t) = target else {
            return check(a, &spec, &program, &mut manifest, verbose);
        };
        // The last choice is recorded whether or not it fits: its report says by how much not.
        let last = k + 1 == choices.len();
        if check_target(a, t, &spec, &program, &mut manifest, last)? || last {
            return Ok(());
        }
        let (next_remat, next_offload) = choices[k + 1];
        println!(
            "(auto: --remat {} --offload {} does not fit; trying --remat {} --offload {})",
            remat.name(),
            offload.name(),
            next_remat.name(),
            next_offload.name()
        );
    }
    Ok(())
}

/// Build the step and write its program dir, saying what it holds.
fn write_program(a: &CompileArgs, spec: &StepSpec) -> Result<(Program, Manifest)> {
    let t0 = std::time::Instant::now();
    let program = xtrain::program::build_train_step(spec)?;
    let build_s = t0.elapsed().as_secs_f64();
    let manifest = program_dir::write_dir(a.dir(), &program, spec)?;
    let arg_bytes: i64 = manifest.args.iter().map(|t| t.bytes).sum();
    let per_device: i64 = manifest.args.iter().map(|t| t.bytes_per_device()).sum();
    println!(
        "wrote {} ({} bytes of StableHLO, {} arguments, built in {:.3}s) and manifest.json",
        a.out.join("train_step.mlir").display(),
        program.text.len(),
        program.args.len(),
        build_s
    );
    let sharded = if per_device != arg_bytes {
        format!(", {} per device", gib(per_device))
    } else {
        String::new()
    };
    let offload = if spec.offload.is_none() {
        String::new()
    } else {
        format!("; --offload {}", spec.offload.name())
    };
    // What the defaults chose, so that the figures below can be read (f32 weights take twice
    // bf16's bytes).
    let targets: Vec<&str> = spec
        .lora
        .targets
        .iter()
        .map(|t| t.module().trim_end_matches("_proj"))
        .collect();
    let mesh = match &spec.mesh {
        Some(m) => format!(
            ", --mesh {} ({} devices)",
            m.axes
                .iter()
                .map(|(n, k)| format!("{n}={k}"))
                .collect::<Vec<_>>()
                .join(","),
            m.devices()
        ),
        None => String::new(),
    };
    println!(
        "step: --dtype {} (weights {}, compute {}), --batch {}, --seq {}, --lora-r {} (alpha {}, on {}), --remat {}, --grad-accum {}{}{}",
        a.step.dtype,
        spec.weight_dtype,
        spec.compute_dtype,
        spec.batch,
        spec.seq,
        spec.lora.r,
        spec.lora.alpha,
        targets.join(","),
        spec.remat.name(),
        spec.microbatches,
        if spec.nf4 { ", --quant nf4" } else { "" },
        mesh,
    );
    println!(
        "arguments: {}{sharded} ({} parameters in the base model{offload})",
        gib(arg_bytes),
        spec.model.param_count()
    );
    Ok((program, manifest))
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
    if order.len() <= 16 {
        println!(
            "mesh {:?}, {} devices; {}",
            m.axes,
            m.devices(),
            order.join("; ")
        );
    } else {
        println!(
            "mesh {:?}, {} devices, numbered row-major over the axes in this order",
            m.axes,
            m.devices()
        );
    }
}

/// Per-device figures, the same lines for every plugin: device memory (what must fit), host
/// memory where the program offloads (per device and per host), and whether it fits.
pub(super) fn print_memory(
    m: &pjrt::MemoryStats,
    available: Option<i64>,
    devices_per_host: i64,
    spec: &StepSpec,
) {
    println!(
        "per device: arguments {}, outputs {} ({} aliased to arguments), temporaries {}, code {}",
        gib(m.argument_bytes),
        gib(m.output_bytes),
        gib(m.alias_bytes),
        gib(m.temp_bytes),
        gib(m.generated_code_bytes)
    );
    if m.host_total_bytes() > 0 {
        println!(
            "in host memory, per device: arguments {}, temporaries {}; per host ({devices_per_host} \
             device(s)): {}",
            gib(m.host_argument_bytes),
            gib(m.host_temp_bytes),
            gib(m.host_total_bytes() * devices_per_host)
        );
    }
    let fits = match available {
        Some(have) if m.total_bytes() <= have => format!(" of {}: fits", gib(have)),
        Some(have) => format!(
            " of {}: does not fit ({})",
            gib(have),
            xtrain::device::fit::fit_advice(m.total_bytes(), Some(have), spec)
        ),
        None => String::new(),
    };
    println!(
        "per device total (arguments + non-aliased outputs + temporaries): {}{fits}",
        gib(m.total_bytes())
    );
}

/// `--check` without a target: compile the program with this machine's plugin, and keep the
/// executable in the program dir for `train --program` on this machine.
fn check(
    a: &CompileArgs,
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
    verbose: bool,
) -> Result<()> {
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
    let info = rt.devices[0].info()?;
    print_memory(&m, info.memory_bytes, program.partitions, spec);
    let build = TargetBuild {
        stats: m,
        compile_s,
        cost: None,
        unpriced_calls: 0,
        optimized_hlo: None,
        memory_report: None,
        executable: exe.serialize()?,
    };
    let by = Compiler {
        target: a.plugin.clone().unwrap_or_else(|| rt.platform()),
        platform: rt.platform(),
        platform_version: rt.client.platform_version()?,
        plugin: rt.client.plugin(),
        device_kind: info.kind,
        devices: program.partitions,
        hosts: 1,
        memory_per_device: info.memory_bytes,
        // The allocator's limit is what the client reports: already the usable share.
        usable_memory_per_device: info.memory_bytes,
    };
    record(a.dir(), by, &build, None, manifest)?;
    println!(
        "wrote {} ({} bytes) for `xtrain train --program` on this machine",
        a.out.join(program_dir::EXECUTABLE_FILE).display(),
        build.executable.len()
    );
    if let Some(dir) = &a.xla_dump {
        println!("XLA's HLO dumps: {}", dir.display());
    }
    Ok(())
}

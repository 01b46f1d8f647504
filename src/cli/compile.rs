//! `xtrain compile`: build the step program and write its directory; with `--check`, compile it
//! (with this machine's plugin, or for `--target` hardware that need not be here) and print the
//! compiler's memory figures.

use crate::cli::args::StepArgs;
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use xtrain::device::aot::{TargetBuild, TargetDevices};
use xtrain::device::platform::named_platform;
use xtrain::device::target::{Platform, Target};
use xtrain::formats::program_dir::{self, Build, Manifest, MemoryFigures, StepEstimate};
use xtrain::program::{MeshPlan, Offload, Program, StepSpec};

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
}

/// Bytes in GiB, or MiB / KiB for small programs (the tiny test model), so no figure reads 0.00.
fn gib(b: i64) -> String {
    let x = b as f64;
    if x.abs() >= (1u64 << 30) as f64 / 100.0 {
        format!("{:.2} GiB", x / (1u64 << 30) as f64)
    } else if x.abs() >= (1u64 << 20) as f64 / 100.0 {
        format!("{:.2} MiB", x / (1u64 << 20) as f64)
    } else {
        format!("{:.2} KiB", x / 1024.0)
    }
}

/// Seconds, or milliseconds / microseconds for small ones.
fn secs(s: f64) -> String {
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
    // `--offload auto` tries the choices in order until the step fits the target's devices;
    // without a target's memory to fit, it offloads nothing.
    let choices: Vec<Offload> = match options.offload {
        Some(o) => vec![o],
        None if target.is_some() && a.check => Offload::AUTO_ORDER.to_vec(),
        None => vec![Offload::NONE],
    };
    if let Some(t) = &target {
        print_target(t)?;
    }
    for (k, &offload) in choices.iter().enumerate() {
        let spec = StepSpec {
            offload,
            ..options.spec(cfg.clone(), a.batch, a.seq, platform)?
        };
        let (program, mut manifest) = write_program(&a, &spec)?;
        if k == 0 {
            if let Some(m) = &spec.mesh {
                print_device_order(m);
            }
        }
        if !a.check {
            return Ok(());
        }
        let Some(t) = &target else {
            return check(&a, &spec, &program, &mut manifest, verbose);
        };
        // The last choice is recorded whether or not it fits: its report says by how much not.
        let last = k + 1 == choices.len();
        if check_target(&a, t, &spec, &program, &mut manifest, last)? || last {
            return Ok(());
        }
        println!(
            "(--offload auto: --offload {} does not fit; trying --offload {})",
            offload.name(),
            choices[k + 1].name()
        );
    }
    Ok(())
}

/// Build the step and write its program dir, saying what it holds.
fn write_program(a: &CompileArgs, spec: &StepSpec) -> Result<(Program, Manifest)> {
    let t0 = std::time::Instant::now();
    let program = xtrain::program::build_train_step(spec)?;
    let build_s = t0.elapsed().as_secs_f64();
    let manifest = program_dir::write_dir(&a.out, &program, spec)?;
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
        a.step.remat,
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

/// What the target is, as its plugin describes it.
fn print_target(t: &TargetDevices) -> Result<()> {
    let memory = match (t.memory_per_device(), t.usable_memory_per_device()?) {
        (Some(b), Some(u)) if u < b => format!(
            ", {} each, of which XLA may use {} ({:.0}%, what xtrain's runtime gives the \
             plugin's allocator; XTRAIN_GPU_MEMORY_FRACTION)",
            gib(b),
            gib(u),
            100.0 * u as f64 / b as f64
        ),
        (Some(b), _) => format!(", {} each", gib(b)),
        _ => String::new(),
    };
    // libtpu's version names the chip and its build; the GPU plugins' repeat the device kind.
    let version = t.platform_version.lines().next().unwrap_or_default();
    let version = if version == t.device_kind() || version.is_empty() {
        String::new()
    } else {
        format!(" {version}")
    };
    println!(
        "target {}: {} x {} on {} host(s){memory} ({} plugin{version}, PJRT C API {}.{})",
        t.target.spec,
        t.devices.len(),
        t.device_kind(),
        t.hosts(),
        t.target.platform.plugin(),
        t.plugin.api_version().0,
        t.plugin.api_version().1,
    );
    Ok(())
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
fn print_memory(
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
    record(&a.out, by, &build, None, manifest)?;
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

/// `--check --target`: compile for the target with its plugin, print the compiler's figures (and
/// for TPUs its cost analysis and a whole-step estimate), and add the build to the program dir.
/// Returns whether the step fits the target's devices (true where their memory is unknown);
/// one that does not fit is recorded only if it is the `last` choice.
fn check_target(
    a: &CompileArgs,
    t: &TargetDevices,
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
    last: bool,
) -> Result<bool> {
    eprintln!(
        "xtrain: compiling for {} with the {} plugin (no device needed)",
        t.target.spec,
        t.target.platform.plugin()
    );
    let build = t.compile(program, a.xla_dump.as_deref())?;
    println!(
        "XLA compile for {}: {:.2}s ({} compiler)",
        t.target.spec,
        build.compile_s,
        t.target.platform.plugin()
    );
    let usable = t.usable_memory_per_device()?;
    print_memory(
        &build.stats,
        usable,
        t.devices.len() as i64 / t.hosts(),
        spec,
    );
    let fits = usable.is_none_or(|have| build.stats.total_bytes() <= have);
    if !fits && !last {
        return Ok(false);
    }
    let mut estimate = None;
    if let Some(cost) = &build.cost {
        let get = |k: &str| cost.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        println!(
            "TPU cost analysis per device, the step as compiled (the layer loop's body counted \
             once): {:.4} TFLOP, {:.4} GB accessed, optimal_seconds {}{}",
            get("flops").unwrap_or(0.0) / 1e12,
            get("bytes accessed").unwrap_or(0.0) / 1e9,
            secs(get("optimal_seconds").unwrap_or(0.0)),
            if get("optimal_seconds").is_some_and(|s| s <= 0.0) {
                " (not a time)"
            } else {
                ""
            }
        );
    }
    if t.target.platform == Platform::Tpu && !a.no_estimate {
        estimate = print_estimate(t, spec)?;
    }
    let by = Compiler {
        target: t.target.spec.clone(),
        platform: t.target.platform.plugin().into(),
        platform_version: t.platform_version.clone(),
        plugin: &t.plugin,
        device_kind: t.device_kind().into(),
        devices: t.devices.len() as i64,
        hosts: t.hosts(),
        memory_per_device: t.memory_per_device(),
        usable_memory_per_device: usable,
    };
    record(&a.out, by, &build, estimate, manifest)?;
    println!(
        "wrote {} ({} bytes), {}{} and the build in manifest.json",
        a.out.join(program_dir::EXECUTABLE_FILE).display(),
        build.executable.len(),
        program_dir::OPTIMIZED_HLO_FILE,
        if build.memory_report.is_some() {
            format!(", {}", program_dir::MEMORY_REPORT_FILE)
        } else {
            String::new()
        }
    );
    if let Some(dir) = &a.xla_dump {
        println!("XLA's dumps: {}", dir.display());
    }
    Ok(fits)
}

/// The TPU compiler's estimate of the whole step, from unrolled 1- and 2-layer steps.
fn print_estimate(t: &TargetDevices, spec: &StepSpec) -> Result<Option<StepEstimate>> {
    eprintln!("xtrain: estimating the step from unrolled 1- and 2-layer steps");
    let e = t.estimate(spec)?;
    if !e.has_time() {
        println!(
            "no step time estimate: the TPU cost model's optimal_seconds for the unrolled 1- and \
             2-layer steps are {} and {}, not times (libtpu 0.0.42.1 gives negative ones for \
             every step measured on v6e; v5p's are positive); {:.4} TFLOP and {:.3} GB accessed \
             per device, extrapolated to {} layers",
            secs(e.unrolled_seconds[0]),
            secs(e.unrolled_seconds[1]),
            e.flops / 1e12,
            e.bytes_accessed / 1e9,
            e.layers
        );
        return Ok(None);
    }
    let tokens = (spec.batch * spec.seq) as f64;
    let model_flops = xtrain::train::bench::model_flops_per_step(spec);
    let devices = t.devices.len() as f64;
    let mfu = t
        .peak_bf16_tflops_per_device()
        .map(|peak| model_flops / (e.seconds * devices * peak * 1e12));
    println!(
        "estimated step, by the TPU compiler's cost model (optimal_seconds of unrolled 1- and \
         2-layer steps, extrapolated to {} layers; an estimate, not a measurement): {} per step, \
         {:.4} TFLOP and {:.3} GB accessed per device, {:.0} tokens/s{}",
        e.layers,
        secs(e.seconds),
        e.flops / 1e12,
        e.bytes_accessed / 1e9,
        tokens / e.seconds,
        match (mfu, t.target.peak_bf16_tflops_per_chip) {
            (Some(m), Some(peak)) => format!(
                ", estimated MFU {:.1}% (model FLOPs {:.4} TFLOP per step; peak {peak} TFLOP/s bf16 per chip)",
                100.0 * m,
                model_flops / 1e12
            ),
            _ => String::new(),
        }
    );
    Ok(Some(StepEstimate {
        seconds: e.seconds,
        flops_per_device: e.flops,
        bytes_accessed_per_device: e.bytes_accessed,
        tokens_per_s: tokens / e.seconds,
        model_flops_per_step: model_flops,
        mfu,
    }))
}

/// Who compiled a build, for its manifest record.
struct Compiler<'a> {
    target: String,
    platform: String,
    platform_version: String,
    plugin: &'a pjrt::Plugin,
    device_kind: String,
    devices: i64,
    hosts: i64,
    memory_per_device: Option<i64>,
    usable_memory_per_device: Option<i64>,
}

/// Add the build to the program dir: the executable, the optimized HLO and memory report when
/// the compiler dumped them, and the record in manifest.json.
fn record(
    out: &std::path::Path,
    by: Compiler,
    build: &TargetBuild,
    estimate: Option<StepEstimate>,
    manifest: &mut Manifest,
) -> Result<()> {
    let m = &build.stats;
    let (major, minor) = by.plugin.api_version();
    let record = Build {
        target: by.target,
        platform: by.platform,
        platform_version: by.platform_version,
        plugin_api: format!("{major}.{minor}"),
        plugin: by.plugin.path().display().to_string(),
        device_kind: by.device_kind,
        devices: by.devices,
        hosts: by.hosts,
        memory_per_device: by.memory_per_device,
        usable_memory_per_device: by.usable_memory_per_device,
        compile_s: build.compile_s,
        per_device: MemoryFigures {
            argument_bytes: m.argument_bytes,
            output_bytes: m.output_bytes,
            alias_bytes: m.alias_bytes,
            temp_bytes: m.temp_bytes,
            generated_code_bytes: m.generated_code_bytes,
            total_bytes: m.total_bytes(),
            host_argument_bytes: m.host_argument_bytes,
            host_temp_bytes: m.host_temp_bytes,
            host_total_bytes: m.host_total_bytes(),
        },
        cost: build.cost.as_ref().map(|c| c.iter().cloned().collect()),
        estimate,
        executable_sha256: program_dir::sha256_hex(&build.executable),
    };
    program_dir::write_build(
        out,
        manifest,
        record,
        &build.executable,
        build.optimized_hlo.as_deref(),
        build.memory_report.as_deref(),
    )
}

/// `xtrain targets [NAME]`.
pub fn targets(name: Option<&str>) -> Result<()> {
    use xtrain::device::target::{GpuArch, GPUS, TPUS};
    let Some(name) = name else {
        println!("TPU slices (libtpu's layouts, e.g. 2x2, 2x2x1, 4x4x4, 16x16; 1x1 for one chip):");
        for t in TPUS {
            println!(
                "  tpu:{}:<chips>  {} TFLOP/s bf16 per chip",
                t.name, t.peak_bf16_tflops_per_chip
            );
        }
        println!(
            "GPUs (<count> per host, or <hosts>x<per host>; --target-config FILE for others):"
        );
        for g in GPUS {
            let arch = match g.arch {
                GpuArch::Cuda(a, b) => format!("sm_{a}{b}"),
                GpuArch::Rocm(n) => n.split(':').next().unwrap_or(n).to_string(),
            };
            let platform = match g.arch {
                GpuArch::Cuda(..) => "cuda",
                GpuArch::Rocm(_) => "rocm",
            };
            println!(
                "  {platform}:{}:<count>  {} ({arch}, {} {}, {}, {:.1} TB/s, {} TFLOP/s bf16)",
                g.name,
                g.kind,
                g.cores,
                if platform == "cuda" { "SMs" } else { "CUs" },
                gib(g.memory_bytes),
                g.bandwidth_bytes_per_s as f64 / 1e12,
                g.peak_bf16_tflops
            );
        }
        return Ok(());
    };
    let (platform, device) = name.split_once(':').unwrap_or(("", name));
    let device = device.split(':').next().unwrap_or(device);
    let Some(g) = GPUS.iter().find(|g| {
        g.name == device
            && matches!(
                (platform, g.arch),
                ("cuda", GpuArch::Cuda(..)) | ("rocm", GpuArch::Rocm(_))
            )
    }) else {
        bail!(
            "`{name}` is not a built-in GPU (TPUs need no description); known: {}",
            xtrain::device::target::known_targets()
        );
    };
    print!("{}", g.target_config());
    Ok(())
}

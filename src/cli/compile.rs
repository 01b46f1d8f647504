//! `xtrain compile`: build the step program and write its directory; with `--check`, compile it
//! (with this machine's plugin, or for `--target` hardware that need not be here) and print the
//! compiler's memory figures.

use crate::cli::args::StepArgs;
use crate::cli::figures::{gib, print_memory};
use crate::cli::target::{check_target, print_target, record, BuildTo, Compiler};
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use xtrain::device::memory::auto::{first_that_fits, Choice};
use xtrain::device::target::aot::{TargetBuild, TargetDevices};
use xtrain::device::target::{Platform, Target};
use xtrain::formats::program_dir::{self, Manifest};
use xtrain::program::sharding::SplitsNothing;
use xtrain::program::{default_choice, fit_choices, MeshPlan, Program, StepSpec};

#[derive(Args)]
pub struct CompileArgs {
    /// A TOML recipe whose keys are these flags (`lora_r = 16`); flags on the command line
    /// override it (see recipes/).
    #[arg(long, value_name = "FILE")]
    // Read before parsing, by config::expand; here only as an input --out may not replace.
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
    /// With --check: a kernel to compile in place of the composite ops it implements
    /// (repeatable), e.g. `every-key`; each build records what it replaced. The program's text
    /// is the same with or without.
    #[arg(long = "kernel", value_name = "NAME")]
    pub kernel: Vec<String>,
    /// With --check: write XLA's optimized HLO here.
    #[arg(long)]
    pub xla_dump: Option<PathBuf>,
    /// With --check and no --target: the PJRT plugin to compile with (cpu, cuda, rocm, tpu or a
    /// path; default $XTRAIN_PLUGIN or cpu). With a --target: that target's plugin file. The
    /// program's text does not depend on it.
    #[arg(long)]
    pub plugin: Option<String>,
    /// Hardware to compile for, which need not be here; repeat it for several targets of the
    /// same device count (one program, one executable each): tpu:<generation>:<chips>
    /// (tpu:v5p:2x2x1, tpu:v5e:2x2, tpu:v6e:16x16), cuda:<gpu>:<count> or rocm:<gpu>:<count>
    /// with <count> per host or <hosts>x<per host> (cuda:h100:8, cuda:h100:2x8, rocm:mi300x:8).
    /// Without --mesh the mesh is FSDP over all its devices. The plugins are needed only with
    /// --check.
    #[arg(long)]
    pub target: Vec<String>,
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
    /// The files and directories this command reads, which `--out` may not be or hold: the model
    /// dir (or config file), the `--config` recipe, the sharding rules, the `--target-config`
    /// file and a plugin given as a file.
    fn inputs(&self) -> Vec<&std::path::Path> {
        let model = std::path::Path::new(&self.model);
        let plugin = self.plugin.as_deref().map(std::path::Path::new);
        [
            model.exists().then_some(model),
            self.config.as_deref(),
            self.step.sharding_rules.as_deref(),
            self.target_config.as_deref(),
            plugin.filter(|p| p.is_file()),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// The directory the program and its build are written to now (see [`CompileArgs::stage`]);
    /// messages name `out`, where they will be.
    pub(super) fn dir(&self) -> &std::path::Path {
        self.stage.as_deref().unwrap_or(&self.out)
    }
}

/// `plugin_from_recipe`: the `--config` recipe, not the command line, gave `--plugin`.
pub fn compile(mut a: CompileArgs, verbose: bool, plugin_from_recipe: bool) -> Result<()> {
    // A recipe's top-level `plugin` serves `train` too: without --check it is left unused, not
    // refused; typed on the command line, it would do nothing.
    if a.plugin.is_some() && !a.check && plugin_from_recipe {
        a.plugin = None;
    }
    let cfg = crate::cli::model::model_config(&a.model, a.revision.as_deref())?;
    let targets = parse_targets(&a)?;
    if !a.check {
        if let Some(d) = &a.xla_dump {
            bail!(
                "--xla-dump {} writes what XLA's compiler made of the program, which runs only \
                 with --check",
                d.display()
            );
        }
        if a.no_estimate {
            bail!("--no-estimate skips the TPU estimate of --check; without --check there is none");
        }
    } else if a.no_estimate && !targets.iter().any(|t| t.platform == Platform::Tpu) {
        bail!("--no-estimate is for --check with a TPU --target (only TPUs are estimated)");
    }
    if a.plugin.is_some() && !a.check {
        bail!(
            "--plugin names the plugin that compiles the program with --check; without --check \
             nothing is compiled (the program text is the same for every plugin)"
        );
    }
    let mut options = a.step.options()?;
    for (_, note) in options.idle_result_types() {
        eprintln!("xtrain: note: {note}");
    }
    // The mesh `fsdp=N` taken from the targets' device count, where --mesh is left out.
    let mut derived = None;
    if let Some(n) = target_devices(&targets)? {
        match &options.mesh {
            None if n > 1 => {
                derived = Some(n);
                options.mesh = Some(MeshPlan {
                    axes: vec![("fsdp".into(), n)],
                    rules: a.step.rules()?,
                })
            }
            None => {}
            Some(m) if m.devices() != n => bail!(
                "--mesh {} has {} but --target {} has {n}; give a mesh of {} (or leave --mesh \
                 out: fsdp={n})",
                a.step.mesh.as_deref().unwrap_or_default(),
                devices(m.devices()),
                targets[0].spec,
                devices(n)
            ),
            Some(_) => {}
        }
    }
    if !a.check {
        for t in &targets {
            println!(
                "target {}: {} devices (the program is written for them; --check compiles it \
                 with the {} plugin)",
                t.spec,
                t.chips,
                t.platform.plugin()
            );
        }
    }
    // The compilers of the targets, opened only to compile (--check): the text needs none.
    if !a.kernel.is_empty() && !a.check {
        anyhow::bail!(
            "--kernel {} replaces a composite when the program is compiled: add --check (the \
             program's text is the same with or without)",
            a.kernel.join(" --kernel ")
        );
    }
    let devices: Vec<TargetDevices> = if a.check {
        targets
            .iter()
            .map(|t| {
                let mut d = TargetDevices::open(t, a.plugin.as_deref(), verbose)?;
                d.kernels = xtrain::device::kernels::chosen(&a.kernel, t.platform.plugin())?;
                Ok(d)
            })
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    a.out = xtrain::formats::outdir::check_writable_dir(&a.out, a.overwrite, &a.inputs())?;
    // The program dir is built beside `--out` and moved into place only once complete (the
    // program and, with --check, its builds): a compile that fails or is interrupted leaves what
    // `--out` held as it was (a killed one's staging dir is removed by the next writer).
    let stage = xtrain::formats::atomic::staging_dir(&a.out)?;
    a.stage = Some(stage.clone());
    let result = compile_choices(&a, &cfg, &options, &devices, verbose).map_err(|e| {
        match (derived, e.downcast_ref::<SplitsNothing>()) {
            (Some(n), Some(s)) => derived_mesh_splits_nothing(&targets[0].spec, n, s),
            _ => e,
        }
    });
    a.stage = None;
    match result {
        Ok(()) => xtrain::formats::atomic::replace_dir_with(&a.out, &stage),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&stage);
            Err(e)
        }
    }
}

/// The mesh `fsdp=n` that compile took from `--target target` (no --mesh given) splits nothing:
/// said as the target's, with what would split something (another mesh axis under the sharding
/// rules, a batch that n divides, or a target of fewer devices that divide a dimension).
fn derived_mesh_splits_nothing(target: &str, n: i64, s: &SplitsNothing) -> anyhow::Error {
    let fix = match s.would_split.first() {
        Some(axis) => format!("give --mesh with an axis that divides, e.g. --mesh {axis}={n}"),
        None => {
            let fewer = (2..n)
                .rev()
                .find(|d| s.sizes.iter().any(|x| x % d == 0))
                .map(|d| match target.strip_suffix(&format!(":{n}")) {
                    Some(base) => format!(" (e.g. --target {base}:{d})"),
                    None => format!(" (e.g. one of {d} devices)"),
                })
                .unwrap_or_default();
            format!(
                "no mesh axis of {n} devices divides them, so give a --batch divisible by {n} \
                 (e.g. --batch {n}, which {}={n} splits), or a --target with a number of devices \
                 that divides them{fewer}",
                s.axis
            )
        }
    };
    anyhow::anyhow!(
        "the mesh taken from --target {target}, {}={}, splits nothing: {}; {fix}",
        s.axis,
        s.size,
        s.why()
    )
}

/// `--target` (each once) and `--target-config`, which describes the one GPU target given.
fn parse_targets(a: &CompileArgs) -> Result<Vec<Target>> {
    let gpus = a
        .target
        .iter()
        .filter(|t| t.starts_with("cuda:") || t.starts_with("rocm:"))
        .count();
    if let Some(f) = &a.target_config {
        if gpus == 0 {
            bail!(
                "--target-config {} describes the GPU of a --target; give --target \
                 cuda:<name>:<count> or rocm:<name>:<count> too",
                f.display()
            );
        }
        if gpus > 1 {
            bail!(
                "--target-config {} describes one GPU, but {gpus} GPU targets are given; compile \
                 a target described by a file on its own",
                f.display()
            );
        }
    }
    let mut targets: Vec<Target> = Vec::new();
    for t in &a.target {
        let gpu = t.starts_with("cuda:") || t.starts_with("rocm:");
        let config = if gpu {
            a.target_config.as_deref()
        } else {
            None
        };
        let target = Target::parse(t, config)?;
        if targets.iter().any(|o| o.spec == target.spec) {
            bail!("--target {t} is given twice; give each target once");
        }
        targets.push(target);
    }
    Ok(targets)
}

/// The device count the targets share (one program is for one mesh), if any target is given.
fn target_devices(targets: &[Target]) -> Result<Option<i64>> {
    let Some(first) = targets.first() else {
        return Ok(None);
    };
    if let Some(other) = targets.iter().find(|t| t.chips != first.chips) {
        bail!(
            "--target {} has {} but --target {} has {}: one program dir holds one program, for \
             one mesh; compile the targets of each device count into a program dir of its own",
            first.spec,
            devices(first.chips),
            other.spec,
            other.chips
        );
    }
    Ok(Some(first.chips))
}

/// Write the step's program dir (into [`CompileArgs::dir`]) for each remat and offload choice in
/// turn, and with `--check` compile it for every target (or with this machine's plugin), until
/// one fits them all or none is left ([`first_that_fits`]).
fn compile_choices(
    a: &CompileArgs,
    cfg: &xtrain::model::config::LlamaConfig,
    options: &xtrain::program::StepOptions,
    targets: &[TargetDevices],
    verbose: bool,
) -> Result<()> {
    // `--remat auto` and `--offload auto` try the choices in order until the step fits every
    // target's devices; without a target's memory to fit, remat per layer and no offload.
    let choices: Vec<Choice> = if !targets.is_empty() {
        fit_choices(options.remat, options.offload)
    } else {
        vec![default_choice(options.remat, options.offload)]
    };
    for t in targets {
        print_target(t)?;
    }
    let mut first = true;
    let build = |(remat, offload): Choice| {
        let spec = StepSpec {
            remat,
            offload,
            ..options.spec(cfg.clone(), a.batch, a.seq)?
        };
        let (program, manifest) = write_program(a, &spec)?;
        if std::mem::take(&mut first) {
            if let Some(m) = &spec.mesh {
                print_device_order(m);
            }
        }
        Ok((spec, program, manifest))
    };
    let take = |(spec, program, manifest): &mut (StepSpec, Program, Manifest),
                choice: Choice,
                next: Option<Choice>| {
        if !a.check {
            return Ok(true);
        }
        if targets.is_empty() {
            check(a, spec, program, manifest, verbose)?;
            return Ok(true);
        }
        check_targets(a, targets, spec, program, manifest, choice, next)
    };
    first_that_fits(&choices, build, take)?;
    Ok(())
}

/// `--check --target`: compile one choice's step for every target, until one it does not fit.
/// Returns whether to take the choice: it fits them all, or it is the last (recorded whether or
/// not it fits: its report says by how much not). Says what is tried next otherwise.
fn check_targets(
    a: &CompileArgs,
    targets: &[TargetDevices],
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
    (remat, offload): Choice,
    next: Option<Choice>,
) -> Result<bool> {
    let last = next.is_none();
    let mut fits_all = true;
    for t in targets {
        let dump = a.xla_dump.as_ref().map(|d| {
            if targets.len() > 1 {
                d.join(program_dir::build_file(&t.target.spec, "dump"))
            } else {
                d.clone()
            }
        });
        let to = BuildTo {
            dir: a.dir(),
            out: &a.out,
            estimate: !a.no_estimate,
        };
        if !check_target(&to, t, spec, program, manifest, last, dump.as_deref())? {
            fits_all = false;
            if !last {
                break;
            }
        }
    }
    let Some((next_remat, next_offload)) = next.filter(|_| !fits_all) else {
        if targets.len() > 1 {
            println!(
                "one program ({}), {} executables: {}",
                manifest.program_sha256,
                manifest.builds.len(),
                manifest
                    .builds
                    .iter()
                    .map(|b| b.executable.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        return Ok(true);
    };
    println!(
        "(auto: --remat {} --offload {} does not fit{}; trying --remat {} --offload {})",
        remat.name(),
        offload.name(),
        if targets.len() > 1 {
            " every target"
        } else {
            ""
        },
        next_remat.name(),
        next_offload.name()
    );
    Ok(false)
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
    println!("form: {}", spec.form());
    println!("program sha256 {}", manifest.program_sha256);
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

/// `--check` without a target: compile the program with this machine's plugin, and keep the
/// executable in the program dir for `train --program` on this machine.
fn check(
    a: &CompileArgs,
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
    verbose: bool,
) -> Result<()> {
    let platform = xtrain::device::platform::named_platform(a.plugin.as_deref());
    xtrain::device::platform::check_offload(platform, spec.offload, "this step")?;
    let mut rt =
        xtrain::device::runtime::Runtime::open(a.plugin.as_deref(), Some(program.partitions))?;
    xtrain::device::platform::check_offload(&rt.platform(), spec.offload, "this step")?;
    rt.use_kernels(&a.kernel)?;
    let kernels = xtrain::device::kernels::say_used(&rt.kernels, &rt.kernel_text(program)?.1)?;
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
        extra_options: Vec::new(),
        kernels,
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
    let file = record(a.dir(), by, &build, None, manifest)?;
    println!(
        "wrote {} ({} bytes) for `xtrain train --program` on this machine",
        a.out.join(file).display(),
        build.executable.len()
    );
    if let Some(dir) = &a.xla_dump {
        println!("XLA's HLO dumps: {}", dir.display());
    }
    Ok(())
}

/// `1 device`, `4 devices`.
fn devices(n: i64) -> String {
    if n == 1 {
        "1 device".into()
    } else {
        format!("{n} devices")
    }
}

//! `xtrain compile` as a stage of the library, as `train::run` is `xtrain train`: build the step
//! program for the model and shapes asked for and write its program dir; with `check`, compile
//! it (with this machine's plugin, or for `--target` hardware that need not be here, each
//! target's compiler opened through `device`) and record each build, trying the choices of
//! `--remat auto` and `--offload auto` until one fits. [`run`] says what it does as it goes (as
//! `train::run` does) and returns a [`CompileReport`]; the binary parses the flags into
//! [`CompileOptions`] and prints the report's summary.

mod check;
pub mod figures;
mod options;
pub mod target;
mod write;

pub use options::{CompileOptions, Writing};

use crate::device::absent::aot::TargetDevices;
use crate::device::absent::{Platform, Target};
use crate::device::memory::auto::{first_that_fits, Choice};
use crate::formats::program_dir::{self, Attempt, Manifest};
use crate::program::sharding::SplitsNothing;
use crate::program::{default_choice, fit_choices, MeshPlan, Program, StepSpec};
use anyhow::{bail, Result};
use target::{check_target, print_target, BuildTo};

/// What a compile wrote and chose.
pub struct CompileReport {
    /// The program dir, complete.
    pub out: std::path::PathBuf,
    /// The spec the program was built for (the remat and offload auto chose among them).
    pub spec: StepSpec,
    /// The manifest as written, with a build per target compiled for.
    pub manifest: Manifest,
    /// `--target`s as given.
    pub targets: Vec<String>,
    /// With `check`: the remat and offload taken (auto's choice where they were auto).
    pub chosen: Option<Choice>,
}

/// Build the step and write its program dir (into `o.out`, replaced only once complete); with
/// `o.check`, compile it as well.
pub fn run(o: &CompileOptions) -> Result<CompileReport> {
    let targets = parse_targets(o)?;
    if !o.check {
        if let Some(d) = &o.xla_dump {
            bail!(
                "--xla-dump {} writes what XLA's compiler made of the program, which runs only \
                 with --check",
                d.display()
            );
        }
        if o.no_estimate {
            bail!("--no-estimate skips the TPU estimate of --check; without --check there is none");
        }
    } else if o.no_estimate && !targets.iter().any(|t| t.platform == Platform::Tpu) {
        bail!("--no-estimate is for --check with a TPU --target (only TPUs are estimated)");
    }
    if o.plugin.is_some() && !o.check {
        bail!(
            "--plugin names the plugin that compiles the program with --check; without --check \
             nothing is compiled (the program text is the same for every plugin)"
        );
    }
    let mut options = o.step.clone();
    for (_, note) in options.idle_result_types() {
        crate::esay!("xtrain: note: {note}");
    }
    // The mesh `fsdp=N` taken from the targets' device count, where --mesh is left out.
    let mut derived = None;
    if let Some(n) = target_devices(&targets)? {
        match &options.mesh {
            None if n > 1 => {
                derived = Some(n);
                options.mesh = Some(MeshPlan {
                    axes: vec![("fsdp".into(), n)],
                    rules: o.rules.clone(),
                })
            }
            None => {}
            Some(m) if m.devices() != n => bail!(
                "--mesh {} has {} but --target {} has {n}; give a mesh of {} (or leave --mesh \
                 out: fsdp={n})",
                o.mesh_flag.as_deref().unwrap_or_default(),
                devices(m.devices()),
                targets[0].spec,
                devices(n)
            ),
            Some(_) => {}
        }
    }
    if !o.check {
        for t in &targets {
            crate::say!(
                "target {}: {} devices (the program is written for them; --check compiles it \
                 with the {} plugin)",
                t.spec,
                t.chips,
                t.platform.plugin()
            );
        }
    }
    if !o.kernels.is_empty() && !o.check {
        bail!(
            "--kernel {} replaces a composite when the program is compiled: add --check (the \
             program's text is the same with or without)",
            o.kernels.join(" --kernel ")
        );
    }
    // The compilers of the targets, opened only to compile (--check): the text needs none.
    let compilers: Vec<TargetDevices> = if o.check {
        targets
            .iter()
            .map(|t| {
                // Chosen before the plugin is opened (or downloaded): a kernel that does not
                // run on the target is refused first.
                let kernels = crate::device::kernels::chosen(&o.kernels, t.platform.plugin())?;
                let mut d = TargetDevices::open(t, o.plugin.as_deref(), o.verbose)?;
                d.kernels = kernels;
                Ok(d)
            })
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let inputs: Vec<&std::path::Path> = o.inputs.iter().map(|p| p.as_path()).collect();
    let out = crate::formats::outdir::check_writable_dir(&o.out, o.overwrite, &inputs)?;
    // The program dir is built beside `--out` and moved into place only once complete (the
    // program and, with --check, its builds): a compile that fails or is interrupted leaves what
    // `--out` held as it was (a killed one's staging dir is removed by the next writer).
    let stage = crate::formats::atomic::staging_dir(&out)?;
    let w = Writing {
        o,
        out: out.clone(),
        dir: stage.clone(),
    };
    let result = compile_choices(&w, &options, &compilers).map_err(|e| {
        match (derived, e.downcast_ref::<SplitsNothing>()) {
            (Some(n), Some(s)) => derived_mesh_splits_nothing(&targets[0].spec, n, s),
            _ => e,
        }
    });
    match result {
        Ok((chosen, spec, manifest)) => {
            let replace = crate::formats::atomic::Replace::when(o.overwrite);
            crate::formats::atomic::replace_dir_with_as(&out, &stage, replace)?;
            Ok(CompileReport {
                out,
                spec,
                manifest,
                targets: targets.iter().map(|t| t.spec.clone()).collect(),
                chosen: o.check.then_some(chosen),
            })
        }
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
                "no mesh axis of {n} devices divides them, so give a --batch-size divisible by {n} \
                 (e.g. --batch-size {n}, which {}={n} splits), or a --target with a number of devices \
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
fn parse_targets(a: &CompileOptions) -> Result<Vec<Target>> {
    let gpus = a
        .targets
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
    for t in &a.targets {
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

/// Write the step's program dir (into [`Writing::dir`]) for each remat and offload choice in
/// turn, and with `--check` compile it for every target (or with this machine's plugin), until
/// one fits them all or none is left ([`first_that_fits`]). Returns the choice taken, its spec
/// and its manifest.
fn compile_choices(
    w: &Writing,
    options: &crate::program::StepOptions,
    targets: &[TargetDevices],
) -> Result<(Choice, StepSpec, Manifest)> {
    let a = w.o;
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
            ..options.spec(a.model.clone(), a.batch, a.seq)?
        };
        let (program, manifest) = write::write_program(w, &spec)?;
        if std::mem::take(&mut first) {
            if let Some(m) = &spec.mesh {
                write::print_device_order(m);
            }
        }
        Ok((spec, program, manifest))
    };
    let mut tried = Vec::new();
    let take = |(spec, program, manifest): &mut (StepSpec, Program, Manifest),
                choice: Choice,
                next: Option<Choice>| {
        if !a.check {
            return Ok(true);
        }
        if targets.is_empty() {
            check::check(w, spec, program, manifest)?;
            return Ok(true);
        }
        check_targets(
            w, targets, spec, program, manifest, choice, next, &mut tried,
        )
    };
    let Some((choice, (spec, _, mut manifest))) = first_that_fits(&choices, build, take)? else {
        bail!("no remat or offload choice was taken");
    };
    // What was compiled before the choice taken, for tables of every attempt (tools/target-tables).
    let (remat, offload) = (choice.0.name(), choice.1.name());
    tried.retain(|a: &Attempt| (a.remat.as_str(), a.offload.as_str()) != (remat, offload));
    if !tried.is_empty() {
        program_dir::write_attempts(w.dir(), &mut manifest, tried)?;
    }
    Ok((choice, spec, manifest))
}

/// `--check --target`: compile one choice's step for every target, until one it does not fit.
/// Returns whether to take the choice: it fits them all, or it is the last (recorded whether or
/// not it fits: its report says by how much not). Says what is tried next otherwise.
#[allow(clippy::too_many_arguments)]
fn check_targets(
    w: &Writing,
    targets: &[TargetDevices],
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
    (remat, offload): Choice,
    next: Option<Choice>,
    tried: &mut Vec<Attempt>,
) -> Result<bool> {
    let last = next.is_none();
    let mut fits_all = true;
    for t in targets {
        let dump = w.o.xla_dump.as_ref().map(|d| {
            if targets.len() > 1 {
                d.join(program_dir::build_file(&t.target.spec, "dump"))
            } else {
                d.clone()
            }
        });
        let to = BuildTo {
            dir: w.dir(),
            out: &w.out,
            estimate: !w.o.no_estimate,
        };
        if !check_target(
            &to,
            t,
            spec,
            program,
            manifest,
            last,
            dump.as_deref(),
            tried,
        )? {
            fits_all = false;
            if !last {
                break;
            }
        }
    }
    let Some((next_remat, next_offload)) = next.filter(|_| !fits_all) else {
        if targets.len() > 1 {
            crate::say!(
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
    crate::say!(
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

/// `1 device`, `4 devices`.
fn devices(n: i64) -> String {
    if n == 1 {
        "1 device".into()
    } else {
        format!("{n} devices")
    }
}

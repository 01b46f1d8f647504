//! The step a run trains with, prepared before any weight is loaded: the plugin opened, and the
//! step taken from a program dir (its executable where one was compiled for these devices) or
//! built here, with `--remat auto` and `--offload auto` decided against the device's memory.
//! Refused here: a step that needs more devices than this process has.

use crate::device::runtime::Runtime;
use crate::formats::program_dir::Build;
use crate::model::config::LlamaConfig;
use crate::program::{self, Program, StepSpec};
use crate::train::options::TrainOptions;
use anyhow::{bail, Result};

/// A refusal of the step's length (`--seq 20 must be a multiple of 8`) where the length is a
/// pre-tokenized batch's and no `--seq` was given: named as the batch's.
fn name_the_batchs_length(
    e: anyhow::Error,
    opts: &TrainOptions,
    batch: i64,
    seq: i64,
) -> anyhow::Error {
    let flag = format!("--seq {seq}");
    let text = format!("{e:#}");
    if !opts.data.is_batch_file() || opts.given("seq") || !text.contains(&flag) {
        return e;
    }
    let file = opts
        .data
        .path
        .file_name()
        .unwrap_or_default()
        .to_string_lossy();
    let named = format!(
        "the batch's length {seq} ({file} is {batch}x{seq}: a pre-tokenized batch sets the length)"
    );
    anyhow::anyhow!("{}", text.replacen(&flag, &named, 1))
}

/// Open the plugin and prepare the step: take it from a program dir (checking that it was built for
/// this model and batch), or build it for the plugin's platform. A CPU plugin gets as many
/// virtual devices as the mesh needs; an accelerator plugin has what it has, and compiling
/// checks that there are enough.
pub fn prepare(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    batch: i64,
    seq: i64,
) -> Result<(Runtime, StepSpec, Program)> {
    prepare_with(opts, cfg, batch, seq, |devices| {
        Runtime::open(opts.plugin.as_deref(), Some(devices.max(1)))
    })
}

/// [`prepare`] with the plugin opened by `open` (given the step's number of devices): a process of
/// a run of several opens its client through the run's store and places the step over every
/// process's devices.
pub fn prepare_with(
    opts: &TrainOptions,
    cfg: &LlamaConfig,
    batch: i64,
    seq: i64,
    open: impl Fn(i64) -> Result<Runtime>,
) -> Result<(Runtime, StepSpec, Program)> {
    if let Some(dir) = &opts.program {
        let (program, spec) =
            crate::formats::program_dir::read_dir_for_model(dir, cfg, &opts.model)?;
        if (spec.examples(), spec.seq) != (batch, seq) {
            let pairs = if spec.dpo.is_some() { " pairs" } else { "" };
            bail!(
                "program dir {} takes batches of {}x{}{pairs} but the data gives {batch}x{seq}",
                dir.display(),
                spec.examples(),
                spec.seq
            );
        }
        let mut rt = open(program.partitions)?;
        let builds = crate::formats::program_dir::read_builds(dir)?;
        rt.use_kernels(&kernels_of_dir(&opts.kernels, &rt, &builds, dir))?;
        crate::device::kernels::announce(&rt.kernel_text(&program)?.uses);
        one_process(
            &rt.platform(),
            in_run(&rt),
            program.partitions,
            &builds,
            &format!("program dir {}", dir.display()),
        )?;
        crate::device::platform::check_offload(
            &rt.platform(),
            spec.offload,
            &format!("program dir {}", dir.display()),
        )?;
        rt.prebuilt = prebuilt(&rt, dir, &program)?;
        crate::esay!(
            "xtrain: program dir {}: --remat {}, --offload {} (as it was compiled)",
            dir.display(),
            spec.remat.name(),
            spec.offload.name()
        );
        return Ok((rt, spec, program));
    }
    let devices = opts.step.mesh.as_ref().map_or(1, |m| m.devices());
    let mut rt = open(devices)?;
    one_process(
        &rt.platform(),
        in_run(&rt),
        devices,
        &[],
        &format!(
            "--mesh {}",
            opts.step.mesh.as_ref().map_or(String::new(), |m| m
                .axes
                .iter()
                .map(|(a, n)| format!("{a}={n}"))
                .collect::<Vec<_>>()
                .join(","))
        ),
    )?;
    let spec = opts
        .step
        .spec(cfg.clone(), batch, seq)
        .map_err(|e| name_the_batchs_length(e, opts, batch, seq))?;
    // Chosen here, checked against the step (and announced) once it is built: a compile of a
    // candidate below refuses a kernel that would replace nothing before XLA sees the text.
    rt.use_kernels(&opts.kernels)?;
    if let Some(o) = opts.step.offload {
        crate::device::platform::check_offload(&rt.platform(), o, "this step")?;
    }
    let choices = crate::program::fit_choices(opts.step.remat, opts.step.offload);
    if rt.platform() != "cpu" && (choices.len() > 1 || !choices[0].1.is_none()) {
        // On an accelerator: the first of save-proj and layer remat (--remat auto) and the least
        // offload (--offload auto) that fits its memory, or the ones asked for, checked against
        // the device's and the host's memory before any weight loads.
        let (spec, program) = crate::device::memory::offload::choose(
            &mut rt,
            &choices,
            crate::program::default_choice(opts.step.remat, opts.step.offload),
            |(remat, offload)| {
                let s = StepSpec {
                    remat,
                    offload,
                    ..spec.clone()
                };
                let p = program::build_train_step(&s)?;
                Ok((s, p))
            },
            opts.use_cache,
        )?;
        crate::device::kernels::announce(&rt.kernel_text(&program)?.uses);
        return Ok((rt, spec, program));
    }
    let program = program::build_train_step(&spec)?;
    crate::device::kernels::announce(&rt.kernel_text(&program)?.uses);
    Ok((rt, spec, program))
}

/// The devices the step can run on: this process's, or every process's of a run of several.
fn in_run(rt: &Runtime) -> usize {
    rt.hosts
        .placement()
        .map_or(rt.devices.len(), |p| p.ids.len())
}

/// A run of one process trains on the devices its plugin gives it: a step whose mesh needs more
/// (`what`: a program dir compiled for several hosts, such as `tpu:v5p:4x4x2` or `cuda:h100:2x8`,
/// or a `--mesh` larger than this host) is refused before anything is loaded, rather than
/// failing inside the plugin; a multi-host dir is pointed to `--num-processes` (one process per
/// host, `train::hosts`). `builds` are the program dir's (its multi-host
/// targets are named). The CPU plugin makes as many devices as asked, so it never refuses.
pub fn one_process(
    platform: &str,
    devices: usize,
    partitions: i64,
    builds: &[Build],
    what: &str,
) -> Result<()> {
    if partitions <= devices as i64 {
        return Ok(());
    }
    let hosts: Vec<String> = builds
        .iter()
        .filter(|b| b.hosts > 1)
        .map(|b| format!("{} ({} devices on {} hosts)", b.target, b.devices, b.hosts))
        .collect();
    let compiled = if hosts.is_empty() {
        String::new()
    } else {
        format!(" It was compiled for {}.", hosts.join(", "))
    };
    let hosts_needed = builds.iter().map(|b| b.hosts).max().unwrap_or(1);
    let across = if hosts_needed > 1 {
        format!(
            "run it as a multi-host dir: start one process per host with the same command and \
             --num-processes {hosts_needed} (docs/usage.md, \"Several hosts\"), "
        )
    } else {
        String::new()
    };
    bail!(
        "{what} needs {partitions} devices, but this process has {devices} ({platform}).{compiled} \
         One process trains on one host's devices: {across}train on a mesh of at most \
         {devices} devices (e.g. --mesh fsdp={devices}, with --quant nf4 or --offload where \
         the model does not fit), or compile for one host (`xtrain compile --target \
         <platform>:<device>:<count>`)"
    )
}

/// The kernels a run of a program dir uses: those `--kernel` names, or else those the dir's
/// build for this plugin and these devices was compiled with (said), as every other recorded
/// setting is taken from the dir.
fn kernels_of_dir(
    asked: &[String],
    rt: &Runtime,
    builds: &[Build],
    dir: &std::path::Path,
) -> Vec<String> {
    if !asked.is_empty() {
        return asked.to_vec();
    }
    let Some(build) = builds
        .iter()
        .find(|b| crate::device::cache::matches(rt, b).is_ok())
    else {
        return Vec::new();
    };
    let mut names: Vec<String> = build.kernels.iter().map(|k| k.kernel.clone()).collect();
    names.dedup();
    if !names.is_empty() {
        crate::esay!(
            "xtrain: program dir {}: --kernel {} (as it was compiled for {})",
            dir.display(),
            names.join(" --kernel "),
            build.target
        );
    }
    names
}

/// The executable of a program dir's builds that was compiled for this plugin and these
/// devices, if one was; otherwise the dir's program text is compiled here, and the reason is
/// said. Either way the program is the dir's own text.
fn prebuilt(
    rt: &Runtime,
    dir: &std::path::Path,
    program: &Program,
) -> Result<Option<crate::device::runtime::Prebuilt>> {
    use crate::formats::program_dir;
    let builds = program_dir::read_builds(dir)?;
    let mut why_not = Vec::new();
    let replaced = rt.kernel_text(program)?;
    let kernels = &replaced.uses;
    for build in &builds {
        let matched = crate::device::cache::matches(rt, build).and_then(|()| {
            match build.kernels == *kernels {
                true => Ok(()),
                false => Err(format!(
                    "{} was compiled with kernels [{}], this run asks for [{}]",
                    build.target,
                    build
                        .kernels
                        .iter()
                        .map(|k| k.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    kernels
                        .iter()
                        .map(|k| k.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
            }
        });
        match matched {
            Ok(()) => {
                // A missing or damaged executable is only a lost compile: the program text it
                // was compiled from is checked against the manifest and compiled here instead.
                let executable = match program_dir::read_executable(dir, build) {
                    Ok(e) => e,
                    Err(e) => {
                        crate::esay!(
                            "xtrain: compiling {} here, the same program: {e:#}",
                            dir.join("train_step.mlir").display()
                        );
                        return Ok(None);
                    }
                };
                return Ok(Some(crate::device::runtime::Prebuilt {
                    program_sha256: program_dir::sha256_hex(program.text.as_bytes()),
                    executable,
                    from: format!(
                        "by `xtrain compile` for {} ({})",
                        build.target,
                        dir.join(&build.executable).display()
                    ),
                }));
            }
            Err(why) => why_not.push(why),
        }
    }
    if !builds.is_empty() {
        crate::esay!(
            "xtrain: compiling {} here, the same program (this machine has {}; no executable \
             of the dir fits this run: {})",
            dir.join("train_step.mlir").display(),
            crate::device::cache::describe(rt),
            why_not.join("; ")
        );
    }
    Ok(None)
}

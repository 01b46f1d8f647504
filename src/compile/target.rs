//! `xtrain compile --target`: the step compiled for hardware that need not be here (the target's
//! own compiler: its memory figures, a TPU's cost analysis and whole-step estimate, the build
//! recorded in the program dir). Apart from `mod.rs` because it is the part about targets.

use crate::compile::figures::print_memory;
use crate::device::absent::aot::{TargetBuild, TargetDevices};
use crate::device::absent::Platform;
use crate::formats::program_dir::{self, Attempt, Build, Manifest, MemoryFigures, StepEstimate};
use crate::program::{Program, StepSpec};
use crate::words::{duration, gib};
use anyhow::Result;

/// Where `--check` writes a build, and what it does besides compiling.
pub struct BuildTo<'a> {
    /// The program dir being written now (see `Writing::dir`).
    pub dir: &'a std::path::Path,
    /// Where the program dir will be once complete: the name messages use (`--out`).
    pub out: &'a std::path::Path,
    /// Estimate a TPU step's time from unrolled steps (`--no-estimate` not given).
    pub estimate: bool,
}

/// What the target is, as its plugin describes it.
pub fn print_target(t: &TargetDevices) -> Result<()> {
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
    crate::say!(
        "target {}: {} x {} on {}{memory} ({} plugin{version}, PJRT C API {}.{})",
        t.target.spec,
        t.devices.len(),
        t.device_kind(),
        crate::words::count(t.hosts().max(0) as usize, "host"),
        t.target.platform.plugin(),
        t.plugin.api_version().0,
        t.plugin.api_version().1,
    );
    Ok(())
}

/// `--check --target`: compile for the target with its plugin, print the compiler's figures (and
/// for TPUs its cost analysis and a whole-step estimate), and add the build to the program dir.
/// Returns whether the step fits the target's devices (true where their memory is unknown);
/// one that does not fit is recorded only if it is the `last` choice. Every compile is added to
/// `tried` (the manifest's attempts, once the choice taken is known).
#[allow(clippy::too_many_arguments)]
pub fn check_target(
    to: &BuildTo,
    t: &TargetDevices,
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
    last: bool,
    dump: Option<&std::path::Path>,
    tried: &mut Vec<Attempt>,
) -> Result<bool> {
    let attempt = |compiled: Option<&TargetBuild>, fits: bool| -> Result<Attempt> {
        Ok(Attempt {
            target: t.target.spec.clone(),
            remat: spec.remat.name().into(),
            offload: spec.offload.name().into(),
            compile_s: compiled.map(|b| b.compile_s),
            per_device: compiled.map(|b| figures(&b.stats)),
            usable_memory_per_device: t.usable_memory_per_device()?,
            fits,
        })
    };
    crate::esay!(
        "xtrain: compiling for {} with the {} plugin (no device needed)",
        t.target.spec,
        t.target.platform.plugin()
    );
    let build = match t.compile(program, dump) {
        Ok(build) => build,
        // The TPU compiler refuses a step whose temporaries exceed the chip's HBM (the GPU
        // compilers compile it and report the memory): for `auto`, one more choice that does
        // not fit; for the last choice, the error, with the figures and what would help.
        Err(e) if crate::device::memory::fit::is_out_of_memory(&e) => {
            let e = crate::device::memory::fit::explain_out_of_memory(
                e,
                "the training step",
                crate::device::memory::fit::argument_bytes_per_device(program),
                spec,
                t.usable_memory_per_device()?,
            );
            if last {
                return Err(e);
            }
            tried.push(attempt(None, false)?);
            crate::say!("XLA compile for {}: does not fit: {e:#}", t.target.spec);
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    crate::say!(
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
    tried.push(attempt(Some(&build), fits)?);
    if !fits && !last {
        return Ok(false);
    }
    let mut estimate = None;
    if let Some(cost) = &build.cost {
        print_cost_analysis(cost, build.unpriced_calls);
    }
    if t.target.platform == Platform::Tpu && to.estimate {
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
    let file = record(to.dir, by, &build, estimate, manifest)?;
    let build_record = manifest.builds.last().expect("recorded");
    crate::say!(
        "wrote {} ({} bytes){} and the build in manifest.json",
        to.out.join(file).display(),
        build.executable.len(),
        [&build_record.optimized_hlo, &build_record.memory_report]
            .iter()
            .filter_map(|f| f.as_ref().map(|f| format!(", {f}")))
            .collect::<String>()
    );
    if let Some(dir) = dump {
        crate::say!("XLA's dumps: {}", dir.display());
    }
    Ok(fits)
}

/// The TPU compiler's cost analysis of the step as compiled, one line.
fn print_cost_analysis(cost: &[(String, f64)], unpriced_calls: usize) {
    let get = |k: &str| cost.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    crate::say!(
        "TPU cost analysis per device, the step as compiled (the layer loop's body counted \
         once): {:.4} TFLOP, {:.4} GB accessed, optimal_seconds {}{}",
        get("flops").unwrap_or(0.0) / 1e12,
        get("bytes accessed").unwrap_or(0.0) / 1e9,
        duration(get("optimal_seconds").unwrap_or(0.0)),
        if get("optimal_seconds").is_some_and(|s| s <= 0.0) {
            " (not a time)".to_string()
        } else if unpriced_calls > 0 {
            format!(
                " (with the cost model's -1 s for each of {} ConcatBitcast calls taken out)",
                unpriced_calls
            )
        } else {
            String::new()
        }
    );
}

/// What was added back to the unrolled steps' times, if anything (see
/// [`crate::device::absent::aot::unpriced_calls`]).
fn unpriced_note(e: &crate::device::absent::aot::Estimate) -> String {
    match e.unpriced_calls {
        [0, 0] => String::new(),
        [a, b] => format!(
            ", with the cost model's -1 s for each of their {a} and {b} ConcatBitcast calls \
             taken out"
        ),
    }
}

/// The TPU compiler's estimate of the whole step, from unrolled 1- and 2-layer steps.
fn print_estimate(t: &TargetDevices, spec: &StepSpec) -> Result<Option<StepEstimate>> {
    crate::esay!(
        "xtrain: estimating the step from unrolled 1- and 2-layer steps{}",
        if spec.key_block.is_some() {
            " (and the same with two trips in each attention loop body)"
        } else {
            ""
        }
    );
    let e = t.estimate(spec)?;
    if let (Some(trip), Some(l)) = (e.trip_seconds(), &e.loops) {
        crate::say!(
            "attention over key/value blocks: {} trips of each of a layer's loops, priced per \
             trip (the cost model counts a loop body once): one trip of a layer's loops {}, \
             from unrolled steps whose loop bodies hold two trips ({} and {})",
            l.trips,
            duration(trip),
            duration(l.seconds[0]),
            duration(l.seconds[1])
        );
    }
    if !e.has_time() {
        crate::say!(
            "no step time estimate: the TPU cost model's optimal_seconds for the unrolled 1- and \
             2-layer steps are {} and {}{}, not times growing with the layers; {:.4} TFLOP and \
             {:.3} GB accessed per device, extrapolated to {} layers",
            duration(e.unrolled_seconds[0]),
            duration(e.unrolled_seconds[1]),
            unpriced_note(&e),
            e.flops() / 1e12,
            e.bytes_accessed() / 1e9,
            e.layers
        );
        return Ok(None);
    }
    let tokens = (spec.batch * spec.seq) as f64;
    let model_flops = crate::program::flops::model_flops_per_step(spec);
    let devices = t.devices.len() as f64;
    let mfu = t
        .peak_bf16_tflops_per_device()
        .map(|peak| model_flops / (e.seconds() * devices * peak * 1e12));
    crate::say!(
        "estimated step, by the TPU compiler's cost model (optimal_seconds of unrolled 1- and \
         2-layer steps{}, extrapolated to {} layers; an estimate, not a measurement): {} per \
         step, {:.4} TFLOP and {:.3} GB accessed per device, {:.0} tokens/s{}",
        unpriced_note(&e),
        e.layers,
        duration(e.seconds()),
        e.flops() / 1e12,
        e.bytes_accessed() / 1e9,
        tokens / e.seconds(),
        match (mfu, t.target.peak_bf16_tflops_per_chip) {
            (Some(m), Some(peak)) => format!(
                ", estimated MFU {:.1}% (model FLOPs {:.4} TFLOP per step; against the chip's \
                 bf16 peak, {peak} TFLOP/s{})",
                100.0 * m,
                model_flops / 1e12,
                // The only peak xtrain knows; the matrix units give no more in another dtype.
                if spec.dtype == hlo::DType::BF16 {
                    String::new()
                } else {
                    format!(
                        ": this step computes in {}, for which xtrain knows no peak of its own",
                        spec.dtype
                    )
                }
            ),
            _ => String::new(),
        }
    );
    for (i, layers) in ["1 layer", "2 layers"].iter().enumerate() {
        crate::say!(
            "  unrolled step with {layers}: optimal_seconds {}, {:.4} TFLOP, {:.3} GB accessed \
             per device",
            duration(e.unrolled_seconds[i]),
            e.unrolled_flops[i] / 1e12,
            e.unrolled_bytes_accessed[i] / 1e9
        );
    }
    Ok(Some(StepEstimate {
        seconds: e.seconds(),
        flops_per_device: e.flops(),
        bytes_accessed_per_device: e.bytes_accessed(),
        tokens_per_s: tokens / e.seconds(),
        model_flops_per_step: model_flops,
        mfu,
    }))
}

/// Who compiled a build, for its manifest record.
pub struct Compiler<'a> {
    pub target: String,
    pub platform: String,
    pub platform_version: String,
    pub plugin: &'a pjrt::Plugin,
    pub device_kind: String,
    pub devices: i64,
    pub hosts: i64,
    pub memory_per_device: Option<i64>,
    pub usable_memory_per_device: Option<i64>,
}

/// Add the build to the program dir: the executable, the optimized HLO and memory report when
/// the compiler dumped them, and the record in manifest.json. Returns the executable's file name.
pub fn record(
    out: &std::path::Path,
    by: Compiler,
    build: &TargetBuild,
    estimate: Option<StepEstimate>,
    manifest: &mut Manifest,
) -> Result<String> {
    let m = &build.stats;
    let (major, minor) = by.plugin.api_version();
    let record = Build {
        executable: program_dir::build_file(&by.target, "executable"),
        optimized_hlo: None,
        memory_report: None,
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
        compile_options: build.extra_options.clone(),
        kernels: build.kernels.clone(),
        per_device: figures(m),
        cost: build.cost.as_ref().map(|c| c.iter().cloned().collect()),
        estimate,
        executable_sha256: program_dir::sha256_hex(&build.executable),
    };
    let file = record.executable.clone();
    program_dir::write_build(
        out,
        manifest,
        record,
        &build.executable,
        build.optimized_hlo.as_deref(),
        build.memory_report.as_deref(),
    )?;
    Ok(file)
}

/// The compiler's per-device figures as a manifest records them.
fn figures(m: &pjrt::MemoryStats) -> MemoryFigures {
    MemoryFigures {
        argument_bytes: m.argument_bytes,
        output_bytes: m.output_bytes,
        alias_bytes: m.alias_bytes,
        temp_bytes: m.temp_bytes,
        generated_code_bytes: m.generated_code_bytes,
        total_bytes: m.total_bytes(),
        host_argument_bytes: m.host_argument_bytes,
        host_temp_bytes: m.host_temp_bytes,
        host_total_bytes: m.host_total_bytes(),
    }
}

//! `compile --check` without a target: the program compiled with this machine's plugin, its
//! executable kept in the program dir for `train --program` here.

use crate::compile::figures::print_memory;
use crate::compile::options::Writing;
use crate::compile::target::{record, Compiler};
use crate::device::absent::aot::TargetBuild;
use crate::formats::program_dir::Manifest;
use crate::program::{Program, StepSpec};
use anyhow::Result;

/// `--check` without a target: compile the program with this machine's plugin, and keep the
/// executable in the program dir for `train --program` on this machine.
pub(super) fn check(
    w: &Writing,
    spec: &StepSpec,
    program: &Program,
    manifest: &mut Manifest,
) -> Result<()> {
    let a = w.o;
    let platform = crate::device::platform::named_platform(a.plugin.as_deref());
    crate::device::platform::check_offload(platform, spec.offload, "this step")?;
    let mut rt =
        crate::device::runtime::Runtime::open(a.plugin.as_deref(), Some(program.partitions))?;
    crate::device::platform::check_offload(&rt.platform(), spec.offload, "this step")?;
    rt.use_kernels(&a.kernels)?;
    let kernels = rt.kernel_text(program)?.uses.clone();
    crate::device::kernels::announce(&kernels);
    let t0 = std::time::Instant::now();
    let exe = rt.compile_dumping(program, a.xla_dump.as_deref())?;
    let compile_s = t0.elapsed().as_secs_f64();
    let m = exe.memory_stats()?;
    if a.verbose {
        crate::esay!("{m:?}");
    }
    crate::say!(
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
    let file = record(w.dir(), by, &build, None, manifest)?;
    crate::say!(
        "wrote {} ({} bytes) for `xtrain train --program` on this machine",
        w.out.join(file).display(),
        build.executable.len()
    );
    if let Some(dir) = &a.xla_dump {
        crate::say!("XLA's HLO dumps: {}", dir.display());
    }
    Ok(())
}

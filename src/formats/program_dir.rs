//! Program directories (`train_step.mlir` + `manifest.json`), model presets, and the on-disk
//! cache of compiled executables.

use crate::model::config::LlamaConfig;
use crate::program::{Program, StepSpec, TensorSpec};
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::path::Path;

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `manifest.json`: everything a runner needs to feed the program, and what it was built for.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    pub xtrain_version: String,
    /// sha256 of train_step.mlir.
    pub program_sha256: String,
    /// sha256 over the settings below and the program's hash ([`settings_sha256`]): a manifest
    /// edited by hand (another alpha, another mesh) no longer matches and is refused, since
    /// the program was built from the settings as they were.
    pub settings_sha256: String,
    pub spec: StepSpec,
    pub args: Vec<TensorSpecOwned>,
    pub results: Vec<TensorSpecOwned>,
    /// The executables compiled from the program by `xtrain compile --check`, one per target
    /// (or one for this machine's plugin), and what each was compiled for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub builds: Vec<Build>,
    /// With `--remat auto` or `--offload auto` and `--check --target`: the choices compiled
    /// before the one taken (which did not fit every target), one per target compiled, in the
    /// order tried. The choice taken is the spec's remat and offload, its figures are `builds`'.
    /// Absent in manifests written before 2026-12-04, and where the first choice was taken.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<Attempt>,
}

/// What [`Manifest::settings_sha256`] covers.
#[derive(serde::Serialize)]
struct Settings<'a> {
    format: &'a str,
    program_sha256: &'a str,
    spec: &'a StepSpec,
    args: &'a [TensorSpecOwned],
    results: &'a [TensorSpecOwned],
}

/// The hash of a manifest's settings, over their JSON as this xtrain writes it (of the values as
/// read back from the file, so that writing and checking hash the same text).
fn settings_sha256(m: &Manifest) -> Result<String> {
    let text = serde_json::to_string(&Settings {
        format: &m.format,
        program_sha256: &m.program_sha256,
        spec: &m.spec,
        args: &m.args,
        results: &m.results,
    })?;
    Ok(sha256_hex(text.as_bytes()))
}

/// [`settings_sha256`] as an xtrain before 2026-12-04 wrote it, whose spec named some fields
/// otherwise (`weight_dtype` and `compute_dtype`, `microbatches`, `nf4`, `wide_matmul_results`,
/// `narrow_attention_scores`, `layer_keeps_softmax_stats`), so that its program dirs still
/// load.
fn settings_sha256_before_flag_names(m: &Manifest) -> Result<String> {
    use crate::program::{Offload, ResultType};
    /// The spec's fields in that xtrain's order and names.
    #[derive(serde::Serialize)]
    struct Spec<'a> {
        model: &'a LlamaConfig,
        lora: &'a crate::model::lora::LoraConfig,
        adam: &'a crate::model::optim::AdamW,
        batch: i64,
        seq: i64,
        weight_dtype: &'a str,
        compute_dtype: &'a str,
        remat: crate::program::Remat,
        microbatches: i64,
        mesh: &'a Option<crate::program::MeshPlan>,
        nf4: bool,
        loss_chunk: Option<i64>,
        attention_block: Option<i64>,
        key_block: Option<i64>,
        wide_matmul_results: bool,
        narrow_attention_scores: bool,
        layer_keeps_softmax_stats: bool,
        pin_mlp_activations: bool,
        #[serde(skip_serializing_if = "Offload::is_none")]
        offload: Offload,
    }
    #[derive(serde::Serialize)]
    struct Settings<'a> {
        format: &'a str,
        program_sha256: &'a str,
        spec: Spec<'a>,
        args: &'a [TensorSpecOwned],
        results: &'a [TensorSpecOwned],
    }
    let s = &m.spec;
    // It said the result types as bools, both false with f32 compute.
    let bf16 = s.dtype != hlo::DType::F32;
    let text = serde_json::to_string(&Settings {
        format: &m.format,
        program_sha256: &m.program_sha256,
        spec: Spec {
            model: &s.model,
            lora: &s.lora,
            adam: &s.adam,
            batch: s.batch,
            seq: s.seq,
            weight_dtype: s.dtype.mlir(),
            compute_dtype: s.dtype.mlir(),
            remat: s.remat,
            microbatches: s.grad_accum,
            mesh: &s.mesh,
            nf4: s.quant.is_nf4(),
            loss_chunk: s.loss_chunk,
            attention_block: s.attention_block,
            key_block: s.key_block,
            wide_matmul_results: bf16 && s.matmul_result == ResultType::F32,
            narrow_attention_scores: bf16 && s.attention_scores == ResultType::Compute,
            layer_keeps_softmax_stats: s.keep_softmax_stats,
            pin_mlp_activations: s.pin_mlp_activations,
            offload: s.offload,
        },
        args: &m.args,
        results: &m.results,
    })?;
    Ok(sha256_hex(text.as_bytes()))
}

/// A compiled executable of a program dir (`train_step.<target>.executable`): which plugin and
/// devices it was compiled for, and the compiler's figures for it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Build {
    /// `--target` as given (`cuda:h100:8`), or the plugin's name for the machine's own devices.
    pub target: String,
    /// The executable's file in the program dir ([`build_file`]), and the optimized HLO and
    /// the compiler's memory report beside it where the compiler dumped them.
    pub executable: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimized_hlo: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_report: Option<String>,
    /// PJRT's platform name: cpu, cuda, rocm, tpu.
    pub platform: String,
    pub platform_version: String,
    /// The PJRT C API version of the plugin that compiled it (a serialized executable loads only
    /// into the same plugin build).
    pub plugin_api: String,
    pub plugin: String,
    /// The devices' kind, as a client on them reports it (`NVIDIA H100 80GB HBM3`).
    pub device_kind: String,
    pub devices: i64,
    pub hosts: i64,
    /// Device memory per device where the plugin describes it.
    pub memory_per_device: Option<i64>,
    /// What XLA may allocate of it (on GPUs xtrain's runtime gives the plugin 90%): whether the
    /// step fits was decided against this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usable_memory_per_device: Option<i64>,
    pub compile_s: f64,
    /// Compile options beyond xtrain's usual ones that the compile needed (`name=value`), e.g.
    /// `xla_gpu_enable_triton_gemm=false` where the GPU compiler's Triton GEMM emitter could not
    /// tile a dot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compile_options: Vec<String>,
    /// XLA's compiled memory figures, per device.
    pub per_device: MemoryFigures,
    /// The compiler's cost analysis of the program as compiled (TPU only; a loop body is
    /// counted once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<std::collections::BTreeMap<String, f64>>,
    /// The whole step estimated from unrolled 1- and 2-layer steps (TPU only): an estimate by the
    /// compiler's cost model, not a measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<StepEstimate>,
    pub executable_sha256: String,
    /// The kernels that replaced composites of the program in this build (`--kernel`): the
    /// program's text stays the dir's; its compiler saw the kernels' bodies instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<KernelUse>,
}

/// Which kernel replaced which composite in a build (`device::kernels`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelUse {
    pub composite: String,
    pub version: i32,
    pub kernel: String,
}

impl std::fmt::Display for KernelUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} v{} -> {}", self.composite, self.version, self.kernel)
    }
}

/// One choice of `--remat auto` / `--offload auto` compiled for one target and not taken.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Attempt {
    /// `--target` as given.
    pub target: String,
    /// `--remat` and `--offload` as tried (`save-proj`, `activations`).
    pub remat: String,
    pub offload: String,
    /// The compiler's time and figures; None where it refused the step as too big for the
    /// device (TPU compilers do; GPU compilers compile it and report the memory).
    pub compile_s: Option<f64>,
    pub per_device: Option<MemoryFigures>,
    /// What the step had to fit in (None: unknown, it fits).
    pub usable_memory_per_device: Option<i64>,
    pub fits: bool,
}

/// Bytes per device, as the compiler reports them.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct MemoryFigures {
    pub argument_bytes: i64,
    pub output_bytes: i64,
    pub alias_bytes: i64,
    pub temp_bytes: i64,
    pub generated_code_bytes: i64,
    /// Arguments + outputs not aliased to arguments + temporaries, in device memory.
    pub total_bytes: i64,
    pub host_argument_bytes: i64,
    pub host_temp_bytes: i64,
    /// The same sum over host memory.
    pub host_total_bytes: i64,
}

/// A TPU compiler's whole-step estimate (see `device::absent::aot::Estimate`).
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct StepEstimate {
    pub seconds: f64,
    pub flops_per_device: f64,
    pub bytes_accessed_per_device: f64,
    pub tokens_per_s: f64,
    /// The FLOPs the step must do (xtrain's count: no recomputation; see `xtrain bench`).
    pub model_flops_per_step: f64,
    /// Model FLOPs / (seconds x devices x peak bf16 per device), when the peak is known.
    pub mfu: Option<f64>,
}

/// The file name of one of a build's files (`executable`, `optimized.txt`, `memory.txt`) for
/// target `target`: `train_step.tpu-v5p-2x2x2.executable`.
pub fn build_file(target: &str, kind: &str) -> String {
    let slug: String = target
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("train_step.{slug}.{kind}")
}

/// [`TensorSpec`] in a form that round-trips through JSON.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct TensorSpecOwned {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
    pub role: crate::program::Role,
    pub bytes: i64,
    /// Each device's shard of it, when the mesh splits it (shape and bytes per device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_shape: Option<Vec<i64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_bytes: Option<i64>,
    /// The memory it is passed in when not the device's own (`pinned_host`: offloaded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
}

impl From<&TensorSpec> for TensorSpecOwned {
    fn from(t: &TensorSpec) -> Self {
        TensorSpecOwned {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: t.dtype.mlir().to_string(),
            role: t.role,
            bytes: t.shape.iter().product::<i64>() * t.dtype.size_bytes() as i64,
            device_shape: None,
            device_bytes: None,
            memory: None,
        }
    }
}

impl TensorSpecOwned {
    /// The argument with each device's shard shape, where that differs from its whole shape.
    fn sharded(t: &TensorSpec, device_shape: &[i64]) -> Self {
        let mut out = TensorSpecOwned::from(t);
        if device_shape != t.shape.as_slice() {
            out.device_bytes =
                Some(device_shape.iter().product::<i64>() * t.dtype.size_bytes() as i64);
            out.device_shape = Some(device_shape.to_vec());
        }
        out
    }

    /// Bytes each device holds of it.
    pub fn bytes_per_device(&self) -> i64 {
        self.device_bytes.unwrap_or(self.bytes)
    }
}

impl TensorSpecOwned {
    fn to_spec(&self) -> Result<TensorSpec> {
        Ok(TensorSpec {
            name: self.name.clone(),
            shape: self.shape.clone(),
            dtype: hlo::DType::parse(&self.dtype)
                .with_context(|| format!("unknown dtype {}", self.dtype))?,
            role: self.role,
        })
    }
}

/// Format 2: one program, several builds, a settings hash (format 1, before 2026-12-03, had one
/// build and no settings hash; such a dir is compiled again).
pub const MANIFEST_FORMAT: &str = "xtrain-program/2";

/// Write a program directory, whole or not at all (replacing what `dir` held).
pub fn write_dir(dir: &Path, program: &Program, spec: &StepSpec) -> Result<Manifest> {
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        xtrain_version: env!("CARGO_PKG_VERSION").into(),
        program_sha256: sha256_hex(program.text.as_bytes()),
        settings_sha256: String::new(),
        spec: spec.clone(),
        args: program
            .args
            .iter()
            .zip(&program.arg_shard_dims)
            .map(|(a, d)| TensorSpecOwned {
                memory: a.memory(spec).map(|m| m.name().to_string()),
                ..TensorSpecOwned::sharded(a, d)
            })
            .collect(),
        results: program.results.iter().map(Into::into).collect(),
        builds: Vec::new(),
        attempts: Vec::new(),
    };
    // Hashed as it will be read back (see [`settings_sha256`]).
    let mut manifest: Manifest = serde_json::from_str(&serde_json::to_string(&manifest)?)?;
    manifest.settings_sha256 = settings_sha256(&manifest)?;
    // Written whole under a temp name and swapped in: a build of an earlier program in this dir
    // (its executable, optimized HLO, memory report) is not this program's, and goes with it.
    crate::formats::atomic::write_dir_atomic(dir, |tmp| {
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("train_step.mlir"),
            program.text.as_bytes(),
        )?;
        crate::formats::atomic::write_bytes_atomic(
            &tmp.join("manifest.json"),
            serde_json::to_string_pretty(&manifest)?.as_bytes(),
        )
    })?;
    Ok(manifest)
}

/// Add a build to a program dir written by [`write_dir`]: the executable (and the optimized HLO
/// and memory report when there are some), then the manifest that names them, each atomically.
/// A build for the same target replaces the earlier one.
pub fn write_build(
    dir: &Path,
    manifest: &mut Manifest,
    mut build: Build,
    executable: &[u8],
    optimized_hlo: Option<&str>,
    memory_report: Option<&str>,
) -> Result<()> {
    use crate::formats::atomic::write_bytes_atomic;
    build.executable = build_file(&build.target, "executable");
    write_bytes_atomic(&dir.join(&build.executable), executable)?;
    build.optimized_hlo = match optimized_hlo {
        Some(text) => {
            let name = build_file(&build.target, "optimized.txt");
            write_bytes_atomic(&dir.join(&name), text.as_bytes())?;
            Some(name)
        }
        None => None,
    };
    build.memory_report = match memory_report {
        Some(text) => {
            let name = build_file(&build.target, "memory.txt");
            write_bytes_atomic(&dir.join(&name), text.as_bytes())?;
            Some(name)
        }
        None => None,
    };
    manifest.builds.retain(|b| b.target != build.target);
    manifest.builds.push(build);
    write_manifest(dir, manifest)
}

/// Record in a program dir written by [`write_dir`] the choices compiled before the one it
/// holds ([`Manifest::attempts`]).
pub fn write_attempts(dir: &Path, manifest: &mut Manifest, attempts: Vec<Attempt>) -> Result<()> {
    manifest.attempts = attempts;
    write_manifest(dir, manifest)
}

fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    crate::formats::atomic::write_bytes_atomic(
        &dir.join("manifest.json"),
        serde_json::to_string_pretty(manifest)?.as_bytes(),
    )
}

/// A program dir's builds (none when `xtrain compile` ran without `--check`), checked against
/// its manifest when their executables are read ([`read_executable`]).
pub fn read_builds(dir: &Path) -> Result<Vec<Build>> {
    Ok(read_manifest(dir, None)?.builds)
}

/// The executable of `build`, one of the program dir `dir`'s, if its bytes match the manifest.
pub fn read_executable(dir: &Path, build: &Build) -> Result<Vec<u8>> {
    if build.executable.contains('/') || build.executable.contains("..") {
        bail!(
            "{}: the build for {} names the executable `{}`, not a file of the program dir",
            dir.join("manifest.json").display(),
            build.target,
            build.executable
        );
    }
    let path = dir.join(&build.executable);
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let hash = sha256_hex(&bytes);
    if hash != build.executable_sha256 {
        bail!(
            "{} does not match its manifest (sha256 {hash}, manifest says {})",
            path.display(),
            build.executable_sha256
        );
    }
    Ok(bytes)
}

/// The manifest of program dir `dir`, checked; `model` (the run's `--model`, when known) goes
/// into the advice to compile it again.
fn read_manifest(dir: &Path, model: Option<&Path>) -> Result<Manifest> {
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath).with_context(|| {
        format!(
            "cannot read {} (is {} a program dir from `xtrain compile`?)",
            mpath.display(),
            dir.display()
        )
    })?;
    let m: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("{} is not an xtrain manifest", mpath.display()))?;
    if m.format != MANIFEST_FORMAT {
        bail!(
            "{}: format {} is not {MANIFEST_FORMAT} (written by another xtrain; compile the \
             program dir again with this one)",
            mpath.display(),
            m.format
        );
    }
    let want = settings_sha256(&m)?;
    if want != m.settings_sha256 && settings_sha256_before_flag_names(&m)? != m.settings_sha256 {
        bail!(
            "{} was edited after `xtrain compile` wrote it: its settings (spec, arguments, \
             results) hash to {want}, but it says {}; the program was built from the settings \
             as they were. Compile again with the settings you want: `xtrain compile --model \
             {} --out {} --overwrite` and their flags",
            mpath.display(),
            m.settings_sha256,
            model.map_or("MODEL".into(), crate::formats::shell::path),
            crate::formats::shell::path(dir)
        );
    }
    Ok(m)
}

/// [`read_dir`] for a run of the model whose config is `cfg` (read from `model`, which the
/// message names): a program dir built for another model is refused.
pub fn read_dir_for_model(
    dir: &Path,
    cfg: &LlamaConfig,
    model: &Path,
) -> Result<(Program, StepSpec)> {
    let (program, spec) = read_dir_of(dir, Some(model))?;
    if &spec.model != cfg {
        bail!(
            "program dir {} was built for another model (its config differs from {})",
            dir.display(),
            model.display()
        );
    }
    Ok((program, spec))
}

/// Read a program directory, checking the program text against the manifest's hash.
pub fn read_dir(dir: &Path) -> Result<(Program, StepSpec)> {
    read_dir_of(dir, None)
}

/// [`read_dir`] for a run of `model` (named in the advice when the manifest was edited).
fn read_dir_of(dir: &Path, model: Option<&Path>) -> Result<(Program, StepSpec)> {
    let m = read_manifest(dir, model)?;
    let ppath = dir.join("train_step.mlir");
    let program = std::fs::read_to_string(&ppath)
        .with_context(|| format!("cannot read {}", ppath.display()))?;
    let hash = sha256_hex(program.as_bytes());
    if hash != m.program_sha256 {
        bail!(
            "{} does not match its manifest (sha256 {hash}, manifest says {})",
            ppath.display(),
            m.program_sha256
        );
    }
    let args = m.args.iter().map(|a| a.to_spec()).collect::<Result<_>>()?;
    let results = m
        .results
        .iter()
        .map(|a| a.to_spec())
        .collect::<Result<_>>()?;
    Ok((Program::new(program, args, results, &m.spec), m.spec))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Quant, ResultType};

    /// A program dir's manifest as xtrain wrote it on 2026-12-03, before the spec's fields were
    /// named as their flags (`weight_dtype`, `microbatches`, `nf4`, `wide_matmul_results`, ...):
    /// it still reads, its settings hash still holds, and its spec is the one it was built for.
    #[test]
    fn a_manifest_written_before_the_flag_names_still_reads() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/formats-2026-12-03");
        let m = read_manifest(&dir, None).unwrap();
        let s = &m.spec;
        assert_eq!(s.dtype, hlo::DType::BF16);
        assert_eq!(s.quant, Quant::Nf4);
        assert_eq!(s.grad_accum, 1);
        assert_eq!(
            (s.matmul_result, s.attention_scores),
            (ResultType::F32, ResultType::Compute)
        );
        assert!(s.keep_softmax_stats && !s.pin_mlp_activations);
        // Written again, it is written with the flags' names, and hashes as this xtrain writes.
        let text = serde_json::to_string(&m.spec).unwrap();
        for name in [
            "\"grad-accum\"",
            "\"quant\"",
            "\"matmul-result\"",
            "\"dtype\"",
        ] {
            assert!(text.contains(name), "{name} in {text}");
        }
        assert!(!text.contains("weight_dtype") && !text.contains("microbatches"));
        let again: StepSpec = serde_json::from_str(&text).unwrap();
        assert_eq!(&again, s);
    }

    /// The same manifest with a setting edited by hand is refused, by either hash.
    #[test]
    fn an_edited_manifest_written_before_the_flag_names_is_refused() {
        let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/formats-2026-12-03/manifest.json");
        let dir = std::env::temp_dir().join(format!("xtrain-old-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = std::fs::read_to_string(from).unwrap();
        let edited = text.replace("\"microbatches\": 1", "\"microbatches\": 2");
        assert_ne!(text, edited);
        std::fs::write(dir.join("manifest.json"), edited).unwrap();
        let e = format!("{:#}", read_manifest(&dir, None).err().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            e.contains("was edited after `xtrain compile` wrote it"),
            "{e}"
        );
    }
}

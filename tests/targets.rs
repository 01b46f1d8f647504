//! `xtrain compile --target`: the tiny model's step compiled by the real TPU, CUDA and ROCm
//! compilers for devices that are not here (plugins fetched into the cache on first use), and
//! what the program dir then holds; bad targets; `train --program` with a program dir's
//! executable.

mod common;
use common::*;
use std::path::Path;
use xtrain::formats::program_dir::Manifest;

fn manifest(dir: &Path) -> Manifest {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

/// Compile the tiny model's bf16 step (batch 4 x 64) for `target`, checking it succeeds.
fn compile_for(target: &str, dir: &Path, env: &[(&str, &Path)]) -> String {
    let mut c = xtrain_cmd();
    c.args([
        "compile",
        "--model",
        "tiny-llama3",
        "--batch",
        "4",
        "--seq",
        "64",
    ])
    .args(["--dtype", "bf16", "--check", "--target", target, "--out"])
    .arg(dir);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{target}: {out}\n{err}");
    // `--remat auto` and `--offload auto` (the defaults) say what they chose for the target.
    assert!(
        out.contains(&format!("for {target}, by its devices' memory"))
            && out.contains("auto chose --remat "),
        "{target}: {out}"
    );
    out
}

/// The entry parameters of an optimized HLO module as (dims, bytes in the compiled layout):
/// `bf16[2,16,64]{2,1,0:T(8,128)(2,1)}` is 2 x 16 x 64 stored in tiles of 8 x 128 over its two
/// most minor dims (TPU layouts; GPU layouts have no tiles), so 2 x 16 x 128 bf16 values.
fn entry_params(hlo: &str) -> Vec<(Vec<i64>, i64)> {
    let start = hlo.find("entry_computation_layout={(").unwrap() + 27;
    let (mut depth, mut params, mut cur) = (0, Vec::new(), String::new());
    for c in hlo[start..].chars() {
        match c {
            '(' | '{' | '[' => depth += 1,
            ')' | '}' | ']' if depth == 0 => break,
            ')' | '}' | ']' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            params.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    params.push(cur);
    params
        .iter()
        .map(|p| {
            let p = p.split("*/").last().unwrap().trim();
            let (ty, rest) = p.split_once('[').unwrap();
            let (dims, layout) = rest.split_once(']').unwrap();
            let dims: Vec<i64> = dims
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.parse().unwrap())
                .collect();
            let size = match ty {
                "pred" | "s8" | "u8" => 1,
                "bf16" | "f16" | "s16" | "u16" => 2,
                "f32" | "s32" | "u32" => 4,
                "f64" | "s64" | "u64" => 8,
                other => panic!("element type {other}"),
            };
            let layout = layout.trim_start_matches('{').trim_end_matches('}');
            let (order, tiles) = layout.split_once(':').unwrap_or((layout, ""));
            let order: Vec<usize> = order
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.parse().unwrap())
                .collect();
            let tile: Vec<i64> = tiles
                .strip_prefix("T(")
                .and_then(|t| t.split(')').next())
                .map(|t| t.split(',').map(|x| x.parse().unwrap()).collect())
                .unwrap_or_default();
            let mut padded = dims.clone();
            let elements = if dims.is_empty() {
                tile.last().copied().unwrap_or(1)
            } else {
                for (k, t) in tile.iter().rev().enumerate() {
                    if let Some(&axis) = order.get(k) {
                        padded[axis] = (padded[axis] + t - 1) / t * t;
                    }
                }
                padded.iter().product()
            };
            (dims, elements * size)
        })
        .collect()
}

/// What every target's build must show: the compiler's per-device arguments are the manifest's
/// sharded shapes, and their bytes its figure (on TPUs after padding to the layout's tiles, on
/// GPUs exactly the manifest's sharded sizes); the optimized program holds the collectives FSDP
/// needs (weights gathered, gradients reduced); the executable is the one the manifest names.
fn check_build(dir: &Path, devices: i64, platform: &str) {
    let m = manifest(dir);
    assert_eq!(m.builds.len(), 1, "one build in manifest.json");
    let build = &m.builds[0];
    assert_eq!(build.devices, devices);
    assert_eq!(build.platform, platform);
    let sharded: i64 = m.args.iter().map(|a| a.bytes_per_device()).sum();
    let whole: i64 = m.args.iter().map(|a| a.bytes).sum();
    assert!(
        sharded * devices >= whole && sharded < whole,
        "{sharded} of {whole}"
    );
    let hlo = std::fs::read_to_string(dir.join(build.optimized_hlo.as_ref().unwrap())).unwrap();
    let params = entry_params(&hlo);
    let shapes: Vec<Vec<i64>> = m
        .args
        .iter()
        .map(|a| a.device_shape.clone().unwrap_or(a.shape.clone()))
        .collect();
    let compiled: Vec<Vec<i64>> = params.iter().map(|(d, _)| d.clone()).collect();
    assert_eq!(compiled, shapes, "{dir:?}");
    let laid_out: i64 = params.iter().map(|(_, b)| b).sum();
    assert_eq!(build.per_device.argument_bytes, laid_out, "{dir:?}");
    if platform != "tpu" {
        assert_eq!(build.per_device.argument_bytes, sharded, "{dir:?}");
    }
    assert!(hlo.contains("all-gather"), "no all-gather in {dir:?}");
    assert!(
        hlo.contains("reduce-scatter") || hlo.contains("all-reduce"),
        "no gradient reduction in {dir:?}"
    );
    let exe = std::fs::read(dir.join(&build.executable)).unwrap();
    assert!(exe.len() > 10_000, "{} bytes", exe.len());
    assert_eq!(
        xtrain::formats::program_dir::sha256_hex(&exe),
        build.executable_sha256
    );
}

#[test]
fn tiny_step_compiles_for_a_tpu_v5e_slice() {
    let dir = tempdir("target-tpu");
    let out = compile_for("tpu:v5e:2x2", &dir, &[]);
    assert!(
        out.contains("target tpu:v5e:2x2: 4 x TPU v5 lite on 1 host"),
        "{out}"
    );
    assert!(out.contains(r#"mesh [("fsdp", 4)]"#), "{out}");
    assert!(out.contains(": fits"), "{out}");
    assert!(out.contains("an estimate, not a measurement"), "{out}");
    check_build(&dir, 4, "tpu");
    let build = manifest(&dir).builds.pop().unwrap();
    assert_eq!(build.usable_memory_per_device, build.memory_per_device);
    let cost = build.cost.unwrap();
    assert!(
        cost["flops"] > 0.0 && cost["optimal_seconds"] > 0.0,
        "{cost:?}"
    );
    // The estimate is of the whole (looped) step: more work than the loop body counted once.
    let e = build.estimate.unwrap();
    assert!(e.flops_per_device > cost["flops"], "{e:?} vs {cost:?}");
    assert!(e.seconds > 0.0 && e.mfu.unwrap() > 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The TPU estimate's MFU is against the chip's bf16 peak, the only one xtrain knows; for an f32
/// step it says so, and that the step is f32 (it gave the bf16 peak's MFU as if it were the
/// step's own).
#[test]
fn an_f32_steps_tpu_estimate_says_its_mfu_is_against_the_bf16_peak() {
    let dir = tempdir("target-tpu-f32");
    let o = xtrain(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--batch",
        "4",
        "--seq",
        "64",
        "--check",
        "--target",
        "tpu:v5e:2x2",
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains(
            "against the chip's bf16 peak, 197 TFLOP/s: this step computes in f32, for which \
             xtrain knows no peak of its own)"
        ),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tiny_step_compiles_for_two_absent_h100s() {
    let dir = tempdir("target-cuda");
    let out = compile_for("cuda:h100:2", &dir, &[]);
    assert!(out.contains("2 x NVIDIA H100 80GB HBM3"), "{out}");
    // A step fits a GPU when it fits the 90% of its memory xtrain's runtime gives XLA.
    assert!(
        out.contains("79.65 GiB each, of which XLA may use 71.68 GiB (90%"),
        "{out}"
    );
    check_build(&dir, 2, "cuda");
    let build = manifest(&dir).builds.pop().unwrap();
    let memory = build.memory_per_device.unwrap();
    assert_eq!(
        build.usable_memory_per_device,
        Some((memory as f64 * 0.9f32 as f64) as i64)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model whose shapes XLA's Triton GEMM emitter cannot tile (hidden 120 in 5 heads of 24, FFN
/// 120, vocab 300, split by fsdp=2, unrolled layers: "Couldn't find output tile sizes that
/// satisfy ... f32[128,16]" for a LoRA gradient dot, in both vendors' compilers) compiles for
/// both: the compile is retried with the emitter off, says so, and records the option in the
/// build. The program is the one the CPU gets.
#[test]
fn a_model_the_triton_gemm_emitter_cannot_tile_compiles_for_both_gpu_vendors() {
    let dir = tempdir("target-odd-shapes");
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("model/config.json")).unwrap(),
    )
    .unwrap();
    for (k, v) in [
        ("hidden_size", 120),
        ("num_attention_heads", 5),
        ("num_key_value_heads", 5),
        ("head_dim", 24),
        ("intermediate_size", 120),
        ("vocab_size", 300),
    ] {
        cfg[k] = v.into();
    }
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let libs = rocm_standins_in("odd-shapes-rocm");
    let mut hashes = Vec::new();
    for target in ["cuda:h100:2", "rocm:mi300x:2"] {
        let out = dir.join(target.replace(':', "-"));
        let o = xtrain_cmd()
            .args(["compile", "--model"])
            .arg(&model)
            .args([
                "--batch", "4", "--seq", "64", "--lora-r", "16", "--remat", "none",
            ])
            .args(["--target", target, "--check", "--out"])
            .arg(&out)
            .env("LD_LIBRARY_PATH", &libs)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{target}: {err}");
        assert!(
            err.contains("Triton GEMM emitter could not tile a matmul")
                && err.contains("compiling again with xla_gpu_enable_triton_gemm=false"),
            "{target}: {err}"
        );
        let m = manifest(&out);
        assert_eq!(
            m.builds[0].compile_options,
            ["xla_gpu_enable_triton_gemm=false"],
            "{target}"
        );
        assert!(out.join(&m.builds[0].executable).is_file());
        hashes.push(m.program_sha256);
    }
    assert_eq!(hashes[0], hashes[1]);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&libs).unwrap();
}

#[test]
fn tiny_step_compiles_for_two_absent_mi300x() {
    let libs = rocm_standins_in("rocm-standins");
    let dir = tempdir("target-rocm");
    let out = compile_for("rocm:mi300x:2", &dir, &[("LD_LIBRARY_PATH", &libs)]);
    assert!(out.contains("2 x AMD Instinct MI300X"), "{out}");
    check_build(&dir, 2, "rocm");
    // Without the runtime libraries, the plugin cannot load: the error says what is missing and
    // where a ROCm host has it (writing the program needs no plugin: see
    // `one_program_for_every_target`).
    let e = fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--target",
        "rocm:mi300x:2",
        "--check",
        "--out",
        dir.join("again").to_str().unwrap(),
    ]);
    assert!(
        e.contains("ROCm 7 runtime libraries") && e.contains("/opt/rocm/lib"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&libs).unwrap();
}

#[test]
fn bad_targets_are_refused_with_what_would_work() {
    let dir = tempdir("target-bad");
    let out = dir.join("p");
    let compile = |extra: &[&str]| {
        let mut a = vec![
            "compile",
            "--model",
            "tiny-llama3",
            "--seq",
            "64",
            "--check",
            "--out",
            out.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        fails(&a)
    };
    // Unknown names list the known ones.
    let e = compile(&["--target", "cuda:h1000:8"]);
    assert!(
        e.contains("no built-in description of a cuda GPU `h1000`"),
        "{e}"
    );
    assert!(
        e.contains("cuda:h100:<count>") && e.contains("tpu:v5p:<chips>"),
        "{e}"
    );
    let e = compile(&["--target", "tpu:v7:2x2"]);
    assert!(e.contains("unknown TPU generation `v7`"), "{e}");
    // A layout libtpu has no slice of: refused before libtpu is asked, with one it has.
    let e = compile(&["--target", "tpu:v5e:2x3"]);
    assert!(
        e.contains("the chip layout `2x3` is not a v5e slice") && e.contains("tpu:v5e:2x4"),
        "{e}"
    );
    // A mesh that is not the target's device count.
    let e = compile(&["--target", "cuda:h100:8", "--mesh", "fsdp=4"]);
    assert!(
        e.contains("--mesh fsdp=4 has 4 devices but --target cuda:h100:8 has 8"),
        "{e}"
    );
    // A plugin of another platform.
    let e = compile(&["--target", "tpu:v5e:2x2", "--plugin", "cpu"]);
    assert!(
        e.contains("compiled by the tpu plugin, but --plugin cpu is a cpu plugin"),
        "{e}"
    );
    // A GPU description for the wrong platform, and one without a target.
    let cfg = dir.join("gpu.txtpb");
    std::fs::write(
        &cfg,
        "gpu_device_info { core_count: 1 }\nplatform_name: \"ROCM\"\n",
    )
    .unwrap();
    let e = compile(&[
        "--target",
        "cuda:mygpu:2",
        "--target-config",
        cfg.to_str().unwrap(),
    ]);
    assert!(
        e.contains("platform_name is \"rocm\" but the target is a cuda GPU"),
        "{e}"
    );
    let e = compile(&["--target-config", cfg.to_str().unwrap()]);
    assert!(e.contains("give --target"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `xtrain targets cuda:h100` (a GPU description to edit) with `edit` applied to its lines,
/// written to `dir/name`.
fn edited_description(dir: &Path, name: &str, edit: impl Fn(&str) -> Option<String>) -> String {
    let described = xtrain(&["targets", "cuda:h100"]);
    assert!(described.status.success());
    let text: String = String::from_utf8_lossy(&described.stdout)
        .lines()
        .filter_map(edit)
        .map(|l| l + "\n")
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// `compile --check --target cuda:mygpu:2 --target-config FILE`, expected to fail: its stderr.
fn compile_described(dir: &Path, config: &str) -> String {
    fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--seq",
        "64",
        "--check",
        "--target",
        "cuda:mygpu:2",
        "--target-config",
        config,
        "--out",
        dir.join("p").to_str().unwrap(),
    ])
}

/// A GPU description whose memory size is negative, zero or missing, whose core count is
/// negative, or that has no compute capability, is refused naming the field, its line and its
/// value (it was compiled for: "-0.00 KiB each", or "ptxas too old" without an architecture).
#[test]
fn a_gpu_description_with_a_bad_size_or_no_architecture_is_refused_naming_the_field() {
    let dir = tempdir("target-bad-description");
    let set = |field: &'static str, value: &'static str| {
        move |l: &str| {
            Some(if l.trim_start().starts_with(&format!("{field}:")) {
                format!("  {field}: {value}")
            } else {
                l.to_string()
            })
        }
    };
    for (name, edit, says) in [
        (
            "negative-memory",
            Box::new(set("device_memory_size", "-1")) as Box<dyn Fn(&str) -> Option<String>>,
            "device_memory_size is -1, but it must be the device's memory in bytes, a positive number",
        ),
        (
            "zero-memory",
            Box::new(set("device_memory_size", "0")),
            "device_memory_size is 0, but it must be the device's memory in bytes",
        ),
        (
            "no-memory",
            Box::new(|l: &str| {
                (!l.contains("device_memory_size")).then(|| l.to_string())
            }),
            "has no device_memory_size (the device's memory in bytes)",
        ),
        (
            "negative-cores",
            Box::new(set("core_count", "-132")),
            "core_count is -132, but it must be the number of SMs or compute units",
        ),
        (
            "no-architecture",
            Box::new(|l: &str| {
                (!l.contains("cuda_compute_capability")).then(|| l.to_string())
            }),
            "has no cuda_compute_capability: XLA compiles for a GPU architecture",
        ),
    ] {
        let config = edited_description(&dir, &format!("{name}.txtpb"), edit);
        let e = compile_described(&dir, &config);
        assert!(e.contains(&format!("--target-config {config}")), "{name}: {e}");
        assert!(e.contains(says), "{name}: {e}");
        assert!(e.contains("line "), "{name}: names the line: {e}");
        assert!(!dir.join("p").exists(), "{name}: nothing written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPU description that is not valid text format is refused naming the line and what was
/// found there, before the plugin's parser sees it.
#[test]
fn a_gpu_description_that_does_not_parse_names_the_line() {
    let dir = tempdir("target-description-syntax");
    // `core_count 132` (no colon) on its line of the description.
    let config = edited_description(&dir, "no-colon.txtpb", |l| {
        Some(l.replace("core_count:", "core_count"))
    });
    let text = std::fs::read_to_string(&config).unwrap();
    let line = 1 + text.lines().position(|l| l.contains("core_count")).unwrap();
    let e = compile_described(&dir, &config);
    assert!(
        e.contains(&format!(
            "--target-config {config}: line {line}: expected `:` or `{{` after `core_count`, found `132`"
        )),
        "{e}"
    );
    // A block never closed names the line it opened on.
    let config = edited_description(&dir, "unclosed.txtpb", |l| {
        (l != "}").then(|| l.to_string())
    });
    let e = compile_described(&dir, &config);
    assert!(
        e.contains("line 1: the `{` opened here is never closed with `}`"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cuda_plugin_without_ptxas_names_the_wheels() {
    // The installed plugin, linked into a directory without NVIDIA's tools beside it.
    let plugin = pjrt::discover::resolve(Some("cuda"))
        .or_else(|_| pjrt::discover::install_announced("cuda"))
        .expect("the CUDA plugin");
    let dir = tempdir("target-no-ptxas");
    let lonely = dir.join("site/jax_plugins/xla_cuda13");
    std::fs::create_dir_all(&lonely).unwrap();
    let so = lonely.join("xla_cuda_plugin.so");
    if std::fs::hard_link(&plugin, &so).is_err() {
        std::fs::copy(&plugin, &so).unwrap();
    }
    let e = fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--target",
        "cuda:h100:1",
        "--check",
        "--plugin",
        so.to_str().unwrap(),
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    assert!(e.contains("ptxas") && e.contains("nvidia-cuda-nvcc"), "{e}");
    assert!(e.contains("libdevice") && e.contains("nvidia-nvvm"), "{e}");
    assert!(e.contains("xtrain plugins install cuda"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --program` takes the executable `compile --check` left when it was compiled for this
/// machine's plugin and devices (same losses as compiling), and otherwise compiles, saying why.
#[test]
fn train_uses_a_program_dirs_executable_only_where_it_was_compiled_for() {
    let f = fixtures();
    let dir = tempdir("target-train");
    let compile = |out: &Path, extra: &[&str]| {
        let mut a: Vec<String> = vec![
            "compile".into(),
            "--model".into(),
            f.join("model").to_str().unwrap().to_string(),
            "--batch".into(),
            "2".into(),
            "--seq".into(),
            "16".into(),
            "--lora-r".into(),
            "8".into(),
            "--lora-alpha".into(),
            "16".into(),
            "--out".into(),
            out.to_str().unwrap().to_string(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        let o = xtrain(&refs(&a));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let train = |program: &Path, out: &Path| {
        let o = train_cmd(&f.join("model"), &f.join("inputs.safetensors"), out)
            .args([
                "--steps",
                "2",
                "--lora-r",
                "8",
                "--lora-alpha",
                "16",
                "--program",
            ])
            .arg(program)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{err}");
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        (err, metrics)
    };
    let here = dir.join("here");
    compile(&here, &["--check", "--mesh", "fsdp=2", "--remat", "layer"]);
    let (err, loaded) = train(&here, &dir.join("run-here"));
    assert!(
        err.contains("loaded the step compiled by `xtrain compile` for cpu"),
        "{err}"
    );
    // A damaged executable is a lost compile, not a lost program: the text (checked against
    // the manifest) is compiled here, and the run is the same.
    let exe = here.join(&manifest(&here).builds[0].executable);
    let mut bytes = std::fs::read(&exe).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&exe, bytes).unwrap();
    let (err, damaged) = train(&here, &dir.join("run-damaged"));
    assert!(
        err.contains("here, the same program") && err.contains("does not match its manifest"),
        "{err}"
    );
    let loss_values = |m: &str| -> Vec<String> {
        m.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].to_string())
            .collect()
    };
    assert_eq!(loss_values(&loaded), loss_values(&damaged));
    // A program dir compiled for two GPU targets holds no executable for this machine: the
    // same text is compiled here, and said so; the same program on the same plugin gives the
    // same losses, to the bit.
    let gpus = dir.join("gpus");
    compile(
        &gpus,
        &[
            "--check",
            "--remat",
            "layer",
            "--target",
            "cuda:h100:2",
            "--target",
            "cuda:a100-80g:2",
        ],
    );
    let m = manifest(&gpus);
    assert_eq!(m.builds.len(), 2, "one build per target");
    assert_eq!(
        m.program_sha256,
        manifest(&here).program_sha256,
        "a GPU program dir holds the CPU's program"
    );
    let (err, compiled) = train(&gpus, &dir.join("run-gpus"));
    assert!(
        err.contains("compiling")
            && err.contains("here, the same program (this machine has 2 x cpu")
            && err.contains("cuda:h100:2 is 2 x NVIDIA H100 80GB HBM3")
            && err.contains("cuda:a100-80g:2 is 2 x NVIDIA A100-SXM4-80GB"),
        "{err}"
    );
    let losses = |m: &str| -> Vec<f64> {
        m.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(losses(&loaded), losses(&compiled));
    assert_eq!(losses(&compiled).len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The architecture's first invariant: for the same model, shapes, mesh and flags, `xtrain
/// compile` writes the same program whatever the target (the CPU, 4 H100s, 4 MI300Xs, a TPU v5p
/// slice of 4 chips), without opening any plugin (the ROCm one cannot even load here without
/// its runtime libraries).
#[test]
fn one_program_for_every_target() {
    let f = fixtures();
    let dir = tempdir("one-program");
    let model = f.join("model");
    let model = model.to_str().unwrap();
    for flags in [
        &["--dtype", "f32"][..],
        &["--dtype", "bf16", "--remat", "save-proj"],
        &["--dtype", "bf16", "--quant", "nf4", "--grad-accum", "2"],
        // Attention over key/value blocks that do not divide the sequence, and the sequence
        // split over a context axis (the mesh given to every target).
        &["--dtype", "bf16", "--key-block", "5"],
        &["--dtype", "bf16", "--mesh", "context=2,fsdp=2"],
        // Preference training: the reference adapter as extra arguments, pairs in microbatches.
        &[
            "--dtype",
            "bf16",
            "--method",
            "dpo",
            "--reference",
            "start",
            "--grad-accum",
            "2",
        ],
    ] {
        let mut hashes = Vec::new();
        let own_mesh = flags.contains(&"--mesh");
        for (name, place) in [
            (
                "cpu",
                if own_mesh {
                    &[][..]
                } else {
                    &["--mesh", "fsdp=4"][..]
                },
            ),
            ("cuda", &["--target", "cuda:h100:4"][..]),
            ("rocm", &["--target", "rocm:mi300x:4"][..]),
            ("tpu", &["--target", "tpu:v5p:2x2x1"][..]),
        ] {
            let out = dir.join(name);
            let mut args = vec![
                "compile",
                "--model",
                model,
                "--batch",
                "4",
                "--seq",
                "24",
                "--lora-r",
                "4",
                "--overwrite",
                "--out",
                out.to_str().unwrap(),
            ];
            args.extend(flags);
            args.extend(place);
            let o = xtrain_cmd()
                .args(&args)
                .env_remove("LD_LIBRARY_PATH")
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{name} {flags:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let text = std::fs::read(out.join("train_step.mlir")).unwrap();
            let m = manifest(&out);
            assert_eq!(
                m.program_sha256,
                xtrain::formats::program_dir::sha256_hex(&text)
            );
            assert!(m.builds.is_empty(), "nothing compiled without --check");
            hashes.push((name, m.program_sha256));
        }
        assert!(
            hashes.iter().all(|(_, h)| *h == hashes[0].1),
            "{flags:?}: {hashes:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A program dir compiled (with `--check`) for a TPU slice runs as is on the CPU, its text
/// untouched, and reproduces the Hugging Face + PEFT oracle: its three AdamW steps' losses (1e-4)
/// and step-3 adapter (1e-5), the tolerances of the oracle tests.
#[test]
fn a_program_dir_compiled_for_a_tpu_runs_as_is_on_the_cpu_and_matches_the_oracle() {
    let f = fixtures();
    let dir = tempdir("tpu-program-on-cpu");
    let model = f.join("model");
    let model = model.to_str().unwrap();
    let tpu = dir.join("tpu-oracle");
    let o = xtrain(&[
        "compile",
        "--model",
        model,
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--target",
        "tpu:v5p:2x2x1",
        "--check",
        "--no-estimate",
        "--out",
        tpu.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(manifest(&tpu).builds[0].platform, "tpu");
    let text_before = std::fs::read(tpu.join("train_step.mlir")).unwrap();
    let run = dir.join("run");
    let o = train_cmd(model.as_ref(), &f.join("inputs.safetensors"), &run)
        .arg("--init-adapter")
        .arg(f.join("adapter_init"))
        .args([
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--save-every",
            "3",
            "--program",
        ])
        .arg(&tpu)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("here, the same program") && err.contains("tpu:v5p:2x2x1 is 4 x TPU v5"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(tpu.join("train_step.mlir")).unwrap(),
        text_before
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    for (line, want) in metrics.lines().zip([6.63896, 6.45776, 6.28345]) {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let loss = row["loss"].as_f64().unwrap();
        assert!(
            (loss - want).abs() <= 1e-4,
            "loss {loss} vs the oracle's {want}"
        );
    }
    let ours = xtrain::formats::safetensors::SafeTensors::open(
        &run.join("step-3/adapter_model.safetensors"),
    )
    .unwrap();
    let want = xtrain::formats::safetensors::SafeTensors::open(
        &f.join("adapter_step3/adapter_model.safetensors"),
    )
    .unwrap();
    for name in want.tensors.keys() {
        let (a, b) = (
            ours.read(name).unwrap().to_f32().unwrap(),
            want.read(name).unwrap().to_f32().unwrap(),
        );
        let d = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(d <= 1e-5, "{name} differs by {d} (tolerance 1e-5)");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Host offload, checked through the target compilers (XLA's CPU compiler has no host
/// offloading): with `--offload frozen` the stacked frozen weights are arguments in host memory
/// (the compiler's host argument bytes are exactly their shards) and the device holds the rest;
/// with `--offload activations` the saved layer inputs become host temporaries.
#[test]
fn offloaded_steps_keep_weights_and_activations_in_host_memory() {
    let dir = tempdir("target-offload");
    let compile = |offload: &str, out: &Path| {
        let o = xtrain(&[
            "compile",
            "--model",
            "tiny-llama3",
            "--batch",
            "4",
            "--seq",
            "64",
            "--dtype",
            "bf16",
            "--target",
            "cuda:h100:2",
            "--offload",
            offload,
            "--check",
            "--out",
            out.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (manifest(out), stdout)
    };
    let (plain, _) = compile("none", &dir.join("none"));
    let (frozen, out) = compile("frozen", &dir.join("frozen"));
    assert!(out.contains("in host memory, per device"), "{out}");
    let host_args: i64 = frozen
        .args
        .iter()
        .filter(|a| a.memory.as_deref() == Some("pinned_host"))
        .map(|a| a.bytes_per_device())
        .sum();
    assert!(host_args > 0);
    assert!(frozen
        .args
        .iter()
        .filter(|a| a.memory.is_some())
        .all(|a| a.name.contains("layers.*.") && a.role == xtrain::program::Role::Frozen));
    let (p, f) = (plain.builds[0].per_device, frozen.builds[0].per_device);
    assert_eq!(f.host_argument_bytes, host_args);
    assert_eq!(f.argument_bytes + f.host_argument_bytes, p.argument_bytes);
    let (act, _) = compile("activations", &dir.join("activations"));
    let a = act.builds[0].per_device;
    assert_eq!(a.host_argument_bytes, 0);
    // Each layer's input [B/2, T, H] bf16 per device, for both layers, kept on the host.
    assert!(a.host_temp_bytes >= 2 * 2 * 64 * 64 * 2, "{a:?}");
    assert!(a.temp_bytes < p.temp_bytes, "{a:?} vs {p:?}");
    // The CPU compiler cannot do this: said before it is asked to.
    let e = fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--offload",
        "frozen",
        "--check",
        "--out",
        dir.join("cpu").to_str().unwrap(),
    ]);
    assert!(
        e.contains("XLA's CPU compiler cannot place values in host memory"),
        "{e}"
    );
    // Refused for unrolled layers; with --overwrite, what the dir held before is kept as it was
    // (the new program dir is built beside it and moved in only once complete).
    let unrolled = dir.join("unrolled");
    let o = xtrain(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--out",
        unrolled.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = std::fs::read(unrolled.join("manifest.json")).unwrap();
    let e = fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--offload",
        "frozen",
        "--remat",
        "none",
        "--target",
        "cuda:h100:2",
        "--overwrite",
        "--out",
        unrolled.to_str().unwrap(),
    ]);
    assert!(e.contains("needs looped layers"), "{e}");
    assert_eq!(
        std::fs::read(unrolled.join("manifest.json")).unwrap(),
        before
    );
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run of one process: a program dir compiled for several hosts (`cuda:h100:2x2`, 4 GPUs on 2
/// hosts) needs more devices than one host of 2 GPUs has, and is refused naming its build and
/// pointing to `--num-processes 2` (one process per host), before anything is loaded (the
/// plugin failed inside instead). The CPU plugin makes the devices it is asked for, so there the
/// same dir trains. No GPU here: the check is called as `train` calls it, with 2 CUDA devices.
#[test]
fn a_multi_host_program_dir_is_refused_where_this_process_has_too_few_devices() {
    let f = fixtures();
    let dir = tempdir("target-multi-host");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        f.join("model").to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--remat",
        "layer",
        "--check",
        "--target",
        "cuda:h100:2x2",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (program, _) = xtrain::formats::program_dir::read_dir(&prog).unwrap();
    let builds = xtrain::formats::program_dir::read_builds(&prog).unwrap();
    let what = format!("program dir {}", prog.display());
    let e = xtrain::train::one_process("cuda", 2, program.partitions, &builds, &what)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "{what} needs 4 devices, but this process has 2 (cuda). It was compiled for \
             cuda:h100:2x2 (4 devices on 2 hosts)"
        )) && e.contains("start one process per host with the same command and --num-processes 2")
            && e.contains("--mesh fsdp=2"),
        "{e}"
    );
    // A host with the 4 devices runs it.
    xtrain::train::one_process("cuda", 4, program.partitions, &builds, &what).unwrap();
    // The CPU plugin makes 4 devices: it trains.
    let o = train_cmd(
        &f.join("model"),
        &f.join("inputs.safetensors"),
        &dir.join("run"),
    )
    .args([
        "--steps",
        "1",
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--program",
    ])
    .arg(&prog)
    .args(["--plugin", "cpu"])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A step that does not fit, whatever is offloaded, is compiled and reported (by how much, and
/// what would help), the last choice recorded; an explicit `--offload` that does not fit likewise.
/// A GPU of 1 MB (a `--target-config`) stands for a device too small.
#[test]
fn a_step_too_big_for_every_offload_choice_is_reported() {
    let dir = tempdir("target-too-small");
    let described = xtrain(&["targets", "cuda:h100"]);
    assert!(described.status.success());
    let text = String::from_utf8_lossy(&described.stdout).to_string();
    let small: String = text
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("device_memory_size:") {
                "  device_memory_size: 1000000"
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(small.contains("device_memory_size: 1000000"), "{small}");
    let cfg = dir.join("small.txtpb");
    std::fs::write(&cfg, small).unwrap();
    // `--remat auto` (the default): save-proj, then layer remat with each offload choice, or
    // with the one given
    for (offload, tried) in [("auto", 4), ("none", 2)] {
        let out = dir.join(offload);
        let o = xtrain(&[
            "compile",
            "--model",
            "tiny-llama3",
            "--batch",
            "2",
            "--seq",
            "64",
            "--target",
            "cuda:small:2",
            "--target-config",
            cfg.to_str().unwrap(),
            "--offload",
            offload,
            "--check",
            "--out",
            out.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{stdout}\n{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(stdout.matches(": does not fit").count(), tried, "{stdout}");
        assert!(
            stdout.contains(
                "(auto: --remat save-proj --offload none does not fit; trying --remat layer \
                 --offload none)"
            ),
            "{stdout}"
        );
        assert!(
            stdout.contains("--remat layer (or auto): keep only each layer's input"),
            "{stdout}"
        );
        // The choices before the one taken are recorded with the compiler's figures, in order.
        let mut m = manifest(&out);
        let tried: Vec<(&str, &str)> = m
            .attempts
            .iter()
            .map(|a| (a.remat.as_str(), a.offload.as_str()))
            .collect();
        let before_last: &[(&str, &str)] = if offload == "auto" {
            &[
                ("save-proj", "none"),
                ("layer", "none"),
                ("layer", "activations"),
            ]
        } else {
            &[("save-proj", "none")]
        };
        assert_eq!(tried, before_last);
        let usable = m.builds[0].usable_memory_per_device;
        assert!(usable.is_some_and(|u| u <= 1_000_000), "{usable:?}");
        for a in &m.attempts {
            assert!(a.target == "cuda:small:2" && !a.fits, "{a:?}");
            assert_eq!(a.usable_memory_per_device, usable, "{a:?}");
            let figures = a.per_device.expect("the GPU compiler reports the memory");
            assert!(figures.total_bytes > usable.unwrap_or(0), "{a:?}");
        }
        // auto's last choice is `all`: the frozen weights are then host arguments.
        let build = m.builds.pop().expect("the last choice is recorded");
        assert_eq!(
            build.per_device.host_argument_bytes > 0,
            offload == "auto",
            "{build:?}"
        );
        assert!(out.join(&build.executable).is_file());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The attention blocks have one default for every target (halves where the sequence is a
/// multiple of 256, else one block: see docs/performance.md for how it was chosen);
/// `--attention-block` chooses, alike for every target.
#[test]
fn attention_blocks_have_one_default_for_every_target() {
    let dir = tempdir("attention-block");
    let program = |name: &str, flags: &[&str]| {
        let out = dir.join(name);
        let mut args = vec![
            "compile",
            "--model",
            "tiny-llama3",
            "--seq",
            "512",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        let o = xtrain(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        let text = std::fs::read_to_string(out.join("train_step.mlir")).unwrap();
        (stdout, text)
    };
    let (cpu_out, cpu) = program("cpu", &[]);
    let (_, cuda) = program("cuda", &["--target", "cuda:h100:1"]);
    let (_, tpu) = program("tpu", &["--target", "tpu:v5e:1x1"]);
    let (chosen_out, chosen) = program(
        "cuda-64",
        &["--target", "cuda:h100:1", "--attention-block", "64"],
    );
    assert!(cpu_out.contains("--attention-block 256"), "{cpu_out}");
    assert!(chosen_out.contains("--attention-block 64"), "{chosen_out}");
    assert_eq!(cpu, cuda);
    assert_eq!(cpu, tpu);
    let dots = |t: &str| t.matches("dot_general").count();
    assert!(
        dots(&chosen) > dots(&cpu),
        "{} vs {}",
        dots(&chosen),
        dots(&cpu)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

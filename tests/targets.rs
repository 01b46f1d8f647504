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
    let build = m.build.as_ref().expect("a build in manifest.json");
    assert_eq!(build.devices, devices);
    assert_eq!(build.platform, platform);
    let sharded: i64 = m.args.iter().map(|a| a.bytes_per_device()).sum();
    let whole: i64 = m.args.iter().map(|a| a.bytes).sum();
    assert!(
        sharded * devices >= whole && sharded < whole,
        "{sharded} of {whole}"
    );
    let hlo = std::fs::read_to_string(dir.join("train_step.optimized.txt")).unwrap();
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
    let exe = std::fs::read(dir.join("train_step.executable")).unwrap();
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
        out.contains("target tpu:v5e:2x2: 4 x TPU v5 lite on 1 host(s)"),
        "{out}"
    );
    assert!(out.contains(r#"mesh [("fsdp", 4)]"#), "{out}");
    assert!(out.contains(": fits"), "{out}");
    assert!(out.contains("an estimate, not a measurement"), "{out}");
    check_build(&dir, 4, "tpu");
    let build = manifest(&dir).build.unwrap();
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
    let build = manifest(&dir).build.unwrap();
    let memory = build.memory_per_device.unwrap();
    assert_eq!(
        build.usable_memory_per_device,
        Some((memory as f64 * 0.9f32 as f64) as i64)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tiny_step_compiles_for_two_absent_mi300x() {
    let libs = rocm_standins_in("rocm-standins");
    let dir = tempdir("target-rocm");
    let out = compile_for("rocm:mi300x:2", &dir, &[("LD_LIBRARY_PATH", &libs)]);
    assert!(out.contains("2 x AMD Instinct MI300X"), "{out}");
    check_build(&dir, 2, "rocm");
    // Without the runtime libraries, the error says what is missing and where a ROCm host has it.
    let e = fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--target",
        "rocm:mi300x:2",
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
    // A layout libtpu refuses: its message, and the form xtrain wants.
    let e = compile(&["--target", "tpu:v5e:2x3"]);
    assert!(
        e.contains("libtpu refused the TPU topology `v5e:2x3`"),
        "{e}"
    );
    assert!(e.contains("not divisible"), "{e}");
    assert!(e.contains("tpu:<generation>:<chips>"), "{e}");
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
    compile(&here, &["--check", "--mesh", "fsdp=2"]);
    let (err, loaded) = train(&here, &dir.join("run-here"));
    assert!(
        err.contains("loaded the step compiled by `xtrain compile` for cpu"),
        "{err}"
    );
    let h100 = dir.join("h100");
    compile(
        &h100,
        &["--check", "--target", "cuda:h100:2", "--remat", "none"],
    );
    let (err, compiled) = train(&h100, &dir.join("run-h100"));
    assert!(
        err.contains("its executable is for cuda:h100:2 (2 x NVIDIA H100 80GB HBM3")
            && err.contains("but this machine has 2 x cpu"),
        "{err}"
    );
    // A GPU's program whose layer loops' stacks start uninitialized (XLA's AllocateBuffer,
    // which XLA CPU does not implement): built here with the stacks filled, saying so.
    let cuda = dir.join("cuda");
    compile(&cuda, &["--mesh", "fsdp=2", "--plugin", "cuda"]);
    let text = std::fs::read_to_string(cuda.join("train_step.mlir")).unwrap();
    assert!(text.contains("@AllocateBuffer"), "{text}");
    let (err, refilled) = train(&cuda, &dir.join("run-cuda"));
    assert!(
        err.contains("with its layer stacks filled: it was built for a GPU or TPU plugin")
            && err.contains("which the cpu plugin does not implement"),
        "{err}"
    );
    // The same step (f32 is the same text for both, but for the stacks' initial contents,
    // which the loop overwrites), so the same losses; without remat (the h100 dir) the same
    // math in another order, so the same losses to rounding (1e-5 relative).
    let losses = |m: &str| -> Vec<f64> {
        m.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(losses(&loaded), losses(&refilled));
    for (a, b) in losses(&loaded).iter().zip(losses(&compiled)) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{a} vs {b}");
    }
    assert_eq!(losses(&compiled).len(), 2);
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
    let (p, f) = (
        plain.build.unwrap().per_device,
        frozen.build.unwrap().per_device,
    );
    assert_eq!(f.host_argument_bytes, host_args);
    assert_eq!(f.argument_bytes + f.host_argument_bytes, p.argument_bytes);
    let (act, _) = compile("activations", &dir.join("activations"));
    let a = act.build.unwrap().per_device;
    assert_eq!(a.host_argument_bytes, 0);
    // Each layer's input [B/2, T, H] bf16 per device, for both layers, kept on the host.
    assert!(a.host_temp_bytes >= 2 * 2 * 64 * 64 * 2, "{a:?}");
    assert!(a.temp_bytes < p.temp_bytes, "{a:?} vs {p:?}");
    // The CPU compiler cannot do this: said before anything is built.
    let e = fails(&[
        "compile",
        "--model",
        "tiny-llama3",
        "--offload",
        "frozen",
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
        // auto's last choice is `all`: the frozen weights are then host arguments.
        let build = manifest(&out).build.expect("the last choice is recorded");
        assert_eq!(
            build.per_device.host_argument_bytes > 0,
            offload == "auto",
            "{build:?}"
        );
        assert!(out.join("train_step.executable").is_file());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// On a GPU the default is two attention blocks (a GPU compiler makes each block's matmuls and
/// softmax kernels of their own: 308 kernels per layer with blocks of 256 against 198 with two,
/// for 8B on an H100), on a TPU four where the sequence is a multiple of 512 (the TPU cost model:
/// 8B on v6e at batch 32, 2.127 -> 2.045 s per step; v5p 392.3 -> 390.8 ms); on a CPU blocks of
/// an eighth of the sequence, at least 128; `--attention-block` chooses on either. Fewer
/// blocks, fewer matmuls in the program.
#[test]
fn accelerators_default_to_fewer_attention_blocks() {
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
        let m = manifest(&out);
        let text = std::fs::read_to_string(out.join("train_step.mlir")).unwrap();
        (m.spec.attention_block, text.matches("dot_general").count())
    };
    let (cpu, cpu_dots) = program("cpu", &[]);
    let (cuda, cuda_dots) = program("cuda", &["--plugin", "cuda"]);
    let (rocm, _) = program("rocm", &["--plugin", "rocm"]);
    let (tpu, tpu_dots) = program("tpu", &["--plugin", "tpu"]);
    let (chosen, chosen_dots) =
        program("cuda-64", &["--plugin", "cuda", "--attention-block", "64"]);
    assert_eq!(cpu, None);
    assert_eq!(cuda, Some(256));
    assert_eq!(rocm, Some(256));
    assert_eq!(tpu, Some(128));
    assert_eq!(chosen, Some(64));
    assert!(cuda_dots < tpu_dots, "{cuda_dots} vs {tpu_dots}");
    // at seq 512 the CPU's blocks (an eighth, at least 128) are quarters too
    assert_eq!(tpu_dots, cpu_dots);
    assert!(chosen_dots > cpu_dots, "{chosen_dots} vs {cpu_dots}");
    std::fs::remove_dir_all(&dir).unwrap();
}

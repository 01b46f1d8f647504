//! `--kernel NAME`: a kernel compiled in place of the program's composite ops (attention over
//! key blocks), the program's text unchanged, the run and the build saying what was replaced.

mod common;
use common::*;
use std::path::Path;

const FLAGS: &[&str] = &[
    "--steps",
    "3",
    "--batch-size",
    "2",
    "--seq",
    "40",
    "--lora-r",
    "4",
    "--key-block",
    "8",
    "--log-every",
    "1",
    "--no-plot",
];

/// The losses of a run's `metrics.jsonl`, in step order.
fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
        .collect()
}

/// Train the tiny model with [`FLAGS`] and `extra` into `dir/name`, expecting success: its
/// losses and what it said.
fn train_run(
    dir: &Path,
    (model, data): (&Path, &Path),
    name: &str,
    extra: &[&str],
) -> (Vec<f64>, String) {
    let out = dir.join(name);
    let o = train_cmd(model, data, &out)
        .args(FLAGS)
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    (losses(&out), err)
}

/// Three steps' losses, the same within f32 rounding of another summation order (1e-5
/// relative).
fn assert_same_losses(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{a:?} against {b:?}");
    }
}

/// The reference kernel in place of the key-block loops trains as they do: the same losses
/// within f32 rounding of another summation order (1e-5 relative), and the run says which
/// composites it replaced.
#[test]
fn a_run_with_a_kernel_trains_as_the_loops_do_and_says_so() {
    let dir = tempdir("kernel-run");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 12);
    let runs = (model.as_path(), data.as_path());
    let (loops, said) = train_run(&dir, runs, "loops", &[]);
    assert!(
        said.contains("--key-block 8 (blocks of 8; the sequence is padded to 48"),
        "{said}"
    );
    let (kernel, said) = train_run(&dir, runs, "kernel", &["--kernel", "every-key"]);
    assert!(
        said.contains(
            "kernels in place of composites: xtrain.attention v1 -> every-key, \
             xtrain.attention_grad v1 -> every-key (the program's text is unchanged)"
        ),
        "{said}"
    );
    assert_same_losses(&loops, &kernel);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_kernel_that_is_unknown_or_replaces_nothing_is_refused() {
    let dir = tempdir("kernel-refused");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 4);
    let m = model.to_str().unwrap();
    let d = data.to_str().unwrap();
    let out = dir.join("out");
    let o = out.to_str().unwrap();
    let base = [
        "train",
        "--model",
        m,
        "--data",
        d,
        "--out",
        o,
        "--steps",
        "1",
        "--seq",
        "40",
        "--batch-size",
        "2",
    ];
    let e = fails(&[&base[..], &["--key-block", "8", "--kernel", "fast"]].concat());
    assert!(
        e.contains("--kernel fast: no such kernel (built in: every-key, cudnn, cudnn-standin)"),
        "{e}"
    );
    let e = fails(&[&base[..], &["--key-block", "off", "--kernel", "every-key"]].concat());
    assert!(
        e.contains("--kernel every-key: the program has no composite it implements"),
        "{e}"
    );
    assert!(!out.exists(), "a refused run writes nothing");
    let e = fails(&[
        "compile",
        "--model",
        m,
        "--batch",
        "2",
        "--seq",
        "24",
        "--key-block",
        "4",
        "--kernel",
        "every-key",
        "--out",
        o,
    ]);
    assert!(e.contains("add --check"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `compile --check --kernel`: the program dir's text is the one compiled without the kernel,
/// and its build records the kernel.
#[test]
fn a_build_records_its_kernels_and_the_program_stays_the_same() {
    let dir = tempdir("kernel-build");
    let m = fixtures().join("model");
    let m = m.to_str().unwrap();
    let compile = |name: &str, extra: &[&str]| -> serde_json::Value {
        let out = dir.join(name);
        let args = [
            &[
                "compile",
                "--model",
                m,
                "--batch",
                "2",
                "--seq",
                "24",
                "--key-block",
                "4",
                "--check",
                "--out",
            ][..],
            &[out.to_str().unwrap()],
            extra,
        ]
        .concat();
        let o = xtrain(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
    };
    let plain = compile("plain", &[]);
    let with = compile("with", &["--kernel", "every-key"]);
    assert_eq!(plain["program_sha256"], with["program_sha256"]);
    assert!(plain["builds"][0].get("kernels").is_none(), "{plain}");
    assert_eq!(
        with["builds"][0]["kernels"],
        serde_json::json!([
            {"composite": "xtrain.attention", "version": 1, "kernel": "every-key"},
            {"composite": "xtrain.attention_grad", "version": 1, "kernel": "every-key"}
        ])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--kernel cudnn`: the CUDA compiler takes cuDNN's fused attention calls for an absent H100
/// (the plugin xtrain installs, no GPU, no cuDNN library here) in the composites' place, and
/// the build records it; where cuDNN's causal kernel cannot stand in for the composite (f32
/// attention, a context axis, the CPU plugin) it is refused with the reason. Whether the calls compute what the loops do needs a GPU:
/// `tools/gpu-long-context.sh` compares the losses there.
#[test]
fn the_cudnn_kernel_compiles_for_an_absent_h100_and_is_refused_where_it_cannot_stand_in() {
    let dir = tempdir("kernel-cudnn");
    let m = fixtures().join("model");
    let m = m.to_str().unwrap();
    let out = dir.join("out");
    let o = out.to_str().unwrap();
    let compile = |extra: &[&str]| -> Vec<String> {
        let base = [
            "compile",
            "--model",
            m,
            "--batch",
            "2",
            "--key-block",
            "4",
            "--check",
            "--kernel",
            "cudnn",
            "--out",
            o,
        ];
        [&base[..], extra]
            .concat()
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let args = compile(&["--dtype", "bf16", "--seq", "24", "--target", "cuda:h100:1"]);
    let run = xtrain(&refs(&args));
    let said = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(run.status.success(), "{said}");
    assert!(
        said.contains(
            "kernels in place of composites: xtrain.attention v1 -> cudnn, \
             xtrain.attention_grad v1 -> cudnn"
        ),
        "{said}"
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        manifest["builds"][0]["kernels"],
        serde_json::json!([
            {"composite": "xtrain.attention", "version": 1, "kernel": "cudnn"},
            {"composite": "xtrain.attention_grad", "version": 1, "kernel": "cudnn"}
        ])
    );
    let optimized =
        std::fs::read_to_string(out.join("train_step.cuda-h100-1.optimized.txt")).unwrap();
    for call in ["\"__cudnn$fmhaSoftmax\"", "\"__cudnn$fmhaSoftmaxBackward\""] {
        assert!(optimized.contains(call), "no {call} in the optimized HLO");
    }
    let program = std::fs::read_to_string(out.join("train_step.mlir")).unwrap();
    assert!(
        !program.contains("cudnn"),
        "the program dir keeps the one text"
    );
    std::fs::remove_dir_all(&out).unwrap();

    // On a batch mesh each device calls cuDNN on its own row (the composites sit in a manual
    // computation): [1, 4 heads, 24 tokens, 16] per call, not the global batch of 2.
    let args = compile(&[
        "--dtype",
        "bf16",
        "--seq",
        "24",
        "--target",
        "cuda:h100:2",
        "--mesh",
        "fsdp=2",
    ]);
    let run = xtrain(&refs(&args));
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let optimized =
        std::fs::read_to_string(out.join("train_step.cuda-h100-2.optimized.txt")).unwrap();
    let call = optimized
        .lines()
        .find(|l| l.contains("custom_call_target=\"__cudnn$fmhaSoftmax\""))
        .expect("the forward call");
    assert!(
        call.contains("(bf16[1,4,24,16]{3,1,2,0}, f32[1,4,24]{2,1,0}"),
        "{call}"
    );
    std::fs::remove_dir_all(&out).unwrap();

    let refused = |extra: &[&str], why: &str| {
        let args = compile(extra);
        let o = xtrain(&refs(&args));
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && !e.contains("panicked"),
            "{extra:?}: {e}"
        );
        assert!(
            e.contains(&format!("error: kernel cudnn for xtrain.attention: {why}")),
            "{extra:?}: {e}"
        );
        assert!(!out.exists(), "{extra:?}: a refused compile writes nothing");
    };
    refused(
        &["--dtype", "f32", "--seq", "24", "--target", "cuda:h100:1"],
        "the attention runs in f32: cuDNN's flash attention takes bf16 or f16",
    );
    refused(
        &[
            "--dtype",
            "bf16",
            "--seq",
            "24",
            "--target",
            "cuda:h100:2",
            "--mesh",
            "context=2",
        ],
        "the sequence is cut over a context axis (4 chunks)",
    );
    let data = instruction_examples(&dir.join("d.jsonl"), 4);
    let text_model = tiny_text_model(&dir);
    let train = [
        "train",
        "--model",
        text_model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        o,
        "--steps",
        "1",
        "--seq",
        "40",
        "--batch-size",
        "2",
        "--key-block",
        "8",
        "--kernel",
        "cudnn",
    ];
    // On the CPU the plugin is the first reason, packed or not; on the CUDA plugin (named,
    // not opened) packed rows are.
    for extra in [&[][..], &["--no-pack"]] {
        let e = fails(&[&train[..], extra].concat());
        assert!(
            e.contains("--kernel cudnn does not run on the cpu plugin"),
            "{e}"
        );
    }
    // A target whose plugin the kernel does not run on is refused before its plugin is opened
    // (or downloaded).
    let args = compile(&[
        "--dtype",
        "bf16",
        "--seq",
        "24",
        "--target",
        "rocm:mi300x:1",
    ]);
    let o = xtrain(&refs(&args));
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success() && e.contains("--kernel cudnn does not run on the rocm plugin"),
        "{e}"
    );
    let e = fails(&[&train[..], &["--plugin", "cuda"]].concat());
    assert!(
        e.contains(
            "cuDNN's causal mask, which does not keep packed documents apart: add --no-pack"
        ),
        "{e}"
    );
    assert!(!out.exists(), "a refused run writes nothing");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--kernel cudnn-standin` (the cuDNN kernel with plain StableHLO in the library calls' place)
/// trains as the loops do on rows of one example each, padded at their ends (`--no-pack`):
/// its padding queries see earlier padding keys, which the loops hide, but they feed no loss,
/// so the losses agree to f32 rounding (1e-5 relative). The kernel's row rule holds them.
#[test]
fn the_cudnn_stand_in_trains_as_the_loops_do_on_padded_rows() {
    let dir = tempdir("kernel-standin");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 12);
    let runs = (model.as_path(), data.as_path());
    let (loops, _) = train_run(&dir, runs, "loops", &["--no-pack"]);
    let standin = ["--no-pack", "--kernel", "cudnn-standin"];
    let (stand_in, _) = train_run(&dir, runs, "standin", &standin);
    assert_same_losses(&loops, &stand_in);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --program DIR` of a dir compiled with `--kernel every-key` runs its executable with
/// the kernel it was compiled with, as it takes every other recorded setting from the dir; a
/// `--kernel` that differs compiles here and says why.
#[test]
fn a_program_dir_runs_with_the_kernels_it_was_compiled_with() {
    let dir = tempdir("kernel-dir");
    let f = fixtures();
    let prog = dir.join("prog");
    let model = f.join("model");
    let args = [
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--key-block",
        "4",
        "--check",
        "--kernel",
        "every-key",
        "--out",
        prog.to_str().unwrap(),
    ];
    let o = xtrain(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let train = |name: &str, extra: &[&str]| -> String {
        let o = train_cmd(
            &f.join("model"),
            &f.join("inputs.safetensors"),
            &dir.join(name),
        )
        .args(["--steps", "1", "--program"])
        .arg(&prog)
        .args(extra)
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{err}");
        err
    };
    let err = train("as-compiled", &[]);
    assert!(
        err.contains("--kernel every-key (as it was compiled for cpu")
            && err.contains("loaded the step compiled by `xtrain compile` for cpu")
            && !err.contains("here, the same program"),
        "{err}"
    );
    let err = train("asked-otherwise", &["--kernel", "cudnn-standin"]);
    assert!(
        err.contains("no executable of the dir fits this run")
            && err.contains("was compiled with kernels [xtrain.attention v1 -> every-key"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

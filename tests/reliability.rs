//! Bad input, interrupted runs and numerical faults: every case exits non-zero (or cleanly
//! where that is the point) with a message that says what was wrong and where, never a panic,
//! and leaves no partial output. docs/reliability.md lists these cases and messages.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn tiny_dir(dir: &Path, name: &str) -> PathBuf {
    let m = dir.join(name);
    std::fs::create_dir_all(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("model").join(f), m.join(f)).unwrap();
    }
    m
}

fn train_on(model: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["train", "--model"].iter().map(|s| s.to_string()).collect();
    v.push(model.to_str().unwrap().into());
    v.extend([
        "--data".to_string(),
        fixtures()
            .join("inputs.safetensors")
            .to_str()
            .unwrap()
            .into(),
        "--out".into(),
        out.to_str().unwrap().into(),
    ]);
    v.extend(
        ["--lora-r", "4", "--log-every", "0", "--no-plot"]
            .iter()
            .map(|s| s.to_string()),
    );
    if !extra.contains(&"--steps") {
        v.extend(["--steps".to_string(), "2".to_string()]);
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[test]
fn bad_model_dirs_and_configs() {
    let dir = tempdir("rel-config");
    let out = dir.join("out");
    let e = fails(&refs(&train_on(&dir.join("nope"), &out, &[])));
    assert!(
        e.contains("model directory") && e.contains("nope does not exist"),
        "{e}"
    );
    assert!(!out.exists(), "no output dir for a run that never started");

    let m = tiny_dir(&dir, "badjson");
    std::fs::write(m.join("config.json"), "{ not json").unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("config.json is not valid JSON"), "{e}");

    let m = tiny_dir(&dir, "yarn");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    c["rope_scaling"]["rope_type"] = "yarn".into();
    std::fs::write(m.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("field `rope_scaling.rope_type` = \"yarn\" is not supported"),
        "{e}"
    );

    let m = tiny_dir(&dir, "act");
    c = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("model/config.json")).unwrap(),
    )
    .unwrap();
    c["hidden_act"] = "gelu".into();
    std::fs::write(m.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("field `hidden_act` = \"gelu\" is not supported"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_safetensors() {
    let dir = tempdir("rel-st");
    let out = dir.join("out");
    let good = std::fs::read(fixtures().join("model/model.safetensors")).unwrap();

    let m = tiny_dir(&dir, "trunc");
    std::fs::write(m.join("model.safetensors"), &good[..good.len() / 2]).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("(truncated?)"), "{e}");

    let m = tiny_dir(&dir, "trailing");
    let mut longer = good.clone();
    longer.extend_from_slice(b"trailing");
    std::fs::write(m.join("model.safetensors"), &longer).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("(trailing bytes: not a safetensors file?)"),
        "{e}"
    );

    let m = tiny_dir(&dir, "header");
    let mut bad = good.clone();
    bad[8] = b'x'; // the header's opening brace
    std::fs::write(m.join("model.safetensors"), &bad).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("header is not valid JSON"), "{e}");

    // A tensor with the wrong shape, and one missing: rewrite the file.
    let st = xtrain::formats::safetensors::SafeTensors::open(
        &fixtures().join("model/model.safetensors"),
    )
    .unwrap();
    let mut all: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    let m = tiny_dir(&dir, "shape");
    let mut wrong = all.clone();
    wrong.insert(
        "model.layers.1.mlp.up_proj.weight".into(),
        pjrt::HostTensor::from_f32(&vec![0.0; 64 * 64], &[64, 64]),
    );
    xtrain::formats::safetensors::write(&m.join("model.safetensors"), &wrong, &Default::default())
        .unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("tensor `model.layers.1.mlp.up_proj.weight` has shape [64, 64] but the config needs [128, 64]"), "{e}");
    let m = tiny_dir(&dir, "missing");
    all.remove("model.norm.weight");
    xtrain::formats::safetensors::write(&m.join("model.safetensors"), &all, &Default::default())
        .unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("the checkpoint has no tensor `model.norm.weight`"),
        "{e}"
    );

    // An index pointing at a shard that is not there.
    let m = dir.join("sharded");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(fixtures().join("model_sharded")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, m.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(m.join("model-00003-of-00006.safetensors")).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("to shard model-00003-of-00006.safetensors, which does not exist"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_data_and_tokenizers() {
    let dir = tempdir("rel-data");
    let out = dir.join("out");
    let model = tiny_text_model(&dir);
    let m = model.to_str().unwrap();
    let jsonl = |name: &str, text: &str| -> String {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let base = |data: &str| -> Vec<String> {
        [
            "train",
            "--model",
            m,
            "--data",
            data,
            "--out",
            out.to_str().unwrap(),
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--seq",
            "32",
            "--lora-r",
            "4",
            "--log-every",
            "0",
            "--no-plot",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let bad = jsonl("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 3}\n");
    let e = fails(&refs(&base(&bad)));
    assert!(
        e.contains(
            "bad.jsonl:2: `text` is a number (3), not a string (expected `text`, `instruction` + \
             `output`, or `messages`)"
        ),
        "{e}"
    );
    let empty = jsonl("empty.jsonl", "\n\n");
    let e = fails(&refs(&base(&empty)));
    assert!(e.contains("empty.jsonl: no usable examples"), "{e}");
    let long = jsonl(
        "long.jsonl",
        &format!("{{\"text\": \"{}\"}}\n", "x".repeat(100)),
    );
    let mut a = base(&long);
    a.push("--strict-length".into());
    let e = fails(&refs(&a));
    assert!(
        e.contains("example 1 has 101 tokens, more than --seq 32"),
        "{e}"
    );
    // Without --strict-length it truncates and says so.
    let mut a = base(&long);
    a[6] = dir.join("out-long").to_str().unwrap().into();
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated 1 examples to --seq 32"));

    // No tokenizer.json.
    let nt = tiny_dir(&dir, "no-tokenizer");
    let mut a = base(&long);
    a[2] = nt.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(e.contains("has no tokenizer.json"), "{e}");
    // A tokenizer larger than the model's vocabulary.
    let big = dir.join("big-vocab");
    std::fs::create_dir_all(&big).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(model.join(f), big.join(f)).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(big.join("config.json")).unwrap()).unwrap();
    c["vocab_size"] = 200.into();
    std::fs::write(big.join("config.json"), c.to_string()).unwrap();
    let mut a = base(&long);
    a[2] = big.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("the tokenizer has 259 tokens but the model's vocabulary is 200"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn out_of_range_tokens_bad_adapters_and_program_dirs() {
    let dir = tempdir("rel-misc");
    let out = dir.join("out");
    // Token ids beyond the vocabulary.
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&fixtures().join("inputs.safetensors"))
            .unwrap();
    let mut t: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    let mut ids = t["input_ids"].to_i64().unwrap();
    ids[17] = 9999;
    t.insert(
        "input_ids".into(),
        pjrt::HostTensor::from_i64(&ids, &[2, 16]),
    );
    let data = dir.join("oob.safetensors");
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    let model = fixtures().join("model");
    let mut a = train_on(&model, &out, &[]);
    a[4] = data.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("token id 9999 at batch row 1, position 1 is outside the vocabulary (0..512)"),
        "{e}"
    );

    // An adapter of another rank, and one with a wrong shape.
    let init = fixtures().join("adapter_init");
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &[
            "--init-adapter",
            init.to_str().unwrap(),
            "--lora-alpha",
            "16",
        ],
    )));
    assert!(e.contains("has r=8") && e.contains("ask for r=4"), "{e}");
    assert!(
        e.contains("targets q,k,v,o,gate,up,down"),
        "targets as users write them: {e}"
    );
    let bad = dir.join("bad-adapter");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(
        init.join("adapter_config.json"),
        bad.join("adapter_config.json"),
    )
    .unwrap();
    let ast =
        xtrain::formats::safetensors::SafeTensors::open(&init.join("adapter_model.safetensors"))
            .unwrap();
    let mut at: std::collections::BTreeMap<String, pjrt::HostTensor> = ast
        .tensors
        .keys()
        .map(|k| (k.clone(), ast.read(k).unwrap()))
        .collect();
    at.insert(
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight".into(),
        pjrt::HostTensor::from_f32(&vec![0.0; 64 * 8], &[64, 8]),
    );
    xtrain::formats::safetensors::write(
        &bad.join("adapter_model.safetensors"),
        &at,
        &Default::default(),
    )
    .unwrap();
    let mut a = train_on(
        &model,
        &out,
        &[
            "--init-adapter",
            bad.to_str().unwrap(),
            "--lora-alpha",
            "16",
        ],
    );
    let pos = a.iter().position(|s| s == "--lora-r").unwrap();
    a[pos + 1] = "8".into();
    let e = fails(&refs(&a));
    assert!(e.contains("tensor `base_model.model.model.layers.0.mlp.up_proj.lora_B.weight` has shape [64, 8] but rank 8 on this model needs [128, 8]"), "{e}");

    // A program dir built for another model.
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        "llama-3.1-8b",
        "--seq",
        "16",
        "--batch",
        "2",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(e.contains("was built for another model"), "{e}");
    // ... or tampered with.
    std::fs::write(prog.join("train_step.mlir"), "module {}").unwrap();
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(e.contains("does not match its manifest"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn step_options_that_do_not_fit_the_batch() {
    let dir = tempdir("rel-step-options");
    let out = dir.join("prog");
    for (options, message) in [
        (
            &["--seq", "48", "--attention-block", "32"][..],
            "--attention-block 32 must be a positive divisor of the sequence length 48",
        ),
        (
            &["--batch", "3", "--grad-accum", "2"][..],
            "--grad-accum 2 must divide the batch size 3",
        ),
        (
            &["--matmul-result", "bf32"][..],
            "invalid value 'bf32' for '--matmul-result <MATMUL_RESULT>'",
        ),
        (
            &["--attention-scores", "bf16"][..],
            "invalid value 'bf16' for '--attention-scores <ATTENTION_SCORES>'",
        ),
        (
            &["--keep-softmax-stats", "maybe"][..],
            "invalid value 'maybe' for '--keep-softmax-stats <BOOL>'",
        ),
        (
            &["--remat", "none", "--keep-softmax-stats", "true"][..],
            "--keep-softmax-stats is for --remat layer",
        ),
        (
            &["--pin-mlp-activations", "true"][..],
            "--pin-mlp-activations places activations on a device mesh, but this step runs on one device",
        ),
        (
            &["--remat", "save_proj"][..],
            "--remat must be auto, none, layer or save-proj, got `save_proj`",
        ),
    ] {
        let mut args = vec!["compile", "--model", "tiny-llama3"];
        args.extend(options);
        args.extend(["--out", out.to_str().unwrap()]);
        let e = fails(&args);
        assert!(e.contains(message), "{options:?}: {e}");
    }
    assert!(!out.exists(), "nothing is written for a refused step");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_plugins_and_output_dirs() {
    let dir = tempdir("rel-plugin");
    let out = dir.join("out");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--plugin", "/nonexistent/plugin.so"],
    )));
    assert!(
        e.contains("plugin file /nonexistent/plugin.so does not exist"),
        "{e}"
    );
    let not_plugin = dir.join("fake.so");
    std::fs::write(&not_plugin, b"not an ELF file").unwrap();
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--plugin", not_plugin.to_str().unwrap()],
    )));
    assert!(e.contains("cannot load PJRT plugin"), "{e}");
    // A real shared object that is not a PJRT plugin: libc.
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .expect("libc");
    let e = fails(&refs(&train_on(&model, &out, &["--plugin", libc])));
    assert!(
        e.contains("not a PJRT plugin: it does not export GetPjrtApi"),
        "{e}"
    );
    let e = fails(&refs(&train_on(&model, &out, &["--plugin", "cuda-typo"])));
    assert!(e.contains("unknown plugin 'cuda-typo'"), "{e}");
    // An output path that is a file: refused before any work.
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = fails(&refs(&train_on(&model, &file, &[])));
    assert!(e.contains("cannot create output dir"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_blown_up_update_stops_with_the_state_from_before_it() {
    let dir = tempdir("rel-nan");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // lr 1e30: step 1's loss and gradient are finite, and so is its update, but it would move
    // the LoRA weights by about 1e30 (step 2's loss was NaN, and the "last good state" was step
    // 1's, with weights of 1e30). It is refused, and the state from before it kept.
    let a = train_on(&model, &out, &["--lr", "1e30", "--steps", "3"]);
    let e = fails(&refs(&a));
    assert!(
        e.contains("step 1: the update blows the LoRA weights up: it would move one by")
            && e.contains("more than 1000 times the largest LoRA weight before it")
            && e.contains("stopped without applying it"),
        "{e}"
    );
    let ckpt = out.join("checkpoint-0");
    assert!(e.contains(&ckpt.display().to_string()), "{e}");
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&ckpt.join("adapter_model.safetensors"))
            .unwrap();
    for name in st.tensors.keys() {
        let v = st.read(name).unwrap().to_f32().unwrap();
        assert!(
            v.iter().all(|x| x.abs() < 1.0),
            "{name}: the last good state is the fresh adapter"
        );
    }
    assert!(!out.join("checkpoint-1").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skipped_steps_are_counted_at_the_end_of_the_run() {
    let dir = tempdir("rel-skip-some");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // A linear decay from lr 1e30 to 0 over 4 steps: steps 1 to 3 blow up and are skipped,
    // step 4 (lr 0) is applied.
    let a = train_on(
        &model,
        &out,
        &[
            "--lr",
            "1e30",
            "--schedule",
            "linear",
            "--steps",
            "4",
            "--skip-nonfinite-steps",
        ],
    );
    let o = xtrain(&refs(&a));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("xtrain: skipped 3 of 4 steps"), "{err}");
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(m.matches("\"nonfinite\":true").count(), 3, "{m}");
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skipping_every_step_fails_and_writes_no_adapter() {
    let dir = tempdir("rel-skip-all");
    let model = fixtures().join("model");
    let out = dir.join("out");
    let a = train_on(
        &model,
        &out,
        &["--lr", "1e30", "--steps", "4", "--skip-nonfinite-steps"],
    );
    let e = fails_after_notes(&refs(&a));
    assert!(e.contains("xtrain: skipped 4 of 4 steps"), "{e}");
    assert!(
        e.contains("error: every step of the run was skipped (4 of 4): nothing was trained, so no adapter is written"),
        "{e}"
    );
    assert!(!out.join("adapter").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Like [`fails`], for an error that follows what the run said while it ran: one `error: `
/// line, no panic.
fn fails_after_notes(args: &[&str]) -> String {
    let o = xtrain(args);
    let err = stderr_of(&o);
    assert!(!o.status.success(), "expected a failure: {args:?}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.matches("error: ").count(), 1, "{err}");
    err
}

#[test]
fn generate_refuses_non_finite_logits_instead_of_printing_nul_bytes() {
    let dir = tempdir("rel-generate-nan");
    let model = tiny_text_model(&dir);
    let adapter = dir.join("nan-adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let init = fixtures().join("adapter_init");
    std::fs::copy(
        init.join("adapter_config.json"),
        adapter.join("adapter_config.json"),
    )
    .unwrap();
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&init.join("adapter_model.safetensors"))
            .unwrap();
    let mut t: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    for (_, v) in t.iter_mut() {
        let n = v.to_f32().unwrap().len();
        *v = pjrt::HostTensor::from_f32(&vec![f32::NAN; n], &v.dims);
    }
    xtrain::formats::safetensors::write(
        &adapter.join("adapter_model.safetensors"),
        &t,
        &Default::default(),
    )
    .unwrap();
    let o = xtrain(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompt",
        "hello",
        "--raw",
        "--context",
        "16",
    ]);
    let err = stderr_of(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.starts_with("error: ") && !err.contains("panicked"),
        "{err}"
    );
    assert!(
        err.contains("next-token logits after 5 tokens are not finite (NaN)"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "nothing printed: {:?}", o.stdout);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn text_run(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut c = train_cmd(model, data, out);
    c.args([
        "--steps",
        "60",
        "--batch-size",
        "2",
        "--seq",
        "48",
        "--lr",
        "1e-3",
        "--lora-r",
        "4",
        "--lora-dropout",
        "0.1",
        "--save-every",
        "1",
        "--seed",
        "3",
        "--log-every",
        "0",
        "--no-plot",
    ]);
    c.args(extra);
    c
}

fn dataset(dir: &Path) -> PathBuf {
    let p = dir.join("d.jsonl");
    let s: String = (0..30)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    std::fs::write(&p, s).unwrap();
    p
}

fn latest_checkpoint(out: &Path) -> Option<PathBuf> {
    std::fs::read_dir(out)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("checkpoint-")
                && p.join("trainer_state.json").is_file()
        })
        .max_by_key(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .trim_start_matches("checkpoint-")
                .parse::<u64>()
                .unwrap_or(0)
        })
}

#[test]
fn runs_are_deterministic_and_survive_sigkill_and_sigterm() {
    let dir = tempdir("rel-kill");
    let model = tiny_text_model(&dir);
    let data = dataset(&dir);
    // Two uninterrupted runs: the same bytes.
    let (a, b) = (dir.join("a"), dir.join("b"));
    assert!(text_run(&model, &data, &a, &[]).status().unwrap().success());
    assert!(text_run(&model, &data, &b, &[]).status().unwrap().success());
    let adapter = |d: &Path| std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(adapter(&a), adapter(&b), "CPU runs are deterministic");
    let losses = |d: &Path| -> Vec<String> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter(|l| l.contains("\"loss\""))
            .map(String::from)
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(&l).unwrap();
                format!("{} {}", v["step"], v["loss"])
            })
            .collect()
    };
    assert_eq!(losses(&a), losses(&b));

    // Killed with SIGKILL at several points, resumed each time from the latest checkpoint.
    let k = dir.join("killed");
    let mut kills = 0;
    for delay_ms in [350u64, 500, 420, 600] {
        // A run killed before its first checkpoint is started again (afresh: --overwrite).
        let mut cmd = match latest_checkpoint(&k) {
            Some(c) => text_run(&model, &data, &k, &["--resume", c.to_str().unwrap()]),
            None => text_run(&model, &data, &k, &["--overwrite"]),
        };
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
    }
    // SIGTERM: a checkpoint is saved and the process exits with 130.
    let mut cmd = match latest_checkpoint(&k) {
        Some(c) => text_run(&model, &data, &k, &["--resume", c.to_str().unwrap()]),
        None => text_run(&model, &data, &k, &["--overwrite"]),
    };
    let before = latest_checkpoint(&k);
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the run to be under way (a new checkpoint appears), then ask it to stop.
    let t0 = std::time::Instant::now();
    while latest_checkpoint(&k) == before && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    unsafe_kill(child.id(), 15);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() == Some(130) || o.status.success(),
        "SIGTERM: {:?} {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{err}");
    // Finish.
    let c = latest_checkpoint(&k).expect("some checkpoint");
    let o = text_run(&model, &data, &k, &["--resume", c.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(kills >= 1, "at least one run was killed mid-way");
    assert_eq!(
        adapter(&k),
        adapter(&a),
        "the same final adapter after {kills} kills and a SIGTERM"
    );
    assert_eq!(losses(&k), losses(&a), "the same losses");
    // No temp files left behind.
    let leftovers: Vec<String> = std::fs::read_dir(&k)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(
        leftovers.iter().all(|n| n.starts_with('.')),
        "{leftovers:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn unsafe_kill(pid: u32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn a_plugin_with_an_old_pjrt_api_is_refused_naming_both_versions() {
    // A shared object whose GetPjrtApi reports API 0.20: built here with the system C compiler.
    let dir = tempdir("rel-oldapi");
    let c = dir.join("old.c");
    std::fs::write(
        &c,
        "#include <stddef.h>\n\
         struct V { size_t s; void* e; int major; int minor; };\n\
         struct Api { size_t struct_size; void* ext; struct V v; void* fns[8]; };\n\
         static struct Api api = { sizeof(struct Api), 0, { sizeof(struct V), 0, 0, 20 }, {0} };\n\
         const struct Api* GetPjrtApi(void) { return &api; }\n",
    )
    .unwrap();
    let so = dir.join("libold_pjrt.so");
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .status()
        .expect("a C compiler (cc)")
        .success();
    assert!(ok);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &["--plugin", so.to_str().unwrap()],
    )));
    assert!(
        e.contains("speaks PJRT C API 0.20, but xtrain needs 0.40 or newer"),
        "{e}"
    );
    assert!(e.contains("(xtrain was written against 0.81)"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- lost or mixed output

/// A pid that no process has now: a child that has exited and been waited for.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

fn stderr_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

fn adapter_rank(dir: &Path) -> i64 {
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    c["r"].as_i64().unwrap()
}

#[test]
fn a_run_dir_is_continued_only_with_resume_and_replaced_only_with_overwrite() {
    let dir = tempdir("rel-outdir");
    let model = fixtures().join("model");
    let out = dir.join("run");
    let o = xtrain(&refs(&train_on(&model, &out, &["--save-every", "1"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let first = names(&out);
    // Another run into the same --out: refused, naming the way to continue, nothing touched.
    let mut a = train_on(&model, &out, &["--steps", "1"]);
    let r = a.iter().position(|s| s == "--lora-r").unwrap();
    a[r + 1] = "8".into();
    let e = fails(&refs(&a));
    assert!(e.contains("holds a previous run"), "{e}");
    assert!(
        e.contains(&format!("--resume {}", out.join("checkpoint-2").display())),
        "{e}"
    );
    assert_eq!(names(&out), first, "nothing written or removed");
    assert_eq!(adapter_rank(&out.join("checkpoint-1")), 4);
    // With --overwrite: a clean r=8 run, none of the r=4 checkpoints left beside it.
    a.push("--overwrite".into());
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(names(&out), vec!["adapter", "metrics.jsonl", "tensorboard"]);
    assert_eq!(adapter_rank(&out.join("adapter")), 8);
    // An --overwrite run stopped early keeps the replaced files aside; the run resuming it
    // deletes them when it completes.
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--overwrite", "--steps", "2", "--stop-after", "1"],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(names(&out).iter().any(|n| n.starts_with(".replaced-")));
    let ckpt = out.join("checkpoint-1");
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--resume", ckpt.to_str().unwrap()],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("deleted when this run completes"), "{err}");
    assert!(
        names(&out).iter().all(|n| !n.starts_with(".replaced-")),
        "{:?}",
        names(&out)
    );
    // A directory holding something else is refused; its files are left alone.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let e = fails(&refs(&train_on(&model, &other, &[])));
    assert!(
        e.contains("holds files that are not a training run's (notes.txt)"),
        "{e}"
    );
    assert_eq!(names(&other), vec!["notes.txt"]);
    // Another run's checkpoint resumed into a dir holding a run: refused, nothing mixed.
    let third = dir.join("third");
    let o = xtrain(&refs(&train_on(&model, &third, &["--save-every", "1"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--resume", third.join("checkpoint-1").to_str().unwrap()],
    )));
    assert!(e.contains("holds another run than the one --resume"), "{e}");
    // --overwrite and --resume together make no sense.
    let ckpt = dir.join("run2");
    let e = fails(&refs(&train_on(
        &model,
        &ckpt,
        &[
            "--overwrite",
            "--resume",
            out.join("adapter").to_str().unwrap(),
        ],
    )));
    assert!(e.contains("--resume"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn one_run_at_a_time_in_a_dir_and_a_killed_runs_leftovers_are_removed() {
    let dir = tempdir("rel-lock");
    let model = fixtures().join("model");
    let out = dir.join("run");
    // Leftovers of killed runs, as write_atomic and write_dir_atomic name them.
    std::fs::create_dir_all(&out).unwrap();
    let pid = dead_pid();
    let leftover = out.join(format!(".checkpoint-3.tmp-{pid}"));
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(out.join(format!(".loss.png.tmp-{pid}")), "x").unwrap();
    let mut first = xtrain_cmd()
        .args(train_on(&model, &out, &["--steps", "100000"]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !out.join(".xtrain-run").is_file() && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let e = fails(&refs(&train_on(&model, &out, &["--overwrite"])));
    assert!(
        e.contains(&format!("another xtrain run (pid {})", first.id())),
        "{e}"
    );
    // The first run is killed: its lock goes with it, and the next run is not blocked.
    first.kill().unwrap();
    let o = first.wait_with_output().unwrap();
    let err = stderr_of(&o);
    assert!(
        err.contains(&format!("removed {}", leftover.display())) && err.contains("killed run"),
        "{err}"
    );
    assert!(!leftover.exists());
    let o = xtrain(&refs(&train_on(&model, &out, &["--overwrite"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(
        names(&out).iter().all(|n| !n.contains(".tmp-")),
        "{:?}",
        names(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stop_after_writes_the_checkpoint_it_stops_at() {
    let dir = tempdir("rel-stop");
    let model = fixtures().join("model");
    let out = dir.join("run");
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--steps", "4", "--stop-after", "3"],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    let ckpt = out.join("checkpoint-3");
    assert!(ckpt.join("trainer_state.json").is_file(), "{err}");
    assert!(
        err.contains(&format!(
            "continue with `xtrain train --resume {}`",
            ckpt.display()
        )),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merge_and_import_refuse_a_dir_that_holds_something_and_replace_it_whole_on_overwrite() {
    let dir = tempdir("rel-merge-out");
    let model = fixtures().join("model");
    let adapter = fixtures().join("adapter_init");
    let merge = |out: &Path, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["merge", "--model", model.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(["--adapter".into(), adapter.to_str().unwrap().into()]);
        v.extend(["--out".into(), out.to_str().unwrap().into()]);
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    // A training run's directory: refused, nothing deleted.
    let run = dir.join("run");
    std::fs::create_dir_all(run.join("checkpoint-5")).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
    let e = fails(&refs(&merge(&run, &[])));
    assert!(
        e.contains("is not empty") && e.contains("--overwrite"),
        "{e}"
    );
    assert_eq!(names(&run), vec!["checkpoint-5", "metrics.jsonl"]);
    // `target/.`: the same refusal, nothing deleted.
    let target = dir.join("target");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("keep.txt"), "x").unwrap();
    let dot = format!("{}/.", target.display());
    let e = fails(&refs(&merge(Path::new(&dot), &[])));
    assert!(e.contains("is not empty"), "{e}");
    assert_eq!(names(&target), vec!["keep.txt"]);
    // The model it reads: refused even with --overwrite.
    let e = fails(&refs(&merge(&model, &["--overwrite"])));
    assert!(e.contains("which this command reads"), "{e}");
    // A sharded model: refused; with --overwrite replaced whole (no index left to win), and a
    // killed merge's leftover beside it removed.
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    for f in std::fs::read_dir(fixtures().join("model_sharded")).unwrap() {
        let p = f.unwrap().path();
        std::fs::copy(&p, sharded.join(p.file_name().unwrap())).unwrap();
    }
    let e = fails(&[
        "import-gguf",
        "/nonexistent/model.gguf",
        "--out",
        sharded.to_str().unwrap(),
    ]);
    assert!(e.contains("is not empty"), "{e}");
    let stale = dir.join(format!(".sharded.tmp-{}", dead_pid()));
    std::fs::create_dir_all(&stale).unwrap();
    let o = xtrain(&refs(&merge(Path::new(&dot), &["--overwrite"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(names(&target).contains(&"model.safetensors".to_string()));
    assert!(!target.join("keep.txt").exists());
    let o = xtrain(&refs(&merge(&sharded, &["--overwrite"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(
        stderr_of(&o).contains("left by a killed run"),
        "{}",
        stderr_of(&o)
    );
    assert!(!stale.exists());
    assert!(!sharded.join("model.safetensors.index.json").exists());
    assert!(sharded.join("model.safetensors").is_file());
    let leftovers: Vec<String> = names(&dir)
        .into_iter()
        .filter(|n| n.contains(".tmp-") || n.contains(".old-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- silent wrong results

#[test]
fn resume_takes_the_checkpoints_settings_and_refuses_contradictions() {
    let dir = tempdir("rel-resume-settings");
    let model = fixtures().join("model");
    // A copy of the batch, changed below to show that other data at the same path is refused.
    let batch = dir.join("batch.safetensors");
    std::fs::copy(fixtures().join("inputs.safetensors"), &batch).unwrap();
    let run = |out: &Path, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["train", "--model", model.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(["--data".into(), batch.to_str().unwrap().into()]);
        v.extend(["--out".into(), out.to_str().unwrap().into()]);
        v.extend(
            ["--log-every", "0", "--no-plot"]
                .iter()
                .map(|s| s.to_string()),
        );
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let flags = [
        "--steps",
        "4",
        "--lr",
        "1e-3",
        "--schedule",
        "cosine",
        "--lora-r",
        "4",
        "--lora-alpha",
        "16",
        "--lora-dropout",
        "0.1",
        "--weight-decay",
        "0.01",
        "--seed",
        "5",
    ];
    let full = dir.join("full");
    let o = xtrain(&refs(&run(&full, &flags)));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let part = dir.join("part");
    let mut a = run(&part, &flags);
    a.extend(["--stop-after".to_string(), "2".to_string()]);
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let ckpt = part.join("checkpoint-2");
    let c = ckpt.to_str().unwrap();
    // A flag given with another value than the checkpoint's: refused, naming both.
    let e = fails(&refs(&run(&part, &["--resume", c, "--lora-alpha", "32"])));
    assert!(
        e.contains("run has --lora-alpha 16, but the command line gives --lora-alpha 32"),
        "{e}"
    );
    let e = fails(&refs(&run(&part, &["--resume", c, "--steps", "9"])));
    assert!(e.contains("--steps 4") && e.contains("--steps 9"), "{e}");
    // Every flag left out: the checkpoint's values, and the same result as the uninterrupted run
    // (the cosine schedule over 4 steps, not an lr of 0 over a 1-step "epoch").
    let o = xtrain(&refs(&run(&part, &["--resume", c])));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("taking") && err.contains("--lora-alpha 16"),
        "{err}"
    );
    let bytes = |d: &Path| std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(
        bytes(&full),
        bytes(&part),
        "the resumed run is the uninterrupted one"
    );
    // Other data than the checkpoint's run saw: refused.
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&fixtures().join("inputs.safetensors"))
            .unwrap();
    let mut t: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    let mut ids = t["input_ids"].to_i64().unwrap();
    ids[3] = (ids[3] + 1) % 512;
    t.insert(
        "input_ids".into(),
        pjrt::HostTensor::from_i64(&ids, &[2, 16]),
    );
    xtrain::formats::safetensors::write(&batch, &t, &Default::default()).unwrap();
    let o = xtrain(&refs(&run(&part, &["--resume", c])));
    assert!(!o.status.success());
    assert!(
        stderr_of(&o).contains("error: checkpoint"),
        "{}",
        stderr_of(&o)
    );
    assert!(
        stderr_of(&o).contains("was trained on other data"),
        "{}",
        stderr_of(&o)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_program_dir_fixes_its_flags() {
    let dir = tempdir("rel-program-flags");
    let model = fixtures().join("model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    // --lora-r 8 against a program built for r=4: refused, naming both.
    let mut a = train_on(
        &model,
        &dir.join("a"),
        &["--program", prog.to_str().unwrap()],
    );
    let r = a.iter().position(|s| s == "--lora-r").unwrap();
    a[r + 1] = "8".into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("was built with --lora-r 4, but the command line gives --lora-r 8"),
        "{e}"
    );
    // A form of the program other than its own: refused too (left out, the flag takes what
    // the program has).
    let mut b = a.clone();
    b[r + 1] = "4".into();
    b.extend(["--keep-softmax-stats".into(), "true".into()]);
    let e = fails(&refs(&b));
    assert!(
        e.contains(
            "was built with --keep-softmax-stats false, but the command line gives --keep-softmax-stats true"
        ),
        "{e}"
    );
    // A remat policy other than the program's (layer: `auto` is layer where the memory is not
    // known) is refused too; `--remat auto` takes the program's.
    let mut c = a.clone();
    c[r + 1] = "4".into();
    c.extend(["--remat".into(), "save-proj".into()]);
    let e = fails(&refs(&c));
    assert!(
        e.contains("was built with --remat layer, but the command line gives --remat save-proj"),
        "{e}"
    );
    // Left out, the rank is the program's.
    a.drain(r..r + 2);
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(adapter_rank(&dir.join("a/adapter")), 4);
    // Compiling into it again needs --overwrite.
    let e = fails(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(e.contains("is not empty"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_flag_is_range_checked_before_any_work() {
    let dir = tempdir("rel-ranges");
    let model = tiny_text_model(&dir);
    let m = model.to_str().unwrap();
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello\"}\n").unwrap();
    let out = dir.join("out");
    let train = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["train", "--model", m, "--data", data.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(["--out".into(), out.to_str().unwrap().into()]);
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    for (flags, message) in [
        (&["--lr", "nan"][..], "--lr must be a number >= 0, got NaN"),
        (&["--lr=-1"][..], "--lr must be a number >= 0"),
        (
            &["--eval-fraction", "1.5"][..],
            "--eval-fraction must be in [0, 1), got 1.5",
        ),
        (
            &["--lora-alpha", "0"][..],
            "--lora-alpha must be a positive number, got 0",
        ),
        (
            &["--loss-chunk", "0"][..],
            "--loss-chunk 0 must be a positive divisor",
        ),
        (
            &["--batch-size", "0"][..],
            "--batch-size must be at least 1, got 0",
        ),
        (&["--seq=-1"][..], "--seq must be at least 2"),
        (&["--epochs", "0"][..], "--epochs must be at least 1"),
        (&["--eps", "0"][..], "--eps must be a positive number"),
        (
            &["--min-lr-ratio", "2"][..],
            "--min-lr-ratio must be in [0, 1]",
        ),
        (
            &["--stop-after", "0"][..],
            "--stop-after must be at least 1",
        ),
        (
            &["--schedule", "cosin"][..],
            "--schedule must be constant, linear or cosine",
        ),
        (
            &["--mesh", "fdsp=8"][..],
            "unknown axis `fdsp` (did you mean `fsdp`?)",
        ),
        (&["--mesh", "dp=2"][..], "unknown axis `dp`"),
        (&["--mesh", "fsdp=8,model=8"][..], "unknown axis `model`"),
        (
            &["--eval-fraction", "0.1", "--eval-data", "x.jsonl"][..],
            "--eval-fraction and --eval-data were both given",
        ),
        (
            &["--sharding-rules", "rules.txt"][..],
            "places tensors on a mesh: give --mesh too",
        ),
    ] {
        let e = fails(&refs(&train(flags)));
        assert!(e.contains(message), "{flags:?}: {e}");
        assert!(!out.exists(), "{flags:?}: nothing written");
    }
    let generate = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["generate", "--model", m, "--prompt", "hi"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    for (flags, message) in [
        (
            &["--temperature", "nan"][..],
            "--temperature must be a number >= 0",
        ),
        (
            &["--temperature=-1"][..],
            "--temperature must be a number >= 0",
        ),
        (&["--context", "0"][..], "--context must be at least 2"),
        (&["--context=-4"][..], "got -4"),
    ] {
        let e = fails(&refs(&generate(flags)));
        assert!(e.contains(message), "{flags:?}: {e}");
    }
    // compile: the batch, a mesh that splits nothing, unknown rule names, and NF4 on a model
    // whose projections are not whole blocks of 64.
    let odd = dir.join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    let mut c: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("model/config.json")).unwrap(),
    )
    .unwrap();
    c["hidden_size"] = 36.into();
    c["intermediate_size"] = 36.into();
    c["num_attention_heads"] = 4.into();
    c["num_key_value_heads"] = 4.into();
    c["head_dim"] = 10.into();
    std::fs::write(odd.join("config.json"), c.to_string()).unwrap();
    let rules = dir.join("rules.txt");
    std::fs::write(&rules, "batchh = data\n").unwrap();
    let prog = dir.join("prog");
    for (flags, message) in [
        (
            &["--model", "tiny-llama3", "--batch", "0"][..],
            "--batch must be at least 1, got 0",
        ),
        (
            &["--model", "tiny-llama3", "--batch", "4", "--mesh", "data=3"][..],
            "--mesh data=3 splits nothing",
        ),
        (
            &[
                "--model",
                "tiny-llama3",
                "--mesh",
                "data=2",
                "--sharding-rules",
                rules.to_str().unwrap(),
            ][..],
            "unknown logical axis `batchh` (did you mean `batch`?)",
        ),
        (
            &["--model", odd.to_str().unwrap(), "--quant", "nf4"][..],
            "--quant nf4 quantizes in blocks of 64 values",
        ),
    ] {
        let mut a = vec!["compile"];
        a.extend(flags);
        a.extend(["--out", prog.to_str().unwrap()]);
        let e = fails(&a);
        assert!(e.contains(message), "{flags:?}: {e}");
        assert!(!prog.exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_nonfinite_guard_covers_the_updated_state() {
    let dir = tempdir("rel-nonfinite-update");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // lr 1e38 is finite, and so are step 1's loss and gradient; lr / (1 - beta1) is not (f32).
    let e = fails(&refs(&train_on(&model, &out, &["--lr", "1e38"])));
    assert!(
        e.contains("step 1: the loss") && e.contains("but the update is not"),
        "{e}"
    );
    let ckpt = out.join("checkpoint-0");
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&ckpt.join("adapter_model.safetensors"))
            .unwrap();
    for name in st.tensors.keys() {
        let v = st.read(name).unwrap().to_f32().unwrap();
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{name}: the last good state is finite"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn evaluation_examples_are_counted_and_data_quirks_are_handled() {
    let dir = tempdir("rel-eval");
    let model = tiny_text_model(&dir);
    let run = |data: &Path, out: &str, extra: &[&str]| -> std::process::Output {
        let mut c = train_cmd(&model, data, &dir.join(out));
        c.args([
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--seq",
            "64",
            "--lora-r",
            "4",
        ]);
        c.args(["--log-every", "0", "--no-plot"]);
        c.args(extra);
        c.output().unwrap()
    };
    let train = dir.join("train.jsonl");
    let lines: String = (0..94)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    // A byte order mark before the first line: read as JSON, not skipped.
    std::fs::write(&train, format!("\u{feff}{lines}")).unwrap();
    let o = run(
        &train,
        "bom",
        &["--skip-bad-lines", "--eval-fraction", "0.01"],
    );
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("skipped"), "{err}");
    assert!(err.contains("holding out 1 of 94 examples"), "{err}");
    // Held-out examples whose answer does not fit --seq: counted, not silently dropped; and with
    // --strict-length, refused.
    let eval = dir.join("eval.jsonl");
    let long = "x".repeat(80);
    std::fs::write(
        &eval,
        format!("{{\"instruction\": \"{long}\", \"output\": \"y\"}}\n{{\"instruction\": \"a\", \"output\": \"b\"}}\n"),
    )
    .unwrap();
    let o = run(&train, "eval", &["--eval-data", eval.to_str().unwrap()]);
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("eval: left out 1 of 2 examples with no target token within --seq 64"),
        "{err}"
    );
    let o = run(
        &train,
        "strict",
        &["--eval-data", eval.to_str().unwrap(), "--strict-length"],
    );
    let err = stderr_of(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("(evaluation examples)") && err.contains("more than --seq 64"),
        "{err}"
    );
    // --eval-data with a pre-tokenized batch: evaluated, not ignored.
    let short = dir.join("short.jsonl");
    std::fs::write(&short, "{\"text\": \"ab\"}\n").unwrap();
    let batch = fixtures().join("inputs.safetensors");
    let o = train_cmd(&model, &batch, &dir.join("batch"))
        .args([
            "--steps",
            "1",
            "--lora-r",
            "4",
            "--log-every",
            "0",
            "--no-plot",
        ])
        .args(["--eval-data", short.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    let m = std::fs::read_to_string(dir.join("batch/metrics.jsonl")).unwrap();
    assert!(m.contains("eval_loss"), "{m}");
    // ... and --batch-size or --seq that contradict the batch's shape are refused.
    let o = run(&batch, "batch2", &[]);
    assert!(!o.status.success());
    assert!(
        stderr_of(&o).contains("is one pre-tokenized batch of 2x16"),
        "{}",
        stderr_of(&o)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_config_with_fewer_layers_than_its_checkpoint_is_refused() {
    let dir = tempdir("rel-layers");
    let m = tiny_dir(&dir, "fewer");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    c["num_hidden_layers"] = 1.into();
    std::fs::write(m.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("the checkpoint has 2 layers") && e.contains("num_hidden_layers = 1"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_says_when_it_stops_at_the_context_limit() {
    let dir = tempdir("rel-generate");
    let model = tiny_text_model(&dir);
    let o = xtrain(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hello",
        "--raw",
        "--context",
        "8",
        "--max-new-tokens",
        "100",
    ]);
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("stopped at the context limit"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- signals and environment

#[test]
fn a_second_ctrl_c_ends_the_run_at_once() {
    let dir = tempdir("rel-sigint");
    let model = tiny_text_model(&dir);
    // Enough examples that reading them takes a while: the first Ctrl-C waits for that phase to
    // end, the second must not.
    let data = dir.join("big.jsonl");
    let lines: String = (0..100_000)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let out = dir.join("run");
    let child = train_cmd(&model, &data, &out)
        .args(["--seq", "32", "--batch-size", "1", "--lora-r", "4"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !out.join(".xtrain-run").is_file() && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    unsafe_kill(child.id(), 2);
    std::thread::sleep(std::time::Duration::from_millis(50));
    unsafe_kill(child.id(), 2);
    let t1 = std::time::Instant::now();
    let o = child.wait_with_output().unwrap();
    let err = stderr_of(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        !err.contains("interrupted before"),
        "the second signal, not the end of the phase, ended it: {err}"
    );
    assert!(t1.elapsed().as_secs() < 5, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn without_home_nothing_is_written_to_the_working_directory() {
    let dir = tempdir("rel-home");
    // The CPU plugin is looked up in (or installed into) the cache; the check compiles with it.
    let o = xtrain_cmd()
        .args([
            "compile",
            "--model",
            "tiny-llama3",
            "--batch",
            "1",
            "--seq",
            "16",
        ])
        .args([
            "--lora-r", "4", "--out", "prog", "--check", "--plugin", "cpu",
        ])
        .env_remove("HOME")
        .env_remove("XDG_CACHE_HOME")
        .env_remove("XTRAIN_CACHE_DIR")
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(
        !dir.join(".cache").exists(),
        "no ./.cache in the working directory"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_list_form_chat_template_is_used_not_replaced_by_chatml() {
    let dir = tempdir("rel-template-list");
    let model = tiny_text_model(&dir);
    let cfg = serde_json::json!({
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "default", "template": "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"}
        ],
        "eos_token": "<|im_end|>"
    });
    std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = xtrain::data::text::TextTokenizer::load(&model).unwrap();
    let msg = xtrain::data::text::Message {
        role: "user".into(),
        content: "hi".into(),
    };
    assert_eq!(tok.render_chat(&[msg], false).unwrap(), "[user: hi]");
    // A list without a `default` is refused, as transformers refuses it.
    let cfg = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "x"}]});
    std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let e = format!(
        "{:#}",
        xtrain::data::text::TextTokenizer::load(&model)
            .err()
            .unwrap()
    );
    assert!(e.contains("none named `default`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A program dir compiled for the fixture model at batch 2 x 16, r=4 (`extra`: more flags).
fn program_dir(dir: &Path, extra: &[&str]) -> std::path::PathBuf {
    let prog = dir.join("prog");
    let model = fixtures().join("model");
    let mut args = vec![
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--out",
        prog.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = xtrain(&args);
    assert!(o.status.success(), "{}", stderr_of(&o));
    prog
}

/// An edited manifest (here another LoRA alpha, which the program text has built in) is refused
/// naming what was edited, rather than trained with the text's alpha and recorded with the
/// manifest's; so is a program dir of another manifest format.
#[test]
fn an_edited_manifest_is_refused() {
    let dir = tempdir("rel-edited-manifest");
    let prog = program_dir(&dir, &[]);
    let model = fixtures().join("model");
    let path = prog.join("manifest.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&original).unwrap();
    assert_eq!(m["spec"]["lora"]["alpha"].as_f64(), Some(32.0));
    m["spec"]["lora"]["alpha"] = 8.0.into();
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let out = dir.join("run");
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(
        e.contains("manifest.json was edited after `xtrain compile` wrote it")
            && e.contains("Compile again"),
        "{e}"
    );
    assert!(!out.join("adapter").exists());
    // The manifest as written trains.
    std::fs::write(&path, &original).unwrap();
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    // A manifest of the first format (one build, no settings hash).
    let mut old: serde_json::Value = serde_json::from_str(&original).unwrap();
    old["format"] = "xtrain-program/1".into();
    std::fs::write(&path, old.to_string()).unwrap();
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run2"),
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(
        e.contains("format xtrain-program/1 is not xtrain-program/2")
            && e.contains("compile the program dir again"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPU program dir that keeps values in host memory, trained on the CPU, is refused by name
/// before XLA sees it (which said only "UNIMPLEMENTED: Side-effect ops cannot be replicated");
/// the same for `train --offload` and `compile --check --offload` on the CPU.
#[test]
fn an_offloaded_program_dir_is_refused_on_the_cpu_by_name() {
    let dir = tempdir("rel-offload-cpu");
    let prog = program_dir(&dir, &["--mesh", "fsdp=2", "--offload", "activations"]);
    let model = fixtures().join("model");
    let want = "keeps values in host memory (--offload activations), but XLA's CPU compiler cannot place values in host memory";
    // (after the line that says which flags the program dir fixed)
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    )));
    let e = stderr_of(&o);
    assert!(!o.status.success() && !e.contains("panicked"), "{e}");
    assert!(
        e.contains(&format!("error: program dir {}", prog.display()))
            && e.contains(want)
            && e.contains("--offload none"),
        "{e}"
    );
    assert!(!e.contains("Side-effect"), "{e}");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run2"),
        &["--offload", "activations"],
    )));
    assert!(e.contains(want), "{e}");
    let e = fails(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--offload",
        "activations",
        "--check",
        "--out",
        dir.join("p2").to_str().unwrap(),
    ]);
    assert!(e.contains(want), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Flags of `compile` that only mean something when it compiles (`--check`) are refused without
/// it, instead of being silently ignored.
#[test]
fn compile_flags_that_need_check_are_refused() {
    let dir = tempdir("rel-compile-check-flags");
    let out = dir.join("p");
    for (flags, message) in [
        (
            &["--xla-dump", "dump"][..],
            "--xla-dump dump writes what XLA's compiler made of the program, which runs only with --check",
        ),
        (
            &["--no-estimate"][..],
            "--no-estimate skips the TPU estimate of --check; without --check there is none",
        ),
        (
            &["--no-estimate", "--check", "--target", "cuda:h100:1"][..],
            "--no-estimate is for --check with a TPU --target",
        ),
        (
            &["--plugin", "cuda", "--target", "cuda:h100:1"][..],
            "--plugin names the plugin that compiles the program with --check",
        ),
        (
            &["--target", "cuda:h100:1", "--target", "cuda:h100:1"][..],
            "--target cuda:h100:1 is given twice",
        ),
        (
            &["--target", "cuda:h100:1", "--target", "tpu:v5p:2x2x1"][..],
            "--target cuda:h100:1 has 1 devices but --target tpu:v5p:2x2x1 has 4",
        ),
    ] {
        let mut args = vec!["compile", "--model", "tiny-llama3", "--out", out.to_str().unwrap()];
        args.extend(flags);
        let e = fails(&args);
        assert!(e.contains(message), "{flags:?}: {e}");
        assert!(!out.exists(), "{flags:?}: nothing is written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GPU recipe run on a machine where the CUDA plugin sees no GPU (here with
/// CUDA_VISIBLE_DEVICES empty) gets the plugin's error with what to do instead (compile for the
/// GPU, or train on the CPU), and none of the plugin's absl log lines unless -v.
#[test]
fn a_gpu_recipe_without_a_gpu_says_to_compile_for_it_or_train_on_the_cpu() {
    let dir = tempdir("rel-no-gpu");
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/llama-3.1-8b-h100.toml");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello there\"}\n".repeat(60)).unwrap();
    let run = |verbose: bool| {
        let mut c = xtrain_cmd();
        if verbose {
            c.arg("-v");
        }
        let o = c
            .arg("train")
            .arg("--config")
            .arg(&recipe)
            .arg("--model")
            .arg(&model)
            .arg("--data")
            .arg(&data)
            .args(["--no-pack", "--out"])
            .arg(dir.join("run"))
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let all = run(false);
    // Notes on the run's setup come first (the recipe keys the command line overrides, the
    // held-out examples), one `xtrain: ` line each; then the error, alone.
    let (notes, err) = all.rsplit_once("\n").map_or(("", all.as_str()), |(a, b)| {
        if b.is_empty() {
            a.rsplit_once('\n').unwrap_or(("", a))
        } else {
            (a, b)
        }
    });
    for line in notes.lines() {
        assert!(line.starts_with("xtrain: "), "{all}");
    }
    assert!(
        err.starts_with("error: cannot create a client for "),
        "{all}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains(
            "If this machine has no cuda GPU: compile for one with `xtrain compile --target \
             cuda:<name>:<count> --check`"
        ) && err.contains("or train here on the CPU with --plugin cpu"),
        "{err}"
    );
    assert!(
        !err.contains("InitializeLog") && !err.contains("cuda drivers"),
        "no absl lines: {err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // -v shows them.
    let verbose = run(true);
    assert!(verbose.lines().count() > all.lines().count(), "{verbose}");
    assert!(!dir.join("run/adapter").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `xtrain targets tpu:v5e` (a TPU asked for as a GPU description) says that TPUs need none
/// and shows the form a TPU target takes; an unknown generation lists the known ones.
#[test]
fn targets_of_a_tpu_says_it_needs_no_description_and_shows_its_form() {
    let o = xtrain(&["targets", "tpu:v5e"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("TPUs need no description")
            && out.contains("compile with --target tpu:v5e:<chips>")
            && !out.contains("not a built-in GPU"),
        "{out}"
    );
    let e = fails(&["targets", "tpu:v9"]);
    assert!(
        e.contains("unknown TPU generation `v9`") && e.contains("tpu:v5e:<chips>"),
        "{e}"
    );
}

/// `--grad-accum 0` is out of range, said as the other ranges are (it was "must divide the
/// batch size"), by train and compile alike.
#[test]
fn grad_accum_zero_is_out_of_range() {
    let dir = tempdir("rel-grad-accum-0");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--grad-accum", "0"],
    )));
    assert!(e.contains("--grad-accum must be at least 1, got 0"), "{e}");
    assert!(!dir.join("run").exists());
    let e = fails(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--grad-accum",
        "0",
        "--out",
        dir.join("prog").to_str().unwrap(),
    ]);
    assert!(e.contains("--grad-accum must be at least 1, got 0"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- flags and recipe keys

#[test]
fn a_flag_typed_twice_is_refused_naming_it_and_both_values() {
    let dir = tempdir("rel-twice");
    let model = fixtures().join("model");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let mut args = train_on(&model, &a, &[]);
    args.extend(["--out".to_string(), b.to_str().unwrap().to_string()]);
    let e = fails(&refs(&args));
    assert!(
        e.contains(&format!(
            "--out is given twice on the command line ({}, then {}); give it once",
            a.display(),
            b.display()
        )),
        "{e}"
    );
    assert!(!a.exists() && !b.exists(), "nothing trained");
    // A switch too.
    let e = fails(&refs(&train_on(&model, &a, &["--no-plot"])));
    assert!(
        e.contains("--no-plot is given twice on the command line"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_key_the_command_line_overrides_is_said_and_not_a_duplicate() {
    let dir = tempdir("rel-recipe-override");
    let model = fixtures().join("model");
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "lora_r = 8\nsteps = 1\n").unwrap();
    let mut args = train_on(&model, &dir.join("run"), &[]);
    args.extend(["--config".to_string(), recipe.to_str().unwrap().to_string()]);
    let o = xtrain(&refs(&args));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "--lora-r 4 on the command line overrides the recipe {}'s --lora-r 8",
            recipe.display()
        )),
        "{err}"
    );
    assert_eq!(adapter_rank(&dir.join("run/adapter")), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_table_with_lora_r_and_lora_dash_r_is_refused_naming_both_keys() {
    let dir = tempdir("rel-recipe-same-flag");
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "lora_r = 8\nlora-r = 16\n").unwrap();
    let e = fails(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--model",
        "tiny-llama3",
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    assert!(
        e.contains("keys `lora-r` and `lora_r` in the top level both set --lora-r; keep one")
            || e.contains(
                "keys `lora_r` and `lora-r` in the top level both set --lora-r; keep one"
            ),
        "{e}"
    );
    std::fs::write(&recipe, "[train]\nlora_alpha = 8\nlora-alpha = 16\n").unwrap();
    let e = fails(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--model",
        "tiny-llama3",
        "--out",
        dir.join("p").to_str().unwrap(),
    ]);
    assert!(e.contains("in [train] both set --lora-alpha"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_value_that_contradicts_a_program_dir_is_named_as_the_recipes() {
    let dir = tempdir("rel-recipe-source");
    let model = fixtures().join("model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "lora_alpha = 64\n").unwrap();
    let mut args = train_on(
        &model,
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    );
    args.extend(["--config".to_string(), recipe.to_str().unwrap().to_string()]);
    let e = fails(&refs(&args));
    assert!(
        e.contains(&format!(
            "was built with --lora-alpha 32, but the recipe {} gives --lora-alpha 64",
            recipe.display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_out_at_its_own_inputs_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-out-inputs");
    let model = tiny_text_model(&dir);
    let run = dir.join("run");
    let data = run.join("d.jsonl");
    std::fs::create_dir_all(&run).unwrap();
    let lines: String = (0..8)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    std::fs::write(&data, &lines).unwrap();
    let outside = dir.join("d.jsonl");
    std::fs::write(&outside, &lines).unwrap();
    let flags = [
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--seq",
        "32",
        "--lora-r",
        "4",
    ];
    let refused = |model: &Path, data: &Path, out: &Path, extra: &[&str], what: &Path| {
        let mut a: Vec<String> = ["train", "--model", model.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(["--data".into(), data.to_str().unwrap().into()]);
        a.extend([
            "--out".into(),
            out.to_str().unwrap().into(),
            "--overwrite".into(),
        ]);
        a.extend(flags.iter().chain(extra).map(|s| s.to_string()));
        let before = names(out);
        let e = fails(&refs(&a));
        assert!(
            e.contains("which this command reads; choose another --out")
                && e.contains(&what.display().to_string()),
            "{e}"
        );
        assert_eq!(names(out), before, "nothing moved");
    };
    // The dir that holds --data.
    refused(&model, &data, &run, &[], &data);
    // The model dir.
    refused(&model, &outside, &model, &[], &model);
    // The dir that holds --eval-data.
    refused(
        &model,
        &outside,
        &run,
        &["--eval-data", data.to_str().unwrap()],
        &data,
    );
    // A run dir whose adapter is --init-adapter.
    let o = xtrain(&refs(&{
        let mut a: Vec<String> = ["train", "--model", model.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(["--data".into(), outside.to_str().unwrap().into()]);
        a.extend(["--out".into(), dir.join("first").to_str().unwrap().into()]);
        a.extend(flags.iter().map(|s| s.to_string()));
        a
    }));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let adapter = dir.join("first/adapter");
    refused(
        &model,
        &outside,
        &dir.join("first"),
        &["--init-adapter", adapter.to_str().unwrap()],
        &adapter,
    );
    assert!(adapter.join("adapter_model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tiny text model with `max_position_embeddings` set to `n` in its config.json.
fn model_with_max_positions(dir: &Path, n: i64) -> PathBuf {
    let model = tiny_text_model(dir);
    let path = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["max_position_embeddings"] = serde_json::json!(n);
    std::fs::write(&path, c.to_string()).unwrap();
    model
}

#[test]
fn a_seq_longer_than_the_models_max_position_embeddings_is_refused_naming_both() {
    let dir = tempdir("rel-max-positions");
    let model = model_with_max_positions(&dir, 64);
    let m = model.to_str().unwrap();
    let want = "--seq 128 is longer than the model's max_position_embeddings 64 (config.json)";
    let prog = dir.join("prog");
    let e = fails(&[
        "compile",
        "--model",
        m,
        "--batch",
        "1",
        "--seq",
        "128",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(e.contains(want), "{e}");
    assert!(!prog.exists());
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello\"}\n").unwrap();
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args(["--seq", "128", "--batch-size", "1", "--steps", "1"])
        .output()
        .unwrap();
    let e = stderr_of(&o);
    assert!(!o.status.success() && e.starts_with("error: "), "{e}");
    assert!(e.contains(want), "{e}");
    // At the limit: trains.
    let o = train_cmd(&model, &data, &out)
        .args([
            "--seq",
            "64",
            "--batch-size",
            "1",
            "--steps",
            "1",
            "--lora-r",
            "4",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generate_with_a_context_longer_than_the_models_max_position_embeddings_is_refused() {
    let dir = tempdir("rel-max-positions-generate");
    let model = model_with_max_positions(&dir, 64);
    let e = fails(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--context",
        "128",
    ]);
    assert!(
        e.contains(
            "--context 128 is longer than the model's max_position_embeddings 64 (config.json)"
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_every_without_eval_data_is_refused() {
    let dir = tempdir("rel-eval-every");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--eval-every", "20"],
    )));
    assert!(
        e.contains("--eval-every 20 (the command line) evaluates on held-out examples, but there are none: give --eval-data FILE or --eval-fraction F"),
        "{e}"
    );
    assert!(!dir.join("run").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn steps_and_epochs_both_typed_are_refused() {
    let dir = tempdir("rel-steps-epochs");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--steps", "3", "--epochs", "2"],
    )));
    assert!(
        e.contains("--steps 3 and --epochs 2 were both given (the command line): --steps sets the run's length, so --epochs would do nothing; give one of them"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn epochs_typed_over_a_recipes_steps_sets_the_length_and_says_so() {
    let dir = tempdir("rel-epochs-over-recipe");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    let lines: String = (0..6)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let recipe = dir.join("r.toml");
    std::fs::write(&recipe, "steps = 50\n").unwrap();
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args(["--config", recipe.to_str().unwrap(), "--epochs", "2"])
        .args([
            "--batch-size",
            "2",
            "--seq",
            "32",
            "--lora-r",
            "4",
            "--log-every",
            "0",
        ])
        .output()
        .unwrap();
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "--epochs 2 (the command line) sets the run's length instead of --steps 50 (the recipe {})",
            recipe.display()
        )),
        "{err}"
    );
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps = m.lines().filter(|l| l.contains("\"loss\"")).count();
    assert!(steps < 50, "two epochs, not the recipe's 50 steps: {steps}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn min_lr_ratio_with_a_constant_schedule_is_refused() {
    let dir = tempdir("rel-min-lr");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--min-lr-ratio", "0.1"],
    )));
    assert!(
        e.contains("--min-lr-ratio 0.1 (the command line) sets where a linear or cosine schedule ends, but --schedule is constant (the default)"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_warmup_longer_than_the_run_is_warned_about() {
    let dir = tempdir("rel-warmup");
    let model = fixtures().join("model");
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--warmup", "100", "--lr", "1e-3"],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("warning: --warmup 100 is longer than the run (2 steps): the learning rate rises to 2e-5 at the last step and never reaches --lr 1e-3"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_empty_mesh_is_refused() {
    let dir = tempdir("rel-empty-mesh");
    let model = fixtures().join("model");
    let e = fails(&refs(&train_on(&model, &dir.join("run"), &["--mesh", ""])));
    assert!(
        e.contains("--mesh is empty: give its axes, such as --mesh fsdp=8, or leave it out"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn log_every_0_prints_no_progress_and_its_help_says_what_it_still_prints() {
    let dir = tempdir("rel-log-every-0");
    let model = fixtures().join("model");
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--steps", "3"],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        !err.contains("step 1/") && !err.contains("loaded") && !err.contains("peak host memory"),
        "{err}"
    );
    let help = String::from_utf8_lossy(&xtrain(&["train", "--help"]).stdout).to_string();
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains("0: no progress (no bars, step lines or loading lines); evaluation results, notes on what the run sets up"),
        "{help}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_with_a_program_dir_says_which_remat_and_offload_it_took() {
    let dir = tempdir("rel-program-remat");
    let model = fixtures().join("model");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--remat",
        "save-proj",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let o = xtrain(&refs(&train_on(
        &model,
        &dir.join("run"),
        &["--program", prog.to_str().unwrap()],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "program dir {}: --remat save-proj, --offload none (as it was compiled)",
            prog.display()
        )),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_step_too_big_for_the_cpu_gives_xlas_figure_and_only_cpu_advice() {
    let dir = tempdir("rel-cpu-oom");
    let model = fixtures().join("model");
    // 4 rows of 131072 tokens (the tiny model's max_position_embeddings): attention's scores
    // alone take terabytes.
    let (b, t) = (4i64, 131072i64);
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7) % 500).collect();
    let batch = dir.join("big.safetensors");
    let tensors: std::collections::BTreeMap<String, pjrt::HostTensor> = [
        ("input_ids", pjrt::HostTensor::from_i64(&ids, &[b, t])),
        ("labels", pjrt::HostTensor::from_i64(&ids, &[b, t])),
        (
            "attention_mask",
            pjrt::HostTensor::from_i64(&vec![1; (b * t) as usize], &[b, t]),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    xtrain::formats::safetensors::write(&batch, &tensors, &Default::default()).unwrap();
    let mut a = train_on(&model, &dir.join("run"), &["--steps", "1"]);
    let d = a.iter().position(|s| s == "--data").unwrap();
    a[d + 1] = batch.to_str().unwrap().into();
    let e = fails(&refs(&a));
    let advice = e.split("(the plugin said").next().unwrap();
    assert!(
        advice.contains("the training step does not fit the device: it needs at least ")
            && advice.contains(" GiB per device (XLA could not allocate a buffer of that size)"),
        "{e}"
    );
    // XLA's figure, not the arguments' few MiB.
    let at = advice.find("at least ").unwrap() + "at least ".len();
    let gib: f64 = advice[at..].split(' ').next().unwrap().parse().unwrap();
    assert!(gib > 100.0, "{e}");
    assert!(
        !advice.contains("--offload") && !advice.contains("--mesh"),
        "the CPU plugin can neither offload nor add memory with more devices: {e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `--target` typed over a recipe's replaces it (said as an override) rather than joining it:
/// `--target` may be repeated, so keeping both would compile for the recipe's hardware too.
#[test]
fn a_target_typed_over_a_recipes_replaces_it() {
    let dir = tempdir("rel-recipe-target");
    let recipe = dir.join("r.toml");
    std::fs::write(
        &recipe,
        "model = \"tiny-llama3\"\nbatch_size = 4\nseq = 64\n[compile]\ntarget = \"tpu:v5p:2x2x1\"\n",
    )
    .unwrap();
    let out = dir.join("p");
    let o = xtrain(&[
        "compile",
        "--config",
        recipe.to_str().unwrap(),
        "--target",
        "cuda:h100:4",
        "--out",
        out.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("--target cuda:h100:4 on the command line overrides the recipe"),
        "{stderr}"
    );
    assert!(stdout.contains("target cuda:h100:4: 4 devices"), "{stdout}");
    assert!(!stdout.contains("tpu:v5p"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

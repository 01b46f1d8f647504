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
        e.contains("bad.jsonl:2: expected `text`, `instruction` + `output`, or `messages`"),
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
    let o = xtrain(&refs(&base(&long)));
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
            "--matmul-result must be auto, f32 or compute, got `bf32`",
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
fn a_nonfinite_loss_stops_with_the_last_good_state_or_is_skipped() {
    let dir = tempdir("rel-nan");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // lr 1e30 blows the weights up at step 1: step 2's loss is not finite.
    let a = train_on(&model, &out, &["--lr", "1e30", "--steps", "4"]);
    let e = fails(&refs(&a));
    assert!(
        e.contains("step 2: the loss is") && e.contains("stopped without applying it"),
        "{e}"
    );
    let ckpt = out.join("checkpoint-1");
    assert!(
        ckpt.join("trainer_state.json").is_file(),
        "the last good state is kept"
    );
    // With --skip-nonfinite-steps the run goes on; skipped steps change nothing.
    let out2 = dir.join("out2");
    let a = train_on(
        &model,
        &out2,
        &["--lr", "1e30", "--steps", "4", "--skip-nonfinite-steps"],
    );
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = std::fs::read_to_string(out2.join("metrics.jsonl")).unwrap();
    assert_eq!(m.matches("\"nonfinite\":true").count(), 3, "{m}");
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
        let mut cmd = match latest_checkpoint(&k) {
            Some(c) => text_run(&model, &data, &k, &["--resume", c.to_str().unwrap()]),
            None => text_run(&model, &data, &k, &[]),
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
        None => text_run(&model, &data, &k, &[]),
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

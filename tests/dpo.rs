//! Preference training (`xtrain train --method dpo`) against TRL's own `DPOTrainer`: the
//! fixtures of `tools/dpo-oracle.py` (tests/fixtures/dpo: the tiny random Llama with a
//! byte-level tokenizer, 4 pairs, 3 steps of AdamW 0.9/0.999/1e-8 at lr 1e-3, no weight decay,
//! max_grad_norm 1, dropout off; see cases.json). Every LoRA weight after each step to 1e-4,
//! the loss and the reward margin of each step to 1e-3 (the issue's tolerances; f32 on both
//! sides, the differences are about 1e-6), TRL's other metrics to 1e-3 relative. Also: TRL's
//! tokenization of every pair, the starting adapter as the reference giving ln 2 first, the
//! reference precomputed, resuming, NF4, and the refusals of bad input.

mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use xtrain::formats::safetensors::SafeTensors;

fn dpo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dpo")
}

fn cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dpo().join("cases.json")).unwrap()).unwrap()
}

/// The tiny model with the fixture's tokenizer, in `dir`.
fn model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("model").join(f), m.join(f)).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dpo().join(f), m.join(f)).unwrap();
    }
    m
}

/// `xtrain train --method dpo` of `case` (its data and flags) into `out`, with `extra` flags;
/// every step's adapter kept (`--save-every 1`).
fn train(dir: &Path, case: &str, out: &Path, extra: &[&str]) -> std::process::Output {
    let c = &cases()["cases"][case];
    let data = match c["tokenized"][0]["prompt_ids"][0].as_u64() {
        Some(256) => "chat_pairs.jsonl",
        _ => "pairs.jsonl",
    };
    let mut cmd = train_cmd(&model(dir), &dpo().join(data), out);
    cmd.args(["--method", "dpo", "--save-every", "1", "--no-plot"]);
    for f in cases()["train_flags"].as_array().unwrap() {
        let f = f.as_str().unwrap();
        if f == "init" {
            cmd.arg(dpo().join("init"));
        } else {
            cmd.arg(f);
        }
    }
    for f in c["flags"].as_array().unwrap() {
        cmd.arg(f.as_str().unwrap());
    }
    cmd.args(extra);
    cmd.output().unwrap()
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some() && v.get("nonfinite").is_none())
        .collect()
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    st.read(name).unwrap().to_f32().unwrap()
}

/// The run in `out` against TRL's `case`: each step's loss, margin and metrics, and each step's
/// adapter.
fn check_against_trl(case: &str, out: &Path, what: &str) {
    let want = &cases()["cases"][case]["steps"];
    let got = metrics(out);
    assert_eq!(got.len(), 3, "{what}: {got:?}");
    for (s, (g, w)) in got.iter().zip(want.as_array().unwrap()).enumerate() {
        for key in ["loss", "rewards/margins"] {
            let (g, w) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            assert!(
                (g - w).abs() <= 1e-3,
                "{what}: step {} {key} {g} vs TRL's {w}",
                s + 1
            );
        }
        for key in [
            "grad_norm",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
        ] {
            let (g, w) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
            assert!(
                (g - w).abs() <= 1e-3 * (1.0 + w.abs()),
                "{what}: step {} {key} {g} vs TRL's {w}",
                s + 1
            );
        }
    }
    let trl = SafeTensors::open(&dpo().join(format!("{case}.safetensors"))).unwrap();
    for step in 1..=3 {
        let ours = SafeTensors::open(
            &out.join(format!("step-{step}"))
                .join("adapter_model.safetensors"),
        )
        .unwrap();
        let names: Vec<&String> = ours.tensors.keys().collect();
        assert_eq!(names.len(), 28, "{what}: {names:?}");
        for name in names {
            let d = f32s(&ours, name)
                .iter()
                .zip(f32s(&trl, &format!("step{step}.{name}")))
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                d <= 1e-4,
                "{what}: {name} after step {step} differs from TRL's by {d}"
            );
        }
    }
}

fn ok(o: &std::process::Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{what}:\n{err}");
    err
}

#[test]
fn sigmoid_and_ipo_with_the_base_model_as_reference_equal_trl() {
    let dir = tempdir("dpo-base");
    for case in ["sigmoid_base", "ipo_base"] {
        let out = dir.join(case);
        let err = ok(&train(&dir, case, &out, &[]), case);
        if case == "sigmoid_base" {
            // The fourth pair is longer than --seq 48: cut as TRL cuts it, and said once.
            assert!(err.contains("truncated 1 of 4 pairs to --seq 48"), "{err}");
        }
        check_against_trl(case, &out, case);
    }
}

#[test]
fn the_starting_adapter_as_reference_starts_at_ln_2_and_equals_trl() {
    let dir = tempdir("dpo-start");
    // --reference start is the default with --init-adapter (TRL's with a PeftModel).
    for case in ["sigmoid_start", "hinge_start"] {
        let out = dir.join(case);
        ok(&train(&dir, case, &out, &[]), case);
        check_against_trl(case, &out, case);
    }
    let first = metrics(&dir.join("sigmoid_start"))[0]["loss"]
        .as_f64()
        .unwrap();
    assert!(
        (first - std::f64::consts::LN_2).abs() <= 1e-7,
        "the first loss against the starting adapter is {first}, not ln 2"
    );
    // The reference precomputed once over the data gives the same run.
    let out = dir.join("precomputed");
    let err = ok(
        &train(&dir, "sigmoid_start", &out, &["--precompute-reference"]),
        "--precompute-reference",
    );
    assert!(
        err.contains("computed the reference's log-probabilities of 4 pairs"),
        "{err}"
    );
    check_against_trl("sigmoid_start", &out, "--precompute-reference");
}

#[test]
fn accumulation_a_mesh_and_label_smoothing_equal_trl() {
    let dir = tempdir("dpo-forms");
    let out = dir.join("accum");
    ok(
        &train(&dir, "sigmoid_base_accum2", &out, &[]),
        "--grad-accum 2",
    );
    check_against_trl("sigmoid_base_accum2", &out, "--grad-accum 2");
    // Two devices, FSDP: the same step as one device's (TRL's one-device run).
    let out = dir.join("fsdp");
    ok(
        &train(&dir, "sigmoid_base", &out, &["--mesh", "fsdp=2"]),
        "fsdp=2",
    );
    check_against_trl("sigmoid_base", &out, "--mesh fsdp=2");
    // cDPO: TRL's sigmoid and robust losses combined (tools/dpo-oracle.py).
    let out = dir.join("cdpo");
    ok(&train(&dir, "cdpo_base", &out, &[]), "--label-smoothing");
    check_against_trl("cdpo_base", &out, "--label-smoothing 0.1");
}

/// xtrain's tokenization of every pair is TRL's: the prompt, and each completion as the tail
/// of prompt + completion (plain text with the EOS appended; chats through the template).
#[test]
fn pairs_are_tokenized_as_trl_tokenizes_them() {
    use xtrain::data::pairs::{read_pairs, tokenize_pair};
    use xtrain::data::text::TextTokenizer;
    let dir = tempdir("dpo-tokens");
    let tok = TextTokenizer::load(&model(&dir)).unwrap();
    for (case, file) in [
        ("sigmoid_base", "pairs.jsonl"),
        ("ipo_base", "chat_pairs.jsonl"),
    ] {
        let pairs = read_pairs(&dpo().join(file), false).unwrap().pairs;
        let want = cases()["cases"][case]["tokenized"].clone();
        for (i, (_, p)) in pairs.iter().enumerate() {
            let t = tokenize_pair(&tok, p).unwrap();
            let ids = |k: &str| -> Vec<u32> { serde_json::from_value(want[i][k].clone()).unwrap() };
            assert_eq!(t.prompt, ids("prompt_ids"), "{file} pair {i}");
            assert_eq!(t.chosen, ids("chosen_ids"), "{file} pair {i}");
            assert_eq!(t.rejected, ids("rejected_ids"), "{file} pair {i}");
        }
    }
}

/// Two virtual hosts over fsdp=2, each reading its own rows and weights: TRL's run again.
#[test]
fn virtual_hosts_equal_trl() {
    let dir = tempdir("dpo-hosts");
    let out = dir.join("hosts");
    let extra = ["--mesh", "fsdp=2", "--virtual-hosts", "2"];
    ok(
        &train(&dir, "sigmoid_start", &out, &extra),
        "--virtual-hosts 2",
    );
    check_against_trl("sigmoid_start", &out, "--virtual-hosts 2");
}

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A run stopped after 2 steps and resumed from its checkpoint ends bit for bit where the
/// uninterrupted run ends: the adapter, and every step's line of metrics. With the starting
/// adapter as the reference (the checkpoint keeps it) and its log-probabilities precomputed
/// (computed again from it on resume).
#[test]
fn a_resumed_dpo_run_equals_an_uninterrupted_one() {
    let dir = tempdir("dpo-resume");
    let extra = ["--precompute-reference"];
    let whole = dir.join("whole");
    ok(&train(&dir, "sigmoid_start", &whole, &extra), "whole");
    let parts = dir.join("parts");
    let mut first: Vec<&str> = extra.to_vec();
    first.extend(["--stop-after", "2"]);
    ok(&train(&dir, "sigmoid_start", &parts, &first), "first part");
    let ckpt = parts.join("checkpoint-2");
    assert!(ckpt.join("reference/adapter_model.safetensors").is_file());
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(&ckpt)
        .output()
        .unwrap();
    let err = ok(&o, "resumed");
    assert!(
        err.contains("computed the reference's log-probabilities"),
        "{err}"
    );
    for f in [
        "adapter/adapter_model.safetensors",
        "step-3/adapter_model.safetensors",
    ] {
        assert!(
            bytes(&whole.join(f)) == bytes(&parts.join(f)),
            "{f} differs"
        );
    }
    let strip = |v: &Vec<Value>| -> Vec<Value> {
        v.iter()
            .map(|l| {
                let mut l = l.clone();
                for k in ["step_time_s", "time_to_first_step"] {
                    l.as_object_mut().unwrap().remove(k);
                }
                l
            })
            .collect()
    };
    assert_eq!(strip(&metrics(&whole)), strip(&metrics(&parts)));
}

/// `--precompute-reference` changes how the reference's log-probabilities are had, not what the
/// run computes: a run started without it and resumed with it says so (it is not refused as a
/// flag of preference training, though `--method` was left out) and still ends at TRL's run.
#[test]
fn a_dpo_run_resumed_with_the_reference_precomputed_still_equals_trl() {
    let dir = tempdir("dpo-resume-precompute");
    let out = dir.join("run");
    ok(
        &train(&dir, "sigmoid_start", &out, &["--stop-after", "2"]),
        "first part",
    );
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(out.join("checkpoint-2"))
        .arg("--precompute-reference")
        .output()
        .unwrap();
    let err = ok(&o, "resumed with --precompute-reference");
    assert!(
        err.contains(
            "--precompute-reference true (the command line) instead of the recorded \
             --precompute-reference false"
        ),
        "{err}"
    );
    check_against_trl("sigmoid_start", &out, "resumed with --precompute-reference");
}

/// Ctrl-C in a DPO run saves a checkpoint at the step it reached, with the reference adapter
/// beside it, and exits with 130; `--resume` of that checkpoint goes on from there.
#[test]
fn ctrl_c_in_a_dpo_run_saves_a_checkpoint_that_resumes() {
    let dir = tempdir("dpo-ctrl-c");
    let out = dir.join("run");
    let mut cmd = train_cmd(&model(&dir), &dpo().join("pairs.jsonl"), &out);
    // More steps than the run can take before the signal comes.
    cmd.args(["--method", "dpo", "--seq", "48", "--batch-size", "4"])
        .args([
            "--steps",
            "100000",
            "--lr",
            "1e-4",
            "--log-every",
            "1",
            "--no-plot",
        ])
        .arg("--init-adapter")
        .arg(dpo().join("init"));
    let (status, said) = interrupted(&mut cmd, "step 2/");
    assert_eq!(status.code(), Some(130), "{said}");
    assert!(
        said.contains("interrupted; saved") && !said.contains("panicked"),
        "{said}"
    );
    let ckpt = latest_checkpoint(&out).expect("a checkpoint");
    let name = ckpt.file_name().unwrap().to_string_lossy().into_owned();
    let step: u64 = name.trim_start_matches("checkpoint-").parse().unwrap();
    assert!(step >= 2, "{said}");
    assert!(ckpt.join("reference/adapter_model.safetensors").is_file());
    // One more step (`--stop-after` counts the steps this process takes).
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(&ckpt)
        .args(["--stop-after", "1"])
        .output()
        .unwrap();
    ok(&o, "resumed after Ctrl-C");
    let next = out.join(format!("checkpoint-{}", step + 1));
    assert!(next.join("reference/adapter_model.safetensors").is_file());
}

/// QLoRA DPO: NF4 base weights, a fresh adapter (the base model is then the reference, and the
/// first loss ln 2): the loss falls and the margin grows over the steps.
#[test]
fn an_nf4_dpo_run_trains() {
    let dir = tempdir("dpo-nf4");
    let out = dir.join("nf4");
    let o = train_cmd(&model(&dir), &dpo().join("pairs.jsonl"), &out)
        .args([
            "--method",
            "dpo",
            "--quant",
            "nf4",
            "--seq",
            "48",
            "--batch-size",
            "4",
        ])
        .args(["--steps", "8", "--lr", "1e-2", "--lora-r", "4", "--no-plot"])
        .output()
        .unwrap();
    ok(&o, "--quant nf4");
    let m = metrics(&out);
    let loss = |i: usize| m[i]["loss"].as_f64().unwrap();
    let margin = |i: usize| m[i]["rewards/margins"].as_f64().unwrap();
    assert!(
        (loss(0) - std::f64::consts::LN_2).abs() < 1e-6,
        "{}",
        loss(0)
    );
    assert!(loss(7) < loss(0) - 0.05, "{} -> {}", loss(0), loss(7));
    assert!(
        margin(7) > margin(0) + 0.5,
        "{} -> {}",
        margin(0),
        margin(7)
    );
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
}

/// `--eval-data` gives TRL's metrics on held-out pairs; on the training pairs at step 0 they
/// are the first step's own (computed by the log-probability program instead of the step).
#[test]
fn evaluation_on_pairs_gives_trls_metrics() {
    let dir = tempdir("dpo-eval");
    let out = dir.join("eval");
    let data = dpo().join("pairs.jsonl");
    let extra = ["--eval-data", data.to_str().unwrap(), "--eval-every", "2"];
    let err = ok(&train(&dir, "sigmoid_base", &out, &extra), "--eval-data");
    assert!(err.contains("eval at step 0: loss 0.7142"), "{err}");
    let lines: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evals: Vec<&Value> = lines
        .iter()
        .filter(|l| l.get("eval_loss").is_some())
        .collect();
    assert_eq!(
        evals
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 2, 3]
    );
    let first = &metrics(&out)[0];
    for key in [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ] {
        let (e, t) = (
            evals[0][format!("eval_{key}")].as_f64().unwrap(),
            first[key].as_f64().unwrap(),
        );
        assert!(
            (e - t).abs() <= 1e-5 * (1.0 + t.abs()),
            "{key}: eval {e}, step 1 {t}"
        );
    }
    assert_eq!(evals[0]["eval_pairs"], 4);
}

/// The adapter a DPO run writes is an ordinary PEFT adapter: generate and merge take it.
#[test]
fn the_dpo_adapter_is_an_ordinary_adapter() {
    let dir = tempdir("dpo-adapter");
    let out = dir.join("run");
    ok(&train(&dir, "sigmoid_base", &out, &[]), "train");
    let m = model(&dir);
    let adapter = out.join("adapter");
    let o = xtrain(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompt",
        "Q: 2+2? A:",
        "--max-new-tokens",
        "4",
    ]);
    ok(&o, "generate");
    let merged = dir.join("merged");
    let o = xtrain(&[
        "merge",
        "--model",
        m.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    ok(&o, "merge");
    assert!(merged.join("model.safetensors").is_file());
}

/// A pairs file written to `dir`, line by line.
fn pairs_file(dir: &Path, name: &str, lines: &[&str]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

/// Bad input is refused naming what and where (the file's line), before any weight is loaded;
/// pairs whose completions are the same are counted in a warning.
#[test]
fn bad_pairs_and_flags_are_refused_naming_what_and_where() {
    let dir = tempdir("dpo-bad");
    let m = model(&dir);
    let good = r#"{"prompt": "a", "chosen": " b", "rejected": " c"}"#;
    let run = |data: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--method",
            "dpo",
            "--model",
            m.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--seq",
            "32",
            "--batch-size",
            "1",
            "--steps",
            "1",
            "--no-plot",
        ];
        let out = dir.join("out");
        args.extend(["--out", out.to_str().unwrap(), "--overwrite"]);
        args.extend(extra);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let no_rejected = pairs_file(
        &dir,
        "a.jsonl",
        &[good, r#"{"prompt": "x", "chosen": " y"}"#],
    );
    let e = fails(&refs(&run(&no_rejected, &[])));
    assert!(e.contains("a.jsonl:2: no `rejected`"), "{e}");
    let empty = pairs_file(
        &dir,
        "b.jsonl",
        &[
            good,
            "",
            r#"{"prompt": "x", "chosen": "", "rejected": " z"}"#,
        ],
    );
    let e = fails(&refs(&run(&empty, &[])));
    assert!(e.contains("b.jsonl:3: `chosen` is empty"), "{e}");
    let chat = pairs_file(
        &dir,
        "c.jsonl",
        &[r#"{"prompt": [{"role": "user", "content": "hi"}], "chosen": "text", "rejected": []}"#],
    );
    let e = fails(&refs(&run(&chat, &[])));
    assert!(
        e.contains("c.jsonl:1: `chosen` is not a list of messages"),
        "{e}"
    );
    let long = format!(
        r#"{{"prompt": "{}", "chosen": " y", "rejected": " z"}}"#,
        "x".repeat(40)
    );
    let no_room = pairs_file(&dir, "d.jsonl", &[good, &long]);
    let e = fails(&refs(&run(&no_room, &[])));
    assert!(
        e.contains("d.jsonl:2: the prompt has 40 tokens, which leaves no room for a completion within --seq 32"),
        "{e}"
    );
    let data = pairs_file(&dir, "e.jsonl", &[good, good]);
    for (flags, says) in [
        (&["--beta", "0"][..], "--beta must be a number > 0"),
        (&["--beta", "-1"], "--beta must be a number > 0"),
        (&["--beta", "nan"], "--beta must be a number > 0"),
        (&["--reference", "start"], "no --init-adapter was given"),
        (
            &["--label-smoothing", "0.5"],
            "--label-smoothing must be in [0, 0.5)",
        ),
        (
            &["--dpo-loss", "hinge", "--label-smoothing", "0.1"],
            "does not use it",
        ),
        (
            &["--train-on-prompt"],
            "--train-on-prompt (the command line) shapes supervised",
        ),
        (
            &["--batch-size", "3"],
            "gives 2 preference pairs, fewer than one batch of 3",
        ),
    ] {
        let mut args = run(&data, &[]);
        // A flag given twice is refused as such: the later value replaces the default's.
        if let Some(i) = args.iter().position(|a| a == flags[0]) {
            args.drain(i..i + 2);
        }
        args.extend(flags.iter().map(|f| f.to_string()));
        let e = fails(&refs(&args));
        assert!(e.contains(says), "{flags:?}: {e}");
    }
    // Supervised training refuses DPO's flags, and names --method dpo for a pairs file.
    let sft = |extra: &[&str]| {
        let mut a = run(&data, extra);
        a.drain(1..3);
        a
    };
    let e = fails(&refs(&sft(&["--beta", "0.2"])));
    assert!(
        e.contains("--beta is a setting of preference training"),
        "{e}"
    );
    let e = fails(&refs(&sft(&[])));
    assert!(
        e.contains("e.jsonl:1: a preference pair") && e.contains("--method dpo"),
        "{e}"
    );
    // The same completion twice: said once, with the count; the run goes on.
    let same = r#"{"prompt": "a", "chosen": " b", "rejected": " b"}"#;
    let data = pairs_file(&dir, "f.jsonl", &[same, good, same]);
    let o = xtrain(&refs(&run(&data, &[])));
    let err = ok(&o, "same completions");
    assert!(
        err.contains("warning: 2 of 3 pairs have the same chosen and rejected completion"),
        "{err}"
    );
}

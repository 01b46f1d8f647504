//! Preference training (`xtrain train --method dpo`) against TRL's own `DPOTrainer`: the
//! fixtures of `tools/dpo-oracle.py` (tests/fixtures/dpo: the tiny random Llama with a
//! byte-level tokenizer, 4 pairs, 3 steps of AdamW 0.9/0.999/1e-8 at lr 1e-3, no weight decay,
//! max_grad_norm 1, dropout off; see cases.json). Every LoRA weight after each step to 1e-4,
//! the loss and the reward margin of each step to 1e-3 (the tolerances; f32 on both
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

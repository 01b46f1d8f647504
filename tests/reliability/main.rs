//! Bad input, interrupted runs and numerical faults: every case exits non-zero (or cleanly
//! where that is the point) with a message that says what was wrong and where, never a panic,
//! and leaves no partial output. docs/reliability.md lists these cases and messages,
//! each with its test; the tests are grouped by what goes wrong, one file each, and the helpers
//! they share are here.

#[path = "../common/mod.rs"]
mod common;
mod devices;
mod flags;
mod generate;
mod inputs;
mod nonfinite;
mod program_dirs;
mod runs;
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
    std::fs::write(&p, say_examples(30)).unwrap();
    p
}

/// `n` JSONL lines of instruction data: `{"instruction": "Say i", "output": "i!"}`.
fn say_examples(n: usize) -> String {
    (0..n)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect()
}

/// Every tensor of the safetensors file at `path`, by name (to change some and write them back).
fn all_tensors(path: &Path) -> std::collections::BTreeMap<String, pjrt::HostTensor> {
    let st = xtrain::formats::safetensors::SafeTensors::open(path).unwrap();
    st.tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect()
}

fn unsafe_kill(pid: u32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
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

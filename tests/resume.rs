//! `xtrain train --resume CHECKPOINT` alone: a checkpoint records every setting of its run (the
//! model, data, evaluation data and output dir as absolute paths, the schedule, and the cadence
//! of saving and evaluating), so the command a stopped run suggests continues it as it was.

mod common;
use common::*;
use std::path::Path;
use std::process::Stdio;

/// The flags of the runs below besides --model, --data, --out and evaluation.
const FLAGS: &[&str] = &[
    "--steps",
    "120",
    "--batch-size",
    "2",
    "--seq",
    "48",
    "--lr",
    "1e-3",
    "--lora-r",
    "4",
    "--seed",
    "3",
    "--save-every",
    "5",
    "--log-every",
    "0",
    "--no-plot",
];

/// Steps at which `metrics.jsonl` has an evaluation row.
fn eval_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("eval_loss"))
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// The `N`s of `out/checkpoint-N`.
fn checkpoints(out: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(out)
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().to_string_lossy().to_string();
            n.strip_prefix("checkpoint-")?.parse().ok()
        })
        .collect();
    v.sort();
    v
}

fn adapter(out: &Path) -> Vec<u8> {
    std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap()
}

#[test]
fn a_run_stopped_with_ctrl_c_goes_on_evaluating_and_checkpointing_with_the_command_it_suggests() {
    let dir = tempdir("resume-ctrl-c");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 30);
    let eval = instruction_examples(&dir.join("eval.jsonl"), 6);
    let with_eval = |out: &Path| {
        let mut c = train_cmd(&model, &data, out);
        c.arg("--eval-data")
            .arg(&eval)
            .args(["--eval-every", "4"])
            .args(FLAGS);
        c
    };
    // The uninterrupted run.
    let full = dir.join("full");
    let o = with_eval(&full).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Ctrl-C once the run has written checkpoint-5.
    let int = dir.join("int");
    let child = with_eval(&int)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !int.join("checkpoint-5/trainer_state.json").is_file() && t0.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(130), "interrupted: {err}");
    let stopped_at = *checkpoints(&int).last().unwrap();
    assert!(stopped_at < 120, "{err}");

    // The suggestion is a whole command: run it as printed, nothing added.
    let at = err.find("continue with `").expect(&err) + "continue with `".len();
    let suggested = &err[at..at + err[at..].find('`').unwrap()];
    let words: Vec<&str> = suggested.split_whitespace().collect();
    assert_eq!(&words[..3], ["xtrain", "train", "--resume"], "{err}");
    assert_eq!(words.len(), 4, "{err}");
    let o = xtrain_cmd().args(&words[1..]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{suggested}: {err}");

    // It evaluated and checkpointed on the run's cadence after the stop, as the uninterrupted
    // run did, and ended with the same adapter.
    let after = |v: Vec<u64>| -> Vec<u64> { v.into_iter().filter(|s| *s > stopped_at).collect() };
    let evals = after(eval_steps(&int));
    assert_eq!(evals, after(eval_steps(&full)), "{err}");
    assert!(evals.contains(&120) && evals.len() > 1, "{evals:?}");
    let saved = after(checkpoints(&int));
    assert_eq!(saved, after(checkpoints(&full)), "{err}");
    assert!(saved.contains(&120) && saved.len() > 1, "{saved:?}");
    assert_eq!(
        adapter(&int),
        adapter(&full),
        "the same adapter as the uninterrupted run"
    );

    // Resuming the last checkpoint trains nothing, and says so.
    let last = int.join("checkpoint-120");
    let o = xtrain_cmd()
        .args(["train", "--resume", last.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "nothing to do: {} is at step 120 of 120",
            last.display()
        )),
        "{err}"
    );
    assert_eq!(adapter(&int), adapter(&full), "the adapter unchanged");
    assert!(
        !err.contains("xtrain: loaded"),
        "no weights are loaded for nothing: {err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_alone_refuses_a_model_that_moved_naming_where_it_was() {
    let dir = tempdir("resume-moved");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 30);
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args(FLAGS)
        .args(["--stop-after", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let was = model.canonicalize().unwrap();
    let moved = dir.join("moved-model");
    std::fs::rename(&model, &moved).unwrap();
    let ckpt = out.join("checkpoint-2");
    let e = fails(&["train", "--resume", ckpt.to_str().unwrap()]);
    assert!(
        e.contains(&format!(
            "run has --model {}, which does not exist now (moved or deleted?); give --model",
            was.display()
        )),
        "{e}"
    );
    // Given where it is now, the run goes on (and says it took the new place).
    let o = xtrain(&[
        "train",
        "--resume",
        ckpt.to_str().unwrap(),
        "--model",
        moved.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    assert!(err.contains("which does not exist now"), "{err}");
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_refuses_other_data_than_its_runs_naming_both_paths() {
    let dir = tempdir("resume-other-data");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 30);
    let other = instruction_examples(&dir.join("other.jsonl"), 12);
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args(FLAGS)
        .args(["--stop-after", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = out.join("checkpoint-2");
    let e = fails(&[
        "train",
        "--resume",
        ckpt.to_str().unwrap(),
        "--data",
        other.to_str().unwrap(),
    ]);
    assert!(
        e.contains(&format!(
            "run has --data {}, but the command line gives --data {}",
            data.canonicalize().unwrap().display(),
            other.display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_without_model_data_or_out_and_no_resume_says_what_is_needed() {
    let e = fails(&["train", "--data", "d.jsonl"]);
    assert!(
        e.contains("--model, --out are needed (or --resume a checkpoint, whose run records them)"),
        "{e}"
    );
}

/// A resumed bf16 run keeps its attention scores' type: bf16 scores round once more than f32
/// ones, so `--attention-scores f32` on a run started with the default (compute) is another
/// run's numerics and is refused, naming both; the form-only flags (`--matmul-result`,
/// `--keep-softmax-stats`) may change and are said.
#[test]
fn a_resumed_bf16_run_keeps_its_attention_scores_type() {
    let dir = tempdir("resume-scores");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 16);
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args([
            "--dtype",
            "bf16",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--stop-after",
            "2",
        ])
        .args([
            "--batch-size",
            "2",
            "--seq",
            "48",
            "--lora-r",
            "4",
            "--log-every",
            "0",
            "--no-plot",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = out.join("checkpoint-2");
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(&ckpt)
        .args(["--attention-scores", "f32"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains(
            "run has --attention-scores compute, but the command line gives --attention-scores f32"
        ),
        "{e}"
    );
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(&ckpt)
        .args(["--matmul-result", "compute"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(out.join("adapter").is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run of `--steps 2` (constant learning rate) resumed with `--epochs 4` runs four epochs of
/// its one-batch data: the typed epochs set the length, as in a new run (they were said to, and
/// the recorded steps stopped the run at step 2 regardless).
#[test]
fn epochs_typed_on_resume_set_the_length_of_a_run_that_recorded_steps() {
    let dir = tempdir("resume-epochs");
    let f = fixtures();
    let out = dir.join("run");
    let o = train_cmd(&f.join("model"), &f.join("inputs.safetensors"), &out)
        .args(["--steps", "2", "--save-every", "2", "--lora-r", "4"])
        .args(["--log-every", "0", "--no-plot"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(out.join("checkpoint-2"))
        .args(["--epochs", "4"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("--epochs 4 sets the resumed run's length instead of its recorded --steps 2"),
        "{e}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r["step"].as_u64())
        .collect();
    assert_eq!(steps.last(), Some(&4), "{metrics}");
    std::fs::remove_dir_all(&dir).unwrap();
}

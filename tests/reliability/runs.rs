//! Run dirs and interruptions: resume, overwrite, one run at a time, SIGINT, SIGTERM and SIGKILL,
//! nothing the user had lost.

use super::*;

/// The adapter's bytes in run dir `d`.
fn adapter_bytes(d: &Path) -> Vec<u8> {
    std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap()
}

/// The `step loss` of each step in run dir `d`'s metrics.jsonl.
fn losses(d: &Path) -> Vec<String> {
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
}

#[test]
fn two_uninterrupted_runs_give_the_same_adapter_and_losses() {
    let dir = tempdir("rel-deterministic");
    let model = tiny_text_model(&dir);
    let data = dataset(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    assert!(text_run(&model, &data, &a, &[]).status().unwrap().success());
    assert!(text_run(&model, &data, &b, &[]).status().unwrap().success());
    assert_eq!(
        adapter_bytes(&a),
        adapter_bytes(&b),
        "CPU runs are deterministic"
    );
    assert_eq!(losses(&a), losses(&b));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_killed_with_sigkill_and_sigterm_and_resumed_ends_as_the_uninterrupted_run() {
    let dir = tempdir("rel-kill");
    let model = tiny_text_model(&dir);
    let data = dataset(&dir);
    // The uninterrupted run to compare with.
    let a = dir.join("a");
    assert!(text_run(&model, &data, &a, &[]).status().unwrap().success());

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
    // SIGTERM: a checkpoint is saved and the process exits with 143 (128 + 15).
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
        o.status.code() == Some(143) || o.status.success(),
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
        adapter_bytes(&k),
        adapter_bytes(&a),
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

// ---------------------------------------------------------------- run dirs

/// A completed run of the fixture model into `out` (2 steps, r=4, `extra` flags).
fn trained(out: &Path, extra: &[&str]) {
    let o = xtrain(&refs(&train_on(&fixtures().join("model"), out, extra)));
    assert!(o.status.success(), "{}", stderr_of(&o));
}

/// `train_on` into `out` with --lora-r 8 instead of 4 (and 1 step).
fn train_r8(out: &Path) -> Vec<String> {
    let mut a = train_on(&fixtures().join("model"), out, &["--steps", "1"]);
    let r = a.iter().position(|s| s == "--lora-r").unwrap();
    a[r + 1] = "8".into();
    a
}

/// A resumed run whose checkpoint recorded `--attention-block`, moved onto a context axis (a
/// layout change it may make): the refusal names the checkpoint as the value's source (it said
/// "leave it out" of a flag not given), and `--attention-block auto` unsets it.
#[test]
fn a_recorded_attention_block_is_named_on_resume_and_unset_by_auto() {
    let dir = tempdir("rel-resume-attention-block");
    let out = dir.join("run");
    trained(&out, &["--save-every", "1", "--attention-block", "8"]);
    let ckpt = out.join("checkpoint-1");
    let resume = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--resume",
            ckpt.to_str().unwrap(),
            "--mesh",
            "context=2",
        ];
        a.extend_from_slice(extra);
        xtrain(&a)
    };
    let o = resume(&[]);
    let e = stderr_of(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains(&format!(
            "checkpoint {}'s run has --attention-block 8, which sets the query blocks",
            ckpt.display()
        )) && e.contains("give --attention-block auto"),
        "{e}"
    );
    let o = resume(&["--attention-block", "auto"]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Another run into the same --out: refused, naming the way to continue, nothing touched.
#[test]
fn a_run_dir_is_continued_only_with_resume() {
    let dir = tempdir("rel-outdir-resume");
    let out = dir.join("run");
    trained(&out, &["--save-every", "1"]);
    let first = names(&out);
    let e = fails(&refs(&train_r8(&out)));
    assert!(e.contains("holds a previous run"), "{e}");
    assert!(
        e.contains(&format!("--resume {}", out.join("checkpoint-2").display())),
        "{e}"
    );
    assert_eq!(names(&out), first, "nothing written or removed");
    assert_eq!(adapter_rank(&out.join("checkpoint-1")), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With --overwrite: a clean r=8 run, none of the r=4 checkpoints left beside it.
#[test]
fn a_run_dir_is_replaced_only_with_overwrite() {
    let dir = tempdir("rel-outdir-overwrite");
    let out = dir.join("run");
    trained(&out, &["--save-every", "1"]);
    let mut a = train_r8(&out);
    a.push("--overwrite".into());
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(names(&out), vec!["adapter", "metrics.jsonl", "tensorboard"]);
    assert_eq!(adapter_rank(&out.join("adapter")), 8);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An --overwrite run stopped early keeps the replaced files aside; the run resuming it deletes
/// them when it completes.
#[test]
fn an_overwrite_run_stopped_early_keeps_the_replaced_files_until_its_resume_completes() {
    let dir = tempdir("rel-outdir-replaced");
    let model = fixtures().join("model");
    let out = dir.join("run");
    trained(&out, &["--save-every", "1"]);
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
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A directory holding something else is refused; its files are left alone.
#[test]
fn train_out_at_a_dir_holding_other_files_is_refused_and_they_are_left_alone() {
    let dir = tempdir("rel-outdir-other");
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let e = fails(&refs(&train_on(&fixtures().join("model"), &other, &[])));
    assert!(
        e.contains("holds files that are not a training run's (notes.txt)"),
        "{e}"
    );
    assert_eq!(names(&other), vec!["notes.txt"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Another run's checkpoint resumed into a dir holding a run: refused, nothing mixed.
#[test]
fn another_runs_checkpoint_resumed_into_a_run_dir_is_refused() {
    let dir = tempdir("rel-outdir-another-run");
    let (out, third) = (dir.join("run"), dir.join("third"));
    trained(&out, &["--save-every", "1"]);
    trained(&third, &["--save-every", "1"]);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &out,
        &["--resume", third.join("checkpoint-1").to_str().unwrap()],
    )));
    assert!(e.contains("holds another run than the one --resume"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// --overwrite and --resume together make no sense.
#[test]
fn overwrite_and_resume_together_are_refused() {
    let dir = tempdir("rel-outdir-overwrite-resume");
    let out = dir.join("run");
    trained(&out, &[]);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("run2"),
        &[
            "--overwrite",
            "--resume",
            out.join("adapter").to_str().unwrap(),
        ],
    )));
    assert!(e.contains("--resume"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An output path that is a file: refused before any work.
#[test]
fn an_output_path_that_is_a_file_is_refused() {
    let dir = tempdir("rel-out-file");
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = fails(&refs(&train_on(&fixtures().join("model"), &file, &[])));
    assert!(e.contains("cannot create output dir"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- one run at a time

/// A run of the fixture model into `out` that goes on until killed, once it holds the dir's lock.
fn long_run_holding(out: &Path) -> std::process::Child {
    let child = xtrain_cmd()
        .args(train_on(
            &fixtures().join("model"),
            out,
            &["--steps", "100000"],
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !out.join(".xtrain-run").is_file() && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}

#[test]
fn a_second_run_into_a_dir_while_one_runs_is_refused_naming_its_pid() {
    let dir = tempdir("rel-lock");
    let out = dir.join("run");
    let mut first = long_run_holding(&out);
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &out,
        &["--overwrite"],
    )));
    assert!(
        e.contains(&format!("another xtrain run (pid {})", first.id())),
        "{e}"
    );
    first.kill().unwrap();
    first.wait().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first run is killed: its lock goes with it, and the next run is not blocked.
#[test]
fn a_killed_runs_lock_does_not_block_the_next_run() {
    let dir = tempdir("rel-lock-killed");
    let out = dir.join("run");
    let mut first = long_run_holding(&out);
    first.kill().unwrap();
    first.wait().unwrap();
    let o = xtrain(&refs(&train_on(
        &fixtures().join("model"),
        &out,
        &["--overwrite"],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(
        names(&out).iter().all(|n| !n.contains(".tmp-")),
        "{:?}",
        names(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Leftovers of killed runs, as write_atomic and write_dir_atomic name them, are removed by the
/// next run into the dir, which says so.
#[test]
fn a_killed_runs_leftover_temp_files_are_removed_by_the_next_run() {
    let dir = tempdir("rel-leftovers");
    let out = dir.join("run");
    std::fs::create_dir_all(&out).unwrap();
    let pid = dead_pid();
    let leftover = out.join(format!(".checkpoint-3.tmp-{pid}"));
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(out.join(format!(".loss.png.tmp-{pid}")), "x").unwrap();
    let o = xtrain(&refs(&train_on(&fixtures().join("model"), &out, &[])));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!("removed {}", leftover.display())) && err.contains("killed run"),
        "{err}"
    );
    assert!(!leftover.exists());
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

/// The command a stopped run prints to continue it quotes a path the shell would split or
/// expand (a space, a `'`, parentheses), so that pasted into a shell it continues the run.
#[test]
fn the_command_to_continue_a_stopped_run_quotes_its_path_and_pastes_into_a_shell() {
    let dir = tempdir("rel-stop-quoted");
    let model = fixtures().join("model");
    let out = dir.join("my run's (1)");
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--steps", "4", "--stop-after", "3"],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    let ckpt = out.join("checkpoint-3");
    let quoted = format!("'{}'", ckpt.to_str().unwrap().replace('\'', r"'\''"));
    let command = format!("xtrain train --resume {quoted}");
    assert!(err.contains(&format!("continue with `{command}`")), "{err}");
    // Pasted into a shell, with this xtrain first on PATH: the run continues to its end.
    let bin = Path::new(env!("CARGO_BIN_EXE_xtrain")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = Command::new("sh")
        .arg("-c")
        .arg(&command)
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(o.status.success(), "{command}: {}", stderr_of(&o));
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--resume` of a run's output dir (not one of its checkpoints) names its latest checkpoint,
/// the highest step (checkpoint-11, not checkpoint-5, the last by name), and the command that
/// continues from it (it said "is runs/x a checkpoint?").
#[test]
fn resume_of_a_run_dir_names_its_latest_checkpoint_and_the_command_to_continue() {
    let dir = tempdir("rel-resume-run-dir");
    let model = fixtures().join("model");
    let out = dir.join("run");
    let o = xtrain(&refs(&train_on(
        &model,
        &out,
        &["--steps", "12", "--save-every", "5", "--stop-after", "11"],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let latest = out.join("checkpoint-11");
    assert!(out.join("checkpoint-5").is_dir() && latest.is_dir());
    let e = fails(&["train", "--resume", out.to_str().unwrap()]);
    assert!(
        e.contains(&format!(
            "{} is a run's output dir, not a checkpoint; its latest checkpoint is {}: continue \
             from it with `xtrain train --resume {}`",
            out.display(),
            latest.display(),
            latest.display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--resume` of a run's output dir that holds no checkpoint says so.
#[test]
fn resume_of_a_run_dir_without_checkpoints_says_it_has_none() {
    let dir = tempdir("rel-resume-run-dir-none");
    let model = fixtures().join("model");
    let out = dir.join("run");
    let o = xtrain(&refs(&train_on(&model, &out, &["--steps", "1"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(out.join("adapter").is_dir() && latest_checkpoint(&out).is_none());
    let e = fails(&["train", "--resume", out.to_str().unwrap()]);
    assert!(
        e.contains(&format!(
            "{} is a run's output dir, not a checkpoint, and it holds no checkpoint to continue from",
            out.display()
        )),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- merge and import output dirs

/// `merge` of the fixture adapter into the fixture model, into `out`, with `extra` flags.
fn merge_into(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "merge",
        "--model",
        fixtures().join("model").to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend([
        "--adapter".into(),
        fixtures().join("adapter_init").to_str().unwrap().into(),
    ]);
    v.extend(["--out".into(), out.to_str().unwrap().into()]);
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// `dir/target` holding keep.txt, and the path `dir/target/.` that names it.
fn target_dot(dir: &Path) -> (PathBuf, String) {
    let target = dir.join("target");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("keep.txt"), "x").unwrap();
    let dot = format!("{}/.", target.display());
    (target, dot)
}

/// A copy of the sharded fixture model in `dir/sharded`.
fn sharded_model(dir: &Path) -> PathBuf {
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    for f in std::fs::read_dir(fixtures().join("model_sharded")).unwrap() {
        let p = f.unwrap().path();
        std::fs::copy(&p, sharded.join(p.file_name().unwrap())).unwrap();
    }
    sharded
}

/// No `.tmp-` or `.old-` leftovers in `dir` after a replace.
fn assert_no_leftovers(dir: &Path) {
    let leftovers: Vec<String> = names(dir)
        .into_iter()
        .filter(|n| n.contains(".tmp-") || n.contains(".old-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// A training run's directory: refused, nothing deleted.
#[test]
fn merge_into_a_training_runs_dir_is_refused_and_nothing_is_deleted() {
    let dir = tempdir("rel-merge-out-run");
    let run = dir.join("run");
    std::fs::create_dir_all(run.join("checkpoint-5")).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
    let e = fails(&refs(&merge_into(&run, &[])));
    assert!(
        e.contains("is not empty") && e.contains("--overwrite"),
        "{e}"
    );
    assert_eq!(names(&run), vec!["checkpoint-5", "metrics.jsonl"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `target/.`: the same refusal, nothing deleted.
#[test]
fn merge_into_a_dir_named_with_a_trailing_dot_is_refused_and_nothing_is_deleted() {
    let dir = tempdir("rel-merge-out-dot");
    let (target, dot) = target_dot(&dir);
    let e = fails(&refs(&merge_into(Path::new(&dot), &[])));
    assert!(e.contains("is not empty"), "{e}");
    assert_eq!(names(&target), vec!["keep.txt"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merge_into_the_model_it_reads_is_refused_even_with_overwrite() {
    let e = fails(&refs(&merge_into(
        &fixtures().join("model"),
        &["--overwrite"],
    )));
    assert!(e.contains("which this command reads"), "{e}");
}

#[test]
fn import_gguf_into_a_dir_holding_a_sharded_model_is_refused() {
    let dir = tempdir("rel-import-out-sharded");
    let sharded = sharded_model(&dir);
    let e = fails(&[
        "import-gguf",
        "/nonexistent/model.gguf",
        "--out",
        sharded.to_str().unwrap(),
    ]);
    assert!(e.contains("is not empty"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merge_with_overwrite_replaces_a_dir_named_with_a_trailing_dot_whole() {
    let dir = tempdir("rel-merge-overwrite-dot");
    let (target, dot) = target_dot(&dir);
    let o = xtrain(&refs(&merge_into(Path::new(&dot), &["--overwrite"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(names(&target).contains(&"model.safetensors".to_string()));
    assert!(!target.join("keep.txt").exists());
    assert_no_leftovers(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sharded model with --overwrite is replaced whole (no index left to win), and a killed
/// merge's leftover beside it is removed.
#[test]
fn merge_with_overwrite_replaces_a_sharded_model_whole_and_removes_a_killed_merges_leftover() {
    let dir = tempdir("rel-merge-overwrite-sharded");
    let sharded = sharded_model(&dir);
    let stale = dir.join(format!(".sharded.tmp-{}", dead_pid()));
    std::fs::create_dir_all(&stale).unwrap();
    let o = xtrain(&refs(&merge_into(&sharded, &["--overwrite"])));
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(
        stderr_of(&o).contains("left by a killed run"),
        "{}",
        stderr_of(&o)
    );
    assert!(!stale.exists());
    assert!(!sharded.join("model.safetensors.index.json").exists());
    assert!(sharded.join("model.safetensors").is_file());
    assert_no_leftovers(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- resumed runs

/// `train` of the fixture model on `batch` into `out` (no progress, no plot) with `extra`.
fn train_batch(batch: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "--model",
        fixtures().join("model").to_str().unwrap(),
    ]
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
}

/// The flags of the run that [`stopped_run`] stops: 4 steps of a cosine schedule, and settings
/// other than the defaults.
const RUN_FLAGS: [&str; 16] = [
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

/// A copy of the fixture batch in `dir/batch.safetensors` (to change, to show that other data at
/// the same path is refused), and a run on it with [`RUN_FLAGS`] stopped after step 2 in
/// `dir/part`. Returns (batch, part, its checkpoint-2).
fn stopped_run(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let batch = dir.join("batch.safetensors");
    std::fs::copy(fixtures().join("inputs.safetensors"), &batch).unwrap();
    let part = dir.join("part");
    let mut a = train_batch(&batch, &part, &RUN_FLAGS);
    a.extend(["--stop-after".to_string(), "2".to_string()]);
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let ckpt = part.join("checkpoint-2");
    (batch, part, ckpt)
}

/// A flag given with another value than the checkpoint's: refused, naming both.
#[test]
fn resume_with_a_flag_of_another_value_than_the_checkpoints_is_refused_naming_both() {
    let dir = tempdir("rel-resume-contradicts");
    let (batch, part, ckpt) = stopped_run(&dir);
    let c = ckpt.to_str().unwrap();
    let e = fails(&refs(&train_batch(
        &batch,
        &part,
        &["--resume", c, "--lora-alpha", "32"],
    )));
    assert!(
        e.contains("run has --lora-alpha 16, but the command line gives --lora-alpha 32"),
        "{e}"
    );
    let e = fails(&refs(&train_batch(
        &batch,
        &part,
        &["--resume", c, "--steps", "9"],
    )));
    assert!(e.contains("--steps 4") && e.contains("--steps 9"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every flag left out: the checkpoint's values, and the same result as the uninterrupted run
/// (the cosine schedule over 4 steps, not an lr of 0 over a 1-step "epoch").
#[test]
fn resume_takes_the_checkpoints_settings_and_ends_as_the_uninterrupted_run() {
    let dir = tempdir("rel-resume-settings");
    let (batch, part, ckpt) = stopped_run(&dir);
    let full = dir.join("full");
    let o = xtrain(&refs(&train_batch(&batch, &full, &RUN_FLAGS)));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let o = xtrain(&refs(&train_batch(
        &batch,
        &part,
        &["--resume", ckpt.to_str().unwrap()],
    )));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("taking") && err.contains("--lora-alpha 16"),
        "{err}"
    );
    assert_eq!(
        adapter_bytes(&full),
        adapter_bytes(&part),
        "the resumed run is the uninterrupted one"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Other data than the checkpoint's run saw, at the same path: refused.
#[test]
fn resume_on_other_data_than_the_checkpoints_run_is_refused() {
    let dir = tempdir("rel-resume-other-data");
    let (batch, part, ckpt) = stopped_run(&dir);
    let mut t = all_tensors(&fixtures().join("inputs.safetensors"));
    let mut ids = t["input_ids"].to_i64().unwrap();
    ids[3] = (ids[3] + 1) % 512;
    t.insert(
        "input_ids".into(),
        pjrt::HostTensor::from_i64(&ids, &[2, 16]),
    );
    xtrain::formats::safetensors::write(&batch, &t, &Default::default()).unwrap();
    let o = xtrain(&refs(&train_batch(
        &batch,
        &part,
        &["--resume", ckpt.to_str().unwrap()],
    )));
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
    assert!(
        err.contains("quitting at once (a second signal); the run has no checkpoint yet"),
        "{err}"
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

// ---------------------------------------------------------------- train --out at its own inputs

/// The flags of [`own_inputs`]'s runs.
const SHORT_RUN: [&str; 8] = [
    "--steps",
    "1",
    "--batch-size",
    "1",
    "--seq",
    "32",
    "--lora-r",
    "4",
];

/// The tiny text model in `dir`, and its 8 examples in `dir/run/d.jsonl` and `dir/d.jsonl`.
/// Returns (model, run, the data inside run, the data outside it).
fn own_inputs(dir: &Path) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let model = tiny_text_model(dir);
    let run = dir.join("run");
    let data = run.join("d.jsonl");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(&data, say_examples(8)).unwrap();
    let outside = dir.join("d.jsonl");
    std::fs::write(&outside, say_examples(8)).unwrap();
    (model, run, data, outside)
}

/// `train --out OUT --overwrite` that reads `what` is refused before anything is moved.
fn refused_as_its_own_input(model: &Path, data: &Path, out: &Path, extra: &[&str], what: &Path) {
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
    a.extend(SHORT_RUN.iter().chain(extra).map(|s| s.to_string()));
    let before = names(out);
    let e = fails(&refs(&a));
    assert!(
        e.contains("which this command reads; choose another --out")
            && e.contains(&what.display().to_string()),
        "{e}"
    );
    assert_eq!(names(out), before, "nothing moved");
}

#[test]
fn train_out_at_the_dir_holding_its_data_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-out-inputs-data");
    let (model, run, data, _) = own_inputs(&dir);
    refused_as_its_own_input(&model, &data, &run, &[], &data);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_out_at_its_model_dir_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-out-inputs-model");
    let (model, _, _, outside) = own_inputs(&dir);
    refused_as_its_own_input(&model, &outside, &model, &[], &model);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_out_at_the_dir_holding_its_eval_data_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-out-inputs-eval-data");
    let (model, run, data, outside) = own_inputs(&dir);
    refused_as_its_own_input(
        &model,
        &outside,
        &run,
        &["--eval-data", data.to_str().unwrap()],
        &data,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run dir whose adapter is --init-adapter.
#[test]
fn train_out_at_the_run_dir_of_its_init_adapter_with_overwrite_is_refused_before_anything_is_moved()
{
    let dir = tempdir("rel-out-inputs-init-adapter");
    let (model, _, _, outside) = own_inputs(&dir);
    let o = train_cmd(&model, &outside, &dir.join("first"))
        .args(SHORT_RUN)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    let adapter = dir.join("first/adapter");
    refused_as_its_own_input(
        &model,
        &outside,
        &dir.join("first"),
        &["--init-adapter", adapter.to_str().unwrap()],
        &adapter,
    );
    assert!(adapter.join("adapter_model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ------------------------------------- bench --export, compile --out and import-gguf --out

/// Every file under `dir` (recursively, by path relative to it) with its bytes.
fn contents(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut all = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                all.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    all
}

/// No staging, temp or set-aside dir of `name` beside it in `parent`: nothing was moved.
fn nothing_staged(parent: &Path, name: &str) {
    let staged: Vec<String> = names(parent)
        .into_iter()
        .filter(|n| n.starts_with(&format!(".{name}.")))
        .collect();
    assert!(staged.is_empty(), "{staged:?}");
}

/// `xtrain bench` on the model dir `model` (batch 2 x 16, r=4, one step), with `extra` flags.
fn bench_on(model: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["bench", "--model", model.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(
        [
            "--batch", "2", "--seq", "16", "--lora-r", "4", "--steps", "1", "--warmup", "0",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string()),
    );
    v
}

/// `bench --export FILE --overwrite` where FILE (as `export`) is a file of the model dir `model`:
/// refused naming --export and FILE, the model dir byte-identical.
fn bench_export_refused_in_model(model: &Path, export: &str) {
    let before = contents(model);
    let e = fails(&refs(&bench_on(
        model,
        &["--export", export, "--overwrite"],
    )));
    assert!(
        e.contains(&format!("--export {export} would replace"))
            && e.contains("which this command reads; choose another --export"),
        "{e}"
    );
    assert_eq!(contents(model), before, "the model dir is as it was");
    nothing_staged(model, "model.safetensors");
}

#[test]
fn bench_export_at_its_models_weights_with_overwrite_is_refused_and_they_are_left_alone() {
    let dir = tempdir("rel-bench-export-model");
    let model = tiny_dir(&dir, "tm");
    let weights = model.join("model.safetensors");
    bench_export_refused_in_model(&model, weights.to_str().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_export_through_a_symlink_to_its_models_weights_is_refused() {
    let dir = tempdir("rel-bench-export-symlink");
    let model = tiny_dir(&dir, "tm");
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(model.join("model.safetensors"), &link).unwrap();
    bench_export_refused_in_model(&model, link.to_str().unwrap());
    assert!(link.is_symlink(), "the link is left too");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_export_at_its_models_weights_through_dotdot_is_refused() {
    let dir = tempdir("rel-bench-export-dotdot");
    let model = tiny_dir(&dir, "tm");
    let dotdot = format!("{}/../tm/model.safetensors", model.display());
    bench_export_refused_in_model(&model, &dotdot);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_export_at_an_existing_file_is_refused_without_overwrite() {
    let dir = tempdir("rel-bench-export-exists");
    let model = tiny_dir(&dir, "tm");
    let file = dir.join("peers.safetensors");
    std::fs::write(&file, "the user's file").unwrap();
    let e = fails(&refs(&bench_on(
        &model,
        &["--export", file.to_str().unwrap()],
    )));
    assert!(
        e.contains(&format!("--export {} exists", file.display())) && e.contains("--overwrite"),
        "{e}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"the user's file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_export_with_overwrite_replaces_an_existing_file_whole() {
    let dir = tempdir("rel-bench-export-overwrite");
    let model = tiny_dir(&dir, "tm");
    let file = dir.join("peers.safetensors");
    std::fs::write(&file, "an older export").unwrap();
    let o = xtrain(&refs(&bench_on(
        &model,
        &["--export", file.to_str().unwrap(), "--overwrite"],
    )));
    assert!(o.status.success(), "{}", stderr_of(&o));
    let exported = all_tensors(&file);
    assert!(exported.contains_key("input_ids"), "{:?}", exported.keys());
    assert_no_leftovers(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_overwrite_without_export_is_refused() {
    let e = fails(&refs(&bench_on(
        &fixtures().join("model"),
        &["--overwrite"],
    )));
    assert!(e.contains("--overwrite") && e.contains("--export"), "{e}");
}

/// `compile --out OUT --overwrite` (batch 2 x 16, r=4) with `extra` flags, where OUT holds `what`,
/// which the command reads: refused naming --out and `what` before anything is moved, OUT
/// byte-identical.
fn compile_refused_as_its_own_input(out: &Path, extra: &[&str], what: &Path) {
    let mut a: Vec<String> = [
        "compile",
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "4",
        "--overwrite",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(["--out".into(), out.to_str().unwrap().into()]);
    a.extend(extra.iter().map(|s| s.to_string()));
    let real = out.canonicalize().unwrap();
    let before = contents(&real);
    let e = fails(&refs(&a));
    assert!(
        e.contains(&format!("--out {} would replace", real.display()))
            && e.contains(&what.display().to_string())
            && e.contains("which this command reads; choose another --out"),
        "{e}"
    );
    assert_eq!(contents(&real), before, "--out is as it was");
    nothing_staged(
        real.parent().unwrap(),
        &real.file_name().unwrap().to_string_lossy(),
    );
}

#[test]
fn compile_out_at_its_model_dir_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-compile-out-model");
    let model = tiny_dir(&dir, "tm");
    compile_refused_as_its_own_input(&model, &["--model", model.to_str().unwrap()], &model);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compile_out_through_a_symlink_to_its_model_dir_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-compile-out-model-symlink");
    let model = tiny_dir(&dir, "tm");
    let link = dir.join("link");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    compile_refused_as_its_own_input(
        &link.join("."),
        &["--model", model.to_str().unwrap()],
        &model,
    );
    assert!(link.is_symlink(), "the link is left too");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compile_out_holding_its_config_recipe_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-compile-out-recipe");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let recipe = out.join("recipe.toml");
    std::fs::write(&recipe, "lora_alpha = 8.0\n").unwrap();
    compile_refused_as_its_own_input(
        &out,
        &[
            "--config",
            recipe.to_str().unwrap(),
            "--model",
            fixtures().join("model").to_str().unwrap(),
        ],
        &recipe,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compile_out_holding_its_sharding_rules_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-compile-out-rules");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let rules = out.join("rules.txt");
    std::fs::write(&rules, "").unwrap();
    compile_refused_as_its_own_input(
        &out,
        &[
            "--model",
            fixtures().join("model").to_str().unwrap(),
            "--mesh",
            "fsdp=1",
            "--sharding-rules",
            rules.to_str().unwrap(),
        ],
        &rules,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn compile_out_holding_its_target_config_with_overwrite_is_refused_before_anything_is_moved() {
    let dir = tempdir("rel-compile-out-target-config");
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let o = xtrain(&["targets", "cuda:h100"]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let gpu = out.join("h100.txtpb");
    std::fs::write(&gpu, &o.stdout).unwrap();
    compile_refused_as_its_own_input(
        &out,
        &[
            "--model",
            fixtures().join("model").to_str().unwrap(),
            "--target",
            "cuda:h100:1",
            "--target-config",
            gpu.to_str().unwrap(),
        ],
        &gpu,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn import_gguf_out_at_the_dir_holding_its_gguf_with_overwrite_is_refused_before_anything_is_moved()
{
    let dir = tempdir("rel-import-out-gguf");
    let out = dir.join("gd");
    std::fs::create_dir_all(&out).unwrap();
    let gguf = out.join("m.gguf");
    std::fs::write(&gguf, b"GGUF and the user's only copy").unwrap();
    let real = out.canonicalize().unwrap();
    let before = contents(&out);
    let e = fails(&[
        "import-gguf",
        gguf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--overwrite",
    ]);
    assert!(
        e.contains(&format!("--out {} would replace", real.display()))
            && e.contains(&gguf.display().to_string())
            && e.contains("which this command reads; choose another --out"),
        "{e}"
    );
    assert_eq!(contents(&out), before, "--out is as it was");
    nothing_staged(&dir, "gd");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first Ctrl-C while the step compiles abandons the compile (one call into the plugin,
/// minutes on a large step, that nothing interrupts): the run ends at once with code 130, saying
/// so, instead of "stopping at the next safe point" after the compile. A step of 512 tokens in
/// query blocks of 8 without remat compiles for over a minute here.
#[test]
fn the_first_ctrl_c_during_the_compile_abandons_it() {
    use std::io::{BufRead, BufReader};
    let dir = tempdir("rel-sigint-compile");
    let model = tiny_text_model(&dir);
    let data = dataset(&dir);
    let out = dir.join("run");
    let mut child = train_cmd(&model, &data, &out)
        .args(["--seq", "512", "--batch-size", "1", "--lora-r", "4"])
        .args([
            "--attention-block",
            "8",
            "--remat",
            "none",
            "--no-cache",
            "-v",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut said = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let compiling = line.contains("xtrain: compiling the step");
        said.push(line);
        if compiling {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    unsafe_kill(child.id(), 2);
    let t0 = std::time::Instant::now();
    said.extend(lines.map(|l| l.unwrap()));
    let status = child.wait().unwrap();
    let err = said.join("\n");
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(
        t0.elapsed().as_secs() < 10,
        "took {:?} after the signal: {err}",
        t0.elapsed()
    );
    assert!(
        err.contains("interrupted while compiling the step and loading the weights (abandoned it); nothing new to save"),
        "{err}"
    );
    assert!(!err.contains("compiled the step in"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.join("adapter").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run dir copied elsewhere (`cp -r runs/a runs/b`) and resumed from the copy's checkpoint
/// with `--resume` alone continues in the copy, saying so, and leaves the original alone (it
/// was refused: "--out runs/a holds another run than the one --resume continues", since the
/// checkpoint recorded runs/a as its --out). A run dir is the directory its checkpoints are in.
#[test]
fn a_copied_run_dir_resumes_in_the_copy_with_resume_alone() {
    let dir = tempdir("rel-copied-run");
    let model = tiny_text_model(&dir);
    let data = dataset(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let o = train_cmd(&model, &data, &a)
        .args([
            "--seq",
            "32",
            "--batch-size",
            "2",
            "--lora-r",
            "4",
            "--steps",
            "4",
        ])
        .args([
            "--save-every",
            "2",
            "--stop-after",
            "2",
            "--log-every",
            "0",
            "--no-plot",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    let o = Command::new("cp")
        .arg("-r")
        .arg(&a)
        .arg(&b)
        .output()
        .unwrap();
    assert!(o.status.success());
    let a_before = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(b.join("checkpoint-2"))
        .args(["--log-every", "0"])
        .output()
        .unwrap();
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "xtrain: note: --out {} (the run dir checkpoint {} is in) instead of the recorded --out {}",
            b.display(),
            b.join("checkpoint-2").display(),
            a.display()
        )),
        "{err}"
    );
    assert!(b.join("adapter/adapter_model.safetensors").is_file());
    assert!(!a.join("adapter").exists());
    assert_eq!(
        std::fs::read_to_string(a.join("metrics.jsonl")).unwrap(),
        a_before
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--out . --overwrite` from a directory of one's own files: refused, every file left (a
/// merge, a train and a plan replaced the current directory whole before).
#[test]
fn the_current_directory_is_never_replaced_even_with_overwrite() {
    let dir = tempdir("rel-out-cwd");
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let merge = merge_into(Path::new("."), &["--overwrite"]);
    let train = train_on(&fixtures().join("model"), Path::new(".."), &["--overwrite"]);
    let runs = [merge, train];
    for args in runs {
        let o = xtrain_cmd().args(&args).current_dir(&dir).output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}: {e}");
        assert!(e.contains("is the current directory or holds it"), "{e}");
        assert_eq!(
            std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
            "mine"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reader that goes away (`xtrain compile ... | head -1`) ends no command: the program dir is
/// written whole and the command succeeds (it panicked on the closed pipe and lost the dir).
#[test]
fn a_closed_stdout_does_not_stop_a_compile() {
    let dir = tempdir("rel-closed-stdout");
    let out = dir.join("program");
    let mut child = xtrain_cmd()
        .args([
            "compile",
            "--model",
            "tiny-llama3",
            "--seq",
            "16",
            "--batch",
            "2",
            "--check",
        ])
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !e.contains("panicked"), "{e}");
    assert!(out.join("manifest.json").is_file() && out.join("train_step.mlir").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--lr 0` trains nothing, and says so; a run's directory given where its adapter is wanted is
/// pointed to the adapter inside it.
#[test]
fn lr_0_is_said_and_a_run_dir_given_as_an_adapter_is_pointed_inside() {
    let dir = tempdir("rel-lr0-rundir");
    let out = dir.join("run");
    let o = xtrain(&refs(&train_on(
        &fixtures().join("model"),
        &out,
        &["--lr", "0", "--steps", "1"],
    )));
    let said = stderr_of(&o);
    assert!(o.status.success(), "{said}");
    assert!(
        said.contains("xtrain: warning: --lr 0: every update is zero"),
        "{said}"
    );
    let e = fails(
        &refs(&merge_into(&dir.join("merged"), &[]))
            .iter()
            .map(|a| {
                if a.ends_with("adapter_init") {
                    out.to_str().unwrap()
                } else {
                    a
                }
            })
            .collect::<Vec<_>>(),
    );
    assert!(
        e.contains(&format!("its adapter is {}", out.join("adapter").display())),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

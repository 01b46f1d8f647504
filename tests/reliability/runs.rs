//! Run dirs and interruptions: resume, overwrite, one run at a time, SIGINT, SIGTERM and SIGKILL,
//! nothing the user had lost.

use super::*;

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

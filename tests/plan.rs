//! `xtrain plan` on the tiny model, over small search spaces (each point a real compile): on
//! this machine's CPU plugin and for an absent CUDA GPU (its plugin fetched into the cache on
//! first use, as tests/targets.rs does), its pick the same as an exhaustive search's of the
//! same space; its recipe taken by `compile --config` as it is; `--seq max` monotone in the
//! memory limit.
//!
//! The memory limits below sit between the compilers' own figures for the tiny model's steps
//! (KiB per device, from `plan --exhaustive`), so that the points the time model puts first do
//! not fit and the pick is not simply the first point.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

/// `xtrain plan` with `args`, into `out`; its plan.json.
fn plan(args: &[&str], out: &Path) -> Value {
    plan_and_log(args, out).0
}

/// [`plan`], and what it printed.
fn plan_and_log(args: &[&str], out: &Path) -> (Value, String) {
    let o = xtrain_cmd()
        .arg("plan")
        .args(["--model", "tiny-llama3"])
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "plan {args:?}: {text}");
    let json = std::fs::read_to_string(out.join("plan.json")).unwrap();
    (serde_json::from_str(&json).unwrap(), text)
}

/// The chosen point's flags, checking that it fits its limit by the compiler's figures.
fn chosen(p: &Value) -> Value {
    let c = &p["chosen"];
    let f = &c["figures"];
    assert_eq!(f["fits"], true, "{p:#}");
    assert!(
        f["device_gib"].as_f64().unwrap() <= f["limit_gib"].as_f64().unwrap(),
        "{p:#}"
    );
    c["flags"].clone()
}

/// How many points of a plan have an outcome starting with `what`.
fn count(p: &Value, what: &str) -> usize {
    let all = p["candidates"].as_array().unwrap();
    all.iter()
        .filter(|c| c["outcome"].as_str().unwrap().starts_with(what))
        .count()
}

/// The search and the exhaustive search of the same space pick the same point; the exhaustive
/// one compiled every point and some did not fit (so the pick is not the first point tried).
fn same_as_exhaustive(args: &[&str], dir: &Path) -> Value {
    let searched = plan(args, &dir.join("searched"));
    let mut all = args.to_vec();
    all.push("--exhaustive");
    let exhaustive = plan(&all, &dir.join("exhaustive"));
    assert_eq!(chosen(&searched), chosen(&exhaustive), "{args:?}");
    assert!(count(&exhaustive, "does not fit") >= 1, "{exhaustive:#}");
    assert_eq!(
        count(&exhaustive, "fits") + count(&exhaustive, "does not fit"),
        exhaustive["candidates"].as_array().unwrap().len(),
        "{exhaustive:#}"
    );
    assert!(searched["method"].as_str().unwrap().contains("model"));
    searched
}

/// On the CPU: microbatches and MLP tiles searched (6 points) for 4 rows of 64 under 2.5 MiB,
/// which 1 microbatch does not fit (save-proj: 4018 and 3363 KiB, whole MLP and in tiles), 2 fit
/// only with the MLP in tiles (2463 KiB; 2755 whole) and 4 fit both ways (2059 and 1949). The
/// time model prices the operations each step launches, and 2 microbatches launch about half
/// of what 4 do: the pick is 2 in tiles. The recipe compiles and checks as it is.
#[test]
fn plan_on_the_cpu_picks_what_the_exhaustive_search_picks() {
    let dir = tempdir("plan-cpu");
    let args = [
        "--seq",
        "64",
        "--global-batch",
        "4",
        "--remat",
        "save-proj",
        "--key-block",
        "8",
        "--loss-chunk",
        "32",
        "--memory-limit-gib",
        "0.00244140625",
    ];
    let p = same_as_exhaustive(&args, &dir);
    let flags = chosen(&p);
    assert_eq!(
        (&flags["grad-accum"], &flags["mlp-chunk"]),
        (&Value::from("2"), &Value::from("32")),
        "{p:#}"
    );
    // The host budget is stated (this machine's memory), and the time model stands on this
    // machine's CPU plugin, measured, with the compiled step's launches priced.
    let host = p["limits"]["host_from"].as_str().unwrap();
    assert!(host.contains("this machine's memory"), "{p:#}");
    assert!(p["limits"]["host_gib"].as_f64().unwrap() > 0.0, "{p:#}");
    let method = p["method"].as_str().unwrap();
    assert!(
        method.contains("this machine's CPU plugin, measured"),
        "{method}"
    );
    let f = &p["chosen"]["figures"];
    assert!(f["launches"]["count"].as_f64().unwrap() > 10.0, "{p:#}");
    assert!(f["model"]["launch_s"].as_f64().unwrap() > 0.0, "{p:#}");
    assert!(f["host_limit_gib"].as_f64().unwrap() > 0.0, "{p:#}");
    assert_eq!(
        flags["offload"], "none",
        "the CPU plugin offloads nothing: {p:#}"
    );
    let recipe = dir.join("searched/recipe.toml");
    let text = std::fs::read_to_string(&recipe).unwrap();
    assert!(
        text.contains("grad_accum = 2") && !text.contains("[compile]"),
        "{text}"
    );
    assert!(
        !text.contains("[train]"),
        "train's default plugin is the CPU's: {text}"
    );
    let o = xtrain_cmd()
        .args(["compile", "--config"])
        .arg(&recipe)
        .arg("--check")
        .arg("--out")
        .arg(dir.join("program"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("XLA compile"), "{out}");
}

/// For an absent RTX 4090 (bf16): the offload searched (4 points) under 1.5 MiB, which neither
/// `none` (1773 KiB) nor `frozen` (1615) fits and `activations` (1519) and `all` (1385) do;
/// the model puts `activations` first of those (less host traffic).
#[test]
fn plan_for_an_absent_gpu_picks_what_the_exhaustive_search_picks() {
    let dir = tempdir("plan-cuda");
    let args = [
        "--target",
        "cuda:rtx4090:1",
        "--dtype",
        "bf16",
        "--seq",
        "64",
        "--global-batch",
        "2",
        "--grad-accum",
        "1",
        "--remat",
        "save-proj",
        "--key-block",
        "8",
        "--loss-chunk",
        "32",
        "--mlp-chunk",
        "off",
        "--memory-limit-gib",
        "0.00146484375",
    ];
    let p = same_as_exhaustive(&args, &dir);
    assert_eq!(chosen(&p)["offload"], "activations", "{p:#}");
    let recipe = std::fs::read_to_string(dir.join("searched/recipe.toml")).unwrap();
    assert!(
        recipe.contains("[compile]\ntarget = \"cuda:rtx4090:1\""),
        "{recipe}"
    );
    // The recipe trains where it was planned for, not on train's default CPU plugin.
    assert!(recipe.contains("[train]\nplugin = \"cuda\""), "{recipe}");
    // The host budget is the RTX 4090's class default, 64 GiB a card.
    assert_eq!(p["limits"]["host_gib"].as_f64(), Some(64.0), "{p:#}");
    let host = p["limits"]["host_from"].as_str().unwrap();
    assert!(host.contains("NVIDIA GeForce RTX 4090"), "{host}");
}

/// `--seq max` on the CPU (one row, every knob fixed, in steps of 64 up to 1024; the step needs
/// 2.22, 3.23 and 5.26 MiB at 128, 256 and 512 tokens) under 2.5 and 5 MiB: more memory
/// never gives a shorter sequence, the longest fits and the next step does not, and every
/// probe agrees with it (shorter ones fit, longer ones do not). The search's one point is the
/// longest probe that fits, compiled once: its figures are the probe's.
#[test]
fn seq_max_is_monotone_in_the_memory_limit() {
    let dir = tempdir("plan-seq-max");
    let mut longest = Vec::new();
    for (k, limit) in ["0.0025", "0.005"].iter().enumerate() {
        let (p, said) = plan_and_log(
            &[
                "--seq",
                "max",
                "--seq-step",
                "64",
                "--seq-limit",
                "1024",
                "--remat",
                "layer",
                "--key-block",
                "16",
                "--mlp-chunk",
                "off",
                "--loss-chunk",
                "64",
                "--grad-accum",
                "1",
                "--memory-limit-gib",
                limit,
            ],
            &dir.join(k.to_string()),
        );
        let seq = p["seq_max"]["longest"].as_i64().unwrap();
        for probe in p["seq_max"]["probes"].as_array().unwrap() {
            let at = probe["seq"].as_i64().unwrap();
            assert_eq!(probe["fits"], at <= seq, "{probe} against {seq}: {p:#}");
        }
        let probes = p["seq_max"]["probes"].as_array().unwrap();
        let probed = |s: i64| probes.iter().any(|q| q["seq"].as_i64() == Some(s));
        assert!(probed(seq), "{p:#}");
        assert!(seq == 1024 || probed(seq + 64), "{p:#}");
        assert_eq!(p["seq"].as_i64(), Some(seq));
        chosen(&p);
        let reused = "the same step was compiled before; its figures are reused";
        assert_eq!(said.matches(reused).count(), 1, "{said}");
        let at_seq = probes
            .iter()
            .find(|q| q["seq"].as_i64() == Some(seq))
            .unwrap();
        assert_eq!(
            p["chosen"]["figures"]["device_gib"].as_f64(),
            at_seq["device_bytes"]
                .as_f64()
                .map(|b| b / (1u64 << 30) as f64),
            "{p:#}"
        );
        longest.push(seq);
    }
    assert!(longest[0] <= longest[1], "{longest:?}");
    assert!(longest[0] < 1024, "the smaller limit binds: {longest:?}");
}

/// A model directory given relative, whose name TOML must escape (a quote and a backslash): the
/// recipe names it absolute, as TOML, so `compile --config` takes it from another directory.
#[test]
fn a_recipe_names_its_model_dir_absolute_in_toml() {
    let dir = tempdir("plan-recipe-model");
    let name = "we\"ird\\model";
    std::fs::create_dir_all(dir.join(name)).unwrap();
    std::fs::copy(
        fixtures().join("model/config.json"),
        dir.join(name).join("config.json"),
    )
    .unwrap();
    let o = xtrain_cmd()
        .current_dir(&dir)
        .args(["plan", "--model", name, "--seq", "32", "--remat", "layer"])
        .args([
            "--offload",
            "none",
            "--key-block",
            "off",
            "--loss-chunk",
            "16",
        ])
        .args(["--mlp-chunk", "off", "--grad-accum", "1", "--out", "plan"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recipe = dir.join("plan/recipe.toml");
    let text = std::fs::read_to_string(&recipe).unwrap();
    let table: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let model = std::path::PathBuf::from(table["model"].as_str().unwrap());
    assert!(model.is_absolute(), "{text}");
    assert_eq!(
        model.canonicalize().unwrap(),
        dir.join(name).canonicalize().unwrap()
    );
    let o = xtrain_cmd()
        .current_dir(std::env::temp_dir())
        .args(["compile", "--config"])
        .arg(&recipe)
        .arg("--out")
        .arg(dir.join("program"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// What a plan is given that no machine has is refused before anything is compiled: a device
/// memory limit above the device's (an RTX 4090's 23.99 GiB; this machine's memory), a host
/// budget above this machine's memory, and a mesh of more devices than the plan has. A
/// `--seq-limit` above the model's positions is said, not taken silently.
#[test]
fn limits_no_machine_has_are_refused_before_compiling() {
    let dir = tempdir("plan-refusals");
    let out = dir.join("plan");
    let out = out.to_str().unwrap();
    let plan = |args: &[&str]| {
        let mut all = vec![
            "plan",
            "--model",
            "tiny-llama3",
            "--seq",
            "64",
            "--out",
            out,
        ];
        all.extend(args);
        fails(&all)
    };
    let e = plan(&["--target", "cuda:rtx4090:1", "--memory-limit-gib", "60"]);
    assert!(
        e.contains("--memory-limit-gib 60: more than a device of cuda:rtx4090:1 has")
            && e.contains("23.99 GiB"),
        "{e}"
    );
    let e = plan(&["--memory-limit-gib", "1000000"]);
    assert!(
        e.contains("more than a device of this machine's cpu plugin (1 device) has"),
        "{e}"
    );
    let e = plan(&["--host-memory-limit-gib", "1000000"]);
    assert!(e.contains("more than this machine has per device"), "{e}");
    let o = xtrain(&[
        "plan",
        "--model",
        "tiny-llama3",
        "--seq",
        "max",
        "--seq-limit",
        "1000000",
        "--mesh",
        "fsdp=2",
        "--out",
        out,
    ]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        e.contains("--seq-limit 1000000 is more than the model's 131072 positions"),
        "{e}"
    );
    assert!(
        e.contains(
            "--mesh fsdp=2 is a mesh of 2 devices, and this machine's cpu plugin (1 \
                    device) has 1 device"
        ),
        "{e}"
    );
    assert!(!e.contains("compil"), "refused before compiling: {e}");
    assert!(!dir.join("plan").exists());
}

/// A GPU described by a file has no known peak: the plan gives no time rather than a made-up
/// one, says so, and budgets a consumer card's host memory.
#[test]
fn a_gpu_without_a_known_peak_gets_no_modelled_time() {
    let dir = tempdir("plan-no-peak");
    let described = xtrain(&["targets", "cuda:rtx4090"]);
    assert!(described.status.success());
    let config = dir.join("mygpu.txtpb");
    std::fs::write(&config, &described.stdout).unwrap();
    let (p, said) = plan_and_log(
        &[
            "--target",
            "cuda:mygpu:1",
            "--target-config",
            config.to_str().unwrap(),
            "--dtype",
            "bf16",
            "--seq",
            "64",
            "--remat",
            "layer",
            "--offload",
            "none",
            "--key-block",
            "off",
            "--loss-chunk",
            "off",
            "--mlp-chunk",
            "off",
            "--grad-accum",
            "1",
        ],
        &dir.join("plan"),
    );
    chosen(&p);
    assert!(said.contains("no peak known: no time modelled"), "{said}");
    assert!(p["chosen"]["figures"]["model_s"].is_null(), "{p:#}");
    assert!(
        p["method"].as_str().unwrap().contains("no time given"),
        "{p:#}"
    );
    let host = p["limits"]["host_from"].as_str().unwrap();
    assert!(host.contains("--target-config"), "{host}");
}

/// Ctrl-C during a plan ends it at once with exit code 130, saying that nothing was written,
/// and leaves neither `--out` nor a temp directory of its compiles behind.
#[test]
fn ctrl_c_during_a_plan_says_nothing_was_written() {
    let dir = tempdir("plan-ctrl-c");
    let out = dir.join("plan");
    let child = xtrain_cmd()
        .args(["plan", "--model", "tiny-llama3", "--seq", "64", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Into its compiles (the first takes seconds).
    std::thread::sleep(std::time::Duration::from_secs(3));
    let pid = child.id();
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(
        err.contains("interrupted; nothing was written to") && err.contains("written whole"),
        "{err}"
    );
    assert!(!out.exists());
    let left: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("xtrain-dumps-{pid}-")))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

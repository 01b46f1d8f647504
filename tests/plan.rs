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
/// which only 4 microbatches fit (save-proj: 4018, 2755 and 2059 KiB with 1, 2 and 4); the
/// recipe compiles and checks as it is.
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
    assert_eq!(flags["grad-accum"], "4", "{p:#}");
    assert_eq!(
        flags["offload"], "none",
        "the CPU plugin offloads nothing: {p:#}"
    );
    let recipe = dir.join("searched/recipe.toml");
    let text = std::fs::read_to_string(&recipe).unwrap();
    assert!(
        text.contains("grad_accum = 4") && !text.contains("[compile]"),
        "{text}"
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

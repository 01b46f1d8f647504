//! `xtrain` from the command line, as a user runs it.

mod common;
use common::*;
use xtrain::formats::safetensors::SafeTensors;

#[test]
fn train_reproduces_the_oracle_losses_and_adapter_step3() {
    let f = fixtures();
    let out = tempdir("oracle-train");
    let status = oracle_train_cmd(&f, &out).status().unwrap();
    assert!(status.success());
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    // The first step's line says where the time before it went, the step-0 evaluation too,
    // and the parts (which run one after another) add up to no more than the total.
    let before = &rows[0]["time_to_first_step"];
    let part = |k: &str| {
        before[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} in {before}"))
    };
    let parts = ["data_s", "compile_s", "load_s", "eval_s", "first_step_s"];
    let sum: f64 = parts.iter().map(|k| part(k)).sum();
    assert!(sum <= part("total_s") + 1e-3, "{before}");
    for k in ["read_s", "convert_s", "upload_s"] {
        part(k);
    }
    assert!(rows[1].get("time_to_first_step").is_none());
    for (i, (row, want)) in rows.iter().zip([6.63896, 6.45776, 6.28345]).enumerate() {
        assert_eq!(row["step"], i as u64 + 1);
        let loss = row["loss"].as_f64().unwrap();
        assert!(
            (loss - want).abs() <= 1e-4,
            "step {}: loss {loss} vs {want}",
            i + 1
        );
    }
    // The saved adapter is PEFT's format with the oracle's step-3 weights.
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("step-3/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 8);
    assert_eq!(cfg["lora_alpha"].as_f64(), Some(16.0));
    let mut targets: Vec<String> = cfg["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    targets.sort();
    assert_eq!(
        targets,
        [
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj"
        ]
    );
    let ours = SafeTensors::open(&out.join("step-3/adapter_model.safetensors")).unwrap();
    let want = SafeTensors::open(&f.join("adapter_step3/adapter_model.safetensors")).unwrap();
    assert_eq!(
        ours.tensors.keys().collect::<Vec<_>>(),
        want.tensors.keys().collect::<Vec<_>>()
    );
    for name in want.tensors.keys() {
        let (a, b) = (
            ours.read(name).unwrap().to_f32().unwrap(),
            want.read(name).unwrap().to_f32().unwrap(),
        );
        let d = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(d <= 1e-5, "{name} differs by {d} (tolerance 1e-5)");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn plugins_lists_the_cpu_plugin_with_version_and_devices() {
    let out = xtrain(&["plugins"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cpu ("), "{text}");
    assert!(text.contains("PJRT C API 0.81"), "{text}");
    assert!(text.contains("4 devices"), "{text}");
}

#[test]
fn a_mismatched_init_adapter_is_refused() {
    let f = fixtures();
    let out = tempdir("mismatch");
    let o = train_cmd(&f.join("model"), &f.join("inputs.safetensors"), &out)
        .arg("--init-adapter")
        .arg(f.join("adapter_init"))
        .args(["--lora-r", "4", "--lora-alpha", "16", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("has r=8") && err.contains("ask for r=4"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn a_second_run_loads_the_compiled_step_from_the_cache() {
    let f = fixtures();
    let cache = tempdir("exe-cache");
    let plugin = pjrt::discover::resolve_or_install(Some("cpu")).unwrap();
    let run = |out: &str| {
        let o = train_cmd(
            &f.join("model"),
            &f.join("inputs.safetensors"),
            &cache.join(out),
        )
        .env("XTRAIN_CACHE_DIR", &cache)
        .args([
            "-v",
            "--steps",
            "1",
            "--lora-r",
            "4",
            "--log-every",
            "0",
            "--no-plot",
            "--plugin",
        ])
        .arg(&plugin)
        .output()
        .unwrap();
        assert!(o.status.success());
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    assert!(run("a").contains("xtrain: compiled the step"));
    assert!(run("b").contains("xtrain: loaded the compiled step from the cache"));
    // Beside each executable lies the lock its makers take turns under (`.NAME.lock`, see
    // pjrt::once), and nothing else.
    let names: Vec<String> = std::fs::read_dir(cache.join("executables"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let (locks, executables): (Vec<&String>, Vec<&String>) = names
        .iter()
        .partition(|n| n.starts_with('.') && n.ends_with(".lock"));
    assert_eq!(
        executables.len(),
        1,
        "one executable, keyed by program, options and plugin: {names:?}"
    );
    assert!(locks.len() <= 1, "{names:?}");
    std::fs::remove_dir_all(&cache).unwrap();
}

/// `compile --lr`: compile takes train's optimizer flags but the learning rate, an argument of
/// each step; it says so (clap's own answer was the nearest flag, `--lora-r`).
#[test]
fn compile_says_the_learning_rate_is_not_part_of_the_program() {
    for lr in [&["--lr", "1e-3"][..], &["--lr=1e-3"]] {
        let args = [
            &["compile", "--model", "tiny-llama3", "--out", "unused"][..],
            lr,
        ]
        .concat();
        let o = xtrain(&args);
        let e = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert!(
            e.contains(
                "`xtrain compile` takes no --lr: the learning rate is an argument of each step"
            ),
            "{e}"
        );
    }
}

/// `xtrain compile --help` and `xtrain plan --help` name every preset `--model` takes.
#[test]
fn compile_help_names_every_preset() {
    for command in ["compile", "plan"] {
        let o = xtrain(&[command, "--help"]);
        let help = String::from_utf8_lossy(&o.stdout).replace('\n', " ");
        for (name, _) in xtrain::model::presets::PRESETS {
            assert!(help.contains(name), "{command}: {name} is not in:\n{help}");
        }
    }
}

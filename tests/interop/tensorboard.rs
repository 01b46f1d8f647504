//! TensorBoard curves, read back by TensorBoard's own readers: every scalar at its step, as
//! metrics.jsonl has it, and a resumed run's steps once each.

use super::*;

/// TensorBoard's reader on a run dir: {tag: [(step, value, wall time)]}.
fn tensorboard_scalars(logdir: &Path) -> serde_json::Map<String, Value> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value, e.wall_time] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let o = std::process::Command::new(tensorboard_python())
        .arg("-c")
        .arg(script)
        .arg(logdir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "TensorBoard's reader failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice::<Value>(&o.stdout)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

/// What TensorBoard's app shows (`plugin_event_accumulator`, scalars as tensors) on a run dir:
/// {tag: [(step, value, wall time)]}.
fn tensorboard_app_scalars(logdir: &Path) -> serde_json::Map<String, Value> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import plugin_event_accumulator as pea
from tensorboard.util import tensor_util
acc = pea.EventAccumulator(sys.argv[1], size_guidance={pea.TENSORS: 0})
acc.Reload()
print(json.dumps({t: [[e.step, float(tensor_util.make_ndarray(e.tensor_proto)), e.wall_time] for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}))
"#;
    let o = std::process::Command::new(tensorboard_python())
        .arg("-c")
        .arg(script)
        .arg(logdir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "TensorBoard's reader failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice::<Value>(&o.stdout)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

/// A run that logged to step 5, resumed from its checkpoint-3 and stopped after step 4: both of
/// TensorBoard's readers show steps 1 to 4 once each, with the values metrics.jsonl has, step 4
/// the resumed run's (logged after it started), and not the first run's steps 4 and 5 (they
/// showed step 4 twice and the stale step 5).
#[test]
fn tensorboard_after_a_resume_shows_each_step_once_as_metrics_jsonl_does() {
    let dir = tempdir("tensorboard-resume");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    let lines: String = (0..8)
        .map(|i| format!("{{\"text\": \"example number {i} of a few\"}}\n"))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let out = dir.join("run");
    let common = [
        "--batch-size",
        "1",
        "--seq",
        "32",
        "--lora-r",
        "4",
        "--log-every",
        "0",
    ];
    let o = train_cmd(&model, &data, &out)
        .args(["--steps", "5", "--save-every", "3", "--no-plot"])
        .args(common)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The same run resumes deterministically (the same losses): whose step 4 is shown is told
    // by its wall time.
    let resumed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(out.join("checkpoint-3"))
        .arg("--model")
        .arg(&model)
        .arg("--data")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .args(["--stop-after", "1"])
        .args(common)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let metrics: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|m: &Value| m.get("loss").is_some())
        .collect();
    let want: Vec<(u64, f64)> = metrics
        .iter()
        .map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(
        want.iter().map(|w| w.0).collect::<Vec<_>>(),
        vec![1, 2, 3, 4],
        "{metrics:?}"
    );
    let tb = out.join("tensorboard");
    for (reader, scalars) in [
        ("EventAccumulator", tensorboard_scalars(&tb)),
        ("plugin_event_accumulator", tensorboard_app_scalars(&tb)),
    ] {
        let got: Vec<(u64, f64, f64)> = scalars["train/loss"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let f = |i: usize| p[i].as_f64().unwrap();
                (p[0].as_u64().unwrap(), f(1), f(2))
            })
            .collect();
        assert_eq!(got.len(), want.len(), "{reader}: {got:?} vs {want:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g.0 == w.0 && (g.1 - w.1).abs() <= 1e-6 * w.1.abs(),
                "{reader}: {got:?} vs metrics.jsonl {want:?}"
            );
        }
        assert!(
            got[3].2 > resumed_at && got[2].2 < resumed_at,
            "{reader}: step 4 is the resumed run's, step 3 the first run's: {got:?} (resumed at {resumed_at})"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One event file, read by TensorBoard's own reader: every scalar at its step, with the value
/// metrics.jsonl has (of a run with held-out examples and --peak-tflops, so that every tag is
/// there).
#[test]
fn tensorboard_reads_every_scalar_of_a_run_at_its_step_as_metrics_jsonl_has_it() {
    let dir = tempdir("tensorboard-scalars");
    let out = recipe_run_on_a_repo_id_and_parquet(&dir);
    let (steps, evals) = steps_and_evals(&out);
    let tb = out.join("tensorboard");
    let files: Vec<String> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        files.len() == 1 && files[0].starts_with("events.out.tfevents."),
        "{files:?}"
    );
    let scalars = tensorboard_scalars(&tb);
    let series = |tag: &str| -> Vec<(u64, f64)> {
        scalars
            .get(tag)
            .unwrap_or_else(|| panic!("no {tag} in {:?}", scalars.keys()))
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    for (tag, key, rows) in [
        ("train/loss", "loss", &steps),
        ("train/lr", "lr", &steps),
        ("train/grad_norm", "grad_norm", &steps),
        ("eval/loss", "eval_loss", &evals),
        ("eval/accuracy", "eval_accuracy", &evals),
    ] {
        let got = series(tag);
        assert_eq!(got.len(), rows.len(), "{tag}: {got:?}");
        for ((step, v), m) in got.iter().zip(rows.iter()) {
            assert_eq!(*step, m["step"].as_u64().unwrap(), "{tag}");
            assert!(
                close(*v, m[key].as_f64().unwrap()),
                "{tag} at {step}: {v} vs {}",
                m[key]
            );
        }
    }
    for tag in ["train/tokens_per_s", "train/mfu"] {
        let got = series(tag);
        assert_eq!(
            got.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![1, 2, 3],
            "{tag}"
        );
        assert!(got.iter().all(|p| p.1 > 0.0), "{tag}: {got:?}");
    }
    // tokens/s is the step's tokens over its time, as metrics.jsonl has them.
    for ((_, v), m) in series("train/tokens_per_s").iter().zip(&steps) {
        let want = m["tokens"].as_f64().unwrap() / m["step_time_s"].as_f64().unwrap();
        assert!((v - want).abs() <= 1e-3 * want, "{v} vs {want}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

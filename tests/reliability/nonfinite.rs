//! Numerical faults: a non-finite or blown-up update is not applied, and the run says how many
//! steps it skipped.

use super::*;

#[test]
fn a_blown_up_update_stops_with_the_state_from_before_it() {
    let dir = tempdir("rel-nan");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // lr 1e30: step 1's loss and gradient are finite, and so is its update, but it would move
    // the LoRA weights by about 1e30 (step 2's loss was NaN, and the "last good state" was step
    // 1's, with weights of 1e30). It is refused, and the state from before it kept.
    let a = train_on(&model, &out, &["--lr", "1e30", "--steps", "3"]);
    let e = fails(&refs(&a));
    assert!(
        e.contains("step 1: the update blows the LoRA weights up: it would move one by")
            && e.contains("more than 1000 times the largest LoRA weight before it")
            && e.contains("stopped without applying it"),
        "{e}"
    );
    let ckpt = out.join("checkpoint-0");
    assert!(e.contains(&ckpt.display().to_string()), "{e}");
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&ckpt.join("adapter_model.safetensors"))
            .unwrap();
    for name in st.tensors.keys() {
        let v = st.read(name).unwrap().to_f32().unwrap();
        assert!(
            v.iter().all(|x| x.abs() < 1.0),
            "{name}: the last good state is the fresh adapter"
        );
    }
    assert!(!out.join("checkpoint-1").exists());
    // Its data position is before step 1's batch (it was after it: a resume skipped the batch).
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(
        (state["step"].as_u64(), state["position"].as_u64()),
        (Some(0), Some(0))
    );
    // The way on with other settings is said.
    assert!(
        e.contains("--init-adapter") && e.contains("another --out"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skipped_steps_are_counted_at_the_end_of_the_run() {
    let dir = tempdir("rel-skip-some");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // A linear decay from lr 300 over 4 steps (300, 225, 150, 75): the tiny model's largest
    // LoRA weight is 0.125, and AdamW's bias-corrected first moves (lr, then 0.74 lr at the
    // second step count) blow steps 1 and 2 up, past 1000 times that, so they are skipped;
    // steps 3 and 4 move the weights by less and are applied.
    let a = train_on(
        &model,
        &out,
        &[
            "--lr",
            "300",
            "--schedule",
            "linear",
            "--steps",
            "4",
            "--skip-nonfinite-steps",
        ],
    );
    let o = xtrain(&refs(&a));
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("xtrain: skipped 2 of 4 steps"), "{err}");
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(m.matches("\"nonfinite\":true").count(), 2, "{m}");
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skipping_every_step_fails_and_writes_no_adapter() {
    let dir = tempdir("rel-skip-all");
    let model = fixtures().join("model");
    let out = dir.join("out");
    let a = train_on(
        &model,
        &out,
        &["--lr", "1e30", "--steps", "4", "--skip-nonfinite-steps"],
    );
    let e = fails_after_notes(&refs(&a));
    assert!(e.contains("xtrain: skipped 4 of 4 steps"), "{e}");
    assert!(
        e.contains("error: every step of the run was skipped (4 of 4): nothing was trained, so no adapter is written"),
        "{e}"
    );
    assert!(!out.join("adapter").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_nonfinite_guard_covers_the_updated_state() {
    let dir = tempdir("rel-nonfinite-update");
    let model = fixtures().join("model");
    let out = dir.join("out");
    // lr 1e38 is finite, and so are step 1's loss and gradient; lr / (1 - beta1) is not (f32).
    let e = fails(&refs(&train_on(&model, &out, &["--lr", "1e38"])));
    assert!(
        e.contains("step 1: the loss") && e.contains("but the update is not"),
        "{e}"
    );
    let ckpt = out.join("checkpoint-0");
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&ckpt.join("adapter_model.safetensors"))
            .unwrap();
    for name in st.tensors.keys() {
        let v = st.read(name).unwrap().to_f32().unwrap();
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{name}: the last good state is finite"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An adapter holding a NaN (a checkpoint of a run that blew up, a damaged file) is refused when
/// it is read, naming the tensor: as `--init-adapter` it was trained from (every step NaN, and
/// its "last good state" held the NaN too), and merged or exported as it was.
#[test]
fn an_adapter_holding_a_nan_is_refused_when_it_is_read() {
    let dir = tempdir("rel-nan-adapter");
    let mut first = String::new();
    let bad = edited_adapter(
        &dir.join("adapter"),
        "adapter_init",
        |_| {},
        |t| {
            let (name, v) = t.iter_mut().next().unwrap();
            let mut values = v.to_f32().unwrap();
            values[3] = f32::NAN;
            *v = pjrt::HostTensor::from_f32(&values, &v.dims);
            first = name.clone();
        },
    );
    let model = fixtures().join("model");
    let out = dir.join("out");
    let o = train_cmd(&model, &fixtures().join("inputs.safetensors"), &out)
        .args(["--lora-r", "8", "--lora-alpha", "16", "--init-adapter"])
        .arg(&bad)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && !e.contains("panicked"), "{e}");
    assert!(
        e.contains(&format!("tensor `{first}` holds NaN at element 3")),
        "{e}"
    );
    assert!(!out.join("checkpoint-0").exists());
    let merged = dir.join("merged");
    let e = fails(&[
        "merge",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        bad.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(e.contains("holds NaN"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A NaN in the base model's weights (a damaged file, a bad conversion) makes step 1's loss NaN
/// before any update: the error points at the weights, the adapter or the data, not at --lr
/// (which plays no part in a step's loss), and writes no checkpoint of the state as loaded.
#[test]
fn a_nan_at_the_first_step_points_at_the_weights_not_the_learning_rate() {
    let dir = tempdir("rel-nan-weights");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixtures().join("model").join(f), model.join(f)).unwrap();
    }
    let st = xtrain::formats::safetensors::SafeTensors::open(
        &fixtures().join("model/model.safetensors"),
    )
    .unwrap();
    let mut tensors = std::collections::BTreeMap::new();
    for name in st.tensors.keys() {
        let mut t = st.read(name).unwrap();
        if name == "model.norm.weight" {
            let mut values = t.to_f32().unwrap();
            values[1] = f32::NAN;
            t = pjrt::HostTensor::from_f32(&values, &t.dims);
        }
        tensors.insert(name.clone(), t);
    }
    xtrain::formats::safetensors::write(&model.join("model.safetensors"), &tensors, &st.metadata)
        .unwrap();
    let out = dir.join("out");
    let a = train_on(&model, &out, &["--steps", "3"]);
    let e = fails(&refs(&a));
    assert!(
        e.contains("step 1: the loss is NaN")
            && e.contains("before any update")
            && e.contains("--model's tensors")
            && !e.contains("lower --lr"),
        "{e}"
    );
    assert!(!out.join("checkpoint-0").exists(), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

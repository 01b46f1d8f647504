//! Adapters made elsewhere: PEFT's `rank_pattern` and `alpha_pattern` (per-module ranks and
//! alphas) are honoured by `xtrain merge` and `xtrain generate` (the forward pass), and refused
//! by name where training would need one rank and one alpha (`--init-adapter`).

mod common;

use common::{edited_adapter, fails, fixtures, tempdir, xtrain};
use pjrt::HostTensor;
use std::collections::BTreeMap;
use std::path::Path;
use xtrain::formats::safetensors::SafeTensors;

/// Apply `f` to the values of every q_proj tensor named `which` (A or B).
fn map_q(
    t: &mut BTreeMap<String, HostTensor>,
    which: &str,
    f: impl Fn(&[f32], &[i64]) -> (Vec<f32>, Vec<i64>),
) {
    for (name, v) in t.iter_mut() {
        if name.contains("q_proj") && name.contains(&format!("lora_{which}")) {
            let (values, dims) = f(&v.to_f32().unwrap(), &v.dims);
            *v = HostTensor::from_f32(&values, &dims);
        }
    }
}

fn merge(adapter: &Path, out: &Path) -> BTreeMap<String, Vec<f32>> {
    let o = xtrain(&[
        "merge",
        "--model",
        fixtures().join("model").to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let st = SafeTensors::open(&out.join("model.safetensors")).unwrap();
    st.tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap().to_f32().unwrap()))
        .collect()
}

/// The largest difference between two merged checkpoints, relative to the largest value.
fn max_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    let mut d = 0.0f32;
    for (k, va) in a {
        for (x, y) in va.iter().zip(&b[k]) {
            d = d.max((x - y).abs() / x.abs().max(y.abs()).max(1.0));
        }
    }
    d
}

/// Logits of the tiny model on a fixed row, with an adapter applied as `generate` applies it.
fn logits(model: &Path, adapter: Option<&Path>) -> Vec<f32> {
    let cfg = xtrain::model::config::LlamaConfig::load(model).unwrap();
    let rt = xtrain::device::runtime::Runtime::open(Some("cpu"), Some(1)).unwrap();
    let a = adapter.map(|a| xtrain::formats::peft::load_adapter(a, &cfg).unwrap());
    let f = xtrain::device::generate::Forward::new(
        &rt,
        &cfg,
        model,
        a.as_ref().map(|(c, t)| (c, t)),
        xtrain::device::generate::Kind::Full,
        1,
        16,
        hlo::DType::F32,
    )
    .unwrap();
    let ids: Vec<i32> = (0..16).map(|i| i * 31 % 500).collect();
    let t = |v: &[i32]| HostTensor::from_i32(v, &[1, 16]);
    f.full(&t(&ids), &t(&ids), &t(&[1; 16])).unwrap().0
}

#[test]
fn alpha_pattern_is_honoured_by_merge_and_generate_and_refused_for_training() {
    let dir = tempdir("alpha-pattern");
    // q_proj at alpha 64 instead of 16: its scale is 64/8, the others' 16/8.
    let patterned = edited_adapter(
        &dir.join("patterned"),
        "adapter_step3",
        |c| c["alpha_pattern"] = serde_json::json!({"q_proj": 64}),
        |_| {},
    );
    // What PEFT computes with it: the same adapter without the pattern, q's B times 64/16.
    let scaled = edited_adapter(
        &dir.join("scaled"),
        "adapter_step3",
        |_| {},
        |t| {
            map_q(t, "B", |v, d| {
                (v.iter().map(|x| x * 4.0).collect(), d.to_vec())
            })
        },
    );
    let plain = fixtures().join("adapter_step3");
    let (mp, ms, m0) = (
        merge(&patterned, &dir.join("mp")),
        merge(&scaled, &dir.join("ms")),
        merge(&plain, &dir.join("m0")),
    );
    let d = max_diff(&mp, &ms);
    assert!(d < 1e-6, "merge with alpha_pattern differs by {d}");
    assert!(
        max_diff(&mp, &m0) > 1e-4,
        "the pattern changes the merged q_proj"
    );
    // generate's forward pass: base + patterned adapter = the merged model.
    let model = fixtures().join("model");
    let (with, merged) = (
        logits(&model, Some(&patterned)),
        logits(&dir.join("mp"), None),
    );
    let d = with
        .iter()
        .zip(&merged)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(d < 1e-4, "adapter-applied logits differ from merged by {d}");
    // Training from it is refused, naming the pattern.
    let e = fails(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        fixtures().join("inputs.safetensors").to_str().unwrap(),
        "--out",
        dir.join("run").to_str().unwrap(),
        "--init-adapter",
        patterned.to_str().unwrap(),
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--steps",
        "1",
        "--log-every",
        "0",
    ]);
    assert!(
        e.contains("`alpha_pattern` [(\"q_proj\", 64.0)]") && e.contains("xtrain merge honour"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rank_pattern_is_honoured_and_named_in_shape_errors() {
    let dir = tempdir("rank-pattern");
    // q_proj at rank 4: its A's first 4 rows and B's first 4 columns; scale 16/4.
    let first4 = |t: &mut BTreeMap<String, HostTensor>| {
        map_q(t, "A", |v, d| {
            (v[..4 * d[1] as usize].to_vec(), vec![4, d[1]])
        });
        map_q(t, "B", |v, d| {
            let r = d[1] as usize;
            let rows: Vec<f32> = v.chunks(r).flat_map(|row| row[..4].to_vec()).collect();
            (rows, vec![d[0], 4])
        });
    };
    let patterned = edited_adapter(
        &dir.join("patterned"),
        "adapter_step3",
        |c| c["rank_pattern"] = serde_json::json!({"q_proj": 4}),
        first4,
    );
    // The same at rank 8: q's rows and columns 4..8 zero, its B times (16/4)/(16/8) = 2.
    let padded = edited_adapter(
        &dir.join("padded"),
        "adapter_step3",
        |_| {},
        |t| {
            map_q(t, "A", |v, d| {
                let keep = 4 * d[1] as usize;
                let w: Vec<f32> = v
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| if i < keep { x } else { 0.0 })
                    .collect();
                (w, d.to_vec())
            });
            map_q(t, "B", |v, d| {
                let r = d[1] as usize;
                let w: Vec<f32> = v
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| if i % r < 4 { 2.0 * x } else { 0.0 })
                    .collect();
                (w, d.to_vec())
            });
        },
    );
    let d = max_diff(
        &merge(&patterned, &dir.join("mp")),
        &merge(&padded, &dir.join("mq")),
    );
    assert!(d < 1e-6, "merge with rank_pattern differs by {d}");
    let model = fixtures().join("model");
    let (with, merged) = (
        logits(&model, Some(&patterned)),
        logits(&dir.join("mp"), None),
    );
    let d = with
        .iter()
        .zip(&merged)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(d < 1e-4, "adapter-applied logits differ from merged by {d}");
    // A pattern the tensors do not follow: the error names the pattern.
    let wrong = edited_adapter(
        &dir.join("wrong"),
        "adapter_step3",
        |c| c["rank_pattern"] = serde_json::json!({"k_proj": 4}),
        first4,
    );
    let e = fails(&[
        "merge",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        wrong.to_str().unwrap(),
        "--out",
        dir.join("mw").to_str().unwrap(),
    ]);
    assert!(e.contains("rank_pattern [(\"k_proj\", 4)]"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An adapter for fewer layers than the model is refused naming both depths; `target_modules`
/// as PEFT's "all-linear" is the seven projections, and as another string (a regular expression
/// to PEFT) is refused with how to write it.
#[test]
fn a_shallower_adapter_and_a_string_target_modules_are_said_as_such() {
    let dir = tempdir("adapter-depth-targets");
    let model = fixtures().join("model");
    let merge_fails = |adapter: &std::path::Path, out: &str| {
        fails(&[
            "merge",
            "--model",
            model.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--out",
            dir.join(out).to_str().unwrap(),
        ])
    };
    let shallow = edited_adapter(
        &dir.join("shallow"),
        "adapter_step3",
        |_| {},
        |t| t.retain(|k, _| !k.contains(".layers.1.")),
    );
    let e = merge_fails(&shallow, "m1");
    assert!(
        e.contains("the adapter has tensors for 1 layer only, but the model has 2 layers")
            && e.contains("shallower model"),
        "{e}"
    );
    let all = edited_adapter(
        &dir.join("all-linear"),
        "adapter_step3",
        |c| c["target_modules"] = serde_json::json!("all-linear"),
        |_| {},
    );
    let (a, plain) = (
        merge(&all, &dir.join("ma")),
        merge(&fixtures().join("adapter_step3"), &dir.join("mp")),
    );
    assert_eq!(max_diff(&a, &plain), 0.0);
    let regex = edited_adapter(
        &dir.join("regex"),
        "adapter_step3",
        |c| c["target_modules"] = serde_json::json!(".*_proj"),
        |_| {},
    );
    let e = merge_fails(&regex, "m2");
    assert!(
        e.contains("`target_modules` is the string \".*_proj\"") && e.contains("as a list"),
        "{e}"
    );
}

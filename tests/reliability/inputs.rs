//! Bad models, checkpoints, data, tokenizers and adapters: refused naming the file, the tensor or
//! the line.

use super::*;
use std::collections::BTreeMap;

// ---------------------------------------------------------------- model dirs and configs

/// The fixture model copied to `dir/name`, its config.json changed by `edit`.
fn model_with_config(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let m = tiny_dir(dir, name);
    let path = m.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(&path, c.to_string()).unwrap();
    m
}

#[test]
fn a_model_dir_that_does_not_exist_is_refused_and_no_output_dir_is_made() {
    let dir = tempdir("rel-config-missing");
    let out = dir.join("out");
    let e = fails(&refs(&train_on(&dir.join("nope"), &out, &[])));
    assert!(
        e.contains("model directory") && e.contains("nope does not exist"),
        "{e}"
    );
    assert!(!out.exists(), "no output dir for a run that never started");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--model tiny-llama3` names a built-in config, which has no weights to train: said as such
/// (it said "model directory tiny-llama3 does not exist").
#[test]
fn train_with_a_preset_name_as_model_says_it_is_a_config_without_weights() {
    let dir = tempdir("rel-model-preset");
    let out = dir.join("out");
    let o = xtrain_cmd()
        .current_dir(&dir)
        .args(refs(&train_on(Path::new("tiny-llama3"), &out, &[])))
        .output()
        .unwrap();
    let e = stderr_of(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.starts_with(
            "error: --model tiny-llama3 is a built-in config without weights (usable by \
             `xtrain compile` and `xtrain bench`); `xtrain train` needs a model directory or a \
             Hugging Face repo id with weights"
        ),
        "{e}"
    );
    assert!(!out.exists(), "no output dir for a run that never started");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_config_json_that_is_not_json_is_refused() {
    let dir = tempdir("rel-config-not-json");
    let m = tiny_dir(&dir, "badjson");
    std::fs::write(m.join("config.json"), "{ not json").unwrap();
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(e.contains("config.json is not valid JSON"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unsupported_rope_scaling_type_in_the_config_is_refused_naming_the_field() {
    let dir = tempdir("rel-config-yarn");
    let m = model_with_config(&dir, "yarn", |c| {
        c["rope_scaling"]["rope_type"] = "yarn".into()
    });
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("field `rope_scaling.rope_type` = \"yarn\" is not supported"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unsupported_activation_in_the_config_is_refused_naming_the_field() {
    let dir = tempdir("rel-config-act");
    let m = model_with_config(&dir, "act", |c| c["hidden_act"] = "gelu".into());
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("field `hidden_act` = \"gelu\" is not supported"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_config_with_fewer_layers_than_its_checkpoint_is_refused() {
    let dir = tempdir("rel-layers");
    let m = tiny_dir(&dir, "fewer");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    c["num_hidden_layers"] = 1.into();
    std::fs::write(m.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("the checkpoint has 2 layers") && e.contains("num_hidden_layers = 1"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- safetensors

/// The fixture model's model.safetensors, as bytes.
fn fixture_weights() -> Vec<u8> {
    std::fs::read(fixtures().join("model/model.safetensors")).unwrap()
}

/// The fixture model copied to `dir/name` with `bytes` as its model.safetensors.
fn model_with_weights_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let m = tiny_dir(dir, name);
    std::fs::write(m.join("model.safetensors"), bytes).unwrap();
    m
}

/// The fixture model copied to `dir/name` with `tensors` written as its model.safetensors.
fn model_with_tensors(
    dir: &Path,
    name: &str,
    tensors: &BTreeMap<String, pjrt::HostTensor>,
) -> PathBuf {
    let m = tiny_dir(dir, name);
    xtrain::formats::safetensors::write(&m.join("model.safetensors"), tensors, &Default::default())
        .unwrap();
    m
}

#[test]
fn a_truncated_safetensors_file_is_refused() {
    let dir = tempdir("rel-st-trunc");
    let good = fixture_weights();
    let m = model_with_weights_file(&dir, "trunc", &good[..good.len() / 2]);
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(e.contains("(truncated?)"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_safetensors_file_with_bytes_after_its_last_tensor_is_refused() {
    let dir = tempdir("rel-st-trailing");
    let mut longer = fixture_weights();
    longer.extend_from_slice(b"trailing");
    let m = model_with_weights_file(&dir, "trailing", &longer);
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("(trailing bytes: not a safetensors file?)"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_safetensors_header_that_is_not_json_is_refused() {
    let dir = tempdir("rel-st-header");
    let mut bad = fixture_weights();
    bad[8] = b'x'; // the header's opening brace
    let m = model_with_weights_file(&dir, "header", &bad);
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(e.contains("header is not valid JSON"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tensor_of_the_wrong_shape_is_refused_naming_it_and_both_shapes() {
    let dir = tempdir("rel-st-shape");
    let mut wrong = all_tensors(&fixtures().join("model/model.safetensors"));
    wrong.insert(
        "model.layers.1.mlp.up_proj.weight".into(),
        pjrt::HostTensor::from_f32(&vec![0.0; 64 * 64], &[64, 64]),
    );
    let m = model_with_tensors(&dir, "shape", &wrong);
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(e.contains("tensor `model.layers.1.mlp.up_proj.weight` has shape [64, 64] but the config needs [128, 64]"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tensor_missing_from_the_checkpoint_is_refused_naming_it() {
    let dir = tempdir("rel-st-missing");
    let mut all = all_tensors(&fixtures().join("model/model.safetensors"));
    all.remove("model.norm.weight");
    let m = model_with_tensors(&dir, "missing", &all);
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("the checkpoint has no tensor `model.norm.weight`"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_index_naming_a_shard_that_does_not_exist_is_refused() {
    let dir = tempdir("rel-st-shard");
    let m = dir.join("sharded");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(fixtures().join("model_sharded")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, m.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(m.join("model-00003-of-00006.safetensors")).unwrap();
    let e = fails(&refs(&train_on(&m, &dir.join("out"), &[])));
    assert!(
        e.contains("to shard model-00003-of-00006.safetensors, which does not exist"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- data and tokenizers

/// `train` of `model` on `data` into `out`: one step of batch 1 x 32, r=4.
fn train_32(model: &Path, data: &Path, out: &Path) -> Vec<String> {
    let mut v: Vec<String> = ["train", "--model", model.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(["--data".into(), data.to_str().unwrap().into()]);
    v.extend(["--out".into(), out.to_str().unwrap().into()]);
    v.extend(
        [
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--seq",
            "32",
            "--lora-r",
            "4",
            "--log-every",
            "0",
            "--no-plot",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    v
}

/// A file `name` in `dir` holding `text`.
fn write_in(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// One example of 100 x's: 101 tokens with the tiny text model's tokenizer, more than --seq 32.
fn long_example(dir: &Path) -> PathBuf {
    write_in(
        dir,
        "long.jsonl",
        &format!("{{\"text\": \"{}\"}}\n", "x".repeat(100)),
    )
}

#[test]
fn a_jsonl_text_that_is_a_number_is_refused_naming_the_line_and_what_it_is() {
    let dir = tempdir("rel-data-bad-line");
    let model = tiny_text_model(&dir);
    let bad = write_in(&dir, "bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 3}\n");
    let e = fails(&refs(&train_32(&model, &bad, &dir.join("out"))));
    assert!(
        e.contains(
            "bad.jsonl:2: `text` is a number (3), not a string (expected `text`, `instruction` + \
             `output`, or `messages`)"
        ),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_dataset_with_no_usable_examples_is_refused() {
    let dir = tempdir("rel-data-empty");
    let model = tiny_text_model(&dir);
    let empty = write_in(&dir, "empty.jsonl", "\n\n");
    let e = fails(&refs(&train_32(&model, &empty, &dir.join("out"))));
    assert!(e.contains("empty.jsonl: no usable examples"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_example_longer_than_seq_is_refused_with_strict_length() {
    let dir = tempdir("rel-data-strict");
    let model = tiny_text_model(&dir);
    let mut a = train_32(&model, &long_example(&dir), &dir.join("out"));
    a.push("--strict-length".into());
    let e = fails(&refs(&a));
    assert!(
        e.contains("example 1 has 101 tokens, more than --seq 32"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_example_longer_than_seq_is_truncated_and_said_without_strict_length() {
    let dir = tempdir("rel-data-truncate");
    let model = tiny_text_model(&dir);
    let o = xtrain(&refs(&train_32(
        &model,
        &long_example(&dir),
        &dir.join("out-long"),
    )));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated 1 examples to --seq 32"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_model_dir_without_tokenizer_json_is_refused() {
    let dir = tempdir("rel-data-no-tokenizer");
    let nt = tiny_dir(&dir, "no-tokenizer");
    let e = fails(&refs(&train_32(&nt, &long_example(&dir), &dir.join("out"))));
    assert!(e.contains("has no tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tokenizer_larger_than_the_models_vocabulary_is_refused() {
    let dir = tempdir("rel-data-big-vocab");
    let model = tiny_text_model(&dir);
    let big = dir.join("big-vocab");
    std::fs::create_dir_all(&big).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(model.join(f), big.join(f)).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(big.join("config.json")).unwrap()).unwrap();
    c["vocab_size"] = 200.into();
    std::fs::write(big.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_32(
        &big,
        &long_example(&dir),
        &dir.join("out"),
    )));
    assert!(
        e.contains("the tokenizer has 259 tokens but the model's vocabulary is 200"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_token_id_outside_the_vocabulary_is_refused_naming_its_row_and_position() {
    let dir = tempdir("rel-token-range");
    let mut t = all_tensors(&fixtures().join("inputs.safetensors"));
    let mut ids = t["input_ids"].to_i64().unwrap();
    ids[17] = 9999;
    t.insert(
        "input_ids".into(),
        pjrt::HostTensor::from_i64(&ids, &[2, 16]),
    );
    let data = dir.join("oob.safetensors");
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    let mut a = train_on(&fixtures().join("model"), &dir.join("out"), &[]);
    a[4] = data.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("token id 9999 at batch row 1, position 1 is outside the vocabulary (0..512)"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The fixture batch with one tensor replaced, written into `dir`.
fn batch_with(dir: &std::path::Path, name: &str, values: Vec<i64>) -> std::path::PathBuf {
    let mut t = all_tensors(&fixtures().join("inputs.safetensors"));
    t.insert(name.into(), pjrt::HostTensor::from_i64(&values, &[2, 16]));
    let data = dir.join(format!("{name}.safetensors"));
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    data
}

#[test]
fn a_label_outside_the_vocabulary_is_refused_naming_the_file_its_row_and_position() {
    let dir = tempdir("rel-label-range");
    for bad in [600, -5] {
        let mut labels = vec![1i64; 32];
        labels[20] = bad;
        let data = batch_with(&dir, "labels", labels);
        let mut a = train_on(&fixtures().join("model"), &dir.join("out"), &[]);
        a[4] = data.to_str().unwrap().into();
        let e = fails(&refs(&a));
        assert!(
            e.contains(&format!(
                "labels.safetensors: label {bad} at batch row 1, position 4 is neither a token of \
                 the vocabulary (0..512) nor -100"
            )),
            "{e}"
        );
        assert!(!dir.join("out").join("adapter").exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_batch_whose_every_label_is_minus_100_is_refused_as_having_no_loss() {
    let dir = tempdir("rel-label-none");
    // Only the first position of each row carries a label, and it is never predicted.
    let labels = (0..32)
        .map(|i| if i % 16 == 0 { 3 } else { -100 })
        .collect();
    let data = batch_with(&dir, "labels", labels);
    let mut a = train_on(&fixtures().join("model"), &dir.join("out"), &[]);
    a[4] = data.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(e.contains("no position carries a loss"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The fixture batch as packed rows (row 0: documents at 0 and 6; row 1: three padding tokens,
/// then documents at 3 and 10), with `labels`, written into `dir/name.safetensors`.
fn packed_batch_with(dir: &Path, name: &str, labels: impl Fn(usize, i64) -> i64) -> PathBuf {
    let mut t = all_tensors(&fixtures().join("inputs.safetensors"));
    let mask: Vec<i64> = (0..16)
        .map(|p| if p < 6 { 1 } else { 7 })
        .chain((0..16).map(|p| match p {
            0..3 => 0,
            3..10 => 4,
            _ => 11,
        }))
        .collect();
    let ids = t["input_ids"].to_i64().unwrap();
    let labels: Vec<i64> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| labels(i, id))
        .collect();
    t.insert(
        "labels".into(),
        pjrt::HostTensor::from_i64(&labels, &[2, 16]),
    );
    t.insert(
        "attention_mask".into(),
        pjrt::HostTensor::from_i64(&mask, &[2, 16]),
    );
    let data = dir.join(format!("{name}.safetensors"));
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    data
}

/// The losses `train` logs on `data` (2 steps), and what it said.
fn losses_on(data: &Path, out: &Path) -> (Vec<f64>, String) {
    let mut a = train_on(&fixtures().join("model"), out, &[]);
    a[4] = data.to_str().unwrap().into();
    let o = xtrain(&refs(&a));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let losses = m
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["loss"].as_f64())
        .collect();
    (losses, err)
}

/// A pre-tokenized packed batch whose labels are its input ids (`labels = input_ids`, with no
/// -100 at the documents' first tokens nor on padding) trains as the same batch with -100 there
/// (Hugging Face's `DataCollatorWithFlattening`): the last token of a document does not learn
/// to predict the next document's first, and padding carries no loss. Said once. (It trained
/// across documents and on padding: another loss.)
#[test]
fn a_packed_batch_with_labels_at_document_starts_and_padding_trains_as_with_minus_100_there() {
    let dir = tempdir("rel-packed-labels");
    let starts = [0usize, 6, 16, 17, 18, 19, 26];
    let careful = packed_batch_with(
        &dir,
        "careful",
        |i, id| {
            if starts.contains(&i) {
                -100
            } else {
                id
            }
        },
    );
    let careless = packed_batch_with(&dir, "careless", |_, id| id);
    let (want, said) = losses_on(&careful, &dir.join("a"));
    assert!(!said.contains("carry no loss"), "{said}");
    let (got, said) = losses_on(&careless, &dir.join("b"));
    assert_eq!(
        got, want,
        "losses with labels at document starts and on padding"
    );
    assert!(
        said.contains(
            "careless.safetensors: 5 of its 30 labels after a row's first position \
             are at a document's first token or on padding (by `attention_mask`): they carry no \
             loss"
        ),
        "{said}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Labels only on padding and at documents' first tokens: no position carries a loss (it
/// trained on them).
#[test]
fn a_batch_whose_labels_are_only_on_padding_and_document_starts_has_no_loss() {
    let dir = tempdir("rel-packed-no-loss");
    let starts = [0usize, 6, 16, 17, 18, 19, 26];
    let data = packed_batch_with(
        &dir,
        "pads",
        |i, id| {
            if starts.contains(&i) {
                id
            } else {
                -100
            }
        },
    );
    let mut a = train_on(&fixtures().join("model"), &dir.join("out"), &[]);
    a[4] = data.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("no position carries a loss") && e.contains("on padding"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A batch without `attention_mask` is taken as all ones, and the run says so.
#[test]
fn a_batch_without_an_attention_mask_is_said_to_be_taken_as_all_ones() {
    let dir = tempdir("rel-no-mask");
    let mut t = all_tensors(&fixtures().join("inputs.safetensors"));
    t.remove("attention_mask");
    let data = dir.join("nomask.safetensors");
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    let (_, said) = losses_on(&data, &dir.join("out"));
    assert!(
        said.contains(
            "nomask.safetensors has no `attention_mask`: taken as all ones (every token real, \
             one document per row)"
        ),
        "{said}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Float labels (a `labels` tensor saved as F32) are refused in safetensors' words, not XLA's
/// ("cannot convert F32 to S32").
#[test]
fn float_labels_are_refused_naming_the_file_and_the_type_in_safetensors_words() {
    let dir = tempdir("rel-float-labels");
    let mut t = all_tensors(&fixtures().join("inputs.safetensors"));
    let ids = t["input_ids"].to_i64().unwrap();
    let floats: Vec<f32> = ids.iter().map(|&x| x as f32).collect();
    t.insert(
        "labels".into(),
        pjrt::HostTensor::from_f32(&floats, &[2, 16]),
    );
    let data = dir.join("float.safetensors");
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    let mut a = train_on(&fixtures().join("model"), &dir.join("out"), &[]);
    a[4] = data.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains(
            "float.safetensors: `labels` holds F32 values, but token ids, labels and attention \
             masks are whole numbers: save it as I64 (torch.long) or I32"
        ) && !e.contains("S32"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A length that comes from a pre-tokenized batch, with no `--seq` given, is named as the
/// batch's, not as `--seq 16`: in the context split's refusal and in the evaluation data's
/// report.
#[test]
fn a_batchs_length_is_not_called_seq_when_no_seq_was_given() {
    let dir = tempdir("rel-batch-length");
    let ids: Vec<i64> = (0..40).map(|i| (i * 7 + 3) % 500).collect();
    let b20 = dir.join("b20.safetensors");
    let t = [
        (
            "input_ids".to_string(),
            pjrt::HostTensor::from_i64(&ids, &[2, 20]),
        ),
        (
            "attention_mask".to_string(),
            pjrt::HostTensor::from_i64(&[1; 40], &[2, 20]),
        ),
    ];
    xtrain::formats::safetensors::write(&b20, &t.into(), &Default::default()).unwrap();
    let mut a = train_on(&fixtures().join("model"), &dir.join("out"), &[]);
    a[4] = b20.to_str().unwrap().into();
    a.extend(["--mesh", "context=4", "--key-block", "2"].map(String::from));
    let e = fails(&refs(&a));
    assert!(
        e.contains("the batch's length 20 (b20.safetensors is 2x20: a pre-tokenized batch sets the length) must be a multiple of 8")
            && !e.contains("--seq 20"),
        "{e}"
    );
    let model = tiny_text_model(&dir);
    let eval = dir.join("eval.jsonl");
    let long = "x".repeat(40);
    std::fs::write(
        &eval,
        format!("{{\"instruction\": \"{long}\", \"output\": \"ok\"}}\n{{\"instruction\": \"a\", \"output\": \"b\"}}\n"),
    )
    .unwrap();
    let mut a = train_on(
        &model,
        &dir.join("out2"),
        &["--eval-data", eval.to_str().unwrap()],
    );
    a[4] = fixtures()
        .join("inputs.safetensors")
        .to_str()
        .unwrap()
        .into();
    let err = stderr_of(&xtrain(&refs(&a)));
    assert!(
        err.contains("within the 16 tokens of inputs.safetensors's rows")
            && !err.contains("--seq 16"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- adapters

/// `--init-adapter` alone takes the adapter's rank, alpha and targets for the flags left out
/// (as `--resume` takes a checkpoint's), and says so; it was refused for the default rank.
#[test]
fn an_init_adapter_without_lora_flags_takes_its_rank_and_alpha() {
    let dir = tempdir("rel-adapter-takes-rank");
    let f = fixtures();
    let out = dir.join("out");
    let o = xtrain_cmd()
        .args(["train", "--model"])
        .arg(f.join("model"))
        .arg("--data")
        .arg(f.join("inputs.safetensors"))
        .arg("--out")
        .arg(&out)
        .arg("--init-adapter")
        .arg(f.join("adapter_init"))
        .args(["--steps", "1", "--log-every", "0", "--no-plot"])
        .output()
        .unwrap();
    let e = stderr_of(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("taking --lora-r 8, --lora-alpha 16 from --init-adapter"),
        "{e}"
    );
    let config = std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap();
    assert!(config.contains("\"r\": 8"), "{config}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_init_adapter_of_another_rank_is_refused_naming_both_and_its_targets() {
    let dir = tempdir("rel-adapter-rank");
    let init = fixtures().join("adapter_init");
    let e = fails(&refs(&train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &[
            "--init-adapter",
            init.to_str().unwrap(),
            "--lora-alpha",
            "16",
        ],
    )));
    assert!(e.contains("has r=8") && e.contains("ask for r=4"), "{e}");
    assert!(
        e.contains("targets q,k,v,o,gate,up,down"),
        "targets as users write them: {e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With `--program` and no LoRA flag, the LoRA settings are the program dir's: a refused
/// `--init-adapter` names the program dir as their source (it said "the flags ask for").
#[test]
fn an_init_adapter_that_is_not_the_program_dirs_lora_names_the_program_dir() {
    let dir = tempdir("rel-adapter-program");
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        fixtures().join("model").to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "16",
        "--lora-r",
        "16",
        "--lora-alpha",
        "16",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let f = fixtures();
    let e = fails_after_notes(&[
        "train",
        "--program",
        prog.to_str().unwrap(),
        "--model",
        f.join("model").to_str().unwrap(),
        "--data",
        f.join("inputs.safetensors").to_str().unwrap(),
        "--out",
        dir.join("out").to_str().unwrap(),
        "--init-adapter",
        f.join("adapter_init").to_str().unwrap(),
        "--steps",
        "1",
    ]);
    assert!(
        e.contains(&format!(
            "has r=8, alpha=16, targets q,k,v,o,gate,up,down, but program dir {} was built for r=16",
            prog.display()
        )),
        "{e}"
    );
    assert!(!e.contains("the flags ask for"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_init_adapter_tensor_of_the_wrong_shape_is_refused_naming_it_and_both_shapes() {
    let dir = tempdir("rel-adapter-shape");
    let init = fixtures().join("adapter_init");
    let bad = dir.join("bad-adapter");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(
        init.join("adapter_config.json"),
        bad.join("adapter_config.json"),
    )
    .unwrap();
    let mut at = all_tensors(&init.join("adapter_model.safetensors"));
    at.insert(
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight".into(),
        pjrt::HostTensor::from_f32(&vec![0.0; 64 * 8], &[64, 8]),
    );
    xtrain::formats::safetensors::write(
        &bad.join("adapter_model.safetensors"),
        &at,
        &Default::default(),
    )
    .unwrap();
    let mut a = train_on(
        &fixtures().join("model"),
        &dir.join("out"),
        &[
            "--init-adapter",
            bad.to_str().unwrap(),
            "--lora-alpha",
            "16",
        ],
    );
    let pos = a.iter().position(|s| s == "--lora-r").unwrap();
    a[pos + 1] = "8".into();
    let e = fails(&refs(&a));
    assert!(e.contains("tensor `base_model.model.model.layers.0.mlp.up_proj.lora_B.weight` has shape [64, 8] but rank 8 on this model needs [128, 8]"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- evaluation examples and data quirks

/// `train` of `model` on `data` into `dir/out`: one step of batch 1 x 64, r=4, with `extra`.
fn train_64(
    model: &Path,
    data: &Path,
    dir: &Path,
    out: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut c = train_cmd(model, data, &dir.join(out));
    c.args([
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--seq",
        "64",
        "--lora-r",
        "4",
    ]);
    c.args(["--log-every", "0", "--no-plot"]);
    c.args(extra);
    c.output().unwrap()
}

/// 94 instruction examples in `dir/train.jsonl`.
fn train_jsonl(dir: &Path) -> PathBuf {
    write_in(dir, "train.jsonl", &say_examples(94))
}

/// `dir/eval.jsonl`: an example whose prompt alone fills --seq 64 (so no target token fits),
/// then a short one.
fn eval_jsonl(dir: &Path) -> PathBuf {
    let long = "x".repeat(80);
    write_in(
        dir,
        "eval.jsonl",
        &format!("{{\"instruction\": \"{long}\", \"output\": \"y\"}}\n{{\"instruction\": \"a\", \"output\": \"b\"}}\n"),
    )
}

#[test]
fn a_byte_order_mark_before_the_first_line_is_read_as_json_not_skipped() {
    let dir = tempdir("rel-eval-bom");
    let model = tiny_text_model(&dir);
    let train = write_in(
        &dir,
        "train.jsonl",
        &format!("\u{feff}{}", say_examples(94)),
    );
    let o = train_64(
        &model,
        &train,
        &dir,
        "bom",
        &["--skip-bad-lines", "--eval-fraction", "0.01"],
    );
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("skipped"), "{err}");
    // All 94 read: the first line was not dropped.
    assert!(err.contains("holding out 1 of 94 examples"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_eval_fraction_that_rounds_to_nothing_holds_out_one_example() {
    let dir = tempdir("rel-eval-fraction");
    let model = tiny_text_model(&dir);
    let o = train_64(
        &model,
        &train_jsonl(&dir),
        &dir,
        "run",
        &["--eval-fraction", "0.01"],
    );
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("holding out 1 of 94 examples"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn evaluation_examples_with_no_target_token_within_seq_are_counted() {
    let dir = tempdir("rel-eval-left-out");
    let model = tiny_text_model(&dir);
    let eval = eval_jsonl(&dir);
    let o = train_64(
        &model,
        &train_jsonl(&dir),
        &dir,
        "eval",
        &["--eval-data", eval.to_str().unwrap()],
    );
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("eval: left out 1 of 2 examples with no target token within --seq 64"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn evaluation_examples_longer_than_seq_are_refused_with_strict_length() {
    let dir = tempdir("rel-eval-strict");
    let model = tiny_text_model(&dir);
    let eval = eval_jsonl(&dir);
    let o = train_64(
        &model,
        &train_jsonl(&dir),
        &dir,
        "strict",
        &["--eval-data", eval.to_str().unwrap(), "--strict-length"],
    );
    let err = stderr_of(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("(evaluation examples)") && err.contains("more than --seq 64"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_data_with_a_pre_tokenized_batch_is_evaluated() {
    let dir = tempdir("rel-eval-batch");
    let model = tiny_text_model(&dir);
    let short = write_in(&dir, "short.jsonl", "{\"text\": \"ab\"}\n");
    let batch = fixtures().join("inputs.safetensors");
    let o = train_cmd(&model, &batch, &dir.join("batch"))
        .args([
            "--steps",
            "1",
            "--lora-r",
            "4",
            "--log-every",
            "0",
            "--no-plot",
        ])
        .args(["--eval-data", short.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    let m = std::fs::read_to_string(dir.join("batch/metrics.jsonl")).unwrap();
    assert!(m.contains("eval_loss"), "{m}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn batch_size_and_seq_that_contradict_a_pre_tokenized_batch_are_refused() {
    let dir = tempdir("rel-eval-batch-shape");
    let model = tiny_text_model(&dir);
    let batch = fixtures().join("inputs.safetensors");
    let o = train_64(&model, &batch, &dir, "batch2", &[]);
    assert!(!o.status.success());
    assert!(
        stderr_of(&o).contains("is one pre-tokenized batch of 2x16"),
        "{}",
        stderr_of(&o)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- chat templates

/// The tiny text model in `dir` with `cfg` as its tokenizer_config.json.
fn model_with_tokenizer_config(dir: &Path, cfg: serde_json::Value) -> PathBuf {
    let model = tiny_text_model(dir);
    std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    model
}

#[test]
fn a_list_form_chat_template_is_used_not_replaced_by_chatml() {
    let dir = tempdir("rel-template-list");
    let model = model_with_tokenizer_config(
        &dir,
        serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS{% for m in messages %}{{ m.content }}{% endfor %}"},
                {"name": "default", "template": "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"}
            ],
            "eos_token": "<|im_end|>"
        }),
    );
    let tok = xtrain::data::text::TextTokenizer::load(&model).unwrap();
    let msg = xtrain::data::text::Message {
        role: "user".into(),
        content: "hi".into(),
    };
    assert_eq!(tok.render_chat(&[msg], false).unwrap(), "[user: hi]");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A list without a `default` is refused, as transformers refuses it.
#[test]
fn a_list_form_chat_template_without_a_default_is_refused() {
    let dir = tempdir("rel-template-list-no-default");
    let model = model_with_tokenizer_config(
        &dir,
        serde_json::json!({"chat_template": [{"name": "tool_use", "template": "x"}]}),
    );
    let e = format!(
        "{:#}",
        xtrain::data::text::TextTokenizer::load(&model)
            .err()
            .unwrap()
    );
    assert!(e.contains("none named `default`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- max_position_embeddings

/// Refused by `compile` and by `train` alike, with the same message.
#[test]
fn a_seq_longer_than_the_models_max_position_embeddings_is_refused_naming_both() {
    let dir = tempdir("rel-max-positions");
    let model = model_with_max_positions(&dir, 64);
    let m = model.to_str().unwrap();
    let want = "--seq 128 is longer than the model's max_position_embeddings 64 (config.json)";
    let prog = dir.join("prog");
    let e = fails(&[
        "compile",
        "--model",
        m,
        "--batch",
        "1",
        "--seq",
        "128",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(e.contains(want), "{e}");
    assert!(!prog.exists());
    let data = write_in(&dir, "d.jsonl", "{\"text\": \"hello\"}\n");
    let o = train_cmd(&model, &data, &dir.join("run"))
        .args(["--seq", "128", "--batch-size", "1", "--steps", "1"])
        .output()
        .unwrap();
    let e = stderr_of(&o);
    assert!(!o.status.success() && e.starts_with("error: "), "{e}");
    assert!(e.contains(want), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_seq_at_the_models_max_position_embeddings_trains() {
    let dir = tempdir("rel-max-positions-at");
    let model = model_with_max_positions(&dir, 64);
    let data = write_in(&dir, "d.jsonl", "{\"text\": \"hello\"}\n");
    let o = train_cmd(&model, &data, &dir.join("run"))
        .args([
            "--seq",
            "64",
            "--batch-size",
            "1",
            "--steps",
            "1",
            "--lora-r",
            "4",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr_of(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

//! Bad models, checkpoints, data, tokenizers and adapters: refused naming the file, the tensor or
//! the line.

use super::*;

#[test]
fn bad_model_dirs_and_configs() {
    let dir = tempdir("rel-config");
    let out = dir.join("out");
    let e = fails(&refs(&train_on(&dir.join("nope"), &out, &[])));
    assert!(
        e.contains("model directory") && e.contains("nope does not exist"),
        "{e}"
    );
    assert!(!out.exists(), "no output dir for a run that never started");

    let m = tiny_dir(&dir, "badjson");
    std::fs::write(m.join("config.json"), "{ not json").unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("config.json is not valid JSON"), "{e}");

    let m = tiny_dir(&dir, "yarn");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    c["rope_scaling"]["rope_type"] = "yarn".into();
    std::fs::write(m.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("field `rope_scaling.rope_type` = \"yarn\" is not supported"),
        "{e}"
    );

    let m = tiny_dir(&dir, "act");
    c = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("model/config.json")).unwrap(),
    )
    .unwrap();
    c["hidden_act"] = "gelu".into();
    std::fs::write(m.join("config.json"), c.to_string()).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("field `hidden_act` = \"gelu\" is not supported"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_safetensors() {
    let dir = tempdir("rel-st");
    let out = dir.join("out");
    let good = std::fs::read(fixtures().join("model/model.safetensors")).unwrap();

    let m = tiny_dir(&dir, "trunc");
    std::fs::write(m.join("model.safetensors"), &good[..good.len() / 2]).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("(truncated?)"), "{e}");

    let m = tiny_dir(&dir, "trailing");
    let mut longer = good.clone();
    longer.extend_from_slice(b"trailing");
    std::fs::write(m.join("model.safetensors"), &longer).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("(trailing bytes: not a safetensors file?)"),
        "{e}"
    );

    let m = tiny_dir(&dir, "header");
    let mut bad = good.clone();
    bad[8] = b'x'; // the header's opening brace
    std::fs::write(m.join("model.safetensors"), &bad).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("header is not valid JSON"), "{e}");

    // A tensor with the wrong shape, and one missing: rewrite the file.
    let st = xtrain::formats::safetensors::SafeTensors::open(
        &fixtures().join("model/model.safetensors"),
    )
    .unwrap();
    let mut all: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    let m = tiny_dir(&dir, "shape");
    let mut wrong = all.clone();
    wrong.insert(
        "model.layers.1.mlp.up_proj.weight".into(),
        pjrt::HostTensor::from_f32(&vec![0.0; 64 * 64], &[64, 64]),
    );
    xtrain::formats::safetensors::write(&m.join("model.safetensors"), &wrong, &Default::default())
        .unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(e.contains("tensor `model.layers.1.mlp.up_proj.weight` has shape [64, 64] but the config needs [128, 64]"), "{e}");
    let m = tiny_dir(&dir, "missing");
    all.remove("model.norm.weight");
    xtrain::formats::safetensors::write(&m.join("model.safetensors"), &all, &Default::default())
        .unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("the checkpoint has no tensor `model.norm.weight`"),
        "{e}"
    );

    // An index pointing at a shard that is not there.
    let m = dir.join("sharded");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(fixtures().join("model_sharded")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, m.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(m.join("model-00003-of-00006.safetensors")).unwrap();
    let e = fails(&refs(&train_on(&m, &out, &[])));
    assert!(
        e.contains("to shard model-00003-of-00006.safetensors, which does not exist"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_data_and_tokenizers() {
    let dir = tempdir("rel-data");
    let out = dir.join("out");
    let model = tiny_text_model(&dir);
    let m = model.to_str().unwrap();
    let jsonl = |name: &str, text: &str| -> String {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let base = |data: &str| -> Vec<String> {
        [
            "train",
            "--model",
            m,
            "--data",
            data,
            "--out",
            out.to_str().unwrap(),
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
        .map(|s| s.to_string())
        .collect()
    };
    let bad = jsonl("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 3}\n");
    let e = fails(&refs(&base(&bad)));
    assert!(
        e.contains(
            "bad.jsonl:2: `text` is a number (3), not a string (expected `text`, `instruction` + \
             `output`, or `messages`)"
        ),
        "{e}"
    );
    let empty = jsonl("empty.jsonl", "\n\n");
    let e = fails(&refs(&base(&empty)));
    assert!(e.contains("empty.jsonl: no usable examples"), "{e}");
    let long = jsonl(
        "long.jsonl",
        &format!("{{\"text\": \"{}\"}}\n", "x".repeat(100)),
    );
    let mut a = base(&long);
    a.push("--strict-length".into());
    let e = fails(&refs(&a));
    assert!(
        e.contains("example 1 has 101 tokens, more than --seq 32"),
        "{e}"
    );
    // Without --strict-length it truncates and says so.
    let mut a = base(&long);
    a[6] = dir.join("out-long").to_str().unwrap().into();
    let o = xtrain(&refs(&a));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("truncated 1 examples to --seq 32"));

    // No tokenizer.json.
    let nt = tiny_dir(&dir, "no-tokenizer");
    let mut a = base(&long);
    a[2] = nt.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(e.contains("has no tokenizer.json"), "{e}");
    // A tokenizer larger than the model's vocabulary.
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
    let mut a = base(&long);
    a[2] = big.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("the tokenizer has 259 tokens but the model's vocabulary is 200"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn out_of_range_tokens_bad_adapters_and_program_dirs() {
    let dir = tempdir("rel-misc");
    let out = dir.join("out");
    // Token ids beyond the vocabulary.
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&fixtures().join("inputs.safetensors"))
            .unwrap();
    let mut t: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    let mut ids = t["input_ids"].to_i64().unwrap();
    ids[17] = 9999;
    t.insert(
        "input_ids".into(),
        pjrt::HostTensor::from_i64(&ids, &[2, 16]),
    );
    let data = dir.join("oob.safetensors");
    xtrain::formats::safetensors::write(&data, &t, &Default::default()).unwrap();
    let model = fixtures().join("model");
    let mut a = train_on(&model, &out, &[]);
    a[4] = data.to_str().unwrap().into();
    let e = fails(&refs(&a));
    assert!(
        e.contains("token id 9999 at batch row 1, position 1 is outside the vocabulary (0..512)"),
        "{e}"
    );

    // An adapter of another rank, and one with a wrong shape.
    let init = fixtures().join("adapter_init");
    let e = fails(&refs(&train_on(
        &model,
        &out,
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
    let bad = dir.join("bad-adapter");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(
        init.join("adapter_config.json"),
        bad.join("adapter_config.json"),
    )
    .unwrap();
    let ast =
        xtrain::formats::safetensors::SafeTensors::open(&init.join("adapter_model.safetensors"))
            .unwrap();
    let mut at: std::collections::BTreeMap<String, pjrt::HostTensor> = ast
        .tensors
        .keys()
        .map(|k| (k.clone(), ast.read(k).unwrap()))
        .collect();
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
        &model,
        &out,
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

    // A program dir built for another model.
    let prog = dir.join("prog");
    let o = xtrain(&[
        "compile",
        "--model",
        "llama-3.1-8b",
        "--seq",
        "16",
        "--batch",
        "2",
        "--out",
        prog.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(e.contains("was built for another model"), "{e}");
    // ... or tampered with.
    std::fs::write(prog.join("train_step.mlir"), "module {}").unwrap();
    let e = fails(&refs(&train_on(
        &model,
        &out,
        &["--program", prog.to_str().unwrap()],
    )));
    assert!(e.contains("does not match its manifest"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn evaluation_examples_are_counted_and_data_quirks_are_handled() {
    let dir = tempdir("rel-eval");
    let model = tiny_text_model(&dir);
    let run = |data: &Path, out: &str, extra: &[&str]| -> std::process::Output {
        let mut c = train_cmd(&model, data, &dir.join(out));
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
    };
    let train = dir.join("train.jsonl");
    let lines: String = (0..94)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    // A byte order mark before the first line: read as JSON, not skipped.
    std::fs::write(&train, format!("\u{feff}{lines}")).unwrap();
    let o = run(
        &train,
        "bom",
        &["--skip-bad-lines", "--eval-fraction", "0.01"],
    );
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("skipped"), "{err}");
    assert!(err.contains("holding out 1 of 94 examples"), "{err}");
    // Held-out examples whose answer does not fit --seq: counted, not silently dropped; and with
    // --strict-length, refused.
    let eval = dir.join("eval.jsonl");
    let long = "x".repeat(80);
    std::fs::write(
        &eval,
        format!("{{\"instruction\": \"{long}\", \"output\": \"y\"}}\n{{\"instruction\": \"a\", \"output\": \"b\"}}\n"),
    )
    .unwrap();
    let o = run(&train, "eval", &["--eval-data", eval.to_str().unwrap()]);
    let err = stderr_of(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("eval: left out 1 of 2 examples with no target token within --seq 64"),
        "{err}"
    );
    let o = run(
        &train,
        "strict",
        &["--eval-data", eval.to_str().unwrap(), "--strict-length"],
    );
    let err = stderr_of(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("(evaluation examples)") && err.contains("more than --seq 64"),
        "{err}"
    );
    // --eval-data with a pre-tokenized batch: evaluated, not ignored.
    let short = dir.join("short.jsonl");
    std::fs::write(&short, "{\"text\": \"ab\"}\n").unwrap();
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
    // ... and --batch-size or --seq that contradict the batch's shape are refused.
    let o = run(&batch, "batch2", &[]);
    assert!(!o.status.success());
    assert!(
        stderr_of(&o).contains("is one pre-tokenized batch of 2x16"),
        "{}",
        stderr_of(&o)
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

#[test]
fn a_list_form_chat_template_is_used_not_replaced_by_chatml() {
    let dir = tempdir("rel-template-list");
    let model = tiny_text_model(&dir);
    let cfg = serde_json::json!({
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS{% for m in messages %}{{ m.content }}{% endfor %}"},
            {"name": "default", "template": "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"}
        ],
        "eos_token": "<|im_end|>"
    });
    std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = xtrain::data::text::TextTokenizer::load(&model).unwrap();
    let msg = xtrain::data::text::Message {
        role: "user".into(),
        content: "hi".into(),
    };
    assert_eq!(tok.render_chat(&[msg], false).unwrap(), "[user: hi]");
    // A list without a `default` is refused, as transformers refuses it.
    let cfg = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "x"}]});
    std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let e = format!(
        "{:#}",
        xtrain::data::text::TextTokenizer::load(&model)
            .err()
            .unwrap()
    );
    assert!(e.contains("none named `default`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

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
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello\"}\n").unwrap();
    let out = dir.join("run");
    let o = train_cmd(&model, &data, &out)
        .args(["--seq", "128", "--batch-size", "1", "--steps", "1"])
        .output()
        .unwrap();
    let e = stderr_of(&o);
    assert!(!o.status.success() && e.starts_with("error: "), "{e}");
    assert!(e.contains(want), "{e}");
    // At the limit: trains.
    let o = train_cmd(&model, &data, &out)
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

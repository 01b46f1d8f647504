//! Text data, templates, masking, packing, checkpoints and resume, exports and merge, on the
//! tiny model with a byte-level tokenizer (so every expected id is a byte value).

mod common;
use common::*;
use xtrain::data::text::{Message, TextTokenizer};
use xtrain::data::{self, Example};

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(|b| b as u32).collect()
}

#[test]
fn each_data_shape_renders_with_the_chat_template_and_masks_the_prompt() {
    let dir = tempdir("shapes");
    let model = tiny_text_model(&dir);
    let tok = TextTokenizer::load(&model).unwrap();
    let jsonl = dir.join("d.jsonl");
    std::fs::write(
        &jsonl,
        concat!(
            "{\"text\": \"hello\"}\n",
            "{\"instruction\": \"Add\", \"input\": \"1 2\", \"output\": \"3\"}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n"
        ),
    )
    .unwrap();
    let r = data::read_jsonl(&jsonl, false).unwrap();
    assert_eq!(r.examples[0], Example::Text("hello".into()));
    assert_eq!(
        r.examples[1],
        Example::Chat(vec![
            Message {
                role: "user".into(),
                content: "Add\n\n1 2".into()
            },
            Message {
                role: "assistant".into(),
                content: "3".into()
            }
        ])
    );

    // Text: every token has a loss; ends with the end-of-turn token.
    let t = data::tokenize(&tok, &r.examples[0], false).unwrap();
    let mut want = bytes("hello");
    want.push(257);
    assert_eq!(t.ids, want);
    assert_eq!(t.labels, want.iter().map(|&i| i as i32).collect::<Vec<_>>());

    // Chat: ChatML rendering, ids straight from the tokenizer, loss only after the prompt.
    let c = data::tokenize(&tok, &r.examples[2], false).unwrap();
    let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let full = format!("{prompt}yo<|im_end|>\n");
    assert_eq!(
        tok.render_chat(
            &[Message {
                role: "user".into(),
                content: "hi".into()
            }],
            true
        )
        .unwrap(),
        prompt
    );
    let mut ids = vec![256];
    ids.extend(bytes("user\nhi"));
    ids.extend([257]);
    ids.extend(bytes("\n"));
    ids.push(256);
    ids.extend(bytes("assistant\n"));
    let n_prompt = ids.len();
    ids.extend(bytes("yo"));
    ids.push(257);
    ids.extend(bytes("\n"));
    assert_eq!(c.ids, ids);
    assert_eq!(c.ids, tok.encode(&full).unwrap());
    assert!(
        c.labels[..n_prompt].iter().all(|&l| l == -100),
        "prompt tokens carry no loss"
    );
    assert_eq!(
        &c.labels[n_prompt..],
        &ids[n_prompt..]
            .iter()
            .map(|&i| i as i32)
            .collect::<Vec<_>>()[..]
    );
    // ... unless asked.
    let all = data::tokenize(&tok, &r.examples[2], true).unwrap();
    assert!(all.labels.iter().all(|&l| l != -100));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_lines_name_file_and_line_or_are_skipped_and_counted() {
    let dir = tempdir("badlines");
    let p = dir.join("bad.jsonl");
    std::fs::write(&p, "{\"text\": \"ok\"}\nnot json\n{\"foo\": 1}\n").unwrap();
    let e = data::read_jsonl(&p, false).err().unwrap().to_string();
    assert!(e.contains("bad.jsonl:2: not valid JSON"), "{e}");
    let r = data::read_jsonl(&p, true).unwrap();
    assert_eq!(r.examples.len(), 1);
    assert_eq!(
        r.skipped.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![2, 3]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn packing_padding_and_truncation() {
    let ex = |n: usize| data::Tokenized {
        ids: (1..=n as u32).collect(),
        labels: (1..=n as i32).collect(),
    };
    let exs = vec![ex(3), ex(4), ex(10)];
    let (rows, report) = data::make_rows(&exs, 8, true, 0, false).unwrap();
    // 3 + 4 fit in one row of 8; the 10-token example is truncated into its own row.
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].ids, vec![1, 2, 3, 1, 2, 3, 4, 0]);
    // Each packed example is its own document: 1 + where it starts.
    assert_eq!(rows[0].mask, vec![1, 1, 1, 4, 4, 4, 4, 0]);
    assert_eq!(
        rows[0].labels[3], -100,
        "the first example does not predict the second"
    );
    assert_eq!(rows[0].labels[7], -100);
    assert_eq!(rows[1].ids, (1..=8).collect::<Vec<i32>>());
    assert_eq!(report.truncated, 1);
    let (rows, _) = data::make_rows(&exs[..2], 8, false, 9, false).unwrap();
    assert_eq!(rows[0].ids, vec![1, 2, 3, 9, 9, 9, 9, 9]);
    assert_eq!(rows[0].labels, vec![1, 2, 3, -100, -100, -100, -100, -100]);
    assert!(
        data::make_rows(&exs, 8, true, 0, true).is_err(),
        "strict length refuses truncation"
    );
    // Seeded shuffling: the same order every time, another for another epoch.
    assert_eq!(data::epoch_order(10, 1, 0), data::epoch_order(10, 1, 0));
    assert_ne!(data::epoch_order(10, 1, 0), data::epoch_order(10, 1, 1));
}

fn write_dataset(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("train.jsonl");
    let mut s = String::new();
    for i in 0..24 {
        s.push_str(&format!(
            "{{\"instruction\": \"Echo {i}\", \"output\": \"{i} {i}\"}}\n"
        ));
    }
    std::fs::write(&p, s).unwrap();
    p
}

fn train_args<'a>(model: &'a str, data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        model,
        "--data",
        data,
        "--out",
        out,
        "--steps",
        steps,
        "--batch-size",
        "2",
        "--seq",
        "48",
        "--lr",
        "1e-3",
        "--warmup",
        "2",
        "--schedule",
        "cosine",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--lora-dropout",
        "0.1",
        "--save-every",
        "3",
        "--seed",
        "7",
        "--log-every",
        "0",
        "--no-plot",
    ]
}

#[test]
fn resume_from_a_checkpoint_equals_an_uninterrupted_run() {
    let dir = tempdir("resume");
    let model = tiny_text_model(&dir);
    let data = write_dataset(&dir);
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    let full = dir.join("full");
    let o = xtrain(&train_args(m, d, full.to_str().unwrap(), "6"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Stop after 3 steps, then resume from checkpoint-3 for the remaining steps.
    let part = dir.join("part");
    let mut args = train_args(m, d, part.to_str().unwrap(), "6");
    args.extend(["--stop-after", "3"]);
    let o = xtrain(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = part.join("checkpoint-3");
    let mut args = train_args(m, d, part.to_str().unwrap(), "6");
    args.extend(["--resume", ckpt.to_str().unwrap()]);
    let o = xtrain(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let losses = |p: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(p.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v.get("loss").map(|x| x.to_string()))
            .collect()
    };
    assert_eq!(losses(&full).len(), 6);
    assert_eq!(losses(&full), losses(&part), "same losses, bit for bit");
    let a = std::fs::read(full.join("adapter/adapter_model.safetensors")).unwrap();
    let b = std::fs::read(part.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(a, b, "same final adapter, byte for byte");
    // The checkpoint holds the adapter, the optimizer state and where training was.
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(f).is_file(), "{f}");
    }
    let st: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(st["step"], 3);
    assert_eq!(st["position"], 6, "3 steps of 2 rows");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn peft_export_names_and_shapes_and_merge_equals_adapter_logits() {
    let dir = tempdir("export");
    let model = tiny_text_model(&dir);
    let data = write_dataset(&dir);
    let out = dir.join("run");
    let o = xtrain(&train_args(
        model.to_str().unwrap(),
        data.to_str().unwrap(),
        out.to_str().unwrap(),
        "3",
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let adapter = out.join("adapter");
    let st =
        xtrain::formats::safetensors::SafeTensors::open(&adapter.join("adapter_model.safetensors"))
            .unwrap();
    assert_eq!(st.tensors.len(), 2 * 7 * 2, "2 layers x 7 targets x (A, B)");
    let a = &st.tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"];
    let b = &st.tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"];
    assert_eq!(
        (a.shape.clone(), b.shape.clone()),
        (vec![4, 64], vec![32, 4])
    );
    assert_eq!(st.metadata.get("format").map(String::as_str), Some("pt"));

    // Merge, then compare the merged model's logits with base + adapter.
    let merged = dir.join("merged");
    let o = xtrain(&[
        "merge",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(merged.join("tokenizer.json").is_file());
    let cfg = xtrain::model::config::LlamaConfig::load(&model).unwrap();
    let rt = xtrain::device::runtime::Runtime::open(Some("cpu"), Some(1)).unwrap();
    let (lc, lt) = xtrain::formats::peft::load_adapter(&adapter, &cfg).unwrap();
    let kind = xtrain::device::generate::Kind::Full;
    let with_adapter = xtrain::device::generate::Forward::new(
        &rt,
        &cfg,
        &model,
        Some((&lc, &lt)),
        kind,
        1,
        16,
        hlo::DType::F32,
    )
    .unwrap();
    let merged_fwd = xtrain::device::generate::Forward::new(
        &rt,
        &cfg,
        &merged,
        None,
        kind,
        1,
        16,
        hlo::DType::F32,
    )
    .unwrap();
    let ids: Vec<i32> = (0..16).map(|i| i * 31 % 500).collect();
    let t = |v: &[i32]| pjrt::HostTensor::from_i32(v, &[1, 16]);
    let (l1, _) = with_adapter.full(&t(&ids), &t(&ids), &t(&[1; 16])).unwrap();
    let (l2, _) = merged_fwd.full(&t(&ids), &t(&ids), &t(&[1; 16])).unwrap();
    let d = l1
        .iter()
        .zip(&l2)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        d <= 1e-4,
        "merged logits differ from adapter-applied logits by {d} (tolerance 1e-4)"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

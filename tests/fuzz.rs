//! Mutation fuzzing of the input parsers (cargo fuzz needs nightly, which this project's
//! machines cannot install): thousands of random mutations of valid inputs, each of which must
//! give a result or an error, never a panic.

mod common;
use common::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A random mutation: flip bytes, overwrite with interesting values, truncate, duplicate, insert.
fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        if v.is_empty() {
            v.push(0);
        }
        let i = rng.below(v.len());
        match rng.below(6) {
            0 => v[i] ^= 1 << rng.below(8),
            1 => v[i] = [0u8, 0xFF, 0x7F, 0x80, b'"', b'{', b'9'][rng.below(7)],
            2 => v.truncate(i),
            3 => {
                let j = rng.below(v.len());
                let (a, b) = (i.min(j), i.max(j));
                let chunk = v[a..b].to_vec();
                v.splice(i..i, chunk);
            }
            4 => v.insert(i, rng.next() as u8),
            _ => {
                // overwrite 8 bytes with a huge little-endian integer (lengths, counts, offsets)
                let n = [u64::MAX, 1 << 40, 1 << 62, 0x7FFF_FFFF][rng.below(4)].to_le_bytes();
                for (k, b) in n.iter().enumerate() {
                    if i + k < v.len() {
                        v[i + k] = *b;
                    }
                }
            }
        }
    }
    v
}

/// Iterations: the default keeps `cargo test` quick; XTRAIN_FUZZ_SCALE=100 runs for minutes.
fn iters(n: usize) -> usize {
    n * std::env::var("XTRAIN_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

fn no_panic(what: &str, case: usize, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        panic!("{what}: mutation {case} panicked");
    }
}

#[test]
fn config_parser() {
    let good = std::fs::read(fixtures().join("model/config.json")).unwrap();
    let mut rng = Rng(1);
    for case in 0..iters(3000) {
        let m = mutate(&mut rng, &good);
        no_panic("config.json", case, || {
            if let Ok(j) = serde_json::from_slice::<serde_json::Value>(&m) {
                let _ = xtrain::model::config::LlamaConfig::from_json(&j);
            }
        });
    }
}

#[test]
fn safetensors_header_reader() {
    let dir = tempdir("fuzz-st");
    let good = std::fs::read(fixtures().join("inputs.safetensors")).unwrap();
    let path = dir.join("x.safetensors");
    let mut rng = Rng(2);
    for case in 0..iters(1500) {
        let m = mutate(&mut rng, &good);
        std::fs::write(&path, &m).unwrap();
        no_panic("safetensors", case, || {
            if let Ok(st) = xtrain::formats::safetensors::SafeTensors::open(&path) {
                for name in st.tensors.keys() {
                    let _ = st.read(name);
                }
            }
        });
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A small valid GGUF v3 file: llama metadata, a tokenizer, and one Q8_0 and one F32 tensor.
fn small_gguf() -> Vec<u8> {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend((t.len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(2u64.to_le_bytes()); // tensors
    b.extend(3u64.to_le_bytes()); // metadata
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, "llama");
    s(&mut b, "llama.block_count");
    b.extend(4u32.to_le_bytes());
    b.extend(1u32.to_le_bytes());
    s(&mut b, "tokenizer.ggml.tokens");
    b.extend(9u32.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    s(&mut b, "a");
    s(&mut b, "b");
    s(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    b.extend(8u32.to_le_bytes()); // Q8_0
    b.extend(0u64.to_le_bytes());
    s(&mut b, "output_norm.weight");
    b.extend(1u32.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(0u32.to_le_bytes()); // F32
    b.extend(96u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for blk in 0..2 {
        b.extend(half::f16::from_f32(0.5 + blk as f32).to_le_bytes());
        b.extend((0..32).map(|i| i as u8));
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for v in [1.0f32, 2.0, 3.0, 4.0] {
        b.extend(v.to_le_bytes());
    }
    b
}

#[test]
fn gguf_reader() {
    let good = small_gguf();
    let g = xtrain::formats::gguf::read::Gguf::parse(good.clone()).expect("the seed file is valid");
    assert_eq!(
        g.dequantize(g.tensor("output_norm.weight").unwrap())
            .unwrap(),
        vec![1.0, 2.0, 3.0, 4.0]
    );
    assert_eq!(
        g.dequantize(g.tensor("token_embd.weight").unwrap())
            .unwrap()[33],
        1.5
    );
    let mut rng = Rng(3);
    for case in 0..iters(4000) {
        let m = mutate(&mut rng, &good);
        no_panic("gguf", case, || {
            if let Ok(g) = xtrain::formats::gguf::read::Gguf::parse(m) {
                for t in &g.tensors {
                    let _ = g.dequantize(t);
                }
                let _ = xtrain::formats::gguf::import::hf_config(&g);
                let _ = xtrain::formats::gguf::vocab::hf_tokenizer(&g);
            }
        });
    }
}

#[test]
fn jsonl_data_pipeline() {
    let dir = tempdir("fuzz-jsonl");
    let model = tiny_text_model(&dir);
    let tok = xtrain::data::text::TextTokenizer::load(&model).unwrap();
    let good = concat!(
        "{\"text\": \"hello world\"}\n",
        "{\"instruction\": \"Add\", \"input\": \"1 2\", \"output\": \"3\"}\n",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n"
    )
    .as_bytes();
    let path = dir.join("d.jsonl");
    let mut rng = Rng(4);
    for case in 0..iters(1500) {
        let m = mutate(&mut rng, good);
        std::fs::write(&path, &m).unwrap();
        no_panic("jsonl", case, || {
            for skip in [false, true] {
                if let Ok(r) = xtrain::data::read_jsonl(&path, skip) {
                    let toks: Vec<_> = r
                        .examples
                        .iter()
                        .filter_map(|e| xtrain::data::tokenize(&tok, e, false).ok())
                        .collect();
                    let _ = xtrain::data::make_rows(&toks, 16, true, 0, false);
                    let _ = xtrain::data::make_rows(&toks, 16, false, 0, false);
                }
            }
        });
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

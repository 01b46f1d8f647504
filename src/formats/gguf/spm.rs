//! SentencePiece-style BPE vocabularies (Llama 2's, Mistral v0.1-v0.3's) both ways between
//! tokenizer.json and llama.cpp's `llama` tokenizer model.
//!
//! In tokenizer.json such a vocabulary is BPE over characters with byte fallback (`<0x0A>`...),
//! spaces written `▁`, and a `▁` before the text (a `Metaspace` pre-tokenizer, or in older files
//! a `Prepend` + `Replace` normalizer). llama.cpp's `llama` model holds no merges: it merges
//! the adjacent pair whose joined text is a token of the highest score, so the scores written
//! here rank each token by the first merge that makes it (score -rank), and llama.cpp merges in
//! the order BPE does. Back from a GGUF file, the merges are every split of a token into two
//! tokens, ranked by the joined token's score, as the Hugging Face converter makes them.

use super::ggml::{TOKEN_BYTE, TOKEN_NORMAL};
use anyhow::{bail, Result};
use serde_json::{json, Value as Json};
use std::collections::HashMap;

/// The space character of SentencePiece vocabularies.
const SPACE: &str = "\u{2581}";

/// Whether tokenizer.json `tok` is a SentencePiece-style BPE vocabulary, and if so whether it
/// puts `▁` before the text (llama.cpp's `add_space_prefix`).
pub fn space_prefix(tok: &Json) -> Option<bool> {
    let model = tok.get("model")?;
    if model.get("byte_fallback") != Some(&Json::Bool(true)) {
        return None;
    }
    let kind = |j: &Json| j.get("type").and_then(|t| t.as_str()).map(String::from);
    let pre = tok.get("pre_tokenizer").unwrap_or(&Json::Null);
    if kind(pre).as_deref() == Some("Metaspace") {
        let spaces = pre.get("replacement").and_then(|r| r.as_str()) == Some(SPACE);
        let whole = pre.get("split") == Some(&Json::Bool(false));
        let prefix = pre.get("prepend_scheme").and_then(|p| p.as_str());
        return (spaces && whole).then(|| prefix != Some("never"));
    }
    // The older form: no pre-tokenizer; the normalizer prepends `▁` and writes spaces as `▁`.
    let norm = tok.get("normalizer")?;
    let parts = match kind(norm).as_deref() {
        Some("Sequence") => norm.get("normalizers")?.as_array()?.clone(),
        _ => vec![norm.clone()],
    };
    let replaces = parts.iter().any(|p| {
        kind(p).as_deref() == Some("Replace")
            && p.pointer("/pattern/String").and_then(|s| s.as_str()) == Some(" ")
            && p.get("content").and_then(|c| c.as_str()) == Some(SPACE)
    });
    let prepends = parts.iter().any(|p| {
        kind(p).as_deref() == Some("Prepend")
            && p.get("prepend").and_then(|c| c.as_str()) == Some(SPACE)
    });
    (pre.is_null() && replaces).then_some(prepends)
}

/// Whether a token is one of the 256 byte-fallback tokens (`<0x00>` ... `<0xFF>`).
pub fn is_byte(text: &str) -> bool {
    text.len() == 6
        && text.starts_with("<0x")
        && text.ends_with('>')
        && u8::from_str_radix(&text[3..5], 16).is_ok()
}

/// Each token's score for llama.cpp from BPE `merges` ("left right", in rank order) over the
/// tokens `texts` (by id): -rank of the first merge that makes it; tokens no merge makes (single
/// characters, bytes, specials: never a pair llama.cpp merges) rank below every merge.
pub fn scores(texts: &[String], merges: &[String]) -> Vec<f32> {
    let id: HashMap<&str, usize> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut scores = vec![-(merges.len() as f32) - 1.0; texts.len()];
    for (rank, m) in merges.iter().enumerate().rev() {
        if let Some(&i) = id.get(m.replacen(' ', "", 1).as_str()) {
            scores[i] = -(rank as f32);
        }
    }
    scores
}

/// tokenizer.json's `model`, `pre_tokenizer` and `decoder` for a GGUF `llama` vocabulary: the
/// tokens (by id), their scores and types, and whether llama.cpp puts `▁` before the text.
pub fn hf_parts(
    tokens: &[String],
    scores: &[f32],
    types: &[i64],
    unknown: Option<&str>,
    space_prefix: bool,
) -> Result<(Json, Json, Json)> {
    if scores.len() != tokens.len() {
        bail!(
            "{} scores for {} tokens: a `llama` vocabulary has a score per token",
            scores.len(),
            tokens.len()
        );
    }
    let id: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let normal = |i: usize| types.get(i).is_none_or(|&t| t == TOKEN_NORMAL as i64);
    // Every split of a normal token into two tokens, by the joined token's score (highest
    // first), then the left part's length (shortest first).
    let mut merges: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (i, t) in tokens.iter().enumerate().filter(|&(i, _)| normal(i)) {
        for (k, _) in t.char_indices().skip(1) {
            let (a, b) = t.split_at(k);
            if let (Some(&x), Some(&y)) = (id.get(a), id.get(b)) {
                if normal(x) && normal(y) {
                    merges.push((scores[i], i, k, a, b));
                }
            }
        }
    }
    merges.sort_by(|l, r| r.0.total_cmp(&l.0).then((l.1, l.2).cmp(&(r.1, r.2))));
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let merges: Vec<Json> = merges.iter().map(|m| json!([m.3, m.4])).collect();
    let bytes = types.contains(&(TOKEN_BYTE as i64)) || tokens.iter().any(|t| is_byte(t));
    let model = json!({"type": "BPE", "dropout": null, "unk_token": unknown, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": bytes, "ignore_merges": false, "vocab": vocab, "merges": merges});
    let prepend = if space_prefix { "first" } else { "never" };
    let pre = json!({"type": "Metaspace", "replacement": SPACE, "prepend_scheme": prepend, "split": false});
    let strip = if space_prefix { 1 } else { 0 };
    let decoder = json!({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": strip, "stop": 0}]});
    Ok((model, pre, decoder))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_rank_tokens_by_the_merge_that_makes_them_and_merges_come_back() {
        let texts: Vec<String> = ["<unk>", "<0x41>", "▁", "a", "b", "ab", "▁a", "▁ab"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let merges = vec!["a b".to_string(), "▁ a".to_string(), "▁a b".to_string()];
        let s = scores(&texts, &merges);
        assert_eq!(&s[5..], &[0.0, -1.0, -2.0]);
        assert!(s[3] < -2.0 && s[1] < -2.0);
        let types = [2, 6, 1, 1, 1, 1, 1, 1];
        let (model, pre, _) = hf_parts(&texts, &s, &types, Some("<unk>"), true).unwrap();
        // "▁ab" splits as "▁a"+"b" and "▁"+"ab": both, after the merges of higher scores.
        assert_eq!(
            model["merges"],
            json!([["a", "b"], ["▁", "a"], ["▁", "ab"], ["▁a", "b"]])
        );
        assert_eq!(model["byte_fallback"], true);
        assert_eq!(pre["prepend_scheme"], "first");
        assert!(is_byte("<0x0A>") && !is_byte("<0xZZ>") && !is_byte("<s>"));
        let tok = json!({"model": model, "pre_tokenizer": pre});
        assert_eq!(space_prefix(&tok), Some(true));
        let old = json!({"model": {"byte_fallback": true}, "pre_tokenizer": null, "normalizer":
            {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}});
        assert_eq!(space_prefix(&old), Some(true));
        assert_eq!(
            space_prefix(&json!({"model": {"byte_fallback": false}})),
            None
        );
    }
}

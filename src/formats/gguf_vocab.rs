//! A model directory's tokenizer as llama.cpp's GGUF metadata: the byte-level BPE vocabulary
//! (`tokenizer.ggml.tokens`, `token_type`, `merges`), the pre-tokenizer llama.cpp must split
//! with (`tokenizer.ggml.pre`), the special token ids, whether a BOS is added, and the chat
//! template.
//!
//! llama.cpp chooses its pre-tokenizer regex by the name in `tokenizer.ggml.pre`, so the name
//! must say how `tokenizer.json` splits: Llama 3's regex split is `llama-bpe`, SmolLM's
//! digit-by-digit split before byte-level BPE is `smollm`, plain byte-level is `gpt-2`. Any other
//! pre-tokenizer is refused rather than written under a name that would tokenize differently.

use crate::formats::gguf::LLAMA3_SPLIT;
use crate::formats::gguf_write::Value;
use anyhow::{bail, Context, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

fn read_json(path: &Path) -> Result<Option<Json>> {
    match std::fs::read_to_string(path) {
        Ok(t) => {
            Ok(Some(serde_json::from_str(&t).with_context(|| {
                format!("{} is not valid JSON", path.display())
            })?))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// `tokenizer.ggml.pre` for tokenizer.json's `pre_tokenizer`.
fn pre_name(pre: &Json, path: &Path) -> Result<&'static str> {
    let kind = |j: &Json| {
        j.get("type")
            .and_then(|t| t.as_str())
            .unwrap_or("")
            .to_string()
    };
    let byte_level = |j: &Json| kind(j) == "ByteLevel";
    let parts: Vec<&Json> = match kind(pre).as_str() {
        "Sequence" => pre
            .get("pretokenizers")
            .and_then(|p| p.as_array())
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        _ => vec![pre],
    };
    match parts.as_slice() {
        [b] if byte_level(b) && b.get("use_regex") != Some(&Json::Bool(false)) => Ok("gpt-2"),
        [d, b]
            if kind(d) == "Digits"
                && d.get("individual_digits") == Some(&Json::Bool(true))
                && byte_level(b) =>
        {
            Ok("smollm")
        }
        [s, b]
            if kind(s) == "Split"
                && s.pointer("/pattern/Regex").and_then(|r| r.as_str()) == Some(LLAMA3_SPLIT)
                && byte_level(b) =>
        {
            Ok("llama-bpe")
        }
        _ => bail!(
            "{}: its pre_tokenizer ({}) is not one llama.cpp is known to split the same way \
             (xtrain writes Llama 3's regex split, SmolLM's digit split and GPT-2's byte-level \
             split); a GGUF file would tokenize differently from this model",
            path.display(),
            serde_json::to_string(pre).unwrap_or_default()
        ),
    }
}

/// The id of a token named in tokenizer_config.json (`"<s>"` or `{"content": "<s>"}`).
fn named_id(cfg: &Json, key: &str, ids: &BTreeMap<String, u32>) -> Option<u32> {
    let text = match cfg.get(key)? {
        Json::String(s) => s.clone(),
        Json::Object(o) => o.get("content")?.as_str()?.to_string(),
        _ => return None,
    };
    ids.get(&text).copied()
}

/// The first id of a config's `key` (a number or a list of numbers).
fn config_id(cfg: Option<&Json>, key: &str) -> Option<u32> {
    match cfg?.get(key)? {
        Json::Number(n) => n.as_u64().map(|v| v as u32),
        Json::Array(a) => a.first()?.as_u64().map(|v| v as u32),
        _ => None,
    }
}

/// The chat template of a model directory: tokenizer_config.json's (a string, or the one named
/// `default` in a list), else chat_template.jinja.
fn chat_template(dir: &Path, cfg: &Json) -> Result<Option<String>> {
    match cfg.get("chat_template") {
        Some(Json::String(t)) => return Ok(Some(t.clone())),
        Some(Json::Array(list)) => {
            let t = list
                .iter()
                .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|e| e.get("template")?.as_str());
            if let Some(t) = t {
                return Ok(Some(t.to_string()));
            }
        }
        _ => {}
    }
    match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(t) => Ok(Some(t)),
        Err(_) => Ok(None),
    }
}

/// Whether tokenizer.json's post-processor puts token `bos` before every text.
fn post_processor_adds(tok: &Json, bos: &str) -> bool {
    fn adds(p: &Json, bos: &str) -> bool {
        match p.get("type").and_then(|t| t.as_str()) {
            Some("Sequence") => p
                .get("processors")
                .and_then(|l| l.as_array())
                .is_some_and(|l| l.iter().any(|q| adds(q, bos))),
            Some("TemplateProcessing") => {
                p.get("single")
                    .and_then(|s| s.as_array())
                    .and_then(|s| s.first())
                    .and_then(|first| first.pointer("/SpecialToken/id"))
                    .and_then(|id| id.as_str())
                    == Some(bos)
            }
            _ => false,
        }
    }
    tok.get("post_processor").is_some_and(|p| adds(p, bos))
}

/// The tokenizer metadata of model directory `dir` for a vocabulary of `vocab_size` ids (ids
/// the tokenizer does not use are written as unused `[PAD<id>]` tokens, as llama.cpp's
/// converter does). Also says what it noticed (no chat template) through `note`.
pub fn tokenizer_metadata(
    dir: &Path,
    vocab_size: usize,
    note: &mut dyn FnMut(String),
) -> Result<Vec<(String, Value)>> {
    let path = dir.join("tokenizer.json");
    let tok = read_json(&path)?.with_context(|| {
        format!(
            "{} has no tokenizer.json; a GGUF file carries the tokenizer",
            dir.display()
        )
    })?;
    let model = tok.get("model").context("tokenizer.json has no `model`")?;
    if model.get("type").and_then(|t| t.as_str()) != Some("BPE") {
        bail!(
            "{}: the tokenizer model is {}; xtrain writes byte-level BPE vocabularies (Llama 3, SmolLM)",
            path.display(),
            model.get("type").unwrap_or(&Json::Null)
        );
    }
    let pre = pre_name(tok.get("pre_tokenizer").unwrap_or(&Json::Null), &path)?;
    let (texts, types, ids) = vocabulary(&tok, model, &path, vocab_size)?;
    let merges = merges_of(model, &path)?;

    let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let config = read_json(&dir.join("config.json"))?;
    let generation = read_json(&dir.join("generation_config.json"))?;
    let id_of = |key: &str, id_key: &str| {
        named_id(&tcfg, key, &ids)
            .or_else(|| config_id(generation.as_ref(), id_key))
            .or_else(|| config_id(config.as_ref(), id_key))
    };
    let mut meta = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::Str("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".to_string(), Value::Str(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Strs(texts)),
        ("tokenizer.ggml.token_type".to_string(), Value::I32s(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Strs(merges)),
    ];
    let bos = id_of("bos_token", "bos_token_id");
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", bos),
        (
            "tokenizer.ggml.eos_token_id",
            id_of("eos_token", "eos_token_id"),
        ),
        (
            "tokenizer.ggml.unknown_token_id",
            named_id(&tcfg, "unk_token", &ids),
        ),
        (
            "tokenizer.ggml.padding_token_id",
            id_of("pad_token", "pad_token_id"),
        ),
    ] {
        if let Some(id) = id {
            meta.push((key.to_string(), Value::U32(id)));
        }
    }
    // llama.cpp adds a BOS where the model's tokenizer does: tokenizer_config.json says so, or
    // tokenizer.json's post-processor puts it first.
    let bos_text = bos.and_then(|b| ids.iter().find(|(_, &i)| i == b).map(|(t, _)| t.clone()));
    let add_bos = match tcfg.get("add_bos_token").and_then(|b| b.as_bool()) {
        Some(b) => b,
        None => bos_text.is_some_and(|t| post_processor_adds(&tok, &t)),
    };
    meta.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    let add_eos = tcfg.get("add_eos_token").and_then(|b| b.as_bool()) == Some(true);
    meta.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(add_eos)));
    match chat_template(dir, &tcfg)? {
        Some(t) => meta.push(("tokenizer.chat_template".into(), Value::Str(t))),
        None => note(format!(
            "{} has no chat template; llama.cpp will format chats its own way",
            dir.display()
        )),
    }
    Ok(meta)
}

/// The vocabulary of `tok` (tokenizer.json at `path`) laid out by id for `vocab_size` ids: each
/// id's text and llama.cpp token type (unused ids as `[PAD<id>]`), and the id of each text.
#[allow(clippy::type_complexity)]
fn vocabulary(
    tok: &Json,
    model: &Json,
    path: &Path,
    vocab_size: usize,
) -> Result<(Vec<String>, Vec<i32>, BTreeMap<String, u32>)> {
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut ids = BTreeMap::new();
    let mut place = |text: &str, id: u64, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).with_context(|| {
            format!(
                "{}: token {text:?} has id {id}, past the model's vocab_size {vocab_size}",
                path.display()
            )
        })?;
        *slot = Some((text.to_string(), ty));
        ids.insert(text.to_string(), id as u32);
        Ok(())
    };
    let vocab = model
        .get("vocab")
        .and_then(|v| v.as_object())
        .context("tokenizer.json has no `model.vocab` object")?;
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .with_context(|| format!("{}: token {text:?} has id {id}", path.display()))?;
        place(text, id, NORMAL)?;
    }
    for added in tok
        .get("added_tokens")
        .and_then(|a| a.as_array())
        .into_iter()
        .flatten()
    {
        let (Some(id), Some(text)) = (
            added.get("id").and_then(|i| i.as_u64()),
            added.get("content").and_then(|c| c.as_str()),
        ) else {
            bail!("{}: an added token without id or content", path.display());
        };
        let special = added.get("special").and_then(|s| s.as_bool()) == Some(true);
        place(text, id, if special { CONTROL } else { USER_DEFINED })?;
    }
    let (texts, types): (Vec<String>, Vec<i32>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED)))
        .unzip();
    Ok((texts, types, ids))
}

/// The BPE merges of tokenizer.json's `model` (at `path`) as "left right" strings, whichever of
/// the two layouts (strings or pairs) the file uses.
fn merges_of(model: &Json, path: &Path) -> Result<Vec<String>> {
    Ok(match model.get("merges") {
        Some(Json::Array(list)) => list
            .iter()
            .map(|m| match m {
                Json::String(s) => Ok(s.clone()),
                Json::Array(pair) if pair.len() == 2 => Ok(format!(
                    "{} {}",
                    pair[0].as_str().unwrap_or_default(),
                    pair[1].as_str().unwrap_or_default()
                )),
                other => bail!("{}: merge {other} is not a pair", path.display()),
            })
            .collect::<Result<_>>()?,
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pre_tokenizer_name_follows_the_split() {
        let p = Path::new("tokenizer.json");
        let bl =
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true});
        assert_eq!(pre_name(&bl, p).unwrap(), "gpt-2");
        let smol = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, bl]});
        assert_eq!(pre_name(&smol, p).unwrap(), "smollm");
        let llama3 = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]});
        assert_eq!(pre_name(&llama3, p).unwrap(), "llama-bpe");
        let other = serde_json::json!({"type": "Whitespace"});
        let e = pre_name(&other, p).unwrap_err().to_string();
        assert!(e.contains("Whitespace"), "{e}");
    }
}

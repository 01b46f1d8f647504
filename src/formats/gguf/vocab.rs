//! A tokenizer both ways between a model directory and llama.cpp's GGUF metadata: the byte-level
//! BPE vocabulary (`tokenizer.ggml.tokens`, `token_type`, `merges`), the pre-tokenizer
//! llama.cpp must split with (`tokenizer.ggml.pre`), the special token ids, whether a BOS is
//! added, and the chat template. [`tokenizer_metadata`] writes them from tokenizer.json and
//! tokenizer_config.json; [`hf_tokenizer`] writes those two back from a GGUF file.
//!
//! llama.cpp chooses its pre-tokenizer regex by the name in `tokenizer.ggml.pre`, so the name
//! must say how `tokenizer.json` splits. [`PRE_TOKENIZERS`] pairs each name with the split, for
//! both directions: Llama 3's regex split is `llama-bpe`, SmolLM's digit-by-digit split before
//! byte-level BPE is `smollm`, Qwen's (Llama 3's with single digits) is `qwen2`, Mistral Nemo's
//! ("Tekken": letters split where the case changes, single digits) is `tekken`, plain byte-level
//! is `gpt-2`. Any other pre-tokenizer is refused rather than written under a name that would
//! tokenize differently.

use super::ggml::{
    self, key, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
};
use super::read::{Gguf, Meta};
use super::spm;
use super::write::Value;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// Llama 3's pre-tokenizer split pattern (tokenizer.json's `Split` regex), which llama.cpp
/// calls `llama-bpe`.
pub const LLAMA3_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// Qwen2's pre-tokenizer split pattern (Qwen2, Qwen2.5 and Qwen3's tokenizer.json): Llama 3's
/// but for digits, which go one at a time. llama.cpp calls it `qwen2`.
pub const QWEN2_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// Mistral Nemo's pre-tokenizer split pattern ("Tekken", its tokenizer.json's `Split`): a
/// letter run may start with capitals and ends at the next capital after small letters (so
/// "camelCase" is two pieces), digits go one at a time, there is no contraction group, and a
/// run of punctuation takes a following `/` as it takes newlines. llama.cpp calls it `tekken`.
pub const TEKKEN_SPLIT: &str = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// A split llama.cpp knows by name.
pub struct PreTokenizer {
    /// llama.cpp's names for it: the first is the one xtrain writes; all are read.
    pub names: &'static [&'static str],
    /// Whose split it is, for messages.
    pub what: &'static str,
    /// tokenizer.json's `pre_tokenizer` parts (in a `Sequence` when more than one).
    parts: fn() -> Vec<Json>,
    /// Whether the model's tokenizer.json puts text in Unicode NFC first (its `normalizer`).
    nfc: bool,
    /// Whether llama.cpp takes a piece that is a whole token of the vocabulary as it is, before
    /// any merge (it does for `llama-bpe` and `tekken`, as their tokenizer.json files say with
    /// the BPE model's `ignore_merges`); import writes the same into tokenizer.json.
    ignore_merges: bool,
    /// Where llama.cpp's split under this name is known to differ from tokenizer.json's, said
    /// to the user at export.
    caveat: Option<&'static str>,
}

fn byte_level(regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex})
}

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

/// The splits xtrain carries between tokenizer.json and GGUF.
pub const PRE_TOKENIZERS: &[PreTokenizer] = &[
    PreTokenizer {
        names: &["gpt-2", "default", "gpt2"],
        what: "GPT-2's byte-level split",
        parts: || vec![byte_level(true)],
        nfc: false,
        ignore_merges: false,
        caveat: None,
    },
    // SmolLM and StarCoder-style vocabularies split digits one by one before byte-level BPE.
    PreTokenizer {
        names: &["smollm", "starcoder", "refact", "smaug-bpe"],
        what: "SmolLM's digit split",
        parts: || {
            vec![
                json!({"type": "Digits", "individual_digits": true}),
                byte_level(true),
            ]
        },
        nfc: false,
        ignore_merges: false,
        caveat: None,
    },
    // Llama 3's regex split (up to three digits a piece), then bytes without GPT-2's regex.
    PreTokenizer {
        names: &["llama-bpe", "llama3"],
        what: "Llama 3's regex split",
        parts: || vec![split(LLAMA3_SPLIT), byte_level(false)],
        nfc: false,
        ignore_merges: true,
        caveat: None,
    },
    // Qwen's regex split (digits one at a time), then bytes without GPT-2's regex.
    PreTokenizer {
        names: &["qwen2"],
        what: "Qwen2's regex split",
        parts: || vec![split(QWEN2_SPLIT), byte_level(false)],
        nfc: true,
        ignore_merges: false,
        caveat: None,
    },
    // Mistral Nemo's regex split (case changes, digits one at a time), then bytes without
    // GPT-2's regex.
    PreTokenizer {
        names: &["tekken"],
        what: "Mistral Nemo's Tekken split",
        parts: || vec![split(TEKKEN_SPLIT), byte_level(false)],
        nfc: false,
        ignore_merges: true,
        // llama.cpp writes the split with ASCII case classes and leaves marks out of its
        // letters (tests/llama_cpp.rs pins both).
        caveat: Some(
            "llama.cpp's own `tekken` split (every GGUF of Mistral Nemo has it) differs from \
             tokenizer.json's in two ways: combining marks (Devanagari vowel signs, Arabic and \
             Hebrew vowel points, decomposed accents) are cut out of words, and a letter \
             outside ASCII counts as both capital and small (\"aÉ\" is one piece, \"éCole\" \
             too); text with them can get other token ids in llama.cpp than in transformers",
        ),
    },
];

impl PreTokenizer {
    /// tokenizer.json's `pre_tokenizer`.
    fn json(&self) -> Json {
        let mut parts = (self.parts)();
        match parts.len() {
            1 => parts.remove(0),
            _ => json!({"type": "Sequence", "pretokenizers": parts}),
        }
    }

    /// Whether tokenizer.json's `parts` split text as this does: the same kinds of part in the
    /// same order, with the same regex, digit rule and byte-level regex (options that do not
    /// change where text splits are not compared).
    fn splits_as(&self, parts: &[&Json]) -> bool {
        let what = |j: &Json| {
            (
                j.get("type").cloned(),
                j.get("use_regex").cloned().unwrap_or(Json::Bool(true)),
                j.get("individual_digits")
                    .cloned()
                    .unwrap_or(Json::Bool(false)),
                j.pointer("/pattern/Regex").cloned(),
            )
        };
        let ours = (self.parts)();
        ours.len() == parts.len() && ours.iter().zip(parts).all(|(a, b)| what(a) == what(b))
    }
}

/// "names (what), ..." of every split, for messages.
fn pre_tokenizers_known() -> String {
    PRE_TOKENIZERS
        .iter()
        .map(|p| format!("{} ({})", p.names.join("/"), p.what))
        .collect::<Vec<_>>()
        .join(", ")
}

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

/// The split llama.cpp knows that tokenizer.json's `pre_tokenizer` is (its first name is
/// `tokenizer.ggml.pre`).
fn pre_of(pre: &Json, path: &Path) -> Result<&'static PreTokenizer> {
    let parts: Vec<&Json> = match pre.get("type").and_then(|t| t.as_str()) {
        Some("Sequence") => pre
            .get("pretokenizers")
            .and_then(|p| p.as_array())
            .map(|a| a.iter().collect())
            .unwrap_or_default(),
        _ => vec![pre],
    };
    match PRE_TOKENIZERS.iter().find(|p| p.splits_as(&parts)) {
        Some(p) => Ok(p),
        None => bail!(
            "{}: its pre_tokenizer ({}) is not one llama.cpp is known to split the same way \
             (xtrain writes {}); a GGUF file would tokenize differently from this model",
            path.display(),
            serde_json::to_string(pre).unwrap_or_default(),
            pre_tokenizers_known()
        ),
    }
}

/// The split of `tokenizer.ggml.pre`: how llama.cpp splits text before
/// BPE, which the vocabulary's merges were made for. A name xtrain does not know is refused:
/// another split gives other token ids than the model was trained on.
fn pre_tokenizer(g: &Gguf) -> Result<&'static PreTokenizer> {
    let pre = g.str(key::PRE).unwrap_or("default");
    match PRE_TOKENIZERS.iter().find(|p| p.names.contains(&pre)) {
        Some(p) => Ok(p),
        None => bail!(
            "{} = {pre}: xtrain knows how llama.cpp splits text for {}, not this one; another \
             split would give other token ids than the model was trained on",
            key::PRE,
            pre_tokenizers_known()
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
            "{}: the tokenizer model is {}; xtrain writes BPE vocabularies, byte-level (Llama 3, \
             Qwen, SmolLM) and SentencePiece-style (Llama 2, Mistral v0.1-v0.3)",
            path.display(),
            model.get("type").unwrap_or(&Json::Null)
        );
    }
    let space_prefix = spm::space_prefix(&tok);
    let (texts, mut types, ids) = vocabulary(&tok, model, &path, vocab_size)?;
    let merges = merges_of(model, &path)?;
    let mut meta = match space_prefix {
        None => {
            let pre = pre_of(tok.get("pre_tokenizer").unwrap_or(&Json::Null), &path)?;
            if let Some(caveat) = pre.caveat {
                note(caveat.to_string());
            }
            vec![
                (key::TOKENIZER_MODEL.to_string(), Value::Str(GPT2.into())),
                (key::PRE.to_string(), Value::Str(pre.names[0].into())),
                (key::TOKENS.to_string(), Value::Strs(texts)),
                (key::TOKEN_TYPE.to_string(), Value::I32s(types)),
                (key::MERGES.to_string(), Value::Strs(merges)),
            ]
        }
        Some(prefix) => {
            let unknown = model.get("unk_token").and_then(|u| u.as_str());
            for (ty, text) in types.iter_mut().zip(&texts) {
                if Some(text.as_str()) == unknown {
                    *ty = TOKEN_UNKNOWN;
                } else if spm::is_byte(text) && *ty == TOKEN_NORMAL {
                    *ty = TOKEN_BYTE;
                }
            }
            vec![
                (key::TOKENIZER_MODEL.to_string(), Value::Str(LLAMA.into())),
                (key::TOKENS.to_string(), Value::Strs(texts.clone())),
                (
                    key::SCORES.to_string(),
                    Value::F32s(spm::scores(&texts, &merges)),
                ),
                (key::TOKEN_TYPE.to_string(), Value::I32s(types)),
                (key::ADD_SPACE_PREFIX.to_string(), Value::Bool(prefix)),
            ]
        }
    };

    let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let config = read_json(&dir.join("config.json"))?;
    let generation = read_json(&dir.join("generation_config.json"))?;
    let id_of = |key: &str, id_key: &str| {
        named_id(&tcfg, key, &ids)
            .or_else(|| config_id(generation.as_ref(), id_key))
            .or_else(|| config_id(config.as_ref(), id_key))
    };
    let bos = id_of("bos_token", "bos_token_id");
    for (k, id) in [
        (key::BOS_ID, bos),
        (key::EOS_ID, id_of("eos_token", "eos_token_id")),
        (key::UNKNOWN_ID, named_id(&tcfg, "unk_token", &ids)),
        (key::PADDING_ID, id_of("pad_token", "pad_token_id")),
    ] {
        if let Some(id) = id {
            meta.push((k.to_string(), Value::U32(id)));
        }
    }
    // llama.cpp adds a BOS where the model's tokenizer does: tokenizer_config.json says so, or
    // tokenizer.json's post-processor puts it first.
    let bos_text = bos.and_then(|b| ids.iter().find(|(_, &i)| i == b).map(|(t, _)| t.clone()));
    let add_bos = match tcfg.get("add_bos_token").and_then(|b| b.as_bool()) {
        Some(b) => b,
        None => bos_text.is_some_and(|t| post_processor_adds(&tok, &t)),
    };
    meta.push((key::ADD_BOS.into(), Value::Bool(add_bos)));
    let add_eos = tcfg.get("add_eos_token").and_then(|b| b.as_bool()) == Some(true);
    meta.push((key::ADD_EOS.into(), Value::Bool(add_eos)));
    match chat_template(dir, &tcfg)? {
        Some(t) => meta.push((key::CHAT_TEMPLATE.into(), Value::Str(t))),
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
        place(text, id, TOKEN_NORMAL)?;
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
        let ty = if special {
            TOKEN_CONTROL
        } else {
            TOKEN_USER_DEFINED
        };
        place(text, id, ty)?;
    }
    let (texts, types): (Vec<String>, Vec<i32>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), TOKEN_UNUSED)))
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

/// `tokenizer.ggml.model` of a byte-level BPE vocabulary.
const GPT2: &str = "gpt2";
/// `tokenizer.ggml.model` of a SentencePiece-style vocabulary ([`spm`]).
const LLAMA: &str = "llama";

/// tokenizer.json (HF tokenizers' format) and tokenizer_config.json for a GGUF `gpt2`-style
/// BPE vocabulary or a `llama` (SentencePiece-style) one.
pub fn hf_tokenizer(g: &Gguf) -> Result<(Json, Json)> {
    let model = g.str(key::TOKENIZER_MODEL).unwrap_or("");
    if model != GPT2 && model != LLAMA {
        bail!(
            "{} is `{model}`; xtrain converts {GPT2} (byte-level BPE) and {LLAMA} \
             (SentencePiece-style BPE) vocabularies",
            key::TOKENIZER_MODEL
        );
    }
    let tokens = strings(g, key::TOKENS)?;
    let types: Vec<i64> = match g.get(key::TOKEN_TYPE) {
        Some(Meta::Array(a)) => a
            .iter()
            .map(|m| m.as_i64().unwrap_or(TOKEN_NORMAL as i64))
            .collect(),
        _ => vec![TOKEN_NORMAL as i64; tokens.len()],
    };
    // Control, unknown and user-defined tokens are matched whole before BPE.
    let control = |i: usize| {
        [TOKEN_CONTROL, TOKEN_UNKNOWN]
            .iter()
            .any(|&t| types.get(i) == Some(&(t as i64)))
    };
    let added: Vec<Json> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| control(*i) || types.get(*i) == Some(&(TOKEN_USER_DEFINED as i64)))
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": control(i)}))
        .collect();
    let (normalizer, pre, decoder, bpe) = if model == GPT2 {
        byte_level_parts(g, &tokens)?
    } else {
        let scores: Vec<f32> = match g.get(key::SCORES) {
            Some(Meta::Array(a)) => a.iter().map(|m| m.as_f64().unwrap_or(0.0) as f32).collect(),
            _ => bail!("GGUF metadata `{}` is missing", key::SCORES),
        };
        let unknown = g.int(key::UNKNOWN_ID).and_then(|i| tokens.get(i as usize));
        let prefix = g.bool(key::ADD_SPACE_PREFIX).unwrap_or(true);
        let (bpe, pre, decoder) = spm::hf_parts(
            &tokens,
            &scores,
            &types,
            unknown.map(|u| u.as_str()),
            prefix,
        )?;
        (Json::Null, pre, decoder, bpe)
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "post_processor": bos_first(g, &tokens),
        "decoder": decoder,
        "model": bpe
    });
    let tok = |k: &str| g.int(k).and_then(|i| tokens.get(i as usize)).cloned();
    let arch = g.str(key::ARCHITECTURE).unwrap_or_default();
    let context = g.int(&ggml::arch_key(arch, ggml::hparam::CONTEXT_LENGTH));
    let mut config = json!({"model_max_length": context.unwrap_or(2048)});
    if let Some(t) = g.str(key::CHAT_TEMPLATE) {
        config["chat_template"] = json!(t);
    }
    if let Some(add) = g.bool(key::ADD_BOS) {
        config["add_bos_token"] = json!(add);
    }
    for (k, id_key) in [
        ("bos_token", key::BOS_ID),
        ("eos_token", key::EOS_ID),
        ("pad_token", key::PADDING_ID),
        ("unk_token", key::UNKNOWN_ID),
    ] {
        if let Some(t) = tok(id_key) {
            config[k] = json!(t);
        }
    }
    Ok((tokenizer, config))
}

/// The array of strings metadata `k` holds.
fn strings(g: &Gguf, k: &str) -> Result<Vec<String>> {
    match g.get(k) {
        Some(Meta::Array(a)) => Ok(a
            .iter()
            .map(|m| m.as_str().unwrap_or_default().to_string())
            .collect()),
        _ => bail!("GGUF metadata `{k}` is missing"),
    }
}

/// tokenizer.json's `normalizer`, `pre_tokenizer`, `decoder` and `model` of a GGUF `gpt2`
/// vocabulary: byte-level BPE with the file's merges, split as `tokenizer.ggml.pre` names.
fn byte_level_parts(g: &Gguf, tokens: &[String]) -> Result<(Json, Json, Json, Json)> {
    let merges = strings(g, key::MERGES)?;
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let pre = pre_tokenizer(g)?;
    let normalizer = if pre.nfc {
        json!({"type": "NFC"})
    } else {
        Json::Null
    };
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let model = json!({"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": merges});
    Ok((normalizer, pre.json(), decoder, model))
}

/// tokenizer.json's `post_processor`: the BOS token before every text where the file says
/// `tokenizer.ggml.add_bos_token` (as Llama 3's tokenizer.json does), else none.
fn bos_first(g: &Gguf, tokens: &[String]) -> Json {
    let add = g.bool(key::ADD_BOS).unwrap_or(false);
    let bos = g
        .int(key::BOS_ID)
        .and_then(|i| Some((i, tokens.get(usize::try_from(i).ok()?)?)));
    match (add, bos) {
        (true, Some((id, token))) => {
            let special = |type_id: i64| json!({"SpecialToken": {"id": token, "type_id": type_id}});
            let seq = |id: &str, type_id: i64| json!({"Sequence": {"id": id, "type_id": type_id}});
            json!({
                "type": "TemplateProcessing",
                "single": [special(0), seq("A", 0)],
                "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
                "special_tokens": {token.as_str(): {"id": token, "ids": [id], "tokens": [token]}}
            })
        }
        _ => Json::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pre_tokenizer_name_follows_the_split() {
        let p = Path::new("tokenizer.json");
        let bl =
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true});
        assert_eq!(pre_of(&bl, p).unwrap().names[0], "gpt-2");
        let smol = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, bl]});
        assert_eq!(pre_of(&smol, p).unwrap().names[0], "smollm");
        let llama3 = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]});
        assert_eq!(pre_of(&llama3, p).unwrap().names[0], "llama-bpe");
        let other = serde_json::json!({"type": "Whitespace"});
        let e = pre_of(&other, p).err().expect("refused").to_string();
        assert!(e.contains("Whitespace"), "{e}");
    }

    #[test]
    fn each_split_written_is_read_back_under_its_name() {
        let p = Path::new("tokenizer.json");
        for pre in PRE_TOKENIZERS {
            assert_eq!(pre_of(&pre.json(), p).unwrap().names[0], pre.names[0]);
        }
    }
}

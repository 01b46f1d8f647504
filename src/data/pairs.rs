//! Preference pairs (`--method dpo`): rows `{"prompt", "chosen", "rejected"}` of a JSONL or
//! Parquet file, tokenized as TRL's `DPOTrainer` tokenizes them, and made into two rows each
//! (the chosen completion's, then the rejected one's), never packed.
//!
//! - Plain text (`prompt` a string): the tokenizer config's EOS token is appended to each
//!   completion (unless it ends with it), and the prompt and prompt + completion are tokenized
//!   as `tokenizer(text)` does (special tokens recognised, the tokenizer's BOS added).
//! - Conversational (`prompt` a list of messages, `chosen` and `rejected` the assistant's): the
//!   prompt is rendered with the chat template and its generation prompt, prompt + completion
//!   without it.
//! - The completion is the tail of prompt + completion past the tokens it shares with the
//!   prompt alone (both completions cut where the first of them departs, as TRL does).
//! - `--seq` bounds prompt + completion: a longer row keeps its start (TRL's `keep_start`), and
//!   a prompt that leaves no room for a completion is refused with its line.
//!
//! The loss sees only completion tokens: their labels are the token ids, every other label
//! (prompt, padding) is -100.

use crate::data::rows::Row;
use crate::data::text::{Message, TextTokenizer};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// One side of a pair (or its prompt): plain text or messages.
#[derive(Clone, Debug, PartialEq)]
pub enum PairText {
    Text(String),
    Chat(Vec<Message>),
}

/// A preference pair as read from a file.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    pub prompt: PairText,
    pub chosen: PairText,
    pub rejected: PairText,
}

/// A pair's token ids: the prompt's, and each completion's (the tail past the prompt).
#[derive(Clone, Debug, PartialEq)]
pub struct PairTokens {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
    /// Tokens of the prompt alone that prompt + completion tokenizes otherwise (left out).
    pub prompt_cut: usize,
}

/// Where a pair came from, for messages: `FILE:LINE` or `FILE: row group G, row R (...)`.
pub type Place = String;

/// A file's pairs, each with its place.
pub struct PairsRead {
    pub pairs: Vec<(Place, Pair)>,
    /// (place, reason) of each row skipped with --skip-bad-lines.
    pub skipped: Vec<(Place, String)>,
}

fn messages(v: &serde_json::Value, key: &str) -> std::result::Result<Vec<Message>, String> {
    let arr = v
        .as_array()
        .ok_or_else(|| format!("`{key}` is not a list of messages"))?;
    arr.iter()
        .enumerate()
        .map(|(i, m)| {
            let s = |k: &str| m.get(k).and_then(|x| x.as_str());
            match (s("role"), s("content")) {
                (Some(role), Some(content)) => Ok(Message {
                    role: role.into(),
                    content: content.into(),
                }),
                _ => Err(format!(
                    "`{key}` message {i} has no string `role` and `content`"
                )),
            }
        })
        .collect()
}

/// What a row without `key` is told: the keys it has (a misspelt one shows), and for a row of
/// supervised data (`text`, `messages`, or `prompt` + `completion`) that it is one.
fn missing(obj: &serde_json::Map<String, serde_json::Value>, key: &str) -> String {
    let expected = "a preference row is {\"prompt\", \"chosen\", \"rejected\"}";
    let has = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    if !has("chosen") && !has("rejected") {
        if let Some(k) = ["text", "messages", "completion"]
            .into_iter()
            .find(|k| has(k))
        {
            return format!(
                "no `{key}`: this is a row of supervised data (`{k}`), and --method dpo takes \
                 preference pairs ({expected}); train on it without --method dpo"
            );
        }
    }
    let keys: Vec<String> = obj.keys().map(|k| format!("`{k}`")).collect();
    let keys = if keys.is_empty() {
        "none".to_string()
    } else {
        keys.join(", ")
    };
    format!("no `{key}` (the row's keys: {keys}; {expected})")
}

/// A row (a JSONL line, or a Parquet row as the object it would be) as a pair.
pub(crate) fn parse_pair(v: &serde_json::Value) -> std::result::Result<Pair, String> {
    let obj = v.as_object().ok_or("not a JSON object")?;
    let get = |k: &str| match obj.get(k) {
        None | Some(serde_json::Value::Null) => Err(missing(obj, k)),
        Some(v) => Ok(v),
    };
    let (prompt, chosen, rejected) = (get("prompt")?, get("chosen")?, get("rejected")?);
    let side =
        |v: &serde_json::Value, k: &str, chat: bool| -> std::result::Result<PairText, String> {
            let t = match (chat, v) {
                (false, serde_json::Value::String(s)) => PairText::Text(s.clone()),
                (true, serde_json::Value::Array(_)) => PairText::Chat(messages(v, k)?),
                (false, _) => {
                    return Err(format!(
                        "`{k}` is not a string, but `prompt` is (plain text: each is a string)"
                    ))
                }
                (true, _) => {
                    return Err(format!(
                    "`{k}` is not a list of messages, but `prompt` is (conversational: each is \
                     a list of {{\"role\", \"content\"}})"
                ))
                }
            };
            let empty = match &t {
                PairText::Text(s) => s.is_empty(),
                PairText::Chat(m) => m.is_empty() || m.iter().all(|m| m.content.is_empty()),
            };
            if empty && k != "prompt" {
                return Err(format!(
                    "`{k}` is empty: a completion needs at least one token"
                ));
            }
            Ok(t)
        };
    let chat = match prompt {
        serde_json::Value::String(_) => false,
        serde_json::Value::Array(_) => true,
        _ => return Err("`prompt` is neither a string nor a list of messages".into()),
    };
    Ok(Pair {
        prompt: side(prompt, "prompt", chat)?,
        chosen: side(chosen, "chosen", chat)?,
        rejected: side(rejected, "rejected", chat)?,
    })
}

/// Read a JSONL or Parquet file's pairs. A bad row is an error naming the file and line (or
/// row), unless `skip_bad`.
pub fn read_pairs(path: &Path, skip_bad: bool) -> Result<PairsRead> {
    let objects = if path.extension().is_some_and(|e| e == "parquet") {
        crate::data::parquet_rows::read_parquet_objects(path, &["prompt", "chosen", "rejected"])?
    } else {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, line)| {
                let place = format!("{}:{}", path.display(), i + 1);
                let v = serde_json::from_str::<serde_json::Value>(line)
                    .map_err(|e| format!("not valid JSON ({e})"));
                (place, v)
            })
            .collect()
    };
    let mut pairs = Vec::new();
    let mut skipped = Vec::new();
    for (place, v) in objects {
        match v.and_then(|v| parse_pair(&v)) {
            Ok(p) => pairs.push((place, p)),
            Err(reason) if skip_bad => skipped.push((place, reason)),
            Err(reason) => bail!("{place}: {reason} (pass --skip-bad-lines to skip such rows)"),
        }
    }
    if pairs.is_empty() {
        bail!("{}: no usable preference pairs", path.display());
    }
    Ok(PairsRead { pairs, skipped })
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokenize a pair as TRL does (module docs).
pub fn tokenize_pair(tok: &TextTokenizer, pair: &Pair) -> Result<PairTokens> {
    let (prompt, chosen, rejected) = match (&pair.prompt, &pair.chosen, &pair.rejected) {
        (PairText::Text(p), PairText::Text(c), PairText::Text(r)) => {
            let eos = tok.eos_token.as_deref().context(
                "the tokenizer has no `eos_token` (tokenizer_config.json) to end plain-text \
                 completions with",
            )?;
            let end = |s: &str| match s.ends_with(eos) {
                true => s.to_string(),
                false => format!("{s}{eos}"),
            };
            (
                tok.encode_with_specials(p)?,
                tok.encode_with_specials(&format!("{p}{}", end(c)))?,
                tok.encode_with_specials(&format!("{p}{}", end(r)))?,
            )
        }
        (PairText::Chat(p), PairText::Chat(c), PairText::Chat(r)) => {
            let with = |m: &[Message]| -> Result<Vec<u32>> {
                let all: Vec<Message> = p.iter().chain(m).cloned().collect();
                tok.encode(&tok.render_chat(&all, false)?)
            };
            (tok.encode(&tok.render_chat(p, true)?)?, with(c)?, with(r)?)
        }
        _ => bail!("a pair's prompt, chosen and rejected are all text or all messages"),
    };
    let at = common_prefix(&prompt, &chosen).min(common_prefix(&prompt, &rejected));
    Ok(PairTokens {
        prompt_cut: prompt.len() - at,
        prompt: prompt[..at].to_vec(),
        chosen: chosen[at..].to_vec(),
        rejected: rejected[at..].to_vec(),
    })
}

/// What making pairs into rows found, for the run to say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PairReport {
    /// Pairs whose prompt + completion (either) was cut to `--seq`.
    pub truncated: usize,
    /// Pairs whose two completions are the same tokens (they teach nothing).
    pub same: usize,
    /// Pairs whose prompt alone tokenizes otherwise than as the start of prompt + completion.
    pub prompt_cut: usize,
}

/// A pair's two rows of `seq` tokens (chosen, then rejected): prompt + completion cut to `seq`
/// (keep_start), padded with `pad_id`; labels the completion's token ids, -100 elsewhere.
fn pair_rows(t: &PairTokens, seq: usize, pad_id: u32) -> ([Row; 2], bool) {
    let mut truncated = false;
    let row = |completion: &[u32], truncated: &mut bool| {
        let mut ids: Vec<i32> = t
            .prompt
            .iter()
            .chain(completion)
            .map(|&x| x as i32)
            .collect();
        let mut labels: Vec<i32> = std::iter::repeat_n(-100, t.prompt.len())
            .chain(completion.iter().map(|&x| x as i32))
            .collect();
        if ids.len() > seq {
            *truncated = true;
            ids.truncate(seq);
            labels.truncate(seq);
        }
        let n = ids.len();
        ids.resize(seq, pad_id as i32);
        labels.resize(seq, -100);
        let mut mask = vec![1; n];
        mask.resize(seq, 0);
        Row {
            ids,
            labels,
            mask,
            reference: None,
        }
    };
    let chosen = row(&t.chosen, &mut truncated);
    let rejected = row(&t.rejected, &mut truncated);
    ([chosen, rejected], truncated)
}

/// Tokenize pairs into rows of `seq` tokens, two per pair in order (chosen, rejected). A pair
/// whose prompt leaves no room for a completion, whose prompt has no token, or whose completion
/// tokenizes to nothing is refused, naming its place.
pub fn pair_rows_of(
    pairs: &[(Place, Pair)],
    tok: &TextTokenizer,
    seq: usize,
    strict: bool,
) -> Result<(Vec<Row>, PairReport)> {
    let mut rows = Vec::with_capacity(2 * pairs.len());
    let mut report = PairReport::default();
    for (place, pair) in pairs {
        let t = tokenize_pair(tok, pair).with_context(|| place.clone())?;
        if t.prompt.is_empty() {
            bail!(
                "{place}: the prompt tokenizes to nothing, so the completion's first token would \
                 be predicted from nothing (give the prompt some text, or use a tokenizer that \
                 adds a BOS token)"
            );
        }
        for (side, c) in [("chosen", &t.chosen), ("rejected", &t.rejected)] {
            if c.is_empty() {
                bail!(
                    "{place}: `{side}` adds no token to the prompt: a completion needs at least one"
                );
            }
        }
        if t.prompt.len() >= seq {
            bail!(
                "{place}: the prompt has {} tokens, which leaves no room for a completion within \
                 --seq {seq}; raise --seq, shorten the prompt, or leave the pair out",
                t.prompt.len()
            );
        }
        report.same += usize::from(t.chosen == t.rejected);
        report.prompt_cut += usize::from(t.prompt_cut > 0);
        let (two, cut) = pair_rows(&t, seq, tok.pad_id);
        if cut && strict {
            let longest = t.prompt.len() + t.chosen.len().max(t.rejected.len());
            bail!(
                "{place}: prompt + completion has {longest} tokens, more than --seq {seq} (drop \
                 --strict-length to truncate)"
            );
        }
        report.truncated += usize::from(cut);
        rows.extend(two);
    }
    Ok((rows, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(line: &str) -> String {
        match parse_pair(&serde_json::from_str(line).unwrap()) {
            Ok(_) => panic!("{line} was taken"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_row_without_a_field_names_the_keys_it_has_or_that_it_is_supervised() {
        let e = refusal(r#"{"prompt": "a", "choosen": " b", "rejected": " c"}"#);
        assert!(
            e.starts_with("no `chosen` (the row's keys: `choosen`, `prompt`, `rejected`;"),
            "{e}"
        );
        let e = refusal("{}");
        assert!(e.starts_with("no `prompt` (the row's keys: none;"), "{e}");
        for row in [
            r#"{"text": "hello"}"#,
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            r#"{"prompt": "a", "completion": " b"}"#,
        ] {
            let e = refusal(row);
            assert!(
                e.contains("this is a row of supervised data")
                    && e.contains("without --method dpo"),
                "{row}: {e}"
            );
        }
    }
}

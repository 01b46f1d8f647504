//! Examples: a row of a data file (a JSONL line, or a Parquet row as the object it would be)
//! made into text or a conversation, then rendered with the chat template and tokenized, with a
//! loss mask. Reading the files is `read`'s.

use crate::data::text::{Message, TextTokenizer};
use anyhow::{Context, Result};

/// One training example as read from a file.
#[derive(Clone, Debug, PartialEq)]
pub enum Example {
    /// Plain text: the loss is on every token.
    Text(String),
    /// A conversation: the loss is on the last assistant message.
    Chat(Vec<Message>),
}

/// What reading a file found.
pub struct ReadReport {
    pub examples: Vec<Example>,
    /// (line number, or row of a Parquet file counted from 0; reason) of each line or row
    /// skipped with --skip-bad-lines.
    pub skipped: Vec<(usize, String)>,
    /// What `skipped` counts: "line" or "row".
    pub unit: &'static str,
    /// What the reader decided that the user should know (which of two columns it trains on).
    pub notes: Vec<String>,
}

/// The keys (JSONL) or columns (Parquet) that hold plain text and chat messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Columns {
    pub text: String,
    pub messages: String,
    /// Whether `--text-column` was given and `--messages-column` was not: a Parquet file with
    /// both columns is then trained on its text column.
    pub text_chosen: bool,
}

impl Default for Columns {
    fn default() -> Columns {
        Columns::new(None, None)
    }
}

impl Columns {
    /// `text` and `messages` unless named otherwise.
    pub fn new(text: Option<String>, messages: Option<String>) -> Columns {
        Columns {
            text_chosen: text.is_some() && messages.is_none(),
            text: text.unwrap_or_else(|| "text".into()),
            messages: messages.unwrap_or_else(|| "messages".into()),
        }
    }
}

/// One row (a JSONL line, or a Parquet row as the object it would be) as an example, by the first
/// of its kinds it has: messages, instruction + output, text.
pub(crate) fn parse_line(
    v: &serde_json::Value,
    columns: &Columns,
) -> std::result::Result<Example, String> {
    let obj = v.as_object().ok_or("not a JSON object")?;
    let s = |k: &str| obj.get(k).and_then(|x| x.as_str());
    if let Some(messages) = obj.get(&columns.messages).filter(|m| !m.is_null()) {
        let arr = messages
            .as_array()
            .ok_or(format!("`{}` is not a list", columns.messages))?;
        let mut out = Vec::new();
        for (i, m) in arr.iter().enumerate() {
            let role = m
                .get("role")
                .and_then(|r| r.as_str())
                .ok_or(format!("message {i} has no string `role`"))?;
            let content = m
                .get("content")
                .and_then(|r| r.as_str())
                .ok_or(format!("message {i} has no string `content`"))?;
            out.push(Message {
                role: role.into(),
                content: content.into(),
            });
        }
        if !out.iter().any(|m| m.role == "assistant") {
            return Err("no assistant message to learn".into());
        }
        return Ok(Example::Chat(out));
    }
    if let (Some(instruction), Some(output)) = (s("instruction"), s("output")) {
        let user = match s("input") {
            Some(i) if !i.trim().is_empty() => format!("{instruction}\n\n{i}"),
            _ => instruction.to_string(),
        };
        return Ok(Example::Chat(vec![
            Message {
                role: "user".into(),
                content: user,
            },
            Message {
                role: "assistant".into(),
                content: output.into(),
            },
        ]));
    }
    if let Some(t) = s(&columns.text) {
        return Ok(Example::Text(t.into()));
    }
    let expected = format!(
        "expected `{}`, `instruction` + `output`, or `{}`",
        columns.text, columns.messages
    );
    if obj.contains_key("chosen") && obj.contains_key("rejected") {
        return Err(format!(
            "a preference pair (`chosen`, `rejected`), which supervised training does not read \
             ({expected}): train on pairs with --method dpo"
        ));
    }
    // Say what the text is instead, where it is there.
    Err(match obj.get(&columns.text) {
        Some(serde_json::Value::Null) => format!("`{}` is null ({expected})", columns.text),
        Some(v) => format!(
            "`{}` is {} ({}), not a string ({expected})",
            columns.text,
            json_kind(v),
            short(v)
        ),
        None if obj.get(&columns.messages).is_some_and(|m| m.is_null()) => {
            format!("`{}` is null ({expected})", columns.messages)
        }
        None => expected,
    })
}

/// "a number", "a list", ... for a JSON value.
fn json_kind(v: &serde_json::Value) -> &'static str {
    use serde_json::Value as J;
    match v {
        J::Null => "null",
        J::Bool(_) => "a boolean",
        J::Number(_) => "a number",
        J::String(_) => "a string",
        J::Array(_) => "a list",
        J::Object(_) => "an object",
    }
}

/// A value as JSON, cut to a few dozen characters.
fn short(v: &serde_json::Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(40) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

/// Token ids and labels (-100 where there is no loss) of one example.
#[derive(Clone, Debug, PartialEq)]
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub labels: Vec<i32>,
}

/// Tokenize an example. For chats, the prompt (everything before the last assistant message,
/// with the template's generation prompt) gets label -100 unless `train_on_prompt`.
pub fn tokenize(tok: &TextTokenizer, ex: &Example, train_on_prompt: bool) -> Result<Tokenized> {
    match ex {
        Example::Text(t) => {
            let mut ids = Vec::new();
            if let Some(bos) = tok.bos.as_deref().filter(|_| !t.is_empty()) {
                ids.extend(tok.encode(bos)?);
            }
            ids.extend(tok.encode(t)?);
            ids.extend(tok.eos_id);
            let labels = ids.iter().map(|&i| i as i32).collect();
            Ok(Tokenized { ids, labels })
        }
        Example::Chat(messages) => {
            let last = messages
                .iter()
                .rposition(|m| m.role == "assistant")
                .context("no assistant message")?;
            let prompt = tok.render_chat(&messages[..last], true)?;
            let full = tok.render_chat(&messages[..=last], false)?;
            let prompt_ids = tok.encode(&prompt)?;
            let ids = tok.encode(&full)?;
            // The prompt's tokens are a prefix of the full text's (the template ends the prompt
            // with special tokens, where BPE cannot merge across); count what matches.
            let n_prompt = prompt_ids
                .iter()
                .zip(&ids)
                .take_while(|(a, b)| a == b)
                .count();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(i, &id)| {
                    if i < n_prompt && !train_on_prompt {
                        -100
                    } else {
                        id as i32
                    }
                })
                .collect();
            Ok(Tokenized { ids, labels })
        }
    }
}

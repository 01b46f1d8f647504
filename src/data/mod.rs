//! Training data from JSONL: `{"text"}`, alpaca `{"instruction","input","output"}` and chat
//! `{"messages":[{"role","content"}]}` rows, rendered with the model's chat template, tokenized,
//! with the loss on the response tokens only (by default), packed or padded into fixed-length
//! rows, shuffled with a seed.

pub mod text;

use crate::data::text::{Message, TextTokenizer};
use crate::model::lora::SplitMix;
use crate::train::Batch;
use anyhow::{bail, Context, Result};
use pjrt::HostTensor;
use std::path::Path;

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
    /// (line number, reason) of each line skipped with --skip-bad-lines.
    pub skipped: Vec<(usize, String)>,
}

fn parse_line(v: &serde_json::Value) -> std::result::Result<Example, String> {
    let obj = v.as_object().ok_or("not a JSON object")?;
    let s = |k: &str| obj.get(k).and_then(|x| x.as_str());
    if let Some(messages) = obj.get("messages") {
        let arr = messages.as_array().ok_or("`messages` is not a list")?;
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
    if let Some(t) = s("text") {
        return Ok(Example::Text(t.into()));
    }
    Err("expected `text`, `instruction` + `output`, or `messages`".into())
}

/// Read a JSONL file. A bad line is an error naming the file and line, unless `skip_bad`.
pub fn read_jsonl(path: &Path, skip_bad: bool) -> Result<ReadReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut examples = Vec::new();
    let mut skipped = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<serde_json::Value>(line)
            .map_err(|e| format!("not valid JSON ({e})"))
            .and_then(|v| parse_line(&v));
        match parsed {
            Ok(ex) => examples.push(ex),
            Err(reason) if skip_bad => skipped.push((n, reason)),
            Err(reason) => bail!(
                "{}:{n}: {reason} (pass --skip-bad-lines to skip such lines)",
                path.display()
            ),
        }
    }
    if examples.is_empty() {
        bail!("{}: no usable examples", path.display());
    }
    Ok(ReadReport { examples, skipped })
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

/// Fixed-length rows ready for batching.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub ids: Vec<i32>,
    pub labels: Vec<i32>,
    pub mask: Vec<i32>,
}

/// What making rows did to the examples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowReport {
    pub truncated: usize,
    pub dropped_empty: usize,
}

/// Pack examples end to end into rows of `seq` tokens (`pack`), or give each its own row padded
/// with `pad_id`. Examples longer than `seq` are truncated (counted), or an error if `strict`.
pub fn make_rows(
    examples: &[Tokenized],
    seq: usize,
    pack: bool,
    pad_id: u32,
    strict: bool,
) -> Result<(Vec<Row>, RowReport)> {
    let mut report = RowReport::default();
    let mut rows = Vec::new();
    let (mut ids, mut labels): (Vec<i32>, Vec<i32>) = (Vec::new(), Vec::new());
    for (i, ex) in examples.iter().enumerate() {
        let mut e_ids: Vec<i32> = ex.ids.iter().map(|&x| x as i32).collect();
        let mut e_labels = ex.labels.clone();
        if e_ids.len() > seq {
            if strict {
                bail!("example {} has {} tokens, more than --seq {seq} (drop --strict-length to truncate)", i + 1, e_ids.len());
            }
            report.truncated += 1;
            e_ids.truncate(seq);
            e_labels.truncate(seq);
        }
        if e_labels.iter().skip(1).all(|&l| l == -100) {
            report.dropped_empty += 1;
            continue;
        }
        if !pack {
            let n = e_ids.len();
            let mut row = Row {
                ids: e_ids,
                labels: e_labels,
                mask: vec![1; n],
            };
            row.ids.resize(seq, pad_id as i32);
            row.labels.resize(seq, -100);
            row.mask.resize(seq, 0);
            rows.push(row);
            continue;
        }
        if ids.len() + e_ids.len() > seq {
            rows.push(finish_packed(
                std::mem::take(&mut ids),
                std::mem::take(&mut labels),
                seq,
                pad_id,
            ));
        }
        ids.extend(e_ids);
        labels.extend(e_labels);
    }
    if !ids.is_empty() {
        rows.push(finish_packed(ids, labels, seq, pad_id));
    }
    Ok((rows, report))
}

fn finish_packed(mut ids: Vec<i32>, mut labels: Vec<i32>, seq: usize, pad_id: u32) -> Row {
    let n = ids.len();
    ids.resize(seq, pad_id as i32);
    labels.resize(seq, -100);
    let mut mask = vec![1; n];
    mask.resize(seq, 0);
    Row { ids, labels, mask }
}

/// Split off every `1/fraction`-th example (deterministically) as the eval set.
pub fn split_eval<T: Clone>(items: &[T], fraction: f64) -> (Vec<T>, Vec<T>) {
    if fraction <= 0.0 {
        return (items.to_vec(), Vec::new());
    }
    let every = (1.0 / fraction).round().max(2.0) as usize;
    let mut train = Vec::new();
    let mut eval = Vec::new();
    for (i, x) in items.iter().enumerate() {
        if i % every == every - 1 {
            eval.push(x.clone());
        } else {
            train.push(x.clone());
        }
    }
    (train, eval)
}

/// The order rows are visited in during `epoch`: a seeded shuffle, the same on every run.
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Stack rows into a batch.
pub fn batch(rows: &[&Row]) -> Batch {
    let (b, t) = (rows.len() as i64, rows[0].ids.len() as i64);
    let cat = |f: fn(&Row) -> &Vec<i32>| {
        rows.iter()
            .flat_map(|r| f(r).iter().copied())
            .collect::<Vec<i32>>()
    };
    Batch {
        input_ids: HostTensor::from_i32(&cat(|r| &r.ids), &[b, t]),
        labels: HostTensor::from_i32(&cat(|r| &r.labels), &[b, t]),
        attention_mask: HostTensor::from_i32(&cat(|r| &r.mask), &[b, t]),
    }
}

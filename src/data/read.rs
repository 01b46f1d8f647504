//! Data files read into examples: JSONL here, line by line; Parquet by `parquet_rows`. Each
//! row is made an example by `examples::parse_line`.

use crate::data::examples::{parse_line, Columns, ReadReport};
use crate::data::parquet_rows::read_parquet;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Read a data file's examples: Parquet (`.parquet`) or JSONL (anything else).
pub fn read_examples(path: &Path, skip_bad: bool, columns: &Columns) -> Result<ReadReport> {
    if path.extension().is_some_and(|e| e == "parquet") {
        return read_parquet(path, skip_bad, columns);
    }
    read_jsonl_with(path, skip_bad, columns)
}

/// Read a JSONL file. A bad line is an error naming the file and line, unless `skip_bad`.
pub fn read_jsonl(path: &Path, skip_bad: bool) -> Result<ReadReport> {
    read_jsonl_with(path, skip_bad, &Columns::default())
}

/// [`read_jsonl`] with other keys for text and messages.
fn read_jsonl_with(path: &Path, skip_bad: bool, columns: &Columns) -> Result<ReadReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    // A byte order mark (as some editors write) is not part of the first line's JSON.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut examples = Vec::new();
    let mut skipped = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<serde_json::Value>(line)
            .map_err(|e| format!("not valid JSON ({e})"))
            .and_then(|v| parse_line(&v, columns));
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
    Ok(ReadReport {
        examples,
        skipped,
        unit: "line",
        notes: Vec::new(),
    })
}

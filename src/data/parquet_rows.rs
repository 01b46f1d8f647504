//! Parquet files (the format Hugging Face datasets are published in) read into examples with the
//! `parquet` crate's row reader: the columns a row kind needs are read (a `text` column, alpaca's
//! `instruction`/`input`/`output`, or a `messages` list of `{role, content}` structs, or a JSON
//! string of one), each row made into the object a JSONL line would be, and parsed by the same
//! code. Only Snappy-compressed and uncompressed files are read (the codecs `datasets`, pandas
//! and pyarrow write by default), which keeps the build small; the row reader, not Arrow, for the
//! same reason.

use crate::data::examples::{parse_line, Columns, ReadReport};
use anyhow::{anyhow, bail, Context, Result};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use parquet::schema::types::{Type, TypePtr};
use std::path::Path;
use std::sync::Arc;

/// A column's name and type as a person reads them (`text: string`, `messages: list`).
fn describe(t: &Type) -> String {
    use parquet::basic::{ConvertedType, LogicalType};
    let kind = if t.is_group() {
        match t.get_basic_info().converted_type() {
            ConvertedType::LIST => "list".to_string(),
            ConvertedType::MAP | ConvertedType::MAP_KEY_VALUE => "map".to_string(),
            _ => "struct".to_string(),
        }
    } else {
        let info = t.get_basic_info();
        match (info.logical_type_ref(), info.converted_type()) {
            (Some(LogicalType::String), _) | (_, ConvertedType::UTF8) => "string".to_string(),
            _ => format!("{}", t.get_physical_type()).to_lowercase(),
        }
    };
    format!("{}: {kind}", t.name())
}

/// The columns to read (the messages, the alpaca fields, the text: those the file has and the
/// choice between messages and text keeps), and notes on that choice; an error when the file has
/// no column to train on.
fn pick_columns(
    path: &Path,
    fields: &[TypePtr],
    columns: &Columns,
) -> Result<(Vec<String>, Vec<String>)> {
    let column = |n: &str| fields.iter().find(|f| f.name() == n);
    let has = |n: &str| column(n).is_some();
    let found = || {
        let found: Vec<String> = fields.iter().map(|f| describe(f)).collect();
        if found.is_empty() {
            "no columns".to_string()
        } else {
            found.join(", ")
        }
    };
    let mut notes = Vec::new();
    // Both a text and a messages column: the messages, as TRL's SFTTrainer takes a
    // conversational dataset, unless only --text-column was given. Said either way.
    let both = has(&columns.messages) && has(&columns.text);
    let use_messages = has(&columns.messages) && !(both && columns.text_chosen);
    if both {
        let (t, m) = (&columns.text, &columns.messages);
        notes.push(if use_messages {
            format!(
                "{} has both a `{m}` and a `{t}` column: training on `{m}` (chats, the loss on \
                 the answers; `{t}` only in rows whose `{m}` is null); to train on `{t}` \
                 instead, pass --text-column {t}",
                path.display()
            )
        } else {
            format!(
                "{} has both a `{m}` and a `{t}` column: training on `{t}` (--text-column), \
                 leaving `{m}` out",
                path.display()
            )
        });
    }
    let text_is_string = column(&columns.text).is_none_or(|f| describe(f).ends_with(": string"));
    let usable = use_messages
        || (has(&columns.text) && text_is_string)
        || (has("instruction") && has("output"));
    if !usable {
        if let Some(text) = column(&columns.text) {
            bail!(
                "{}: column `{}` holds {} values, not strings, so there is no column to train on \
                 (the file has {}; name another with --text-column or --messages-column)",
                path.display(),
                columns.text,
                describe(text).rsplit(": ").next().unwrap_or_default(),
                found()
            );
        }
        bail!(
            "{}: no column to train on: expected `{}` (text), `{}` (chat messages) or `instruction` + `output` (alpaca); the file has {} (name them with --text-column or --messages-column)",
            path.display(),
            columns.text,
            columns.messages,
            found()
        );
    }
    let wanted: Vec<String> = [
        columns.messages.as_str(),
        "instruction",
        "input",
        "output",
        columns.text.as_str(),
    ]
    .into_iter()
    .filter(|n| has(n) && (use_messages || *n != columns.messages))
    .map(str::to_string)
    .collect();
    Ok((wanted, notes))
}

/// Read a Parquet file's examples. A bad row is an error naming the file, row group and row
/// (counted from 0, as pandas and pyarrow count), unless `skip_bad`.
pub fn read_parquet(path: &Path, skip_bad: bool, columns: &Columns) -> Result<ReadReport> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| anyhow!("{} is not a readable Parquet file: {e}", path.display()))?;
    let schema = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema();
    let fields = schema.get_fields();
    let (wanted, notes) = pick_columns(path, fields, columns)?;
    let projected: Vec<TypePtr> = fields
        .iter()
        .filter(|f| wanted.iter().any(|w| w == f.name()))
        .cloned()
        .collect();
    let projection = Type::group_type_builder(schema.name())
        .with_fields(projected)
        .build()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let projection = Arc::new(projection);
    let mut examples = Vec::new();
    let mut skipped = Vec::new();
    let mut first_row = 0usize;
    for g in 0..reader.num_row_groups() {
        let at_group = |e: parquet::errors::ParquetError| {
            let hint = if e.to_string().contains("Disabled feature") {
                " (xtrain reads uncompressed and Snappy-compressed Parquet; rewrite the file with compression='snappy')"
            } else {
                ""
            };
            anyhow!("{}: row group {g}: {e}{hint}", path.display())
        };
        let group = reader.get_row_group(g).map_err(at_group)?;
        let rows = group
            .get_row_iter(Some(projection.as_ref().clone()))
            .map_err(at_group)?;
        for (r, row) in rows.enumerate() {
            let row = row.map_err(at_group)?;
            let mut object: serde_json::Map<String, serde_json::Value> = row
                .get_column_iter()
                .map(|(k, v)| (k.clone(), to_json(v)))
                .collect();
            // Some datasets store each conversation as a JSON string.
            if let Some(serde_json::Value::String(s)) = object.get(&columns.messages) {
                if let Ok(list @ serde_json::Value::Array(_)) = serde_json::from_str(s) {
                    object.insert(columns.messages.clone(), list);
                }
            }
            let value = serde_json::Value::Object(object);
            match parse_line(&value, columns) {
                Ok(ex) => examples.push(ex),
                Err(reason) if skip_bad => {
                    skipped.push((first_row + r, format!("row group {g}, row {r}: {reason}")))
                }
                Err(reason) => bail!(
                    "{}: row group {g}, row {r} (row {} of the file, counting from 0): {reason} (pass --skip-bad-lines to skip such rows)",
                    path.display(),
                    first_row + r
                ),
            }
        }
        first_row += group.metadata().num_rows() as usize;
    }
    if examples.is_empty() {
        bail!("{}: no usable examples", path.display());
    }
    Ok(ReadReport {
        examples,
        skipped,
        unit: "row",
        notes,
    })
}

/// A Parquet value as the JSON value a JSONL line would hold (binary that is not UTF-8 as null).
fn to_json(f: &Field) -> serde_json::Value {
    use serde_json::Value as J;
    match f {
        Field::Null => J::Null,
        Field::Bool(b) => J::Bool(*b),
        Field::Byte(i) => J::from(*i),
        Field::Short(i) => J::from(*i),
        Field::Int(i) => J::from(*i),
        Field::Long(i) => J::from(*i),
        Field::UByte(i) => J::from(*i),
        Field::UShort(i) => J::from(*i),
        Field::UInt(i) => J::from(*i),
        Field::ULong(i) => J::from(*i),
        Field::Float(x) => J::from(*x),
        Field::Double(x) => J::from(*x),
        Field::Str(s) => J::String(s.clone()),
        Field::Bytes(b) => std::str::from_utf8(b.data()).map_or(J::Null, |s| J::String(s.into())),
        Field::Group(row) => J::Object(
            row.get_column_iter()
                .map(|(k, v)| (k.clone(), to_json(v)))
                .collect(),
        ),
        Field::ListInternal(list) => J::Array(list.elements().iter().map(to_json).collect()),
        other => J::String(other.to_string()),
    }
}

/// Each row of a Parquet file's `columns` (each must be there) as the object a JSONL line would
/// be, with where it is (`FILE: row group G, row R (row N of the file, counting from 0)`); a
/// column holding a JSON string of a list (as some datasets store conversations) is that list.
pub(crate) fn read_parquet_objects(
    path: &Path,
    columns: &[&str],
) -> Result<Vec<(String, std::result::Result<serde_json::Value, String>)>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| anyhow!("{} is not a readable Parquet file: {e}", path.display()))?;
    let schema = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema();
    let fields = schema.get_fields();
    if let Some(missing) = columns
        .iter()
        .find(|c| !fields.iter().any(|f| f.name() == **c))
    {
        let found: Vec<String> = fields.iter().map(|f| describe(f)).collect();
        bail!(
            "{}: no column `{missing}`: preference pairs are `{}`; the file has {}",
            path.display(),
            columns.join("`, `"),
            if found.is_empty() {
                "no columns".to_string()
            } else {
                found.join(", ")
            }
        );
    }
    let projected: Vec<TypePtr> = fields
        .iter()
        .filter(|f| columns.contains(&f.name()))
        .cloned()
        .collect();
    let projection = Type::group_type_builder(schema.name())
        .with_fields(projected)
        .build()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut first_row = 0usize;
    for g in 0..reader.num_row_groups() {
        let at_group =
            |e: parquet::errors::ParquetError| anyhow!("{}: row group {g}: {e}", path.display());
        let group = reader.get_row_group(g).map_err(at_group)?;
        let rows = group
            .get_row_iter(Some(projection.clone()))
            .map_err(at_group)?;
        for (r, row) in rows.enumerate() {
            let row = row.map_err(at_group)?;
            let mut object: serde_json::Map<String, serde_json::Value> = row
                .get_column_iter()
                .map(|(k, v)| (k.clone(), to_json(v)))
                .collect();
            for c in columns {
                if let Some(serde_json::Value::String(s)) = object.get(*c) {
                    if let Ok(list @ serde_json::Value::Array(_)) = serde_json::from_str(s) {
                        object.insert(c.to_string(), list);
                    }
                }
            }
            let place = format!(
                "{}: row group {g}, row {r} (row {} of the file, counting from 0)",
                path.display(),
                first_row + r
            );
            out.push((place, Ok(serde_json::Value::Object(object))));
        }
        first_row += group.metadata().num_rows() as usize;
    }
    Ok(out)
}

//! Parquet data: rows of each kind read as JSONL lines do, and a bad row, column or file is named
//! with where it is.

use super::*;
use xtrain::data::{self, Columns, Example};

fn chat(user: &str, assistant: &str) -> Value {
    json!([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])
}

fn msg(role: &str, content: &str) -> data::text::Message {
    data::text::Message {
        role: role.into(),
        content: content.into(),
    }
}

/// What `data::read_examples` says is wrong with `path`, read with the default columns.
fn read_error(path: &Path) -> String {
    data::read_examples(path, false, &Columns::default())
        .err()
        .unwrap()
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// Rows of each kind

#[test]
fn parquet_rows_of_each_kind_read_as_jsonl_lines_do() {
    let dir = tempdir("parquet-kinds");
    let p = dir.join("mixed.parquet");
    let cols = [
        ("text", Kind::Str),
        ("instruction", Kind::Str),
        ("input", Kind::Str),
        ("output", Kind::Str),
        ("messages", Kind::Messages),
    ];
    write_parquet(
        &p,
        &cols,
        &[
            vec![
                json!({"text": "hello"}),
                json!({"instruction": "Add", "input": "1 2", "output": "3"}),
            ],
            vec![json!({"messages": chat("hi", "yo")})],
        ],
    );
    let r = data::read_examples(&p, false, &Columns::default()).unwrap();
    assert_eq!(
        r.examples,
        vec![
            Example::Text("hello".into()),
            Example::Chat(vec![msg("user", "Add\n\n1 2"), msg("assistant", "3")]),
            Example::Chat(vec![msg("user", "hi"), msg("assistant", "yo")]),
        ]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Other column names, named as --text-column and --messages-column name them.
#[test]
fn parquet_columns_of_other_names_are_read_when_named() {
    let dir = tempdir("parquet-renamed");
    let q = dir.join("renamed.parquet");
    write_parquet(
        &q,
        &[("body", Kind::Str), ("conversation", Kind::Messages)],
        &[vec![
            json!({"body": "plain"}),
            json!({"conversation": chat("a", "b")}),
        ]],
    );
    let named = Columns::new(Some("body".into()), Some("conversation".into()));
    let r = data::read_examples(&q, false, &named).unwrap();
    assert_eq!(r.examples[0], Example::Text("plain".into()));
    assert_eq!(
        r.examples[1],
        Example::Chat(vec![msg("user", "a"), msg("assistant", "b")])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Messages stored as a JSON string, as some datasets do.
#[test]
fn parquet_messages_stored_as_a_json_string_read_as_a_chat() {
    let dir = tempdir("parquet-json-string");
    let s = dir.join("json-string.parquet");
    let as_string = chat("q", "r").to_string();
    write_parquet(
        &s,
        &[("messages", Kind::Str)],
        &[vec![json!({ "messages": as_string })]],
    );
    let r = data::read_examples(&s, false, &Columns::default()).unwrap();
    assert_eq!(
        r.examples[0],
        Example::Chat(vec![msg("user", "q"), msg("assistant", "r")])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Bad rows, columns and files

/// `dir/bad.parquet`: two row groups of chats, the second group's row 1 (the file's row 3)
/// without an answer.
fn parquet_with_a_bad_row(dir: &Path) -> PathBuf {
    let p = dir.join("bad.parquet");
    let good = || json!({"messages": chat("hi", "yo")});
    let no_answer = json!({"messages": [{"role": "user", "content": "hi"}]});
    write_parquet(
        &p,
        &[("messages", Kind::Messages)],
        &[vec![good(), good()], vec![good(), no_answer, good()]],
    );
    p
}

#[test]
fn a_bad_parquet_row_names_its_file_row_group_and_row() {
    let dir = tempdir("parquet-bad");
    let e = read_error(&parquet_with_a_bad_row(&dir));
    assert!(
        e.contains("bad.parquet: row group 1, row 1 (row 3 of the file")
            && e.contains("no assistant message"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_parquet_row_is_skipped_and_counted_as_a_row_with_skip_bad_lines() {
    let dir = tempdir("parquet-bad-skipped");
    let p = parquet_with_a_bad_row(&dir);
    let r = data::read_examples(&p, true, &Columns::default()).unwrap();
    assert_eq!(r.examples.len(), 4);
    assert_eq!(r.skipped.len(), 1);
    assert_eq!(r.skipped[0].0, 3);
    assert_eq!(r.unit, "row");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// No column to train on: the error lists what the file has; on the command line too, naming
/// the file.
#[test]
fn a_parquet_file_with_no_column_to_train_on_lists_the_columns_it_has() {
    let dir = tempdir("parquet-no-column");
    let q = dir.join("other.parquet");
    write_parquet(
        &q,
        &[("question", Kind::Str), ("conversation", Kind::Messages)],
        &[vec![json!({"question": "x"})]],
    );
    let e = read_error(&q);
    assert!(
        e.contains("the file has question: string, conversation: list")
            && e.contains("--text-column"),
        "{e}"
    );
    let model = tiny_text_model(&dir);
    let out = dir.join("run");
    let err = fails(&refs(&[
        "train".into(),
        "--model".into(),
        model.display().to_string(),
        "--data".into(),
        q.display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ]));
    assert!(
        err.contains("other.parquet: no column to train on"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_parquet_file_that_is_not_parquet_is_refused_as_such() {
    let dir = tempdir("parquet-fake");
    let fake = dir.join("fake.parquet");
    std::fs::write(&fake, "{\"text\": \"not parquet\"}\n").unwrap();
    let e = read_error(&fake);
    assert!(
        e.contains("fake.parquet is not a readable Parquet file"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `text` column of integers is refused naming the column and its type (it was "expected
/// `text`, ...").
#[test]
fn a_parquet_text_column_of_numbers_is_refused_naming_its_type() {
    let dir = tempdir("parquet-text-ints");
    let ints = dir.join("ints.parquet");
    write_parquet(
        &ints,
        &[("text", Kind::Int64)],
        &[vec![json!({"text": 1}), json!({"text": 2})]],
    );
    let e = read_error(&ints);
    assert!(
        e.contains("ints.parquet: column `text` holds int64 values, not strings")
            && e.contains("the file has text: int64"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A row whose text is null is named with its file, row group and row and said to be null (it
/// was "expected `text`, ...").
#[test]
fn a_parquet_row_whose_text_is_null_is_named_and_said_to_be_null() {
    let dir = tempdir("parquet-text-null");
    let nulls = dir.join("nulls.parquet");
    write_parquet(
        &nulls,
        &[("text", Kind::Str)],
        &[
            vec![json!({"text": "fine"})],
            vec![json!({"text": "ok"}), json!({})],
        ],
    );
    let e = read_error(&nulls);
    assert!(
        e.contains("nulls.parquet: row group 1, row 1 (row 2 of the file, counting from 0): `text` is null"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The JSONL counterpart of the two above: a line whose text is a number says so.
#[test]
fn a_jsonl_line_whose_text_is_a_number_says_so() {
    let dir = tempdir("parquet-jsonl-number");
    let jsonl = dir.join("numbers.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"fine\"}\n{\"text\": 42}\n").unwrap();
    let e = read_error(&jsonl);
    assert!(
        e.contains("numbers.jsonl:2: `text` is a number (42), not a string"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Text and messages both

/// `dir/both.parquet`: two rows with both a `text` and a `messages` column.
fn parquet_with_text_and_messages(dir: &Path) -> PathBuf {
    let p = dir.join("both.parquet");
    write_parquet(
        &p,
        &[("text", Kind::Str), ("messages", Kind::Messages)],
        &[vec![
            json!({"text": "user: hi assistant: yo", "messages": chat("hi", "yo")}),
            json!({"text": "user: a assistant: b", "messages": chat("a", "b")}),
        ]],
    );
    p
}

/// A Parquet file with both a `text` and a `messages` column trains on the messages (as TRL
/// does with a conversational dataset) and says so, naming --text-column, which trains on the
/// text instead; `xtrain train` says it.
#[test]
fn a_parquet_file_with_text_and_messages_says_which_column_it_trains_on() {
    let dir = tempdir("parquet-both");
    let p = parquet_with_text_and_messages(&dir);
    let r = data::read_examples(&p, false, &Columns::default()).unwrap();
    assert_eq!(
        r.examples[0],
        Example::Chat(vec![msg("user", "hi"), msg("assistant", "yo")])
    );
    assert!(
        r.notes.len() == 1
            && r.notes[0].contains(
                "both.parquet has both a `messages` and a `text` column: training on `messages`"
            )
            && r.notes[0].contains("pass --text-column text"),
        "{:?}",
        r.notes
    );
    let o = train_cmd(&tiny_text_model(&dir), &p, &dir.join("run"))
        .args([
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--seq",
            "32",
            "--lora-r",
            "4",
        ])
        .args(["--log-every", "0", "--no-plot"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("training on `messages`"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_parquet_file_with_text_and_messages_trains_on_the_text_with_text_column() {
    let dir = tempdir("parquet-both-text-column");
    let p = parquet_with_text_and_messages(&dir);
    let text = Columns::new(Some("text".into()), None);
    let r = data::read_examples(&p, false, &text).unwrap();
    assert_eq!(
        r.examples[0],
        Example::Text("user: hi assistant: yo".into())
    );
    assert!(
        r.notes[0].contains("training on `text` (--text-column)"),
        "{:?}",
        r.notes
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Preference pairs (`--method dpo`) from Parquet: plain-text columns and conversational ones
/// (lists of {role, content} structs) read as the same rows of JSONL do; a missing column is
/// named with the file's columns.
#[test]
fn parquet_preference_pairs_read_as_jsonl_lines_do() {
    use xtrain::data::pairs::read_pairs;
    let dir = tempdir("parquet-pairs");
    let text = dir.join("text.parquet");
    let rows = [
        json!({"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5"}),
        json!({"prompt": "Hi", "chosen": " hello", "rejected": " go"}),
    ];
    let str_cols = [
        ("prompt", Kind::Str),
        ("chosen", Kind::Str),
        ("rejected", Kind::Str),
    ];
    write_parquet(&text, &str_cols, &[rows[..1].to_vec(), rows[1..].to_vec()]);
    let jsonl = dir.join("text.jsonl");
    let lines: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&jsonl, lines).unwrap();
    let pairs = |p: &Path| -> Vec<_> {
        read_pairs(p, false)
            .unwrap()
            .pairs
            .into_iter()
            .map(|(_, pair)| pair)
            .collect()
    };
    assert_eq!(pairs(&text), pairs(&jsonl));
    let chat = dir.join("chat.parquet");
    let chat_cols = [
        ("prompt", Kind::Messages),
        ("chosen", Kind::Messages),
        ("rejected", Kind::Messages),
    ];
    let one = |role: &str, content: &str| json!([{"role": role, "content": content}]);
    let chat_rows = vec![json!({
        "prompt": one("user", "2+2?"),
        "chosen": one("assistant", "4"),
        "rejected": one("assistant", "5"),
    })];
    write_parquet(&chat, &chat_cols, std::slice::from_ref(&chat_rows));
    let chat_jsonl = dir.join("chat.jsonl");
    std::fs::write(&chat_jsonl, format!("{}\n", chat_rows[0])).unwrap();
    assert_eq!(pairs(&chat), pairs(&chat_jsonl));
    let missing = dir.join("missing.parquet");
    write_parquet(
        &missing,
        &str_cols[..2],
        &[vec![json!({"prompt": "a", "chosen": "b"})]],
    );
    let e = read_pairs(&missing, false).err().unwrap().to_string();
    assert!(
        e.contains("no column `rejected`") && e.contains("prompt: string, chosen: string"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

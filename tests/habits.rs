//! What people who fine-tune bring along: models by Hugging Face repo id from the hub cache,
//! Parquet data, TensorBoard curves (read back by TensorBoard's own reader) and TOML recipes
//! (every file in recipes/ compiles).

mod common;
use common::*;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use xtrain::data::{self, Columns, Example};
use xtrain::formats::hub::{self, Lookup, Need};

// ---------------------------------------------------------------------------------------------
// The hub cache

/// A fake hub cache holding repo `org/tiny` as `huggingface_hub` lays it out: `refs/main` and
/// `refs/v1` -> a snapshot whose files are symlinks into `blobs/`. Returns (cache, hash).
fn fake_hub_cache(dir: &Path) -> (PathBuf, String) {
    let model = tiny_text_model(dir);
    let cache = dir.join("hub");
    let repo = cache.join("models--org--tiny");
    let hash = "0123456789abcdef0123456789abcdef01234567".to_string();
    let snap = repo.join("snapshots").join(&hash);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    for (i, f) in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .iter()
    .enumerate()
    {
        let blob = repo.join("blobs").join(format!("blob{i:040}"));
        std::fs::copy(model.join(f), &blob).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/blob{i:040}"), snap.join(f)).unwrap();
    }
    std::fs::write(repo.join("refs/main"), &hash).unwrap();
    std::fs::write(repo.join("refs/v1"), format!("{hash}\n")).unwrap();
    (cache, hash)
}

#[test]
fn a_repo_id_resolves_in_the_hub_cache_by_branch_tag_or_commit() {
    let dir = tempdir("hub-lookup");
    let (cache, hash) = fake_hub_cache(&dir);
    let snap = cache.join("models--org--tiny/snapshots").join(&hash);
    for rev in [None, Some("main"), Some("v1"), Some(hash.as_str())] {
        match hub::lookup(&cache, "org/tiny", rev, Need::Weights).unwrap() {
            Lookup::Found(d) => assert_eq!(d, snap, "{rev:?}"),
            Lookup::Missing(why) => panic!("{rev:?}: {why}"),
        }
    }
    let missing = |id: &str, rev: Option<&str>, need: Need| match hub::lookup(&cache, id, rev, need)
        .unwrap()
    {
        Lookup::Found(d) => panic!("{id} {rev:?} found {}", d.display()),
        Lookup::Missing(why) => why,
    };
    assert!(missing("org/other", None, Need::Config).contains("models--org--other does not exist"));
    assert!(missing("org/tiny", Some("v2"), Need::Config).contains("no revision `v2`"));
    // A sharded checkpoint with a shard not downloaded is not there for training, but its
    // config is there for compiling.
    let (cache2, hash2) = fake_hub_cache(&dir.join("sharded"));
    let snap2 = cache2.join("models--org--tiny/snapshots").join(&hash2);
    std::fs::remove_file(snap2.join("model.safetensors")).unwrap();
    std::fs::write(
        snap2.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    std::fs::write(snap2.join("model-00001-of-00002.safetensors"), b"").unwrap();
    match hub::lookup(&cache2, "org/tiny", None, Need::Weights).unwrap() {
        Lookup::Missing(why) => assert!(why.contains("model-00002-of-00002"), "{why}"),
        Lookup::Found(_) => panic!("a missing shard is not a complete model"),
    }
    assert!(matches!(
        hub::lookup(&cache2, "org/tiny", None, Need::Config).unwrap(),
        Lookup::Found(_)
    ));
    assert!(hub::is_repo_id("meta-llama/Llama-3.1-8B-Instruct"));
    for not in [
        "llama-3.1-8b",
        "./x",
        "/abs/path",
        "a/b/c",
        "a/..",
        "-a/b",
        "org/",
    ] {
        assert!(!hub::is_repo_id(not), "{not}");
    }
}

#[test]
fn a_repo_id_not_in_the_cache_while_offline_says_where_it_looked_and_how_to_download_it() {
    let dir = tempdir("hub-offline");
    let (cache, _) = fake_hub_cache(&dir);
    let d = dir.to_str().unwrap();
    for args in [
        vec![
            "train",
            "--model",
            "org/absent",
            "--data",
            "d.jsonl",
            "--out",
            d,
        ],
        vec!["generate", "--model", "org/absent", "--prompt", "hi"],
        vec!["compile", "--model", "org/absent", "--out", d],
        vec!["merge", "--model", "org/absent", "--adapter", d, "--out", d],
        vec![
            "train",
            "--model",
            "org/tiny",
            "--revision",
            "v9",
            "--data",
            "d.jsonl",
            "--out",
            d,
        ],
    ] {
        let o = xtrain_cmd()
            .args(&args)
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.starts_with("error: "),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            err.contains(&cache.display().to_string()),
            "names the cache: {err}"
        );
        assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
        assert!(
            err.contains("huggingface-cli download org/"),
            "says how: {err}"
        );
    }
    // HF_HOME/hub when HF_HUB_CACHE is not set.
    let o = xtrain_cmd()
        .args(["compile", "--model", "org/absent", "--out"])
        .arg(&dir)
        .env_remove("HF_HUB_CACHE")
        .env("HF_HOME", dir.join("hfhome"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&dir.join("hfhome/hub").display().to_string()),
        "{err}"
    );
    // A preset's repo compiles without the cache, from the built-in config.
    let out = dir.join("prog");
    let o = xtrain_cmd()
        .args([
            "compile",
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--out",
        ])
        .arg(&out)
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("built-in config (llama-3.1-8b)"));
}

/// A ref naming a snapshot that is not there, and a snapshot's file linking to a blob that is
/// gone, are named (the ref and its snapshot; the link and its target), where they read "has
/// no config.json" or "has neither model.safetensors ..."; the command line says it too.
#[test]
fn a_broken_ref_or_blob_link_in_the_hub_cache_is_named() {
    let dir = tempdir("hub-broken");
    let (cache, hash) = fake_hub_cache(&dir);
    let repo = cache.join("models--org--tiny");
    let why =
        |rev: Option<&str>, need: Need| match hub::lookup(&cache, "org/tiny", rev, need).unwrap() {
            Lookup::Found(d) => panic!("{rev:?} found {}", d.display()),
            Lookup::Missing(why) => why,
        };
    // refs/v3 names a commit whose snapshot is not in the cache.
    let gone = "fedcba9876543210fedcba9876543210fedcba98";
    std::fs::write(repo.join("refs/v3"), gone).unwrap();
    let w = why(Some("v3"), Need::Config);
    assert!(
        w.contains(&format!(
            "{} names commit {gone}, but its snapshot {} does not exist",
            repo.join("refs/v3").display(),
            repo.join("snapshots").join(gone).display()
        )),
        "{w}"
    );
    // The weights' blob deleted: the link and where it points.
    let snap = repo.join("snapshots").join(&hash);
    std::fs::remove_file(repo.join("blobs").join(format!("blob{:040}", 1))).unwrap();
    let w = why(None, Need::Weights);
    assert!(
        w.contains(&format!(
            "{} is a link to {}, which does not exist",
            snap.join("model.safetensors").display(),
            snap.join(format!("../../blobs/blob{:040}", 1)).display()
        )),
        "{w}"
    );
    // The config's blob deleted too.
    std::fs::remove_file(repo.join("blobs").join(format!("blob{:040}", 0))).unwrap();
    let w = why(None, Need::Config);
    assert!(
        w.contains(&format!(
            "{} is a link to ",
            snap.join("config.json").display()
        )),
        "{w}"
    );
    let o = xtrain_cmd()
        .args([
            "compile",
            "--model",
            "org/tiny",
            "--revision",
            "v3",
            "--out",
        ])
        .arg(dir.join("p"))
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.starts_with("error: "), "{err}");
    assert!(err.contains("refs/v3 names commit"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A download that fails says its network error once (it was said three times: hf-hub's error,
/// then each of its causes, which its text already held).
#[test]
fn a_failed_download_says_its_network_error_once() {
    let dir = tempdir("hub-download-fails");
    // Nothing listens on port 9 of this machine: the connection is refused at once.
    let o = xtrain_cmd()
        .args(["compile", "--model", "org/absent", "--out"])
        .arg(dir.join("p"))
        .env("HF_HUB_CACHE", dir.join("hub"))
        .env_remove("HF_HUB_OFFLINE")
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("downloading it failed"),
        "{err}"
    );
    assert_eq!(
        last.matches("http://127.0.0.1:9/api/models/org/absent")
            .count(),
        1,
        "{last}"
    );
    let parts: Vec<&str> = last.split(": ").filter(|p| p.len() > 12).collect();
    for p in &parts {
        assert_eq!(
            parts.iter().filter(|q| q == &p).count(),
            1,
            "`{p}` said twice: {last}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second snapshot of `org/tiny` in `cache` (the same files, as links into the same blobs),
/// named by `refs/{tag}`. Returns its commit.
fn add_snapshot(cache: &Path, main: &str, tag: &str, commit: &str) -> String {
    let repo = cache.join("models--org--tiny");
    let snap = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    for e in std::fs::read_dir(repo.join("snapshots").join(main)).unwrap() {
        let e = e.unwrap();
        let target = std::fs::read_link(e.path()).unwrap();
        std::os::unix::fs::symlink(target, snap.join(e.file_name())).unwrap();
    }
    std::fs::write(repo.join("refs").join(tag), commit).unwrap();
    commit.to_string()
}

/// `--model org/tiny --revision v2` trains on v2's snapshot, and the adapter (and each
/// checkpoint's) records that commit as PEFT's `revision`, so PEFT loads it onto the same
/// weights rather than onto `main`; without `--revision`, main's commit.
#[test]
fn an_adapter_trained_at_a_revision_records_its_commit_for_peft() {
    let dir = tempdir("hub-revision");
    let (cache, main) = fake_hub_cache(&dir);
    let v2 = add_snapshot(
        &cache,
        &main,
        "v2",
        "89abcdef0123456789abcdef0123456789abcdef",
    );
    let data = dir.join("d.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"hello there\"}\n{\"text\": \"general kenobi\"}\n",
    )
    .unwrap();
    for (revision, commit) in [(Some("v2"), &v2), (None, &main)] {
        let out = dir.join(format!("run-{}", revision.unwrap_or("main")));
        let mut c = xtrain_cmd();
        c.args(["train", "--model", "org/tiny"]);
        if let Some(r) = revision {
            c.args(["--revision", r]);
        }
        let o = c
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(&out)
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
            .args(["--save-every", "1", "--log-every", "0", "--no-plot"])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for adapter in ["adapter", "checkpoint-1", "step-1"] {
            let config: Value = serde_json::from_str(
                &std::fs::read_to_string(out.join(adapter).join("adapter_config.json")).unwrap(),
            )
            .unwrap();
            assert_eq!(config["base_model_name_or_path"], "org/tiny", "{adapter}");
            assert_eq!(
                config["revision"],
                commit.as_str(),
                "{revision:?} {adapter}: {config}"
            );
        }
    }
    // A plain directory has no revision (PEFT's null).
    let out = dir.join("run-dir");
    let o = train_cmd(&tiny_text_model(&dir), &data, &out)
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
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert!(config["revision"].is_null(), "{config}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Parquet

/// A column of a test Parquet file: a string, or a chat as a list of {role, content} structs.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Messages,
    Int64,
}

/// Write `groups` (row groups of JSON objects) as a Snappy-compressed Parquet file with
/// `columns`, in the standard three-level list layout pyarrow writes.
fn write_parquet(path: &Path, columns: &[(&str, Kind)], groups: &[Vec<Value>]) {
    let mut schema = String::from("message schema {\n");
    for (name, kind) in columns {
        schema.push_str(&match kind {
            Kind::Str => format!("  optional binary {name} (STRING);\n"),
            Kind::Int64 => format!("  optional int64 {name};\n"),
            Kind::Messages => format!(
                "  optional group {name} (LIST) {{ repeated group list {{ optional group element {{ optional binary role (STRING); optional binary content (STRING); }} }} }}\n"
            ),
        });
    }
    schema.push('}');
    let schema = Arc::new(parquet::schema::parser::parse_message_type(&schema).unwrap());
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    for rows in groups {
        // Each leaf column: (values, definition levels, repetition levels); int64 columns'
        // values apart.
        let mut leaves: Vec<(Vec<ByteArray>, Vec<i16>, Vec<i16>)> = Vec::new();
        let mut ints: Vec<Vec<i64>> = Vec::new();
        for (name, kind) in columns {
            match kind {
                Kind::Int64 => {
                    let mut c = (vec![], vec![], vec![]);
                    let mut values = vec![];
                    for r in rows {
                        match r.get(*name).and_then(|v| v.as_i64()) {
                            Some(i) => {
                                values.push(i);
                                c.1.push(1);
                            }
                            None => c.1.push(0),
                        }
                        c.2.push(0);
                    }
                    leaves.push(c);
                    ints.push(values);
                }
                Kind::Str => {
                    let mut c = (vec![], vec![], vec![]);
                    for r in rows {
                        match r.get(*name).and_then(|v| v.as_str()) {
                            Some(s) => {
                                c.0.push(ByteArray::from(s));
                                c.1.push(1);
                            }
                            None => c.1.push(0),
                        }
                        c.2.push(0);
                    }
                    leaves.push(c);
                }
                Kind::Messages => {
                    for field in ["role", "content"] {
                        let mut c = (vec![], vec![], vec![]);
                        for r in rows {
                            match r.get(*name).and_then(|v| v.as_array()) {
                                None => {
                                    c.1.push(0);
                                    c.2.push(0);
                                }
                                Some(list) if list.is_empty() => {
                                    c.1.push(1);
                                    c.2.push(0);
                                }
                                Some(list) => {
                                    for (i, m) in list.iter().enumerate() {
                                        c.2.push(if i == 0 { 0 } else { 1 });
                                        match m.get(field).and_then(|v| v.as_str()) {
                                            Some(s) => {
                                                c.0.push(ByteArray::from(s));
                                                c.1.push(4);
                                            }
                                            None => c.1.push(3),
                                        }
                                    }
                                }
                            }
                        }
                        leaves.push(c);
                    }
                }
            }
        }
        let mut rg = w.next_row_group().unwrap();
        let (mut leaves, mut ints) = (leaves.into_iter(), ints.into_iter());
        while let Some(mut col) = rg.next_column().unwrap() {
            let (values, defs, reps) = leaves.next().unwrap();
            if matches!(
                col.untyped(),
                parquet::column::writer::ColumnWriter::Int64ColumnWriter(_)
            ) {
                col.typed::<parquet::data_type::Int64Type>()
                    .write_batch(&ints.next().unwrap(), Some(&defs), Some(&reps))
                    .unwrap();
            } else {
                col.typed::<ByteArrayType>()
                    .write_batch(&values, Some(&defs), Some(&reps))
                    .unwrap();
            }
            col.close().unwrap();
        }
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn chat(user: &str, assistant: &str) -> Value {
    json!([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])
}

fn msg(role: &str, content: &str) -> data::text::Message {
    data::text::Message {
        role: role.into(),
        content: content.into(),
    }
}

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
    // Other column names, and messages stored as a JSON string, as some datasets do.
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
}

#[test]
fn a_bad_parquet_row_names_file_row_group_and_row_and_missing_columns_are_listed() {
    let dir = tempdir("parquet-bad");
    let p = dir.join("bad.parquet");
    let good = || json!({"messages": chat("hi", "yo")});
    let no_answer = json!({"messages": [{"role": "user", "content": "hi"}]});
    write_parquet(
        &p,
        &[("messages", Kind::Messages)],
        &[vec![good(), good()], vec![good(), no_answer, good()]],
    );
    let e = data::read_examples(&p, false, &Columns::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("bad.parquet: row group 1, row 1 (row 3 of the file")
            && e.contains("no assistant message"),
        "{e}"
    );
    let r = data::read_examples(&p, true, &Columns::default()).unwrap();
    assert_eq!(r.examples.len(), 4);
    assert_eq!(r.skipped.len(), 1);
    assert_eq!(r.skipped[0].0, 3);
    assert_eq!(r.unit, "row");

    // No column to train on: the error lists what the file has.
    let q = dir.join("other.parquet");
    write_parquet(
        &q,
        &[("question", Kind::Str), ("conversation", Kind::Messages)],
        &[vec![json!({"question": "x"})]],
    );
    let e = data::read_examples(&q, false, &Columns::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("the file has question: string, conversation: list")
            && e.contains("--text-column"),
        "{e}"
    );
    // On the command line too, naming the file; and a file that is not Parquet.
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
    let fake = dir.join("fake.parquet");
    std::fs::write(&fake, "{\"text\": \"not parquet\"}\n").unwrap();
    let e = data::read_examples(&fake, false, &Columns::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("fake.parquet is not a readable Parquet file"),
        "{e}"
    );
}

/// A `text` column of integers is refused naming the column and its type, and a row whose text
/// is null is named with its file, row group and row and said to be null (both were "expected
/// `text`, ...").
#[test]
fn a_parquet_text_column_of_numbers_or_a_null_text_says_which_and_where() {
    let dir = tempdir("parquet-text-types");
    let ints = dir.join("ints.parquet");
    write_parquet(
        &ints,
        &[("text", Kind::Int64)],
        &[vec![json!({"text": 1}), json!({"text": 2})]],
    );
    let e = data::read_examples(&ints, false, &Columns::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("ints.parquet: column `text` holds int64 values, not strings")
            && e.contains("the file has text: int64"),
        "{e}"
    );
    let nulls = dir.join("nulls.parquet");
    write_parquet(
        &nulls,
        &[("text", Kind::Str)],
        &[
            vec![json!({"text": "fine"})],
            vec![json!({"text": "ok"}), json!({})],
        ],
    );
    let e = data::read_examples(&nulls, false, &Columns::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("nulls.parquet: row group 1, row 1 (row 2 of the file, counting from 0): `text` is null"),
        "{e}"
    );
    // A JSONL line whose text is a number says so too.
    let jsonl = dir.join("numbers.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"fine\"}\n{\"text\": 42}\n").unwrap();
    let e = data::read_examples(&jsonl, false, &Columns::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("numbers.jsonl:2: `text` is a number (42), not a string"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Parquet file with both a `text` and a `messages` column trains on the messages (as TRL
/// does with a conversational dataset) and says so, naming --text-column, which trains on the
/// text instead.
#[test]
fn a_parquet_file_with_text_and_messages_says_which_column_it_trains_on() {
    let dir = tempdir("parquet-both");
    let p = dir.join("both.parquet");
    write_parquet(
        &p,
        &[("text", Kind::Str), ("messages", Kind::Messages)],
        &[vec![
            json!({"text": "user: hi assistant: yo", "messages": chat("hi", "yo")}),
            json!({"text": "user: a assistant: b", "messages": chat("a", "b")}),
        ]],
    );
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
    // `xtrain train` says it.
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

// ---------------------------------------------------------------------------------------------
// A run: repo id + Parquet + recipe, with TensorBoard scalars read back by TensorBoard

/// TensorBoard's reader on a run dir: {tag: [(step, value, wall time)]}.
fn tensorboard_scalars(logdir: &Path) -> serde_json::Map<String, Value> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value, e.wall_time] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let o = std::process::Command::new(tensorboard_python())
        .arg("-c")
        .arg(script)
        .arg(logdir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "TensorBoard's reader failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice::<Value>(&o.stdout)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

/// What TensorBoard's app shows (`plugin_event_accumulator`, scalars as tensors) on a run dir:
/// {tag: [(step, value, wall time)]}.
fn tensorboard_app_scalars(logdir: &Path) -> serde_json::Map<String, Value> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import plugin_event_accumulator as pea
from tensorboard.util import tensor_util
acc = pea.EventAccumulator(sys.argv[1], size_guidance={pea.TENSORS: 0})
acc.Reload()
print(json.dumps({t: [[e.step, float(tensor_util.make_ndarray(e.tensor_proto)), e.wall_time] for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}))
"#;
    let o = std::process::Command::new(tensorboard_python())
        .arg("-c")
        .arg(script)
        .arg(logdir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "TensorBoard's reader failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice::<Value>(&o.stdout)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

/// A run that logged to step 5, resumed from its checkpoint-3 and stopped after step 4: both of
/// TensorBoard's readers show steps 1 to 4 once each, with the values metrics.jsonl has, step 4
/// the resumed run's (logged after it started), and not the first run's steps 4 and 5 (they
/// showed step 4 twice and the stale step 5).
#[test]
fn tensorboard_after_a_resume_shows_each_step_once_as_metrics_jsonl_does() {
    let dir = tempdir("tensorboard-resume");
    let model = tiny_text_model(&dir);
    let data = dir.join("d.jsonl");
    let lines: String = (0..8)
        .map(|i| format!("{{\"text\": \"example number {i} of a few\"}}\n"))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let out = dir.join("run");
    let common = [
        "--batch-size",
        "1",
        "--seq",
        "32",
        "--lora-r",
        "4",
        "--log-every",
        "0",
    ];
    let o = train_cmd(&model, &data, &out)
        .args(["--steps", "5", "--save-every", "3", "--no-plot"])
        .args(common)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The same run resumes deterministically (the same losses): whose step 4 is shown is told
    // by its wall time.
    let resumed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let o = xtrain_cmd()
        .args(["train", "--resume"])
        .arg(out.join("checkpoint-3"))
        .arg("--model")
        .arg(&model)
        .arg("--data")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .args(["--stop-after", "1"])
        .args(common)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let metrics: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|m: &Value| m.get("loss").is_some())
        .collect();
    let want: Vec<(u64, f64)> = metrics
        .iter()
        .map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(
        want.iter().map(|w| w.0).collect::<Vec<_>>(),
        vec![1, 2, 3, 4],
        "{metrics:?}"
    );
    let tb = out.join("tensorboard");
    for (reader, scalars) in [
        ("EventAccumulator", tensorboard_scalars(&tb)),
        ("plugin_event_accumulator", tensorboard_app_scalars(&tb)),
    ] {
        let got: Vec<(u64, f64, f64)> = scalars["train/loss"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let f = |i: usize| p[i].as_f64().unwrap();
                (p[0].as_u64().unwrap(), f(1), f(2))
            })
            .collect();
        assert_eq!(got.len(), want.len(), "{reader}: {got:?} vs {want:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g.0 == w.0 && (g.1 - w.1).abs() <= 1e-6 * w.1.abs(),
                "{reader}: {got:?} vs metrics.jsonl {want:?}"
            );
        }
        assert!(
            got[3].2 > resumed_at && got[2].2 < resumed_at,
            "{reader}: step 4 is the resumed run's, step 3 the first run's: {got:?} (resumed at {resumed_at})"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_recipe_trains_a_repo_id_on_parquet_and_tensorboard_reads_its_scalars() {
    let dir = tempdir("habits-run");
    let (cache, _) = fake_hub_cache(&dir);
    let data = dir.join("train.parquet");
    let rows: Vec<Value> = (0..12)
        .map(|i| json!({"instruction": format!("Echo {i}"), "output": format!("{i} {i}")}))
        .collect();
    write_parquet(
        &data,
        &[("instruction", Kind::Str), ("output", Kind::Str)],
        &[rows[..7].to_vec(), rows[7..].to_vec()],
    );
    let out = dir.join("run");
    let recipe = dir.join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            r#"# the tiny model by repo id, from the (fake) hub cache
model = "org/tiny"
data = "{}"
batch_size = 2
seq = 48
lora_r = 4
lora_alpha = 8
lora_targets = ["q", "v"]
lr = 1e-3
steps = 4
eval_fraction = 0.25
eval_every = 2
log_every = 0
no_plot = true

[train]
out = "{}"
seed = 3

[compile]
out = "unused-by-train"
"#,
            data.display(),
            out.display()
        ),
    )
    .unwrap();
    // --steps 3 on the command line overrides the recipe's 4; --peak-tflops gives train/mfu.
    let o = xtrain_cmd()
        .args(["train", "--config"])
        .arg(&recipe)
        .args(["--steps", "3", "--peak-tflops", "0.001"])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let metrics: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<&Value> = metrics.iter().filter(|m| m.get("loss").is_some()).collect();
    let evals: Vec<&Value> = metrics
        .iter()
        .filter(|m| m.get("eval_loss").is_some())
        .collect();
    assert_eq!(
        steps.len(),
        3,
        "the command line's --steps won: {metrics:?}"
    );
    assert_eq!(evals.len(), 3, "steps 0, 2 and 3: {metrics:?}");
    let adapter: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(adapter["r"], 4);
    assert_eq!(
        adapter["base_model_name_or_path"], "org/tiny",
        "the adapter names the repo, not the snapshot path"
    );

    // One event file, read by TensorBoard's own reader: every scalar at its step.
    let tb = out.join("tensorboard");
    let files: Vec<String> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        files.len() == 1 && files[0].starts_with("events.out.tfevents."),
        "{files:?}"
    );
    let scalars = tensorboard_scalars(&tb);
    let series = |tag: &str| -> Vec<(u64, f64)> {
        scalars
            .get(tag)
            .unwrap_or_else(|| panic!("no {tag} in {:?}", scalars.keys()))
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
            .collect()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    for (tag, key, rows) in [
        ("train/loss", "loss", &steps),
        ("train/lr", "lr", &steps),
        ("train/grad_norm", "grad_norm", &steps),
        ("eval/loss", "eval_loss", &evals),
        ("eval/accuracy", "eval_accuracy", &evals),
    ] {
        let got = series(tag);
        assert_eq!(got.len(), rows.len(), "{tag}: {got:?}");
        for ((step, v), m) in got.iter().zip(rows.iter()) {
            assert_eq!(*step, m["step"].as_u64().unwrap(), "{tag}");
            assert!(
                close(*v, m[key].as_f64().unwrap()),
                "{tag} at {step}: {v} vs {}",
                m[key]
            );
        }
    }
    for tag in ["train/tokens_per_s", "train/mfu"] {
        let got = series(tag);
        assert_eq!(
            got.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![1, 2, 3],
            "{tag}"
        );
        assert!(got.iter().all(|p| p.1 > 0.0), "{tag}: {got:?}");
    }
    // tokens/s is the step's tokens over its time, as metrics.jsonl has them.
    for ((_, v), m) in series("train/tokens_per_s").iter().zip(&steps) {
        let want = m["tokens"].as_f64().unwrap() / m["step_time_s"].as_f64().unwrap();
        assert!((v - want).abs() <= 1e-3 * want, "{v} vs {want}");
    }
}

// ---------------------------------------------------------------------------------------------
// Recipes

fn manifest(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn recipe_keys_are_flags_the_command_line_overrides_and_a_wrong_key_names_the_nearest_flag() {
    let dir = tempdir("recipe-keys");
    let recipe = dir.join("r.toml");
    std::fs::write(
        &recipe,
        "model = \"tiny-llama3\"\nlora-r = 8\nlora_targets = [\"q\", \"v\"]\nseq = 32\nbatch_size = 2\nlr = 1e-4\n[compile]\nbatch = 4\n",
    )
    .unwrap();
    let out = dir.join("prog");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["compile", "--config", recipe.to_str().unwrap(), "--out"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.push(out.display().to_string());
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let o = xtrain(&refs(&args(&[])));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not used by `xtrain compile`: lr"),
        "train's keys are left out, and said so"
    );
    let m = manifest(&out);
    let spec = m.to_string();
    assert!(
        spec.contains("\"seq\":32") && spec.contains("\"batch\":4"),
        "[compile] overrides the top level: {spec}"
    );
    assert!(spec.contains("\"r\":8"), "{spec}");
    std::fs::remove_dir_all(&out).unwrap();
    let o = xtrain(&refs(&args(&["--lora-r", "2", "--seq", "16"])));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let spec = manifest(&out).to_string();
    assert!(
        spec.contains("\"r\":2") && spec.contains("\"seq\":16"),
        "flags override: {spec}"
    );

    for (text, want) in [
        ("learning_rate = 1e-4\n", "key `learning_rate` is not a flag of `xtrain train` or `xtrain compile`; the nearest flag is --lr"),
        ("lora_rnak = 4\n", "the nearest flag is --lora-r"),
        ("[compile]\nepochs = 2\n", "key `epochs` in [compile] is not a flag of `xtrain compile`"),
        ("[serve]\nport = 1\n", "[serve] is not a section"),
        ("check = \"yes\"\n", "`check` is a switch (--check): write true or false, not a string"),
        ("seq = [[1]]\n", "`seq` (--seq) takes a value, not an array"),
        ("seq = \n", "is not valid TOML"),
        ("config = \"other.toml\"\n", "`config` cannot be a recipe key"),
    ] {
        std::fs::write(&recipe, text).unwrap();
        let err = fails(&refs(&args(&["--model", "tiny-llama3"])));
        assert!(err.contains(want), "{text:?}: {err}");
        assert!(err.contains(recipe.to_str().unwrap()), "names the file: {err}");
    }
    let err = fails(&[
        "compile",
        "--config",
        "/nonexistent/r.toml",
        "--model",
        "x",
        "--out",
        "y",
    ]);
    assert!(err.contains("cannot read /nonexistent/r.toml"), "{err}");
}

/// `config` and `help` in a recipe (at the top or in a section) are refused as what they are,
/// not a recipe's settings; they were taken for misspelt flags ("the nearest flag is --out").
#[test]
fn a_recipe_key_config_or_help_is_said_not_to_be_a_setting() {
    let dir = tempdir("recipe-config-key");
    let recipe = dir.join("r.toml");
    for (text, want) in [
        (
            "config = \"base.toml\"\n",
            "`config` cannot be a recipe key: --config names the recipe file itself (a recipe cannot include another)",
        ),
        (
            "[train]\nhelp = true\n",
            "`help` cannot be a recipe key: --help prints the command's flags and runs nothing",
        ),
    ] {
        std::fs::write(&recipe, text).unwrap();
        let err = fails(&[
            "train",
            "--config",
            recipe.to_str().unwrap(),
            "--model",
            "x",
            "--data",
            "d.jsonl",
            "--out",
            dir.join("run").to_str().unwrap(),
        ]);
        assert!(err.contains(&format!("{}: {want}", recipe.display())), "{text:?}: {err}");
        assert!(!err.contains("nearest flag"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_recipe_compiles_without_weights() {
    let dir = tempdir("recipes");
    let recipes = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&recipes)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    names.sort();
    assert!(names.len() >= 6, "{names:?}");
    // The recipes' --target plugins are fetched on first use; ROCm's needs its runtime's stand-ins.
    let rocm_libs = rocm_standins_in("recipes-rocm");
    for r in names {
        let out = dir.join(r.file_stem().unwrap());
        // An empty hub cache and no downloads: the recipes' models are presets' repos.
        let o = xtrain_cmd()
            .args(["compile", "--config"])
            .arg(&r)
            .arg("--out")
            .arg(&out)
            .env("HF_HUB_CACHE", dir.join("empty-hub"))
            .env("HF_HUB_OFFLINE", "1")
            .env("LD_LIBRARY_PATH", &rocm_libs)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{}: {stdout}{}",
            r.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.join("train_step.mlir").is_file(), "{}", r.display());
        // A recipe for hardware names it as its --target, and compiles for it.
        let recipe = std::fs::read_to_string(&r).unwrap();
        if let Some(line) = recipe.lines().find(|l| l.starts_with("target = ")) {
            let target = line.trim_start_matches("target = ").trim_matches('"');
            assert!(
                stdout.contains(&format!("target {target}: ")),
                "{}: {stdout}",
                r.display()
            );
        }
    }
    std::fs::remove_dir_all(&rocm_libs).unwrap();
}

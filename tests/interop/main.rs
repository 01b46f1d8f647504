//! Interop with the tools people who fine-tune bring along (`cargo test --test interop`): models
//! by Hugging Face repo id from the hub cache,
//! Parquet data, TensorBoard curves (read back by TensorBoard's own reader) and TOML recipes
//! (every file in recipes/ compiles). The tests are grouped by what is brought along, one file
//! each, and the helpers they share are here.

#[path = "../common/mod.rs"]
mod common;
mod hub;
mod parquet_data;
mod recipes;
mod tensorboard;
use common::*;
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

// ---------------------------------------------------------------------------------------------
// A run: repo id + Parquet + recipe

/// A run trained with a recipe (`dir/recipe.toml`) on the tiny model by repo id from a fake hub
/// cache, on Parquet data in two row groups, with held-out examples evaluated every 2 steps:
/// `--steps 3` on the command line overrides the recipe's 4, `--peak-tflops` gives train/mfu.
/// Returns its run dir (`dir/run`), checked to have trained.
fn recipe_run_on_a_repo_id_and_parquet(dir: &Path) -> PathBuf {
    let (cache, _) = fake_hub_cache(dir);
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
    out
}

/// The records of run dir `out`'s metrics.jsonl: (the steps', the evaluations').
fn steps_and_evals(out: &Path) -> (Vec<Value>, Vec<Value>) {
    let metrics: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps = metrics
        .iter()
        .filter(|m| m.get("loss").is_some())
        .cloned()
        .collect();
    let evals = metrics
        .iter()
        .filter(|m| m.get("eval_loss").is_some())
        .cloned()
        .collect();
    (steps, evals)
}

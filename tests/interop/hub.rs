//! Models by Hugging Face repo id: looked up in the hub cache as `huggingface_hub` lays it out,
//! named where something is missing or broken, and recorded in the adapter for PEFT.

use super::*;
use xtrain::formats::hub::{self, Lookup, Need};

/// What `hub::lookup` says is missing for `id` at `rev` in `cache`; panics if it is found.
fn missing(cache: &Path, id: &str, rev: Option<&str>, need: Need) -> String {
    match hub::lookup(cache, id, rev, need).unwrap() {
        Lookup::Found(d) => panic!("{id} {rev:?} found {}", d.display()),
        Lookup::Missing(why) => why,
    }
}

/// `xtrain ARGS` with `cache` as the hub cache, offline.
fn offline(args: &[&str], cache: &Path) -> std::process::Output {
    xtrain_cmd()
        .args(args)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Lookups

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
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_repo_not_in_the_hub_cache_is_missing_naming_its_dir() {
    let dir = tempdir("hub-lookup-no-repo");
    let (cache, _) = fake_hub_cache(&dir);
    assert!(missing(&cache, "org/other", None, Need::Config)
        .contains("models--org--other does not exist"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_revision_not_in_the_hub_cache_is_missing_naming_it() {
    let dir = tempdir("hub-lookup-no-revision");
    let (cache, _) = fake_hub_cache(&dir);
    assert!(missing(&cache, "org/tiny", Some("v2"), Need::Config).contains("no revision `v2`"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sharded checkpoint with a shard not downloaded is not there for training, but its config is
/// there for compiling.
#[test]
fn a_sharded_checkpoint_missing_a_shard_is_there_for_compiling_but_not_for_training() {
    let dir = tempdir("hub-lookup-shard");
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
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_repo_id_is_told_from_preset_names_and_paths() {
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

// ---------------------------------------------------------------------------------------------
// Offline and downloads

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
        let o = offline(&args, &cache);
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
    std::fs::remove_dir_all(&dir).unwrap();
}

/// HF_HOME/hub when HF_HUB_CACHE is not set.
#[test]
fn offline_without_hf_hub_cache_the_cache_looked_in_is_hf_home_hub() {
    let dir = tempdir("hub-offline-hf-home");
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
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A preset's repo compiles without the cache, from the built-in config.
#[test]
fn a_presets_repo_id_compiles_offline_from_the_built_in_config() {
    let dir = tempdir("hub-offline-preset");
    let (cache, _) = fake_hub_cache(&dir);
    let out = dir.join("prog");
    let o = offline(
        &[
            "compile",
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--out",
            out.to_str().unwrap(),
        ],
        &cache,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("built-in config (llama-3.1-8b)"));
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

// ---------------------------------------------------------------------------------------------
// A broken cache

/// A ref naming a snapshot that is not there is named, the ref and its snapshot (where it read
/// "has no config.json"); the command line says it too.
#[test]
fn a_ref_naming_a_snapshot_not_in_the_hub_cache_is_named_with_it() {
    let dir = tempdir("hub-broken-ref");
    let (cache, _) = fake_hub_cache(&dir);
    let repo = cache.join("models--org--tiny");
    // refs/v3 names a commit whose snapshot is not in the cache.
    let gone = "fedcba9876543210fedcba9876543210fedcba98";
    std::fs::write(repo.join("refs/v3"), gone).unwrap();
    let w = missing(&cache, "org/tiny", Some("v3"), Need::Config);
    assert!(
        w.contains(&format!(
            "{} names commit {gone}, but its snapshot {} does not exist",
            repo.join("refs/v3").display(),
            repo.join("snapshots").join(gone).display()
        )),
        "{w}"
    );
    let o = offline(
        &[
            "compile",
            "--model",
            "org/tiny",
            "--revision",
            "v3",
            "--out",
            dir.join("p").to_str().unwrap(),
        ],
        &cache,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.starts_with("error: "), "{err}");
    assert!(err.contains("refs/v3 names commit"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A snapshot's file linking to a blob that is gone is named, the link and its target (where it
/// read "has neither model.safetensors ..."): the weights', then the config's too.
#[test]
fn a_snapshot_file_linking_to_a_blob_that_is_gone_is_named_with_its_target() {
    let dir = tempdir("hub-broken-blob");
    let (cache, hash) = fake_hub_cache(&dir);
    let repo = cache.join("models--org--tiny");
    let snap = repo.join("snapshots").join(&hash);
    std::fs::remove_file(repo.join("blobs").join(format!("blob{:040}", 1))).unwrap();
    let w = missing(&cache, "org/tiny", None, Need::Weights);
    assert!(
        w.contains(&format!(
            "{} is a link to {}, which does not exist",
            snap.join("model.safetensors").display(),
            snap.join(format!("../../blobs/blob{:040}", 1)).display()
        )),
        "{w}"
    );
    std::fs::remove_file(repo.join("blobs").join(format!("blob{:040}", 0))).unwrap();
    let w = missing(&cache, "org/tiny", None, Need::Config);
    assert!(
        w.contains(&format!(
            "{} is a link to ",
            snap.join("config.json").display()
        )),
        "{w}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Revisions recorded for PEFT

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

/// Two lines of text data in `dir/d.jsonl`.
fn two_lines(dir: &Path) -> PathBuf {
    let data = dir.join("d.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"hello there\"}\n{\"text\": \"general kenobi\"}\n",
    )
    .unwrap();
    data
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
    let data = two_lines(&dir);
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
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A plain directory has no revision (PEFT's null).
#[test]
fn an_adapter_trained_from_a_plain_directory_records_no_revision() {
    let dir = tempdir("hub-revision-dir");
    let data = two_lines(&dir);
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

//! Everything xtrain and its tests make on first use, made from an empty cache by several
//! threads in several processes at once, as a newcomer's first `cargo test` does: the CPU plugin
//! install, the TensorBoard venv, SmolLM2's download and import, the Llama 3 tokenizer, a
//! compiled executable and a model downloaded into the Hugging Face hub cache. For each, one
//! creator makes it and announces it once, every other one waits and uses that one, and nothing
//! is left in the cache but the things and their lock files.
//!
//! Each test runs itself again in [`PROCESSES`] processes against one fresh cache
//! (`XTRAIN_CACHE_DIR`, with [`CHILD`] set), each of which runs the maker in [`THREADS`] threads;
//! the test then checks what they all said and left. The plugins are linked into the fresh cache
//! (the CPU plugin's own install is raced with a stand-in wheel, offline); everything else starts
//! empty and is fetched again (from pip's and npm's own caches when those hold it).

mod assets;
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Set in the processes a test starts: run the threads, not the processes.
const CHILD: &str = "XTRAIN_FIRST_USE_CHILD";
const PROCESSES: usize = 3;
const THREADS: usize = 3;

/// An empty cache for test `name`, with `plugins/` linked to the user's cache's (the CPU plugin
/// installed there first if it is not).
fn empty_cache_with_plugins(name: &str) -> PathBuf {
    pjrt::discover::resolve_or_install(Some("cpu")).expect("the CPU plugin");
    let cache = tempdir(&format!("first-use-{name}"));
    let plugins = pjrt::discover::cache_dir().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::os::unix::fs::symlink(&plugins, cache.join("plugins")).unwrap();
    cache
}

/// In a test: run this test (`test`) again in [`PROCESSES`] processes against `cache` at once
/// and return their stderr, all of them checked to have passed. In one of those processes
/// (`CHILD` set): run `make` in [`THREADS`] threads at once, check they all got the same path,
/// and return None.
fn race(
    test: &str,
    cache: impl FnOnce() -> PathBuf,
    envs: &[(String, String)],
    make: fn() -> PathBuf,
) -> Option<(PathBuf, String)> {
    if std::env::var_os(CHILD).is_some() {
        let threads: Vec<_> = (0..THREADS).map(|_| std::thread::spawn(make)).collect();
        let made: Vec<PathBuf> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(made.iter().all(|p| p == &made[0]), "{made:?}");
        println!("made {}", made[0].display());
        return None;
    }
    let cache = cache();
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--nocapture", "--test-threads", "1"])
                .env(CHILD, "1")
                .env("XTRAIN_CACHE_DIR", &cache)
                .envs(envs.iter().cloned())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut said = String::new();
    for child in children {
        let o = child.wait_with_output().unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "a racing process failed:\n{out}\n{err}");
        assert!(out.contains("made "), "{out}");
        said.push_str(&err);
    }
    Some((cache, said))
}

/// `said` holds `line` exactly once: one creator made the thing.
fn made_once(said: &str, line: &str) {
    assert_eq!(said.matches(line).count(), 1, "`{line}` once in:\n{said}");
}

/// Nothing under `cache` but finished things and lock files: no temp or set-aside names.
fn nothing_left_over(cache: &Path) {
    let mut stack = vec![cache.to_path_buf()];
    let mut left = Vec::new();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.contains(".tmp-") || name.contains(".old-") || name.contains(".staged-") {
                left.push(e.path());
            }
            let t = e.file_type().unwrap();
            // Not into the venv (pip's own files) nor through the plugins' link.
            if t.is_dir() && name != "site-packages" {
                stack.push(e.path());
            }
        }
    }
    assert!(left.is_empty(), "left over: {left:?}");
}

#[test]
fn the_cpu_plugin_is_installed_once() {
    let wheels = std::env::temp_dir().join(format!("xtrain-test-wheels-{}", std::process::id()));
    let make = || pjrt::discover::install_announced("cpu").unwrap();
    let Some((cache, said)) = race(
        "the_cpu_plugin_is_installed_once",
        || {
            stand_in_wheel(&wheels);
            tempdir("first-use-plugin")
        },
        &[
            ("PIP_NO_INDEX".into(), "1".into()),
            ("PIP_FIND_LINKS".into(), wheels.display().to_string()),
        ],
        make,
    ) else {
        return;
    };
    made_once(&said, "xtrain: installing the cpu PJRT plugin");
    let so = cache.join("plugins/cpu/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so");
    assert_eq!(std::fs::read_to_string(&so).unwrap(), "a stand-in plugin");
    nothing_left_over(&cache);
}

/// A wheel `xla_cpu_pjrt-0.0.1` in `dir` whose plugin is a stand-in file, so that the install
/// races offline (pip is pointed at `dir` only).
fn stand_in_wheel(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let script = "import sys, zipfile\n\
        z = zipfile.ZipFile(sys.argv[1] + '/xla_cpu_pjrt-0.0.1-py3-none-any.whl', 'w')\n\
        z.writestr('xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so', 'a stand-in plugin')\n\
        d = 'xla_cpu_pjrt-0.0.1.dist-info/'\n\
        z.writestr(d + 'METADATA', 'Metadata-Version: 2.1\\nName: xla-cpu-pjrt\\nVersion: 0.0.1\\n')\n\
        z.writestr(d + 'WHEEL', 'Wheel-Version: 1.0\\nGenerator: xtrain-test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
        z.writestr(d + 'RECORD', '')\n\
        z.close()";
    let o = Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn the_tensorboard_venv_is_made_once() {
    let Some((cache, said)) = race(
        "the_tensorboard_venv_is_made_once",
        || empty_cache_with_plugins("tensorboard"),
        &[],
        tensorboard_python,
    ) else {
        return;
    };
    made_once(&said, "xtrain: making the TensorBoard venv");
    let python = cache.join("venvs/tensorboard-2.21.0/bin/python");
    let o = Command::new(&python)
        .args(["-c", "import tensorboard; print(tensorboard.__version__)"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "2.21.0");
    nothing_left_over(&cache);
}

#[test]
fn smollm2_is_fetched_and_imported_once() {
    let Some((cache, said)) = race(
        "smollm2_is_fetched_and_imported_once",
        || empty_cache_with_plugins("smollm2"),
        &[],
        || assets::smollm2().unwrap(),
    ) else {
        return;
    };
    made_once(&said, "xtrain: fetching SmolLM2-135M-Instruct");
    let model = cache.join("models/smollm2-135m-instruct");
    let cfg = xtrain::model::config::LlamaConfig::load(&model.join("config.json")).unwrap();
    assert_eq!((cfg.hidden_size, cfg.num_hidden_layers), (576, 30));
    let tok = xtrain::data::text::TextTokenizer::load(&model).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    nothing_left_over(&cache);
}

#[test]
fn the_llama3_tokenizer_is_fetched_once() {
    let Some((cache, said)) = race(
        "the_llama3_tokenizer_is_fetched_once",
        || empty_cache_with_plugins("llama3"),
        &[],
        || assets::llama3_tokenizer().unwrap(),
    ) else {
        return;
    };
    made_once(&said, "xtrain: fetching the Llama 3 tokenizer");
    let tok = xtrain::data::text::TextTokenizer::load(&cache.join("tokenizers/llama3")).unwrap();
    // The ids Hugging Face's tokenizers gives (tests/llama3_tokenizer.rs).
    assert_eq!(
        tok.encode("<|begin_of_text|>Hello world!").unwrap(),
        [128000, 9906, 1917, 0]
    );
    nothing_left_over(&cache);
}

/// Four runs of one step started together from an empty cache (processes, as xtrain compiles one
/// step per process): one compiles it, the other three wait and load its executable.
#[test]
fn a_step_is_compiled_once_by_runs_started_together() {
    let cache = empty_cache_with_plugins("executables");
    let dir = tempdir("first-use-exe");
    let model = tiny_text_model(&dir);
    let data = instruction_examples(&dir.join("d.jsonl"), 8);
    let runs: Vec<_> = (0..4)
        .map(|i| {
            train_cmd(&model, &data, &dir.join(format!("run{i}")))
                .args(["--steps", "1", "--batch-size", "2", "--seq", "32"])
                .args(["--log-every", "0", "--no-plot", "--verbose"])
                .env("XTRAIN_CACHE_DIR", &cache)
                .stderr(std::process::Stdio::piped())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut said = String::new();
    for run in runs {
        let o = run.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        said.push_str(&err);
    }
    made_once(&said, "xtrain: compiled the step");
    assert_eq!(
        said.matches("xtrain: loaded the compiled step from the cache")
            .count(),
        3,
        "{said}"
    );
    let exes: Vec<_> = std::fs::read_dir(cache.join("executables"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".pjrt"))
        .collect();
    assert_eq!(exes.len(), 1, "{exes:?}");
    nothing_left_over(&cache);
}

/// Three processes of three threads each resolving `org/tiny`, which is not in the (empty) hub
/// cache, from a stand-in hub: one downloads it, each file once, and every one gets the complete
/// snapshot (none sees a download half done).
#[test]
fn a_model_is_downloaded_into_the_hub_cache_once() {
    use xtrain::formats::hub::{lookup, resolve, Lookup, Need};
    let test = "a_model_is_downloaded_into_the_hub_cache_once";
    let make = || resolve("org/tiny", None, Need::Weights).unwrap();
    if std::env::var_os(CHILD).is_some() {
        race(test, || unreachable!(), &[], make);
        return;
    }
    // Not "first-use-hub": that is the name of the cache made below, whose making empties it.
    let dir = tempdir("first-use-hub-origin");
    let model = tiny_text_model(&dir);
    let files = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    let hub = StandInHub::serve(files.map(|f| (f, std::fs::read(model.join(f)).unwrap())));
    let hub_cache = dir.join("hub");
    let envs = [
        ("HF_HUB_CACHE".to_string(), hub_cache.display().to_string()),
        ("HF_ENDPOINT".to_string(), hub.endpoint.clone()),
        ("HF_HUB_OFFLINE".to_string(), "0".to_string()),
    ];
    let (_, said) = race(test, || empty_cache_with_plugins("hub"), &envs, make).unwrap();
    made_once(
        &said,
        "xtrain: org/tiny is not in the Hugging Face hub cache",
    );
    let fetched = hub.fetched.lock().unwrap().clone();
    assert_eq!(fetched, files.map(String::from).to_vec(), "each file once");
    let Lookup::Found(snap) = lookup(&hub_cache, "org/tiny", None, Need::Weights).unwrap() else {
        panic!("org/tiny is not complete in the hub cache");
    };
    for f in files {
        assert_eq!(
            std::fs::read(snap.join(f)).unwrap(),
            std::fs::read(model.join(f)).unwrap()
        );
    }
    nothing_left_over(&hub_cache);
}

/// A stand-in for the Hugging Face hub on a local port, serving one repo (`org/tiny` at commit
/// [`StandInHub::COMMIT`]) the way `hf-hub` asks for it: the repo's file list, each file's
/// metadata (a one-byte range with its commit and etag) and its bytes from an offset. It answers
/// slowly (100 ms) so that the racing downloaders overlap.
struct StandInHub {
    endpoint: String,
    /// The files whose bytes were asked for, in order.
    fetched: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl StandInHub {
    const COMMIT: &str = "89abcdef0123456789abcdef0123456789abcdef";

    fn serve<const N: usize>(files: [(&'static str, Vec<u8>); N]) -> StandInHub {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let fetched = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = fetched.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let log = log.clone();
                let files = files.clone();
                std::thread::spawn(move || StandInHub::answer(conn, &files, &log));
            }
        });
        StandInHub { endpoint, fetched }
    }

    /// Answer one request on `conn` and close it.
    fn answer(
        mut conn: std::net::TcpStream,
        files: &[(&'static str, Vec<u8>)],
        fetched: &std::sync::Mutex<Vec<String>>,
    ) {
        use sha2::Digest;
        use std::io::{BufRead, Write};
        let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
        let mut request = String::new();
        let mut range_from = None;
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line.trim() != "" {
            if request.is_empty() {
                request = line.trim().to_string();
            } else if let Some(r) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                range_from = Some(r.trim().to_string());
            }
            line.clear();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        let path = request.split(' ').nth(1).unwrap_or("").to_string();
        let (status, headers, body) = if path == "/api/models/org/tiny/revision/main" {
            let siblings: Vec<_> = files
                .iter()
                .map(|(f, _)| serde_json::json!({ "rfilename": f }))
                .collect();
            let info = serde_json::json!({ "siblings": siblings, "sha": Self::COMMIT });
            ("200 OK", String::new(), info.to_string().into_bytes())
        } else if let Some((name, bytes)) = files
            .iter()
            .find(|(f, _)| path == format!("/org/tiny/resolve/main/{f}"))
        {
            let from: usize = match range_from.as_deref() {
                Some("0-0") => 0,
                Some(r) => r.trim_end_matches('-').parse().unwrap(),
                None => 0,
            };
            let to = if range_from.as_deref() == Some("0-0") {
                0
            } else {
                fetched.lock().unwrap().push(name.to_string());
                bytes.len() - 1
            };
            // The hub's etag of a file in LFS: its SHA-256.
            let etag: String = sha2::Sha256::digest(bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let headers = format!(
                "x-repo-commit: {}\r\netag: \"{etag}\"\r\ncontent-range: bytes {from}-{to}/{}\r\n",
                Self::COMMIT,
                bytes.len()
            );
            ("206 Partial Content", headers, bytes[from..=to].to_vec())
        } else {
            ("404 Not Found", String::new(), Vec::new())
        };
        let head = format!(
            "HTTP/1.1 {status}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = conn.write_all(head.as_bytes());
        let _ = conn.write_all(&body);
    }
}

//! Shared test helpers: the fixtures, temp dirs, the tiny model with a byte-level tokenizer, and
//! xtrain's command lines (run as a user runs it).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama3")
}

/// A family's tiny model and its transformers + PEFT oracle (`qwen2`, `qwen3`, `mistral`:
/// tests/fixtures/tiny-FAMILY, made by tools/make-family-fixtures).
pub fn family_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/tiny-{family}"))
}

/// A fresh `$TMPDIR/xtrain-test-NAME-PID`. Left in place when the test ends (a failed test's files
/// can be read), and swept by the next test process to make one once their process is gone: a
/// run of the whole suite leaves GBs otherwise (copied plugins, venvs, models), which filled a
/// CI machine's disk.
pub fn tempdir(name: &str) -> PathBuf {
    sweep_dirs_of_ended_tests();
    let d = std::env::temp_dir().join(format!("xtrain-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Removes the `xtrain-test-*-PID` dirs of test processes that have ended (Linux: no
/// `/proc/PID`), once per test process.
fn sweep_dirs_of_ended_tests() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if !Path::new("/proc/self").exists() {
            return;
        }
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name
                .strip_prefix("xtrain-test-")
                .and_then(|rest| rest.rsplit('-').next())
                .and_then(|pid| pid.parse::<u32>().ok());
            if let Some(pid) = pid {
                if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    });
}

/// Fixture adapter `from` (`adapter_init`, `adapter_step3`: r=8, lora_alpha=16, all seven
/// projections) copied to `dir`, its config edited by `config` and its tensors by `tensors`.
pub fn edited_adapter(
    dir: &Path,
    from: &str,
    config: impl FnOnce(&mut serde_json::Value),
    tensors: impl FnOnce(&mut std::collections::BTreeMap<String, pjrt::HostTensor>),
) -> PathBuf {
    use xtrain::formats::safetensors::{self, SafeTensors};
    let src = fixtures().join(from);
    std::fs::create_dir_all(dir).unwrap();
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    config(&mut c);
    std::fs::write(dir.join("adapter_config.json"), c.to_string()).unwrap();
    let st = SafeTensors::open(&src.join("adapter_model.safetensors")).unwrap();
    let mut t: std::collections::BTreeMap<String, pjrt::HostTensor> = st
        .tensors
        .keys()
        .map(|k| (k.clone(), st.read(k).unwrap()))
        .collect();
    tensors(&mut t);
    safetensors::write(
        &dir.join("adapter_model.safetensors"),
        &t,
        &Default::default(),
    )
    .unwrap();
    dir.to_path_buf()
}

/// `xtrain`, to add arguments, environment variables and pipes to.
pub fn xtrain_cmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtrain"))
}

/// `xtrain train --model MODEL --data DATA --out OUT`, to add the run's other flags to.
pub fn train_cmd(model: &Path, data: &Path, out: &Path) -> Command {
    let mut c = xtrain_cmd();
    c.arg("train")
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out);
    c
}

/// The oracle's run of a fixture dir (`model/`, `inputs.safetensors`, `adapter_init/`) into
/// `out`: 3 AdamW steps (lr 1e-3, betas 0.9,0.999, eps 1e-8, no weight decay) of a rank-8,
/// alpha-16 adapter on all seven projections, saved at step 3; to add flags to.
pub fn oracle_train_cmd(fixture: &Path, out: &Path) -> Command {
    let mut c = train_cmd(
        &fixture.join("model"),
        &fixture.join("inputs.safetensors"),
        out,
    );
    c.arg("--init-adapter")
        .arg(fixture.join("adapter_init"))
        .args(["--steps", "3", "--lr", "1e-3", "--betas", "0.9,0.999"])
        .args(["--eps", "1e-8", "--weight-decay", "0"])
        .args(["--lora-r", "8", "--lora-alpha", "16"])
        .args([
            "--lora-targets",
            "q,k,v,o,gate,up,down",
            "--save-every",
            "3",
        ]);
    c
}

/// Runs `cmd`, sends it SIGINT once a line of its stderr starts with `after`, and gives its exit
/// status and everything it said on stderr.
pub fn interrupted(cmd: &mut Command, after: &str) -> (std::process::ExitStatus, String) {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut said = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        said += &line;
        said.push('\n');
        if line.starts_with(after) {
            break;
        }
    }
    assert!(said.contains(after), "no progress: {said}");
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    for line in lines {
        said += &line.unwrap();
        said.push('\n');
    }
    (child.wait().unwrap(), said)
}

/// The run dir's checkpoint of the highest step (`checkpoint-N` holding a trainer_state.json).
pub fn latest_checkpoint(out: &Path) -> Option<PathBuf> {
    std::fs::read_dir(out)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("checkpoint-")
                && p.join("trainer_state.json").is_file()
        })
        .max_by_key(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .trim_start_matches("checkpoint-")
                .parse::<u64>()
                .unwrap_or(0)
        })
}

/// Run xtrain with `args` and wait for it.
pub fn xtrain(args: &[&str]) -> Output {
    xtrain_cmd().args(args).output().unwrap()
}

/// Run xtrain expecting failure; returns stderr, checked to start with `error: ` and to hold no
/// panic.
pub fn fails(args: &[&str]) -> String {
    let o = xtrain(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "expected a failure: {args:?}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

/// Owned arguments as the `&str`s [`xtrain`] and [`fails`] take.
pub fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

/// GPT-2's reversible byte -> printable char map (so every byte is one token).
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut map = vec!['\0'; 256];
    for &b in &printable {
        map[b as usize] = char::from_u32(b).unwrap();
    }
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            map[b as usize] = char::from_u32(256 + n).unwrap();
            n += 1;
        }
    }
    printable.clear();
    map
}

/// The tiny test model (vocab 512) plus a byte-level BPE tokenizer (256 byte tokens and three
/// ChatML specials: <|im_start|> 256, <|im_end|> 257, <|endoftext|> 258) and ChatML template.
pub fn tiny_text_model(dir: &Path) -> PathBuf {
    let m = dir.join("tiny-text-model");
    std::fs::create_dir_all(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("model").join(f), m.join(f)).unwrap();
    }
    let mut vocab = serde_json::Map::new();
    for (i, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), serde_json::json!(i));
    }
    let specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(k, t)| {
            vocab.insert(t.to_string(), serde_json::json!(256 + k));
            serde_json::json!({"id": 256 + k, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(
        m.join("tokenizer.json"),
        serde_json::to_string(&tok).unwrap(),
    )
    .unwrap();
    let cfg = serde_json::json!({
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"
    });
    std::fs::write(
        m.join("tokenizer_config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    m
}

/// A Python with TensorBoard (`tensorboard==2.21.0`, the reader a real user's TensorBoard runs),
/// in a venv under xtrain's cache made on first use (about 20 s and 60 MB from PyPI), by one
/// caller at a time: others, in this process or another, wait for it and use it. Panics, saying
/// why, when it cannot be made: a test that needs it must not pass without it.
pub fn tensorboard_python() -> PathBuf {
    let venv = pjrt::discover::cache_dir()
        .join("venvs")
        .join("tensorboard-2.21.0");
    let python = |venv: &Path| venv.join("bin").join("python");
    pjrt::once::create_once(
        &venv,
        "the TensorBoard venv",
        |v| python(v).is_file(),
        |tmp| -> std::io::Result<()> {
            eprintln!("xtrain: making the TensorBoard venv (tensorboard 2.21.0 from PyPI, once)");
            run(
                Command::new("python3").args(["-m", "venv"]).arg(tmp),
                "python3 -m venv",
            );
            run(
                Command::new(python(tmp)).args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "tensorboard==2.21.0",
                ]),
                "pip install tensorboard==2.21.0",
            );
            Ok(())
        },
    )
    .unwrap_or_else(|e| panic!("cannot make the TensorBoard venv: {e}"));
    python(&venv)
}

/// Run `c` (`what`, for a test's venv), panicking with its output when it fails.
fn run(c: &mut Command, what: &str) {
    let o = c.output().unwrap_or_else(|e| {
        panic!("cannot run {what}: {e} (the test needs python3 with venv and pip)")
    });
    assert!(
        o.status.success(),
        "{what} failed (the test needs it):\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Stand-ins for the ROCm 7 runtime libraries the ROCm plugin links (a ROCm host has the real
/// ones in /opt/rocm/lib), built by tools/rocm-standins into a fresh temp dir named after `name`:
/// put it on LD_LIBRARY_PATH to compile for an absent AMD GPU.
pub fn rocm_standins_in(name: &str) -> PathBuf {
    let plugin = pjrt::discover::resolve(Some("rocm"))
        .or_else(|_| pjrt::discover::install_announced("rocm"))
        .expect("the ROCm plugin");
    let dir = tempdir(name);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/rocm-standins");
    let o = Command::new(script)
        .arg(&plugin)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "tools/rocm-standins: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

/// `n` instruction examples ("Say i" -> "i!") as JSONL at `path`, for runs of the tiny text
/// model; returns the path.
pub fn instruction_examples(path: &Path, n: usize) -> PathBuf {
    let s: String = (0..n)
        .map(|i| format!("{{\"instruction\": \"Say {i}\", \"output\": \"{i}!\"}}\n"))
        .collect();
    std::fs::write(path, s).unwrap();
    path.to_path_buf()
}

/// A Python with llama.cpp's Python bindings (`llama-cpp-python==0.3.36`, which builds
/// llama.cpp from source: about 10 minutes on 2 cores the first time) and llama.cpp's own GGUF
/// reader (`gguf==0.19.0`), in a venv under xtrain's cache made on first use and kept, by one
/// caller at a time: the tests of tests/llama_cpp.rs ask for it at once, and the others wait
/// for the one that builds it rather than build it again beside it. Panics, saying why, when it
/// cannot be made (no C++ compiler, no PyPI): a test that needs llama.cpp must not pass without it.
pub fn llama_cpp_python() -> PathBuf {
    let venv = pjrt::discover::cache_dir()
        .join("venvs")
        .join("llama-cpp-python-0.3.36");
    let python = |venv: &Path| venv.join("bin").join("python");
    pjrt::once::create_once(
        &venv,
        "the llama.cpp venv",
        |v| python(v).is_file(),
        |tmp| -> std::io::Result<()> {
            eprintln!(
                "xtrain tests: building llama-cpp-python 0.3.36 (llama.cpp from source, about \
                 10 minutes on 2 cores, once) into {}",
                venv.display()
            );
            run(
                Command::new("python3").args(["-m", "venv"]).arg(tmp),
                "python3 -m venv",
            );
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            run(
                Command::new(python(tmp))
                    .env("CMAKE_BUILD_PARALLEL_LEVEL", cores.to_string())
                    .args([
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--disable-pip-version-check",
                        "llama-cpp-python==0.3.36",
                        "gguf==0.19.0",
                    ]),
                "pip install llama-cpp-python==0.3.36 gguf==0.19.0 (building llama.cpp needs a C++ compiler)",
            );
            Ok(())
        },
    )
    .unwrap_or_else(|e| panic!("cannot make the llama.cpp venv: {e}"));
    python(&venv)
}

/// Every `.rs` file under `dir`, into `out` (the source readers of tests/architecture.rs and
/// tests/functions.rs).
pub fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

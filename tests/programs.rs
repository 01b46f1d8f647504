//! Program goldens: the sha256 of every program xtrain emits, over configurations that cover its
//! options, and the whole text of one tiny step, checked against the files in
//! `tests/golden/programs/`. A change meant to move code must leave every program byte-identical
//! (docs/architecture.md); this is the test that says so.
//!
//! - `compile.txt`: `train_step.mlir` and `manifest.json` as `xtrain compile` writes them, for
//!   each of [`COMPILES`] (no plugin is opened: a `--target` changes the mesh only).
//! - `library.txt`: the train step, grads, forward, eval and next-token programs as the library
//!   builds them, for each of [`library_specs`].
//! - `tiny_step.mlir`: the text of [`TINY_STEP`]'s program, so that a change shows as a diff.
//!
//! After an intended change (a new op, a new form of attention), rewrite the files with
//! `UPDATE_GOLDEN=1 cargo test --test programs` and commit them with the change; the diff of
//! `compile.txt` and `library.txt` says which programs moved. `tools/program-hashes` prints the
//! same lines (`PROGRAM_HASHES_OUT=FILE` writes them to FILE).

mod common;
use common::*;
use hlo::DType;
use std::path::{Path, PathBuf};
use xtrain::formats::program_dir::sha256_hex as sha;
use xtrain::model::lora::{LoraConfig, Projection};
use xtrain::model::preference::PairLoss;
use xtrain::model::presets::resolve_model_config;
use xtrain::program::sharding::{parse_mesh, Rules};
use xtrain::program::{self, MeshPlan, Preference, Quant, Reference, Remat, ResultType, StepSpec};

/// The tiny model's flags every tiny configuration starts from.
const TINY: &[&str] = &[
    "--model",
    "tiny-llama3",
    "--batch",
    "4",
    "--seq",
    "64",
    "--lora-r",
    "4",
];

/// `xtrain compile` configurations: a name, whether it is the tiny model (with [`TINY`]'s
/// flags), and the flags that make it what it is. Together they cover every flag of the
/// program's form, every mesh axis, NF4, the remat policies and the 8B model's shapes.
const COMPILES: &[(&str, bool, &[&str])] = &[
    ("tiny-f32", true, &[]),
    ("tiny-bf16", true, &["--dtype", "bf16"]),
    (
        "tiny-bf16-cuda",
        true,
        &["--dtype", "bf16", "--target", "cuda:h100:1"],
    ),
    (
        "tiny-bf16-compute",
        true,
        &[
            "--dtype",
            "bf16",
            "--matmul-result",
            "compute",
            "--attention-scores",
            "f32",
        ],
    ),
    (
        "tiny-bf16-rocm-tpu",
        true,
        &[
            "--dtype",
            "bf16",
            "--mesh",
            "fsdp=4",
            "--target",
            "rocm:mi300x:4",
            "--keep-softmax-stats",
            "true",
            "--pin-mlp-activations",
            "true",
        ],
    ),
    ("tiny-nf4", true, &["--quant", "nf4"]),
    ("tiny-mesh", true, &["--mesh", "data=2,fsdp=2"]),
    (
        "tiny-mesh-tensor",
        true,
        &[
            "--mesh",
            "fsdp=2,tensor=2",
            "--dtype",
            "bf16",
            "--quant",
            "nf4",
        ],
    ),
    ("tiny-remat-none", true, &["--remat", "none"]),
    (
        "tiny-save-proj",
        true,
        &[
            "--remat",
            "save-proj",
            "--grad-accum",
            "2",
            "--lora-dropout",
            "0.1",
            "--loss-chunk",
            "16",
            "--attention-block",
            "32",
            "--betas",
            "0.8,0.99",
            "--weight-decay",
            "0.01",
            "--max-grad-norm",
            "1",
        ],
    ),
    (
        "tiny-targets",
        true,
        &["--lora-targets", "q,v", "--lora-alpha", "16"],
    ),
    ("tiny-key-blocks", true, &["--key-block", "5"]),
    (
        "tiny-mlp-chunk",
        true,
        &[
            "--mlp-chunk",
            "24",
            "--remat",
            "save-proj",
            "--lora-dropout",
            "0.1",
            "--dtype",
            "bf16",
        ],
    ),
    (
        "tiny-key-blocks-save-proj",
        true,
        &[
            "--key-block",
            "16",
            "--remat",
            "save-proj",
            "--dtype",
            "bf16",
        ],
    ),
    ("tiny-context", true, &["--mesh", "context=2,fsdp=2"]),
    (
        "tiny-context-tensor",
        true,
        &[
            "--mesh",
            "context=2,tensor=2",
            "--remat",
            "save-proj",
            "--key-block",
            "8",
        ],
    ),
    // Preference training (--method dpo): the base model or the starting adapter as the
    // reference, or its log-probabilities precomputed; each loss; the step's forms.
    ("tiny-dpo", true, &["--method", "dpo"]),
    (
        "tiny-dpo-start-ipo-save-proj",
        true,
        &[
            "--method",
            "dpo",
            "--reference",
            "start",
            "--dpo-loss",
            "ipo",
            "--grad-accum",
            "2",
            "--remat",
            "save-proj",
            "--loss-chunk",
            "16",
            "--dtype",
            "bf16",
        ],
    ),
    (
        "tiny-dpo-precomputed-fsdp-nf4",
        true,
        &[
            "--method",
            "dpo",
            "--precompute-reference",
            "--label-smoothing",
            "0.1",
            "--mesh",
            "fsdp=2",
            "--quant",
            "nf4",
            "--lora-dropout",
            "0.1",
        ],
    ),
    (
        "tiny-dpo-hinge-start-context",
        true,
        &[
            "--method",
            "dpo",
            "--dpo-loss",
            "hinge",
            "--reference",
            "start",
            "--mesh",
            "context=2,fsdp=2",
        ],
    ),
    (
        "8b-bf16",
        false,
        &[
            "--model",
            "llama-3.1-8b",
            "--dtype",
            "bf16",
            "--lora-r",
            "16",
        ],
    ),
    (
        "8b-nf4-fsdp8",
        false,
        &[
            "--model",
            "llama-3.1-8b",
            "--dtype",
            "bf16",
            "--lora-r",
            "16",
            "--quant",
            "nf4",
            "--mesh",
            "fsdp=8",
        ],
    ),
    (
        "8b-f32-none",
        false,
        &["--model", "llama-3.1-8b", "--seq", "256", "--remat", "none"],
    ),
    // The other families: Qwen3's per-head q/k norms (QLoRA, the 24 GB recipe's form), Qwen2.5's
    // q/k/v biases and tied embeddings over tensor and FSDP axes, Mistral Nemo's head_dim over
    // key blocks.
    (
        "qwen3-8b-nf4",
        false,
        &[
            "--model", "qwen3-8b", "--dtype", "bf16", "--quant", "nf4", "--lora-r", "16", "--seq",
            "512", "--batch", "2",
        ],
    ),
    (
        "qwen2.5-0.5b-tensor",
        false,
        &[
            "--model",
            "qwen2.5-0.5b",
            "--mesh",
            "fsdp=2,tensor=2",
            "--seq",
            "256",
            "--batch",
            "2",
        ],
    ),
    (
        "mistral-nemo-key-blocks",
        false,
        &[
            "--model",
            "mistral-nemo-12b",
            "--dtype",
            "bf16",
            "--seq",
            "1024",
            "--key-block",
            "256",
            "--remat",
            "save-proj",
        ],
    ),
];

/// The one step whose whole text is pinned: the tiny model, looped layers, small shapes.
const TINY_STEP: &[&str] = &[
    "--model",
    "tiny-llama3",
    "--batch",
    "1",
    "--seq",
    "8",
    "--lora-r",
    "2",
];

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/programs")
        .join(name)
}

/// Compare `text` with the golden file `name`, or write it there with `UPDATE_GOLDEN=1`.
/// Hash lists are compared line by line, so that the failure names the programs that moved.
fn check_golden(name: &str, text: &str) {
    let path = golden(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run `UPDATE_GOLDEN=1 cargo test --test programs` to create it)",
            path.display()
        )
    });
    if text == want {
        return;
    }
    let moved: Vec<String> = if name.ends_with(".txt") {
        let old: Vec<&str> = want.lines().collect();
        text.lines()
            .filter(|l| !old.contains(l))
            .map(|l| format!("  {l}"))
            .collect()
    } else {
        vec!["  (the text differs; diff it against the file)".into()]
    };
    panic!(
        "{name}: the programs differ from {} in:\n{}\nA change meant to move code must leave every \
         program byte-identical; after an intended change, rewrite the file with \
         `UPDATE_GOLDEN=1 cargo test --test programs` and commit it",
        path.display(),
        moved.join("\n")
    );
}

/// Where `tools/program-hashes` asks for the lines to be written too.
fn also_write(lines: &str) {
    if let Some(out) = std::env::var_os("PROGRAM_HASHES_OUT") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .unwrap();
        f.write_all(lines.as_bytes()).unwrap();
    }
}

/// `xtrain compile --out DIR` with `flags`, checked to succeed.
fn compile(dir: &Path, flags: &[&str]) {
    let o = xtrain_cmd()
        .arg("compile")
        .args(flags)
        .arg("--out")
        .arg(dir)
        .env_remove("XTRAIN_PLUGIN")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "xtrain compile {flags:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn compile_writes_the_programs_it_wrote_before() {
    let tmp = tempdir("programs-compile");
    // Each configuration in a process of its own, as many at once as there are cores.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut lines = vec![String::new(); COMPILES.len()];
    for (chunk, out) in COMPILES.chunks(threads).zip(lines.chunks_mut(threads)) {
        std::thread::scope(|s| {
            for ((name, tiny, flags), line) in chunk.iter().zip(out.iter_mut()) {
                let dir = tmp.join(name);
                s.spawn(move || {
                    let mut all: Vec<&str> = if *tiny { TINY.to_vec() } else { Vec::new() };
                    all.extend_from_slice(flags);
                    compile(&dir, &all);
                    *line = ["train_step.mlir", "manifest.json"]
                        .iter()
                        .map(|f| {
                            let bytes = std::fs::read(dir.join(f)).unwrap();
                            format!("compile/{name}/{f} {}\n", sha(&bytes))
                        })
                        .collect();
                });
            }
        });
    }
    let text = lines.concat();
    also_write(&text);
    check_golden("compile.txt", &text);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The library's configurations: each kind of program over the options that change it.
fn library_specs() -> Vec<(&'static str, StepSpec)> {
    let (tiny, _) = resolve_model_config("tiny-llama3").unwrap();
    let lora = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: Projection::ALL.to_vec(),
    };
    let base = |dtype| StepSpec::new(tiny.clone(), lora.clone(), 4, 64, dtype);
    let mesh = |m: &str| MeshPlan {
        axes: parse_mesh(m).unwrap().axes,
        rules: Rules::default(),
    };
    let mut specs: Vec<(&str, StepSpec)> = vec![
        ("f32", base(DType::F32)),
        ("bf16", base(DType::BF16)),
        (
            "bf16-wide",
            StepSpec {
                matmul_result: ResultType::F32,
                ..base(DType::BF16)
            },
        ),
        (
            "nf4",
            StepSpec {
                quant: Quant::Nf4,
                ..base(DType::F32)
            },
        ),
        (
            "remat-none",
            StepSpec {
                remat: Remat::None,
                ..base(DType::F32)
            },
        ),
        (
            "save-proj-accum-chunk-block",
            StepSpec {
                remat: Remat::SaveProj,
                grad_accum: 2,
                loss_chunk: Some(16),
                attention_block: Some(32),
                ..base(DType::BF16)
            },
        ),
        (
            "mesh-data2-fsdp2",
            StepSpec {
                mesh: Some(mesh("data=2,fsdp=2")),
                ..base(DType::F32)
            },
        ),
        (
            "mesh-tensor2-nf4-none",
            StepSpec {
                mesh: Some(mesh("tensor=2")),
                quant: Quant::Nf4,
                remat: Remat::None,
                ..base(DType::BF16)
            },
        ),
    ];
    specs.push((
        "mlp-tiles-none",
        StepSpec {
            mlp_chunk: Some(24),
            remat: Remat::None,
            ..base(DType::F32)
        },
    ));
    let mut dropout = base(DType::F32);
    dropout.lora.dropout = 0.1;
    specs.push(("dropout", dropout.clone()));
    dropout.remat = Remat::None;
    specs.push(("dropout-none", dropout));
    specs
}

#[test]
fn the_library_builds_the_programs_it_built_before() {
    let mut text = String::new();
    for (name, spec) in &library_specs() {
        let mut line = |kind: &str, program: anyhow::Result<program::Program>| {
            let p = program.unwrap_or_else(|e| panic!("{name}/{kind}: {e:#}"));
            text += &format!("{name}/{kind} {}\n", sha(p.text.as_bytes()));
        };
        line("train_step", program::build_train_step(spec));
        line("grads", program::build_grad_program(spec));
        line("eval", program::build_eval(spec));
        for with_lora in [false, true] {
            let l = if with_lora { "lora" } else { "base" };
            line(
                &format!("forward-{l}"),
                program::build_forward(spec, with_lora),
            );
            line(
                &format!("next_token-{l}"),
                program::build_next_token(spec, with_lora),
            );
        }
    }
    // Preference training's programs: the step, its grads and the log-probabilities.
    for (name, spec) in &dpo_specs() {
        let mut line = |kind: &str, program: anyhow::Result<program::Program>| {
            let p = program.unwrap_or_else(|e| panic!("{name}/{kind}: {e:#}"));
            text += &format!("{name}/{kind} {}\n", sha(p.text.as_bytes()));
        };
        line("train_step", program::build_train_step(spec));
        line("grads", program::build_grad_program(spec));
        line("logps-base", program::build_sequence_logps(spec, false));
        line("logps-lora", program::build_sequence_logps(spec, true));
    }
    also_write(&text);
    check_golden("library.txt", &text);
}

/// The library's DPO configurations: each reference, each loss, and the step's forms.
fn dpo_specs() -> Vec<(&'static str, StepSpec)> {
    let base = library_specs()
        .into_iter()
        .find(|(n, _)| *n == "f32")
        .unwrap()
        .1;
    let dpo = |reference, dpo_loss, precompute_reference| {
        Some(Preference {
            reference,
            dpo_loss,
            precompute_reference,
            ..Preference::default()
        })
    };
    vec![
        (
            "dpo-base-sigmoid",
            StepSpec {
                dpo: dpo(Reference::Base, PairLoss::Sigmoid, false),
                ..base.clone()
            },
        ),
        (
            "dpo-start-ipo-none",
            StepSpec {
                dpo: dpo(Reference::Start, PairLoss::Ipo, false),
                remat: Remat::None,
                ..base.clone()
            },
        ),
        (
            "dpo-precomputed-hinge-accum-chunk",
            StepSpec {
                dpo: dpo(Reference::Start, PairLoss::Hinge, true),
                grad_accum: 2,
                loss_chunk: Some(16),
                ..base.clone()
            },
        ),
    ]
}

#[test]
fn a_tiny_step_is_the_text_it_was() {
    let dir = tempdir("programs-tiny-step");
    compile(&dir, TINY_STEP);
    let text = std::fs::read_to_string(dir.join("train_step.mlir")).unwrap();
    check_golden("tiny_step.mlir", &text);
    let _ = std::fs::remove_dir_all(&dir);
}

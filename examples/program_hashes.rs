//! Print the sha256 of the StableHLO text of every kind of program xtrain builds (train step,
//! grads, forward, eval, next token) over a set of configurations, one `name sha256` line each.
//! `tools/program-hashes` runs it next to `xtrain compile`: a change meant to move code, not to
//! change it, must leave every line as it was.

use hlo::DType;
use sha2::{Digest, Sha256};
use xtrain::model::lora::{LoraConfig, Target};
use xtrain::model::presets::resolve_model_config;
use xtrain::program::sharding::{parse_mesh, Rules};
use xtrain::program::{self, MeshPlan, Remat, StepSpec};

fn sha(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn main() -> anyhow::Result<()> {
    let (tiny, _) = resolve_model_config("tiny-llama3")?;
    let lora = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: Target::ALL.to_vec(),
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
                wide_matmul_results: true,
                ..base(DType::BF16)
            },
        ),
        (
            "nf4",
            StepSpec {
                nf4: true,
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
                microbatches: 2,
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
                nf4: true,
                remat: Remat::None,
                ..base(DType::BF16)
            },
        ),
    ];
    let mut dropout = base(DType::F32);
    dropout.lora.dropout = 0.1;
    specs.push(("dropout", dropout.clone()));
    dropout.remat = Remat::None;
    specs.push(("dropout-none", dropout));
    for (name, spec) in &specs {
        println!(
            "{name}/train_step {}",
            sha(&program::build_train_step(spec)?.text)
        );
        println!(
            "{name}/grads {}",
            sha(&program::build_grad_program(spec)?.text)
        );
        println!("{name}/eval {}", sha(&program::build_eval(spec)?.text));
        for with_lora in [false, true] {
            let l = if with_lora { "lora" } else { "base" };
            println!(
                "{name}/forward-{l} {}",
                sha(&program::build_forward(spec, with_lora)?.text)
            );
            println!(
                "{name}/next_token-{l} {}",
                sha(&program::build_next_token(spec, with_lora)?.text)
            );
        }
    }
    Ok(())
}

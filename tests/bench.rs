//! `xtrain bench`'s random weights: the fast path (program layout, program types, all cores) makes
//! exactly the values of the per-layer path that `--export` writes for the peers, so the loss the
//! peers are checked against belongs to the model that is timed.

use pjrt::ElementType;
use xtrain::bench::{random_program_weights, random_weights};
use xtrain::lora::{LoraConfig, Target};
use xtrain::optim::AdamW;
use xtrain::runtime::{convert, to_program_layout};
use xtrain::step::{build_train_step, Remat, Role, StepSpec};

fn spec(dtype: hlo::DType) -> StepSpec {
    let (model, _) = xtrain::program::resolve_model_config("tiny-llama3").unwrap();
    StepSpec {
        remat: Remat::Layer,
        microbatches: 1,
        mesh: None,
        nf4: false,
        loss_chunk: None,
        attention_block: None,
        wide_matmul_results: false,
        model,
        lora: LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: vec![Target::Q, Target::V],
        },
        adam: AdamW::default(),
        batch: 2,
        seq: 8,
        weight_dtype: dtype,
        compute_dtype: dtype,
    }
}

#[test]
fn program_layout_weights_equal_the_exported_ones() {
    for dtype in [hlo::DType::F32, hlo::DType::BF16] {
        let spec = spec(dtype);
        let program = build_train_step(&spec).unwrap();
        let fast = random_program_weights(&program, 7).unwrap();
        let frozen: Vec<_> = program
            .args
            .iter()
            .filter(|a| a.role == Role::Frozen)
            .collect();
        let names = program.frozen_shapes();
        let per_layer = random_weights(&spec, 7);
        let slow = to_program_layout(&names, &per_layer, spec.model.num_hidden_layers).unwrap();
        assert_eq!(fast.len(), slow.len());
        for ((a, f), s) in frozen.iter().zip(&fast).zip(&slow) {
            let want = xtrain::runtime::element_type(a.dtype);
            let s = convert(s, want).unwrap();
            assert_eq!(f.ty, want, "{}", a.name);
            assert_eq!(f.dims, s.dims, "{}", a.name);
            assert!(f.bytes == s.bytes, "{} ({dtype:?}): values differ", a.name);
        }
        // and they are random where they should be: a projection has many distinct values (bf16
        // has 8 significant bits, so a few hundred at most in this range)
        let q = frozen
            .iter()
            .position(|a| a.name.contains("q_proj"))
            .unwrap();
        let values = convert(&fast[q], ElementType::F32)
            .unwrap()
            .to_f32()
            .unwrap();
        let distinct: std::collections::BTreeSet<u32> =
            values.iter().map(|v| v.to_bits()).collect();
        assert!(
            distinct.len() > 200,
            "{dtype:?}: {} distinct",
            distinct.len()
        );
        // within the uniform bound, plus bf16 rounding (half a unit in the last place: up to 2^-8 relative here)
        let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max <= 0.0346 * (1.0 + 1.0 / 256.0), "{dtype:?}: max {max}");
    }
}

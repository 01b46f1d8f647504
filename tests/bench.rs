//! `xtrain bench`'s random weights: the fast path (program layout, program types, all cores) makes
//! exactly the values of the per-layer path that `--export` writes for the peers, so the loss the
//! peers are checked against belongs to the model that is timed.

use pjrt::ElementType;
use xtrain::formats::host::{convert, to_program_layout};
use xtrain::model::lora::{LoraConfig, Projection};
use xtrain::program::{build_train_step, Remat, Role, StepSpec};
use xtrain::train::bench::{random_program_weights, random_weights};

fn spec(dtype: hlo::DType) -> StepSpec {
    let (model, _) = xtrain::model::presets::resolve_model_config("tiny-llama3").unwrap();
    let lora = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: vec![Projection::Q, Projection::V],
    };
    StepSpec::new(model, lora, 2, 8, dtype)
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
            let want = xtrain::formats::host::element_type(a.dtype);
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

/// FLOPs of every dot_general in a program's text: 2 x (result elements) x (contracted size).
fn dot_flops(text: &str) -> f64 {
    let dims = |t: &str| -> Vec<i64> {
        let inner = t.trim_start_matches("tensor<");
        let parts: Vec<&str> = inner.split('x').collect();
        parts[..parts.len() - 1]
            .iter()
            .map(|d| d.parse().unwrap())
            .collect()
    };
    let mut total = 0.0;
    for line in text.lines().filter(|l| l.contains("stablehlo.dot_general")) {
        let contract = line.split("contracting_dims = [").nth(1).unwrap();
        let lhs_dims: Vec<usize> = contract
            .split(']')
            .next()
            .unwrap()
            .split(", ")
            .map(|d| d.parse().unwrap())
            .collect();
        let types = line.split(" : (").nth(1).unwrap();
        let lhs = dims(types.split(", ").next().unwrap());
        let result = dims(
            types
                .split("-> ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap(),
        );
        let k: i64 = lhs_dims.iter().map(|&d| lhs[d]).product();
        total += 2.0 * result.iter().product::<i64>() as f64 * k as f64;
    }
    total
}

/// The benchmarks' FLOP count (`model_flops_per_step`, the one MFU and FLOP/s use) against the
/// matmuls the step actually contains: the standard workload built unrolled (nothing recomputed)
/// with attention as one block (the full T x T, as the formula counts it) has within 1% of the
/// formula's FLOPs in its dot_generals (0.6% fewer: the formula also counts work at layer 0 that
/// no LoRA weight needs and autodiff leaves out, the activation gradient through its q, k, v
/// projections and its keys' gradient). And the published
/// figures: 180.1 GFLOP per step for the standard workload, 33.5 GFLOP per token for Llama 3.1 8B
/// at 2048 tokens with LoRA r=16 on every projection.
#[test]
fn model_flops_match_the_programs_matmuls() {
    let (bench512, _) = xtrain::model::presets::resolve_model_config("bench-512").unwrap();
    let mut s = spec(hlo::DType::F32);
    s.model = bench512;
    s.lora.r = 16;
    s.batch = 4;
    s.seq = 256;
    let formula = xtrain::train::bench::model_flops_per_step(&s);
    assert!((formula / 1e9 - 180.1).abs() < 0.05, "{formula}");
    s.remat = Remat::None;
    s.attention_block = Some(256);
    let counted = dot_flops(&build_train_step(&s).unwrap().text);
    let rel = (counted - formula) / formula;
    assert!(
        (-0.01..=0.0).contains(&rel),
        "program matmuls {counted:.4e} vs formula {formula:.4e}: {rel:+.4}"
    );

    let (l8b, _) = xtrain::model::presets::resolve_model_config("llama-3.1-8b").unwrap();
    let mut s8 = spec(hlo::DType::BF16);
    s8.model = l8b;
    s8.lora.r = 16;
    s8.lora.targets = Projection::ALL.to_vec();
    s8.batch = 1;
    s8.seq = 2048;
    let per_token = xtrain::train::bench::model_flops_per_step(&s8) / 2048.0;
    assert!((per_token / 1e9 - 33.49).abs() < 0.01, "{per_token}");
}

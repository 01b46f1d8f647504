//! Settings recorded, compared and taken back by flag.

use super::run::*;
use super::settle::*;
use crate::data::{Columns, DataOptions};
use crate::model::lora::LoraConfig;
use crate::model::lora::Projection;
use crate::program::StepOptions;
use crate::program::{sharding, KeyBlocks, MeshPlan, MlpChunks, Offload, Quant, Remat, ResultType};
use crate::train::checkpoint::TrainerState;
use crate::train::options::TrainOptions;
use serde_json::json;

/// Options whose every recorded value differs from the fixture's, so that taking a value
/// shows.
fn options() -> TrainOptions {
    TrainOptions {
        model: "m".into(),
        data: DataOptions {
            path: "d.jsonl".into(),
            batch_size: 8,
            seq: 64,
            pack: false,
            train_on_prompt: true,
            skip_bad_lines: true,
            strict_length: true,
            eval_fraction: 0.5,
            eval_data: None,
            columns: Columns::new(Some("t".into()), Some("m".into())),
            pairs: false,
        },
        step: StepOptions {
            lora: LoraConfig {
                r: 2,
                alpha: 3.0,
                dropout: 0.25,
                targets: vec![Projection::Q],
            },
            adam: crate::model::optim::AdamW {
                beta1: 0.5,
                beta2: 0.75,
                eps: 0.125,
                weight_decay: 0.5,
                max_grad_norm: 2.0,
            },
            dtype: hlo::DType::BF16,
            remat: Some(Remat::SaveProj),
            grad_accum: 2,
            mesh: Some(MeshPlan {
                axes: vec![("fsdp".into(), 2)],
                rules: sharding::Rules::default(),
            }),
            quant: Quant::Nf4,
            loss_chunk: Some(8),
            attention_block: None,
            key_block: KeyBlocks::Off,
            mlp_chunk: MlpChunks::Size(3),
            matmul_result: ResultType::Compute,
            attention_scores: ResultType::F32,
            keep_softmax_stats: true,
            pin_mlp_activations: true,
            offload: Some(Offload::NONE),
            method: Default::default(),
            preference: Default::default(),
        },
        init_adapter: None,
        steps: 9,
        epochs: 3,
        lr: 0.5,
        warmup: 4,
        schedule: "cosine".into(),
        min_lr_ratio: 0.5,
        program: None,
        use_cache: true,
        eval_every: 7,
        save_every: 7,
        resume: None,
        out: "o".into(),
        overwrite: false,
        seed: 7,
        plugin: Some("cuda".into()),
        verbose: false,
        log_every: 7,
        plot: false,
        peak_tflops: Some(1.0),
        stop_after: None,
        skip_nonfinite: true,
        explicit: Default::default(),
        recipe: None,
        sharding_rules: None,
        taken_from: Default::default(),
        kernels: Vec::new(),
        launch: Default::default(),
    }
}

/// The settings of a checkpoint as xtrain wrote them on 2026-12-03: each is a flag of
/// [`RunSettings`] with a value of its type, and taken one by one (as a resumed run takes
/// them) the options then record every one of them as it was, and nothing else but the flags
/// added since.
#[test]
fn a_checkpoint_written_before_the_typed_settings_is_taken_whole() {
    let state: TrainerState = serde_json::from_str(include_str!(
        "../../../tests/fixtures/formats-2026-12-03/trainer_state.json"
    ))
    .unwrap();
    let recorded = &state.settings;
    let mut o = options();
    for (flag, v) in recorded {
        if !PATH_FLAGS.contains(&flag.as_str()) {
            apply(&mut o, flag, v).unwrap_or_else(|e| panic!("--{flag} {v}: {e:#}"));
        }
    }
    let now = of_run(&o);
    // The flags added since that checkpoint was written, which it does not record (a resumed
    // run takes them as given, or their defaults).
    let added = [
        "mlp-chunk",
        "method",
        "beta",
        "dpo-loss",
        "label-smoothing",
        "reference",
        "precompute-reference",
    ];
    assert_eq!(
        now.keys()
            .filter(|k| !added.contains(&k.as_str()))
            .collect::<Vec<_>>(),
        recorded.keys().collect::<Vec<_>>()
    );
    for (flag, v) in recorded {
        if !PATH_FLAGS.contains(&flag.as_str()) {
            assert!(
                &now[flag] == v || numerically_equal(&now[flag], v),
                "--{flag}: recorded {v}, now {}",
                now[flag]
            );
        }
    }
}

/// The flag lists that decide how a recorded setting is taken name recorded settings: a typo
/// there would silently make a may-differ flag a must-agree one (or a path one compared).
#[test]
fn every_listed_flag_is_a_recorded_setting() {
    let recorded = of_run(&options());
    for flag in PATH_FLAGS.iter().chain(LAYOUT_AND_REPORTING) {
        assert!(
            recorded.contains_key(*flag),
            "--{flag} is listed but no recorded setting has that name"
        );
    }
}

/// A setting of another type, or one no flag has, is refused naming it.
#[test]
fn a_recorded_value_of_another_type_or_flag_is_refused() {
    let mut o = options();
    let e = format!("{:#}", apply(&mut o, "lora-r", &json!("four")).unwrap_err());
    assert!(e.contains("--lora-r \"four\" is not a valid value"), "{e}");
    let e = format!("{:#}", apply(&mut o, "lora-rank", &json!(4)).unwrap_err());
    assert!(e.contains("unknown recorded setting `lora-rank`"), "{e}");
    // The options are as they were.
    assert_eq!(of_run(&o), of_run(&options()));
}

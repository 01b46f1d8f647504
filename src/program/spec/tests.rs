//! The step's options as `StepOptions::spec` completes and checks them, on the tiny model:
//! every refusal names its flag, and the program-form flags mean the same on every target.

use super::*;
use crate::model::config::LlamaConfig;
use crate::model::lora::{LoraConfig, Projection};
use crate::model::optim::AdamW;
use hlo::DType;

fn tiny() -> LlamaConfig {
    crate::model::presets::preset_config("tiny-llama3")
        .unwrap()
        .expect("the tiny-llama3 preset")
}

/// The command line's defaults, as `xtrain train` and `compile` start from them.
fn options(dtype: DType) -> StepOptions {
    StepOptions {
        lora: LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
        },
        adam: AdamW::default(),
        dtype,
        remat: None,
        grad_accum: 1,
        mesh: None,
        quant: Quant::None,
        loss_chunk: None,
        attention_block: None,
        key_block: KeyBlocks::Auto,
        mlp_chunk: MlpChunks::Auto,
        matmul_result: DEFAULT_MATMUL_RESULT,
        attention_scores: DEFAULT_ATTENTION_SCORES,
        keep_softmax_stats: false,
        pin_mlp_activations: false,
        offload: None,
        method: Default::default(),
        preference: Default::default(),
    }
}

fn refused(o: &StepOptions, batch: i64, seq: i64) -> String {
    format!("{:#}", o.spec(tiny(), batch, seq).unwrap_err())
}

/// One rule for `--key-block auto`: an `--attention-block` (as a TPU recipe gives) does not
/// turn auto's key blocks off above 8192 tokens (it did, silently, at 16k-32k); the two
/// together are refused as a typed error, which says how to keep either form.
#[test]
fn an_attention_block_does_not_turn_auto_key_blocks_off() {
    let mut cfg = tiny();
    cfg.max_position_embeddings = 32768;
    let o = StepOptions {
        attention_block: Some(512),
        ..options(DType::BF16)
    };
    let e = o.spec(cfg.clone(), 1, 16384).unwrap_err();
    let unused = e.downcast_ref::<AttentionBlockUnused>().expect("typed");
    assert_eq!(unused.block, 512);
    let e = format!("{e:#}");
    assert!(
        e.contains("--attention-block 512 sets the query blocks")
            && e.contains("auto above 8192 tokens")
            && e.contains("give --attention-block auto")
            && e.contains("--key-block off"),
        "{e}"
    );
    // Up to 8192 tokens auto keeps every key at once, in the blocks asked for.
    assert_eq!(o.spec(cfg.clone(), 1, 8192).unwrap().key_block, None);
    let off = StepOptions {
        key_block: KeyBlocks::Off,
        ..o
    };
    assert_eq!(off.spec(cfg, 1, 16384).unwrap().attention_block, Some(512));
}

/// `--key-block auto`: every key at once up to 8192 tokens, blocks of 512 above, always
/// blocks on a context axis; a size or `off` as given.
#[test]
fn key_blocks_resolve_by_the_sequence_and_the_context() {
    let auto = KeyBlocks::Auto;
    assert_eq!(auto.resolve(8192, 1), None);
    assert_eq!(auto.resolve(8193, 1), Some(DEFAULT_KEY_BLOCK));
    assert_eq!(auto.resolve(16, 2), Some(DEFAULT_KEY_BLOCK));
    assert_eq!(KeyBlocks::Size(64).resolve(16, 1), Some(64));
    assert_eq!(KeyBlocks::Off.resolve(131072, 1), None);
    for bad in ["0", "-3", "1.5", "nan", ""] {
        assert!(KeyBlocks::parse(bad).is_err(), "{bad}");
    }
    assert_eq!(KeyBlocks::parse("off").unwrap(), KeyBlocks::Off);
    assert_eq!(KeyBlocks::parse("2048").unwrap().name(), "2048");
}

#[test]
fn the_defaults_give_layer_remat_and_no_offload_where_memory_is_unknown() {
    let s = options(DType::F32).spec(tiny(), 4, 64).unwrap();
    assert_eq!((s.remat, s.offload), (Remat::Layer, Offload::NONE));
    assert_eq!(default_choice(None, None), (Remat::Layer, Offload::NONE));
}

#[test]
fn auto_tries_save_proj_then_layer_with_growing_offload() {
    let activations = Offload::parse("activations").unwrap();
    let all = Offload::parse("all").unwrap();
    assert_eq!(
        fit_choices(None, None),
        [
            (Remat::SaveProj, Offload::NONE),
            (Remat::Layer, Offload::NONE),
            (Remat::Layer, activations),
            (Remat::Layer, all),
        ]
    );
    assert_eq!(
        fit_choices(Some(Remat::Layer), Some(all)),
        [(Remat::Layer, all)]
    );
    assert_eq!(
        fit_choices(Some(Remat::None), None),
        [(Remat::None, Offload::NONE)]
    );
}

#[test]
fn remat_and_offload_names_parse_back_to_themselves() {
    for r in [Remat::None, Remat::Layer, Remat::SaveProj] {
        assert_eq!(Remat::parse(r.name()).unwrap(), r);
    }
    for o in Offload::AUTO_ORDER {
        assert_eq!(Offload::parse(o.name()).unwrap(), o);
    }
    assert_eq!(Remat::parse_choice("auto").unwrap(), None);
    let e = format!("{:#}", Remat::parse("layers").unwrap_err());
    assert!(e.contains("--remat") && e.contains("`layers`"), "{e}");
    let e = format!("{:#}", Offload::parse("cpu").unwrap_err());
    assert!(e.contains("--offload") && e.contains("`cpu`"), "{e}");
}

/// With f32 compute every result is f32, so the form flags change nothing and the spec
/// says so; with bf16 the defaults are f32 matmul results and bf16 scores.
#[test]
fn the_result_types_follow_the_flags_only_with_bf16_compute() {
    let f32_spec = StepOptions {
        matmul_result: ResultType::F32,
        attention_scores: ResultType::Compute,
        ..options(DType::F32)
    }
    .spec(tiny(), 4, 64)
    .unwrap();
    let f32_ = ResultType::F32;
    assert_eq!(
        (f32_spec.matmul_result, f32_spec.attention_scores),
        (f32_, f32_)
    );
    let bf16 = options(DType::BF16).spec(tiny(), 4, 64).unwrap();
    assert_eq!(
        (bf16.matmul_result, bf16.attention_scores),
        (f32_, ResultType::Compute)
    );
    let plain = StepSpec::new(tiny(), options(DType::BF16).lora, 4, 64, DType::BF16);
    let generated = plain.with_default_form();
    assert_eq!(
        (generated.matmul_result, generated.attention_scores),
        (bf16.matmul_result, bf16.attention_scores)
    );
    let e = format!(
        "{:#}",
        ResultType::parse("matmul-result", "bf16").unwrap_err()
    );
    assert!(e.contains("--matmul-result") && e.contains("`bf16`"), "{e}");
}

#[test]
fn sequences_shorter_than_two_or_past_the_models_positions_are_refused() {
    assert!(refused(&options(DType::F32), 4, 1).contains("--seq must be at least 2"));
    let e = refused(&options(DType::F32), 1, 131072 * 2);
    assert!(e.contains("--seq 262144") && e.contains("131072"), "{e}");
}

#[test]
fn divisors_of_the_batch_and_the_sequence_are_checked() {
    let o = |f: &dyn Fn(&mut StepOptions)| {
        let mut o = options(DType::F32);
        f(&mut o);
        o
    };
    let e = refused(&o(&|o| o.loss_chunk = Some(24)), 4, 64);
    assert!(e.contains("--loss-chunk 24") && e.contains("64"), "{e}");
    let e = refused(
        &o(&|o| {
            o.loss_chunk = Some(16);
            o.remat = Some(Remat::None)
        }),
        4,
        64,
    );
    assert!(
        e.contains("--loss-chunk 16") && e.contains("--remat none"),
        "{e}"
    );
    let e = refused(&o(&|o| o.grad_accum = 3), 4, 64);
    assert!(
        e.contains("--grad-accum 3") && e.contains("batch size 4"),
        "{e}"
    );
    let e = refused(&o(&|o| o.grad_accum = 0), 4, 64);
    assert!(e.contains("--grad-accum must be at least 1"), "{e}");
    let e = refused(&o(&|o| o.attention_block = Some(48)), 4, 64);
    assert!(
        e.contains("--attention-block 48") && e.contains("64"),
        "{e}"
    );
    assert!(o(&|o| o.attention_block = Some(16))
        .spec(tiny(), 4, 64)
        .is_ok());
}

/// The tiny model's K and V projections are [32, 64]: rank 32 at most.
#[test]
fn a_rank_above_a_projections_smaller_dimension_is_refused() {
    let o = |r| StepOptions {
        lora: LoraConfig {
            r,
            ..options(DType::F32).lora
        },
        ..options(DType::F32)
    };
    let e = refused(&o(33), 4, 64);
    assert!(
        e.contains("--lora-r 33") && e.contains("(32)") && e.contains("k_proj"),
        "{e}"
    );
    assert!(o(32).spec(tiny(), 4, 64).is_ok());
}

#[test]
fn softmax_statistics_need_remat_and_pins_need_a_mesh() {
    let stats = StepOptions {
        keep_softmax_stats: true,
        remat: Some(Remat::None),
        ..options(DType::F32)
    };
    assert!(refused(&stats, 4, 64).contains("--keep-softmax-stats"));
    let stats = StepOptions {
        remat: Some(Remat::Layer),
        ..stats
    };
    assert!(stats.spec(tiny(), 4, 64).unwrap().keep_softmax_stats);
    let pin = StepOptions {
        pin_mlp_activations: true,
        ..options(DType::F32)
    };
    assert!(refused(&pin, 4, 64).contains("--pin-mlp-activations"));
}

/// A model whose MLP projections have 100 x 36 values (not a multiple of the 64-value NF4
/// block) is refused naming the tensor's size, before any builder meets it.
#[test]
fn nf4_refuses_a_projection_that_is_not_whole_blocks() {
    let mut cfg = tiny();
    (cfg.hidden_size, cfg.intermediate_size) = (36, 100);
    let o = StepOptions {
        quant: Quant::Nf4,
        ..options(DType::BF16)
    };
    let e = format!("{:#}", o.spec(cfg, 4, 64).unwrap_err());
    assert!(e.contains("--quant nf4") && e.contains("3600"), "{e}");
}

/// The trips the TPU estimate prices per layer, nb (NK + 1) per loop nest for nb blocks per
/// query chunk and NK key blocks: on one device two chunks of the sequence (8k over blocks of
/// 512: 8 x 17 = 136, the causal block pairs), on a context axis of 8 sixteen chunks (32k: 4
/// blocks per chunk, 4 x 65 = 260; 128k: 16 x 257 = 4112); none without key blocks.
#[test]
fn attention_loop_trips_count_the_loops_trips() {
    let at = |seq: i64, mesh: Option<&str>, key_block: Option<i64>| {
        StepSpec {
            key_block,
            mesh: mesh.map(|m| MeshPlan {
                axes: crate::program::sharding::parse_mesh(m).unwrap().axes,
                rules: crate::program::sharding::Rules::default(),
            }),
            ..StepSpec::new(tiny(), options(DType::F32).lora, 1, seq, DType::F32)
        }
        .attention_loop_trips()
    };
    assert_eq!(at(8192, None, Some(512)), Some(136));
    assert_eq!(at(32768, Some("context=8"), Some(512)), Some(260));
    assert_eq!(at(131072, Some("context=8"), Some(512)), Some(4112));
    assert_eq!(at(8192, None, None), None);
}

/// `--mlp-chunk auto`: the whole MLP up to 16384 tokens, tiles of 4096 above, the whole MLP on
/// a context axis; a size or `off` as given.
#[test]
fn mlp_chunks_resolve_by_the_sequence_and_the_context() {
    let auto = MlpChunks::Auto;
    assert_eq!(auto.resolve(16384, 1), None);
    assert_eq!(auto.resolve(16385, 1), Some(DEFAULT_MLP_CHUNK));
    assert_eq!(auto.resolve(131072, 2), None);
    assert_eq!(MlpChunks::Size(5).resolve(16, 2), Some(5));
    assert_eq!(MlpChunks::Off.resolve(131072, 1), None);
    for bad in ["0", "-3", "1.5", "nan", "", "on"] {
        let e = MlpChunks::parse(bad).unwrap_err().to_string();
        assert!(e.contains("--mlp-chunk") && e.contains(bad), "{e}");
    }
    assert_eq!(MlpChunks::parse("off").unwrap(), MlpChunks::Off);
    assert_eq!(MlpChunks::parse("2048").unwrap().name(), "2048");
    // Today's default programs at the goldens' shapes keep the whole MLP.
    let s = options(DType::F32).spec(tiny(), 4, 64).unwrap();
    assert_eq!(s.mlp_chunk, None);
}

/// `--mlp-chunk N` is refused longer than the sequence and on a context axis, naming the flag;
/// a tile that does not divide the sequence is taken (the last tile is padded).
#[test]
fn mlp_chunks_are_checked_against_the_sequence_and_the_mesh() {
    let with = |n: i64, mesh: Option<&str>| StepOptions {
        mlp_chunk: MlpChunks::Size(n),
        mesh: mesh.map(|m| MeshPlan {
            axes: crate::program::sharding::parse_mesh(m).unwrap().axes,
            rules: crate::program::sharding::Rules::default(),
        }),
        key_block: KeyBlocks::Size(8),
        ..options(DType::F32)
    };
    assert_eq!(
        with(24, None).spec(tiny(), 4, 64).unwrap().mlp_chunk,
        Some(24)
    );
    assert_eq!(
        with(64, None).spec(tiny(), 4, 64).unwrap().mlp_chunk,
        Some(64)
    );
    let e = refused(&with(65, None), 4, 64);
    assert!(e.contains("--mlp-chunk 65") && e.contains("64"), "{e}");
    let e = refused(&with(16, Some("context=2")), 4, 64);
    assert!(e.contains("--mlp-chunk 16") && e.contains("context"), "{e}");
}

/// A length a context axis cannot cut in 2 x CP chunks is said as such, whether or not the
/// length happens to be a multiple of CP (100 is not, 105 is): it was "splits nothing" for
/// the first, as a new user found at seq 4100 over context=3.
#[test]
fn a_length_the_context_axis_cannot_cut_is_named_before_the_axes_splits() {
    for seq in [100, 105] {
        let mut o = options(DType::F32);
        o.mesh = Some(MeshPlan {
            axes: vec![("context".into(), 3)],
            rules: crate::program::sharding::Rules::default(),
        });
        let e = refused(&o, 4, seq);
        assert!(
            e.contains(&format!("--seq {seq} must be a multiple of 6")),
            "{e}"
        );
    }
}

/// Key blocks that do not cut the sequence in two halves of whole blocks pad it, and the form
/// says so on one device as it does over a context axis.
#[test]
fn the_form_says_when_key_blocks_pad_the_sequence() {
    let form = |seq: i64| {
        let mut o = options(DType::F32);
        o.key_block = KeyBlocks::Size(512);
        o.spec(tiny(), 1, seq).unwrap().form()
    };
    let padded = form(4100);
    assert!(
        padded.contains("--key-block 512 (blocks of 512; the sequence is padded to 5120"),
        "{padded}"
    );
    let whole = form(4096);
    assert!(whole.contains("--key-block 512 (blocks of 512)"), "{whole}");
}

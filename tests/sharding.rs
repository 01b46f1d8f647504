//! The training step on 8 CPU devices under several meshes against 1 device.

mod common;
use common::*;
use xtrain::data::Batch;
use xtrain::device::runtime::Runtime;
use xtrain::device::trainer::Trainer;
use xtrain::model::config::LlamaConfig;
use xtrain::model::lora::{LoraConfig, Projection};
use xtrain::program::sharding::{parse_mesh, Rules};
use xtrain::program::{self, MeshPlan, Remat, StepSpec};

fn spec(mesh: Option<&str>, remat: Remat) -> StepSpec {
    let model = LlamaConfig::load(&fixtures().join("model")).unwrap();
    let lora = LoraConfig {
        r: 8,
        alpha: 16.0,
        dropout: 0.0,
        targets: Projection::ALL.to_vec(),
    };
    StepSpec {
        remat,
        mesh: mesh.map(|m| MeshPlan {
            axes: parse_mesh(m).unwrap().axes,
            rules: Rules::default(),
        }),
        ..StepSpec::new(model, lora, 2, 16, hlo::DType::F32)
    }
}

/// Two steps' results: (losses, grad norms, final LoRA weights by name, argument bytes per
/// device).
type Steps = (
    Vec<f32>,
    Vec<f32>,
    std::collections::BTreeMap<String, Vec<f32>>,
    i64,
);

/// `got` equals `one_device` to 1e-5 (a few f32 roundings of sums taken in another order):
/// both losses and grad norms, and every LoRA weight after the two steps.
fn assert_matches_one_device(what: &str, got: &Steps, one_device: &Steps) {
    assert_within(what, got, one_device, 1e-5);
}

fn assert_within(what: &str, got: &Steps, one_device: &Steps, tol: f32) {
    let ((l, g, w, _), (l1, g1, w1, _)) = (got, one_device);
    for (a, b) in l.iter().zip(l1).chain(g.iter().zip(g1)) {
        assert!(
            (a - b).abs() <= tol,
            "{what}: loss/grad norm {l:?} {g:?} vs {l1:?} {g1:?}"
        );
    }
    for (name, v) in w {
        let d = v
            .iter()
            .zip(&w1[name])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d <= tol, "{what}: {name} differs by {d} (tolerance {tol})");
    }
}

/// Two steps on the oracle batch.
fn run(mesh: Option<&str>, remat: Remat) -> Steps {
    run_spec(spec(mesh, remat))
}

fn run_spec(s: StepSpec) -> Steps {
    let batch = Batch::from_safetensors(&fixtures().join("inputs.safetensors")).unwrap();
    run_on(s, &batch)
}

/// The oracle batch with packed rows: row 0 holds documents at 0 and 6, row 1 three padding
/// tokens and then documents at 3 and 10; the first token of each packed document is not
/// predicted by the one before.
fn packed_batch() -> Batch {
    let b = Batch::from_safetensors(&fixtures().join("inputs.safetensors")).unwrap();
    let mask: Vec<i32> = (0..16)
        .map(|t| if t < 6 { 1 } else { 7 })
        .chain((0..16).map(|t| match t {
            0..3 => 0,
            3..10 => 4,
            _ => 11,
        }))
        .collect();
    let mut labels = b.input_ids.to_i32().unwrap();
    for (i, l) in labels.iter_mut().enumerate() {
        if mask[i] == 0 || [0, 6, 16 + 3, 16 + 10].contains(&i) {
            *l = -100;
        }
    }
    Batch {
        labels: pjrt::HostTensor::from_i32(&labels, &[2, 16]),
        attention_mask: pjrt::HostTensor::from_i32(&mask, &[2, 16]),
        ..b
    }
}

fn run_on(s: StepSpec, batch: &Batch) -> Steps {
    let (mut t, exe_args) = trainer(s, &Default::default());
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let (l, g) = t.step(batch, 1e-3).unwrap();
        losses.push(l);
        norms.push(g);
    }
    (losses, norms, weights(&t), exe_args)
}

/// A trainer of `s` on 8 CPU devices from the fixture's adapter and `moments` (none: zero), and
/// its executable's per-device argument bytes.
fn trainer(
    s: StepSpec,
    moments: &std::collections::BTreeMap<String, pjrt::HostTensor>,
) -> (Trainer, i64) {
    let program = program::build_train_step(&s).unwrap();
    let frozen = program.frozen_shapes();
    let weights = xtrain::formats::weights::load(
        &fixtures().join("model"),
        &s.model,
        &frozen,
        pjrt::ElementType::F32,
        |_, _| {},
    )
    .unwrap();
    let lora =
        xtrain::formats::peft::read_tensors(&fixtures().join("adapter_init"), &s.model, &s.lora)
            .unwrap();
    let rt = Runtime::open(Some("cpu"), Some(8)).unwrap();
    let exe_args = {
        let e = rt
            .compile(&program, &pjrt::CompileOptions::default())
            .unwrap();
        e.memory_stats().unwrap().argument_bytes
    };
    let mut t = Trainer::new(rt, s, program, weights, &lora, moments, false, false).unwrap();
    t.dropout_seed = DROPOUT_SEED;
    (t, exe_args)
}

/// The seed of the dropout tests' masks.
const DROPOUT_SEED: u64 = 1234;

/// A trainer's LoRA weights by name.
fn weights(t: &Trainer) -> std::collections::BTreeMap<String, Vec<f32>> {
    let (w, _) = t.state_to_host().unwrap();
    w.into_iter()
        .map(|(k, v)| (k, v.to_f32().unwrap()))
        .collect()
}

#[test]
fn meshes_match_one_device() {
    let one = run(None, Remat::Layer);
    assert!((one.0[0] - 6.63896).abs() < 1e-5);
    let args1 = one.3;
    // The last case is the form TPU steps take: the MLP's activations pinned on the mesh.
    for (mesh, pin) in [
        ("fsdp=8", false),
        ("data=2,fsdp=2,tensor=2", false),
        ("tensor=2", false),
        ("data=2,fsdp=2,tensor=2", true),
    ] {
        let got = run_spec(StepSpec {
            pin_mlp_activations: pin,
            ..spec(Some(mesh), Remat::Layer)
        });
        let mesh = if pin {
            format!("{mesh} (MLP pinned)")
        } else {
            mesh.to_string()
        };
        assert_matches_one_device(&mesh, &got, &one);
        let args = got.3;
        eprintln!("{mesh}: per-device argument bytes {args} (1 device: {args1})");
        if mesh == "fsdp=8" {
            // Every weight of the tiny model divides by 8 along its embed dim: 1/8 the bytes
            // (the batch inputs and the two scalars are replicated and tiny).
            assert!(
                args * 8 <= args1 + 8 * 1024,
                "fsdp=8 per-device arguments {args} vs {args1} on 1 device"
            );
        }
    }
}

/// Attention over key/value blocks on a mesh without a context axis (its composites partitioned
/// by XLA, batch over fsdp and heads over tensor) computes what one device computes with every
/// key at once, to 1e-5.
#[test]
fn key_blocks_on_a_batch_and_head_mesh_compute_what_one_device_does() {
    let batch = packed_batch();
    let one = run_on(spec(None, Remat::Layer), &batch);
    let s = StepSpec {
        key_block: Some(4),
        ..spec(Some("fsdp=2,tensor=2"), Remat::SaveProj)
    };
    assert_matches_one_device("fsdp=2,tensor=2 --key-block 4", &run_on(s, &batch), &one);
}

/// The sequence split over a context axis (rows in the two-chunk balanced layout, keys and
/// values gathered, attention over key/value blocks) computes what one device computes with
/// every key at once: two steps on packed rows with padding, to 1e-5 (a few f32 roundings of
/// sums taken in another order). Key blocks of 2 make several blocks per chunk.
#[test]
fn a_sequence_split_over_the_context_axis_computes_what_one_device_does() {
    let batch = packed_batch();
    let one = run_on(spec(None, Remat::Layer), &batch);
    for (mesh, remat, key_block) in [
        ("context=4", Remat::Layer, None),
        ("fsdp=2,context=2", Remat::Layer, Some(2)),
        ("context=2,tensor=2", Remat::SaveProj, None),
        ("context=2", Remat::None, Some(4)),
    ] {
        let s = StepSpec {
            key_block: key_block.or(Some(xtrain::program::DEFAULT_KEY_BLOCK)),
            ..spec(Some(mesh), remat)
        };
        assert!(s.context_size() > 1, "{mesh}");
        let what = format!("{mesh} --remat {} --key-block {key_block:?}", remat.name());
        assert_matches_one_device(&what, &run_on(s, &batch), &one);
    }
}

#[test]
fn the_program_declares_the_mesh_and_shardings() {
    let p = program::build_train_step(&spec(Some("data=2,fsdp=2,tensor=2"), Remat::Layer)).unwrap();
    assert!(p
        .text
        .contains("sdy.mesh @mesh = <[\"data\"=2, \"fsdp\"=2, \"tensor\"=2]>"));
    assert!(p.text.contains("mhlo.num_partitions = 8 : i32"));
    // q_proj stacked [L, q_heads, embed]: layers replicated, heads on tensor then fsdp.
    assert!(p.text.contains("%model.layers._.self_attn.q_proj.weight: tensor<2x64x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {\"tensor\", \"fsdp\"}, {}]>}"));
    // LoRA A [L, r, embed]: the rank replicated, embed on fsdp; its moments sharded the same way.
    assert!(p.text.contains("%base_model.model.model.layers._.self_attn.q_proj.lora_A.weight: tensor<2x8x64xf32> {tf.aliasing_output = 0 : i32, sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {\"fsdp\"}]>}"));
    assert!(p.text.contains("%exp_avg.base_model.model.model.layers._.self_attn.q_proj.lora_A.weight: tensor<2x8x64xf32> {tf.aliasing_output = 14 : i32, sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {\"fsdp\"}]>}"));
    assert!(p.text.contains("sdy.sharding_constraint"));
    assert_eq!(p.partitions, 8);
}

#[test]
fn xtrain_train_runs_on_a_mesh_from_the_command_line() {
    let out = tempdir("mesh-cli");
    let f = fixtures();
    let o = train_cmd(&f.join("model"), &f.join("inputs.safetensors"), &out)
        .arg("--init-adapter")
        .arg(f.join("adapter_init"))
        .args([
            "--lora-r",
            "8",
            "--lora-alpha",
            "16",
            "--lr",
            "1e-3",
            "--steps",
            "2",
            "--mesh",
            "data=2,fsdp=2",
            "--log-every",
            "0",
            "--no-plot",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(m.lines().next().unwrap()).unwrap();
    let loss = first["loss"].as_f64().unwrap();
    assert!(
        (loss - 6.63896).abs() <= 1e-4,
        "4-device loss {loss} vs the reference 6.63896"
    );
    std::fs::remove_dir_all(&out).unwrap();
}

/// With `pin_mlp_activations` (`--pin-mlp-activations true`), the MLP's hidden activations
/// [B, T, F] (the gate and up projections' outputs) are pinned where the rules put activations:
/// batch on data (then fsdp, which batch 2 does not divide again), F on tensor then fsdp.
/// Without the flag nothing is pinned; on one device the flag is refused (there is no mesh to
/// pin to). (On `tpu:v5p:2x2x1`, left to itself the partitioner split F at 1 row per chip and
/// paid all-to-alls to get back.)
#[test]
fn the_mlp_hidden_activations_are_pinned_where_the_rules_put_them() {
    let pinning = |mesh: Option<&str>, pin: bool| StepSpec {
        pin_mlp_activations: pin,
        ..spec(mesh, Remat::Layer)
    };
    let hidden = "tensor<2x16x128xf32>";
    let pinned = |p: &program::Program, sharding: &str| {
        p.text
            .lines()
            .filter(|l| l.contains("sdy.sharding_constraint") && l.contains(sharding))
            .filter(|l| l.contains(&format!(": {hidden}")))
            .count()
    };
    let p = program::build_train_step(&pinning(Some("data=2,fsdp=2,tensor=2"), true)).unwrap();
    // Gate and up in the forward loop, again in the backward loop's recomputation, and their
    // gradients there (a constraint's gradient rule pins the cotangent the same way).
    assert_eq!(
        pinned(&p, "[{\"data\"}, {}, {\"tensor\", \"fsdp\"}]"),
        6,
        "{}",
        p.text
    );
    let p = program::build_train_step(&pinning(Some("fsdp=2"), true)).unwrap();
    assert_eq!(pinned(&p, "[{\"fsdp\"}, {}, {}]"), 6);
    let p = program::build_train_step(&pinning(Some("fsdp=2"), false)).unwrap();
    assert_eq!(pinned(&p, "[{\"fsdp\"}, {}, {}]"), 0);
    let Err(e) = program::build_train_step(&pinning(None, true)) else {
        panic!("a pin without a mesh was accepted");
    };
    assert!(e.to_string().contains("runs on one device"), "{e}");
}

/// `s` with LoRA dropout 0.3, and on a context axis the key blocks its tests use.
fn with_dropout(s: StepSpec) -> StepSpec {
    let mut s = s;
    s.lora.dropout = 0.3;
    if s.context_size() > 1 && s.key_block.is_none() {
        s.key_block = Some(xtrain::program::DEFAULT_KEY_BLOCK);
    }
    s
}

/// LoRA dropout drops the same elements whatever the mesh (`model::dropout`: the masks are a
/// hash of seed, step, layer, projection, batch row, natural position and feature): every mesh
/// of the tests above, microbatches and the unrolled step give one device's two steps with
/// dropout 0.3 on the packed batch, to 2e-5: the kept values are scaled by 1 / 0.7 and Adam
/// divides by the root of small second moments, so the sums' other order moves a weight by up to
/// 1.1e-5 (context=2, key blocks of 4), while one element dropped elsewhere moves weights by about
/// the learning rate, 1e-3. On a context axis the masks followed the balanced row order (step-1
/// loss 6.4328 on context=2 against 6.4244 on one device).
#[test]
fn lora_dropout_drops_the_same_elements_on_every_mesh() {
    let batch = packed_batch();
    let one = run_on(with_dropout(spec(None, Remat::Layer)), &batch);
    let without = run_on(spec(None, Remat::Layer), &batch);
    assert!(
        (one.0[0] - without.0[0]).abs() > 1e-3,
        "dropout 0.3 changed nothing: {:?} vs {:?}",
        one.0,
        without.0
    );
    let cases: [(Option<&str>, Remat, i64, Option<i64>); 11] = [
        (None, Remat::None, 1, None),
        (None, Remat::SaveProj, 2, None),
        (Some("fsdp=8"), Remat::Layer, 1, None),
        (Some("data=2,fsdp=2,tensor=2"), Remat::Layer, 1, None),
        (Some("tensor=2"), Remat::Layer, 1, None),
        (Some("data=2"), Remat::Layer, 1, None),
        (Some("context=4"), Remat::Layer, 1, None),
        (Some("fsdp=2,context=2"), Remat::Layer, 1, Some(2)),
        (Some("context=2,tensor=2"), Remat::SaveProj, 1, None),
        (Some("context=2"), Remat::None, 1, Some(4)),
        (Some("context=2"), Remat::Layer, 2, None),
    ];
    for (mesh, remat, microbatches, key_block) in cases {
        let s = with_dropout(StepSpec {
            grad_accum: microbatches,
            key_block,
            ..spec(mesh, remat)
        });
        let what = format!(
            "--lora-dropout 0.3 --mesh {mesh:?} --remat {} --grad-accum {microbatches} --key-block {key_block:?}",
            remat.name()
        );
        assert_within(&what, &run_on(s, &batch), &one, DROPOUT_TOL);
    }
}

/// See [`lora_dropout_drops_the_same_elements_on_every_mesh`].
const DROPOUT_TOL: f32 = 2e-5;

/// The MLP in tiles of positions (`--mlp-chunk`) drops the elements the whole MLP drops (each
/// tile draws its tokens' masks at their own positions) and computes what one device computes
/// with the whole MLP, to [`DROPOUT_TOL`]: on one device with a tile that does not divide the
/// 16 positions, and on meshes of batch and heads, the MLP's activations pinned or not.
#[test]
fn the_mlp_in_tiles_drops_what_the_whole_mlp_drops_on_every_mesh() {
    let batch = packed_batch();
    let whole = run_on(with_dropout(spec(None, Remat::Layer)), &batch);
    for (mesh, pin, remat, tile) in [
        (None, false, Remat::Layer, 5),
        (None, false, Remat::SaveProj, 4),
        (Some("fsdp=2,tensor=2"), true, Remat::SaveProj, 6),
        (Some("data=2,fsdp=2,tensor=2"), false, Remat::Layer, 8),
    ] {
        let s = with_dropout(StepSpec {
            mlp_chunk: Some(tile),
            pin_mlp_activations: pin,
            ..spec(mesh, remat)
        });
        let what = format!(
            "--lora-dropout 0.3 --mesh {mesh:?} --pin-mlp-activations {pin} --remat {} \
             --mlp-chunk {tile}",
            remat.name()
        );
        assert_within(&what, &run_on(s, &batch), &whole, DROPOUT_TOL);
    }
}

/// A run with dropout resumed onto another mesh (`--resume ... --mesh context=2`, a layout
/// change) continues exactly: one step on one device, its weights and moments given to a
/// trainer on context=2 at step 1, and its second step gives the uninterrupted run's weights.
#[test]
fn a_run_with_dropout_resumed_onto_a_context_mesh_continues_exactly() {
    let batch = packed_batch();
    let one = run_on(with_dropout(spec(None, Remat::Layer)), &batch);
    let (mut first, _) = trainer(with_dropout(spec(None, Remat::Layer)), &Default::default());
    first.step(&batch, 1e-3).unwrap();
    let (lora, moments) = first.state_to_host().unwrap();
    let s = with_dropout(spec(Some("context=2"), Remat::Layer));
    let (mut resumed, _) = trainer(s, &Default::default());
    resumed.set_state(&lora, &moments).unwrap();
    resumed.step = 1;
    let (loss, norm) = resumed.step(&batch, 1e-3).unwrap();
    let got = (
        vec![one.0[0], loss],
        vec![one.1[0], norm],
        weights(&resumed),
        0,
    );
    assert_within("resumed onto context=2", &got, &one, DROPOUT_TOL);
}

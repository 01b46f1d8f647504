//! The Llama 3.1 + LoRA + AdamW step against Hugging Face transformers + PEFT
//! (tests/fixtures/tiny-llama3, see its manifest.json). f32 throughout.

mod common;
use common::fixtures;
use pjrt::{CompileOptions, ElementType, HostTensor};
use std::collections::BTreeMap;
use std::sync::OnceLock;
use xtrain::device::runtime::Runtime;
use xtrain::formats::host::convert;
use xtrain::formats::safetensors::SafeTensors;
use xtrain::model::config::LlamaConfig;
use xtrain::model::lora::{LoraConfig, Projection};
use xtrain::model::optim::AdamW;
use xtrain::program::{self, Program, Remat, Role, StepSpec};

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| Runtime::open(Some("cpu"), Some(1)).expect("CPU runtime"))
}

fn read(file: &str) -> SafeTensors {
    SafeTensors::open(&fixtures().join(file)).unwrap()
}

fn f32s(t: &HostTensor) -> Vec<f32> {
    t.to_f32_lossy().unwrap()
}

fn oracle_lora() -> LoraConfig {
    LoraConfig {
        r: 8,
        alpha: 16.0,
        dropout: 0.0,
        targets: Projection::ALL.to_vec(),
    }
}

fn spec(model_dir: &str) -> StepSpec {
    spec_with(model_dir, Remat::None)
}

fn spec_with(model_dir: &str, remat: Remat) -> StepSpec {
    let model = LlamaConfig::load(&fixtures().join(model_dir)).unwrap();
    StepSpec {
        remat,
        // The oracle's AdamW, written out: its conventions, not whatever our defaults become.
        adam: AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 0.0,
        },
        ..StepSpec::new(model, oracle_lora(), 2, 16, hlo::DType::F32)
    }
}

/// Host inputs for a program, by role: weights from `model_dir`, LoRA from `lora` (per-layer
/// PEFT names, stacked here when the program loops over layers), the batch, and `extra` by name.
fn inputs(
    program: &Program,
    model_dir: &str,
    lora: &BTreeMap<String, HostTensor>,
    extra: &BTreeMap<String, HostTensor>,
) -> Vec<HostTensor> {
    let s = spec(model_dir);
    let names = |role: Role| -> Vec<(String, Vec<i64>)> {
        program
            .args
            .iter()
            .filter(|a| a.role == role)
            .map(|a| (a.name.clone(), a.shape.clone()))
            .collect()
    };
    let weights = xtrain::formats::weights::load(
        &fixtures().join(model_dir),
        &s.model,
        &names(Role::Frozen),
        ElementType::F32,
        |_, _| {},
    )
    .unwrap();
    let mut all = lora.clone();
    all.extend(extra.clone());
    let state_names: Vec<(String, Vec<i64>)> = program
        .args
        .iter()
        .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
        .map(|a| (a.name.clone(), a.shape.clone()))
        .collect();
    let state =
        xtrain::formats::host::to_program_layout(&state_names, &all, s.model.num_hidden_layers)
            .unwrap();
    let batch = read("inputs.safetensors");
    let (mut w, mut st) = (weights.into_iter(), state.into_iter());
    program
        .args
        .iter()
        .map(|a| match a.role {
            Role::Frozen => w.next().unwrap(),
            Role::Lora | Role::AdamM | Role::AdamV => st.next().unwrap(),
            Role::InputIds | Role::Labels | Role::AttentionMask => {
                convert(&batch.read(&a.name).unwrap(), ElementType::S32).unwrap()
            }
            _ => extra[&a.name].clone(),
        })
        .collect()
}

/// Results by name, stacked (`layers.*`) results split back into per-layer names.
fn per_layer(program: &Program, out: Vec<HostTensor>) -> BTreeMap<String, HostTensor> {
    xtrain::formats::host::from_program_layout(
        program
            .results
            .iter()
            .map(|r| r.name.clone())
            .zip(out)
            .collect(),
    )
}

fn execute(program: &Program, host: &[HostTensor]) -> BTreeMap<String, HostTensor> {
    let rt = runtime();
    let exe = rt.compile(program, &CompileOptions::default()).unwrap();
    let bufs: Vec<_> = host.iter().map(|t| rt.upload(t).unwrap()).collect();
    let out = exe.execute(&[bufs.iter().collect()]).unwrap();
    per_layer(
        program,
        out[0].iter().map(|b| b.to_host().unwrap()).collect(),
    )
}

fn adapter(dir: &str) -> BTreeMap<String, HostTensor> {
    let s = spec("model");
    xtrain::formats::peft::read_tensors(&fixtures().join(dir), &s.model, &oracle_lora()).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn both_config_forms_agree() {
    let a = LlamaConfig::load(&fixtures().join("model/config.json")).unwrap();
    let b = LlamaConfig::load(&fixtures().join("model/config.v5.json")).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.head_dim, 16);
    assert!(a.rope_scaling.is_some());
}

#[test]
fn rope_frequencies_match_transformers() {
    let cfg = spec("model").model;
    let base = read("base_outputs.safetensors");
    let want = f32s(&base.read("rope_inv_freq").unwrap());
    let got = cfg.rope_inv_freq();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs(), "{g} vs {w}");
    }
}

#[test]
fn base_logits_and_loss_match() {
    let program = program::build_forward(&spec("model"), false).unwrap();
    let out = execute(
        &program,
        &inputs(&program, "model", &BTreeMap::new(), &BTreeMap::new()),
    );
    let base = read("base_outputs.safetensors");
    let d = max_abs_diff(&f32s(&out["logits"]), &f32s(&base.read("logits").unwrap()));
    assert!(d <= 1e-4, "logits differ by {d} (tolerance 1e-4)");
    // Causal attention in blocks of 4 and 8 query rows (blocks above the diagonal skipped).
    for block in [4, 8] {
        let mut s = spec("model");
        s.attention_block = Some(block);
        let blocked = program::build_forward(&s, false).unwrap();
        let out = execute(
            &blocked,
            &inputs(&blocked, "model", &BTreeMap::new(), &BTreeMap::new()),
        );
        let d = max_abs_diff(&f32s(&out["logits"]), &f32s(&base.read("logits").unwrap()));
        assert!(
            d <= 1e-4,
            "attention blocks of {block}: logits differ by {d} (tolerance 1e-4)"
        );
    }
    let loss = out["loss"].scalar_f32().unwrap();
    assert!(
        (loss - 6.649667).abs() <= 1e-5,
        "loss {loss} vs 6.649667 (tolerance 1e-5)"
    );
    // Per-token CE: oracle [2, 15] for positions 0..14; ours [2, 16] with the last position 0.
    let ce = f32s(&out["token_loss"]);
    let want = f32s(&base.read("per_token_ce").unwrap());
    for r in 0..2 {
        for t in 0..15 {
            let (g, w) = (ce[r * 16 + t], want[r * 15 + t]);
            assert!((g - w).abs() <= 1e-4, "row {r} pos {t}: {g} vs {w}");
        }
    }
}

/// Padding is masked out of the attention: row 1 holds row 0's first 11 tokens after 5 padding
/// positions (attention mask 0 there, left padding as batched generation uses). Its real
/// positions must give row 0's logits: RoPE makes the scores depend on relative positions only,
/// so the shift changes nothing but rounding. Checked whole and in query blocks of 4 and 8,
/// whose causal masks start at other offsets. Tolerance 1e-4 (f32), as for the oracle's logits.
#[test]
fn left_padding_is_masked_out() {
    const PAD: usize = 5;
    let base = read("base_outputs.safetensors");
    let want = f32s(&base.read("logits").unwrap());
    let (t, v) = (16, want.len() / 32);
    for block in [None, Some(4), Some(8)] {
        let mut s = spec("model");
        s.attention_block = block;
        let program = program::build_forward(&s, false).unwrap();
        let mut host = inputs(&program, "model", &BTreeMap::new(), &BTreeMap::new());
        for (arg, tensor) in program.args.iter().zip(host.iter_mut()) {
            if !matches!(
                arg.role,
                Role::InputIds | Role::Labels | Role::AttentionMask
            ) {
                continue;
            }
            let mut values = tensor.to_i32().unwrap();
            match arg.role {
                // row 1 = [token 0 x PAD, row 0's tokens 0..11], padding repeated from row 0
                Role::InputIds | Role::Labels => {
                    let row0 = values[..t].to_vec();
                    values[t..t + PAD].fill(row0[0]);
                    values[t + PAD..].copy_from_slice(&row0[..t - PAD]);
                }
                Role::AttentionMask => {
                    values[t..t + PAD].fill(0);
                    values[t + PAD..].fill(1);
                }
                _ => unreachable!(),
            }
            *tensor = HostTensor::from_i32(&values, &tensor.dims);
        }
        let got = f32s(&execute(&program, &host)["logits"]);
        let row1_real = &got[(t + PAD) * v..2 * t * v];
        let d = max_abs_diff(row1_real, &want[..(t - PAD) * v]);
        assert!(
            d <= 1e-4,
            "blocks {block:?}: left-padded row's logits differ from the unpadded row's by {d} \
             (tolerance 1e-4)"
        );
        let d = max_abs_diff(&got[..t * v], &want[..t * v]);
        assert!(d <= 1e-4, "blocks {block:?}: row 0 changed by {d}");
    }
}

#[test]
fn sharded_and_bf16_checkpoints() {
    let program = program::build_forward(&spec("model"), false).unwrap();
    let base = read("base_outputs.safetensors");
    let out = execute(
        &program,
        &inputs(
            &program,
            "model_sharded",
            &BTreeMap::new(),
            &BTreeMap::new(),
        ),
    );
    let d = max_abs_diff(&f32s(&out["logits"]), &f32s(&base.read("logits").unwrap()));
    assert!(d <= 1e-4, "sharded checkpoint logits differ by {d}");
    let out = execute(
        &program,
        &inputs(&program, "model_bf16", &BTreeMap::new(), &BTreeMap::new()),
    );
    let want = read("bf16_outputs.safetensors");
    let d = max_abs_diff(&f32s(&out["logits"]), &f32s(&want.read("logits").unwrap()));
    assert!(
        d <= 1e-4,
        "bf16 checkpoint (f32 compute) logits differ by {d} (tolerance 1e-4)"
    );
}

#[test]
fn lora_logits_loss_and_all_28_gradients_match() {
    let s = spec("model");
    let init = adapter("adapter_init");
    let program = program::build_forward(&s, true).unwrap();
    let out = execute(
        &program,
        &inputs(&program, "model", &init, &BTreeMap::new()),
    );
    let lo = read("lora_outputs.safetensors");
    let d = max_abs_diff(&f32s(&out["logits"]), &f32s(&lo.read("logits").unwrap()));
    assert!(d <= 1e-4, "LoRA logits differ by {d}");
    let loss = out["loss"].scalar_f32().unwrap();
    assert!((loss - 6.63896).abs() <= 1e-5, "LoRA loss {loss}");

    // The same gradients with layers unrolled, looped (both remat policies; remat layer also
    // keeping the softmax statistics, as TPU programs do), with the loss computed 4 positions
    // at a time, with causal attention in blocks of 4 query rows, and over key/value blocks
    // (the flash recurrence with its own backward rule) that divide the 16 positions or not.
    let _ = &s;
    for (remat, chunk, block, stats, keys) in [
        (Remat::None, None, None, false, None),
        (Remat::Layer, None, None, false, None),
        (Remat::SaveProj, None, None, false, None),
        (Remat::Layer, Some(4), None, false, None),
        (Remat::None, None, Some(4), false, None),
        (Remat::SaveProj, None, Some(4), false, None),
        (Remat::Layer, None, Some(4), true, None),
        (Remat::None, None, None, false, Some(4)),
        (Remat::Layer, None, None, false, Some(5)),
        (Remat::SaveProj, None, None, false, Some(6)),
        (Remat::Layer, Some(4), None, true, Some(3)),
    ] {
        let mut sp = spec_with("model", remat);
        sp.loss_chunk = chunk;
        sp.attention_block = block;
        sp.keep_softmax_stats = stats;
        sp.key_block = keys;
        let block = (block, keys);
        let program = program::build_grad_program(&sp).unwrap();
        let out = execute(
            &program,
            &inputs(&program, "model", &init, &BTreeMap::new()),
        );
        let loss = out["loss"].scalar_f32().unwrap();
        assert!(
            (loss - 6.63896).abs() <= 1e-5,
            "{remat:?} chunk {chunk:?} block {block:?} stats {stats}: loss {loss}"
        );
        assert_grads_match(
            &out,
            &lo,
            &format!("{remat:?} chunk {chunk:?} block {block:?} stats {stats}"),
        );
    }
}

/// The MLP in tiles of positions (`--mlp-chunk`, `model::mlp_tiles`: a loop whose backward
/// pass recomputes each tile) gives the oracle's loss and all 28 LoRA gradients, with the
/// tolerances above: tiles that divide the 16 positions (4, 8) and tiles that do not (5, 6, 7:
/// the last tile padded), with layers unrolled and looped under both remat policies, and beside
/// key blocks and loss chunks.
#[test]
fn the_mlp_in_tiles_matches_the_oracle() {
    let init = adapter("adapter_init");
    let lo = read("lora_outputs.safetensors");
    for (remat, tile, keys, chunk) in [
        (Remat::None, 4, None, None),
        (Remat::None, 7, None, None),
        (Remat::Layer, 5, None, None),
        (Remat::Layer, 8, Some(4), Some(4)),
        (Remat::SaveProj, 6, None, None),
        (Remat::SaveProj, 4, Some(5), None),
    ] {
        let mut sp = spec_with("model", remat);
        sp.mlp_chunk = Some(tile);
        sp.key_block = keys;
        sp.loss_chunk = chunk;
        let what =
            format!("{remat:?} --mlp-chunk {tile} --key-block {keys:?} --loss-chunk {chunk:?}");
        let program = program::build_grad_program(&sp).unwrap();
        assert!(
            program.text.contains("mlp_tiles"),
            "{what}: no tiles in the program"
        );
        let out = execute(
            &program,
            &inputs(&program, "model", &init, &BTreeMap::new()),
        );
        let loss = out["loss"].scalar_f32().unwrap();
        assert!((loss - 6.63896).abs() <= 1e-5, "{what}: loss {loss}");
        assert_grads_match(&out, &lo, &what);
    }
}

fn zeros_like_lora(init: &BTreeMap<String, HostTensor>) -> BTreeMap<String, HostTensor> {
    let mut extra = BTreeMap::new();
    for (name, t) in init {
        let z = HostTensor::from_f32(&vec![0.0; t.element_count()], &t.dims);
        extra.insert(format!("exp_avg.{name}"), z.clone());
        extra.insert(format!("exp_avg_sq.{name}"), z);
    }
    extra
}

#[test]
fn three_adamw_steps_match_torch() {
    // With layers unrolled and with layers looped, and with attention over key/value blocks of
    // 5 (the sequence padded to 20): the same numbers.
    for (remat, keys) in [
        (Remat::None, None),
        (Remat::Layer, None),
        (Remat::Layer, Some(5)),
    ] {
        three_adamw_steps(remat, keys);
    }
}

fn three_adamw_steps(remat: Remat, key_block: Option<i64>) {
    let spec = StepSpec {
        key_block,
        ..spec_with("model", remat)
    };
    let program = program::build_train_step(&spec).unwrap();
    let remat = (remat, key_block);
    let rt = runtime();
    let exe = rt.compile(&program, &CompileOptions::default()).unwrap();
    let init = adapter("adapter_init");
    let mut state = init.clone();
    state.extend(zeros_like_lora(&init));
    let step1 = read("lora_step1.safetensors");
    let step3 = read("lora_step3.safetensors");
    let grads = read("lora_outputs.safetensors");
    let mut losses = Vec::new();
    for t in 1..=3 {
        let mut extra = state.clone();
        extra.insert("step".into(), HostTensor::from_f32(&[t as f32], &[]));
        extra.insert("lr".into(), HostTensor::from_f32(&[1e-3], &[]));
        let host = inputs(&program, "model", &state, &extra);
        let bufs: Vec<_> = host.iter().map(|t| rt.upload(t).unwrap()).collect();
        let out = exe.execute(&[bufs.iter().collect()]).unwrap();
        // Donated state buffers are consumed by the step.
        let lora_idx = program
            .args
            .iter()
            .position(|a| a.role == Role::Lora)
            .unwrap();
        assert!(
            bufs[lora_idx].is_deleted().unwrap(),
            "LoRA params are donated"
        );
        let out = per_layer(
            &program,
            out[0].iter().map(|b| b.to_host().unwrap()).collect(),
        );
        losses.push(out["loss"].scalar_f32().unwrap());
        if t == 1 {
            let gn = out["grad_norm"].scalar_f32().unwrap();
            assert!(
                (gn - 2.576915).abs() <= 1e-4 * 2.58,
                "{remat:?}: grad norm {gn} vs 2.576915"
            );
            for name in init.keys() {
                let got = f32s(&out[name]);
                let want = f32s(&step1.read(name).unwrap());
                let g = f32s(&grads.read(&format!("grad.{name}")).unwrap());
                for i in 0..got.len() {
                    if g[i].abs() > 1e-6 {
                        assert!(
                            (got[i] - want[i]).abs() <= 1e-5,
                            "{remat:?} {name}[{i}] after step 1: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
                for prefix in ["exp_avg", "exp_avg_sq"] {
                    let m = format!("{prefix}.{name}");
                    let d = max_abs_diff(&f32s(&out[&m]), &f32s(&step1.read(&m).unwrap()));
                    assert!(
                        d <= 1e-6,
                        "{remat:?} {m} after step 1 differs by {d} (tolerance 1e-6)"
                    );
                }
            }
        }
        if t == 3 {
            for name in init.keys() {
                let d = max_abs_diff(&f32s(&out[name]), &f32s(&step3.read(name).unwrap()));
                assert!(
                    d <= 1e-5,
                    "{remat:?} {name} after step 3 differs by {d} (tolerance 1e-5)"
                );
            }
        }
        for name in state.keys().cloned().collect::<Vec<_>>() {
            state.insert(name.clone(), out[&name].clone());
        }
    }
    for (g, w) in losses.iter().zip([6.63896f32, 6.45776, 6.28345]) {
        assert!((g - w).abs() <= 1e-4, "{remat:?}: losses {losses:?}");
    }
}

#[test]
fn the_step_computes_no_gradient_of_a_frozen_weight() {
    let s = spec("model");
    let program = program::build_train_step(&s).unwrap();
    let frozen: Vec<String> = program
        .args
        .iter()
        .filter(|a| a.role == Role::Frozen)
        .map(|a| {
            format!(
                "tensor<{}xf32>",
                a.shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join("x")
            )
        })
        .collect();
    // A weight gradient is a product of two activations with the weight's type. No product in
    // the backward pass (locations ending in ".grad") has a frozen weight's type unless one of
    // its operands is a parameter (then it is an activation gradient through that parameter that
    // happens to share the shape, like lm_head's [tokens, hidden] in this tiny model).
    let param_names: Vec<String> = program
        .args
        .iter()
        .map(|a| format!("%{}", a.name.replace('*', "_")))
        .collect();
    let mut backward_lines = 0;
    for line in program.text.lines().filter(|l| l.contains(".grad\")")) {
        backward_lines += 1;
        if !line.contains("stablehlo.dot_general") {
            continue;
        }
        let result_type = line.rsplit("-> ").next().unwrap_or(line);
        let uses_weight = param_names
            .iter()
            .any(|n| line.contains(&format!("{n},")) || line.contains(&format!("{n} ")));
        for f in &frozen {
            assert!(
                uses_weight || !result_type.starts_with(f.as_str()),
                "backward forms a {f} from activations: {line}"
            );
        }
    }
    assert!(backward_lines > 100);
    // Forward, per layer: 7 projections + 14 LoRA dots + 2 attention dots; plus lm_head.
    // Backward, per layer: 7 activation grads through W, 4 per LoRA pair (dA, dB and two
    // activation grads), 4 attention; plus lm_head's activation grad. Layer 0's input comes from
    // the frozen embedding, so q, k and v there need no input gradient: 3 through W and 3
    // through A fewer. Nothing else: a frozen weight never gets a gradient dot.
    let dots = program.text.matches("stablehlo.dot_general").count();
    let forward = 2 * (7 + 14 + 2) + 1;
    let backward = 2 * (7 + 28 + 4) - 6 + 1;
    assert_eq!(dots, forward + backward, "dot_general count");
}

/// A kernel in place of the attention composites gives the oracle's loss and every LoRA
/// gradient, with the tolerances of the key-block rows above; the program's text keeps its
/// loops, and only the compiled text holds the kernel. `every-key`: every key at once in plain
/// StableHLO. `cudnn-standin`: the cuDNN kernel's layout changes, head grouping and row
/// statistic around plain StableHLO that computes what cuDNN's calls compute (the oracle's rows
/// are one document each, as the kernel requires).
#[test]
fn a_kernel_in_place_of_the_attention_composites_matches_the_oracle() {
    let init = adapter("adapter_init");
    let lo = read("lora_outputs.safetensors");
    for (kernel, remat, keys) in [
        ("every-key", Remat::Layer, 5),
        ("every-key", Remat::SaveProj, 4),
        ("cudnn-standin", Remat::Layer, 5),
        ("cudnn-standin", Remat::SaveProj, 4),
    ] {
        let kernels = xtrain::device::kernels::chosen(&[kernel.to_string()], "cpu").unwrap();
        let mut sp = spec_with("model", remat);
        sp.key_block = Some(keys);
        let program = program::build_grad_program(&sp).unwrap();
        let (text, used) = xtrain::device::kernels::replace(&program.text, &kernels).unwrap();
        let names: Vec<String> = used.iter().map(|u| u.to_string()).collect();
        assert_eq!(
            names,
            [
                format!("xtrain.attention v1 -> {kernel}"),
                format!("xtrain.attention_grad v1 -> {kernel}")
            ]
        );
        assert!(program.text.contains("stablehlo.while") && text.len() != program.text.len());
        let replaced = Program { text, ..program };
        let out = execute(
            &replaced,
            &inputs(&replaced, "model", &init, &BTreeMap::new()),
        );
        let loss = out["loss"].scalar_f32().unwrap();
        assert!(
            (loss - 6.63896).abs() <= 1e-5,
            "{kernel} {remat:?} {keys}: loss {loss}"
        );
        assert_grads_match(&out, &lo, &format!("{remat:?} --kernel {kernel} {keys}"));
    }
}

/// Every LoRA gradient of `out` against the oracle's, to 1e-4 relative error (L2), all 28.
fn assert_grads_match(out: &BTreeMap<String, HostTensor>, lo: &SafeTensors, what: &str) {
    let mut checked = 0;
    for (name, t) in out.iter().filter(|(n, _)| n.starts_with("grad.")) {
        let got = f32s(t);
        let want = f32s(&lo.read(name).unwrap());
        let diff: f32 = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        let norm: f32 = want.iter().map(|b| b * b).sum::<f32>().sqrt();
        assert!(
            diff / norm <= 1e-4,
            "{what} {name}: relative error {} (tolerance 1e-4)",
            diff / norm
        );
        checked += 1;
    }
    assert_eq!(checked, 28, "{what}");
}

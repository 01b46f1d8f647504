//! Layers as loops, remat policies, gradient accumulation, bf16 mixed precision, dropout.

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
use xtrain::program::{self, Program, Remat, Role, StepSpec};

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| Runtime::open(Some("cpu"), Some(1)).expect("CPU runtime"))
}

fn tiny() -> LlamaConfig {
    LlamaConfig::load(&fixtures().join("model")).unwrap()
}

fn spec(cfg: LlamaConfig, remat: Remat, batch: i64, seq: i64) -> StepSpec {
    let lora = LoraConfig {
        r: 8,
        alpha: 16.0,
        dropout: 0.0,
        targets: Projection::ALL.to_vec(),
    };
    StepSpec {
        remat,
        ..StepSpec::new(cfg, lora, batch, seq, hlo::DType::F32)
    }
}

/// Run a program on the tiny model's weights, the oracle's initial adapter and `batch`.
fn run(
    program: &Program,
    s: &StepSpec,
    batch: &[HostTensor; 3],
    extra: &BTreeMap<String, HostTensor>,
) -> BTreeMap<String, HostTensor> {
    let rt = runtime();
    let frozen = program.frozen_shapes();
    let wdt = if s.dtype == hlo::DType::BF16 {
        ElementType::BF16
    } else {
        ElementType::F32
    };
    let weights = xtrain::formats::weights::load(
        &fixtures().join("model"),
        &s.model,
        &frozen,
        wdt,
        |_, _| {},
    )
    .unwrap();
    let lora =
        xtrain::formats::peft::read_tensors(&fixtures().join("adapter_init"), &s.model, &s.lora)
            .unwrap();
    let mut all = lora.clone();
    for (n, t) in &lora {
        let z = HostTensor::from_f32(&vec![0.0; t.element_count()], &t.dims);
        all.insert(format!("exp_avg.{n}"), z.clone());
        all.insert(format!("exp_avg_sq.{n}"), z);
    }
    let names: Vec<(String, Vec<i64>)> = program
        .args
        .iter()
        .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
        .map(|a| (a.name.clone(), a.shape.clone()))
        .collect();
    let state =
        xtrain::formats::host::to_program_layout(&names, &all, s.model.num_hidden_layers).unwrap();
    let (mut w, mut st) = (weights.into_iter(), state.into_iter());
    let host: Vec<HostTensor> = program
        .args
        .iter()
        .map(|a| match a.role {
            Role::Frozen => w.next().unwrap(),
            Role::Lora | Role::AdamM | Role::AdamV => st.next().unwrap(),
            Role::InputIds => batch[0].clone(),
            Role::Labels => batch[1].clone(),
            Role::AttentionMask => batch[2].clone(),
            _ => extra[&a.name].clone(),
        })
        .collect();
    let exe = rt.compile(program, &CompileOptions::default()).unwrap();
    let bufs: Vec<_> = host.iter().map(|t| rt.upload(t).unwrap()).collect();
    let out = exe.execute(&[bufs.iter().collect()]).unwrap();
    xtrain::formats::host::from_program_layout(
        program
            .results
            .iter()
            .map(|r| r.name.clone())
            .zip(out[0].iter().map(|b| b.to_host().unwrap()))
            .collect(),
    )
}

fn oracle_batch() -> [HostTensor; 3] {
    let st = SafeTensors::open(&fixtures().join("inputs.safetensors")).unwrap();
    ["input_ids", "labels", "attention_mask"]
        .map(|n| convert(&st.read(n).unwrap(), ElementType::S32).unwrap())
}

fn step_extra() -> BTreeMap<String, HostTensor> {
    let mut e = BTreeMap::new();
    e.insert("step".into(), HostTensor::from_f32(&[1.0], &[]));
    e.insert("lr".into(), HostTensor::from_f32(&[1e-3], &[]));
    e
}

#[test]
fn looped_program_size_does_not_grow_with_depth() {
    let mut c2 = tiny();
    c2.num_hidden_layers = 2;
    let mut c32 = tiny();
    c32.num_hidden_layers = 32;
    for remat in [Remat::Layer, Remat::SaveProj] {
        let a = program::build_train_step(&spec(c2.clone(), remat, 2, 16))
            .unwrap()
            .text
            .len() as f64;
        let b = program::build_train_step(&spec(c32.clone(), remat, 2, 16))
            .unwrap()
            .text
            .len() as f64;
        assert!(
            (b - a).abs() / a <= 0.10,
            "{remat:?}: 2 layers {a} bytes, 32 layers {b} bytes"
        );
    }
    // Unrolled, it does grow.
    let a = program::build_train_step(&spec(c2, Remat::None, 2, 16))
        .unwrap()
        .text
        .len();
    let b = program::build_train_step(&spec(c32, Remat::None, 2, 16))
        .unwrap()
        .text
        .len();
    assert!(b > 10 * a);
}

#[test]
fn remat_layer_lowers_compiled_temp_memory() {
    // A fixed config with enough activations to see: the tiny model at 8 layers, 4 x 128 tokens.
    let mut cfg = tiny();
    cfg.num_hidden_layers = 8;
    let rt = runtime();
    let mut temps = Vec::new();
    for remat in [Remat::None, Remat::SaveProj, Remat::Layer] {
        let p = program::build_train_step(&spec(cfg.clone(), remat, 4, 128)).unwrap();
        let exe = rt.compile(&p, &CompileOptions::default()).unwrap();
        let m = exe.memory_stats().unwrap();
        eprintln!(
            "remat {remat:?}: temp {} bytes, arguments {} bytes",
            m.temp_bytes, m.argument_bytes
        );
        temps.push(m.temp_bytes);
    }
    assert!(
        temps[2] < temps[0],
        "remat=layer temp {} must be below remat=none temp {}",
        temps[2],
        temps[0]
    );
    assert!(
        temps[2] <= temps[1],
        "remat=layer keeps less than save-proj"
    );
}

#[test]
fn gradient_accumulation_equals_one_big_batch() {
    let batch = oracle_batch();
    let one = spec(tiny(), Remat::Layer, 2, 16);
    let mut two = one.clone();
    two.grad_accum = 2;
    let a = run(
        &program::build_train_step(&one).unwrap(),
        &one,
        &batch,
        &step_extra(),
    );
    let b = run(
        &program::build_train_step(&two).unwrap(),
        &two,
        &batch,
        &step_extra(),
    );
    for (name, t) in &a {
        let (x, y) = (t.to_f32().unwrap(), b[name].to_f32().unwrap());
        let d = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q).abs() / q.abs().max(1.0))
            .fold(0.0f32, f32::max);
        assert!(
            d <= 1e-6,
            "{name}: 1 batch vs 2 microbatches differ by {d} (tolerance 1e-6)"
        );
    }
    let loss = a["loss"].scalar_f32().unwrap();
    assert!((loss - 6.63896).abs() < 1e-5);
}

// ---------------------------------------------------------------------------------------------
// bf16 tolerances, derived from bf16's rounding
//
// bf16 rounds to nearest with an 8-bit significand: each rounding changes a value by at most
// u = 2^-8 of it. A result is reached through a chain of k roundings (each op whose result is
// bf16 and computed: matmuls, arithmetic, converts from f32; moving data, max, min, negation and
// selection are exact). Their errors have independent signs and add like a random walk: with
// each uniform in [-u, u] (standard deviation u/sqrt(3)), after k roundings the standard
// deviation is u sqrt(k/3), and three of them, u sqrt(3k), bounds the relative error of the
// result (Higham and Mary's probabilistic rounding analysis, SIAM J. Sci. Comput. 2019; the
// worst case k u is far above what any run shows). Against the f32 step (whose own roundings,
// k x 2^-24, are negligible): `VS_F32(k)`. Two bf16 programs whose roundings may land apart
// (another form, fusion, GEMM kernel or summation order; another CPU: XLA CPU takes other paths
// on one without AVX-512) each err that much, independently: sqrt(2) times it, `BETWEEN(k)`.
// Tensors are compared relative to their largest magnitude; k is counted per result on the
// unrolled program of the same step (`rounding_chains`: the looped one recomputes the same
// ops, so its chains are the same), plus one for the weights' own rounding to bf16 at load.
// On the tiny model k is 60 for the loss (62 with bf16 attention scores) and 60 to 127 for the
// LoRA gradients (142 in the wide-result form, whose converts after each matmul count): the
// loss within 5.2% of the f32 step's and the gradients within 7.6%; two bf16 forms within 7.4%
// (loss) and 10.8% to 11.4% (gradients). The test prints the counts and what it measured.

/// bf16's unit roundoff.
const U: f64 = 1.0 / 256.0;

/// The relative error bound of a bf16 result `k` roundings deep against the f32 step's.
fn vs_f32(k: usize) -> f32 {
    (U * (3.0 * k as f64).sqrt()) as f32
}

/// The relative bound on the difference of two bf16 computations of a result `k` roundings
/// deep whose roundings may land apart.
fn between(k: usize) -> f32 {
    (U * (6.0 * k as f64).sqrt()) as f32
}

/// The longest chain of bf16 roundings from the arguments to each result of a program without
/// loops, plus one for the bf16 weights' own rounding: {result name: k}.
fn rounding_chains(program: &Program) -> BTreeMap<String, usize> {
    assert!(
        !program.text.contains("stablehlo.while"),
        "count the chains on the unrolled program"
    );
    let exact = [
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "bitcast_convert",
        "constant",
        "select",
        "pad",
        "iota",
        "gather",
        "reverse",
        "maximum",
        "minimum",
        "negate",
        "abs",
        "compare",
    ];
    let def = regex::Regex::new(r#"^\s*(%[\w.#]+) = "?stablehlo\.(\w+)"#).unwrap();
    let value = regex::Regex::new(r"%[\w.#]+").unwrap();
    let mut depth: BTreeMap<String, usize> = BTreeMap::new();
    let mut returned = Vec::new();
    for line in program.text.lines() {
        if let Some(c) = def.captures(line) {
            let rhs = line.split_once(" = ").unwrap().1;
            let result_type = match rhs.rsplit_once("->") {
                Some((_, t)) => t,
                None => rhs.rsplit_once(':').map_or(rhs, |(_, t)| t),
            };
            let rounds = result_type.contains("bf16>") && !exact.contains(&&c[2]);
            let deepest = value
                .find_iter(rhs)
                .map(|m| depth.get(m.as_str()).copied().unwrap_or(0))
                .max()
                .unwrap_or(0);
            depth.insert(c[1].to_string(), deepest + usize::from(rounds));
        } else if line.trim_start().starts_with("return ") {
            returned = value
                .find_iter(line)
                .map(|m| depth.get(m.as_str()).copied().unwrap_or(0))
                .collect();
        }
    }
    assert_eq!(returned.len(), program.results.len(), "the return's values");
    program
        .results
        .iter()
        .zip(returned)
        .map(|(r, k)| (r.name.clone(), k + 1))
        .collect()
}

/// The chains of the unrolled form of `s`'s gradient program.
fn chains_of(s: &StepSpec) -> BTreeMap<String, usize> {
    let mut unrolled = s.clone();
    unrolled.remat = Remat::None;
    unrolled.loss_chunk = None;
    let chains = rounding_chains(&program::build_grad_program(&unrolled).unwrap());
    eprintln!(
        "bf16 rounding chains: loss {}, LoRA gradients {} to {}",
        chains["loss"],
        chains.values().min().unwrap(),
        chains.values().max().unwrap()
    );
    chains
}

/// The bf16 loss is within `vs_f32` of the f32 step's (its chain: 60 roundings on the tiny
/// model, 5.2%).
#[test]
fn bf16_loss_is_close_to_f32() {
    let batch = oracle_batch();
    let f32_spec = spec(tiny(), Remat::Layer, 2, 16);
    let bf = in_bf16(&f32_spec);
    let a = run(
        &program::build_grad_program(&f32_spec).unwrap(),
        &f32_spec,
        &batch,
        &BTreeMap::new(),
    );
    let b = run(
        &program::build_grad_program(&bf).unwrap(),
        &bf,
        &batch,
        &BTreeMap::new(),
    );
    let (la, lb) = (
        a["loss"].scalar_f32().unwrap(),
        b["loss"].scalar_f32().unwrap(),
    );
    let tol = vs_f32(chains_of(&bf)["loss"]);
    assert!(
        (la - lb).abs() <= tol * la.abs(),
        "bf16 loss {lb} vs f32 {la} (tolerance {tol} of it)"
    );
    // LoRA weights and their gradients stay f32 (master weights).
    assert!(b
        .iter()
        .filter(|(n, _)| n.starts_with("grad."))
        .all(|(_, t)| t.ty == ElementType::F32));
}

/// `matmul_result: F32` changes only the form of the bf16 program (each matmul gives its f32
/// accumulator, rounded to bf16 right after, as XLA CPU's native bf16 GEMM wants), not its
/// arithmetic: loss and every LoRA gradient match the bf16-result form. They need not match to
/// the bit: the two forms may run other GEMM kernels that sum in other orders, and a rounding
/// can then land one unit apart (on a CPU without AVX-512 a gradient moved by 1.1% of its
/// largest magnitude; on SmolLM2-135M's 30 layers the first loss by 0.45%): within `between`.
#[test]
fn bf16_wide_matmul_results_change_the_form_not_the_numbers() {
    let batch = oracle_batch();
    let narrow = in_bf16(&spec(tiny(), Remat::Layer, 2, 16));
    let mut wide = narrow.clone();
    wide.matmul_result = xtrain::program::ResultType::F32;
    let (pn, pw) = (
        program::build_grad_program(&narrow).unwrap(),
        program::build_grad_program(&wide).unwrap(),
    );
    // Every bf16 x bf16 product gives f32 in the wide form; the narrow form keeps bf16 results
    // except the attention scores (f32 for the softmax), the probabilities-times-values product
    // (f32 until it is divided by the softmax's sum) and their backward products.
    assert_eq!(
        bf16_dots(&pw.text, "xbf16>"),
        0,
        "wide form has a bf16-result matmul"
    );
    assert!(bf16_dots(&pn.text, "xbf16>") > bf16_dots(&pn.text, "xf32>"));
    let a = run(&pn, &narrow, &batch, &BTreeMap::new());
    let b = run(&pw, &wide, &batch, &BTreeMap::new());
    let chains = deepest(&[chains_of(&narrow), chains_of(&wide)]);
    let (la, lb) = (
        a["loss"].scalar_f32().unwrap(),
        b["loss"].scalar_f32().unwrap(),
    );
    let tol = between(chains["loss"]);
    assert!(
        (la - lb).abs() <= tol * la.abs(),
        "loss: wide {lb} vs narrow {la} (tolerance {tol} of it)"
    );
    assert_grads_close("wide vs narrow", &a, &b, |n| between(chains[n]));
}

/// `attention_scores: Compute` (the default on GPUs and TPUs) writes q.k in bf16 before the f32
/// softmax, as Hugging Face's eager bf16 attention does: one more rounding, so the numbers move,
/// by about as much as bf16 itself moves them. Against the f32-scores bf16 program: within
/// `between` (loss and every LoRA gradient); against the f32 step, each bf16 step within
/// `vs_f32` of its chains, which the scores' rounding lengthens by one per layer and pass.
#[test]
fn bf16_attention_scores_move_the_numbers_no_more_than_bf16_does() {
    let batch = oracle_batch();
    let f32_spec = spec(tiny(), Remat::Layer, 2, 16);
    let wide = in_bf16(&f32_spec);
    let mut narrow = wide.clone();
    narrow.attention_scores = xtrain::program::ResultType::Compute;
    let (pw, pn) = (
        program::build_grad_program(&wide).unwrap(),
        program::build_grad_program(&narrow).unwrap(),
    );
    // In the default form the bf16 x bf16 matmuls with f32 results are the scores product and
    // the probabilities-times-values product (f32 until it is divided by the softmax's sum),
    // with their backward products; narrow scores leave only the second kind, and the same
    // number of them.
    let (wide_f32, narrow_f32) = (bf16_dots(&pw.text, "xf32>"), bf16_dots(&pn.text, "xf32>"));
    assert!(
        narrow_f32 > 0 && narrow_f32 < wide_f32,
        "{narrow_f32} vs {wide_f32}"
    );
    assert_eq!(
        bf16_dots(&pn.text, "xbf16>") - bf16_dots(&pw.text, "xbf16>"),
        wide_f32 - narrow_f32,
        "narrow scores: the f32-result products that became bf16"
    );
    let f = run(
        &program::build_grad_program(&f32_spec).unwrap(),
        &f32_spec,
        &batch,
        &BTreeMap::new(),
    );
    let a = run(&pw, &wide, &batch, &BTreeMap::new());
    let b = run(&pn, &narrow, &batch, &BTreeMap::new());
    let (ca, cb) = (chains_of(&wide), chains_of(&narrow));
    let both = deepest(&[ca.clone(), cb.clone()]);
    let (lf, la, lb) = (
        f["loss"].scalar_f32().unwrap(),
        a["loss"].scalar_f32().unwrap(),
        b["loss"].scalar_f32().unwrap(),
    );
    eprintln!("loss: f32 {lf}, bf16 with f32 scores {la}, with bf16 scores {lb}");
    let tol = between(both["loss"]);
    assert!(
        (la - lb).abs() <= tol * la.abs(),
        "loss: bf16 scores {lb} vs f32 scores {la} (tolerance {tol} of it)"
    );
    for (what, got, chains) in [("f32 scores", &a, &ca), ("bf16 scores", &b, &cb)] {
        let tol = vs_f32(chains["loss"]);
        let l = got["loss"].scalar_f32().unwrap();
        assert!(
            (lf - l).abs() <= tol * lf.abs(),
            "loss: bf16 with {what} {l} vs the f32 step's {lf} (tolerance {tol} of it)"
        );
        assert_grads_close(&format!("bf16 with {what} vs f32"), &f, got, |n| {
            vs_f32(chains[n])
        });
    }
    assert_grads_close("bf16 vs f32 scores", &a, &b, |n| between(both[n]));
}

/// The same step in bf16 (weights and compute).
fn in_bf16(s: &StepSpec) -> StepSpec {
    let mut bf = s.clone();
    bf.dtype = hlo::DType::BF16;
    bf
}

/// Per result, the longer of the programs' chains.
fn deepest(chains: &[BTreeMap<String, usize>]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for c in chains {
        for (n, k) in c {
            let e = out.entry(n.clone()).or_insert(0);
            *e = (*e).max(*k);
        }
    }
    out
}

/// The bf16 x bf16 matmuls in a program's text whose result type contains `result`.
fn bf16_dots(text: &str, result: &str) -> usize {
    text.lines()
        .filter(|l| l.contains("stablehlo.dot_general") && l.contains("xbf16>, tensor<"))
        .filter(|l| l.split("-> ").nth(1).is_some_and(|r| r.contains(result)))
        .count()
}

/// (largest |want - got|, largest |want|) over a tensor's elements.
fn largest_difference(want: &HostTensor, got: &HostTensor) -> (f32, f32) {
    let (x, y) = (want.to_f32().unwrap(), got.to_f32().unwrap());
    let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = x
        .iter()
        .zip(&y)
        .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
    (d, scale)
}

/// Every `grad.*` tensor (and the loss) of `got` within `tol(name)` of the largest magnitude of
/// the same tensor in `want`; the largest fraction is printed.
fn assert_grads_close(
    what: &str,
    want: &BTreeMap<String, HostTensor>,
    got: &BTreeMap<String, HostTensor>,
    tol: impl Fn(&str) -> f32,
) {
    let mut n = 0;
    let mut worst = (0.0f32, "");
    for (name, t) in want
        .iter()
        .filter(|(n, _)| n.starts_with("grad.") || *n == "loss")
    {
        let (d, scale) = largest_difference(t, &got[name]);
        let tol = tol(name);
        assert!(
            d <= tol * scale,
            "{what} {name}: differs by {d}, largest magnitude {scale} (tolerance {tol} of it)"
        );
        if d / scale > worst.0 {
            worst = (d / scale, name);
        }
        n += 1;
    }
    assert!(n > 1, "{what}: no gradients compared");
    eprintln!(
        "{what}: largest difference {} of a tensor's largest magnitude ({})",
        worst.0, worst.1
    );
}

/// In bf16 the looped step keeps its per-layer stacks (layer inputs, saved projections, the
/// chunked loss's dh) as u16 bits, so that XLA writes one layer in place rather than converting
/// the whole stack to f32 and back. Storage only: remat layer, save-proj, a chunked loss and the
/// unrolled step (which has no stacks) compute the same roundings, but as other programs, which
/// XLA fuses differently, so roundings may land apart: within `between` of each other. A wrong
/// layer or a garbled bit pattern is far outside that.
#[test]
fn bf16_layer_stacks_as_bits_keep_the_numbers() {
    let batch = oracle_batch();
    let bf16 = |remat, chunk| {
        let mut s = spec(tiny(), remat, 2, 16);
        s.dtype = hlo::DType::BF16;
        s.loss_chunk = chunk;
        s
    };
    let grads = |s: &StepSpec| {
        let program = program::build_grad_program(s).unwrap();
        let out = run(&program, s, &batch, &BTreeMap::new());
        (program.text, out)
    };
    let unrolled_spec = bf16(Remat::None, None);
    let chains = chains_of(&unrolled_spec);
    let (_, unrolled) = grads(&unrolled_spec);
    let (text, layer) = grads(&bf16(Remat::Layer, None));
    assert!(text.contains("xui16>"), "remat layer: no u16 stack");
    assert_grads_close("remat layer vs unrolled", &unrolled, &layer, |n| {
        between(chains[n])
    });
    for (remat, chunk) in [(Remat::SaveProj, None), (Remat::Layer, Some(8))] {
        let (_, got) = grads(&bf16(remat, chunk));
        assert_grads_close(
            &format!("{remat:?} chunk {chunk:?} vs remat layer"),
            &layer,
            &got,
            |n| between(chains[n]),
        );
    }
}

#[test]
fn dropout_is_deterministic_and_the_same_unrolled_or_looped() {
    let batch = oracle_batch();
    let mut extra = step_extra();
    extra.insert(
        "dropout_key".into(),
        HostTensor {
            ty: ElementType::U64,
            dims: vec![2],
            bytes: [7u64, 1 << 20]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        },
    );
    let mut losses = Vec::new();
    for remat in [Remat::None, Remat::Layer, Remat::Layer] {
        let mut s = spec(tiny(), remat, 2, 16);
        s.lora.dropout = 0.1;
        let out = run(&program::build_train_step(&s).unwrap(), &s, &batch, &extra);
        losses.push((
            out["loss"].scalar_f32().unwrap(),
            out["grad_norm"].scalar_f32().unwrap(),
        ));
    }
    assert_ne!(losses[0].0, 6.63896f32, "dropout changes the loss");
    assert!(
        (losses[0].0 - losses[1].0).abs() < 1e-5 && (losses[0].1 - losses[1].1).abs() < 1e-4,
        "{losses:?}"
    );
    assert_eq!(losses[1], losses[2], "same key, same result");
}

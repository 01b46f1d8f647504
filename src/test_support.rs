//! Helpers for the unit tests beside the model, program and data code: run a small function on
//! the CPU plugin (installed on first use, as the integration tests do), deterministic data, and
//! a step's loss and gradients with random weights.

use crate::program::{Role, StepSpec};
use hlo::{Func, Module};
use pjrt::{Client, ClientOptions, CompileOptions, HostTensor, Plugin};
use std::collections::BTreeMap;
use std::sync::OnceLock;

fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let path = pjrt::discover::resolve_or_install(Some("cpu")).expect("the CPU plugin");
        Plugin::load(&path)
            .expect("load the CPU plugin")
            .client(&ClientOptions::cpu_device_count(1))
            .expect("a CPU client")
    })
}

/// Compile `func` as a module's main and run it once.
pub fn run(func: Func, inputs: &[HostTensor]) -> Vec<HostTensor> {
    run_text(&Module::new("test", func).to_text(), inputs)
}

/// Compile a module's text (one device) and run it once.
pub fn run_text(text: &str, inputs: &[HostTensor]) -> Vec<HostTensor> {
    let c = client();
    let exe = c
        .compile(text, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}\n--- program ---\n{text}"));
    let device = &c.devices().unwrap()[0];
    let bufs: Vec<_> = inputs
        .iter()
        .map(|t| c.to_device(t, device).unwrap())
        .collect();
    let out = exe.execute(&[bufs.iter().collect()]).unwrap();
    out.into_iter()
        .next()
        .unwrap()
        .iter()
        .map(|b| b.to_host().unwrap())
        .collect()
}

/// `n` deterministic values in [-1, 1) (xorshift from `seed`).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

/// The largest absolute difference between `got` and `want`.
pub fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// A loss and the LoRA gradients by per-layer name (`...layers.0...`), whether the program's
/// layers are stacked or not.
pub type LossAndGrads = (f32, BTreeMap<String, Vec<f32>>);

/// Per-layer names and values of a tensor that is stacked over the layers
/// (`model.layers.*.x` [L, ...]) or already one layer's.
fn per_layer(name: &str, shape: &[i64], values: &[f32]) -> Vec<(String, Vec<f32>)> {
    if !name.contains(".layers.*.") {
        return vec![(name.to_string(), values.to_vec())];
    }
    let each = values.len() / shape[0] as usize;
    values
        .chunks(each)
        .enumerate()
        .map(|(i, v)| {
            let name = name.replace(".layers.*.", &format!(".layers.{i}."));
            (name, v.to_vec())
        })
        .collect()
}

/// Random values in [-0.2, 0.2) for a tensor, each layer's seeded by its per-layer name, so
/// that every form of the step gets the same weights whether its layers are stacked or not.
pub fn weights(name: &str, shape: &[i64]) -> Vec<f32> {
    let layers = if name.contains(".layers.*.") {
        shape[0]
    } else {
        1
    };
    let each = (shape.iter().product::<i64>() / layers) as usize;
    (0..layers)
        .flat_map(|i| {
            let name = name.replace(".layers.*.", &format!(".layers.{i}."));
            let seed = name
                .bytes()
                .fold(7u64, |h, c| h.wrapping_mul(31).wrapping_add(c as u64));
            values(each, seed).into_iter().map(|v| 0.2 * v)
        })
        .collect()
}

/// The loss and the LoRA gradients of `spec`'s grads program with random weights and adapters
/// (the same for every form of the step) on a batch of `spec.batch` rows given end to end.
pub fn loss_and_grads_on(
    spec: &StepSpec,
    ids: &[i32],
    labels: &[i32],
    mask: &[i32],
) -> LossAndGrads {
    grads_program_on(spec, ids, labels, mask, None).0
}

/// [`loss_and_grads_on`] for any grads program, a DPO step's too: its reference adapter random
/// as the policy's (other values: other names), its precomputed reference log-probabilities
/// `reference`. Also returns the program's results after the gradients (a DPO step's rows'
/// log-probabilities under the policy and the reference).
pub fn grads_program_on(
    spec: &StepSpec,
    ids: &[i32],
    labels: &[i32],
    mask: &[i32],
    reference: Option<&[f32]>,
) -> (LossAndGrads, Vec<Vec<f32>>) {
    let program = crate::program::build_grad_program(spec).unwrap();
    let inputs: Vec<HostTensor> = program
        .args
        .iter()
        .map(|a| match a.role {
            Role::Frozen | Role::Lora | Role::ReferenceLora => {
                HostTensor::from_f32(&weights(&a.name, &a.shape), &a.shape)
            }
            Role::InputIds => HostTensor::from_i32(ids, &a.shape),
            Role::Labels => HostTensor::from_i32(labels, &a.shape),
            Role::AttentionMask => HostTensor::from_i32(mask, &a.shape),
            Role::ReferenceLogps => HostTensor::from_f32(
                reference.expect("the reference's log-probabilities"),
                &a.shape,
            ),
            other => panic!("the grads program takes no {other:?} argument"),
        })
        .collect();
    let out = run_text(&program.text, &inputs);
    let loss = out[0].to_f32().unwrap()[0];
    let n = program
        .results
        .iter()
        .filter(|r| r.name.starts_with("grad."))
        .count();
    let grads = program.results[1..=n]
        .iter()
        .zip(&out[1..=n])
        .flat_map(|(r, g)| per_layer(&r.name, &r.shape, &g.to_f32().unwrap()))
        .collect();
    let rest = out[1 + n..].iter().map(|t| t.to_f32().unwrap()).collect();
    ((loss, grads), rest)
}

/// The same loss (to `tol` relative) and the same gradients (to `tol` times the largest one),
/// which must not all be zero.
pub fn assert_same(what: &str, got: &LossAndGrads, want: &LossAndGrads, tol: f32) {
    let scale = want.1.values().flatten().fold(0f32, |m, g| m.max(g.abs()));
    assert!(scale > 0.0, "{what}: the gradients are all zero");
    assert!(
        (got.0 - want.0).abs() <= tol * want.0.abs(),
        "{what}: loss {} against {}",
        got.0,
        want.0
    );
    assert_eq!(
        got.1.keys().collect::<Vec<_>>(),
        want.1.keys().collect::<Vec<_>>(),
        "{what}: other gradients"
    );
    for (name, g) in &got.1 {
        let d = max_diff(g, &want.1[name]);
        assert!(
            d <= tol * scale,
            "{what}: {name} differs by {d} (largest gradient {scale})"
        );
    }
}

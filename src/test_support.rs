//! Helpers for the unit tests beside the model and program code: run a small function on the
//! CPU plugin (installed on first use, as the integration tests do), and deterministic data.

use hlo::{Func, Module};
use pjrt::{Client, ClientOptions, CompileOptions, HostTensor, Plugin};
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

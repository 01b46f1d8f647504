//! Shared test helpers: run a built function on the CPU plugin, random data, finite differences.
#![allow(dead_code)]

use hlo::{Builder, DType, Func, Module, Shape, Value};
use pjrt::{Client, ClientOptions, CompileOptions, ElementType, HostTensor, Plugin};
use std::sync::OnceLock;

pub fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let path = pjrt::discover::resolve_or_install(Some("cpu")).expect("CPU plugin");
        Plugin::load(&path)
            .expect("load")
            .client(&ClientOptions::cpu_device_count(4))
            .expect("client")
    })
}

pub fn element_type(d: DType) -> ElementType {
    match d {
        DType::Pred => ElementType::Pred,
        DType::S8 => ElementType::S8,
        DType::S32 => ElementType::S32,
        DType::S64 => ElementType::S64,
        DType::U8 => ElementType::U8,
        DType::U16 => ElementType::U16,
        DType::U32 => ElementType::U32,
        DType::U64 => ElementType::U64,
        DType::F16 => ElementType::F16,
        DType::BF16 => ElementType::BF16,
        DType::F32 => ElementType::F32,
        DType::F64 => ElementType::F64,
    }
}

/// Compile `func` as a module's main and run it once on device 0.
pub fn run(func: Func, inputs: &[HostTensor]) -> Vec<HostTensor> {
    let text = Module::new("test", func).to_text();
    let c = client();
    let exe = c
        .compile(&text, &CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}\n--- program ---\n{text}"));
    let d = &c.devices().unwrap()[0];
    let bufs: Vec<_> = inputs.iter().map(|t| c.to_device(t, d).unwrap()).collect();
    let out = exe.execute(&[bufs.iter().collect()]).unwrap();
    out.into_iter()
        .next()
        .unwrap()
        .iter()
        .map(|b| b.to_host().unwrap())
        .collect()
}

/// Deterministic pseudo-random numbers (xorshift), uniform in [lo, hi).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.next_f64()).collect()
    }
}

/// One input of a gradient check: its shape (f64) and values.
pub struct Input {
    pub dims: Vec<i64>,
    pub values: Vec<f64>,
}

pub fn input(dims: &[i64], values: Vec<f64>) -> Input {
    assert_eq!(values.len() as i64, dims.iter().product::<i64>());
    Input {
        dims: dims.to_vec(),
        values,
    }
}

/// Check the gradient of `build` (inputs -> any f64 tensor) against central finite differences.
/// The scalar differentiated is `sum(build(x) * R)` with a fixed random R, so every output
/// element's cotangent differs. `wrt` lists the inputs to differentiate; `tol` bounds
/// |analytic - numeric| / max(1, |numeric|) for every element.
pub fn check_vjp(
    name: &str,
    inputs: &[Input],
    wrt: &[usize],
    tol: f64,
    build: impl Fn(&mut Builder, &[Value]) -> hlo::Result<Value>,
) {
    check_vjp_eps(name, inputs, wrt, tol, 1e-6, build)
}

/// [`check_vjp`] with a chosen finite-difference step.
pub fn check_vjp_eps(
    name: &str,
    inputs: &[Input],
    wrt: &[usize],
    tol: f64,
    eps: f64,
    build: impl Fn(&mut Builder, &[Value]) -> hlo::Result<Value>,
) {
    let weighted = |b: &mut Builder, params: &[Value]| -> hlo::Result<Value> {
        let y = build(b, params)?;
        let s = b.shape(y).clone();
        assert_eq!(s.dtype, DType::F64, "{name}: build must return f64");
        let r = Rng::new(99).uniform(s.element_count() as usize, -1.0, 1.0);
        let rc = b.constant(hlo::Literal::Float(r), s)?;
        let p = b.mul(y, rc)?;
        b.sum_all(p)
    };
    let host: Vec<HostTensor> = inputs
        .iter()
        .map(|i| HostTensor::from_f64(&i.values, &i.dims))
        .collect();

    // Analytic gradient.
    let mut b = Builder::new("grad");
    let params: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(k, i)| b.param(&format!("x{k}"), Shape::new(&i.dims, DType::F64)))
        .collect();
    let loss = weighted(&mut b, &params).unwrap();
    let wrt_vals: Vec<Value> = wrt.iter().map(|&k| params[k]).collect();
    let grads = b.grad(loss, &wrt_vals).unwrap();
    let mut results = vec![("loss", loss)];
    let names: Vec<String> = (0..grads.len()).map(|k| format!("g{k}")).collect();
    for (k, g) in grads.iter().enumerate() {
        results.push((names[k].as_str(), *g));
    }
    let out = run(b.finish(&results), &host);

    // Numeric gradient: one compiled forward, executed at x +- eps.
    let mut fb = Builder::new("forward");
    let fparams: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(k, i)| fb.param(&format!("x{k}"), Shape::new(&i.dims, DType::F64)))
        .collect();
    let floss = weighted(&mut fb, &fparams).unwrap();
    let text = Module::new("fd", fb.finish(&[("loss", floss)])).to_text();
    let c = client();
    let exe = c.compile(&text, &CompileOptions::default()).unwrap();
    let d = &c.devices().unwrap()[0];
    let eval = |xs: &[HostTensor]| -> f64 {
        let bufs: Vec<_> = xs.iter().map(|t| c.to_device(t, d).unwrap()).collect();
        let o = exe.execute(&[bufs.iter().collect()]).unwrap();
        o[0][0].to_host().unwrap().to_f64().unwrap()[0]
    };
    for (gi, &k) in wrt.iter().enumerate() {
        let analytic = out[1 + gi].to_f64().unwrap();
        assert_eq!(
            analytic.len(),
            inputs[k].values.len(),
            "{name}: gradient {gi} has the wrong size"
        );
        for e in 0..inputs[k].values.len() {
            let mut plus = inputs[k].values.clone();
            plus[e] += eps;
            let mut minus = inputs[k].values.clone();
            minus[e] -= eps;
            let mut xp = host.clone();
            xp[k] = HostTensor::from_f64(&plus, &inputs[k].dims);
            let mut xm = host.clone();
            xm[k] = HostTensor::from_f64(&minus, &inputs[k].dims);
            let numeric = (eval(&xp) - eval(&xm)) / (2.0 * eps);
            let err = (analytic[e] - numeric).abs() / numeric.abs().max(1.0);
            assert!(
                err <= tol,
                "{name}: d/dx{k}[{e}] analytic {} vs numeric {numeric} (error {err:e} > {tol:e})",
                analytic[e]
            );
        }
    }
}

//! This machine's CPU plugin measured for `xtrain plan`'s time model, in a second or so: its
//! matmul rate (the best of three runs of a 1024 x 1024 x 1024 matmul in the step's element
//! type, after one to warm up) and its cost per launched operation (a chain of 128 dependent
//! 16 x 16 matmuls, whose arithmetic is nothing, over the operations its optimized HLO
//! launches, [`crate::device::launches`]). Both are what the plugin gives one program on one
//! device using every core; devices of one CPU share them.

use crate::device::runtime::Runtime;
use anyhow::{Context, Result};
use hlo::{Builder, DType, Module, Shape};
use pjrt::{CompileOptions, HostTensor, OptionValue};
use std::time::Instant;

/// The CPU plugin's measured rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuRates {
    /// Dense matmul throughput, TFLOP/s.
    pub matmul_tflops: f64,
    /// Seconds per launched operation.
    pub per_launch_s: f64,
}

/// Measure the CPU plugin of `rt` (one device) for steps in `dtype`.
pub fn measure_cpu(rt: &Runtime, dtype: DType) -> Result<CpuRates> {
    let n = 1024;
    let (seconds, _) = best_of(rt, &matmul(n, dtype), &[n, n], dtype, 3)?;
    let matmul_tflops = 2.0 * (n as f64).powi(3) / seconds / 1e12;
    let (seconds, launched) = best_of(rt, &chain(16, 128, dtype), &[16, 16], dtype, 3)?;
    let per_launch_s = seconds / launched.max(1.0);
    Ok(CpuRates {
        matmul_tflops,
        per_launch_s,
    })
}

/// `a @ b` over [n, n] operands.
fn matmul(n: i64, dtype: DType) -> String {
    let mut b = Builder::new("main");
    let x = b.param("a", Shape::new(&[n, n], dtype));
    let y = b.param("b", Shape::new(&[n, n], dtype));
    let out = b.matmul(x, y).expect("a square matmul");
    Module::new("xtrain_peak_matmul", b.finish(&[("out", out)])).to_text()
}

/// `((x @ x) @ x) ... @ x`, `depth` matmuls of [n, n] in a row (each waits for the last).
fn chain(n: i64, depth: usize, dtype: DType) -> String {
    let mut b = Builder::new("main");
    let x = b.param("a", Shape::new(&[n, n], dtype));
    let y = b.param("b", Shape::new(&[n, n], dtype));
    let mut acc = x;
    for _ in 0..depth {
        acc = b.matmul(acc, y).expect("a square matmul");
    }
    Module::new("xtrain_peak_chain", b.finish(&[("out", acc)])).to_text()
}

/// The best of `runs` timed runs of `text` (two operands of `dims`, zeros) after one untimed,
/// and how many operations its optimized HLO launches per run.
fn best_of(
    rt: &Runtime,
    text: &str,
    dims: &[i64],
    dtype: DType,
    runs: usize,
) -> Result<(f64, f64)> {
    let dump = crate::device::dumps::DumpDir::new()?;
    let options = CompileOptions::default()
        .with_override(
            "xla_dump_to",
            OptionValue::String(dump.path().to_string_lossy().into()),
        )
        .with_override("xla_dump_hlo_as_text", OptionValue::Bool(true));
    let exe = rt.client.compile(text, &options);
    let optimized = crate::device::absent::aot::read_dump(dump.path()).0;
    drop(dump);
    let exe = exe.context("compiling the CPU plugin's measuring program")?;
    let launched = optimized
        .as_deref()
        .and_then(crate::device::launches::launches)
        .map_or(1.0, |l| l.count);
    let ty = crate::formats::host::element_type(dtype);
    let zeros = HostTensor {
        ty,
        dims: dims.to_vec(),
        bytes: vec![0; ty.byte_size(dims.iter().product::<i64>() as usize)],
    };
    let device = rt.devices.first().context("the CPU plugin has no device")?;
    let a = rt.client.to_device(&zeros, device)?;
    let b = rt.client.to_device(&zeros, device)?;
    let mut best = f64::MAX;
    for k in 0..=runs {
        let t0 = Instant::now();
        let out = exe.execute(&[vec![&a, &b]])?;
        // Reading the result back waits for the run (its bytes are a few KiB to 4 MiB).
        out[0][0].to_host()?;
        if k > 0 {
            best = best.min(t0.elapsed().as_secs_f64());
        }
    }
    Ok((best, launched))
}

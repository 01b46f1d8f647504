//! QLoRA's 4-bit NormalFloat (NF4): weights quantized at load in blocks of 64 with an absmax
//! scale per block, two 4-bit codes per byte; the scales themselves quantized to 8 bits in
//! blocks of 256 (double quantization). The step dequantizes right before each matmul.
//!
//! Bytes per parameter: 0.5 (codes) + 1/64 (8-bit scales) + 4/(64*256) (their f32 scales)
//! + 4/n (one f32 mean) ~= 0.516.

use hlo::{Builder, DType, Literal, Result, Shape, Value};

pub mod encode;
mod format;
pub use encode::NonFinite;
pub use format::{blocks, nearest_code, scale_blocks, Nf4, BLOCK, NF4, SCALE_BLOCK};

/// Quantize `w` (length a multiple of 64) on all cores; a NaN or infinite value is refused
/// (its index is in the error).
pub fn quantize(w: &[f32]) -> std::result::Result<Nf4, NonFinite> {
    assert!(
        w.len().is_multiple_of(BLOCK),
        "NF4 needs a multiple of {BLOCK} values, got {}",
        w.len()
    );
    encode::quantize_with(w.len(), encode::threads(), |b, out| {
        out.copy_from_slice(&w[b * BLOCK..(b + 1) * BLOCK])
    })
}

/// The block scales a quantized tensor decodes with.
pub fn block_scales(q: &Nf4) -> Vec<f32> {
    q.scales
        .iter()
        .enumerate()
        .map(|(i, &c)| c as f32 * (q.scale_absmax[i / SCALE_BLOCK] / 127.0) + q.mean)
        .collect()
}

/// Dequantize on the host (the same arithmetic as the graph).
pub fn dequantize(q: &Nf4) -> Vec<f32> {
    let scales = block_scales(q);
    let mut out = Vec::with_capacity(q.packed.len() * 2);
    for (i, &byte) in q.packed.iter().enumerate() {
        let s = scales[(2 * i) / BLOCK];
        out.push(NF4[(byte >> 4) as usize] * s);
        out.push(NF4[(byte & 15) as usize] * s);
    }
    out
}

/// Dequantize in the graph: (packed u8 [n/2], scales s8 [n/64], scale absmax f32 [n/64/256
/// rounded up], mean f32 []) -> a [dims] tensor of `dtype`.
pub fn dequantize_graph(
    b: &mut Builder,
    parts: &[Value],
    dims: &[i64],
    dtype: DType,
) -> Result<Value> {
    let (packed, scales, scale_absmax, mean) = (parts[0], parts[1], parts[2], parts[3]);
    let half = b.dims(packed)[0];
    let n = half * 2;
    let nb = n / BLOCK as i64;
    let nsb = b.dims(scale_absmax)[0];
    b.scoped("nf4", |b| {
        // codes: high nibble first, then low
        let four = b.full(4.0, Shape::new(&[half], DType::U8));
        let fifteen = b.full(15.0, Shape::new(&[half], DType::U8));
        let hi = b.shift_right_logical(packed, four)?;
        let lo = b.and(packed, fifteen)?;
        let hi = b.reshape(hi, &[half, 1])?;
        let lo = b.reshape(lo, &[half, 1])?;
        let codes = b.concatenate(&[hi, lo], 1)?;
        let codes = b.reshape(codes, &[n])?;
        let codes = b.convert(codes, DType::S32)?;
        let table = b.constant(
            Literal::Float(NF4.iter().map(|&v| v as f64).collect()),
            Shape::new(&[16], DType::F32),
        )?;
        let values = b.take_rows(table, codes)?;
        // block scales: int8 * (absmax of its 256-block / 127) + mean
        let sa = b.broadcast_in_dim(scale_absmax, &[nsb, SCALE_BLOCK as i64], &[0])?;
        let sa = b.reshape(sa, &[nsb * SCALE_BLOCK as i64])?;
        let sa = b.slice_dim(sa, 0, 0, nb)?;
        let sa = b.mul_scalar(sa, 1.0 / 127.0)?;
        let s = b.convert(scales, DType::F32)?;
        let s = b.mul(s, sa)?;
        let m = b.broadcast_in_dim(mean, &[nb], &[])?;
        let s = b.add(s, m)?;
        let values = b.reshape(values, &[nb, BLOCK as i64])?;
        let s = b.broadcast_in_dim(s, &[nb, BLOCK as i64], &[0])?;
        let w = b.mul(values, s)?;
        let w = b.reshape(w, dims)?;
        b.convert(w, dtype)
    })
}

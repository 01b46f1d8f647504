//! Dequantizing ggml's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: super-blocks of 256 values with
//! quantized per-sub-block scales) and Q5_0/Q5_1 (blocks of 32 with a fifth bit per value), the
//! block formats of the GGUF files people hold (a Q4_K_M file mixes Q4_K, Q5_K or Q5_0, Q6_K and
//! Q8_0). Each follows ggml's reference dequantizer value for value: the same layout, the same
//! f32 operations in the same order; `tests/llama_cpp.rs`
//! (`every_block_type_dequantizes_as_llama_cpps_reader_does`) checks each against the `gguf`
//! package's dequantization of the same bytes. The layouts are [`super::ggml::TYPES`]'.

use super::ggml;
use half::f16;

fn h(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Dequantize whole blocks `raw` of type `ggml_type` (Q5_0, Q5_1 or a K-quant) onto `out`.
pub fn dequantize(ggml_type: u32, raw: &[u8], out: &mut Vec<f32>) {
    let blocks = |f: fn(&[u8], &mut Vec<f32>), out: &mut Vec<f32>| {
        let bytes = ggml::layout(ggml_type).expect("a type xtrain reads").bytes;
        raw.chunks_exact(bytes as usize).for_each(|b| f(b, out));
    };
    match ggml_type {
        ggml::Q5_0 => blocks(|b, out| q5(b, false, out), out),
        ggml::Q5_1 => blocks(|b, out| q5(b, true, out), out),
        ggml::Q2_K => blocks(q2_k, out),
        ggml::Q3_K => blocks(q3_k, out),
        ggml::Q4_K => blocks(q4_k, out),
        ggml::Q5_K => blocks(q5_k, out),
        ggml::Q6_K => blocks(q6_k, out),
        other => unreachable!("ggml type {other} is not a K-quant or Q5"),
    }
}

/// Q5_0 (d, 32 high bits, 16 bytes of low nibbles; values q - 16) and Q5_1 (d, m, ...; q d + m).
fn q5(blk: &[u8], with_min: bool, out: &mut Vec<f32>) {
    let d = h(&blk[0..2]);
    let (m, rest) = if with_min {
        (h(&blk[2..4]), &blk[4..])
    } else {
        (0.0, &blk[2..])
    };
    let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let qs = &rest[4..20];
    let value = |j: usize, high: bool| {
        let (low, bit) = if high {
            (qs[j] >> 4, (qh >> (j + 12)) & 0x10)
        } else {
            (qs[j] & 0x0F, ((qh >> j) << 4) & 0x10)
        };
        let q = (low as u32 | bit) as i32;
        if with_min {
            q as f32 * d + m
        } else {
            (q - 16) as f32 * d
        }
    };
    out.extend((0..16).map(|j| value(j, false)));
    out.extend((0..16).map(|j| value(j, true)));
}

/// The 6-bit scale and min of sub-block `j` from a K-quant's 12 packed scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q2_K: 16 scale bytes (scale low nibble, min high nibble), 64 bytes of 2-bit values, d, dmin.
fn q2_k(blk: &[u8], out: &mut Vec<f32>) {
    let (scales, qs) = (&blk[0..16], &blk[16..80]);
    let (d, dmin) = (h(&blk[80..82]), h(&blk[82..84]));
    let mut is = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                out.extend(
                    q[part * 16..part * 16 + 16]
                        .iter()
                        .map(|&b| dl * ((b >> shift) & 3) as f32 - ml),
                );
            }
        }
    }
}

/// Q3_K's sixteen 6-bit scales from its 12 packed bytes.
fn q3_scales(packed: &[u8]) -> [i8; 16] {
    let word = |i: usize| u32::from_le_bytes(packed[i * 4..i * 4 + 4].try_into().unwrap());
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let (m1, m2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let aux = [
        (a0 & m2) | ((tmp & m1) << 4),
        (a1 & m2) | (((tmp >> 2) & m1) << 4),
        ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4),
        ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4),
    ];
    let mut s = [0i8; 16];
    for (i, a) in aux.iter().enumerate() {
        for (k, b) in a.to_le_bytes().iter().enumerate() {
            s[i * 4 + k] = *b as i8;
        }
    }
    s
}

/// Q3_K: 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of scales, d.
fn q3_k(blk: &[u8], out: &mut Vec<f32>) {
    let (hmask, qs) = (&blk[0..32], &blk[32..96]);
    let scales = q3_scales(&blk[96..108]);
    let d = h(&blk[108..110]);
    let (mut is, mut m) = (0, 1u8);
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * (scales[is] as i32 - 32) as f32;
                is += 1;
                let range = part * 16..part * 16 + 16;
                out.extend(q[range.clone()].iter().zip(&hmask[range]).map(|(&b, &hb)| {
                    let low = ((b >> shift) & 3) as i32;
                    dl * (low - if hb & m != 0 { 0 } else { 4 }) as f32
                }));
            }
            m <<= 1;
        }
    }
}

/// Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (per 64 values: 32
/// low nibbles, then the same bytes' high nibbles).
fn q4_k(blk: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (h(&blk[0..2]), h(&blk[2..4]));
    let (scales, qs) = (&blk[4..16], &blk[16..144]);
    for (j, q) in qs.chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * j, scales);
        let (s2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, min1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * s2 as f32, dmin * m2 as f32);
        out.extend(q.iter().map(|&b| d1 * (b & 0xF) as f32 - min1));
        out.extend(q.iter().map(|&b| d2 * (b >> 4) as f32 - min2));
    }
}

/// Q5_K: Q4_K's layout with 32 bytes of fifth bits (two bits of each byte per 64 values).
fn q5_k(blk: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (h(&blk[0..2]), h(&blk[2..4]));
    let (scales, qh, qs) = (&blk[4..16], &blk[16..48], &blk[48..176]);
    for (j, q) in qs.chunks_exact(32).enumerate() {
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let (s1, m1) = scale_min_k4(2 * j, scales);
        let (s2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, min1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * s2 as f32, dmin * m2 as f32);
        let hi = |b: u8, u: u8| if b & u != 0 { 16 } else { 0 };
        out.extend(
            q.iter()
                .zip(qh)
                .map(|(&b, &hb)| d1 * ((b & 0xF) + hi(hb, u1)) as f32 - min1),
        );
        out.extend(
            q.iter()
                .zip(qh)
                .map(|(&b, &hb)| d2 * ((b >> 4) + hi(hb, u2)) as f32 - min2),
        );
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed 8-bit scales, d.
fn q6_k(blk: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
    let d = h(&blk[208..210]);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
        let mut y = [0f32; 128];
        for l in 0..32 {
            let is = l / 16;
            let q =
                |low: u8, shift: u32| ((low | (((qh[l] >> shift) & 3) << 4)) as i32 - 32) as f32;
            y[l] = d * sc[is] as i8 as f32 * q(ql[l] & 0xF, 0);
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q(ql[l + 32] & 0xF, 2);
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q(ql[l] >> 4, 4);
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q(ql[l + 32] >> 4, 6);
        }
        out.extend_from_slice(&y);
    }
}

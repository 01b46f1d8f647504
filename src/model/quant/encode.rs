//! NF4 encoding at memory speed: the same codes and scales as the definition (each value's
//! nearest code, [`super::nearest_code`]; the scales' double quantization), computed without a
//! search and across all cores.
//!
//! A value's code is how many of the 15 thresholds between adjacent codes it exceeds: fifteen
//! compares and adds, the same for every value, which the compiler turns into vector
//! instructions. Each threshold is the largest f32 at or below the exact midpoint of its two
//! codes, so `y > t` holds exactly when `y` is nearer the upper code, and a tie (a value at the
//! exact midpoint) goes to the lower code, as the search does. (Near a midpoint both distances
//! the search computes are exact, by Sterbenz's lemma, so its choice is the exact one there;
//! the unit tests check every value within thousands of ulps of each threshold.) The absmax of a
//! block is the maximum of the values' bits with the sign cleared, which orders finite floats as
//! their magnitudes do and exposes a NaN or infinity in the same pass.
//!
//! Blocks are independent, so the tensor is cut into one run of blocks per core (scoped
//! threads); the double quantization of the block scales (one value per 64) and their mean stay
//! sequential, in the definition's order, so the f32 sum is bit for bit the same.

use super::{Nf4, BLOCK, NF4, SCALE_BLOCK};

/// A NaN or infinite value at `index` of a tensor: NF4 has no code for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NonFinite {
    pub index: usize,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "element {} is NaN or infinite (NF4 has no code for it)",
            self.index
        )
    }
}

impl std::error::Error for NonFinite {}

/// The threads quantization uses: every core the process may run on.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Below this many values a tensor is quantized on one thread (starting threads costs more).
const PARALLEL_FROM: usize = 1 << 16;

/// The 15 thresholds between adjacent codes: the largest f32 at or below each exact midpoint.
pub fn thresholds() -> [f32; 15] {
    let mut t = [0f32; 15];
    for (k, t) in t.iter_mut().enumerate() {
        // Exact: the sum of two f32s fits in an f64's mantissa.
        let mid = (NF4[k] as f64 + NF4[k + 1] as f64) / 2.0;
        let m = mid as f32;
        *t = if m as f64 > mid { m.next_down() } else { m };
    }
    t
}

/// The bits of a block's largest magnitude: at least 0x7f80_0000 when a value is NaN or
/// infinite.
#[inline(always)]
fn absmax_bits(x: &[f32; BLOCK]) -> u32 {
    x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff))
}

/// The codes of a block of finite values whose largest magnitude is `absmax`, two per byte
/// (the even element in the high nibble), into `out` (32 bytes).
#[inline(always)]
fn encode_block(x: &[f32; BLOCK], absmax: f32, t: &[f32; 15], out: &mut [u8]) {
    let inv = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
    let mut y = [0f32; BLOCK];
    for (y, &x) in y.iter_mut().zip(x) {
        *y = x * inv;
    }
    let mut codes = [0u32; BLOCK];
    for &tk in t {
        for (c, &y) in codes.iter_mut().zip(&y) {
            *c += (y > tk) as u32;
        }
    }
    for (c, &y) in codes.iter_mut().zip(&y) {
        // +inf (a block whose absmax is subnormal, so that 1/absmax overflows) is nearer no
        // code than another, and the search keeps code 0, as for NaN.
        if y > f32::MAX {
            *c = 0;
        }
    }
    for (o, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *o = ((pair[0] << 4) | pair[1]) as u8;
    }
}

/// Codes and block absmaxes of blocks `first..first + absmax.len()` (`fill(b, out)` writes block
/// `b`'s values) into `packed` (32 bytes a block) and `absmax`; the first block with a NaN or
/// infinite value, if any (its codes are left unwritten).
fn encode_run(
    first: usize,
    fill: &(impl Fn(usize, &mut [f32; BLOCK]) + Sync),
    t: &[f32; 15],
    packed: &mut [u8],
    absmax: &mut [f32],
) -> Option<usize> {
    let mut x = [0f32; BLOCK];
    for (i, (out, m)) in packed
        .chunks_exact_mut(BLOCK / 2)
        .zip(absmax.iter_mut())
        .enumerate()
    {
        fill(first + i, &mut x);
        let bits = absmax_bits(&x);
        if bits >= 0x7f80_0000 {
            return Some(first + i);
        }
        *m = f32::from_bits(bits);
        encode_block(&x, *m, t, out);
    }
    None
}

/// The codes (`packed`, n/2 bytes) and block absmaxes (`absmax`, n/64) of the `n` values that
/// `fill` gives block by block, on `threads` threads; a NaN or infinite value is refused.
pub fn encode_into(
    n: usize,
    threads: usize,
    fill: impl Fn(usize, &mut [f32; BLOCK]) + Sync,
    packed: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), NonFinite> {
    let blocks = n / BLOCK;
    assert!(n.is_multiple_of(BLOCK) && packed.len() == n / 2 && absmax.len() == blocks);
    let t = thresholds();
    let threads = if n < PARALLEL_FROM { 1 } else { threads.max(1) };
    let per = blocks.div_ceil(threads).max(1);
    let bad = if threads == 1 {
        encode_run(0, &fill, &t, packed, absmax)
    } else {
        std::thread::scope(|s| {
            let runs: Vec<_> = packed
                .chunks_mut(per * BLOCK / 2)
                .zip(absmax.chunks_mut(per))
                .enumerate()
                .map(|(r, (p, m))| {
                    let (fill, t) = (&fill, &t);
                    s.spawn(move || encode_run(r * per, fill, t, p, m))
                })
                .collect();
            runs.into_iter()
                .filter_map(|h| h.join().expect("an NF4 encoding thread panicked"))
                .min()
        })
    };
    match bad {
        None => Ok(()),
        Some(b) => {
            let mut x = [0f32; BLOCK];
            fill(b, &mut x);
            let j = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
            Err(NonFinite {
                index: b * BLOCK + j,
            })
        }
    }
}

/// The double quantization of block scales `absmax` into `scales` (int8, one per block) and
/// `scale_absmax` (one per 256 blocks); returns their mean. The definition's arithmetic in its
/// order.
pub fn double_quantize(absmax: &[f32], scales: &mut [i8], scale_absmax: &mut [f32]) -> f32 {
    let mean = absmax.iter().sum::<f32>() / absmax.len().max(1) as f32;
    for (a, chunk) in scale_absmax.iter_mut().zip(absmax.chunks(SCALE_BLOCK)) {
        *a = chunk.iter().fold(0f32, |m, &s| m.max((s - mean).abs()));
    }
    for (i, (q, &s)) in scales.iter_mut().zip(absmax).enumerate() {
        let a = scale_absmax[i / SCALE_BLOCK];
        *q = if a > 0.0 {
            ((s - mean) / a * 127.0).round().clamp(-127.0, 127.0) as i8
        } else {
            0
        };
    }
    mean
}

/// Quantize the `n` values (a multiple of 64) that `fill` gives block by block, on `threads`
/// threads.
pub fn quantize_with(
    n: usize,
    threads: usize,
    fill: impl Fn(usize, &mut [f32; BLOCK]) + Sync,
) -> Result<Nf4, NonFinite> {
    let blocks = n / BLOCK;
    let mut packed = vec![0u8; n / 2];
    let mut absmax = vec![0f32; blocks];
    encode_into(n, threads, fill, &mut packed, &mut absmax)?;
    let mut scales = vec![0i8; blocks];
    let mut scale_absmax = vec![0f32; super::scale_blocks(n)];
    let mean = double_quantize(&absmax, &mut scales, &mut scale_absmax);
    Ok(Nf4 {
        packed,
        scales,
        scale_absmax,
        mean,
    })
}

#[cfg(test)]
mod tests {
    use super::super::nearest_code;
    use super::*;

    /// The quantizer as it was before this module (one value at a time, searching the codes):
    /// the reference the fast one must equal bit for bit.
    fn reference(w: &[f32]) -> Nf4 {
        let absmax: Vec<f32> = w
            .chunks(BLOCK)
            .map(|b| b.iter().fold(0f32, |m, &x| m.max(x.abs())))
            .collect();
        let mut codes = Vec::with_capacity(w.len());
        for (b, &m) in w.chunks(BLOCK).zip(&absmax) {
            let inv = if m > 0.0 { 1.0 / m } else { 0.0 };
            codes.extend(b.iter().map(|&x| nearest_code(x * inv)));
        }
        let packed = codes.chunks(2).map(|c| (c[0] << 4) | c[1]).collect();
        let mean = absmax.iter().sum::<f32>() / absmax.len().max(1) as f32;
        let centered: Vec<f32> = absmax.iter().map(|&s| s - mean).collect();
        let scale_absmax: Vec<f32> = centered
            .chunks(SCALE_BLOCK)
            .map(|b| b.iter().fold(0f32, |m, &x| m.max(x.abs())))
            .collect();
        let scales = centered
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let a = scale_absmax[i / SCALE_BLOCK];
                if a > 0.0 {
                    (s / a * 127.0).round().clamp(-127.0, 127.0) as i8
                } else {
                    0
                }
            })
            .collect();
        Nf4 {
            packed,
            scales,
            scale_absmax,
            mean,
        }
    }

    fn fast(w: &[f32], threads: usize) -> Nf4 {
        quantize_with(w.len(), threads, |b, out| {
            out.copy_from_slice(&w[b * BLOCK..(b + 1) * BLOCK])
        })
        .unwrap()
    }

    /// Bit-for-bit equality (NaN-safe, -0.0 distinct from 0.0).
    fn assert_identical(w: &[f32], what: &str) {
        let want = reference(w);
        for threads in [1, 3] {
            let got = fast(w, threads);
            assert_eq!(got.packed, want.packed, "{what}: codes ({threads} threads)");
            assert_eq!(
                got.scales, want.scales,
                "{what}: scales ({threads} threads)"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.scale_absmax), bits(&want.scale_absmax), "{what}");
            assert_eq!(got.mean.to_bits(), want.mean.to_bits(), "{what}: mean");
        }
    }

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    #[test]
    fn thresholds_lie_between_their_codes() {
        let t = thresholds();
        for k in 0..15 {
            assert!(
                NF4[k] < t[k] && t[k] < NF4[k + 1],
                "threshold {k}: {}",
                t[k]
            );
            assert_eq!(nearest_code(t[k]), k as u8, "at threshold {k}");
            assert_eq!(nearest_code(t[k].next_up()), k as u8 + 1, "above {k}");
        }
    }

    #[test]
    fn random_tensors_match_the_reference() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        // Blocks of many scales (1e-30 to 1e30), some spanning two scale blocks and a ragged
        // last one, so that threads get uneven runs.
        for blocks in [1usize, 7, 256, 1000, 1100 + 37] {
            let w: Vec<f32> = (0..blocks * BLOCK)
                .map(|i| {
                    let scale = 10f32.powi((i / BLOCK % 61) as i32 - 30);
                    rng.unit() * scale
                })
                .collect();
            assert_identical(&w, &format!("{blocks} random blocks"));
        }
        // Large enough to run on several threads (PARALLEL_FROM values and more).
        let w: Vec<f32> = (0..PARALLEL_FROM * 3 + 64 * 5)
            .map(|_| rng.unit() * 0.02)
            .collect();
        assert_identical(&w, "a tensor split across threads");
    }

    #[test]
    fn adversarial_blocks_match_the_reference() {
        let t = thresholds();
        let mut w: Vec<f32> = Vec::new();
        let mut block = |values: &[f32]| {
            let mut b = values.to_vec();
            b.resize(BLOCK, 0.0);
            w.extend(b);
        };
        block(&[0.0; BLOCK]);
        block(&[-0.0; BLOCK]);
        // With 1.0 (or -1.0) in the block the scaled value is the value itself: every value at
        // and next to each threshold, and the codes themselves.
        for sign in [1.0f32, -1.0] {
            let mut v = vec![sign];
            for &tk in &t {
                v.extend([tk, tk.next_up(), tk.next_down(), -tk, -tk.next_up()]);
            }
            for chunk in v.chunks(BLOCK) {
                block(chunk);
            }
            let mut codes = vec![sign];
            codes.extend(NF4);
            block(&codes);
        }
        // Ties after scaling: midpoints times a power of two (exact) with the absmax scaled too.
        for e in [-20, -3, 0, 7, 40] {
            let s = 2f32.powi(e);
            let mut v = vec![s];
            v.extend(t.iter().map(|&tk| tk * s));
            block(&v);
        }
        // Tiny, subnormal (1/absmax overflows to inf), huge and mixed magnitudes.
        block(&[f32::MIN_POSITIVE, -f32::MIN_POSITIVE / 2.0, 1e-40, 0.0]);
        block(&[1e-45, -1e-45, 0.0, 1e-45]);
        block(&[f32::from_bits(1), f32::from_bits(2), -f32::from_bits(3)]);
        block(&[f32::MAX, -f32::MAX, 1.0, -3e38, 1e-38]);
        block(&[3.4e38, 1e-30, -1e-30, 1.0]);
        block(&[-2.5, 1.25, 0.3125, -0.0, 2.5]);
        assert_identical(&w, "adversarial blocks");
    }

    #[test]
    fn every_value_near_each_threshold_gets_the_searched_code() {
        // Blocks led by 1.0 (scale 1: the scaled value is the value), then 63 probes each.
        let t = thresholds();
        let mut probes = Vec::new();
        for &tk in &t {
            let mut v = tk;
            for _ in 0..4000 {
                v = v.next_down();
            }
            for _ in 0..8000 {
                probes.push(v);
                v = v.next_up();
            }
        }
        let mut w = Vec::new();
        for chunk in probes.chunks(BLOCK - 1) {
            w.push(1.0);
            w.extend_from_slice(chunk);
            w.resize(w.len().next_multiple_of(BLOCK), 0.0);
        }
        assert_identical(&w, "values near the thresholds");
    }

    #[test]
    fn nan_and_infinity_are_refused_with_their_index() {
        let mut w = vec![0.01f32; PARALLEL_FROM * 2];
        w[PARALLEL_FROM + 5] = f32::INFINITY;
        w[PARALLEL_FROM + 70] = f32::NAN;
        let first = |w: &[f32], threads| {
            quantize_with(w.len(), threads, |b, out| {
                out.copy_from_slice(&w[b * BLOCK..(b + 1) * BLOCK])
            })
            .unwrap_err()
            .index
        };
        assert_eq!(first(&w, 1), PARALLEL_FROM + 5);
        assert_eq!(first(&w, 4), PARALLEL_FROM + 5);
        w[3] = f32::NEG_INFINITY;
        assert_eq!(first(&w, 4), 3);
        let tiny = [0.5, f32::NAN].repeat(32);
        assert_eq!(first(&tiny, 2), 1);
    }
}

//! The NF4 format itself: the 16 code values, the block sizes, the quantized tensor's parts and
//! the nearest code by definition. A file of its own so that the encoder and the module's
//! entry points both use it without importing each other.

/// The 16 NF4 code values (QLoRA, Dettmers et al. 2023, Appendix E): quantiles of N(0, 1)
/// normalised to [-1, 1], with an exact zero.
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

pub const BLOCK: usize = 64;
pub const SCALE_BLOCK: usize = 256;

/// A quantized tensor of `n` values.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4 {
    /// Two codes per byte: the even element in the high nibble.
    pub packed: Vec<u8>,
    /// Per block of 64: its absmax, minus `mean`, as int8 of `scale_absmax / 127`.
    pub scales: Vec<i8>,
    /// Per block of 256 scales: their absmax (after subtracting the mean).
    pub scale_absmax: Vec<f32>,
    pub mean: f32,
}

pub fn blocks(n: usize) -> usize {
    n / BLOCK
}

pub fn scale_blocks(n: usize) -> usize {
    blocks(n).div_ceil(SCALE_BLOCK)
}

/// The nearest NF4 code of a value in [-1, 1] (ties to the lower code), by search: the
/// definition [`encode`]'s thresholds are checked against.
pub fn nearest_code(x: f32) -> u8 {
    let mut best = 0;
    for (k, v) in NF4.iter().enumerate().skip(1) {
        if (v - x).abs() < (NF4[best] - x).abs() {
            best = k;
        }
    }
    best as u8
}

//! LoRA dropout's masks, as a function of where an element is in the model and the batch, not of
//! how the batch is laid out on devices.
//!
//! Whether element (row, position, feature) of a projection's input is kept in one step is a
//! hash of integers: the run's seed, the step, the layer, the projection, the row's index in the
//! whole batch, the token's natural position in its row, and the feature. So a sequence split
//! over the mesh's `context` axis (rows in balanced order inside the layers, see
//! `model::context`), a batch split over `data` or `fsdp`, microbatches (`--grad-accum`) and a
//! run resumed onto another mesh all drop the same elements as one device does. (A stateful
//! generator such as `rng_bit_generator` gives the n-th number to the n-th element of the
//! tensor in its layout, so the masks moved with the balanced order.)
//!
//! The hash is MurmurHash3's 32-bit finalizer (`fmix32`), a bijection of u32 with full
//! avalanche, applied to the words one after another (`h = fmix32(h ^ word)`): first the key's
//! words and the projection (once per projection, a scalar), then the row and the position
//! (once per token), then, per element, the token's hash xor the feature's. An element is kept
//! when its 32-bit hash is at least `p x 2^32`.
//!
//! [`Key`] is the layer's key as the program carries it: `tensor<3xui64>` holding the seed,
//! `(step << 20) + layer` and the batch row of the first row this pass sees. [`keeps`] is the
//! same function on the host, which the unit test holds the program to.

use crate::model::lora::Projection;
use hlo::{Builder, CmpDir, DType, Result, Shape, Value};

/// The key's words as the program carries them (see the module docs).
pub const KEY_WORDS: i64 = 3;

/// The hash's starting value (the golden ratio's fraction, as in splitmix).
const START: u32 = 0x9E37_79B9;
/// Domain separators, so that the per-token and per-feature hashes are not the same function.
const TOKENS: u32 = 1;
const FEATURES: u32 = 2;

/// MurmurHash3's finalizer.
pub fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

fn absorb(h: u32, word: u32) -> u32 {
    fmix32(h ^ word)
}

/// The projection's number in the hash (its place in [`Projection::ALL`]).
fn projection_number(t: Projection) -> u32 {
    Projection::ALL
        .iter()
        .position(|&a| a == t)
        .expect("a target") as u32
}

/// The smallest 32-bit hash that is kept at drop probability `p` (in [0, 1)).
pub fn threshold(p: f64) -> u32 {
    (p * 4_294_967_296.0).ceil().min(u32::MAX as f64) as u32
}

/// A layer's key on the host: the run's seed, `(step << 20) + layer`, and the batch row of the
/// first row the pass sees (0 without microbatches).
#[derive(Clone, Copy, Debug)]
pub struct Key {
    pub seed: u64,
    pub step_layer: u64,
    pub first_row: u64,
}

impl Key {
    /// The words the program's key holds for step `step`'s layer `layer`.
    pub fn new(seed: u64, step: u64, layer: u64, first_row: u64) -> Key {
        Key {
            seed,
            step_layer: (step << 20) + layer,
            first_row,
        }
    }
}

/// Whether dropout keeps element `feature` of the input of `target` at `row` (of the pass, as
/// the layers see it) and natural position `position`: the host's form of what [`apply`] builds.
pub fn keeps(key: Key, p: f64, target: Projection, row: u64, position: u64, feature: u64) -> bool {
    let words = [
        key.seed as u32,
        (key.seed >> 32) as u32,
        key.step_layer as u32,
        (key.step_layer >> 32) as u32,
        projection_number(target),
    ];
    let s = words.into_iter().fold(START, absorb);
    let token = absorb(
        absorb(absorb(s, TOKENS), (key.first_row + row) as u32),
        position as u32,
    );
    let feature = absorb(absorb(s, FEATURES), feature as u32);
    fmix32(token ^ feature) >= threshold(p)
}

/// `fmix32` on a u32 tensor.
fn fmix32_graph(b: &mut Builder, h: Value) -> Result<Value> {
    let shape = b.shape(h).clone();
    let mut c = |v: f64| b.full(v, shape.clone());
    let (s16, s13) = (c(16.0), c(13.0));
    let (m1, m2) = (c(0x85EB_CA6B_u32 as f64), c(0xC2B2_AE35_u32 as f64));
    let h = xorshift(b, h, s16)?;
    let h = b.mul(h, m1)?;
    let h = xorshift(b, h, s13)?;
    let h = b.mul(h, m2)?;
    xorshift(b, h, s16)
}

/// `h ^ (h >> by)`.
fn xorshift(b: &mut Builder, h: Value, by: Value) -> Result<Value> {
    let shifted = b.shift_right_logical(h, by)?;
    b.xor(h, shifted)
}

/// `fmix32(h ^ word)` on u32 tensors of one shape.
fn absorb_graph(b: &mut Builder, h: Value, word: Value) -> Result<Value> {
    let x = b.xor(h, word)?;
    fmix32_graph(b, x)
}

/// Word `i` of the key [`KEY_WORDS`] x u64 as two u32 scalars (low, high).
fn key_word(b: &mut Builder, key: Value, i: i64) -> Result<[Value; 2]> {
    let w = b.slice_dim(key, 0, i, i + 1)?;
    let w = b.reshape(w, &[])?;
    let mask = b.scalar(u32::MAX as f64, DType::U64);
    let low = b.and(w, mask)?;
    let thirty_two = b.scalar(32.0, DType::U64);
    let high = b.shift_right_logical(w, thirty_two)?;
    Ok([b.convert(low, DType::U32)?, b.convert(high, DType::U32)?])
}

/// Inverted dropout on a projection's input `x` [B, T, F]: keep each element with probability
/// 1 - p, by [`keeps`], and scale it by 1 / (1 - p). `key` is the layer's [`KEY_WORDS`] x u64
/// key; `positions` [B, T] s32 holds the natural position of each of x's rows (they are in
/// balanced order on a context axis).
pub fn apply(
    b: &mut Builder,
    x: Value,
    p: f64,
    key: Value,
    target: Projection,
    positions: Value,
) -> Result<Value> {
    let dims = b.dims(x).to_vec();
    let (bs, t, f) = (dims[0], dims[1], dims[2]);
    let keep = b.scoped("dropout", |b| {
        // Once per projection: the key's words and the projection.
        let [seed_lo, seed_hi] = key_word(b, key, 0)?;
        let [step_lo, step_hi] = key_word(b, key, 1)?;
        let [first_row, _] = key_word(b, key, 2)?;
        let proj = b.scalar(projection_number(target) as f64, DType::U32);
        let mut s = b.scalar(START as f64, DType::U32);
        for w in [seed_lo, seed_hi, step_lo, step_hi, proj] {
            s = absorb_graph(b, s, w)?;
        }
        // Once per token: its batch row and natural position.
        let tokens = Shape::new(&[bs, t], DType::U32);
        let sep = b.scalar(TOKENS as f64, DType::U32);
        let st = absorb_graph(b, s, sep)?;
        let st = b.broadcast_in_dim(st, &[bs, t], &[])?;
        let rows = b.iota(tokens.clone(), 0)?;
        let first_row = b.broadcast_in_dim(first_row, &[bs, t], &[])?;
        let rows = b.add(rows, first_row)?;
        let h = absorb_graph(b, st, rows)?;
        let pos = b.convert(positions, DType::U32)?;
        let token = absorb_graph(b, h, pos)?;
        // Once per feature.
        let sep = b.scalar(FEATURES as f64, DType::U32);
        let sf = absorb_graph(b, s, sep)?;
        let sf = b.broadcast_in_dim(sf, &[f], &[])?;
        let features = b.iota(Shape::new(&[f], DType::U32), 0)?;
        let feature = absorb_graph(b, sf, features)?;
        // Per element.
        let token = b.broadcast_in_dim(token, &dims, &[0, 1])?;
        let feature = b.broadcast_in_dim(feature, &dims, &[2])?;
        let mixed = b.xor(token, feature)?;
        let h = fmix32_graph(b, mixed)?;
        let thresh = b.full(threshold(p) as f64, Shape::new(&dims, DType::U32));
        b.compare(h, thresh, CmpDir::Ge)
    })?;
    let scaled = b.mul_scalar(x, 1.0 / (1.0 - p))?;
    let zero = b.zeros_like(x);
    b.select(keep, scaled, zero)
}

/// The key of layer `layer` (s32 scalar) from the pass's key: the layer added to the second
/// word, so that a layer draws the same masks when it is recomputed.
pub fn layer_key(b: &mut Builder, key: Value, layer: Value) -> Result<Value> {
    let n = b.dims(key)[0];
    let l = b.convert(layer, DType::U64)?;
    let l = b.reshape(l, &[1])?;
    let before = b.zeros(Shape::new(&[1], DType::U64));
    let mut parts = vec![before, l];
    if n > 2 {
        parts.push(b.zeros(Shape::new(&[n - 2], DType::U64)));
    }
    let offset = b.concatenate(&parts, 0)?;
    b.add(key, offset)
}

/// The pass's key from the step's `dropout_key` (seed, step << 20) and the batch row of the
/// pass's first row (u64 scalar; 0 without microbatches).
pub fn pass_key(b: &mut Builder, step_key: Value, first_row: Value) -> Result<Value> {
    let first_row = b.reshape(first_row, &[1])?;
    b.concatenate(&[step_key, first_row], 0)
}

/// The program's masks against [`keeps`], element by element, on a small input: two rows of
/// four tokens of six features, positions given out of order (as a context split gives them),
/// a key whose words all have high bits, and a first row of 3 (a second microbatch).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::run;
    use pjrt::{ElementType, HostTensor};

    fn u64_tensor(v: &[u64]) -> HostTensor {
        HostTensor {
            ty: ElementType::U64,
            dims: vec![v.len() as i64],
            bytes: v.iter().flat_map(|w| w.to_le_bytes()).collect(),
        }
    }

    #[test]
    fn the_programs_masks_are_the_hash_of_row_position_feature_and_key() {
        let (bs, t, f) = (2i64, 4i64, 6i64);
        let p = 0.3;
        let key = Key::new(0x1234_5678_9ABC_DEF0, 5, 1, 3);
        let positions: Vec<i32> = vec![0, 3, 1, 2, 0, 3, 1, 2];
        for target in [Projection::Q, Projection::Down] {
            let mut b = Builder::new("main");
            let x = b.param("x", Shape::new(&[bs, t, f], DType::F32));
            let k = b.param("key", Shape::new(&[KEY_WORDS], DType::U64));
            let pos = b.param("positions", Shape::new(&[bs, t], DType::S32));
            let y = apply(&mut b, x, p, k, target, pos).unwrap();
            let n = (bs * t * f) as usize;
            let out = run(
                b.finish(&[("y", y)]),
                &[
                    HostTensor::from_f32(&vec![1.0; n], &[bs, t, f]),
                    u64_tensor(&[key.seed, key.step_layer, key.first_row]),
                    HostTensor::from_i32(&positions, &[bs, t]),
                ],
            )[0]
            .to_f32()
            .unwrap();
            for (i, &v) in out.iter().enumerate() {
                let (row, tok, feat) = (i / (t * f) as usize, i / f as usize, i % f as usize);
                let pos = positions[tok] as u64;
                let want = keeps(key, p, target, row as u64, pos, feat as u64);
                let kept_value = (1.0 / (1.0 - p)) as f32;
                assert_eq!(
                    v,
                    if want { kept_value } else { 0.0 },
                    "{target} element {i} (row {row}, position {pos}, feature {feat})"
                );
            }
        }
    }

    /// About 1 - p of the elements are kept, and the masks of two projections, layers, steps,
    /// seeds or rows are not the same (each pair would agree on about p^2 + (1-p)^2 of them).
    #[test]
    fn masks_keep_one_minus_p_and_differ_by_every_input() {
        let p = 0.3;
        let mask = |key: Key, target, row| -> Vec<bool> {
            (0..64)
                .flat_map(|pos| (0..256).map(move |f| keeps(key, p, target, row, pos, f)))
                .collect()
        };
        let base = mask(Key::new(42, 7, 2, 0), Projection::Q, 0);
        let kept = base.iter().filter(|&&k| k).count() as f64 / base.len() as f64;
        assert!((kept - 0.7).abs() < 0.01, "kept {kept}");
        for (what, other) in [
            ("projection", mask(Key::new(42, 7, 2, 0), Projection::K, 0)),
            ("layer", mask(Key::new(42, 7, 3, 0), Projection::Q, 0)),
            ("step", mask(Key::new(42, 8, 2, 0), Projection::Q, 0)),
            ("seed", mask(Key::new(43, 7, 2, 0), Projection::Q, 0)),
            ("row", mask(Key::new(42, 7, 2, 0), Projection::Q, 1)),
            ("first row", mask(Key::new(42, 7, 2, 1), Projection::Q, 0)),
        ] {
            let same =
                base.iter().zip(&other).filter(|(a, b)| a == b).count() as f64 / base.len() as f64;
            assert!((same - 0.58).abs() < 0.02, "{what}: agree on {same}");
        }
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(0.5), 1 << 31);
    }
}

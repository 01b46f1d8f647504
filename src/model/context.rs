//! Context parallelism: the sequence split over the mesh's `context` axis, every activation's
//! sequence dimension sharded, keys and values all-gathered in each layer (small with grouped
//! heads: 8 KV heads on Llama 3.1).
//!
//! Causal attention gives the token at the end of a sequence all the work and the one at its
//! start none, so a plain split would leave the first device idle while the last works. The
//! sequence is cut into 2 x CP chunks of C tokens and device r holds chunks r and 2CP-1-r (the
//! layout of the Llama 3 paper's context parallelism): inside the layers, rows are in this
//! *balanced* order, [chunk 0, chunk 2CP-1, chunk 1, chunk 2CP-2, ...], which the mesh splits
//! into contiguous pieces. Tokens keep their natural positions for RoPE, the causal mask and the
//! documents; the embedding's input is put in balanced order and the last hidden state back in
//! natural order, so the loss (its shift across chunk edges included) and the logits never see
//! the layout.
//!
//! Attention is written per device (`sdy.manual_computation`): each device runs the nested
//! loops of `model::flash` over its two chunks, whose natural indices (r, 2CP-1-r) are an
//! operand cut by the mesh like the rows, against every key (all-gathered before). Device r's
//! chunks see (r + 1) + (2CP - r) key chunks, the same on every device, and the loops pair them
//! so that every trip of every device computes a block at or below the diagonal. Each chunk is
//! padded to whole key blocks inside the step, so the block stays the one asked for whatever
//! the chunk's length. The keys' gradients each device computes are summed over the devices.

use crate::model::flash::{self, Chunks, Cuts, KeySum, PerDevice};
use crate::model::forward::{Numerics, Placement, Saves};
use hlo::{Builder, DType, Result, Shape, Value};

/// The natural chunk index at each place of the balanced order: 0, 2CP-1, 1, 2CP-2, ...
fn balanced_chunks(cp: i64) -> Vec<i64> {
    (0..cp).flat_map(|r| [r, 2 * cp - 1 - r]).collect()
}

/// `x` [B, T, ...] with its rows in balanced order (T divisible by 2 x `cp`).
pub fn to_balanced(b: &mut Builder, x: Value, cp: i64) -> Result<Value> {
    let c = b.dims(x)[1] / (2 * cp);
    let parts = balanced_chunks(cp)
        .into_iter()
        .map(|k| b.slice_dim(x, 1, k * c, (k + 1) * c))
        .collect::<Result<Vec<_>>>()?;
    b.concatenate(&parts, 1)
}

/// `x` [B, T, ...] in balanced order back in natural order.
pub fn to_natural(b: &mut Builder, x: Value, cp: i64) -> Result<Value> {
    let c = b.dims(x)[1] / (2 * cp);
    let order = balanced_chunks(cp);
    let parts = (0..2 * cp)
        .map(|k| {
            let at = order.iter().position(|&o| o == k).expect("every chunk") as i64;
            b.slice_dim(x, 1, at * c, (at + 1) * c)
        })
        .collect::<Result<Vec<_>>>()?;
    b.concatenate(&parts, 1)
}

/// The key/value block of the context form: the requested size, at most a chunk of
/// C = T / 2CP tokens (each chunk is padded to whole blocks).
pub fn key_block(t: i64, cp: i64, requested: i64) -> i64 {
    requested.clamp(1, (t / (2 * cp)).max(1))
}

/// The [`flash::LSE`] save point's shape in the context form: [B, KV, 2CP, Cp, G] f32, every device's
/// two chunks padded to whole blocks of `tb`.
pub fn lse_shape(bs: i64, t: i64, cp: i64, kv_heads: i64, groups: i64, tb: i64) -> Shape {
    let c = flash::padded(t / (2 * cp), tb);
    Shape::new(&[bs, kv_heads, 2 * cp, c, groups], DType::F32)
}

/// Trips of each of a layer's attention loop nests for `t` tokens over `cp` devices and a
/// requested key block (what a cost model that counts a loop body once leaves out).
pub fn loop_trips(t: i64, cp: i64, requested: i64) -> i64 {
    let tb = key_block(t, cp, requested);
    let nb = flash::padded(t / (2 * cp), tb) / tb;
    flash::nest_trips(nb, 2 * cp * nb)
}

/// Causal attention over the context axis: q [B, T, KV, G, D] and k, v [B, T, KV, D] in balanced
/// order (sharded over the sequence), `doc_starts` [B, T] in balanced order (-1 for padding);
/// the rule of `model::attention::attend`. Returns [B, T, KV x G x D] in balanced order after the
/// save points `out_point` and [`flash::LSE`]. What it adds to `model::flash`'s per-device
/// attention: the keys gathered to every device, and their gradients summed over the devices.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    doc_starts: Value,
    (cp, tb): (i64, i64),
    num: Numerics,
    saves: (&str, &mut Saves),
    placement: &dyn Placement,
) -> Result<Value> {
    let qd = b.dims(q).to_vec();
    let dims = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    let t = dims.1;
    let cuts = Cuts::of(placement, dims, "length");
    // Every device gets every key and value (the all-gather), in natural order.
    let gathered = |b: &mut Builder, x: Value| -> Result<Value> {
        let x = b.sharding_constraint(x, cuts.kv.clone())?;
        to_natural(b, x, cp)
    };
    let k = gathered(b, k)?;
    let v = gathered(b, v)?;
    let zero = b.zeros(b.shape(doc_starts).clone());
    let query_docs = b.max(doc_starts, zero)?;
    let key_docs = to_natural(b, doc_starts, cp)?;
    let wiring = PerDevice {
        ch: Chunks::new(2 * cp, t / (2 * cp), tb, dims.4, num),
        cuts: Some(cuts),
        chunk_ids: balanced_chunks(cp),
        dims,
        padding_cut: false,
        key_sum: Some(KeySum {
            share: key_share,
            sum: sum_of_shares,
        }),
    };
    wiring.attend(b, [q, k, v, query_docs, key_docs], saves)
}

/// This device's share of every key's gradient, one row of [B, CP, T, KV, D].
fn key_share(b: &mut Builder, x: Value) -> Result<Value> {
    let mut dims = b.dims(x).to_vec();
    dims.insert(1, 1);
    b.reshape(x, &dims)
}

/// The keys' gradients: every device's share added up.
fn sum_of_shares(b: &mut Builder, x: Value) -> Result<Value> {
    b.reduce_sum(x, &[1])
}

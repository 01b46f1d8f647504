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
//! Attention runs over key/value blocks of TB tokens with the flash recurrence, as on one
//! device (`model::flash`), in one loop that every device runs the same number of times. Device
//! r's first chunk sees key chunks 0..=r and its second 0..=2CP-1-r: 2CP + 1 key chunks in all
//! on every device, so the loop visits (2CP + 1) x C / TB key blocks, each with every query
//! block of the chunk it serves: first the keys of chunk r's queries, then those of chunk
//! 2CP-1-r's. Which chunk and key block a visit serves differs by device, so those indices are
//! vectors over the context dimension [CP], and the key block is gathered from the all-gathered
//! keys by them. The work above the diagonal inside a query chunk's own key chunk is masked,
//! not skipped: 1 key chunk in 2CP + 1.

use crate::model::flash::LSE;
use crate::model::forward::{mask_scores, Numerics, Placement, Saves};
use hlo::{Builder, CmpDir, DType, DotDims, Precision, Result, Shape, Value};
use std::rc::Rc;

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

/// The key/value block of the context form: the largest size that divides both the chunk of
/// C = T / 2CP tokens and the requested block.
pub fn key_block(t: i64, cp: i64, requested: i64) -> i64 {
    let (mut a, mut c) = (t / (2 * cp), requested.max(1));
    while c != 0 {
        (a, c) = (c, a % c);
    }
    a
}

/// The [`LSE`] save point's shape in the context form: [B, CP, 2, KV, C, G] f32.
pub fn lse_shape(bs: i64, t: i64, cp: i64, kv_heads: i64, groups: i64) -> Shape {
    Shape::new(&[bs, cp, 2, kv_heads, t / (2 * cp), groups], DType::F32)
}

/// The sizes the loops share.
#[derive(Clone, Copy)]
struct Grid {
    cp: i64,
    /// Tokens per chunk, per key block, blocks per chunk, key blocks in the sequence.
    c: i64,
    tb: i64,
    nbc: i64,
    nk: i64,
    d: i64,
    num: Numerics,
}

impl Grid {
    /// Key-block visits per device: 2CP + 1 chunks' worth.
    fn visits(&self) -> i64 {
        (2 * self.cp + 1) * self.nbc
    }

    /// Trips of each attention loop.
    fn trips(&self) -> i64 {
        trips(self.cp, self.nbc)
    }
}

/// Trips of each attention loop over `cp` devices with `nbc` key blocks per chunk: every visit
/// ((2CP + 1) x NBc of them) with each query block of a chunk.
fn trips(cp: i64, nbc: i64) -> i64 {
    (2 * cp + 1) * nbc * nbc
}

/// Trips of each of a layer's attention loops for `t` tokens over `cp` devices and a requested
/// key block (what a cost model that counts a loop body once leaves out).
pub fn loop_trips(t: i64, cp: i64, requested: i64) -> i64 {
    trips(cp, t / (2 * cp) / key_block(t, cp, requested))
}

/// Pins values to the mesh by logical axis names (nothing where the mesh splits nothing).
struct Pin<'a>(&'a dyn Placement);

impl Pin<'_> {
    fn pin(&self, b: &mut Builder, x: Value, logical: &[&str]) -> Result<Value> {
        let s = self.0.place(logical, b.dims(x));
        if s.is_replicated() {
            return Ok(x);
        }
        b.sharding_constraint(x, s)
    }
}

/// Causal attention over the context axis: q [B, T, KV, G, D] and k, v [B, T, KV, D] in balanced
/// order (sharded over the sequence), `doc_starts` [B, T] in balanced order (-1 for padding);
/// the rule of `model::llama::attend`. Returns [B, T, KV x G x D] in balanced order after the
/// save points `out_point` and [`LSE`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    doc_starts: Value,
    (cp, tb): (i64, i64),
    num: Numerics,
    (out_point, saves): (&str, &mut Saves),
    placement: &dyn Placement,
) -> Result<Value> {
    let pin = Pin(placement);
    let qd = b.dims(q).to_vec();
    let (bs, t, kvh, g, d) = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    let c = t / (2 * cp);
    let grid = Grid {
        cp,
        c,
        tb,
        nbc: c / tb,
        nk: t / tb,
        d,
        num,
    };
    // Every device gets every key and value (the all-gather), in natural order.
    let gathered = |b: &mut Builder, x: Value| -> Result<Value> {
        let x = pin.pin(b, x, &["batch", "none", "kv_heads", "none"])?;
        to_natural(b, x, cp)
    };
    let k = gathered(b, k)?;
    let v = gathered(b, v)?;
    let zero = b.zeros(b.shape(doc_starts).clone());
    let query_docs = b.max(doc_starts, zero)?;
    let key_docs = to_natural(b, doc_starts, cp)?;
    let (out, lse) = forward_loop(b, [q, k, v], (query_docs, key_docs), grid, &pin)?;
    let out = b.transpose(out, &[0, 1, 2, 4, 3, 5, 6])?;
    let out = b.reshape(out, &[bs, t, kvh * g * d])?;
    let out = pin.pin(b, out, &["batch", "length", "none"])?;
    let out = saves.point(b, out_point, out)?;
    let lse = saves.point(b, LSE, lse)?;
    let visits = grid.visits();
    let places = ContextPlaces::of(
        placement,
        &[
            (&Q_AXES, vec![bs, cp, 2, c, kvh, g, d]),
            (&QDOCS_AXES, vec![bs, cp, 2, c]),
            (&ACC_AXES, vec![bs, cp, 2, kvh, c, g, d]),
            (&VISIT_AXES, vec![bs, cp, visits, tb, kvh, d]),
        ],
    );
    let rule: hlo::VjpRule =
        Rc::new(move |b, ins, outs, cts| backward(b, ins, outs, cts, grid, &places));
    let outs = b.custom_vjp(&[q, k, v, query_docs, key_docs], &[out, lse], rule);
    Ok(outs[0])
}

/// Logical axes of the queries [B, CP, 2, C, KV, G, D], their document starts [B, CP, 2, C],
/// the row accumulators [B, CP, 2, KV, C, G, (D)] and the per-visit key gradients
/// [B, CP, V, TB, KV, D].
const Q_AXES: [&str; 7] = [
    "batch", "length", "none", "none", "kv_heads", "none", "none",
];
const QDOCS_AXES: [&str; 4] = ["batch", "length", "none", "none"];
const ROW_AXES: [&str; 6] = ["batch", "length", "none", "kv_heads", "none", "none"];
const ACC_AXES: [&str; 7] = [
    "batch", "length", "none", "kv_heads", "none", "none", "none",
];
const VISIT_AXES: [&str; 6] = ["batch", "length", "none", "none", "kv_heads", "none"];

/// The shardings the backward rule pins with, taken from the placement while it is at hand
/// (the rule outlives it): by logical axes and dims.
struct ContextPlaces(Vec<(Vec<&'static str>, Vec<i64>, hlo::Sharding)>);

impl ContextPlaces {
    fn of(p: &dyn Placement, wanted: &[(&[&'static str], Vec<i64>)]) -> ContextPlaces {
        ContextPlaces(
            wanted
                .iter()
                .map(|(l, d)| (l.to_vec(), d.clone(), p.place(l, d)))
                .collect(),
        )
    }
}

impl Placement for ContextPlaces {
    fn place(&self, logical: &[&str], dims: &[i64]) -> hlo::Sharding {
        self.0
            .iter()
            .find(|(l, ds, _)| l == logical && ds == dims)
            .map(|(_, _, s)| s.clone())
            .unwrap_or_else(|| hlo::Sharding {
                dims: vec![Vec::new(); dims.len()],
            })
    }
}

/// What a visit `n` (s32 scalar) means on each device: (whether it serves the device's second
/// query chunk, [CP] pred; the key block it visits, [CP] s32; the natural chunk index of the
/// query chunk it serves, [CP] s32).
fn visit(b: &mut Builder, n: Value, grid: Grid) -> Result<(Value, Value, Value)> {
    let cp = grid.cp;
    let vec = Shape::new(&[cp], DType::S32);
    let r = b.iota(vec.clone(), 0)?;
    let ones = b.full(1.0, vec.clone());
    let nbc = b.full(grid.nbc as f64, vec.clone());
    let r1 = b.add(r, ones)?;
    let first = b.mul(r1, nbc)?;
    let n = b.broadcast_in_dim(n, &[cp], &[])?;
    let second = b.compare(n, first, CmpDir::Ge)?;
    let later = b.sub(n, first)?;
    let key = b.select(second, later, n)?;
    let last = b.full((2 * cp - 1) as f64, vec);
    let mirrored = b.sub(last, r)?;
    let chunk = b.select(second, mirrored, r)?;
    Ok((second, key, chunk))
}

/// `all` [B, CP, 2, ...] at the chunk each device's `second` [CP] picks: [B, CP, ...].
fn pick(b: &mut Builder, all: Value, second: Value) -> Result<Value> {
    let dims = b.dims(all).to_vec();
    let mut one = dims.clone();
    one.remove(2);
    let first = b.slice_dim(all, 2, 0, 1)?;
    let first = b.reshape(first, &one)?;
    let other = b.slice_dim(all, 2, 1, 2)?;
    let other = b.reshape(other, &one)?;
    let which = b.broadcast_in_dim(second, &one, &[1])?;
    b.select(which, other, first)
}

/// `all` [B, CP, 2, ...] with `new` [B, CP, ...] in place of the chunk each device's `second`
/// picks.
fn put(b: &mut Builder, all: Value, new: Value, second: Value) -> Result<Value> {
    let dims = b.dims(all).to_vec();
    let rest: Vec<i64> = (0..dims.len() as i64).filter(|&i| i != 2).collect();
    let wide = b.broadcast_in_dim(new, &dims, &rest)?;
    let chunk = b.iota(Shape::new(&dims, DType::S32), 2)?;
    let second = b.convert(second, DType::S32)?;
    let second = b.broadcast_in_dim(second, &dims, &[1])?;
    let here = b.compare(chunk, second, CmpDir::Eq)?;
    b.select(here, wide, all)
}

/// `x`'s rows `u * TB ..` along `dim`, TB of them (s32 scalar `u`).
fn rows(b: &mut Builder, x: Value, dim: usize, u: Value, tb: i64) -> Result<Value> {
    let starts = starts_at(b, b.rank(x), dim, u, tb)?;
    let mut sizes = b.dims(x).to_vec();
    sizes[dim] = tb;
    b.dynamic_slice(x, &starts, &sizes)
}

fn starts_at(b: &mut Builder, rank: usize, dim: usize, u: Value, tb: i64) -> Result<Vec<Value>> {
    let zero = b.scalar(0.0, DType::S32);
    let size = b.scalar(tb as f64, DType::S32);
    let at = b.mul(u, size)?;
    Ok((0..rank)
        .map(|r| if r == dim { at } else { zero })
        .collect())
}

/// `x` with `rows` written at `u * TB ..` along `dim`.
fn put_rows(b: &mut Builder, x: Value, new: Value, dim: usize, u: Value, tb: i64) -> Result<Value> {
    let starts = starts_at(b, b.rank(x), dim, u, tb)?;
    b.dynamic_update_slice(x, new, &starts)
}

/// The loop's invariants: queries [B, CP, 2, C, KV, G, D] and their document starts
/// [B, CP, 2, C]; keys and values by block [NK, B, TB, KV, D] and their document starts
/// [NK, B, TB].
struct Tables {
    q: Value,
    query_docs: Value,
    k: Value,
    v: Value,
    key_docs: Value,
}

fn tables(
    b: &mut Builder,
    [q, k, v]: [Value; 3],
    (query_docs, key_docs): (Value, Value),
    grid: Grid,
    pin: &Pin,
) -> Result<Tables> {
    let qd = b.dims(q).to_vec();
    let (bs, kvh, g, d) = (qd[0], qd[2], qd[3], qd[4]);
    let (cp, c, tb, nk) = (grid.cp, grid.c, grid.tb, grid.nk);
    let q = b.reshape(q, &[bs, cp, 2, c, kvh, g, d])?;
    let q = pin.pin(b, q, &Q_AXES)?;
    let query_docs = b.reshape(query_docs, &[bs, cp, 2, c])?;
    let query_docs = pin.pin(b, query_docs, &QDOCS_AXES)?;
    let by_block = |b: &mut Builder, x: Value| -> Result<Value> {
        let mut dims = b.dims(x).to_vec();
        dims.splice(1..2, [nk, tb]);
        let x = b.reshape(x, &dims)?;
        let mut perm: Vec<i64> = (0..dims.len() as i64).collect();
        perm.swap(0, 1);
        b.transpose(x, &perm)
    };
    Ok(Tables {
        q,
        query_docs,
        k: by_block(b, k)?,
        v: by_block(b, v)?,
        key_docs: by_block(b, key_docs)?,
    })
}

fn unpack(inv: &[Value]) -> Tables {
    Tables {
        q: inv[0],
        query_docs: inv[1],
        k: inv[2],
        v: inv[3],
        key_docs: inv[4],
    }
}

/// One visit's blocks: (q [B, CP, TB, KV, G, D], k and v [B, CP, TB, KV, D], the query and key
/// document starts [B, CP, TB]) for query block `u` of each device's chunk `second` and key
/// block `key` [CP].
fn visit_blocks(
    b: &mut Builder,
    t: &Tables,
    (second, key, u): (Value, Value, Value),
    tb: i64,
) -> Result<[Value; 5]> {
    let q = rows(b, t.q, 3, u, tb)?;
    let q = pick(b, q, second)?;
    let qdocs = rows(b, t.query_docs, 3, u, tb)?;
    let qdocs = pick(b, qdocs, second)?;
    // [CP, B, ...] gathered by each device's key block, then [B, CP, ...]
    let take = |b: &mut Builder, table: Value| -> Result<Value> {
        let x = b.take_rows(table, key)?;
        let mut perm: Vec<i64> = (0..b.rank(x) as i64).collect();
        perm.swap(0, 1);
        b.transpose(x, &perm)
    };
    Ok([q, take(b, t.k)?, take(b, t.v)?, qdocs, take(b, t.key_docs)?])
}

/// The masked scores of a visit, f32 [B, CP, KV, TB, G, TB]: natural positions from the query
/// chunk and block and the key block, the lowest f32 where the key is later than the query or
/// outside its document.
#[allow(clippy::too_many_arguments)]
fn visit_scores(
    b: &mut Builder,
    [q, k, qdocs, kdocs]: [Value; 4],
    (chunk, key, u): (Value, Value, Value),
    grid: Grid,
) -> Result<Value> {
    let dims = DotDims {
        lhs_batch: vec![0, 1, 3],
        rhs_batch: vec![0, 1, 3],
        lhs_contract: vec![5],
        rhs_contract: vec![4],
    };
    let scores = b.dot_general(q, k, dims, None, Some(grid.num.scores))?;
    let scores = b.convert(scores, DType::F32)?;
    let scores = b.mul_scalar(scores, 1.0 / (grid.d as f64).sqrt())?;
    let (cp, tb) = (grid.cp, grid.tb);
    let square = [cp, tb, tb];
    // Natural positions [CP, TB, TB] of the queries (dim 1) and the keys (dim 2).
    let position = |b: &mut Builder, start: Value, dim: i64| -> Result<Value> {
        let at = b.iota(Shape::new(&square, DType::S32), dim)?;
        let start = b.broadcast_in_dim(start, &square, &[0])?;
        b.add(at, start)
    };
    let vec = Shape::new(&[cp], DType::S32);
    let c = b.full(grid.c as f64, vec.clone());
    let tbv = b.full(tb as f64, vec);
    let chunk_start = b.mul(chunk, c)?;
    let u = b.broadcast_in_dim(u, &[cp], &[])?;
    let u_start = b.mul(u, tbv)?;
    let q_start = b.add(chunk_start, u_start)?;
    let k_start = b.mul(key, tbv)?;
    let q_pos = position(b, q_start, 1)?;
    let k_pos = position(b, k_start, 2)?;
    mask_scores(b, scores, (q_pos, k_pos), (qdocs, kdocs), &[0, 1, 3, 5])
}

/// The visit and query block of loop step `s`: (n, u) = (s / NBc, s % NBc).
fn step_of(b: &mut Builder, s: Value, nbc: i64) -> Result<(Value, Value)> {
    let per = b.scalar(nbc as f64, DType::S32);
    Ok((b.div(s, per)?, b.rem(s, per)?))
}

/// The forward loop: (out [B, CP, 2, KV, C, G, D] in the compute type, lse [B, CP, 2, KV, C, G]).
fn forward_loop(
    b: &mut Builder,
    qkv: [Value; 3],
    docs: (Value, Value),
    grid: Grid,
    pin: &Pin,
) -> Result<(Value, Value)> {
    let t = tables(b, qkv, docs, grid, pin)?;
    let qd = b.dims(t.q).to_vec();
    let (bs, cp, c, kvh, g, d) = (qd[0], qd[1], qd[3], qd[4], qd[5], qd[6]);
    let rows_dims = [bs, cp, 2, kvh, c, g];
    let (row_axes, acc_axes) = (ROW_AXES, ACC_AXES);
    let lowest = b.full(f32::MIN as f64, Shape::new(&rows_dims, DType::F32));
    let init = [
        pin.pin(b, lowest, &row_axes)?,
        {
            let z = b.zeros(Shape::new(&rows_dims, DType::F32));
            pin.pin(b, z, &row_axes)?
        },
        {
            let z = b.zeros(Shape::new(&[bs, cp, 2, kvh, c, g, d], DType::F32));
            pin.pin(b, z, &acc_axes)?
        },
    ];
    let invariants = [t.q, t.query_docs, t.k, t.v, t.key_docs];
    let out = b.scoped("context_blocks", |b| {
        b.rolled_fori_loop(grid.trips(), &init, &invariants, |b, s, carry, inv| {
            forward_visit(b, s, carry, inv, grid)
        })
    })?;
    let (m, l, acc) = (out[0], out[1], out[2]);
    let ad = b.dims(acc).to_vec();
    let l_wide = b.broadcast_in_dim(l, &ad, &[0, 1, 2, 3, 4, 5])?;
    let o = b.div(acc, l_wide)?;
    let o = b.convert(o, grid.num.compute)?;
    let log_l = b.log(l)?;
    let lse = b.add(m, log_l)?;
    Ok((o, lse))
}

/// The gradient rule of [`attend`]: inputs (q, k, v, query starts, key starts), outputs (out
/// [B, T, heads x D] balanced, lse), their cotangents; the cotangents of q (balanced), k and
/// v (natural order, every device's share summed).
fn backward(
    b: &mut Builder,
    ins: &[Value],
    outs: &[Value],
    cts: &[Option<Value>],
    grid: Grid,
    places: &ContextPlaces,
) -> Result<Vec<Option<Value>>> {
    let Some(dout) = cts[0] else {
        return Ok(vec![None; ins.len()]);
    };
    let pin = Pin(places);
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let qd = b.dims(q).to_vec();
    let (bs, t, kvh, g, d) = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    let (cp, c, tb, nk) = (grid.cp, grid.c, grid.tb, grid.nk);
    let tab = tables(b, [q, k, v], (ins[3], ins[4]), grid, &pin)?;
    // out and dout as [B, CP, 2, KV, C, G, D]
    let rows_major = |b: &mut Builder, x: Value| -> Result<Value> {
        let x = b.reshape(x, &[bs, cp, 2, c, kvh, g, d])?;
        b.transpose(x, &[0, 1, 2, 4, 3, 5, 6])
    };
    let out = rows_major(b, outs[0])?;
    let dout = rows_major(b, dout)?;
    let delta = b.scoped("context_blocks.delta", |b| {
        let o = b.convert(out, DType::F32)?;
        let dof = b.convert(dout, DType::F32)?;
        let prod = b.mul(o, dof)?;
        b.reduce_sum(prod, &[6])
    })?;
    let visits = grid.visits();
    let dq0 = b.zeros(Shape::new(&[bs, cp, 2, kvh, c, g, d], DType::F32));
    let dkv0 = b.zeros(Shape::new(&[bs, cp, visits, tb, kvh, d], DType::F32));
    let init = [
        pin.pin(b, dq0, &ACC_AXES)?,
        pin.pin(b, dkv0, &VISIT_AXES)?,
        pin.pin(b, dkv0, &VISIT_AXES)?,
    ];
    let invariants = [
        tab.q,
        tab.query_docs,
        tab.k,
        tab.v,
        tab.key_docs,
        dout,
        outs[1],
        delta,
    ];
    let grads = b.scoped("context_blocks.grad", |b| {
        b.rolled_fori_loop(grid.trips(), &init, &invariants, |b, s, carry, inv| {
            backward_visit(b, s, carry, inv, grid)
        })
    })?;
    let dq = b.transpose(grads[0], &[0, 1, 2, 4, 3, 5, 6])?;
    let dq = b.reshape(dq, &[bs, t, kvh, g, d])?;
    let dq = b.convert(dq, b.dtype(q))?;
    let natural = |b: &mut Builder, visits_of: Value, like: Value| -> Result<Value> {
        let x = keys_of_visits(b, visits_of, grid)?;
        let x = b.reshape(x, &[nk, bs, tb, kvh, d])?;
        let x = b.transpose(x, &[1, 0, 2, 3, 4])?;
        let x = b.reshape(x, &[bs, t, kvh, d])?;
        b.convert(x, b.dtype(like))
    };
    Ok(vec![
        Some(dq),
        Some(natural(b, grads[1], k)?),
        Some(natural(b, grads[2], v)?),
        None,
        None,
    ])
}

/// Per-visit key gradients [B, CP, V, TB, KV, D] summed by the key block each visit served, on
/// each device and then over the devices: [NK, B x TB x KV x D]. On device r visit n served key
/// block n (n < (r + 1) NBc) or n - (r + 1) NBc: a 0/1 matrix [CP, NK, V] per device, applied
/// exactly (f32 at the highest precision: its sums only add zeros).
fn keys_of_visits(b: &mut Builder, per_visit: Value, grid: Grid) -> Result<Value> {
    let dims = b.dims(per_visit).to_vec();
    let (bs, cp, visits) = (dims[0], dims[1], dims[2]);
    let width: i64 = dims[3..].iter().product();
    let x = b.reshape(per_visit, &[bs, cp, visits, width])?;
    let grid_shape = Shape::new(&[cp, grid.nk, visits], DType::S32);
    let r = b.iota(grid_shape.clone(), 0)?;
    let key = b.iota(grid_shape.clone(), 1)?;
    let n = b.iota(grid_shape.clone(), 2)?;
    let ones = b.full(1.0, grid_shape.clone());
    let nbc = b.full(grid.nbc as f64, grid_shape);
    let r1 = b.add(r, ones)?;
    let first = b.mul(r1, nbc)?;
    let own = b.compare(n, key, CmpDir::Eq)?;
    let early = b.compare(n, first, CmpDir::Lt)?;
    let own = b.and(own, early)?;
    let shifted = b.add(first, key)?;
    let mirrored = b.compare(n, shifted, CmpDir::Eq)?;
    let hit = b.or(own, mirrored)?;
    let hit = b.convert(hit, DType::F32)?;
    let dims = DotDims {
        lhs_batch: vec![0],
        rhs_batch: vec![1],
        lhs_contract: vec![2],
        rhs_contract: vec![2],
    };
    // [CP, NK, B, width], summed over the devices
    let per_device = b.dot_general(hit, x, dims, Some(Precision::Highest), Some(DType::F32))?;
    let summed = b.reduce_sum(per_device, &[0])?;
    b.reshape(summed, &[grid.nk, bs * width])
}

/// One step `s` of the backward loop: the visit's query block adds its share to dq (carry[0])
/// and the visited key block's to this visit's slot of dk and dv (carry[1], carry[2]);
/// invariants (the tables, dout, lse, delta).
fn backward_visit(
    b: &mut Builder,
    s: Value,
    carry: &[Value],
    inv: &[Value],
    grid: Grid,
) -> Result<Vec<Value>> {
    let (tb, nbc) = (grid.tb, grid.nbc);
    let dims = b.dims(carry[0]).to_vec();
    let (bs, cp, kvh, d) = (dims[0], dims[1], dims[3], dims[6]);
    let (n, u) = step_of(b, s, nbc)?;
    let (second, key, chunk) = visit(b, n, grid)?;
    let [qb, kb, vb, qdocs, kdocs] = visit_blocks(b, &unpack(inv), (second, key, u), tb)?;
    let block = |b: &mut Builder, all: Value| -> Result<Value> {
        let r = rows(b, all, 4, u, tb)?;
        pick(b, r, second)
    };
    let dout_b = block(b, inv[5])?;
    let lse_b = block(b, inv[6])?;
    let delta_b = block(b, inv[7])?;
    let s = visit_scores(b, [qb, kb, qdocs, kdocs], (chunk, key, u), grid)?;
    let sd = b.dims(s).to_vec();
    let keep = [0, 1, 2, 3, 4];
    let lse_wide = b.broadcast_in_dim(lse_b, &sd, &keep)?;
    let shifted = b.sub(s, lse_wide)?;
    let probs = b.exp(shifted)?;
    let compute = grid.num.compute;
    let probs_c = b.convert(probs, compute)?;
    // dv of the visited key block: p^T dout, over the queries and their group heads
    let over_queries = DotDims {
        lhs_batch: vec![0, 1, 2],
        rhs_batch: vec![0, 1, 2],
        lhs_contract: vec![3, 4],
        rhs_contract: vec![3, 4],
    };
    let dv_b = b.dot_general(probs_c, dout_b, over_queries, None, Some(DType::F32))?;
    let dims = DotDims {
        lhs_batch: vec![0, 1, 2],
        rhs_batch: vec![0, 1, 3],
        lhs_contract: vec![5],
        rhs_contract: vec![4],
    };
    let dprobs = b.dot_general(dout_b, vb, dims, None, Some(DType::F32))?;
    let delta_wide = b.broadcast_in_dim(delta_b, &sd, &keep)?;
    let centered = b.sub(dprobs, delta_wide)?;
    let ds = b.mul(probs, centered)?;
    let ds = b.mul_scalar(ds, 1.0 / (grid.d as f64).sqrt())?;
    let ds = b.convert(ds, compute)?;
    let dims = DotDims {
        lhs_batch: vec![0, 1, 2],
        rhs_batch: vec![0, 1, 3],
        lhs_contract: vec![5],
        rhs_contract: vec![2],
    };
    let dq_b = b.dot_general(ds, kb, dims, None, Some(DType::F32))?;
    let dims = DotDims {
        lhs_batch: vec![0, 1, 2],
        rhs_batch: vec![0, 1, 3],
        lhs_contract: vec![3, 4],
        rhs_contract: vec![2, 4],
    };
    let dk_b = b.dot_general(ds, qb, dims, None, Some(DType::F32))?;
    // dq: add to the query block's rows of its chunk
    let rows_q = rows(b, carry[0], 4, u, tb)?;
    let old = pick(b, rows_q, second)?;
    let new = b.add(old, dq_b)?;
    let rows_q = put(b, rows_q, new, second)?;
    let dq = put_rows(b, carry[0], rows_q, 4, u, tb)?;
    // dk, dv: add to this visit's slot, [B, CP, 1, TB, KV, D]
    let add_visit = |b: &mut Builder, all: Value, blk: Value| -> Result<Value> {
        let blk = b.transpose(blk, &[0, 1, 3, 2, 4])?;
        let blk = b.reshape(blk, &[bs, cp, 1, tb, kvh, d])?;
        let slot = rows(b, all, 2, n, 1)?;
        let sum = b.add(slot, blk)?;
        put_rows(b, all, sum, 2, n, 1)
    };
    let dk = add_visit(b, carry[1], dk_b)?;
    let dv = add_visit(b, carry[2], dv_b)?;
    Ok(vec![dq, dk, dv])
}

/// One step `s` of the forward loop: the visit's query block takes in the visited key block,
/// updating its rows' running maximum, sum and output (carry: m, l, acc); invariants: the
/// tables.
fn forward_visit(
    b: &mut Builder,
    s: Value,
    carry: &[Value],
    inv: &[Value],
    grid: Grid,
) -> Result<Vec<Value>> {
    let tb = grid.tb;
    let (n, u) = step_of(b, s, grid.nbc)?;
    let (second, key, chunk) = visit(b, n, grid)?;
    let [qb, kb, vb, qdocs, kdocs] = visit_blocks(b, &unpack(inv), (second, key, u), tb)?;
    let s = visit_scores(b, [qb, kb, qdocs, kdocs], (chunk, key, u), grid)?;
    let keep = [0, 1, 2, 3, 4];
    let block = |b: &mut Builder, all: Value| -> Result<Value> {
        let r = rows(b, all, 4, u, tb)?;
        pick(b, r, second)
    };
    let m = block(b, carry[0])?;
    let l = block(b, carry[1])?;
    let acc = block(b, carry[2])?;
    let (e, correction, m_new, l_new) = crate::model::flash::online_softmax_step(b, s, m, l)?;
    let e = b.convert(e, grid.num.compute)?;
    let dims = DotDims {
        lhs_batch: vec![0, 1, 2],
        rhs_batch: vec![0, 1, 3],
        lhs_contract: vec![5],
        rhs_contract: vec![2],
    };
    let ev = b.dot_general(e, vb, dims, None, Some(DType::F32))?;
    let ad = b.dims(ev).to_vec();
    let correction = b.broadcast_in_dim(correction, &ad, &keep)?;
    let acc_kept = b.mul(acc, correction)?;
    let acc_new = b.add(acc_kept, ev)?;
    let write = |b: &mut Builder, all: Value, new: Value| -> Result<Value> {
        let r = rows(b, all, 4, u, tb)?;
        let r = put(b, r, new, second)?;
        put_rows(b, all, r, 4, u, tb)
    };
    Ok(vec![
        write(b, carry[0], m_new)?,
        write(b, carry[1], l_new)?,
        write(b, carry[2], acc_new)?,
    ])
}

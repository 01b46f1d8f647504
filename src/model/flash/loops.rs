//! The attention loops: the forward pass over pairs of query blocks, and the backward pass
//! over the rectangles and triangles of key blocks (see the module docs of `model::flash`).
//! Each is the decomposition of one of the composites. A loop body's invariants are named
//! (the structs below), listed and read back in one place each.

use super::blocks::*;
use super::contract::{GradOperands, Operands};
use hlo::{Builder, CmpDir, DType, DotDims, Result, Shape, Value};

/// The `K` values a loop's invariants hold after its `base` ones.
fn after<const K: usize>(inv: &[Value], base: usize) -> [Value; K] {
    inv[base..base + K]
        .try_into()
        .expect("a loop's invariants as listed")
}

/// The forward's inner loop: the operands and the query pair (u, nb-1-u) whose first block's
/// diagonal key block is `a`.
struct PairTrip {
    tab: Operands<Value>,
    u: Value,
    a: Value,
}

impl PairTrip {
    fn list(&self) -> Vec<Value> {
        let mut l = self.tab.list();
        l.extend([self.u, self.a]);
        l
    }

    fn of(inv: &[Value]) -> PairTrip {
        let [u, a] = after(inv, Operands::<Value>::NAMES.len());
        PairTrip {
            tab: Operands::of(inv),
            u,
            a,
        }
    }
}

/// The backward's loops: the operands, and dout, lse and delta (rowsum(dout * out)) laid out
/// as the queries.
#[derive(Clone, Copy)]
struct GradRows {
    tab: Operands<Value>,
    dout: Value,
    lse: Value,
    delta: Value,
}

impl GradRows {
    const LEN: usize = Operands::<Value>::NAMES.len() + 3;

    fn list(&self) -> Vec<Value> {
        let mut l = self.tab.list();
        l.extend([self.dout, self.lse, self.delta]);
        l
    }

    fn of(inv: &[Value]) -> GradRows {
        let [dout, lse, delta] = after(inv, Operands::<Value>::NAMES.len());
        GradRows {
            tab: Operands::of(inv),
            dout,
            lse,
            delta,
        }
    }

    /// These, then `extra` (an inner loop's own invariants, read back with [`after`]).
    fn with<const K: usize>(&self, extra: [Value; K]) -> Vec<Value> {
        let mut l = self.list();
        l.extend(extra);
        l
    }
}

/// The forward decomposition: the operands in the loops' layout; (out [B, KV, 2, Cp, G, D] in
/// the compute type, lse [B, KV, 2, Cp, G]).
pub(super) fn forward_loops(
    b: &mut Builder,
    tab: &Operands<Value>,
    ch: Chunks,
) -> Result<Vec<Value>> {
    let qd = b.dims(tab.q).to_vec();
    let (bs, kvh, g, d) = (qd[0], qd[1], qd[4], qd[5]);
    let init = [
        b.zeros(Shape::new(&[bs, kvh, 2, ch.cp, g, d], ch.num.compute)),
        b.zeros(Shape::new(&[bs, kvh, 2, ch.cp, g], DType::F32)),
    ];
    let out = b.scoped("forward", |b| {
        b.fori_loop(ch.nb(), &init, &tab.list(), |b, u, c, inv| {
            let tab = Operands::of(inv);
            let a = first_diagonal(b, tab.chunk_ids, u, ch)?;
            let rows = Shape::new(&[bs, kvh, 2, ch.tb, g], DType::F32);
            let init = [
                b.full(f32::MIN as f64, rows.clone()),
                b.zeros(rows),
                b.zeros(Shape::new(&[bs, kvh, 2, ch.tb, g, d], DType::F32)),
            ];
            let inv = PairTrip { tab, u, a }.list();
            let run = b.rolled_fori_loop(ch.nk() + 1, &init, &inv, |b, t, c, inv| {
                forward_trip(b, t, c, inv, ch)
            })?;
            let (m, l, acc) = (run[0], run[1], run[2]);
            let ad = b.dims(acc).to_vec();
            let l_wide = b.broadcast_in_dim(l, &ad, &[0, 1, 2, 3, 4])?;
            let o = b.div(acc, l_wide)?;
            let o = b.convert(o, ch.num.compute)?;
            let log_l = b.log(l)?;
            let lse = b.add(m, log_l)?;
            Ok(vec![
                write_pair(b, c[0], o, u, ch)?,
                write_pair(b, c[1], lse, u, ch)?,
            ])
        })
    })?;
    Ok(out)
}

/// `all` [B, KV, 2, Cp, ...] with a pair's rows [B, KV, 2, TB, ...] written: slot 0 at block
/// u, slot 1 at block nb-1-u.
fn write_pair(b: &mut Builder, all: Value, pair: Value, u: Value, ch: Chunks) -> Result<Value> {
    let mut all = all;
    for slot in 0..2 {
        let x = b.slice_dim(pair, 2, slot, slot + 1)?;
        let block = match slot {
            0 => u,
            _ => {
                let last = s32(b, ch.nb() - 1);
                b.sub(last, u)?
            }
        };
        let at = times(b, block, ch.tb)?;
        let slot = s32(b, slot);
        all = put_query_rows(b, all, x, slot, at)?;
    }
    Ok(all)
}

/// One inner trip of the forward pass: the pair's running max, sum and output (carry) take in
/// one key block; invariants a [`PairTrip`].
fn forward_trip(
    b: &mut Builder,
    t: Value,
    c: &[Value],
    inv: &[Value],
    ch: Chunks,
) -> Result<Vec<Value>> {
    let trip = PairTrip::of(inv);
    let (slot, block, j) = query_pair_trip(b, t, (trip.u, trip.a), ch)?;
    let pr = pair(b, &trip.tab, (slot, block, j), ch)?;
    let m = pair_slot(b, c[0], slot)?;
    let l = pair_slot(b, c[1], slot)?;
    let acc = pair_slot(b, c[2], slot)?;
    let (e, correction, m_new, l_new) = online_softmax_step(b, pr.s, m, l)?;
    // As the whole-sequence form: the exponentials rounded to the compute type, the product
    // with v accumulated and kept in f32 until it is divided.
    let e = b.convert(e, ch.num.compute)?;
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![4],
        rhs_contract: vec![2],
    };
    let ev = b.dot_general(e, pr.v, dims, None, Some(DType::F32))?;
    let ad = b.dims(ev).to_vec();
    let correction = b.broadcast_in_dim(correction, &ad, &[0, 1, 2, 3])?;
    let kept = b.mul(acc, correction)?;
    let acc_new = b.add(kept, ev)?;
    Ok(vec![
        put_pair_slot(b, c[0], m_new, slot)?,
        put_pair_slot(b, c[1], l_new, slot)?,
        put_pair_slot(b, c[2], acc_new, slot)?,
    ])
}

/// The backward decomposition: the operands in the loops' layout; (dq [B, KV, 2, Cp, G, D],
/// dk and dv [B, KV, NC Cp, D]) in the inputs' types.
pub(super) fn backward_loops(
    b: &mut Builder,
    p: &GradOperands<Value>,
    ch: Chunks,
) -> Result<Vec<Value>> {
    let (tab, out, lse, dout) = (p.ins, p.out, p.lse, p.dout);
    let delta = b.scoped("delta", |b| {
        let o = b.convert(out, DType::F32)?;
        let dof = b.convert(dout, DType::F32)?;
        let prod = b.mul(o, dof)?;
        b.reduce_sum(prod, &[5])
    })?;
    let rows = GradRows {
        tab,
        dout,
        lse,
        delta,
    };
    let (dq, dk, dv) = b.scoped("grad", |b| gradient_pass(b, rows, ch))?;
    Ok(vec![
        b.convert(dq, b.dtype(tab.q))?,
        b.convert(dk, b.dtype(tab.k))?,
        b.convert(dv, b.dtype(tab.v))?,
    ])
}

/// The backward pass: outer over key blocks, inner over the query blocks that see them,
/// carrying the key block's dk and dv and adding each trip's dq share in place to the query
/// rows it belongs to; the rectangles of earlier chunks first, then the two triangles. Returns
/// (dq [B, KV, 2, Cp, G, D], dk and dv [B, KV, NC Cp, D]), f32.
fn gradient_pass(b: &mut Builder, rows: GradRows, ch: Chunks) -> Result<(Value, Value, Value)> {
    let kd = b.dims(rows.tab.k).to_vec();
    let (bs, kvh, d) = (kd[0], kd[1], kd[3]);
    let g = b.dims(rows.tab.q)[4];
    let init = [
        b.zeros(Shape::new(&[bs, kvh, ch.nc * ch.cp, d], DType::F32)),
        b.zeros(Shape::new(&[bs, kvh, ch.nc * ch.cp, d], DType::F32)),
        b.zeros(Shape::new(&[bs, kvh, 2, ch.cp, g, d], DType::F32)),
    ];
    let inv = rows.list();
    let nb = ch.nb();
    // The rectangles: key block j of an earlier chunk than query chunk `slot`, against each of
    // its nb query blocks. Outer trip o: slot 0's c0 nb blocks, then slot 1's c1 nb.
    let rect = b.scoped("rectangles", |b| {
        b.fori_loop((ch.nc - 1) * nb, &init, &inv, |b, o, c, inv| {
            let rows = GradRows::of(inv);
            let zero = s32(b, 0);
            let c0 = chunk_id(b, rows.tab.chunk_ids, zero)?;
            let first = times(b, c0, nb)?;
            let second = b.compare(o, first, CmpDir::Ge)?;
            let slot = b.convert(second, DType::S32)?;
            let later = b.sub(o, first)?;
            let j = b.select(second, later, o)?;
            let key = Shape::new(&[bs, kvh, ch.tb, d], DType::F32);
            let init = [b.zeros(key.clone()), b.zeros(key), c[2]];
            let inner = rows.with([slot, j]);
            let run = b.rolled_fori_loop(nb, &init, &inner, |b, u, c, inv| {
                let [slot, j] = after(inv, GradRows::LEN);
                let (dk, dv, dq) = block_grads(b, GradRows::of(inv), (slot, u, j), ch)?;
                Ok(vec![
                    b.add(c[0], dk)?,
                    b.add(c[1], dv)?,
                    add_query_block(b, c[2], dq, slot, u, ch)?,
                ])
            })?;
            Ok(vec![
                add_key_block(b, c[0], run[0], j, ch)?,
                add_key_block(b, c[1], run[1], j, ch)?,
                run[2],
            ])
        })
    })?;
    // The triangles: key block x of chunk c0 (seen by its query blocks x..nb) with key block
    // nb-1-x of chunk c1 (seen by nb-1-x..nb): nb + 1 query blocks in all.
    let tri = b.scoped("triangles", |b| {
        b.fori_loop(nb, &rect, &inv, |b, x, c, inv| {
            let rows = GradRows::of(inv);
            let key = Shape::new(&[bs, kvh, 2, ch.tb, d], DType::F32);
            let init = [b.zeros(key.clone()), b.zeros(key), c[2]];
            let inner = rows.with([x]);
            // Not a priced loop: its trips cost what the rectangles' do, and the estimate
            // counts the nest's trips as the rectangles' and the triangles' together.
            let run = b.fori_loop(nb + 1, &init, &inner, |b, t, c, inv| {
                let rows = GradRows::of(inv);
                let [x] = after(inv, GradRows::LEN);
                let nbv = s32(b, nb);
                let split = b.sub(nbv, x)?;
                let second = b.compare(t, split, CmpDir::Ge)?;
                let slot = b.convert(second, DType::S32)?;
                let ones = s32(b, 1);
                let first_u = b.add(x, t)?;
                let second_u = b.sub(t, ones)?;
                let u = b.select(second, second_u, first_u)?;
                let j = triangle_key(b, rows.tab.chunk_ids, slot, x, nb)?;
                let (dk, dv, dq) = block_grads(b, rows, (slot, u, j), ch)?;
                let add = |b: &mut Builder, pair: Value, g: Value| -> Result<Value> {
                    let old = pair_slot(b, pair, slot)?;
                    let new = b.add(old, g)?;
                    put_pair_slot(b, pair, new, slot)
                };
                Ok(vec![
                    add(b, c[0], dk)?,
                    add(b, c[1], dv)?,
                    add_query_block(b, c[2], dq, slot, u, ch)?,
                ])
            })?;
            let mut out = c.to_vec();
            out[2] = run[2];
            for slot in 0..2 {
                let sv = s32(b, slot);
                let j = triangle_key(b, rows.tab.chunk_ids, sv, x, nb)?;
                for (k, o) in out.iter_mut().take(2).enumerate() {
                    let g = b.slice_dim(run[k], 2, slot, slot + 1)?;
                    let gd = b.dims(g).to_vec();
                    let g = b.reshape(g, &[gd[0], gd[1], gd[3], gd[4]])?;
                    *o = add_key_block(b, *o, g, j, ch)?;
                }
            }
            Ok(out)
        })
    })?;
    Ok((tri[2], tri[0], tri[1]))
}

/// The key block a triangle pairs with the queries of `slot` (0 or 1) in outer trip `x`:
/// block x of the first chunk, block nb-1-x of the second, counted from chunk id(slot) x nb.
/// The inner trips ask with the slot they compute, the outer write with each slot in turn.
fn triangle_key(b: &mut Builder, ids: Value, slot: Value, x: Value, nb: i64) -> Result<Value> {
    let chunk = chunk_id(b, ids, slot)?;
    let nbv = s32(b, nb);
    let base = b.mul(chunk, nbv)?;
    let zero = s32(b, 0);
    let second = b.compare(slot, zero, CmpDir::Ne)?;
    let last = s32(b, nb - 1);
    let mirrored = b.sub(last, x)?;
    let off = b.select(second, mirrored, x)?;
    b.add(base, off)
}

/// One backward trip: query block `u` of slot `slot` against key block `j`. Returns the block pair's shares of dk_j and dv_j
/// [B, KV, TB, D] and of dq_u [B, KV, TB, G, D], f32.
fn block_grads(
    b: &mut Builder,
    rows: GradRows,
    (slot, u, j): (Value, Value, Value),
    ch: Chunks,
) -> Result<(Value, Value, Value)> {
    let pr = pair(b, &rows.tab, (slot, u, j), ch)?;
    let dout = query_rows(b, rows.dout, slot, u, ch.tb)?;
    let lse = query_rows(b, rows.lse, slot, u, ch.tb)?;
    let delta = query_rows(b, rows.delta, slot, u, ch.tb)?;
    let (probs, ds) = probs_and_ds(b, pr.s, pr.v, (dout, lse, delta), ch)?;
    let dq = query_grad(b, ds, pr.k)?;
    let (dk, dv) = key_grads(b, (probs, ds), (pr.q, dout), ch)?;
    Ok((dk, dv, dq))
}

/// `all` [B, KV, 2, Cp, G, D] with `g` [B, KV, TB, G, D] added to query block `u` of `slot`.
fn add_query_block(
    b: &mut Builder,
    all: Value,
    g: Value,
    slot: Value,
    u: Value,
    ch: Chunks,
) -> Result<Value> {
    let old = query_rows(b, all, slot, u, ch.tb)?;
    let new = b.add(old, g)?;
    let mut d = b.dims(new).to_vec();
    d.insert(2, 1);
    let new = b.reshape(new, &d)?;
    let at = times(b, u, ch.tb)?;
    put_query_rows(b, all, new, slot, at)
}

/// `all` [B, KV, NK TB, D] with `g` [B, KV, TB, D] added to key block `j`.
fn add_key_block(b: &mut Builder, all: Value, g: Value, j: Value, ch: Chunks) -> Result<Value> {
    let old = key_rows(b, all, 2, j, ch.tb)?;
    let new = b.add(old, g)?;
    let at = times(b, j, ch.tb)?;
    put_window(b, all, new, 2, at)
}

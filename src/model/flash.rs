//! Causal attention over key/value blocks, with the flash-attention recurrence: the memory it
//! needs grows with the sequence, not with its square.
//!
//! The sequence is cut into blocks of `TB` tokens (padded up to a whole number of blocks). One
//! loop visits the pairs (query block i, key block j) with j <= i, row by row; for each query row
//! it keeps a running maximum `m`, a running sum `l` and an unnormalized output `acc`:
//!
//! ```text
//! s    = q_i k_j^T / sqrt(D), masked            [TB, TB] per head: the only score block alive
//! m'   = max(m, rowmax(s))
//! p    = exp(s - m')
//! l'   = l exp(m - m') + rowsum(p)
//! acc' = acc exp(m - m') + p v_j
//! ```
//! and writes `out_i = acc / l` and the row statistic `lse_i = m + log l` (the write at the
//! diagonal block, row i's last, is the one that stays).
//! The backward pass is a rule of its own ([`hlo::Builder::custom_vjp`]): the same loop
//! recomputes each block's probabilities `p = exp(s - lse_i)` from the saved statistic and adds
//! the block's share to dq_i, dk_j and dv_j:
//!
//! ```text
//! delta = rowsum(dout * out)                    (once, before the loop)
//! dv_j += p^T dout_i
//! ds    = p * (dout_i v_j^T - delta_i) / sqrt(D)
//! dq_i += ds k_j,     dk_j += ds^T q_i
//! ```
//! Masked scores are the lowest f32 rather than -inf, as in the whole-sequence form, so a row
//! with no visible key (a padding query before any real token) averages its block uniformly
//! instead of dividing by zero; such rows feed no loss.

use crate::model::forward::{mask_scores, Numerics, Saves};
use hlo::{Builder, CmpDir, DType, DotDims, Result, Shape, Value};
use std::rc::Rc;

/// The key/value block `--key-block auto` takes (see `program::KeyBlocks::resolve`).
pub const DEFAULT_KEY_BLOCK: i64 = 512;

/// The save point of the attention's row statistic `m + log l`, [B, KV, T', G] f32 over the
/// padded sequence T'.
pub const LSE: &str = "attn.lse";

/// The key/value block size for a sequence of `t` tokens: the requested size, at most the
/// sequence.
pub fn key_block(t: i64, requested: i64) -> i64 {
    requested.clamp(1, t)
}

/// The padded sequence length: `t` rounded up to whole blocks of `tb`.
pub fn padded(t: i64, tb: i64) -> i64 {
    (t + tb - 1) / tb * tb
}

/// The shape of the [`LSE`] save point for batches of `bs` x `t` tokens.
pub fn lse_shape(bs: i64, t: i64, kv_heads: i64, groups: i64, tb: i64) -> Shape {
    Shape::new(&[bs, kv_heads, padded(t, tb), groups], DType::F32)
}

/// What the forward and backward loops share: block size, head dim, numerics.
#[derive(Clone, Copy)]
struct Blocks {
    tb: i64,
    d: i64,
    num: Numerics,
}

/// softmax(q k^T / sqrt(D), masked) v in key/value blocks of `tb`, for q [B, T, KV, G, D], k and
/// v [B, T, KV, D], `query_docs` [B, T] (where each query's document starts, 0 for padding) and
/// `key_docs` [B, T] (where each key's document starts, -1 for padding), with the masking rule
/// of the whole-sequence form (`model::llama::attend`). Returns the output [B, T, KV x G x D]
/// after the save points `out_point` (the output) and [`LSE`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    (query_docs, key_docs): (Value, Value),
    tb: i64,
    num: Numerics,
    (out_point, saves): (&str, &mut Saves),
) -> Result<Value> {
    let qd = b.dims(q).to_vec();
    let (bs, t, heads) = (qd[0], qd[1], qd[2] * qd[3]);
    let blocks = Blocks { tb, d: qd[4], num };
    let padded_in = pad_inputs(b, [q, k, v], (query_docs, key_docs), tb)?;
    let (out, lse) = forward_loop(b, &padded_in, blocks)?;
    // out [B, KV, T', G, D] -> [B, T, KV x G x D]
    let out = b.slice_dim(out, 2, 0, t)?;
    let out = b.transpose(out, &[0, 2, 1, 3, 4])?;
    let out = b.reshape(out, &[bs, t, heads * blocks.d])?;
    let out = saves.point(b, out_point, out)?;
    let lse = saves.point(b, LSE, lse)?;
    let rule: hlo::VjpRule = Rc::new(move |b, ins, outs, cts| backward(b, ins, outs, cts, blocks));
    let outs = b.custom_vjp(&[q, k, v, query_docs, key_docs], &[out, lse], rule);
    Ok(outs[0])
}

/// q, k, v and the document starts padded to whole blocks: q, k and v with zeros, the query
/// starts with 0 and the key starts with -1 (padding keys, which no query sees).
struct Padded {
    q: Value,
    k: Value,
    v: Value,
    query_docs: Value,
    key_docs: Value,
}

fn pad_inputs(
    b: &mut Builder,
    [q, k, v]: [Value; 3],
    (query_docs, key_docs): (Value, Value),
    tb: i64,
) -> Result<Padded> {
    let t = b.dims(q)[1];
    let extra = padded(t, tb) - t;
    let pad_seq = |b: &mut Builder, x: Value, fill: f64| -> Result<Value> {
        if extra == 0 {
            return Ok(x);
        }
        let r = b.rank(x);
        let mut high = vec![0; r];
        high[1] = extra;
        let fill = b.scalar(fill, b.dtype(x));
        b.pad(x, fill, &vec![0; r], &high, &vec![0; r])
    };
    Ok(Padded {
        q: pad_seq(b, q, 0.0)?,
        k: pad_seq(b, k, 0.0)?,
        v: pad_seq(b, v, 0.0)?,
        query_docs: pad_seq(b, query_docs, 0.0)?,
        key_docs: pad_seq(b, key_docs, -1.0)?,
    })
}

/// The visiting order of the causal block pairs: (i, j) -> (i, j + 1), or (i + 1, 0) after the
/// diagonal. Returns (diagonal?, next i, next j) for s32 scalars i and j.
fn next_pair(b: &mut Builder, i: Value, j: Value) -> Result<(Value, Value, Value)> {
    let diag = b.compare(i, j, CmpDir::Eq)?;
    let one = b.scalar(1.0, DType::S32);
    let zero = b.scalar(0.0, DType::S32);
    let step = b.select(diag, one, zero)?;
    let next_i = b.add(i, step)?;
    let j1 = b.add(j, one)?;
    let next_j = b.select(diag, zero, j1)?;
    Ok((diag, next_i, next_j))
}

/// `x[:, block * tb : (block + 1) * tb]` along dim `dim` (s32 `block`).
fn block_of(b: &mut Builder, x: Value, dim: usize, block: Value, tb: i64) -> Result<Value> {
    let starts = block_starts(b, b.rank(x), dim, block, tb)?;
    let mut sizes = b.dims(x).to_vec();
    sizes[dim] = tb;
    b.dynamic_slice(x, &starts, &sizes)
}

/// `x` with `update` added to its block `block` along dim `dim`.
fn add_to_block(
    b: &mut Builder,
    x: Value,
    update: Value,
    dim: usize,
    block: Value,
    tb: i64,
) -> Result<Value> {
    let old = block_of(b, x, dim, block, tb)?;
    let new = b.add(old, update)?;
    let starts = block_starts(b, b.rank(x), dim, block, tb)?;
    b.dynamic_update_slice(x, new, &starts)
}

fn block_starts(
    b: &mut Builder,
    rank: usize,
    dim: usize,
    block: Value,
    tb: i64,
) -> Result<Vec<Value>> {
    let zero = b.scalar(0.0, DType::S32);
    let size = b.scalar(tb as f64, DType::S32);
    let start = b.mul(block, size)?;
    Ok((0..rank)
        .map(|r| if r == dim { start } else { zero })
        .collect())
}

/// The masked scores of query block i and key block j, f32 [B, KV, TB, G, TB]: `q_i . k_j /
/// sqrt(D)` (written in the scores' type first, as the whole-sequence form does), the lowest
/// f32 where the key is later than the query or outside its document.
#[allow(clippy::too_many_arguments)]
fn block_scores(
    b: &mut Builder,
    (qi, kj): (Value, Value),
    (query_docs_i, key_docs_j): (Value, Value),
    (i, j): (Value, Value),
    blocks: Blocks,
) -> Result<Value> {
    let dims = DotDims {
        lhs_batch: vec![0, 2],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![4],
        rhs_contract: vec![3],
    };
    let scores = b.dot_general(qi, kj, dims, None, Some(blocks.num.scores))?;
    let scores = b.convert(scores, DType::F32)?;
    let scores = b.mul_scalar(scores, 1.0 / (blocks.d as f64).sqrt())?;
    let tb = blocks.tb;
    let square = Shape::new(&[tb, tb], DType::S32);
    let position = |b: &mut Builder, dim: i64, block: Value| -> Result<Value> {
        let at = b.iota(square.clone(), dim)?;
        let size = b.scalar(tb as f64, DType::S32);
        let start = b.mul(block, size)?;
        let start = b.broadcast_in_dim(start, &[tb, tb], &[])?;
        b.add(at, start)
    };
    let q_pos = position(b, 0, i)?;
    let k_pos = position(b, 1, j)?;
    let docs = (query_docs_i, key_docs_j);
    mask_scores(b, scores, (q_pos, k_pos), docs, &[0, 2, 4])
}

/// The blocks of pair (i, j): (q_i, k_j, v_j, query starts of i, key starts of j).
fn pair_inputs(b: &mut Builder, p: &Padded, (i, j): (Value, Value), tb: i64) -> Result<[Value; 5]> {
    Ok([
        block_of(b, p.q, 1, i, tb)?,
        block_of(b, p.k, 1, j, tb)?,
        block_of(b, p.v, 1, j, tb)?,
        block_of(b, p.query_docs, 1, i, tb)?,
        block_of(b, p.key_docs, 1, j, tb)?,
    ])
}

fn unpack(inv: &[Value]) -> Padded {
    Padded {
        q: inv[0],
        k: inv[1],
        v: inv[2],
        query_docs: inv[3],
        key_docs: inv[4],
    }
}

/// Number of causal block pairs for a padded sequence of `tp` tokens.
fn pairs(tp: i64, tb: i64) -> i64 {
    let n = tp / tb;
    n * (n + 1) / 2
}

/// Trips of each of a layer's attention loops for `t` tokens and a requested key block: its
/// causal block pairs (what a cost model that counts a loop body once leaves out).
pub fn loop_trips(t: i64, requested: i64) -> i64 {
    let tb = key_block(t, requested);
    pairs(padded(t, tb), tb)
}

/// The forward loop: (out [B, KV, T', G, D] in the compute type, lse [B, KV, T', G] f32).
fn forward_loop(b: &mut Builder, p: &Padded, blocks: Blocks) -> Result<(Value, Value)> {
    let qd = b.dims(p.q).to_vec();
    let (bs, tp, kvh, g, d) = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    let tb = blocks.tb;
    let row = Shape::new(&[bs, kvh, tb, g], DType::F32);
    let zero_i = b.scalar(0.0, DType::S32);
    let init = [
        zero_i,
        zero_i,
        b.zeros(Shape::new(&[bs, kvh, tb, g, d], DType::F32)),
        b.full(f32::MIN as f64, row.clone()),
        b.zeros(row.clone()),
        b.zeros(Shape::new(&[bs, kvh, tp, g, d], blocks.num.compute)),
        b.zeros(Shape::new(&[bs, kvh, tp, g], DType::F32)),
    ];
    let invariants = [p.q, p.k, p.v, p.query_docs, p.key_docs];
    let out = b.scoped("key_blocks", |b| {
        b.rolled_fori_loop(pairs(tp, tb), &init, &invariants, |b, _, c, inv| {
            forward_pair(b, c, inv, blocks)
        })
    })?;
    Ok((out[5], out[6]))
}

/// The gradient rule of [`attend`]: inputs (q, k, v, query starts, key starts), outputs (out
/// [B, T, heads x D], lse), their cotangents; the cotangents of q, k and v.
fn backward(
    b: &mut Builder,
    ins: &[Value],
    outs: &[Value],
    cts: &[Option<Value>],
    blocks: Blocks,
) -> Result<Vec<Option<Value>>> {
    let Some(dout) = cts[0] else {
        return Ok(vec![None; ins.len()]);
    };
    let (q, k, v) = (ins[0], ins[1], ins[2]);
    let qd = b.dims(q).to_vec();
    let (bs, t, kvh, g, d) = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    let tb = blocks.tb;
    let p = pad_inputs(b, [q, k, v], (ins[3], ins[4]), tb)?;
    let tp = b.dims(p.q)[1];
    // out and dout as [B, KV, T', G, D], padded with zeros.
    let head_major = |b: &mut Builder, x: Value| -> Result<Value> {
        let x = b.reshape(x, &[bs, t, kvh, g, d])?;
        let x = b.transpose(x, &[0, 2, 1, 3, 4])?;
        if tp == t {
            return Ok(x);
        }
        let zero = b.scalar(0.0, b.dtype(x));
        b.pad(x, zero, &[0; 5], &[0, 0, tp - t, 0, 0], &[0; 5])
    };
    let out = head_major(b, outs[0])?;
    let dout = head_major(b, dout)?;
    let delta = b.scoped("key_blocks.delta", |b| {
        let o = b.convert(out, DType::F32)?;
        let dof = b.convert(dout, DType::F32)?;
        let prod = b.mul(o, dof)?;
        b.reduce_sum(prod, &[4])
    })?;
    let zero_i = b.scalar(0.0, DType::S32);
    let init = [
        zero_i,
        zero_i,
        b.zeros(Shape::new(&[bs, kvh, tp, g, d], DType::F32)),
        b.zeros(Shape::new(&[bs, kvh, tp, d], DType::F32)),
        b.zeros(Shape::new(&[bs, kvh, tp, d], DType::F32)),
    ];
    let invariants = [
        p.q,
        p.k,
        p.v,
        p.query_docs,
        p.key_docs,
        dout,
        outs[1],
        delta,
    ];
    let grads = b.scoped("key_blocks.grad", |b| {
        b.rolled_fori_loop(pairs(tp, tb), &init, &invariants, |b, _, c, inv| {
            backward_pair(b, c, inv, blocks)
        })
    })?;
    // Back to the inputs' layouts and types, the padding cut off.
    let back = |b: &mut Builder, x: Value, like: Value| -> Result<Value> {
        let x = b.slice_dim(x, 2, 0, t)?;
        let perm: Vec<i64> = match b.rank(x) {
            5 => vec![0, 2, 1, 3, 4],
            _ => vec![0, 2, 1, 3],
        };
        let x = b.transpose(x, &perm)?;
        b.convert(x, b.dtype(like))
    };
    Ok(vec![
        Some(back(b, grads[2], q)?),
        Some(back(b, grads[3], k)?),
        Some(back(b, grads[4], v)?),
        None,
        None,
    ])
}

/// One step of the backward loop: block pair (i, j) = carry[0..2] adds its share to dq_i, dk_j
/// and dv_j (carry[2..5]); invariants (q, k, v, query starts, key starts, dout, lse, delta).
fn backward_pair(
    b: &mut Builder,
    c: &[Value],
    inv: &[Value],
    blocks: Blocks,
) -> Result<Vec<Value>> {
    let tb = blocks.tb;
    let (i, j) = (c[0], c[1]);
    let [qi, kj, vj, qdi, kdj] = pair_inputs(b, &unpack(inv), (i, j), tb)?;
    let dout_i = block_of(b, inv[5], 2, i, tb)?;
    let lse_i = block_of(b, inv[6], 2, i, tb)?;
    let delta_i = block_of(b, inv[7], 2, i, tb)?;
    let s = block_scores(b, (qi, kj), (qdi, kdj), (i, j), blocks)?;
    let sd = b.dims(s).to_vec();
    let keep = [0, 1, 2, 3];
    let lse_wide = b.broadcast_in_dim(lse_i, &sd, &keep)?;
    let shifted = b.sub(s, lse_wide)?;
    let probs = b.exp(shifted)?;
    let compute = blocks.num.compute;
    let probs_c = b.convert(probs, compute)?;
    // dv_j += p^T dout_i, over the queries and their group heads
    let over_queries = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![2, 3],
        rhs_contract: vec![2, 3],
    };
    let dv_j = b.dot_general(
        probs_c,
        dout_i,
        over_queries.clone(),
        None,
        Some(DType::F32),
    )?;
    // dp = dout_i v_j^T
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![4],
        rhs_contract: vec![3],
    };
    let dprobs = b.dot_general(dout_i, vj, dims, None, Some(DType::F32))?;
    let delta_wide = b.broadcast_in_dim(delta_i, &sd, &keep)?;
    let centered = b.sub(dprobs, delta_wide)?;
    let ds = b.mul(probs, centered)?;
    let ds = b.mul_scalar(ds, 1.0 / (blocks.d as f64).sqrt())?;
    let ds = b.convert(ds, compute)?;
    // dq_i += ds k_j
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![4],
        rhs_contract: vec![1],
    };
    let dq_i = b.dot_general(ds, kj, dims, None, Some(DType::F32))?;
    // dk_j += ds^T q_i
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![2, 3],
        rhs_contract: vec![1, 3],
    };
    let dk_j = b.dot_general(ds, qi, dims, None, Some(DType::F32))?;
    let dq = add_to_block(b, c[2], dq_i, 2, i, tb)?;
    let dk = add_to_block(b, c[3], dk_j, 2, j, tb)?;
    let dv = add_to_block(b, c[4], dv_j, 2, j, tb)?;
    let (_, next_i, next_j) = next_pair(b, i, j)?;
    Ok(vec![next_i, next_j, dq, dk, dv])
}

/// One step of the forward loop: block pair (i, j) of carry (i, j, acc, m, l, out, lse) updates
/// row block i's running statistics and output; invariants (q, k, v, query starts, key starts).
fn forward_pair(b: &mut Builder, c: &[Value], inv: &[Value], blocks: Blocks) -> Result<Vec<Value>> {
    let tb = blocks.tb;
    let row = b.shape(c[3]).clone();
    let (i, j, acc, m, l, out, lse) = (c[0], c[1], c[2], c[3], c[4], c[5], c[6]);
    let [qi, kj, vj, qdi, kdj] = pair_inputs(b, &unpack(inv), (i, j), tb)?;
    let s = block_scores(b, (qi, kj), (qdi, kdj), (i, j), blocks)?;
    let keep = [0, 1, 2, 3];
    let (e, correction, m_new, l_new) = online_softmax_step(b, s, m, l)?;
    // As the whole-sequence form: the exponentials rounded to the compute type, the
    // product with v accumulated and kept in f32 until it is divided.
    let e = b.convert(e, blocks.num.compute)?;
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
        lhs_contract: vec![4],
        rhs_contract: vec![1],
    };
    let ev = b.dot_general(e, vj, dims, None, Some(DType::F32))?;
    let ad = b.dims(ev).to_vec();
    let correction = b.broadcast_in_dim(correction, &ad, &keep)?;
    let acc_kept = b.mul(acc, correction)?;
    let acc_new = b.add(acc_kept, ev)?;
    // Row i's output and statistic, final once j reaches the diagonal (its last block).
    let l_wide = b.broadcast_in_dim(l_new, &ad, &keep)?;
    let out_i = b.div(acc_new, l_wide)?;
    let out_i = b.convert(out_i, blocks.num.compute)?;
    let starts = block_starts(b, 5, 2, i, tb)?;
    let out = b.dynamic_update_slice(out, out_i, &starts)?;
    let log_l = b.log(l_new)?;
    let lse_i = b.add(m_new, log_l)?;
    let starts = block_starts(b, 4, 2, i, tb)?;
    let lse = b.dynamic_update_slice(lse, lse_i, &starts)?;
    // After the diagonal the next row starts afresh.
    let (diag, next_i, next_j) = next_pair(b, i, j)?;
    let zeros = b.zeros_like(acc_new);
    let acc_next = b.select(diag, zeros, acc_new)?;
    let lowest = b.full(f32::MIN as f64, row.clone());
    let m_next = b.select(diag, lowest, m_new)?;
    let zeros = b.zeros(row.clone());
    let l_next = b.select(diag, zeros, l_new)?;
    Ok(vec![next_i, next_j, acc_next, m_next, l_next, out, lse])
}

/// One key block's step of the flash recurrence for scores `s` (f32, keys on the last dim)
/// and the rows' running max `m` and sum `l`: (exp(s - m'), exp(m - m'), m', l') with
/// m' = max(m, rowmax(s)) and l' = l exp(m - m') + rowsum(exp(s - m')).
pub(crate) fn online_softmax_step(
    b: &mut Builder,
    s: Value,
    m: Value,
    l: Value,
) -> Result<(Value, Value, Value, Value)> {
    let sd = b.dims(s).to_vec();
    let last = sd.len() as i64 - 1;
    let keep: Vec<i64> = (0..last).collect();
    let m_block = b.reduce_max(s, &[last])?;
    let m_new = b.max(m, m_block)?;
    let shifted = b.broadcast_in_dim(m_new, &sd, &keep)?;
    let shifted = b.sub(s, shifted)?;
    let e = b.exp(shifted)?;
    let old = b.sub(m, m_new)?;
    let correction = b.exp(old)?;
    let l_kept = b.mul(l, correction)?;
    let e_sum = b.reduce_sum(e, &[last])?;
    let l_new = b.add(l_kept, e_sum)?;
    Ok((e, correction, m_new, l_new))
}

//! The block algebra of the attention loops: one block pair's scores, probabilities and
//! gradients, and which blocks a loop trip visits (see the module docs of `model::flash`).

use super::contract::{Attributes, Operands, CAUSAL_RULE};
use crate::model::forward::{mask_scores, Numerics};
use hlo::{Builder, CmpDir, DType, DotDims, Result, Shape, Value};

/// `t` rounded up to whole blocks of `tb`.
pub fn padded(t: i64, tb: i64) -> i64 {
    (t + tb - 1) / tb * tb
}

/// The sizes the loops share: what the composites' attributes say.
#[derive(Clone, Copy, Debug)]
pub struct Chunks {
    /// Key chunks in the sequence (2 on one device, 2CP over a context axis).
    pub nc: i64,
    /// Natural tokens per chunk: chunk c starts at position c x `c`.
    pub c: i64,
    /// Tokens per chunk padded to whole blocks, and the block.
    pub cp: i64,
    pub tb: i64,
    pub d: i64,
    pub num: Numerics,
}

impl Chunks {
    /// Chunks of `c` natural tokens in blocks of `tb`.
    pub fn new(nc: i64, c: i64, tb: i64, d: i64, num: Numerics) -> Chunks {
        Chunks {
            nc,
            c,
            cp: padded(c, tb),
            tb,
            d,
            num,
        }
    }

    pub(super) fn nb(&self) -> i64 {
        self.cp / self.tb
    }

    pub(super) fn nk(&self) -> i64 {
        self.nc * self.nb()
    }

    /// The composites' attributes for `heads` (key/value heads, groups).
    pub(super) fn attributes(&self, heads: (i64, i64)) -> Attributes {
        Attributes {
            block: self.tb,
            chunk: self.c,
            chunks: self.nc,
            padded_chunk: self.cp,
            head_dim: self.d,
            kv_heads: heads.0,
            q_heads: heads.0 * heads.1,
            scale: 1.0 / (self.d as f64).sqrt(),
            causal: CAUSAL_RULE.into(),
        }
    }
}

pub(super) fn s32(b: &mut Builder, v: i64) -> Value {
    b.scalar(v as f64, DType::S32)
}

/// `x * k` for an s32 scalar `x`.
pub(super) fn times(b: &mut Builder, x: Value, k: i64) -> Result<Value> {
    let k = s32(b, k);
    b.mul(x, k)
}

/// Start indices into `x` for a dynamic slice or update: `at`'s (dim, start) pairs (s32
/// scalars), 0 in every other dim.
fn starts_at(b: &mut Builder, x: Value, at: &[(usize, Value)]) -> Vec<Value> {
    let zero = s32(b, 0);
    (0..b.rank(x))
        .map(|r| at.iter().find(|(d, _)| *d == r).map_or(zero, |&(_, v)| v))
        .collect()
}

/// `x`'s `size` entries of dim `dim` from `start` (s32 scalar), the other dims whole.
pub(super) fn window(
    b: &mut Builder,
    x: Value,
    dim: usize,
    start: Value,
    size: i64,
) -> Result<Value> {
    let starts = starts_at(b, x, &[(dim, start)]);
    let mut sizes = b.dims(x).to_vec();
    sizes[dim] = size;
    b.dynamic_slice(x, &starts, &sizes)
}

/// `x` with `new` written at `start` (s32 scalar) of dim `dim`.
pub(super) fn put_window(
    b: &mut Builder,
    x: Value,
    new: Value,
    dim: usize,
    start: Value,
) -> Result<Value> {
    let starts = starts_at(b, x, &[(dim, start)]);
    b.dynamic_update_slice(x, new, &starts)
}

/// Rows `u TB ..` of chunk slot `slot` of a query-shaped table [B, KV, 2, Cp, ...]:
/// [B, KV, TB, ...].
pub(super) fn query_rows(
    b: &mut Builder,
    x: Value,
    slot: Value,
    u: Value,
    tb: i64,
) -> Result<Value> {
    let x = window(b, x, 2, slot, 1)?;
    let at = times(b, u, tb)?;
    let x = window(b, x, 3, at, tb)?;
    let mut d = b.dims(x).to_vec();
    d.remove(2);
    b.reshape(x, &d)
}

/// `x` [B, KV, 2, Cp, ...] with `rows` [B, KV, 1, TB, ...] written at chunk slot `slot` from
/// row `at` (s32 scalars): where [`query_rows`] reads.
pub(super) fn put_query_rows(
    b: &mut Builder,
    x: Value,
    rows: Value,
    slot: Value,
    at: Value,
) -> Result<Value> {
    let starts = starts_at(b, x, &[(2, slot), (3, at)]);
    b.dynamic_update_slice(x, rows, &starts)
}

/// One block's worth [B, KV, TB, ...] of a pair carry [B, KV, 2, TB, ...] at `slot`.
pub(super) fn pair_slot(b: &mut Builder, pair: Value, slot: Value) -> Result<Value> {
    let x = window(b, pair, 2, slot, 1)?;
    let mut d = b.dims(x).to_vec();
    d.remove(2);
    b.reshape(x, &d)
}

pub(super) fn put_pair_slot(
    b: &mut Builder,
    pair: Value,
    new: Value,
    slot: Value,
) -> Result<Value> {
    let mut d = b.dims(new).to_vec();
    d.insert(2, 1);
    let new = b.reshape(new, &d)?;
    put_window(b, pair, new, 2, slot)
}

/// Key block `j` of a key table [B, KV, NK TB, D] (or starts [B, NK TB]: `dim` 1).
pub(super) fn key_rows(b: &mut Builder, x: Value, dim: usize, j: Value, tb: i64) -> Result<Value> {
    let at = times(b, j, tb)?;
    window(b, x, dim, at, tb)
}

/// The chunk id of slot `slot` (s32 scalar).
pub(super) fn chunk_id(b: &mut Builder, ids: Value, slot: Value) -> Result<Value> {
    let x = b.dynamic_slice(ids, &[slot], &[1])?;
    b.reshape(x, &[])
}

/// One block pair's inputs: query block `u` of slot `slot` against key block `j`.
pub(super) struct Pair {
    pub(super) q: Value,
    pub(super) k: Value,
    pub(super) v: Value,
    /// Masked scores [B, KV, TB, G, TB] f32.
    pub(super) s: Value,
}

pub(super) fn pair(
    b: &mut Builder,
    t: &Operands<Value>,
    (slot, u, j): (Value, Value, Value),
    ch: Chunks,
) -> Result<Pair> {
    let tb = ch.tb;
    let q = query_rows(b, t.q, slot, u, tb)?;
    let k = key_rows(b, t.k, 2, j, tb)?;
    let v = key_rows(b, t.v, 2, j, tb)?;
    let qdocs = window(b, t.query_docs, 1, slot, 1)?;
    let at = times(b, u, tb)?;
    let qdocs = window(b, qdocs, 2, at, tb)?;
    let bs = b.dims(qdocs)[0];
    let qdocs = b.reshape(qdocs, &[bs, tb])?;
    let kdocs = key_rows(b, t.key_docs, 1, j, tb)?;
    // Natural positions: chunk c's row x is token c C + x.
    let c = s32(b, ch.c);
    let chunk = chunk_id(b, t.chunk_ids, slot)?;
    let q_start = b.mul(chunk, c)?;
    let q_start = b.add(q_start, at)?;
    let nb = s32(b, ch.nb());
    let k_chunk = b.div(j, nb)?;
    let k_block = b.rem(j, nb)?;
    let k_start = b.mul(k_chunk, c)?;
    let k_off = times(b, k_block, tb)?;
    let k_start = b.add(k_start, k_off)?;
    let s = block_scores(b, (q, k), (q_start, k_start), (qdocs, kdocs), ch)?;
    Ok(Pair { q, k, v, s })
}

/// The masked scores of a query block [B, KV, TB, G, D] and a key block [B, KV, TB, D] whose
/// first tokens sit at natural positions `starts`: f32 [B, KV, TB, G, TB], `q . k / sqrt(D)`
/// (written in the scores' type first, as the whole-sequence form does), the lowest f32 where
/// the key is later than the query or outside its document.
pub(super) fn block_scores(
    b: &mut Builder,
    (q, k): (Value, Value),
    (q_start, k_start): (Value, Value),
    docs: (Value, Value),
    ch: Chunks,
) -> Result<Value> {
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![4],
        rhs_contract: vec![3],
    };
    let scores = b.dot_general(q, k, dims, None, Some(ch.num.scores))?;
    let scores = b.convert(scores, DType::F32)?;
    let scores = b.mul_scalar(scores, 1.0 / (ch.d as f64).sqrt())?;
    let tb = ch.tb;
    let square = Shape::new(&[tb, tb], DType::S32);
    let position = |b: &mut Builder, dim: i64, start: Value| -> Result<Value> {
        let at = b.iota(square.clone(), dim)?;
        let start = b.broadcast_in_dim(start, &[tb, tb], &[])?;
        b.add(at, start)
    };
    let q_pos = position(b, 0, q_start)?;
    let k_pos = position(b, 1, k_start)?;
    mask_scores(b, scores, (q_pos, k_pos), docs, &[0, 2, 4])
}

/// The probabilities of a block pair recomputed from the saved row statistic, and the scores'
/// cotangent: (p [B, KV, TB, G, TB] f32, ds in the compute type).
pub(super) fn probs_and_ds(
    b: &mut Builder,
    s: Value,
    v: Value,
    (dout, lse, delta): (Value, Value, Value),
    ch: Chunks,
) -> Result<(Value, Value)> {
    let sd = b.dims(s).to_vec();
    let keep = [0, 1, 2, 3];
    let lse_wide = b.broadcast_in_dim(lse, &sd, &keep)?;
    let shifted = b.sub(s, lse_wide)?;
    let probs = b.exp(shifted)?;
    // dp = dout v^T
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![4],
        rhs_contract: vec![3],
    };
    let dprobs = b.dot_general(dout, v, dims, None, Some(DType::F32))?;
    let delta_wide = b.broadcast_in_dim(delta, &sd, &keep)?;
    let centered = b.sub(dprobs, delta_wide)?;
    let ds = b.mul(probs, centered)?;
    let ds = b.mul_scalar(ds, 1.0 / (ch.d as f64).sqrt())?;
    let ds = b.convert(ds, ch.num.compute)?;
    Ok((probs, ds))
}

/// dv_j's and dk_j's shares of a block pair: (p^T dout, ds^T q), [B, KV, TB, D] f32.
pub(super) fn key_grads(
    b: &mut Builder,
    (probs, ds): (Value, Value),
    (q, dout): (Value, Value),
    ch: Chunks,
) -> Result<(Value, Value)> {
    let probs = b.convert(probs, ch.num.compute)?;
    let over_queries = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![2, 3],
        rhs_contract: vec![2, 3],
    };
    let dv = b.dot_general(probs, dout, over_queries.clone(), None, Some(DType::F32))?;
    let dk = b.dot_general(ds, q, over_queries, None, Some(DType::F32))?;
    Ok((dk, dv))
}

/// dq_i's share of a block pair: ds k, [B, KV, TB, G, D] f32.
pub(super) fn query_grad(b: &mut Builder, ds: Value, k: Value) -> Result<Value> {
    let dims = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![4],
        rhs_contract: vec![2],
    };
    b.dot_general(ds, k, dims, None, Some(DType::F32))
}

/// The block pair of inner trip `t` of the query pair (u, nb-1-u) whose first block's diagonal
/// key block is `a`: (slot, query block, key block).
pub(super) fn query_pair_trip(
    b: &mut Builder,
    t: Value,
    (u, a): (Value, Value),
    ch: Chunks,
) -> Result<(Value, Value, Value)> {
    let second = b.compare(t, a, CmpDir::Gt)?;
    let slot = b.convert(second, DType::S32)?;
    let one = s32(b, 1);
    let past = b.sub(t, a)?;
    let past = b.sub(past, one)?;
    let j = b.select(second, past, t)?;
    let last = s32(b, ch.nb() - 1);
    let mirrored = b.sub(last, u)?;
    let block = b.select(second, mirrored, u)?;
    Ok((slot, block, j))
}

/// The diagonal key block of query block u of the first chunk: c0 nb + u.
pub(super) fn first_diagonal(b: &mut Builder, ids: Value, u: Value, ch: Chunks) -> Result<Value> {
    let zero = s32(b, 0);
    let c0 = chunk_id(b, ids, zero)?;
    let base = times(b, c0, ch.nb())?;
    b.add(base, u)
}

/// One key block's step of the flash recurrence for scores `s` (f32, keys on the last dim)
/// and the rows' running max `m` and sum `l`: (exp(s - m'), exp(m - m'), m', l') with
/// m' = max(m, rowmax(s)) and l' = l exp(m - m') + rowsum(exp(s - m')).
pub(super) fn online_softmax_step(
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

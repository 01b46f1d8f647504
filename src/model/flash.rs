//! Causal attention over key/value blocks with the flash-attention recurrence, in nested loops:
//! the memory it needs grows with the sequence, not with its square, and no loop trip touches
//! more than a block or two of queries and keys.
//!
//! # The layout the loops see
//! Each device holds two *query chunks* of C tokens, padded to whole blocks of TB (Cp tokens,
//! nb = Cp / TB blocks each), and every key and value of the sequence in NC chunks laid out the
//! same way. Its chunks' natural indices `ids = (c0, c1)` are an operand, so that every device
//! runs the same program: on one device the sequence is cut in two halves (ids (0, 1), NC = 2);
//! over a `context` axis of CP devices, device r holds chunks r and 2CP-1-r of NC = 2CP
//! (`model::context`). Either way c0 + c1 = NC - 1, which is what balances the loops.
//!
//! # The forward pass
//! ```text
//! s    = q_i k_j^T / sqrt(D), masked            [TB, TB] per head: the only score block alive
//! m'   = max(m, rowmax(s))
//! p    = exp(s - m')
//! l'   = l exp(m - m') + rowsum(p)
//! acc' = acc exp(m - m') + p v_j
//! out_i = acc / l,  lse_i = m + log l            (once the row's last key block is in)
//! ```
//! The outer loop walks pairs of query blocks, block u of the first chunk and block nb-1-u of
//! the second: they see (c0 nb + u + 1) + (c1 nb + nb - u) = NC nb + 1 key blocks between them
//! on every device and in every trip, so the inner loop has a constant NK + 1 trips (NK = NC nb
//! key blocks) and never computes a block above the diagonal. Its carry is the pair's running
//! max, sum and output; the outer trip writes the pair's rows of the output once.
//!
//! # The backward pass
//! A rule of its own ([`hlo::Builder::custom_vjp`]) that recomputes each block's probabilities
//! `p = exp(s - lse_i)` from the saved row statistic, in two passes so that every inner loop
//! carries one block's gradients:
//! ```text
//! delta_i = rowsum(dout_i * out_i)              (once, before the loops)
//! dp      = dout_i v_j^T,   ds = p * (dp - delta_i) / sqrt(D)
//! dK/dV pass (outer: key blocks, inner: query blocks):  dv_j += p^T dout_i,  dk_j += ds^T q_i
//! dQ pass    (outer: query block pairs, inner: keys):   dq_i += ds k_j
//! ```
//! The dK/dV pass visits the same block pairs as the forward pass: for each query chunk, the key
//! blocks of earlier chunks against all its query blocks (a rectangle: (NC - 1) nb outer trips
//! of nb inner ones, over both chunks) and its own chunk's triangle (nb outer trips that pair
//! key block x of the first triangle with key block nb-1-x of the second: nb + 1 inner trips).
//!
//! Trip counts are constants, masks are iota compares (causal and document starts), and no loop
//! body branches. Grouped heads attend without repeating keys and values ([B, KV, ..., G, D]).
//!
//! # One op, replaceable
//! The forward and backward passes are each one `stablehlo.composite` ([`ATTENTION`] and
//! [`ATTENTION_GRAD`], version [`VERSION`]) whose decomposition is the nested loops above and
//! whose operands are one device's: a target may put a kernel of its own in the decomposition's
//! place before its compiler sees the program (`device::kernels`); every other target inlines
//! it. The attributes name what a kernel needs to know: the block, the chunk lengths, the scale
//! and the head counts.
//!
//! Masked scores are the lowest f32 rather than -inf, as in the whole-sequence form, so a row
//! with no visible key (a padding query) averages its block uniformly instead of dividing by
//! zero; such rows feed no loss.

use crate::model::forward::{mask_scores, Numerics, Saves};
use hlo::{Attr, Builder, CmpDir, DType, DotDims, Result, Shape, Value};
use std::rc::Rc;

/// The key/value block `--key-block auto` takes (see `program::KeyBlocks::resolve`).
pub const DEFAULT_KEY_BLOCK: i64 = 512;

/// The save point of the attention's row statistic `m + log l`, [B, KV, NC', Cp, G] f32: every
/// device's two query chunks (NC' = 2 on one device, 2CP over a context axis), padded.
pub const LSE: &str = "attn.lse";

/// The composites' names and version: what a kernel that replaces them is looked up by.
pub const ATTENTION: &str = "xtrain.attention";
pub const ATTENTION_GRAD: &str = "xtrain.attention_grad";
pub const VERSION: i32 = 1;

/// The key/value block for a sequence of `t` tokens on one device: the requested size, at
/// most half the sequence (the two query chunks hold one block or more each).
pub fn key_block(t: i64, requested: i64) -> i64 {
    requested.clamp(1, ((t + 1) / 2).max(1))
}

/// `t` rounded up to whole blocks of `tb`.
pub fn padded(t: i64, tb: i64) -> i64 {
    (t + tb - 1) / tb * tb
}

/// The [`LSE`] save point's shape on one device for batches of `bs` x `t` tokens.
pub fn lse_shape(bs: i64, t: i64, kv_heads: i64, groups: i64, tb: i64) -> Shape {
    let cp = padded(t, 2 * tb) / 2;
    Shape::new(&[bs, kv_heads, 2, cp, groups], DType::F32)
}

/// Trips of each of a layer's attention loop nests (forward, dQ, dK/dV) for `nb` blocks per
/// query chunk and `nk` key blocks: nb (NK + 1), what a cost model that counts a loop body once
/// leaves out.
pub fn nest_trips(nb: i64, nk: i64) -> i64 {
    nb * (nk + 1)
}

/// [`nest_trips`] on one device for `t` tokens and a requested key block.
pub fn loop_trips(t: i64, requested: i64) -> i64 {
    let tb = key_block(t, requested);
    let nb = padded(t, 2 * tb) / 2 / tb;
    nest_trips(nb, 2 * nb)
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

    fn nb(&self) -> i64 {
        self.cp / self.tb
    }

    fn nk(&self) -> i64 {
        self.nc * self.nb()
    }

    fn attributes(&self, heads: (i64, i64)) -> Vec<(String, Attr)> {
        vec![
            ("block".into(), Attr::Int(self.tb)),
            ("causal".into(), Attr::Str("balanced_chunk_pairs".into())),
            ("chunk".into(), Attr::Int(self.c)),
            ("chunks".into(), Attr::Int(self.nc)),
            ("head_dim".into(), Attr::Int(self.d)),
            ("kv_heads".into(), Attr::Int(heads.0)),
            ("padded_chunk".into(), Attr::Int(self.cp)),
            ("q_heads".into(), Attr::Int(heads.0 * heads.1)),
            ("scale".into(), Attr::Float(1.0 / (self.d as f64).sqrt())),
        ]
    }
}

/// softmax(q k^T / sqrt(D), masked) v over key/value blocks of `tb` on one device, for q
/// [B, T, KV, G, D], k and v [B, T, KV, D], `query_docs` [B, T] (where each query's document
/// starts, 0 for padding) and `key_docs` [B, T] (-1 for padding), with the masking rule of the
/// whole-sequence form (`model::llama::attend`). Returns the output [B, T, KV x G x D] after the
/// save points `out_point` (the output) and [`LSE`].
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
    let (bs, t, kvh, g, d) = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    // Two halves of whole blocks: the padding at the end is a key no query sees.
    let tp = padded(t, 2 * tb);
    let chunks = Chunks::new(2, tp / 2, tb, d, num);
    let pad = |b: &mut Builder, x: Value, fill: f64| pad_dim(b, x, 1, tp - t, fill);
    let ins = [
        pad(b, q, 0.0)?,
        pad(b, k, 0.0)?,
        pad(b, v, 0.0)?,
        pad(b, query_docs, 0.0)?,
        pad(b, key_docs, -1.0)?,
    ];
    let ids = one_device_ids(b)?;
    let fwd = forward_on_device(b, &ins, ids, chunks)?;
    let out = b.slice_dim(fwd[0], 1, 0, t)?;
    let out = b.reshape(out, &[bs, t, kvh * g * d])?;
    let out = saves.point(b, out_point, out)?;
    let lse = saves.point(b, LSE, fwd[1])?;
    let rule: hlo::VjpRule = Rc::new(move |b, ins, outs, cts| {
        let Some(dout) = cts[0] else {
            return Ok(vec![None; ins.len()]);
        };
        // out and its cotangent back as [B, T', KV, G, D], padded as the inputs are.
        let padded_rows = |b: &mut Builder, x: Value| -> Result<Value> {
            let x = b.reshape(x, &[bs, t, kvh, g, d])?;
            pad_dim(b, x, 1, tp - t, 0.0)
        };
        let out = padded_rows(b, outs[0])?;
        let dout = padded_rows(b, dout)?;
        let ids = one_device_ids(b)?;
        let grads = backward_on_device(b, ins, (ids, out, outs[1], dout), chunks)?;
        Ok(grads.into_iter().map(Some).chain([None, None]).collect())
    });
    let outs = b.custom_vjp(&ins, &[out, lse], rule);
    Ok(outs[0])
}

/// The chunk ids [1, 2] of one device: the sequence's two halves.
fn one_device_ids(b: &mut Builder) -> Result<Value> {
    b.constant(
        hlo::Literal::Int(vec![0, 1]),
        Shape::new(&[1, 2], DType::S32),
    )
}

/// `x` with `n` more rows of `fill` at the end of dim `dim`.
pub(crate) fn pad_dim(b: &mut Builder, x: Value, dim: usize, n: i64, fill: f64) -> Result<Value> {
    if n == 0 {
        return Ok(x);
    }
    let r = b.rank(x);
    let mut high = vec![0; r];
    high[dim] = n;
    let fill = b.scalar(fill, b.dtype(x));
    b.pad(x, fill, &vec![0; r], &high, &vec![0; r])
}

/// One device's forward pass, from its shard of the operands in the model's layout: q
/// [B, 2C, KV, G, D] (its two chunks), k and v [B, NC C, KV, D] (every chunk, natural order),
/// query starts [B, 2C], key starts [B, NC C] and its chunk ids [1, 2]. Returns (out
/// [B, 2C, KV, G, D], lse [B, KV, 2, Cp, G]).
pub(crate) fn forward_on_device(
    b: &mut Builder,
    ins: &[Value],
    ids: Value,
    ch: Chunks,
) -> Result<Vec<Value>> {
    let (q, k, v, qdocs, kdocs) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
    let qd = b.dims(q).to_vec();
    let (kvh, g) = (qd[2], qd[3]);
    let kin = [
        ("q", to_kernel_queries(b, q, ch)?),
        ("k", to_kernel_keys(b, k, ch)?),
        ("v", to_kernel_keys(b, v, ch)?),
        ("query_docs", to_kernel_rows(b, qdocs, 2, ch, 0.0)?),
        ("key_docs", to_kernel_keys_flat(b, kdocs, ch)?),
        ("chunk_ids", b.reshape(ids, &[2])?),
    ];
    let outs = b.composite(
        (ATTENTION, VERSION),
        ch.attributes((kvh, g)),
        &kin,
        |b, p| kernel_forward(b, p, ch),
    )?;
    Ok(vec![from_kernel_queries(b, outs[0], ch)?, outs[1]])
}

/// One device's backward pass: the operands as [`forward_on_device`] takes them, its chunk ids,
/// and (out, lse) with out's cotangent; returns the cotangents of q [B, 2C, KV, G, D], k and v
/// [B, NC C, KV, D] (this device's share: every device adds to every key).
pub(crate) fn backward_on_device(
    b: &mut Builder,
    ins: &[Value],
    (ids, out, lse, dout): (Value, Value, Value, Value),
    ch: Chunks,
) -> Result<Vec<Value>> {
    let (q, k, v, qdocs, kdocs) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
    let qd = b.dims(q).to_vec();
    let (kvh, g) = (qd[2], qd[3]);
    let kin = [
        ("q", to_kernel_queries(b, q, ch)?),
        ("k", to_kernel_keys(b, k, ch)?),
        ("v", to_kernel_keys(b, v, ch)?),
        ("query_docs", to_kernel_rows(b, qdocs, 2, ch, 0.0)?),
        ("key_docs", to_kernel_keys_flat(b, kdocs, ch)?),
        ("chunk_ids", b.reshape(ids, &[2])?),
        ("out", to_kernel_queries(b, out, ch)?),
        ("lse", lse),
        ("dout", to_kernel_queries(b, dout, ch)?),
    ];
    let outs = b.composite(
        (ATTENTION_GRAD, VERSION),
        ch.attributes((kvh, g)),
        &kin,
        |b, p| kernel_backward(b, p, ch),
    )?;
    let dq = from_kernel_queries(b, outs[0], ch)?;
    let dk = from_kernel_keys(b, outs[1], ch)?;
    let dv = from_kernel_keys(b, outs[2], ch)?;
    Ok(vec![dq, dk, dv])
}

// ------------------------------------------------------------ the kernel's layouts

/// [B, N C, ...] -> [B, N, Cp, ...]: each chunk padded to whole blocks with `fill`.
fn to_kernel_rows(b: &mut Builder, x: Value, n: i64, ch: Chunks, fill: f64) -> Result<Value> {
    let mut dims = b.dims(x).to_vec();
    dims.splice(1..2, [n, ch.c]);
    let x = b.reshape(x, &dims)?;
    pad_dim(b, x, 2, ch.cp - ch.c, fill)
}

/// Queries (or anything shaped like them) [B, 2C, KV, G, D] -> [B, KV, 2, Cp, G, D].
fn to_kernel_queries(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = to_kernel_rows(b, x, 2, ch, 0.0)?;
    b.transpose(x, &[0, 3, 1, 2, 4, 5])
}

/// [B, KV, 2, Cp, G, D] -> [B, 2C, KV, G, D], the padding cut off.
fn from_kernel_queries(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = b.slice_dim(x, 3, 0, ch.c)?;
    let x = b.transpose(x, &[0, 2, 3, 1, 4, 5])?;
    let d = b.dims(x).to_vec();
    b.reshape(x, &[d[0], 2 * ch.c, d[3], d[4], d[5]])
}

/// Keys or values [B, NC C, KV, D] -> [B, KV, NC Cp, D].
fn to_kernel_keys(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = to_kernel_rows(b, x, ch.nc, ch, 0.0)?;
    let x = b.transpose(x, &[0, 3, 1, 2, 4])?;
    let d = b.dims(x).to_vec();
    b.reshape(x, &[d[0], d[1], ch.nc * ch.cp, d[4]])
}

/// Key document starts [B, NC C] -> [B, NC Cp], the padding -1 (before every document).
fn to_kernel_keys_flat(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = to_kernel_rows(b, x, ch.nc, ch, -1.0)?;
    let bs = b.dims(x)[0];
    b.reshape(x, &[bs, ch.nc * ch.cp])
}

/// [B, KV, NC Cp, D] -> [B, NC C, KV, D], the padding cut off.
fn from_kernel_keys(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let d = b.dims(x).to_vec();
    let x = b.reshape(x, &[d[0], d[1], ch.nc, ch.cp, d[3]])?;
    let x = b.slice_dim(x, 3, 0, ch.c)?;
    let x = b.transpose(x, &[0, 2, 3, 1, 4])?;
    b.reshape(x, &[d[0], ch.nc * ch.c, d[1], d[3]])
}

// ------------------------------------------------------------ the kernel: block algebra

/// The kernel's inputs inside a loop body: q [B, KV, 2, Cp, G, D], k and v [B, KV, NC Cp, D],
/// query starts [B, 2, Cp], key starts [B, NC Cp], chunk ids [2].
#[derive(Clone, Copy)]
struct Tables {
    q: Value,
    k: Value,
    v: Value,
    query_docs: Value,
    key_docs: Value,
    ids: Value,
}

impl Tables {
    fn of(p: &[Value]) -> Tables {
        Tables {
            q: p[0],
            k: p[1],
            v: p[2],
            query_docs: p[3],
            key_docs: p[4],
            ids: p[5],
        }
    }

    fn list(&self) -> [Value; 6] {
        [
            self.q,
            self.k,
            self.v,
            self.query_docs,
            self.key_docs,
            self.ids,
        ]
    }
}

fn s32(b: &mut Builder, v: i64) -> Value {
    b.scalar(v as f64, DType::S32)
}

/// `x * k` for an s32 scalar `x`.
fn times(b: &mut Builder, x: Value, k: i64) -> Result<Value> {
    let k = s32(b, k);
    b.mul(x, k)
}

/// `x`'s `size` entries of dim `dim` from `start` (s32 scalar), the other dims whole.
fn window(b: &mut Builder, x: Value, dim: usize, start: Value, size: i64) -> Result<Value> {
    let zero = s32(b, 0);
    let starts: Vec<Value> = (0..b.rank(x))
        .map(|r| if r == dim { start } else { zero })
        .collect();
    let mut sizes = b.dims(x).to_vec();
    sizes[dim] = size;
    b.dynamic_slice(x, &starts, &sizes)
}

/// `x` with `new` written at `start` (s32 scalar) of dim `dim`.
fn put_window(b: &mut Builder, x: Value, new: Value, dim: usize, start: Value) -> Result<Value> {
    let zero = s32(b, 0);
    let starts: Vec<Value> = (0..b.rank(x))
        .map(|r| if r == dim { start } else { zero })
        .collect();
    b.dynamic_update_slice(x, new, &starts)
}

/// Rows `u TB ..` of chunk slot `slot` of a query-shaped table [B, KV, 2, Cp, ...]:
/// [B, KV, TB, ...].
fn query_rows(b: &mut Builder, x: Value, slot: Value, u: Value, tb: i64) -> Result<Value> {
    let x = window(b, x, 2, slot, 1)?;
    let at = times(b, u, tb)?;
    let x = window(b, x, 3, at, tb)?;
    let mut d = b.dims(x).to_vec();
    d.remove(2);
    b.reshape(x, &d)
}

/// One block's worth [B, KV, TB, ...] of a pair carry [B, KV, 2, TB, ...] at `slot`.
fn pair_slot(b: &mut Builder, pair: Value, slot: Value) -> Result<Value> {
    let x = window(b, pair, 2, slot, 1)?;
    let mut d = b.dims(x).to_vec();
    d.remove(2);
    b.reshape(x, &d)
}

fn put_pair_slot(b: &mut Builder, pair: Value, new: Value, slot: Value) -> Result<Value> {
    let mut d = b.dims(new).to_vec();
    d.insert(2, 1);
    let new = b.reshape(new, &d)?;
    put_window(b, pair, new, 2, slot)
}

/// Key block `j` of a key table [B, KV, NK TB, D] (or starts [B, NK TB]: `dim` 1).
fn key_rows(b: &mut Builder, x: Value, dim: usize, j: Value, tb: i64) -> Result<Value> {
    let at = times(b, j, tb)?;
    window(b, x, dim, at, tb)
}

/// The chunk id of slot `slot` (s32 scalar).
fn chunk_id(b: &mut Builder, ids: Value, slot: Value) -> Result<Value> {
    let x = b.dynamic_slice(ids, &[slot], &[1])?;
    b.reshape(x, &[])
}

/// One block pair's inputs: query block `u` of slot `slot` against key block `j`.
struct Pair {
    q: Value,
    k: Value,
    v: Value,
    /// Masked scores [B, KV, TB, G, TB] f32.
    s: Value,
}

fn pair(
    b: &mut Builder,
    t: &Tables,
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
    let chunk = chunk_id(b, t.ids, slot)?;
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
fn block_scores(
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
fn probs_and_ds(
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
fn key_grads(
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
fn query_grad(b: &mut Builder, ds: Value, k: Value) -> Result<Value> {
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
fn query_pair_trip(
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
fn first_diagonal(b: &mut Builder, ids: Value, u: Value, ch: Chunks) -> Result<Value> {
    let zero = s32(b, 0);
    let c0 = chunk_id(b, ids, zero)?;
    let base = times(b, c0, ch.nb())?;
    b.add(base, u)
}

// ------------------------------------------------------------ the kernel: loops

/// The forward decomposition: inputs (q, k, v, query starts, key starts, chunk ids) in the
/// kernel's layout; (out [B, KV, 2, Cp, G, D] in the compute type, lse [B, KV, 2, Cp, G]).
fn kernel_forward(b: &mut Builder, p: &[Value], ch: Chunks) -> Result<Vec<Value>> {
    let tab = Tables::of(p);
    let qd = b.dims(tab.q).to_vec();
    let (bs, kvh, g, d) = (qd[0], qd[1], qd[4], qd[5]);
    let init = [
        b.zeros(Shape::new(&[bs, kvh, 2, ch.cp, g, d], ch.num.compute)),
        b.zeros(Shape::new(&[bs, kvh, 2, ch.cp, g], DType::F32)),
    ];
    let out = b.scoped("forward", |b| {
        b.fori_loop(ch.nb(), &init, &tab.list(), |b, u, c, inv| {
            let tab = Tables::of(inv);
            let a = first_diagonal(b, tab.ids, u, ch)?;
            let rows = Shape::new(&[bs, kvh, 2, ch.tb, g], DType::F32);
            let init = [
                b.full(f32::MIN as f64, rows.clone()),
                b.zeros(rows),
                b.zeros(Shape::new(&[bs, kvh, 2, ch.tb, g, d], DType::F32)),
            ];
            let mut inv = tab.list().to_vec();
            inv.extend([u, a]);
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
        let zero = s32(b, 0);
        let slot = s32(b, slot);
        let starts: Vec<Value> = (0..b.rank(all))
            .map(|r| match r {
                2 => slot,
                3 => at,
                _ => zero,
            })
            .collect();
        all = b.dynamic_update_slice(all, x, &starts)?;
    }
    Ok(all)
}

/// One inner trip of the forward pass: the pair's running max, sum and output (carry) take in
/// one key block; invariants (the tables, u, a).
fn forward_trip(
    b: &mut Builder,
    t: Value,
    c: &[Value],
    inv: &[Value],
    ch: Chunks,
) -> Result<Vec<Value>> {
    let tab = Tables::of(inv);
    let (slot, block, j) = query_pair_trip(b, t, (inv[6], inv[7]), ch)?;
    let pr = pair(b, &tab, (slot, block, j), ch)?;
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

/// The backward decomposition: inputs (q, k, v, query starts, key starts, chunk ids, out, lse,
/// dout) in the kernel's layout; (dq [B, KV, 2, Cp, G, D], dk and dv [B, KV, NC Cp, D]) in the
/// inputs' types.
fn kernel_backward(b: &mut Builder, p: &[Value], ch: Chunks) -> Result<Vec<Value>> {
    let tab = Tables::of(p);
    let (out, lse, dout) = (p[6], p[7], p[8]);
    let delta = b.scoped("delta", |b| {
        let o = b.convert(out, DType::F32)?;
        let dof = b.convert(dout, DType::F32)?;
        let prod = b.mul(o, dof)?;
        b.reduce_sum(prod, &[5])
    })?;
    let rows = [dout, lse, delta];
    let dq = b.scoped("dq", |b| dq_pass(b, &tab, rows, ch))?;
    let (dk, dv) = b.scoped("dkv", |b| dkv_pass(b, &tab, rows, ch))?;
    Ok(vec![
        b.convert(dq, b.dtype(tab.q))?,
        b.convert(dk, b.dtype(tab.k))?,
        b.convert(dv, b.dtype(tab.v))?,
    ])
}

/// The dQ pass: outer over the query block pairs, inner over their key blocks (as the forward
/// pass), carrying the pair's dq.
fn dq_pass(b: &mut Builder, tab: &Tables, rows: [Value; 3], ch: Chunks) -> Result<Value> {
    let qd = b.dims(tab.q).to_vec();
    let (bs, kvh, g, d) = (qd[0], qd[1], qd[4], qd[5]);
    let init = [b.zeros(Shape::new(&[bs, kvh, 2, ch.cp, g, d], DType::F32))];
    let mut inv = tab.list().to_vec();
    inv.extend(rows);
    let out = b.fori_loop(ch.nb(), &init, &inv, |b, u, c, inv| {
        let tab = Tables::of(inv);
        let a = first_diagonal(b, tab.ids, u, ch)?;
        let init = [b.zeros(Shape::new(&[bs, kvh, 2, ch.tb, g, d], DType::F32))];
        let mut inner = inv.to_vec();
        inner.extend([u, a]);
        let run = b.rolled_fori_loop(ch.nk() + 1, &init, &inner, |b, t, c, inv| {
            let tab = Tables::of(inv);
            let (slot, block, j) = query_pair_trip(b, t, (inv[9], inv[10]), ch)?;
            let pr = pair(b, &tab, (slot, block, j), ch)?;
            let dout = query_rows(b, inv[6], slot, block, ch.tb)?;
            let lse = query_rows(b, inv[7], slot, block, ch.tb)?;
            let delta = query_rows(b, inv[8], slot, block, ch.tb)?;
            let (_, ds) = probs_and_ds(b, pr.s, pr.v, (dout, lse, delta), ch)?;
            let dq = query_grad(b, ds, pr.k)?;
            let old = pair_slot(b, c[0], slot)?;
            let new = b.add(old, dq)?;
            Ok(vec![put_pair_slot(b, c[0], new, slot)?])
        })?;
        Ok(vec![write_pair(b, c[0], run[0], u, ch)?])
    })?;
    Ok(out[0])
}

/// The dK/dV pass: outer over key blocks, inner over the query blocks that see them, carrying
/// the key block's dk and dv; the rectangles of earlier chunks first, then the two triangles.
fn dkv_pass(b: &mut Builder, tab: &Tables, rows: [Value; 3], ch: Chunks) -> Result<(Value, Value)> {
    let kd = b.dims(tab.k).to_vec();
    let (bs, kvh, d) = (kd[0], kd[1], kd[3]);
    let init = [
        b.zeros(Shape::new(&[bs, kvh, ch.nc * ch.cp, d], DType::F32)),
        b.zeros(Shape::new(&[bs, kvh, ch.nc * ch.cp, d], DType::F32)),
    ];
    let mut inv = tab.list().to_vec();
    inv.extend(rows);
    let nb = ch.nb();
    // The rectangles: key block j of an earlier chunk than query chunk `slot`, against each of
    // its nb query blocks. Outer trip o: slot 0's c0 nb blocks, then slot 1's c1 nb.
    let rect = b.scoped("rectangles", |b| {
        b.fori_loop((ch.nc - 1) * nb, &init, &inv, |b, o, c, inv| {
            let tab = Tables::of(inv);
            let zero = s32(b, 0);
            let c0 = chunk_id(b, tab.ids, zero)?;
            let first = times(b, c0, nb)?;
            let second = b.compare(o, first, CmpDir::Ge)?;
            let slot = b.convert(second, DType::S32)?;
            let later = b.sub(o, first)?;
            let j = b.select(second, later, o)?;
            let key = Shape::new(&[bs, kvh, ch.tb, d], DType::F32);
            let init = [b.zeros(key.clone()), b.zeros(key)];
            let mut inner = inv.to_vec();
            inner.extend([slot, j]);
            let run = b.rolled_fori_loop(nb, &init, &inner, |b, u, c, inv| {
                let (slot, j) = (inv[9], inv[10]);
                let (dk, dv) = key_trip(b, inv, (slot, u, j), ch)?;
                Ok(vec![b.add(c[0], dk)?, b.add(c[1], dv)?])
            })?;
            Ok(vec![
                add_key_block(b, c[0], run[0], j, ch)?,
                add_key_block(b, c[1], run[1], j, ch)?,
            ])
        })
    })?;
    // The triangles: key block x of chunk c0 (seen by its query blocks x..nb) with key block
    // nb-1-x of chunk c1 (seen by nb-1-x..nb): nb + 1 query blocks in all.
    let tri = b.scoped("triangles", |b| {
        b.fori_loop(nb, &rect, &inv, |b, x, c, inv| {
            let tab = Tables::of(inv);
            let key = Shape::new(&[bs, kvh, 2, ch.tb, d], DType::F32);
            let init = [b.zeros(key.clone()), b.zeros(key)];
            let mut inner = inv.to_vec();
            inner.push(x);
            // Not a priced loop: its trips cost what the rectangles' do, and the estimate
            // counts the nest's trips as the rectangles' and the triangles' together.
            let run = b.fori_loop(nb + 1, &init, &inner, |b, t, c, inv| {
                let x = inv[9];
                let nbv = s32(b, nb);
                let split = b.sub(nbv, x)?;
                let second = b.compare(t, split, CmpDir::Ge)?;
                let slot = b.convert(second, DType::S32)?;
                let ones = s32(b, 1);
                let first_u = b.add(x, t)?;
                let second_u = b.sub(t, ones)?;
                let u = b.select(second, second_u, first_u)?;
                let tab = Tables::of(inv);
                let j = {
                    let chunk = chunk_id(b, tab.ids, slot)?;
                    let base = b.mul(chunk, nbv)?;
                    let last = s32(b, nb - 1);
                    let mirrored = b.sub(last, x)?;
                    let off = b.select(second, mirrored, x)?;
                    b.add(base, off)?
                };
                let (dk, dv) = key_trip(b, inv, (slot, u, j), ch)?;
                let add = |b: &mut Builder, pair: Value, g: Value| -> Result<Value> {
                    let old = pair_slot(b, pair, slot)?;
                    let new = b.add(old, g)?;
                    put_pair_slot(b, pair, new, slot)
                };
                Ok(vec![add(b, c[0], dk)?, add(b, c[1], dv)?])
            })?;
            let mut out = c.to_vec();
            for slot in 0..2 {
                let nbv = s32(b, nb);
                let sv = s32(b, slot);
                let chunk = chunk_id(b, tab.ids, sv)?;
                let base = b.mul(chunk, nbv)?;
                let off = match slot {
                    0 => x,
                    _ => {
                        let last = s32(b, nb - 1);
                        b.sub(last, x)?
                    }
                };
                let j = b.add(base, off)?;
                for (k, o) in out.iter_mut().enumerate() {
                    let g = b.slice_dim(run[k], 2, slot, slot + 1)?;
                    let gd = b.dims(g).to_vec();
                    let g = b.reshape(g, &[gd[0], gd[1], gd[3], gd[4]])?;
                    *o = add_key_block(b, *o, g, j, ch)?;
                }
            }
            Ok(out)
        })
    })?;
    Ok((tri[0], tri[1]))
}

/// One dK/dV trip: query block `u` of slot `slot` against key block `j`; invariants (the
/// tables, dout, lse, delta, ...). Returns (dk_j, dv_j) shares [B, KV, TB, D] f32.
fn key_trip(
    b: &mut Builder,
    inv: &[Value],
    (slot, u, j): (Value, Value, Value),
    ch: Chunks,
) -> Result<(Value, Value)> {
    let tab = Tables::of(inv);
    let pr = pair(b, &tab, (slot, u, j), ch)?;
    let dout = query_rows(b, inv[6], slot, u, ch.tb)?;
    let lse = query_rows(b, inv[7], slot, u, ch.tb)?;
    let delta = query_rows(b, inv[8], slot, u, ch.tb)?;
    let (probs, ds) = probs_and_ds(b, pr.s, pr.v, (dout, lse, delta), ch)?;
    key_grads(b, (probs, ds), (pr.q, dout), ch)
}

/// `all` [B, KV, NK TB, D] with `g` [B, KV, TB, D] added to key block `j`.
fn add_key_block(b: &mut Builder, all: Value, g: Value, j: Value, ch: Chunks) -> Result<Value> {
    let old = key_rows(b, all, 2, j, ch.tb)?;
    let new = b.add(old, g)?;
    let at = times(b, j, ch.tb)?;
    put_window(b, all, new, 2, at)
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

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
//! `p = exp(s - lse_i)` from the saved row statistic, in one pass over key blocks whose inner
//! loop carries one key block's gradients:
//! ```text
//! delta_i = rowsum(dout_i * out_i)              (once, before the loops)
//! dp      = dout_i v_j^T,   ds = p * (dp - delta_i) / sqrt(D)
//! outer: key blocks j, inner: the query blocks i that see them
//!   dv_j += p^T dout_i,  dk_j += ds^T q_i       (the inner loop's carry)
//!   dq_i += ds k_j                              (added in place to query block i's rows)
//! ```
//! It visits the same block pairs as the forward pass: for each query chunk, the key blocks of
//! earlier chunks against all its query blocks (a rectangle: (NC - 1) nb outer trips of nb
//! inner ones, over both chunks) and its own chunk's triangle (nb outer trips that pair key
//! block x of the first triangle with key block nb-1-x of the second: nb + 1 inner trips).
//!
//! Why one pass and not the two of FlashAttention-2 (a dK/dV pass, and a dQ pass over query
//! blocks whose inner loop carries one block's dq): the second pass recomputes every block
//! pair's scores and `dout v^T` again, 7 block matmuls per pair instead of 5. The dq buffer the
//! one pass carries is as long as the device's queries, but each trip only adds to one block of
//! it, in place: the compilers keep it in place (no copy of it in any loop body on the CPU,
//! CUDA, ROCm or TPU; `tools/hlo-loop-copies.py`), and the figures of docs/performance.md
//! ("Long context in nested loops") favour it on the CPU, the CUDA compiler and the TPU
//! estimate alike.
//!
//! Trip counts are constants, masks are iota compares (causal and document starts), and no loop
//! body branches. Grouped heads attend without repeating keys and values ([B, KV, ..., G, D]).
//!
//! # One op, replaceable
//! The forward and backward passes are each one `stablehlo.composite` ([`ATTENTION`] and
//! [`ATTENTION_GRAD`], version [`VERSION`]) whose decomposition is the nested loops above and
//! whose operands are one device's: a target may put a kernel of its own in the decomposition's
//! place before its compiler sees the program (`device::kernels`); every other target inlines
//! it. The attributes name what a kernel needs to know: the block, the chunk lengths, the scale,
//! the head counts and the causal rule. Names, operands and attributes are written once, in
//! `contract.rs`, which the loops here and every kernel read them through.
//!
//! Masked scores are the lowest f32 rather than -inf, as in the whole-sequence form, so a row
//! with no visible key (a padding query) averages its block uniformly instead of dividing by
//! zero; such rows feed no loss.

mod blocks;
mod contract;
mod loops;

use crate::model::forward::{Numerics, Placement, Saves};
pub use blocks::{padded, Chunks};
pub use contract::{
    Attributes, ContractError, GradOperands, Operands, ATTENTION, ATTENTION_GRAD, CAUSAL_RULE,
    VERSION,
};
use hlo::{Builder, DType, Result, Shape, Sharding, Value};
use loops::{backward_loops, forward_loops};
use std::rc::Rc;

/// The key/value block `--key-block auto` takes (see `program::KeyBlocks::resolve`).
pub const DEFAULT_KEY_BLOCK: i64 = 512;

/// The save point of the attention's row statistic `m + log l`, [B, KV, NC', Cp, G] f32: every
/// device's two query chunks (NC' = 2 on one device, 2CP over a context axis), padded.
pub const LSE: &str = "attn.lse";

/// The key/value block for a sequence of `t` tokens on one device: the requested size, at
/// most half the sequence (the two query chunks hold one block or more each).
pub fn key_block(t: i64, requested: i64) -> i64 {
    requested.clamp(1, ((t + 1) / 2).max(1))
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

/// softmax(q k^T / sqrt(D), masked) v over key/value blocks of `tb` on one device, for q
/// [B, T, KV, G, D], k and v [B, T, KV, D], `query_docs` [B, T] (where each query's document
/// starts, 0 for padding) and `key_docs` [B, T] (-1 for padding), with the masking rule of the
/// whole-sequence form (`model::attention::attend`). Returns the output [B, T, KV x G x D] after the
/// save points `out_point` (the output) and [`LSE`].
///
/// On a `mesh` (without a context axis) the loops run per device in a manual computation, each
/// device on its shard of the batch and heads (as the mesh's rules cut the queries), so that
/// the composites' operands are one device's there too: a kernel in their place sees the
/// shapes it runs on, and the partitioner has no loop to propagate shardings through.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    b: &mut Builder,
    q: Value,
    k: Value,
    v: Value,
    (query_docs, key_docs): (Value, Value),
    tb: i64,
    num: Numerics,
    saves: (&str, &mut Saves),
    mesh: Option<&dyn Placement>,
) -> Result<Value> {
    let qd = b.dims(q).to_vec();
    let dims = (qd[0], qd[1], qd[2], qd[3], qd[4]);
    let t = dims.1;
    // Two halves of whole blocks: the padding at the end is a key no query sees.
    let tp = padded(t, 2 * tb);
    let wiring = PerDevice {
        ch: Chunks::new(2, tp / 2, tb, dims.4, num),
        cuts: mesh.map(|p| Cuts::of(p, dims, "none")),
        chunk_ids: vec![0, 1],
        dims,
        padding_cut: true,
        key_sum: None,
    };
    let pad = |b: &mut Builder, x: Value, fill: f64| pad_dim(b, x, 1, tp - t, fill);
    let ins = [
        pad(b, q, 0.0)?,
        pad(b, k, 0.0)?,
        pad(b, v, 0.0)?,
        pad(b, query_docs, 0.0)?,
        pad(b, key_docs, -1.0)?,
    ];
    wiring.attend(b, ins, saves)
}

/// How each device's key gradients become the keys' (over a context axis every device adds to
/// every key): `share` shapes one device's [B, NC C, KV, D] as its row of [B, CP, ...] inside
/// the manual computation, `sum` adds the rows up after it.
#[derive(Clone, Copy)]
pub(crate) struct KeySum {
    pub(crate) share: fn(&mut Builder, Value) -> Result<Value>,
    pub(crate) sum: fn(&mut Builder, Value) -> Result<Value>,
}

/// One device's attention wired into the step, written once for the one-device form
/// ([`attend`]) and the context form (`model::context::attend`): the loops (or a kernel in their
/// place) per device, in a manual computation where there is a mesh, the save points, and a
/// gradient rule that runs the backward composite on what the forward saved.
pub(crate) struct PerDevice {
    pub(crate) ch: Chunks,
    pub(crate) cuts: Option<Cuts>,
    /// Each device's chunk ids, two per device: the rows of the `chunk_ids` operand [n, 2].
    pub(crate) chunk_ids: Vec<i64>,
    /// The queries' (B, T, KV, G, D), T the natural length.
    pub(crate) dims: (i64, i64, i64, i64, i64),
    /// Whether the operands were padded at the end (the one-device form): the output is cut
    /// back to T rows.
    pub(crate) padding_cut: bool,
    pub(crate) key_sum: Option<KeySum>,
}

impl PerDevice {
    /// The attention of `ins` (q, k, v, query starts, key starts in the model's layout, as
    /// every device's operands are cut from them): [B, T, KV x G x D] after the save points.
    pub(crate) fn attend(
        self,
        b: &mut Builder,
        ins: [Value; 5],
        (out_point, saves): (&str, &mut Saves),
    ) -> Result<Value> {
        let (bs, t, kvh, g, d) = self.dims;
        let ids = self.ids(b)?;
        let fwd = self.forward(b, &with_ids(&ins, ids))?;
        let out = match self.padding_cut {
            true => b.slice_dim(fwd[0], 1, 0, t)?,
            false => fwd[0],
        };
        let out = b.reshape(out, &[bs, t, kvh * g * d])?;
        let out = saves.point(b, out_point, out)?;
        let lse = saves.point(b, LSE, fwd[1])?;
        let rows = self.ch.nc * self.ch.c;
        let rule: hlo::VjpRule = Rc::new(move |b, ins, outs, cts| {
            let Some(dout) = cts[0] else {
                return Ok(vec![None; ins.len()]);
            };
            // out and its cotangent back as [B, T', KV, G, D], padded as the inputs are.
            let padded_rows = |b: &mut Builder, x: Value| -> Result<Value> {
                let x = b.reshape(x, &[bs, t, kvh, g, d])?;
                pad_dim(b, x, 1, rows - t, 0.0)
            };
            let out = padded_rows(b, outs[0])?;
            let dout = padded_rows(b, dout)?;
            let ids = self.ids(b)?;
            let grads = self.backward(
                b,
                &GradOperands {
                    ins: with_ids(ins, ids),
                    out,
                    lse: outs[1],
                    dout,
                },
            )?;
            let none = ins.len() - grads.len();
            Ok(grads
                .into_iter()
                .map(Some)
                .chain(vec![None; none])
                .collect())
        });
        let outs = b.custom_vjp(&ins, &[out, lse], rule);
        Ok(outs[0])
    }

    fn ids(&self, b: &mut Builder) -> Result<Value> {
        let n = self.chunk_ids.len() as i64 / 2;
        b.constant(
            hlo::Literal::Int(self.chunk_ids.clone()),
            Shape::new(&[n, 2], DType::S32),
        )
    }

    /// The forward composite per device: (out [B, T', KV, G, D], lse).
    fn forward(&self, b: &mut Builder, ins: &Operands<Value>) -> Result<Vec<Value>> {
        let ch = self.ch;
        match &self.cuts {
            None => forward_on_device(b, ins, ch),
            Some(c) => b.manual_computation(
                &c.mesh,
                &cut(&ins.list(), &c.operands().list()),
                &[c.q.clone(), c.lse.clone()],
                |b, l| forward_on_device(b, &Operands::of(l), ch),
            ),
        }
    }

    /// The backward composite per device: the cotangents of q, k and v (the keys' summed over
    /// the devices where each computes a share).
    fn backward(&self, b: &mut Builder, ins: &GradOperands<Value>) -> Result<Vec<Value>> {
        let ch = self.ch;
        let Some(c) = &self.cuts else {
            return backward_on_device(b, ins, ch);
        };
        let cuts = GradOperands {
            ins: c.operands(),
            out: c.q.clone(),
            lse: c.lse.clone(),
            dout: c.q.clone(),
        };
        let keys = match self.key_sum {
            Some(_) => c.dkv.clone(),
            None => c.kv.clone(),
        };
        let key_sum = self.key_sum;
        let grads = b.manual_computation(
            &c.mesh,
            &cut(&ins.list(), &cuts.list()),
            &[c.q.clone(), keys.clone(), keys],
            |b, l| {
                let g = backward_on_device(b, &GradOperands::of(l), ch)?;
                match key_sum {
                    Some(s) => Ok(vec![g[0], (s.share)(b, g[1])?, (s.share)(b, g[2])?]),
                    None => Ok(g),
                }
            },
        )?;
        match self.key_sum {
            Some(s) => Ok(vec![grads[0], (s.sum)(b, grads[1])?, (s.sum)(b, grads[2])?]),
            None => Ok(grads),
        }
    }
}

/// The model-layout operands (q, k, v, query and key starts) and the chunk ids.
fn with_ids(ins: &[Value], ids: Value) -> Operands<Value> {
    let [q, k, v, query_docs, key_docs] = ins[..5].try_into().expect("five operands");
    Operands {
        q,
        k,
        v,
        query_docs,
        key_docs,
        chunk_ids: ids,
    }
}

/// Values with their cuts, for a manual computation.
fn cut(values: &[Value], cuts: &[Sharding]) -> Vec<(Value, Sharding)> {
    values.iter().copied().zip(cuts.iter().cloned()).collect()
}

/// How the per-device attention's operands and results are cut over the mesh, taken from the
/// placement while it is at hand (the gradient rule outlives it). The queries' sharding decides:
/// its batch, sequence and head axes cut every other tensor alike, so that each device holds
/// matching shards: queries [B, T, KV, G, D] and their output; keys and values [B, T, KV, D],
/// whole along the sequence; the query and key document starts [B, T]; the chunk ids [CP, 2];
/// the row statistic [B, KV, 2CP, Cp, G]; each device's key gradients [B, CP, T, KV, D]. Over
/// a context axis (`model::context`) the sequence is cut (`sequence` = "length"); on a mesh
/// without one ([`attend`]) it is whole ("none"), each device on its own rows and heads.
#[derive(Clone)]
pub(crate) struct Cuts {
    pub(crate) mesh: hlo::Mesh,
    pub(crate) q: Sharding,
    pub(crate) kv: Sharding,
    pub(crate) qdocs: Sharding,
    pub(crate) kdocs: Sharding,
    pub(crate) ids: Sharding,
    pub(crate) lse: Sharding,
    pub(crate) dkv: Sharding,
}

impl Cuts {
    pub(crate) fn of(p: &dyn Placement, dims: (i64, i64, i64, i64, i64), sequence: &str) -> Cuts {
        let (bs, t, kvh, g, d) = dims;
        let q = p.place(
            &["batch", sequence, "kv_heads", "none", "none"],
            &[bs, t, kvh, g, d],
        );
        let (batch, length, heads) = (q.dims[0].clone(), q.dims[1].clone(), q.dims[2].clone());
        let none = Vec::new;
        let cut = |dims: Vec<Vec<String>>| Sharding { dims };
        Cuts {
            mesh: p.mesh(),
            kv: cut(vec![batch.clone(), none(), heads.clone(), none()]),
            qdocs: cut(vec![batch.clone(), length.clone()]),
            kdocs: cut(vec![batch.clone(), none()]),
            ids: cut(vec![length.clone(), none()]),
            lse: cut(vec![
                batch.clone(),
                heads.clone(),
                length.clone(),
                none(),
                none(),
            ]),
            dkv: cut(vec![batch, length, none(), heads, none()]),
            q,
        }
    }

    /// How the composites' operands are cut (model layout: `flash::attend`'s).
    pub(crate) fn operands(&self) -> Operands<Sharding> {
        Operands {
            q: self.q.clone(),
            k: self.kv.clone(),
            v: self.kv.clone(),
            query_docs: self.qdocs.clone(),
            key_docs: self.kdocs.clone(),
            chunk_ids: self.ids.clone(),
        }
    }
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
fn forward_on_device(b: &mut Builder, ins: &Operands<Value>, ch: Chunks) -> Result<Vec<Value>> {
    let (kvh, g) = (b.dims(ins.q)[2], b.dims(ins.q)[3]);
    let laid = loops_operands(b, ins, ch)?;
    let outs = b.composite(
        (ATTENTION, VERSION),
        ch.attributes((kvh, g)).to_attrs(),
        &laid.named(),
        |b, p| forward_loops(b, &Operands::of(p), ch),
    )?;
    Ok(vec![from_loops_queries(b, outs[0], ch)?, outs[1]])
}

/// One device's backward pass: the operands as [`forward_on_device`] takes them, and (out, lse)
/// with out's cotangent; returns the cotangents of q [B, 2C, KV, G, D], k and v [B, NC C, KV, D]
/// (this device's share: every device adds to every key).
fn backward_on_device(
    b: &mut Builder,
    ins: &GradOperands<Value>,
    ch: Chunks,
) -> Result<Vec<Value>> {
    let (kvh, g) = (b.dims(ins.ins.q)[2], b.dims(ins.ins.q)[3]);
    let laid = GradOperands {
        ins: loops_operands(b, &ins.ins, ch)?,
        out: to_loops_queries(b, ins.out, ch)?,
        lse: ins.lse,
        dout: to_loops_queries(b, ins.dout, ch)?,
    };
    let outs = b.composite(
        (ATTENTION_GRAD, VERSION),
        ch.attributes((kvh, g)).to_attrs(),
        &laid.named(),
        |b, p| backward_loops(b, &GradOperands::of(p), ch),
    )?;
    let dq = from_loops_queries(b, outs[0], ch)?;
    let dk = from_loops_keys(b, outs[1], ch)?;
    let dv = from_loops_keys(b, outs[2], ch)?;
    Ok(vec![dq, dk, dv])
}

// ------------------------------------------------------------ the composites' layouts

/// The composites' first operands in the loops' layout (the composites'), from the model's
/// (see [`forward_on_device`]).
fn loops_operands(b: &mut Builder, ins: &Operands<Value>, ch: Chunks) -> Result<Operands<Value>> {
    Ok(Operands {
        q: to_loops_queries(b, ins.q, ch)?,
        k: to_loops_keys(b, ins.k, ch)?,
        v: to_loops_keys(b, ins.v, ch)?,
        query_docs: to_loops_rows(b, ins.query_docs, 2, ch, 0.0)?,
        key_docs: to_loops_keys_flat(b, ins.key_docs, ch)?,
        chunk_ids: b.reshape(ins.chunk_ids, &[2])?,
    })
}

/// [B, N C, ...] -> [B, N, Cp, ...]: each chunk padded to whole blocks with `fill`.
fn to_loops_rows(b: &mut Builder, x: Value, n: i64, ch: Chunks, fill: f64) -> Result<Value> {
    let mut dims = b.dims(x).to_vec();
    dims.splice(1..2, [n, ch.c]);
    let x = b.reshape(x, &dims)?;
    pad_dim(b, x, 2, ch.cp - ch.c, fill)
}

/// Queries (or anything shaped like them) [B, 2C, KV, G, D] -> [B, KV, 2, Cp, G, D].
fn to_loops_queries(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = to_loops_rows(b, x, 2, ch, 0.0)?;
    b.transpose(x, &[0, 3, 1, 2, 4, 5])
}

/// [B, KV, 2, Cp, G, D] -> [B, 2C, KV, G, D], the padding cut off.
fn from_loops_queries(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = b.slice_dim(x, 3, 0, ch.c)?;
    let x = b.transpose(x, &[0, 2, 3, 1, 4, 5])?;
    let d = b.dims(x).to_vec();
    b.reshape(x, &[d[0], 2 * ch.c, d[3], d[4], d[5]])
}

/// Keys or values [B, NC C, KV, D] -> [B, KV, NC Cp, D].
fn to_loops_keys(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = to_loops_rows(b, x, ch.nc, ch, 0.0)?;
    let x = b.transpose(x, &[0, 3, 1, 2, 4])?;
    let d = b.dims(x).to_vec();
    b.reshape(x, &[d[0], d[1], ch.nc * ch.cp, d[4]])
}

/// Key document starts [B, NC C] -> [B, NC Cp], the padding -1 (before every document).
fn to_loops_keys_flat(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let x = to_loops_rows(b, x, ch.nc, ch, -1.0)?;
    let bs = b.dims(x)[0];
    b.reshape(x, &[bs, ch.nc * ch.cp])
}

/// [B, KV, NC Cp, D] -> [B, NC C, KV, D], the padding cut off.
fn from_loops_keys(b: &mut Builder, x: Value, ch: Chunks) -> Result<Value> {
    let d = b.dims(x).to_vec();
    let x = b.reshape(x, &[d[0], d[1], ch.nc, ch.cp, d[3]])?;
    let x = b.slice_dim(x, 3, 0, ch.c)?;
    let x = b.transpose(x, &[0, 2, 3, 1, 4])?;
    b.reshape(x, &[d[0], ch.nc * ch.c, d[1], d[3]])
}

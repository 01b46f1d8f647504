//! The MLP over a tile of N positions at a time (`--mlp-chunk N`), so that none of its
//! [B, T, intermediate] tensors (the gate and up projections, their product, the LoRA
//! dropout's mask of the down projection's input) exists whole: at 131,072 tokens of 8B each
//! is 3.5 GiB in bf16, and the whole MLP holds several.
//!
//! ```text
//! forward:   y[:, tile] = MLP(x[:, tile])                     for each tile, in a loop
//! backward:  recompute MLP(x[:, tile]), its vjp with dy[:, tile]:
//!            dx[:, tile] = ...,  dA, dB += ...                 for each tile, in a loop
//! ```
//! The MLP works on each position alone, so the tiles are the same arithmetic as the whole: the
//! same per-position values; the LoRA gradients are the same sums over positions, added tile by
//! tile. A loop has no generic gradient, so the tiles are one computation with a rule of its own
//! ([`hlo::Builder::custom_vjp`]) whose backward loop recomputes each tile's forward pass: the
//! layer's own recomputation (`--remat layer`) computes the MLP's output for nothing, and the
//! compilers drop that loop as dead code. With `--remat save-proj` the MLP's projections are
//! not saved (they would be whole), so its backward pass recomputes them.
//!
//! A sequence that the tiles do not divide is padded with zero rows to whole tiles: their
//! outputs are cut off and their cotangents are zero, so they add nothing to any gradient.
//! Each tile's LoRA dropout draws its tokens' masks at their own positions
//! ([`LayerContext::tile_start`]), the masks of the whole sequence.

use crate::model::config::LlamaConfig;
use crate::model::forward::{Numerics, Placement, Saves};
use crate::model::llama::{LayerAdapters, LayerContext, Llama, LoraPair};
use crate::model::lora::Projection;
use hlo::{Builder, DType, Mesh, Result, Shape, Sharding, Value};
use std::rc::Rc;

/// The MLP's three projections, in the order their LoRA pairs are the tiles' operands.
const MLP: [Projection; 3] = [Projection::Gate, Projection::Up, Projection::Down];

/// What one tile of the MLP is computed with, owned so that the gradient rule (which outlives
/// the model's borrowed config and placement) can rebuild it.
#[derive(Clone)]
struct Tiles {
    cfg: LlamaConfig,
    num: Numerics,
    /// The tile's hidden activations' sharding on the mesh, with `--pin-mlp-activations`.
    pins: Option<TilePins>,
    lora_scale: f64,
    dropout: Option<f64>,
    /// The MLP's projections that carry LoRA, in [`MLP`] order.
    adapted: Vec<Projection>,
    /// Positions per tile, tiles, and the batch rows and hidden size of `x`.
    n: i64,
    count: i64,
    rows: i64,
    hidden: i64,
}

/// The placement the MLP's pins ask for, for one tile's shape (taken from the mesh's placement
/// while it is at hand): every pin in the MLP is of its hidden activations [B, N, F].
#[derive(Clone)]
struct TilePins {
    mesh: Mesh,
    hidden: Sharding,
}

impl Placement for TilePins {
    fn place(&self, _logical: &[&str], _dims: &[i64]) -> Sharding {
        self.hidden.clone()
    }

    fn mesh(&self) -> Mesh {
        self.mesh.clone()
    }
}

/// The element type a tensor written a tile at a time is kept in: bf16 and f16 as their bits,
/// so that each tile's write is in place on every backend (XLA CPU computes a bf16
/// dynamic-update-slice in f32, copying the whole buffer: `program::layout::stack_type`).
fn written_type(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::U16,
        d => d,
    }
}

impl Llama<'_> {
    /// Positions per MLP tile for a sequence of `t` (None: the MLP over the whole sequence): the
    /// requested chunk where it is shorter than the sequence. One rule for the layers and for
    /// the remat policy's save points (the tiles save none of the MLP's projections).
    pub fn mlp_tile(&self, t: i64) -> Option<i64> {
        self.num.mlp_chunk.filter(|&n| n >= 1 && n < t)
    }

    /// The MLP (`Llama::mlp`) over tiles of `n` positions of `x` [B, T, H], in a loop with a
    /// gradient rule that recomputes each tile (module docs).
    pub(super) fn mlp_in_tiles(
        &self,
        b: &mut Builder,
        x: Value,
        weights: [Value; 3],
        lora: &LayerAdapters,
        ctx: &LayerContext,
        n: i64,
    ) -> Result<Value> {
        let (rows, t, hidden) = (b.dims(x)[0], b.dims(x)[1], b.dims(x)[2]);
        let count = (t + n - 1) / n;
        let adapted: Vec<Projection> = MLP.into_iter().filter(|p| lora.contains_key(p)).collect();
        let f = self.cfg.intermediate_size;
        let pins = self.placement.map(|p| TilePins {
            mesh: p.mesh(),
            hidden: p.place(&["batch", "length", "mlp"], &[rows, n, f]),
        });
        let tiles = Tiles {
            cfg: self.cfg.clone(),
            num: self.num,
            pins,
            lora_scale: ctx.lora_scale,
            dropout: ctx.dropout.map(|(p, _)| p),
            adapted,
            n,
            count,
            rows,
            hidden,
        };
        // The operands: x padded to whole tiles, the frozen weights, the LoRA pairs, the key.
        let mut ins = vec![pad_rows(b, x, count * n - t)?];
        ins.extend(weights);
        for p in &tiles.adapted {
            ins.extend([lora[p].a, lora[p].b]);
        }
        ins.extend(ctx.dropout.map(|(_, key)| key));
        let out = b.scoped("mlp_tiles", |b| tiles.forward(b, &ins))?;
        let out = b.slice_dim(out, 1, 0, t)?;
        let rule: hlo::VjpRule = Rc::new(move |b, ins, _outs, cts| {
            let Some(dy) = cts[0] else {
                return Ok(vec![None; ins.len()]);
            };
            b.scoped("mlp_tiles", |b| tiles.backward(b, ins, dy))
        });
        Ok(b.custom_vjp(&ins, &[out], rule)[0])
    }
}

impl Tiles {
    /// The LoRA pairs and dropout key among the operands (after x and the three weights).
    fn adapters(&self, ops: &[Value]) -> (LayerAdapters, Option<Value>) {
        let pairs = &ops[4..4 + 2 * self.adapted.len()];
        let lora = self
            .adapted
            .iter()
            .zip(pairs.chunks(2))
            .map(|(&p, ab)| (p, LoraPair { a: ab[0], b: ab[1] }))
            .collect();
        (lora, ops.get(4 + 2 * self.adapted.len()).copied())
    }

    /// Tile `i`'s rows [B, N, ...] of `x` [B, Tp, ...], and the position they start at.
    fn rows_of(&self, b: &mut Builder, x: Value, i: Value) -> Result<(Value, Value)> {
        let n = b.scalar(self.n as f64, DType::S32);
        let start = b.mul(i, n)?;
        let zero = b.scalar(0.0, DType::S32);
        let dims = b.dims(x).to_vec();
        let mut sizes = dims.clone();
        sizes[1] = self.n;
        let mut starts = vec![zero; dims.len()];
        starts[1] = start;
        Ok((b.dynamic_slice(x, &starts, &sizes)?, start))
    }

    /// `y` [B, N, H] written into `into` (kept in [`written_type`]) at tile `start`.
    fn write(&self, b: &mut Builder, into: Value, y: Value, start: Value) -> Result<Value> {
        let y = b.bitcast_convert(y, b.dtype(into))?;
        let zero = b.scalar(0.0, DType::S32);
        b.dynamic_update_slice(into, y, &[zero, start, zero])
    }

    /// One tile's MLP output for its rows `x` starting at `start`, from the operands `ops` (the
    /// weights at 1..4, then the adapters and key).
    fn one(&self, b: &mut Builder, x: Value, start: Value, ops: &[Value]) -> Result<Value> {
        let (lora, key) = self.adapters(ops);
        let mut ctx = LayerContext {
            // The MLP reads no RoPE table and no document start.
            rope: (x, x),
            doc_starts: start,
            lora_scale: self.lora_scale,
            dropout: self.dropout.zip(key),
            tile_start: Some(start),
        };
        let model = Llama {
            cfg: &self.cfg,
            num: self.num,
            placement: self.pins.as_ref().map(|p| p as &dyn Placement),
            mesh: None,
            context: None,
        };
        let weights = [ops[1], ops[2], ops[3]];
        model.mlp(b, x, weights, &lora, &mut ctx, &mut Saves::Off)
    }

    /// The tiles' outputs [B, Tp, H] from the operands (x padded to `count` tiles first).
    fn forward(&self, b: &mut Builder, ins: &[Value]) -> Result<Value> {
        let dtype = b.dtype(ins[0]);
        let shape = Shape::new(&[self.rows, self.count * self.n, self.hidden], dtype);
        let out0 = b.zeros(Shape::new(&shape.dims, written_type(dtype)));
        let out = b.fori_loop(self.count, &[out0], ins, |bb, i, carry, inv| {
            let (x, start) = self.rows_of(bb, inv[0], i)?;
            let y = self.one(bb, x, start, inv)?;
            Ok(vec![self.write(bb, carry[0], y, start)?])
        })?;
        b.bitcast_convert(out[0], dtype)
    }

    /// The operands' cotangents from the output's `dy` [B, T, H]: a loop over the tiles that
    /// recomputes each and adds its share of the LoRA gradients (None for the frozen weights and
    /// the key).
    fn backward(&self, b: &mut Builder, ins: &[Value], dy: Value) -> Result<Vec<Option<Value>>> {
        let dtype = b.dtype(ins[0]);
        let tp = self.count * self.n;
        let dy = pad_rows(b, dy, tp - b.dims(dy)[1])?;
        let lora = 4..4 + 2 * self.adapted.len();
        let dx0 = b.zeros(Shape::new(
            &[self.rows, tp, self.hidden],
            written_type(dtype),
        ));
        let mut carry = vec![dx0];
        for &v in &ins[lora.clone()] {
            carry.push(b.zeros_like(v));
        }
        let mut inv = ins.to_vec();
        inv.push(dy);
        let out = b.fori_loop(self.count, &carry, &inv, |bb, i, carry, inv| {
            let (x, start) = self.rows_of(bb, inv[0], i)?;
            let (dy, _) = self.rows_of(bb, inv[inv.len() - 1], i)?;
            let y = self.one(bb, x, start, &inv[..inv.len() - 1])?;
            let mut wrt = vec![x];
            wrt.extend(&inv[lora.clone()]);
            let g = bb.vjp(&[(y, dy)], &wrt)?;
            let mut next = vec![self.write(bb, carry[0], g[0], start)?];
            for (k, &gk) in g[1..].iter().enumerate() {
                next.push(bb.add(carry[1 + k], gk)?);
            }
            Ok(next)
        })?;
        let mut cts = vec![Some(b.bitcast_convert(out[0], dtype)?), None, None, None];
        cts.extend(out[1..].iter().map(|&g| Some(g)));
        cts.resize(ins.len(), None);
        Ok(cts)
    }
}

/// `x` [B, T, ...] with `n` rows of zeros after its last.
fn pad_rows(b: &mut Builder, x: Value, n: i64) -> Result<Value> {
    if n == 0 {
        return Ok(x);
    }
    let r = b.rank(x);
    let mut high = vec![0; r];
    high[1] = n;
    let zero = b.scalar(0.0, b.dtype(x));
    b.pad(x, zero, &vec![0; r], &high, &vec![0; r])
}

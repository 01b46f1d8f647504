//! Where each token is, and what that does to attention: a token's position counts from the start
//! of its document, and RoPE turns each query and key by its position (the split-half layout of
//! Hugging Face's Llama: the two halves of each head's dims are a pair's two coordinates).

use crate::model::context;
use crate::model::llama::{starts_or_zero, Llama};
use hlo::{Builder, DType, Result, Shape, Value};

impl Llama<'_> {
    /// Each token's position in its document, [B, T] s32: its index in the row less where its
    /// document starts (padding, `doc_starts` -1, counts from the row's start).
    pub(super) fn positions(&self, b: &mut Builder, doc_starts: Value) -> Result<Value> {
        let index = self.natural_positions(b, b.shape(doc_starts).clone())?;
        let starts = starts_or_zero(b, doc_starts)?;
        b.sub(index, starts)
    }

    /// Each token's natural index in its row, [B, T] (`shape`), in the layers' order of the
    /// sequence: tokens in balanced order keep their natural index.
    pub(super) fn natural_positions(&self, b: &mut Builder, shape: Shape) -> Result<Value> {
        let index = b.iota(shape, 1)?;
        match self.context {
            Some(cs) => context::to_balanced(b, index, cs.size),
            None => Ok(index),
        }
    }

    /// cos and sin tables [B, T, D] for positions [B, T], in the split-half layout.
    pub(super) fn rope_tables(&self, b: &mut Builder, positions: Value) -> Result<(Value, Value)> {
        let inv = self.cfg.rope_inv_freq();
        let half = inv.len() as i64;
        let inv = b.constant(
            hlo::Literal::Float(inv.iter().map(|&f| f as f64).collect()),
            Shape::new(&[half], DType::F32),
        )?;
        let (bs, t) = (b.dims(positions)[0], b.dims(positions)[1]);
        let dims = [bs, t, half];
        let pos = b.convert(positions, DType::F32)?;
        let pos = b.broadcast_in_dim(pos, &dims, &[0, 1])?;
        let inv = b.broadcast_in_dim(inv, &dims, &[2])?;
        let freqs = b.mul(pos, inv)?;
        let angles = b.concatenate(&[freqs, freqs], 2)?;
        let cos = b.cos(angles)?;
        let sin = b.sin(angles)?;
        Ok((
            b.convert(cos, self.num.compute)?,
            b.convert(sin, self.num.compute)?,
        ))
    }

    /// x * cos + rotate_half(x) * sin, for x [B, T, ..heads.., D] and tables [B, T, D].
    pub(super) fn apply_rope(
        &self,
        b: &mut Builder,
        x: Value,
        (cos, sin): (Value, Value),
    ) -> Result<Value> {
        let dims = b.dims(x).to_vec();
        let r = dims.len();
        let d = dims[r - 1];
        let x1 = b.slice_dim(x, r - 1, 0, d / 2)?;
        let x2 = b.slice_dim(x, r - 1, d / 2, d)?;
        let neg_x2 = b.neg(x2)?;
        let rotated = b.concatenate(&[neg_x2, x1], r as i64 - 1)?;
        let cos = b.broadcast_in_dim(cos, &dims, &[0, 1, r as i64 - 1])?;
        let sin = b.broadcast_in_dim(sin, &dims, &[0, 1, r as i64 - 1])?;
        let a = b.mul(x, cos)?;
        let c = b.mul(rotated, sin)?;
        b.add(a, c)
    }
}

//! The step's math over a [`Layout`]: the forward pass (layers unrolled, or a loop over stacked
//! layers that keeps each layer's input), the backward loop that recomputes each layer and
//! applies its vjp, the loss in chunks, and the microbatch loop of gradient accumulation.

use crate::model::dropout::{layer_key, pass_key};
use crate::model::llama::{BaseWeights, LayerAdapters, LayerContext, Saves};
use crate::model::lora::Projection;
use crate::model::loss::{cross_entropy_loss_and_grad, next_token_targets};
use crate::model::tensors::projection_dims;
use crate::program::layout::{
    layer_slice, layer_slice_from, layer_update, layer_update_to, stack_type, Layout,
    LoopInvariants, ModelValues,
};
use crate::program::spec::Remat;
use hlo::{Builder, DType, Shape, Value};
use std::collections::BTreeMap;

/// The invariants both layer loops are given (see [`Layout::loop_invariants`]): the values, and
/// how many of them are stacked weights and stacked LoRA tensors, and whether a dropout key
/// follows the RoPE tables and the document starts.
pub(super) struct LoopInputs {
    pub values: Vec<Value>,
    stacked: usize,
    lora: usize,
    dropout: bool,
}

/// A looped forward pass kept for its backward: what the forward loop carried out (the last
/// hidden state in the layers' row order, the saved stacks), the loops' invariants, and the
/// last hidden state in natural row order, `h_last` [B, T, H], that the head reads.
pub(super) struct ScannedForward {
    fwd: Vec<Value>,
    inv: LoopInputs,
    pub h_last: Value,
}

impl Layout<'_> {
    /// The embedding and the layer loop up to `h_last`, for a step that takes gradients (the
    /// next-token loss's and DPO's): the first half of [`Layout::scanned_backward`]'s pair.
    pub(super) fn scanned_forward(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        mask: Value,
        key: Option<Value>,
    ) -> hlo::Result<ScannedForward> {
        let model = self.model();
        let (embed, _, _) = self.ends(&m.frozen);
        let h0 = model.embed(b, embed, ids)?;
        let h0 = self.constrain_batch(b, h0)?;
        let ctx = model.context(b, mask, self.spec.lora.scale())?;
        let (fwd, inv) = self.forward_loop(b, m, h0, &ctx, key)?;
        let h_last = model.in_natural_order(b, fwd[0])?;
        Ok(ScannedForward { fwd, inv, h_last })
    }

    /// The LoRA gradients from the gradient `dh` of `f.h_last`, through the backward loop.
    pub(super) fn scanned_backward(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        f: &ScannedForward,
        dh: Value,
    ) -> hlo::Result<Vec<Value>> {
        // The gradient of the last hidden state in the layers' row order.
        let dh = if f.h_last == f.fwd[0] {
            dh
        } else {
            b.vjp(&[(f.h_last, dh)], &[f.fwd[0]])?[0]
        };
        self.backward_loop(b, m, &f.fwd, &f.inv, dh)
    }

    /// Logits with layers unrolled over per-layer weights.
    pub(super) fn logits_unrolled(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        dropout: Option<(f64, Value)>,
        ids: Value,
        mask: Value,
    ) -> hlo::Result<Value> {
        let (embed, norm, lm_head) = self.ends(&m.frozen);
        let per_layer: usize = self.kind_sizes().iter().sum();
        let layers = self
            .layer_values(&m.frozen)
            .chunks(per_layer)
            .map(|w| self.layer_weights(b, w))
            .collect::<hlo::Result<_>>()?;
        let per_layer = 2 * self.spec.lora.targets.len();
        let lora: Vec<LayerAdapters> = if m.lora.is_empty() {
            Vec::new()
        } else {
            m.lora.chunks(per_layer).map(|c| self.adapters(c)).collect()
        };
        let w = BaseWeights {
            embed,
            layers,
            norm,
            lm_head,
        };
        self.model()
            .logits(b, &w, &lora, self.spec.lora.scale(), dropout, ids, mask)
    }

    /// Pin the batch dim of an activation [B, T, ...] to the mesh's batch sharding (a hint for
    /// the partitioner where the embedding gather would otherwise leave it guessing).
    pub(super) fn constrain_batch(&self, b: &mut Builder, x: Value) -> hlo::Result<Value> {
        let Some(m) = &self.spec.mesh else {
            return Ok(x);
        };
        let dims = b.dims(x).to_vec();
        let mut logical = vec!["batch"];
        logical.extend(std::iter::repeat_n("none", dims.len() - 1));
        let sh = m.rules.sharding(&logical, &dims, &m.mesh());
        b.sharding_constraint(x, sh)
    }

    /// What a remat policy saves in the forward loop besides each layer's input, by name and
    /// per-layer shape, for batches of `bs` x `t` tokens.
    /// - `layer` keeps, with `--keep-softmax-stats`
    ///   ([`crate::program::StepSpec::keep_softmax_stats`]), the softmax's row max and sum
    ///   (f32, [B, KV, TB, G] per query block: 4/head_dim of the attention output's bytes in
    ///   bf16; the statistics flash attention keeps for its backward pass), so the
    ///   recomputation skips the row max's pass over the scores.
    /// - `save-proj` also keeps the frozen projections' outputs, the attention output and the
    ///   softmax statistics, so that the backward loop recomputes only q.k and one elementwise
    ///   pass for the probabilities; with the MLP in tiles (`--mlp-chunk`) not the MLP's
    ///   projections, which the tiles never form whole (their backward pass recomputes them).
    fn saved_points(&self, bs: i64, t: i64) -> Vec<(String, Shape)> {
        let model = self.model();
        match self.spec.remat {
            Remat::None => return Vec::new(),
            Remat::Layer if self.spec.keep_softmax_stats => {
                return model.softmax_stat_points(bs, t)
            }
            Remat::Layer => return Vec::new(),
            Remat::SaveProj => {}
        }
        let compute = self.spec.dtype;
        let tiled = model.mlp_tile(t).is_some();
        let mut points: Vec<(String, Shape)> = Projection::ALL
            .iter()
            .filter(|p| !(tiled && p.block() == "mlp"))
            .map(|target| {
                let out = projection_dims(&self.spec.model, *target).1;
                (
                    target.module().to_string(),
                    Shape::new(&[bs, t, out], compute),
                )
            })
            .collect();
        points.push(model.attention_output_point(bs, t));
        points.extend(model.softmax_stat_points(bs, t));
        points
    }

    /// Run layer `i` (a loop index) of the stacked model inside a loop body.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_in_loop(
        &self,
        b: &mut Builder,
        i: Value,
        h: Value,
        stacked: &[Value],
        lora: &[Value],
        ctx: &LayerContext,
        dropout: Option<(f64, Value)>,
        saves: &mut Saves,
    ) -> hlo::Result<(Value, Vec<Value>)> {
        // Offloaded weights live in host memory: each layer's shard is copied in just before use.
        let on_host = self.spec.offload.frozen;
        let w: Vec<Value> = stacked
            .iter()
            .map(|&s| {
                let w = layer_slice(b, s, i)?;
                Ok(if on_host {
                    b.place(w, hlo::MemoryKind::Device)
                } else {
                    w
                })
            })
            .collect::<hlo::Result<_>>()?;
        let lw = b.scoped("layers", |b| self.layer_weights(b, &w))?;
        let lora_l: Vec<Value> = lora
            .iter()
            .map(|&s| layer_slice(b, s, i))
            .collect::<hlo::Result<_>>()?;
        let adapters = self.adapters(&lora_l);
        let mut ctx = ctx.clone();
        if let Some((p, key)) = dropout {
            ctx.dropout = Some((p, layer_key(b, key, i)?));
        }
        let out = b.scoped("layers", |b| {
            self.model().layer(b, h, &lw, &adapters, &mut ctx, saves)
        })?;
        Ok((out, lora_l))
    }

    /// Forward and backward for one (micro)batch: (loss share, gradients in LoRA arg order).
    /// `denom` is the number of valid targets in the whole batch, so that microbatch losses and
    /// gradients add up to those of the whole batch.
    #[allow(clippy::too_many_arguments)]
    fn loss_and_grads(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        labels: Value,
        mask: Value,
        key: Option<Value>,
        denom: Value,
    ) -> hlo::Result<(Value, Vec<Value>)> {
        let dropout = key.map(|k| (self.spec.lora.dropout, k));
        if !self.spec.remat.scan() {
            let logits = self.logits_unrolled(b, m, dropout, ids, mask)?;
            let targets = next_token_targets(b, labels)?;
            let (loss, dlogits) = cross_entropy_loss_and_grad(b, logits, targets, denom)?;
            let grads = b.vjp(&[(logits, dlogits)], &m.lora)?;
            return Ok((loss, grads));
        }
        let model = self.model();
        let (_, norm, lm_head) = self.ends(&m.frozen);
        let f = self.scanned_forward(b, m, ids, mask, key)?;
        let h_last = f.h_last;
        let (loss, dh) = match self.spec.loss_chunk {
            Some(chunk) => {
                self.chunked_loss_and_dh(b, h_last, norm, lm_head, labels, denom, chunk)?
            }
            None => {
                let logits = model.head(b, h_last, norm, lm_head)?;
                let targets = next_token_targets(b, labels)?;
                let (loss, dlogits) = cross_entropy_loss_and_grad(b, logits, targets, denom)?;
                let dh = b.vjp(&[(logits, dlogits)], &[h_last])?[0];
                (loss, dh)
            }
        };
        let grads = self.scanned_backward(b, m, &f, dh)?;
        Ok((loss, grads))
    }

    /// The loop invariants of the layer loops (training's two, the forward-only one), as they
    /// are passed: the stacked weights, the stacked LoRA tensors, the RoPE tables and the
    /// document starts [B, S], and the dropout key if there is one.
    pub(super) fn loop_invariants(
        &self,
        m: &ModelValues,
        ctx: &LayerContext,
        key: Option<Value>,
    ) -> LoopInputs {
        let stacked = self.layer_values(&m.frozen);
        let mut values: Vec<Value> = stacked.iter().chain(&m.lora).copied().collect();
        values.extend([ctx.rope.0, ctx.rope.1, ctx.doc_starts]);
        values.extend(key);
        LoopInputs {
            values,
            stacked: stacked.len(),
            lora: m.lora.len(),
            dropout: key.is_some(),
        }
    }

    /// A loop body's view of the invariants passed as [`LoopInputs`].
    pub(super) fn unpack(&self, at: &LoopInputs, inv: &[Value]) -> LoopInvariants {
        let (ns, nl) = (at.stacked, at.lora);
        let c = LayerContext {
            rope: (inv[ns + nl], inv[ns + nl + 1]),
            doc_starts: inv[ns + nl + 2],
            lora_scale: self.spec.lora.scale(),
            dropout: None,
            tile_start: None,
        };
        let d = at
            .dropout
            .then(|| (self.spec.lora.dropout, inv[ns + nl + 3]));
        (inv[..ns].to_vec(), inv[ns..ns + nl].to_vec(), c, d)
    }

    /// The forward loop over the stacked layers from the embedded input `h0`. Its carry, and what
    /// it returns: the last hidden state, every layer's input [L, B, T, H] and (with `save-proj`)
    /// a stack [L, ...] of each of [`Layout::saved_points`], stacks kept as [`stack_type`].
    fn forward_loop(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        h0: Value,
        ctx: &LayerContext,
        key: Option<Value>,
    ) -> hlo::Result<(Vec<Value>, LoopInputs)> {
        let l = self.spec.model.num_hidden_layers;
        let (bs, t, hd) = (b.dims(h0)[0], b.dims(h0)[1], b.dims(h0)[2]);
        let saved = self.saved_points(bs, t);
        let compute = self.spec.dtype;
        // Every slot of a stack is written before it is read, so the fill does not matter. Each
        // stack gets its own (0, 1, 2, ...) because XLA would otherwise merge the equal fills into
        // one broadcast and copy it into every stack of that shape before the loop. The looped
        // step keeps its fills on every target (XLA CPU has no uninitialized buffer; the TPU
        // compiler turns a fill the loop overwrites whole into one by itself). An unrolled step
        // is built only to be priced by the TPU cost model, standing for the looped one
        // (`device::absent::aot::Estimate`); there the compiler cannot see that every slot is written
        // and would price a fill that the looped step never pays, so its stacks start
        // uninitialized (XLA's `AllocateBuffer`), as the compiled looped step's do. Stacks in
        // host memory keep their fill (an `AllocateBuffer` is not known to be placed there).
        let unpriced_fill = b.unrolls_loops() && !self.spec.offload.activations;
        let stack = |b: &mut Builder, i: usize, dims: &[i64], dtype: DType| {
            let shape = Shape::new(dims, stack_type(dtype));
            if unpriced_fill {
                b.uninitialized(shape)
            } else {
                b.full(i as f64, shape)
            }
        };
        let inputs0 = stack(b, 0, &[l, bs, t, hd], compute);
        let mut carry = vec![h0, inputs0];
        for (i, (_, shape)) in saved.iter().enumerate() {
            let mut dims = vec![l];
            dims.extend_from_slice(&shape.dims);
            carry.push(stack(b, i + 1, &dims, shape.dtype));
        }
        let at = self.loop_invariants(m, ctx, key);
        let fwd = b.fori_loop(l, &carry, &at.values, |bb, i, carry, inv| {
            let (stacked, lora, ctx, dropout) = self.unpack(&at, inv);
            let mut recorded = Vec::new();
            let (h, _) = self.layer_in_loop(
                bb,
                i,
                carry[0],
                &stacked,
                &lora,
                &ctx,
                dropout,
                &mut Saves::Record(&mut recorded),
            )?;
            let host = self.spec.offload.activations;
            let mut next = vec![h, layer_update_to(bb, carry[1], carry[0], i, host)?];
            for (k, (name, _)) in saved.iter().enumerate() {
                let v = recorded
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| *v)
                    .expect("save point recorded");
                next.push(layer_update_to(bb, carry[2 + k], v, i, host)?);
            }
            Ok(next)
        })?;
        Ok((fwd, at))
    }

    /// The backward loop, last layer first: from the forward loop's stacks `fwd` and the
    /// gradient `dh` of the last hidden state, recompute each layer (substituting the saved
    /// projections) and apply its vjp; the carry is (dh, the LoRA gradient stacks). Returns the
    /// gradients in LoRA argument order.
    fn backward_loop(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        fwd: &[Value],
        at: &LoopInputs,
        dh: Value,
    ) -> hlo::Result<Vec<Value>> {
        let l = self.spec.model.num_hidden_layers;
        let compute = self.spec.dtype;
        let (bs, t) = (b.dims(dh)[0], b.dims(dh)[1]);
        let points = self.saved_points(bs, t);
        let mut carry = vec![dh];
        for &v in &m.lora {
            carry.push(b.zeros_like(v));
        }
        let mut binv = fwd[1..].to_vec();
        binv.extend(&at.values);
        let nsaved = fwd.len() - 1;
        let bwd = b.fori_loop(l, &carry, &binv, |bb, i, carry, binv| {
            let last = bb.scalar((l - 1) as f64, DType::S32);
            let idx = bb.sub(last, i)?;
            let host = self.spec.offload.activations;
            let h_in = layer_slice_from(bb, binv[0], idx, compute, host)?;
            let mut saved = BTreeMap::new();
            for (k, (name, shape)) in points.iter().enumerate() {
                let v = layer_slice_from(bb, binv[1 + k], idx, shape.dtype, host)?;
                saved.insert(name.clone(), v);
            }
            let (stacked, lora, ctx, dropout) = self.unpack(at, &binv[nsaved..]);
            let (h_out, lora_l) = self.layer_in_loop(
                bb,
                idx,
                h_in,
                &stacked,
                &lora,
                &ctx,
                dropout,
                &mut Saves::Use(&saved),
            )?;
            let mut wrt = vec![h_in];
            wrt.extend(&lora_l);
            let g = bb.vjp(&[(h_out, carry[0])], &wrt)?;
            let mut next = vec![g[0]];
            for (k, &gk) in g[1..].iter().enumerate() {
                next.push(layer_update(bb, carry[1 + k], gk, idx)?);
            }
            Ok(next)
        })?;
        Ok(bwd[1..].to_vec())
    }

    /// The loss and its gradient with respect to the last hidden state, a chunk of the sequence
    /// at a time, so that the logits [B, T, V] (f32, and their softmax) never exist whole: each
    /// chunk's logits are computed, turned into its share of the loss and, straight away, into the
    /// gradient of that share (the loss's own cotangent is 1), then dropped.
    #[allow(clippy::too_many_arguments)]
    fn chunked_loss_and_dh(
        &self,
        b: &mut Builder,
        h: Value,
        norm: Value,
        lm_head: Value,
        labels: Value,
        denom: Value,
        chunk: i64,
    ) -> hlo::Result<(Value, Value)> {
        let (bs, t, hd) = (b.dims(h)[0], b.dims(h)[1], b.dims(h)[2]);
        let chunk = if chunk > 0 && t % chunk == 0 {
            chunk
        } else {
            t
        };
        let targets = next_token_targets(b, labels)?;
        let loss0 = b.scalar(0.0, DType::F32);
        // dh is written a chunk at a time: kept as bits, as a layer stack is (see stack_type).
        let dh0 = b.zeros(Shape::new(&[bs, t, hd], stack_type(b.dtype(h))));
        let out = b.scoped("loss_chunks", |b| {
            b.fori_loop(
                t / chunk,
                &[loss0, dh0],
                &[h, norm, lm_head, targets, denom],
                |bb, i, carry, inv| {
                    let c = bb.scalar(chunk as f64, DType::S32);
                    let start = bb.mul(i, c)?;
                    let zero = bb.scalar(0.0, DType::S32);
                    let hc = bb.dynamic_slice(inv[0], &[zero, start, zero], &[bs, chunk, hd])?;
                    let tc = bb.dynamic_slice(inv[3], &[zero, start], &[bs, chunk])?;
                    let logits = self.model().head(bb, hc, inv[1], inv[2])?;
                    let (share, dlogits) = cross_entropy_loss_and_grad(bb, logits, tc, inv[4])?;
                    let g = bb.vjp(&[(logits, dlogits)], &[hc])?[0];
                    let g = bb.bitcast_convert(g, bb.dtype(carry[1]))?;
                    let dh = bb.dynamic_update_slice(carry[1], g, &[zero, start, zero])?;
                    Ok(vec![bb.add(carry[0], share)?, dh])
                },
            )
        })?;
        let dh = b.bitcast_convert(out[1], b.dtype(h))?;
        Ok((out[0], dh))
    }

    /// max(1, number of valid targets): labels[:, 1:] != -100.
    pub(super) fn denominator(&self, b: &mut Builder, labels: Value) -> hlo::Result<Value> {
        let t = b.dims(labels)[1];
        let next = b.slice_dim(labels, 1, 1, t)?;
        let ignore = b.full(-100.0, b.shape(next).clone());
        let valid = b.compare(next, ignore, hlo::CmpDir::Ne)?;
        let valid = b.convert(valid, DType::F32)?;
        let count = b.sum_all(valid)?;
        let one = b.scalar(1.0, DType::F32);
        b.max(count, one)
    }

    /// Loss and gradients of the whole batch, looping over microbatches when there are several.
    pub(super) fn batch_loss_and_grads(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        labels: Value,
        mask: Value,
        key: Option<Value>,
    ) -> hlo::Result<(Value, Vec<Value>)> {
        let denom = self.denominator(b, labels)?;
        let micro = self.spec.grad_accum;
        if micro <= 1 {
            let key = match key {
                Some(k) => {
                    let first_row = b.scalar(0.0, DType::U64);
                    Some(pass_key(b, k, first_row)?)
                }
                None => None,
            };
            return self.loss_and_grads(b, m, ids, labels, mask, key, denom);
        }
        let rows = self.spec.batch / micro;
        let t = self.spec.seq;
        let mut carry = vec![b.scalar(0.0, DType::F32)];
        for &v in &m.lora {
            carry.push(b.zeros_like(v));
        }
        let mut inv = m.flat();
        inv.extend([ids, labels, mask, denom]);
        inv.extend(key);
        let nm = m.frozen.len() + m.lora.len();
        let out = b.fori_loop(micro, &carry, &inv, |bb, i, carry, inv| {
            let mv = m.rebind(&inv[..nm]);
            let r = bb.scalar(rows as f64, DType::S32);
            let start = bb.mul(i, r)?;
            let zero = bb.scalar(0.0, DType::S32);
            let slice =
                |bb: &mut Builder, x: Value| bb.dynamic_slice(x, &[start, zero], &[rows, t]);
            let (ids, labels, mask) = (
                slice(bb, inv[nm])?,
                slice(bb, inv[nm + 1])?,
                slice(bb, inv[nm + 2])?,
            );
            // A microbatch's rows draw the masks they draw in the whole batch (model::dropout).
            let key = match key {
                Some(_) => {
                    let first_row = bb.convert(start, DType::U64)?;
                    Some(pass_key(bb, inv[nm + 4], first_row)?)
                }
                None => None,
            };
            let (loss, grads) =
                self.loss_and_grads(bb, &mv, ids, labels, mask, key, inv[nm + 3])?;
            let mut next = vec![bb.add(carry[0], loss)?];
            for (k, g) in grads.into_iter().enumerate() {
                next.push(bb.add(carry[1 + k], g)?);
            }
            Ok(next)
        })?;
        Ok((out[0], out[1..].to_vec()))
    }
}

/// The passes' forms of one computation give one result: every remat policy, the loss in chunks
/// and gradient accumulation against the plain unrolled step, on the tiny model with random
/// weights and adapters and a padded row (the oracle tests check the plain step against Hugging
/// Face). f32; 1e-5 relative to the largest gradient, a few f32 roundings of the sums that the
/// forms order differently.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::LoraConfig;
    use crate::program::spec::StepSpec;
    use crate::test_support::{assert_same, loss_and_grads_on, LossAndGrads};

    const TOL: f32 = 1e-5;
    const BATCH: i64 = 2;
    const SEQ: i64 = 16;

    fn spec(remat: Remat) -> StepSpec {
        let model = crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .expect("the tiny-llama3 preset");
        let lora = LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
        };
        StepSpec {
            remat,
            ..StepSpec::new(model, lora, BATCH, SEQ, DType::F32)
        }
    }

    /// The loss and gradients of `spec` on one fixed batch, the second row padded after 11
    /// tokens.
    fn loss_and_grads(spec: &StepSpec) -> LossAndGrads {
        let vocab = spec.model.vocab_size as usize;
        let seq = SEQ as usize;
        let real = |i: usize| i % seq < if i < seq { seq } else { 11 };
        let tokens = |i: usize| ((i * 7919 + 13) % vocab) as i32;
        let n = (BATCH * SEQ) as usize;
        let ids: Vec<i32> = (0..n).map(tokens).collect();
        let labels: Vec<i32> = (0..n)
            .map(|i| if real(i) { tokens(i) } else { -100 })
            .collect();
        let mask: Vec<i32> = (0..n).map(|i| real(i) as i32).collect();
        loss_and_grads_on(spec, &ids, &labels, &mask)
    }

    fn same(what: &str, got: &LossAndGrads, want: &LossAndGrads) {
        assert_same(what, got, want, TOL);
    }

    #[test]
    fn every_remat_policy_gives_the_unrolled_steps_loss_and_gradients() {
        let plain = loss_and_grads(&spec(Remat::None));
        same(
            "--remat layer",
            &loss_and_grads(&spec(Remat::Layer)),
            &plain,
        );
        same(
            "--remat save-proj",
            &loss_and_grads(&spec(Remat::SaveProj)),
            &plain,
        );
        let stats = StepSpec {
            keep_softmax_stats: true,
            attention_block: Some(8),
            ..spec(Remat::Layer)
        };
        same(
            "--keep-softmax-stats, two blocks",
            &loss_and_grads(&stats),
            &plain,
        );
    }

    /// Attention over key/value blocks (`model::flash`, its own backward rule) against every
    /// key at once: blocks that divide the sequence (4) and blocks that do not (5, 6: the
    /// sequence is padded to whole blocks), unrolled and under each remat policy, with the
    /// padded row and grouped heads of the fixed batch.
    #[test]
    fn attention_over_key_blocks_gives_the_whole_key_forms_loss_and_gradients() {
        let plain = loss_and_grads(&spec(Remat::None));
        for (remat, block, keep_stats) in [
            (Remat::None, 4, false),
            (Remat::None, 5, false),
            (Remat::Layer, 6, false),
            (Remat::Layer, 4, true),
            (Remat::SaveProj, 5, false),
            (Remat::SaveProj, 16, false),
        ] {
            let s = StepSpec {
                key_block: Some(block),
                keep_softmax_stats: keep_stats,
                ..spec(remat)
            };
            let what = format!(
                "--remat {} --key-block {block} --keep-softmax-stats {keep_stats}",
                remat.name()
            );
            same(&what, &loss_and_grads(&s), &plain);
        }
    }

    /// The MLP in tiles (`model::mlp_tiles`, its own backward rule) against the whole MLP:
    /// tiles that divide the sequence (4, 8) and tiles that do not (5, 6, 15: the last one
    /// padded), under each remat policy (save-proj saving none of the MLP's projections), with
    /// key blocks, loss chunks and microbatches around them, on the padded row of the fixed
    /// batch.
    #[test]
    fn the_mlp_in_tiles_gives_the_whole_mlps_loss_and_gradients() {
        let plain = loss_and_grads(&spec(Remat::None));
        for (remat, tile, key_block, loss_chunk, grad_accum) in [
            (Remat::None, 4, None, None, 1),
            (Remat::None, 5, None, None, 1),
            (Remat::Layer, 6, None, None, 1),
            (Remat::Layer, 15, Some(5), Some(4), 2),
            (Remat::SaveProj, 8, None, None, 1),
            (Remat::SaveProj, 5, Some(4), None, 2),
        ] {
            let s = StepSpec {
                mlp_chunk: Some(tile),
                key_block,
                loss_chunk,
                grad_accum,
                ..spec(remat)
            };
            let what = format!(
                "--remat {} --mlp-chunk {tile} --key-block {key_block:?} --loss-chunk \
                 {loss_chunk:?} --grad-accum {grad_accum}",
                remat.name()
            );
            same(&what, &loss_and_grads(&s), &plain);
        }
    }

    #[test]
    fn the_loss_in_chunks_and_microbatches_add_up_to_the_whole_batch() {
        let whole = loss_and_grads(&spec(Remat::Layer));
        let chunks = StepSpec {
            loss_chunk: Some(4),
            ..spec(Remat::Layer)
        };
        same("--loss-chunk 4", &loss_and_grads(&chunks), &whole);
        let micro = StepSpec {
            grad_accum: 2,
            ..spec(Remat::Layer)
        };
        same("--grad-accum 2", &loss_and_grads(&micro), &whole);
    }

    #[test]
    fn each_remat_policy_saves_what_it_says() {
        let names = |s: &StepSpec, bs, t| -> Vec<String> {
            Layout { spec: s }
                .saved_points(bs, t)
                .into_iter()
                .map(|(n, _)| n)
                .collect()
        };
        assert!(names(&spec(Remat::None), 2, 16).is_empty());
        assert!(names(&spec(Remat::Layer), 2, 16).is_empty());
        let stats = StepSpec {
            keep_softmax_stats: true,
            attention_block: Some(8),
            ..spec(Remat::Layer)
        };
        assert_eq!(
            names(&stats, 2, 16),
            ["attn.max.0", "attn.sum.0", "attn.max.1", "attn.sum.1"]
        );
        let save_proj = spec(Remat::SaveProj);
        let points = Layout { spec: &save_proj }.saved_points(2, 16);
        assert_eq!(points.len(), Projection::ALL.len() + 1 + 2, "{points:?}");
        // The tiny model: 4 heads of 16 over 2 KV heads; f32 statistics per query row and head.
        let stat = Shape::new(&[2, 2, 16, 2], DType::F32);
        assert!(points.iter().any(|(n, s)| n == "attn.max.0" && *s == stat));
        let attn = Shape::new(&[2, 16, 64], DType::F32);
        assert!(points.iter().any(|(n, s)| n == "attn" && *s == attn));
        // The MLP in tiles: none of its three projections is saved, the rest as before.
        let tiled = StepSpec {
            mlp_chunk: Some(4),
            ..spec(Remat::SaveProj)
        };
        let names = names(&tiled, 2, 16);
        assert_eq!(names.len(), points.len() - 3, "{names:?}");
        for p in ["gate_proj", "up_proj", "down_proj"] {
            assert!(!names.iter().any(|n| n == p), "{p} saved: {names:?}");
        }
    }
}

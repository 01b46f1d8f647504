//! The loss: cross entropy of the next token, HF's way (position t predicts label t+1, label -100
//! is ignored, the mean is over the valid targets of the whole batch), and the training loss's
//! gradient with respect to the logits written out by hand.

use hlo::{Builder, CmpDir, DType, GatherDims, Result, Shape, Value};

/// Per-token cross entropy, HF's way: position t predicts label t+1 (`labels` [B, T], s32,
/// -100 = ignore); the last position predicts nothing. Returns (CE [B, T] with ignored positions
/// zero, valid [B, T] as 0/1 f32). The loss is sum(CE) / sum(valid) over the whole batch.
pub fn token_cross_entropy(
    b: &mut Builder,
    logits: Value,
    labels: Value,
) -> Result<(Value, Value)> {
    let targets = b.scoped("loss", |b| next_token_targets(b, labels))?;
    cross_entropy_with_targets(b, logits, targets)
}

/// The training loss `sum(CE) / denom` and its gradient with respect to the logits, written out
/// instead of derived by autodiff: `dlogits = (softmax(logits) - onehot(target)) * valid / denom`.
///
/// Why by hand: the logits are the largest tensor of the step ([B, T, V] f32, 131 MB on the
/// benchmark), and every pass over them costs. Autodiff of the log-sum-exp keeps `exp(logits - m)`
/// for the backward pass (one more write and read of that size) and the one-hot pick of the
/// target's logit is a select over the whole tensor plus a reduction. Here the target's logit is a
/// gather of B*T scalars, and the gradient recomputes `exp(logits - lse)` in the same elementwise
/// pass that writes it, so XLA reads the logits three times (max, sum of exp, gradient) and writes
/// only the gradient. Checked against the oracle's gradients (tests/oracle.rs).
pub fn cross_entropy_loss_and_grad(
    b: &mut Builder,
    logits: Value,
    targets: Value,
    denom: Value,
) -> Result<(Value, Value)> {
    b.scoped("loss", |b| {
        let dims = b.dims(logits).to_vec();
        let (bs, t) = (dims[0], dims[1]);
        let rows = [bs, t];
        // log-sum-exp over the vocabulary
        let m = b.reduce_max(logits, &[2])?;
        let mb = b.broadcast_in_dim(m, &dims, &[0, 1])?;
        let shifted = b.sub(logits, mb)?;
        let e = b.exp(shifted)?;
        let s = b.reduce_sum(e, &[2])?;
        let ls = b.log(s)?;
        let lse = b.add(ls, m)?;
        // the target's logit: a gather of one scalar per position, indexed (b, t, target) so that
        // the logits keep their shape (flattening them would make a sharded program gather them
        // whole onto every device)
        let minus100 = b.full(-100.0, Shape::new(&rows, DType::S32));
        let valid = b.compare(targets, minus100, CmpDir::Ne)?;
        let zero = b.zeros_like(targets);
        let safe = b.max(targets, zero)?;
        let index_dims = [bs, t, 1];
        let pos_b = b.iota(Shape::new(&index_dims, DType::S32), 0)?;
        let pos_t = b.iota(Shape::new(&index_dims, DType::S32), 1)?;
        let safe = b.reshape(safe, &index_dims)?;
        let index = b.concatenate(&[pos_b, pos_t, safe], 2)?;
        let picked = b.gather(
            logits,
            index,
            GatherDims {
                offset_dims: vec![],
                collapsed_slice_dims: vec![0, 1, 2],
                start_index_map: vec![0, 1, 2],
                index_vector_dim: 2,
            },
            &[1, 1, 1],
        )?;
        let ce = b.sub(lse, picked)?;
        let valid = b.convert(valid, DType::F32)?;
        let ce = b.mul(ce, valid)?;
        let total = b.sum_all(ce)?;
        let loss = b.div(total, denom)?;
        // d loss / d logits, one elementwise pass over the logits
        let denom_rows = b.broadcast_in_dim(denom, &rows, &[])?;
        let weight = b.div(valid, denom_rows)?;
        let lse_b = b.broadcast_in_dim(lse, &dims, &[0, 1])?;
        let centred = b.sub(logits, lse_b)?;
        let p = b.exp(centred)?;
        let vocab = b.iota(Shape::new(&dims, DType::S32), 2)?;
        let tb = b.broadcast_in_dim(targets, &dims, &[0, 1])?;
        let hit = b.compare(vocab, tb, CmpDir::Eq)?;
        let p_minus_one = b.add_scalar(p, -1.0)?;
        let residual = b.select(hit, p_minus_one, p)?;
        let wb = b.broadcast_in_dim(weight, &dims, &[0, 1])?;
        let dlogits = b.mul(residual, wb)?;
        Ok((loss, dlogits))
    })
}

/// HF's shift: the target of position t is label t+1; the last position has none (-100).
pub fn next_token_targets(b: &mut Builder, labels: Value) -> Result<Value> {
    let t = b.dims(labels)[1];
    let next = b.slice_dim(labels, 1, 1, t)?;
    let ignore = b.scalar(-100.0, DType::S32);
    b.pad(next, ignore, &[0, 0], &[0, 1], &[0, 0])
}

/// Cross entropy of logits [B, T, V] against already-shifted targets [B, T] (-100 = none):
/// (CE [B, T] with ignored positions zero, valid [B, T] as 0/1 f32).
pub fn cross_entropy_with_targets(
    b: &mut Builder,
    logits: Value,
    targets: Value,
) -> Result<(Value, Value)> {
    b.scoped("loss", |b| {
        let dims = b.dims(logits).to_vec();
        let (bs, t, v) = (dims[0], dims[1], dims[2]);
        // log-sum-exp over the vocabulary
        let m = b.reduce_max(logits, &[2])?;
        let m = b.stop_gradient(m);
        let mb = b.broadcast_in_dim(m, &dims, &[0, 1])?;
        let shifted = b.sub(logits, mb)?;
        let e = b.exp(shifted)?;
        let s = b.reduce_sum(e, &[2])?;
        let ls = b.log(s)?;
        let lse = b.add(ls, m)?;
        // the target's logit, picked with a one-hot compare (fused by XLA, no gather)
        let vocab = b.iota(Shape::new(&[bs, t, v], DType::S32), 2)?;
        let tb = b.broadcast_in_dim(targets, &dims, &[0, 1])?;
        let hit = b.compare(vocab, tb, CmpDir::Eq)?;
        let zero = b.zeros_like(logits);
        let picked = b.select(hit, logits, zero)?;
        let picked = b.reduce_sum(picked, &[2])?;
        let ce = b.sub(lse, picked)?;
        let minus100 = b.full(-100.0, Shape::new(&[bs, t], DType::S32));
        let valid = b.compare(targets, minus100, CmpDir::Ne)?;
        let valid = b.convert(valid, DType::F32)?;
        Ok((b.mul(ce, valid)?, valid))
    })
}

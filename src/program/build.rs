//! The supervised programs: the training step, the loss and gradients, the forward pass,
//! evaluation and the next token's logits, each on the skeleton of `builder`
//! ([`ProgramBuilder`]); a spec of preference training (`--method dpo`) builds its step and
//! grads program in `dpo`.

use crate::model::loss::token_cross_entropy;
use crate::program::builder::ProgramBuilder;
use crate::program::signature::{Program, Role, TensorSpec};
use crate::program::spec::{check_spec, StepSpec};
use anyhow::Result;
use hlo::{DType, Shape};
/// The training step program.
pub fn build_train_step(spec: &StepSpec) -> Result<Program> {
    train_step(spec, false)
}

/// The training step with every loop (layers, microbatches) unrolled: the same computation,
/// recomputation included, for compilers whose cost analysis counts a loop body once (TPU's).
/// Meant for models of one or two layers (`device::absent::aot` estimates a step from them).
pub fn build_train_step_unrolled(spec: &StepSpec) -> Result<Program> {
    train_step(spec, true)
}

/// [`build_train_step_unrolled`] whose rolled loops (attention over key/value blocks) hold
/// `trips` trips per body, for pricing one trip (see `hlo::Builder::price_rolled_loops`): not a
/// program to run.
pub fn build_train_step_priced(spec: &StepSpec, trips: i64) -> Result<Program> {
    train_step_with(spec, true, trips)
}

fn train_step(spec: &StepSpec, unroll_loops: bool) -> Result<Program> {
    train_step_with(spec, unroll_loops, 1)
}

fn train_step_with(spec: &StepSpec, unroll_loops: bool, trips: i64) -> Result<Program> {
    check_spec(spec)?;
    if spec.dpo.is_some() {
        return crate::program::dpo::dpo_step(spec, unroll_loops, trips);
    }
    let mut p = ProgramBuilder::new(spec, "train_step");
    p.b.unroll_loops(unroll_loops);
    p.b.price_rolled_loops(trips);
    let state = p.step_params();
    let (ids, labels, mask) = p.batch_params();
    let key = p.dropout_key();
    let layout = p.layout();
    let (loss, grads) = layout.batch_loss_and_grads(&mut p.b, &state.mv, ids, labels, mask, key)?;
    p.update(&state, loss, &grads)?;
    Ok(p.finish("xtrain_train_step"))
}

/// A forward-only program: (logits [B,T,V], per-token CE [B,T], loss) with or without LoRA.
pub fn build_forward(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut p = ProgramBuilder::new(spec, "forward");
    let mv = p.model_params(with_lora);
    let (ids, labels, mask) = p.batch_params();
    let layout = p.layout();
    let b = &mut p.b;
    let logits = layout.logits(b, &mv, ids, mask)?;
    let (ce, _) = token_cross_entropy(b, logits, labels)?;
    let denom = layout.denominator(b, labels)?;
    let total = b.sum_all(ce)?;
    let loss = b.div(total, denom)?;
    let (bs, t, v) = (spec.batch, spec.seq, spec.model.vocab_size);
    p.result(
        TensorSpec::new("logits", vec![bs, t, v], DType::F32, Role::Logits),
        logits,
    );
    p.result(
        TensorSpec::new("token_loss", vec![bs, t], DType::F32, Role::TokenLoss),
        ce,
    );
    p.result(
        TensorSpec::new("loss", vec![], DType::F32, Role::Loss),
        loss,
    );
    Ok(p.finish("xtrain_forward"))
}

/// A program returning the loss and the gradient of every LoRA tensor (for checking gradients
/// against a reference; the train step folds them into AdamW instead).
pub fn build_grad_program(spec: &StepSpec) -> Result<Program> {
    check_spec(spec)?;
    if spec.dpo.is_some() {
        return crate::program::dpo::dpo_grads(spec);
    }
    let mut p = ProgramBuilder::new(spec, "grads");
    let mv = p.model_params(true);
    let (ids, labels, mask) = p.batch_params();
    let layout = p.layout();
    let (loss, grads) = layout.batch_loss_and_grads(&mut p.b, &mv, ids, labels, mask, None)?;
    p.result(
        TensorSpec::new("loss", vec![], DType::F32, Role::Loss),
        loss,
    );
    let lora_args: Vec<TensorSpec> = p
        .args
        .iter()
        .filter(|a| a.role == Role::Lora)
        .cloned()
        .collect();
    for (a, g) in lora_args.iter().zip(&grads) {
        let name = format!("grad.{}", a.name);
        p.result(
            TensorSpec::new(name, a.shape.clone(), DType::F32, Role::Lora),
            *g,
        );
    }
    Ok(p.finish("xtrain_grads"))
}

/// A program for generation: the logits [B, V] of the next token after position `positions[b]`
/// of each row (the head runs on those positions only).
pub fn build_next_token(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut p = ProgramBuilder::new(spec, "next_token");
    let mv = p.model_params(with_lora);
    let shape = [spec.batch, spec.seq];
    let ids = p.param("input_ids", &shape, DType::S32, Role::InputIds);
    let mask = p.param("attention_mask", &shape, DType::S32, Role::AttentionMask);
    let pos = p.param("positions", &[spec.batch], DType::S32, Role::Step);
    let layout = p.layout();
    let b = &mut p.b;
    let h = layout.hidden(b, &mv, ids, mask)?;
    // Pick h[b, positions[b], :] with a one-hot contraction over T.
    let t = spec.seq;
    let iota = b.iota(Shape::new(&[spec.batch, t], DType::S32), 1)?;
    let pb = b.broadcast_in_dim(pos, &[spec.batch, t], &[0])?;
    let hit = b.compare(iota, pb, hlo::CmpDir::Eq)?;
    let one_hot = b.convert(hit, spec.dtype)?;
    let dims = hlo::DotDims {
        lhs_batch: vec![0],
        rhs_batch: vec![0],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let picked = b.dot_general(one_hot, h, dims, None, None)?;
    let picked = b.reshape(picked, &[spec.batch, 1, spec.model.hidden_size])?;
    let (_, norm, lm_head) = layout.ends(&mv.frozen);
    let logits = layout.model().head(b, picked, norm, lm_head)?;
    let logits = b.reshape(logits, &[spec.batch, spec.model.vocab_size])?;
    p.result(
        TensorSpec::new(
            "logits",
            vec![spec.batch, spec.model.vocab_size],
            DType::F32,
            Role::Logits,
        ),
        logits,
    );
    Ok(p.finish("xtrain_next_token"))
}

/// An evaluation program: per-token loss [B, T] and whether the argmax prediction at each
/// position is the target [B, T] (1.0 or 0.0), teacher-forced. A row whose every target
/// position is right is exactly what greedy decoding would produce.
pub fn build_eval(spec: &StepSpec) -> Result<Program> {
    let mut p = ProgramBuilder::new(spec, "eval");
    let mv = p.model_params(true);
    let (ids, labels, mask) = p.batch_params();
    let layout = p.layout();
    let b = &mut p.b;
    let logits = layout.logits(b, &mv, ids, mask)?;
    let (ce, _) = token_cross_entropy(b, logits, labels)?;
    let correct = b.scoped("accuracy", |b| {
        let (bs, t, v) = (spec.batch, spec.seq, spec.model.vocab_size);
        let dims = [bs, t, v];
        // argmax as the smallest index holding the maximum
        let m = b.reduce_max(logits, &[2])?;
        let mb = b.broadcast_in_dim(m, &dims, &[0, 1])?;
        let at_max = b.compare(logits, mb, hlo::CmpDir::Eq)?;
        let iota = b.iota(Shape::new(&dims, DType::S32), 2)?;
        let big = b.full(v as f64, Shape::new(&dims, DType::S32));
        let idx = b.select(at_max, iota, big)?;
        let argmax = b.reduce(idx, &[2], hlo::Combiner::Min)?;
        let next = b.slice_dim(labels, 1, 1, t)?;
        let ignore = b.scalar(-100.0, DType::S32);
        let targets = b.pad(next, ignore, &[0, 0], &[0, 1], &[0, 0])?;
        let hit = b.compare(argmax, targets, hlo::CmpDir::Eq)?;
        b.convert(hit, DType::F32)
    })?;
    let (bs, t) = (spec.batch, spec.seq);
    p.result(
        TensorSpec::new("token_loss", vec![bs, t], DType::F32, Role::TokenLoss),
        ce,
    );
    p.result(
        TensorSpec::new("token_correct", vec![bs, t], DType::F32, Role::TokenLoss),
        correct,
    );
    Ok(p.finish("xtrain_eval"))
}

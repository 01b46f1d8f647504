//! The five programs: the training step, the loss and gradients, the forward pass, evaluation and
//! the next token's logits.

use crate::model::loss::token_cross_entropy;
use crate::model::optim::Slot;
use crate::program::layout::{add_batch_params, add_model_params, scalar_param, Layout};
use crate::program::signature::{Program, Role, TensorSpec};
use crate::program::spec::{check_spec, StepSpec};
use anyhow::Result;
use hlo::{Builder, DType, Module, ParamAttrs, Shape, Value};

/// Annotate parameters and results with their shardings and wrap the function in a module
/// that declares the mesh.
fn finish_module(
    name: &str,
    mut b: Builder,
    spec: &StepSpec,
    args: &[TensorSpec],
    results: &[TensorSpec],
    outs: &[(String, Value)],
) -> String {
    let params: Vec<Value> = b.func().params.iter().map(|p| p.value).collect();
    let mut func_results: Vec<hlo::FuncResult> = outs
        .iter()
        .map(|(n, v)| hlo::FuncResult {
            value: *v,
            name: n.clone(),
            sharding: None,
        })
        .collect();
    if let Some(m) = &spec.mesh {
        for (v, a) in params.iter().zip(args) {
            b.set_param_sharding(*v, Some(m.sharding(&a.name, &a.shape)));
        }
        for (r, spec_r) in func_results.iter_mut().zip(results) {
            r.sharding = Some(m.sharding(&spec_r.name, &spec_r.shape));
        }
    }
    let module = Module::new(name, b.finish_with(func_results));
    match &spec.mesh {
        Some(m) => module.with_mesh(m.mesh()).to_text(),
        None => module.to_text(),
    }
}

/// The training step program.
pub fn build_train_step(spec: &StepSpec) -> Result<Program> {
    check_spec(spec)?;
    let mut b = Builder::new("train_step");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, true, &mut args);
    let lora_args: Vec<TensorSpec> = args
        .iter()
        .filter(|a| a.role == Role::Lora)
        .cloned()
        .collect();
    // moments[i] = m of LoRA tensor i, moments[n + i] = its v; named as torch's state dict.
    let n = mv.lora.len();
    let mut moments = Vec::new();
    for (prefix, role) in [("exp_avg", Role::AdamM), ("exp_avg_sq", Role::AdamV)] {
        for src in &lora_args {
            let name = format!("{prefix}.{}", src.name);
            moments.push(b.param(&name, Shape::new(&src.shape, DType::F32)));
            args.push(TensorSpec::new(name, src.shape.clone(), DType::F32, role));
        }
    }
    let step = scalar_param(&mut b, "step", Role::Step, &mut args);
    let lr = scalar_param(&mut b, "lr", Role::LearningRate, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let key = if spec.lora.dropout > 0.0 {
        args.push(TensorSpec::new(
            "dropout_key",
            vec![2],
            DType::U64,
            Role::DropoutKey,
        ));
        Some(b.param("dropout_key", Shape::new(&[2], DType::U64)))
    } else {
        None
    };

    let layout = Layout { spec };
    let (loss, grads) = layout.batch_loss_and_grads(&mut b, &mv, ids, labels, mask, key)?;
    let slots: Vec<Slot> = (0..n)
        .map(|i| Slot {
            param: mv.lora[i],
            grad: grads[i],
            m: moments[i],
            v: moments[n + i],
        })
        .collect();
    // A step whose loss or gradient is not finite changes nothing: the state stays the last
    // good one, and the host decides whether to stop or go on.
    let (updated, grad_norm) = spec
        .adam
        .update_guarded(&mut b, &slots, step, lr, Some(loss))?;

    // Results: params, then m, then v (each aliasing its input), then loss and grad norm.
    let mut results = Vec::new();
    let mut outs: Vec<(String, Value)> = Vec::new();
    // (input, output) pairs: the updated params, m and v, in argument order.
    let pairs: Vec<(Value, Value)> = (0..n)
        .map(|i| (mv.lora[i], updated[i].param))
        .chain((0..n).map(|i| (moments[i], updated[i].m)))
        .chain((0..n).map(|i| (moments[n + i], updated[i].v)))
        .collect();
    let state_args = args
        .iter()
        .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV));
    for (a, &(input, output)) in state_args.zip(&pairs) {
        b.set_param_attrs(
            input,
            ParamAttrs {
                alias_output: Some(outs.len()),
                sharding: None,
            },
        );
        results.push(a.clone());
        outs.push((a.name.clone(), output));
    }
    for (name, v, role) in [
        ("loss", loss, Role::Loss),
        ("grad_norm", grad_norm, Role::GradNorm),
    ] {
        results.push(TensorSpec::new(name, vec![], DType::F32, role));
        outs.push((name.into(), v));
    }
    let text = finish_module("xtrain_train_step", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

/// A forward-only program: (logits [B,T,V], per-token CE [B,T], loss) with or without LoRA.
pub fn build_forward(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut b = Builder::new("forward");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, with_lora, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let layout = Layout { spec };
    let logits = layout.logits(&mut b, &mv, ids, mask)?;
    let (ce, _) = token_cross_entropy(&mut b, logits, labels)?;
    let denom = layout.denominator(&mut b, labels)?;
    let total = b.sum_all(ce)?;
    let loss = b.div(total, denom)?;
    let (bs, t, v) = (spec.batch, spec.seq, spec.model.vocab_size);
    let results = vec![
        TensorSpec::new("logits", vec![bs, t, v], DType::F32, Role::Logits),
        TensorSpec::new("token_loss", vec![bs, t], DType::F32, Role::TokenLoss),
        TensorSpec::new("loss", vec![], DType::F32, Role::Loss),
    ];
    let outs = vec![
        ("logits".to_string(), logits),
        ("token_loss".to_string(), ce),
        ("loss".to_string(), loss),
    ];
    let text = finish_module("xtrain_forward", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

/// A program returning the loss and the gradient of every LoRA tensor (for checking gradients
/// against a reference; the train step folds them into AdamW instead).
pub fn build_grad_program(spec: &StepSpec) -> Result<Program> {
    check_spec(spec)?;
    let mut b = Builder::new("grads");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, true, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let layout = Layout { spec };
    let (loss, grads) = layout.batch_loss_and_grads(&mut b, &mv, ids, labels, mask, None)?;
    let mut results = vec![TensorSpec::new("loss", vec![], DType::F32, Role::Loss)];
    let mut outs = vec![("loss".to_string(), loss)];
    for (a, g) in args.iter().filter(|a| a.role == Role::Lora).zip(&grads) {
        let name = format!("grad.{}", a.name);
        results.push(TensorSpec::new(
            name.clone(),
            a.shape.clone(),
            DType::F32,
            Role::Lora,
        ));
        outs.push((name, *g));
    }
    let text = finish_module("xtrain_grads", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

/// A program for generation: the logits [B, V] of the next token after position `positions[b]`
/// of each row (the head runs on those positions only).
pub fn build_next_token(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    let mut b = Builder::new("next_token");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, with_lora, &mut args);
    let shape = vec![spec.batch, spec.seq];
    let ids = b.param("input_ids", Shape::new(&shape, DType::S32));
    args.push(TensorSpec::new(
        "input_ids",
        shape.clone(),
        DType::S32,
        Role::InputIds,
    ));
    let mask = b.param("attention_mask", Shape::new(&shape, DType::S32));
    args.push(TensorSpec::new(
        "attention_mask",
        shape.clone(),
        DType::S32,
        Role::AttentionMask,
    ));
    let pos = b.param("positions", Shape::new(&[spec.batch], DType::S32));
    args.push(TensorSpec::new(
        "positions",
        vec![spec.batch],
        DType::S32,
        Role::Step,
    ));
    let layout = Layout { spec };
    let h = layout.hidden(&mut b, &mv, ids, mask)?;
    // Pick h[b, positions[b], :] with a one-hot contraction over T.
    let t = spec.seq;
    let iota = b.iota(Shape::new(&[spec.batch, t], DType::S32), 1)?;
    let pb = b.broadcast_in_dim(pos, &[spec.batch, t], &[0])?;
    let hit = b.compare(iota, pb, hlo::CmpDir::Eq)?;
    let one_hot = b.convert(hit, spec.compute_dtype)?;
    let dims = hlo::DotDims {
        lhs_batch: vec![0],
        rhs_batch: vec![0],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let picked = b.dot_general(one_hot, h, dims, None, None)?;
    let picked = b.reshape(picked, &[spec.batch, 1, spec.model.hidden_size])?;
    let (_, norm, lm_head) = layout.ends(&mv.frozen);
    let logits = layout.model().head(&mut b, picked, norm, lm_head)?;
    let logits = b.reshape(logits, &[spec.batch, spec.model.vocab_size])?;
    let results = vec![TensorSpec::new(
        "logits",
        vec![spec.batch, spec.model.vocab_size],
        DType::F32,
        Role::Logits,
    )];
    let text = finish_module(
        "xtrain_next_token",
        b,
        spec,
        &args,
        &results,
        &[("logits".to_string(), logits)],
    );
    Ok(Program::new(text, args, results, spec))
}

/// An evaluation program: per-token loss [B, T] and whether the argmax prediction at each
/// position is the target [B, T] (1.0 or 0.0), teacher-forced. A row whose every target
/// position is right is exactly what greedy decoding would produce.
pub fn build_eval(spec: &StepSpec) -> Result<Program> {
    let mut b = Builder::new("eval");
    let mut args = Vec::new();
    let mv = add_model_params(&mut b, spec, true, &mut args);
    let (ids, labels, mask) = add_batch_params(&mut b, spec, &mut args);
    let layout = Layout { spec };
    let logits = layout.logits(&mut b, &mv, ids, mask)?;
    let (ce, _) = token_cross_entropy(&mut b, logits, labels)?;
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
    let results = vec![
        TensorSpec::new("token_loss", vec![bs, t], DType::F32, Role::TokenLoss),
        TensorSpec::new("token_correct", vec![bs, t], DType::F32, Role::TokenLoss),
    ];
    let outs = vec![
        ("token_loss".to_string(), ce),
        ("token_correct".to_string(), correct),
    ];
    let text = finish_module("xtrain_eval", b, spec, &args, &results, &outs);
    Ok(Program::new(text, args, results, spec))
}

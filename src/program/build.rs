//! The five programs: the training step, the loss and gradients, the forward pass, evaluation and
//! the next token's logits. Each is the same skeleton ([`ProgramBuilder`]): declare the
//! parameters (each named in the program and listed in the signature at once), compute on a
//! [`Layout`] of them, name the results, and finish the module (shardings from the mesh).

use crate::model::loss::token_cross_entropy;
use crate::model::optim::Slot;
use crate::model::tensors::{frozen_args_typed, lora_args};
use crate::program::layout::{Layout, ModelValues};
use crate::program::signature::{Program, Role, TensorSpec};
use crate::program::spec::{check_spec, StepSpec};
use anyhow::Result;
use hlo::{Builder, DType, Module, ParamAttrs, Shape, Value};

/// One program as it is built: the graph, its parameters and results so far, and what it is
/// built for.
pub(super) struct ProgramBuilder<'s> {
    spec: &'s StepSpec,
    b: Builder,
    args: Vec<TensorSpec>,
    results: Vec<TensorSpec>,
    outs: Vec<(String, Value)>,
}

impl<'s> ProgramBuilder<'s> {
    /// A program whose function is named `func`.
    fn new(spec: &'s StepSpec, func: &str) -> Self {
        ProgramBuilder {
            spec,
            b: Builder::new(func),
            args: Vec::new(),
            results: Vec::new(),
            outs: Vec::new(),
        }
    }

    /// The model's structure over this program's parameters.
    fn layout(&self) -> Layout<'s> {
        Layout { spec: self.spec }
    }

    /// A parameter, declared in the program and listed in its signature.
    fn param(&mut self, name: &str, shape: &[i64], dtype: DType, role: Role) -> Value {
        self.args
            .push(TensorSpec::new(name, shape.to_vec(), dtype, role));
        self.b.param(name, Shape::new(shape, dtype))
    }

    /// The model's parameters: the frozen weights (per layer or stacked, NF4 parts when
    /// quantized), then, `with_lora`, the LoRA A and B of each adapted projection (f32).
    pub(super) fn model_params(&mut self, with_lora: bool) -> ModelValues {
        let spec = self.spec;
        let stacked = spec.remat.scan();
        let frozen = frozen_args_typed(&spec.model, stacked, spec.quant.is_nf4(), spec.dtype)
            .into_iter()
            .map(|(name, shape, dtype)| self.param(&name, &shape, dtype, Role::Frozen))
            .collect();
        let mut lora = Vec::new();
        if with_lora {
            for t in lora_args(&spec.model, &spec.lora, stacked) {
                lora.push(self.param(&t.name, &t.shape, DType::F32, Role::Lora));
            }
        }
        ModelValues { frozen, lora }
    }

    /// input_ids, labels and attention_mask, each s32 [B, T].
    fn batch_params(&mut self) -> (Value, Value, Value) {
        let shape = [self.spec.batch, self.spec.seq];
        (
            self.param("input_ids", &shape, DType::S32, Role::InputIds),
            self.param("labels", &shape, DType::S32, Role::Labels),
            self.param("attention_mask", &shape, DType::S32, Role::AttentionMask),
        )
    }

    /// A result of the program.
    fn result(&mut self, spec: TensorSpec, value: Value) {
        self.outs.push((spec.name.clone(), value));
        self.results.push(spec);
    }

    /// A result that updates parameter `input` in place: the parameter is donated to it.
    fn result_aliasing(&mut self, input: Value, spec: TensorSpec, value: Value) {
        self.b.set_param_attrs(
            input,
            ParamAttrs {
                alias_output: Some(self.outs.len()),
                ..ParamAttrs::default()
            },
        );
        self.result(spec, value);
    }

    /// Annotate parameters and results with their shardings and wrap the function in a module
    /// (named `module`) that declares the mesh.
    fn finish(self, module: &str) -> Program {
        let ProgramBuilder {
            spec,
            mut b,
            args,
            results,
            outs,
        } = self;
        let params: Vec<Value> = b.func().params.iter().map(|p| p.value).collect();
        let mut func_results: Vec<hlo::FuncResult> = outs
            .iter()
            .map(|(n, v)| hlo::FuncResult {
                value: *v,
                name: n.clone(),
                sharding: None,
            })
            .collect();
        for (v, a) in params.iter().zip(&args) {
            if let Some(memory) = a.memory(spec) {
                b.set_param_memory(*v, Some(memory));
            }
        }
        if let Some(m) = &spec.mesh {
            for (v, a) in params.iter().zip(&args) {
                b.set_param_sharding(*v, Some(m.sharding(&a.name, &a.shape)));
            }
            for (r, spec_r) in func_results.iter_mut().zip(&results) {
                r.sharding = Some(m.sharding(&spec_r.name, &spec_r.shape));
            }
        }
        let module = Module::new(module, b.finish_with(func_results));
        let text = match &spec.mesh {
            Some(m) => module.with_mesh(m.mesh()).to_text(),
            None => module.to_text(),
        };
        Program::new(text, args, results, spec)
    }
}

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
    let mut p = ProgramBuilder::new(spec, "train_step");
    p.b.unroll_loops(unroll_loops);
    p.b.price_rolled_loops(trips);
    let mv = p.model_params(true);
    let lora_args: Vec<TensorSpec> = p
        .args
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
            moments.push(p.param(&name, &src.shape, DType::F32, role));
        }
    }
    let step = p.param("step", &[], DType::F32, Role::Step);
    let lr = p.param("lr", &[], DType::F32, Role::LearningRate);
    let (ids, labels, mask) = p.batch_params();
    let key = (spec.lora.dropout > 0.0)
        .then(|| p.param("dropout_key", &[2], DType::U64, Role::DropoutKey));

    let layout = p.layout();
    let (loss, grads) = layout.batch_loss_and_grads(&mut p.b, &mv, ids, labels, mask, key)?;
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
    let (updated, grad_norm, guard) =
        spec.adam
            .update_guarded(&mut p.b, &slots, step, lr, Some(loss))?;

    // Results: params, then m, then v (each aliasing its input), then loss and grad norm.
    // (input, output) pairs: the updated params, m and v, in argument order.
    let pairs: Vec<(Value, Value)> = (0..n)
        .map(|i| (mv.lora[i], updated[i].param))
        .chain((0..n).map(|i| (moments[i], updated[i].m)))
        .chain((0..n).map(|i| (moments[n + i], updated[i].v)))
        .collect();
    let state_args: Vec<TensorSpec> = p
        .args
        .iter()
        .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
        .cloned()
        .collect();
    for (a, &(input, output)) in state_args.into_iter().zip(&pairs) {
        p.result_aliasing(input, a, output);
    }
    for (name, v, role) in [
        ("loss", loss, Role::Loss),
        ("grad_norm", grad_norm, Role::GradNorm),
    ] {
        p.result(TensorSpec::new(name, vec![], DType::F32, role), v);
    }
    if let Some(g) = guard {
        for (name, v, role) in [
            ("max_lora_weight", g.largest, Role::MaxWeight),
            ("max_lora_update", g.largest_move, Role::MaxUpdate),
            (
                "max_lora_weight_before",
                g.largest_before,
                Role::MaxWeightBefore,
            ),
        ] {
            p.result(TensorSpec::new(name, vec![], DType::F32, role), v);
        }
    }
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

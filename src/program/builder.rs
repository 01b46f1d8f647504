//! The skeleton every program is built on ([`ProgramBuilder`]): declare the parameters (each
//! named in the program and listed in the signature at once), compute on a [`Layout`] of them,
//! name the results, and finish the module (shardings from the mesh); and a training step's
//! parameters and its AdamW update with the results that go with it, which the supervised and
//! the preference steps share.

use crate::model::optim::Slot;
use crate::model::tensors::{frozen_args_typed, lora_args};
use crate::program::layout::{Layout, ModelValues};
use crate::program::signature::{Program, Role, TensorSpec};
use crate::program::spec::StepSpec;
use anyhow::Result;
use hlo::{Builder, DType, Module, ParamAttrs, Shape, Value};

/// One program as it is built: the graph, its parameters and results so far, and what it is
/// built for.
pub(super) struct ProgramBuilder<'s> {
    spec: &'s StepSpec,
    pub(super) b: Builder,
    pub(super) args: Vec<TensorSpec>,
    results: Vec<TensorSpec>,
    outs: Vec<(String, Value)>,
}

/// A training step's parameters before its batch: the model's (frozen weights and LoRA), the
/// AdamW moments (m of each LoRA tensor, then v), the step number and the learning rate.
pub(super) struct StepState {
    pub(super) mv: ModelValues,
    moments: Vec<Value>,
    step: Value,
    lr: Value,
}

impl<'s> ProgramBuilder<'s> {
    /// A program whose function is named `func`.
    pub(super) fn new(spec: &'s StepSpec, func: &str) -> Self {
        ProgramBuilder {
            spec,
            b: Builder::new(func),
            args: Vec::new(),
            results: Vec::new(),
            outs: Vec::new(),
        }
    }

    /// The model's structure over this program's parameters.
    pub(super) fn layout(&self) -> Layout<'s> {
        Layout { spec: self.spec }
    }

    /// A parameter, declared in the program and listed in its signature.
    pub(super) fn param(&mut self, name: &str, shape: &[i64], dtype: DType, role: Role) -> Value {
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
    pub(super) fn batch_params(&mut self) -> (Value, Value, Value) {
        let shape = [self.spec.batch, self.spec.seq];
        (
            self.param("input_ids", &shape, DType::S32, Role::InputIds),
            self.param("labels", &shape, DType::S32, Role::Labels),
            self.param("attention_mask", &shape, DType::S32, Role::AttentionMask),
        )
    }

    /// A result of the program.
    pub(super) fn result(&mut self, spec: TensorSpec, value: Value) {
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
    pub(super) fn finish(self, module: &str) -> Program {
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

impl ProgramBuilder<'_> {
    /// The parameters of a training step before its batch ([`StepState`]).
    pub(super) fn step_params(&mut self) -> StepState {
        let mv = self.model_params(true);
        let lora_args: Vec<TensorSpec> = self
            .args
            .iter()
            .filter(|a| a.role == Role::Lora)
            .cloned()
            .collect();
        // moments[i] = m of LoRA tensor i, moments[n + i] = its v; named as torch's state dict.
        let mut moments = Vec::new();
        for (prefix, role) in [("exp_avg", Role::AdamM), ("exp_avg_sq", Role::AdamV)] {
            for src in &lora_args {
                let name = format!("{prefix}.{}", src.name);
                moments.push(self.param(&name, &src.shape, DType::F32, role));
            }
        }
        let step = self.param("step", &[], DType::F32, Role::Step);
        let lr = self.param("lr", &[], DType::F32, Role::LearningRate);
        StepState {
            mv,
            moments,
            step,
            lr,
        }
    }

    /// The LoRA dropout key, when the spec drops out.
    pub(super) fn dropout_key(&mut self) -> Option<Value> {
        (self.spec.lora.dropout > 0.0)
            .then(|| self.param("dropout_key", &[2], DType::U64, Role::DropoutKey))
    }

    /// AdamW's update of the LoRA tensors from the step's `loss` and `grads` (in LoRA argument
    /// order), and the step's results: the updated parameters, m and v (each aliasing its
    /// input), the loss and gradient norm, and the finite guard's scalars.
    pub(super) fn update(&mut self, s: &StepState, loss: Value, grads: &[Value]) -> Result<()> {
        let (mv, moments) = (&s.mv, &s.moments);
        let n = mv.lora.len();
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
            self.spec
                .adam
                .update_guarded(&mut self.b, &slots, s.step, s.lr, Some(loss))?;

        // Results: params, then m, then v (each aliasing its input), then loss and grad norm.
        // (input, output) pairs: the updated params, m and v, in argument order.
        let pairs: Vec<(Value, Value)> = (0..n)
            .map(|i| (mv.lora[i], updated[i].param))
            .chain((0..n).map(|i| (moments[i], updated[i].m)))
            .chain((0..n).map(|i| (moments[n + i], updated[i].v)))
            .collect();
        let state_args: Vec<TensorSpec> = self
            .args
            .iter()
            .filter(|a| matches!(a.role, Role::Lora | Role::AdamM | Role::AdamV))
            .cloned()
            .collect();
        for (a, &(input, output)) in state_args.into_iter().zip(&pairs) {
            self.result_aliasing(input, a, output);
        }
        for (name, v, role) in [
            ("loss", loss, Role::Loss),
            ("grad_norm", grad_norm, Role::GradNorm),
        ] {
            self.result(TensorSpec::new(name, vec![], DType::F32, role), v);
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
                self.result(TensorSpec::new(name, vec![], DType::F32, role), v);
            }
        }
        Ok(())
    }
}

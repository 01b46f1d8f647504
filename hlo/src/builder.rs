//! The function builder: parameters, scopes for readable locations, remat regions, and the
//! bookkeeping every op constructor shares. The op constructors themselves live in `ops/`.

use crate::graph::*;
use crate::types::{DType, Shape};

/// A shape or operand error, naming the op: `dot_general: lhs contracting dim 1 has size 64 ...`.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{op}: {message}")]
pub struct Error {
    pub op: &'static str,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn err<T>(op: &'static str, message: impl Into<String>) -> Result<T> {
    Err(Error {
        op,
        message: message.into(),
    })
}

/// Builds one function. Values it returns belong to this builder's function only.
pub struct Builder {
    pub(crate) f: Func,
    pub(crate) scope: Vec<String>,
    pub(crate) remat: Option<u32>,
    next_remat: u32,
    /// Emit [`Builder::fori_loop`] bodies inline, once per iteration, instead of a while loop.
    pub(crate) unroll_loops: bool,
    /// The gradient rules of this function's [`Op::CustomVjp`] nodes, by index.
    pub(crate) vjp_rules: Vec<VjpRule>,
    /// Trips per body of the loops [`Builder::rolled_fori_loop`] builds (see
    /// [`Builder::price_rolled_loops`]); 1 in every program that is run.
    pub(crate) trips_per_rolled_body: i64,
}

/// A gradient rule given to [`Builder::custom_vjp`]: from the computation's inputs, its outputs
/// and the outputs' cotangents (None where an output has none), the inputs' cotangents (None
/// for an input that needs none, e.g. an integer one).
pub type VjpRule = std::rc::Rc<
    dyn Fn(&mut Builder, &[Value], &[Value], &[Option<Value>]) -> Result<Vec<Option<Value>>>,
>;

impl Builder {
    pub fn new(name: &str) -> Builder {
        Builder {
            f: Func {
                name: name.to_string(),
                params: Vec::new(),
                nodes: Vec::new(),
                results: Vec::new(),
                shapes: Vec::new(),
                defined_by: Vec::new(),
            },
            scope: Vec::new(),
            remat: None,
            next_remat: 0,
            unroll_loops: false,
            vjp_rules: Vec::new(),
            trips_per_rolled_body: 1,
        }
    }

    /// Unroll every [`Builder::fori_loop`] built from now on: the body is emitted once per
    /// iteration with a constant index, each iteration's carry and invariants passing through an
    /// `optimization_barrier` as a loop boundary would (so XLA cannot merge work across
    /// iterations, e.g. a backward loop's recomputation with the forward pass). The same
    /// computation as the loop, for compilers whose cost analysis counts a loop body once.
    pub fn unroll_loops(&mut self, unroll: bool) {
        self.unroll_loops = unroll;
    }

    /// For pricing only: each loop built by [`Builder::rolled_fori_loop`] from now on holds
    /// `trips` trips of its body and runs n / trips times, the remainder dropped, so the program
    /// no longer computes what it says. A cost analysis that counts a loop body once prices one
    /// trip as the difference between such a program and the plain one (see
    /// `device::target::aot::Estimate`).
    pub fn price_rolled_loops(&mut self, trips: i64) {
        self.trips_per_rolled_body = trips.max(1);
    }

    /// Whether loops built now are unrolled ([`Builder::unroll_loops`]).
    pub fn unrolls_loops(&self) -> bool {
        self.unroll_loops
    }

    /// The function built so far (for inspection; values stay valid).
    pub fn func(&self) -> &Func {
        &self.f
    }

    fn new_value(&mut self, shape: Shape, def: Option<usize>) -> Value {
        let v = Value(self.f.shapes.len() as u32);
        self.f.shapes.push(shape);
        self.f.defined_by.push(def);
        v
    }

    /// Add a parameter. `name` is for humans (the printed SSA name) and must be unique.
    pub fn param(&mut self, name: &str, shape: Shape) -> Value {
        self.param_with(name, shape, ParamAttrs::default())
    }

    pub fn param_with(&mut self, name: &str, shape: Shape, attrs: ParamAttrs) -> Value {
        let v = self.new_value(shape, None);
        self.f.params.push(Param {
            value: v,
            name: name.to_string(),
            attrs,
        });
        v
    }

    /// Set the attributes of an existing parameter (e.g. donation, once result order is known).
    pub fn set_param_attrs(&mut self, v: Value, attrs: ParamAttrs) {
        if let Some(p) = self.f.params.iter_mut().find(|p| p.value == v) {
            p.attrs = attrs;
        }
    }

    /// Set the sharding of an existing parameter, keeping its other attributes.
    /// Pass parameter `v` in `memory` (e.g. host memory, for weights offloaded from the device).
    pub fn set_param_memory(&mut self, v: Value, memory: Option<MemoryKind>) {
        if let Some(p) = self.f.params.iter_mut().find(|p| p.value == v) {
            p.attrs.memory = memory;
        }
    }

    pub fn set_param_sharding(&mut self, v: Value, sharding: Option<Sharding>) {
        if let Some(p) = self.f.params.iter_mut().find(|p| p.value == v) {
            p.attrs.sharding = sharding;
        }
    }

    pub fn shape(&self, v: Value) -> &Shape {
        self.f.shape(v)
    }

    pub fn dims(&self, v: Value) -> &[i64] {
        &self.f.shape(v).dims
    }

    pub fn dtype(&self, v: Value) -> DType {
        self.f.dtype(v)
    }

    pub fn rank(&self, v: Value) -> usize {
        self.f.shape(v).rank()
    }

    /// Enter a named scope: nodes created until the matching [`Builder::pop_scope`] carry
    /// `loc("outer.inner")`.
    pub fn push_scope(&mut self, name: &str) {
        self.scope.push(name.to_string());
    }

    pub fn pop_scope(&mut self) {
        self.scope.pop();
    }

    /// Run `f` inside a named scope.
    pub fn scoped<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Builder) -> Result<R>,
    ) -> Result<R> {
        self.push_scope(name);
        let r = f(self);
        self.pop_scope();
        r
    }

    /// Run `f` as a remat region: what it computes is recomputed in the backward pass (behind an
    /// `optimization_barrier`) instead of being kept alive from the forward pass.
    pub fn remat<R>(&mut self, f: impl FnOnce(&mut Builder) -> Result<R>) -> Result<R> {
        let outer = self.remat;
        self.remat = Some(self.next_remat);
        self.next_remat += 1;
        let r = f(self);
        self.remat = outer;
        r
    }

    /// `outputs`, computed from `inputs` by nodes already built, with `rule` as their gradient:
    /// autodiff gives each input its cotangent by the rule and never differentiates the nodes in
    /// between (a loop, which has no generic rule, or a computation whose plain derivative
    /// would keep too much alive). Returns the outputs to use from here on.
    pub fn custom_vjp(&mut self, inputs: &[Value], outputs: &[Value], rule: VjpRule) -> Vec<Value> {
        let id = self.vjp_rules.len() as u32;
        self.vjp_rules.push(rule);
        let shapes = outputs.iter().map(|&v| self.shape(v).clone()).collect();
        let mut operands = outputs.to_vec();
        operands.extend_from_slice(inputs);
        self.push(Op::CustomVjp(id), operands, shapes)
    }

    fn loc(&self) -> Option<String> {
        (!self.scope.is_empty()).then(|| self.scope.join("."))
    }

    /// Append a node with the given output shapes; shape checking is the caller's job.
    pub(crate) fn push(&mut self, op: Op, inputs: Vec<Value>, outs: Vec<Shape>) -> Vec<Value> {
        let idx = self.f.nodes.len();
        let outputs: Vec<Value> = outs
            .into_iter()
            .map(|s| self.new_value(s, Some(idx)))
            .collect();
        let loc = self.loc();
        self.f.nodes.push(Node {
            op,
            inputs,
            outputs: outputs.clone(),
            loc,
            remat: self.remat,
        });
        outputs
    }

    pub(crate) fn push1(&mut self, op: Op, inputs: Vec<Value>, out: Shape) -> Value {
        self.push(op, inputs, vec![out])[0]
    }

    /// Append a copy of `node` reading `inputs`, outside any remat region (used by autodiff).
    pub(crate) fn push_copy(&mut self, node: &Node, inputs: Vec<Value>) -> Vec<Value> {
        let shapes = node
            .outputs
            .iter()
            .map(|&v| self.shape(v).clone())
            .collect();
        let saved = self.remat.take();
        let outs = self.push(node.op.clone(), inputs, shapes);
        self.remat = saved;
        outs
    }

    /// Finish the function with named results.
    pub fn finish(self, results: &[(&str, Value)]) -> Func {
        self.finish_with(
            results
                .iter()
                .map(|(n, v)| FuncResult {
                    value: *v,
                    name: n.to_string(),
                    sharding: None,
                })
                .collect(),
        )
    }

    pub fn finish_with(mut self, results: Vec<FuncResult>) -> Func {
        self.f.results = results;
        self.f
    }
}

//! The graph: functions made of nodes in SSA order. A `Value` is an index into its function.

use crate::types::{DType, Shape};

/// A value of one function (a parameter or a node output).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value(pub(crate) u32);

impl Value {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Log1p,
    Sqrt,
    Rsqrt,
    Tanh,
    Logistic,
    Sin,
    Cos,
    Floor,
    Sign,
    Not,
}

impl UnaryOp {
    pub fn mlir(self) -> &'static str {
        match self {
            UnaryOp::Neg => "negate",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exponential",
            UnaryOp::Log => "log",
            UnaryOp::Log1p => "log_plus_one",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Logistic => "logistic",
            UnaryOp::Sin => "sine",
            UnaryOp::Cos => "cosine",
            UnaryOp::Floor => "floor",
            UnaryOp::Sign => "sign",
            UnaryOp::Not => "not",
        }
    }

    /// Ops defined on floats only (the rest also take integers; `not` takes ints and bools).
    pub fn float_only(self) -> bool {
        !matches!(
            self,
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Not
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Max,
    Min,
    Pow,
    And,
    Or,
    Xor,
    ShiftLeft,
    ShiftRightLogical,
    ShiftRightArithmetic,
}

impl BinaryOp {
    pub fn mlir(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "subtract",
            BinaryOp::Mul => "multiply",
            BinaryOp::Div => "divide",
            BinaryOp::Rem => "remainder",
            BinaryOp::Max => "maximum",
            BinaryOp::Min => "minimum",
            BinaryOp::Pow => "power",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::ShiftLeft => "shift_left",
            BinaryOp::ShiftRightLogical => "shift_right_logical",
            BinaryOp::ShiftRightArithmetic => "shift_right_arithmetic",
        }
    }

    /// Bitwise and shift ops take integers (and/or/xor also booleans), never floats.
    pub fn integer_only(self) -> bool {
        matches!(
            self,
            BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::ShiftLeft
                | BinaryOp::ShiftRightLogical
                | BinaryOp::ShiftRightArithmetic
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpDir {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpDir {
    pub fn mlir(self) -> &'static str {
        match self {
            CmpDir::Eq => "EQ",
            CmpDir::Ne => "NE",
            CmpDir::Lt => "LT",
            CmpDir::Le => "LE",
            CmpDir::Gt => "GT",
            CmpDir::Ge => "GE",
        }
    }
}

/// The combiner of a reduce or scatter. Named rather than an arbitrary region so that autodiff
/// knows what it differentiates and the printer writes the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combiner {
    Add,
    Max,
    Min,
    /// Scatter only: the update replaces the operand element.
    Replace,
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct DotDims {
    pub lhs_batch: Vec<i64>,
    pub rhs_batch: Vec<i64>,
    pub lhs_contract: Vec<i64>,
    pub rhs_contract: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatherDims {
    pub offset_dims: Vec<i64>,
    pub collapsed_slice_dims: Vec<i64>,
    pub start_index_map: Vec<i64>,
    pub index_vector_dim: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScatterDims {
    pub update_window_dims: Vec<i64>,
    pub inserted_window_dims: Vec<i64>,
    pub scatter_dims_to_operand_dims: Vec<i64>,
    pub index_vector_dim: i64,
}

/// `precision_config` of dot_general.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Default,
    High,
    Highest,
}

/// Constant data. Floats are kept as f64 and ints as i64, which holds every value of the smaller
/// types exactly; the printer writes them in the tensor's own type.
#[derive(Clone, Debug, PartialEq)]
pub enum Literal {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl Literal {
    pub fn len(&self) -> usize {
        match self {
            Literal::Float(v) => v.len(),
            Literal::Int(v) => v.len(),
            Literal::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A device mesh: named axes with sizes, e.g. `data=2, fsdp=4`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mesh {
    pub axes: Vec<(String, i64)>,
}

impl Mesh {
    pub fn device_count(&self) -> i64 {
        self.axes.iter().map(|(_, n)| n).product()
    }

    pub fn axis_size(&self, name: &str) -> Option<i64> {
        self.axes.iter().find(|(n, _)| n == name).map(|(_, s)| *s)
    }
}

/// How a tensor is split over the mesh: for each dimension, the mesh axes it is split along
/// (empty = replicated along that dimension).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Sharding {
    pub dims: Vec<Vec<String>>,
}

impl Sharding {
    pub fn replicated(rank: usize) -> Sharding {
        Sharding {
            dims: vec![Vec::new(); rank],
        }
    }

    pub fn is_replicated(&self) -> bool {
        self.dims.iter().all(|d| d.is_empty())
    }

    /// The shape one device holds, given the mesh.
    pub fn shard_dims(&self, dims: &[i64], mesh: &Mesh) -> Vec<i64> {
        dims.iter()
            .zip(&self.dims)
            .map(|(&d, axes)| {
                let split: i64 = axes.iter().filter_map(|a| mesh.axis_size(a)).product();
                d / split.max(1)
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Constant(Literal),
    Iota {
        dim: i64,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    Compare(CmpDir),
    Select,
    Clamp,
    Convert,
    BitcastConvert,
    BroadcastInDim {
        dims: Vec<i64>,
    },
    Reshape,
    Transpose {
        perm: Vec<i64>,
    },
    Slice {
        start: Vec<i64>,
        limit: Vec<i64>,
        strides: Vec<i64>,
    },
    DynamicSlice {
        sizes: Vec<i64>,
    },
    DynamicUpdateSlice,
    Concatenate {
        dim: i64,
    },
    Pad {
        low: Vec<i64>,
        high: Vec<i64>,
        interior: Vec<i64>,
    },
    Gather {
        dims: GatherDims,
        slice_sizes: Vec<i64>,
    },
    Scatter {
        dims: ScatterDims,
        combiner: Combiner,
    },
    DotGeneral {
        dims: DotDims,
        precision: Option<Precision>,
    },
    Reduce {
        dims: Vec<i64>,
        combiner: Combiner,
    },
    While {
        cond: Box<Func>,
        body: Box<Func>,
    },
    OptimizationBarrier,
    ShardingConstraint(Sharding),
    /// Identity that tells XLA which memory the value lives in from here on (XLA's host
    /// offloading: `annotate_device_placement`).
    Place(MemoryKind),
    RngBitGenerator,
    /// A buffer whose contents are undefined (XLA's `AllocateBuffer` custom call, which TPU and
    /// GPU compilers implement): for a loop-carried stack that the loop writes whole, so that
    /// no fill is written first.
    Uninitialized,
    /// Identity for the graph, a wall for autodiff. Printed as nothing: its output is its input.
    StopGradient,
    /// `(recomputed, saved)`: evaluates to `saved` while gradients flow into `recomputed`. Lets a
    /// backward pass reuse a value saved by the forward pass; printed as nothing, so the
    /// recomputation is dead code that XLA removes.
    UseSaved,
    /// `(outputs.., inputs..)` of a computation with its own gradient rule (rule `n` of the
    /// builder that made it; see [`crate::Builder::custom_vjp`]): evaluates to the outputs, and
    /// autodiff gives the inputs their cotangents by the rule instead of through the nodes that
    /// computed the outputs. Printed as nothing: its outputs are the computation's.
    CustomVjp(u32),
    /// A named op with a decomposition of its own (`stablehlo.composite`): a compiler inlines
    /// the decomposition unless it has an implementation of that name and version to put in its
    /// place. Autodiff never enters it (wrap it in a custom vjp).
    Composite(Box<Composite>),
    /// A computation written per device (`sdy.manual_computation` over every mesh axis): its
    /// body sees each device's shard of the operands, as the in-shardings cut them, and its
    /// results are put together by the out-shardings. Autodiff never enters it.
    ManualComputation(Box<ManualComputation>),
    /// A call into a target's own library (`stablehlo.custom_call`), with the string it reads
    /// and the layouts it expects: only a target's kernel emits one. No gradient.
    CustomCall(Box<CustomCall>),
}

/// A composite attribute's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Str(String),
}

/// What [`Op::Composite`] holds: its name and version (what an implementation is looked up
/// by), its attributes, and the function it stands for.
#[derive(Clone, Debug, PartialEq)]
pub struct Composite {
    pub name: String,
    pub version: i32,
    pub attributes: Vec<(String, Attr)>,
    pub decomposition: Func,
}

/// What [`Op::CustomCall`] holds: the symbol called, its backend config and the layouts
/// (minor to major) of its operands and results.
#[derive(Clone, Debug, PartialEq)]
pub struct CustomCall {
    pub target: String,
    pub backend_config: String,
    pub operand_layouts: Vec<Vec<i64>>,
    pub result_layouts: Vec<Vec<i64>>,
}

/// What [`Op::ManualComputation`] holds: how each operand and result is cut over the mesh, the
/// mesh's axes (all of them manual), and the per-device body.
#[derive(Clone, Debug, PartialEq)]
pub struct ManualComputation {
    pub in_shardings: Vec<Sharding>,
    pub out_shardings: Vec<Sharding>,
    pub manual_axes: Vec<String>,
    pub body: Func,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Constant(_) => "constant",
            Op::Iota { .. } => "iota",
            Op::Unary(u) => u.mlir(),
            Op::Binary(b) => b.mlir(),
            Op::Compare(_) => "compare",
            Op::Select => "select",
            Op::Clamp => "clamp",
            Op::Convert => "convert",
            Op::BitcastConvert => "bitcast_convert",
            Op::BroadcastInDim { .. } => "broadcast_in_dim",
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::DynamicSlice { .. } => "dynamic_slice",
            Op::DynamicUpdateSlice => "dynamic_update_slice",
            Op::Concatenate { .. } => "concatenate",
            Op::Pad { .. } => "pad",
            Op::Gather { .. } => "gather",
            Op::Scatter { .. } => "scatter",
            Op::DotGeneral { .. } => "dot_general",
            Op::Reduce { .. } => "reduce",
            Op::While { .. } => "while",
            Op::OptimizationBarrier => "optimization_barrier",
            Op::ShardingConstraint(_) => "sharding_constraint",
            Op::Place(_) => "annotate_device_placement",
            Op::RngBitGenerator => "rng_bit_generator",
            Op::Uninitialized => "uninitialized",
            Op::StopGradient => "stop_gradient",
            Op::UseSaved => "use_saved",
            Op::CustomVjp(_) => "custom_vjp",
            Op::Composite(_) => "composite",
            Op::ManualComputation(_) => "manual_computation",
            Op::CustomCall(_) => "custom_call",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<Value>,
    pub outputs: Vec<Value>,
    /// Readable location, printed as `loc("...")` and kept by XLA in op metadata.
    pub loc: Option<String>,
    /// Remat region this node belongs to: recomputed in the backward instead of kept.
    pub remat: Option<u32>,
}

/// Attributes of a function parameter.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ParamAttrs {
    /// The buffer is donated and its memory reused for this result index.
    pub alias_output: Option<usize>,
    pub sharding: Option<Sharding>,
    /// The memory the argument is passed in (None: the device's own).
    pub memory: Option<MemoryKind>,
}

/// A memory space as XLA's memory kinds name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// The accelerator's own memory.
    Device,
    /// Page-locked host memory the device reads and writes directly (DMA).
    PinnedHost,
}

impl MemoryKind {
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Device => "device",
            MemoryKind::PinnedHost => "pinned_host",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub value: Value,
    pub name: String,
    pub attrs: ParamAttrs,
}

#[derive(Clone, Debug, PartialEq)]
pub struct FuncResult {
    pub value: Value,
    pub name: String,
    pub sharding: Option<Sharding>,
}

/// A function: parameters, nodes in definition order, results. Also used for regions.
#[derive(Clone, Debug, PartialEq)]
pub struct Func {
    pub name: String,
    pub params: Vec<Param>,
    pub nodes: Vec<Node>,
    pub results: Vec<FuncResult>,
    /// Type of every value, indexed by `Value`.
    pub shapes: Vec<Shape>,
    /// For every value, the node that defines it (`None` for parameters).
    pub defined_by: Vec<Option<usize>>,
}

impl Func {
    pub fn shape(&self, v: Value) -> &Shape {
        &self.shapes[v.index()]
    }

    pub fn dtype(&self, v: Value) -> DType {
        self.shapes[v.index()].dtype
    }

    /// Count the nodes whose op has this name (e.g. "dot_general"), including nested regions.
    pub fn count_ops(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .map(|n| {
                let own = (n.op.name() == name) as usize;
                let nested = match &n.op {
                    Op::While { cond, body } => cond.count_ops(name) + body.count_ops(name),
                    Op::Composite(c) => c.decomposition.count_ops(name),
                    Op::ManualComputation(m) => m.body.count_ops(name),
                    _ => 0,
                };
                own + nested
            })
            .sum()
    }
}

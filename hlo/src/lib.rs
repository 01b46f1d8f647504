//! `hlo`: a typed StableHLO builder with shape inference, reverse-mode autodiff and a
//! deterministic printer. It knows nothing of files, plugins or Llama.
//!
//! Build `f(x, W) = sum(tanh(x @ W))`, take its gradient with respect to `W`, print it:
//!
//! ```
//! use hlo::{Builder, DType, Module, Shape};
//!
//! let mut b = Builder::new("main");
//! let x = b.param("x", Shape::new(&[4, 3], DType::F32));
//! let w = b.param("W", Shape::new(&[3, 2], DType::F32));
//! let xw = b.matmul(x, w)?;
//! let t = b.tanh(xw)?;
//! let f = b.sum_all(t)?;
//! let grads = b.grad(f, &[w])?;              // only W: no gradient work for x
//! let func = b.finish(&[("f", f), ("dW", grads[0])]);
//! let text = Module::new("example", func).to_text();
//! assert!(text.contains("stablehlo.tanh"));
//! println!("{text}");
//! // Running it: pjrt::Client::compile(&text, ..) then execute with x and W buffers
//! // (see hlo/tests/ops.rs for the whole round trip through the CPU plugin).
//! # Ok::<(), hlo::Error>(())
//! ```
//!
//! Op constructors check their operands and fail with a message that names the op and the
//! shapes, e.g. `dot_general: lhs contracting dim 1 has size 64 but rhs contracting dim 0 has
//! size 32 (lhs tensor<4x64xf32>, rhs tensor<32x8xf32>)`.

mod autodiff;
mod builder;
mod graph;
mod ops;
mod print;
mod regions;
mod types;

pub use builder::{Builder, Error, Result, VjpRule};
pub use graph::{
    Attr, BinaryOp, CmpDir, Combiner, Composite, DotDims, Func, FuncResult, GatherDims, Literal,
    ManualComputation, MemoryKind, Mesh, Node, Op, Param, ParamAttrs, Precision, ScatterDims,
    Sharding, UnaryOp, Value,
};
pub use print::{
    composite_calls, function_signature, function_text, replace_function, CompositeCall, Module,
};
pub use types::{DType, Shape};

//! Ops that make a value from nothing but their attributes (constants, iota, an uninitialized
//! buffer) or from a generator's state (random bits). None has a gradient.

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::{DType, Shape};

impl Builder {
    /// A constant: `values` holds one value (splat) or one per element, row-major.
    pub fn constant(&mut self, values: Literal, shape: Shape) -> Result<Value> {
        let n = shape.element_count() as usize;
        if values.len() != 1 && values.len() != n {
            return err(
                "constant",
                format!("{} values for {shape} ({n} elements)", values.len()),
            );
        }
        let kind_ok = match &values {
            Literal::Float(_) => shape.dtype.is_float(),
            Literal::Int(_) => shape.dtype.is_int(),
            Literal::Bool(_) => shape.dtype == DType::Pred,
        };
        if !kind_ok {
            return err("constant", format!("literal kind does not match {shape}"));
        }
        Ok(self.push1(Op::Constant(values), vec![], shape))
    }

    /// A tensor of `shape` filled with `value` (converted to the element type).
    pub fn full(&mut self, value: f64, shape: Shape) -> Value {
        let lit = match shape.dtype {
            DType::Pred => Literal::Bool(vec![value != 0.0]),
            d if d.is_float() => Literal::Float(vec![value]),
            _ => Literal::Int(vec![value as i64]),
        };
        self.constant(lit, shape).expect("splat constant")
    }

    pub fn scalar(&mut self, value: f64, dtype: DType) -> Value {
        self.full(value, Shape::scalar(dtype))
    }

    pub fn zeros(&mut self, shape: Shape) -> Value {
        self.full(0.0, shape)
    }

    pub fn zeros_like(&mut self, v: Value) -> Value {
        let s = self.shape(v).clone();
        self.zeros(s)
    }

    pub fn full_like(&mut self, v: Value, value: f64) -> Value {
        let s = self.shape(v).clone();
        self.full(value, s)
    }

    pub fn iota(&mut self, shape: Shape, dim: i64) -> Result<Value> {
        if dim < 0 || dim as usize >= shape.rank() {
            return err("iota", format!("dim {dim} out of range for {shape}"));
        }
        Ok(self.push1(Op::Iota { dim }, vec![], shape))
    }

    /// A tensor of `shape` whose elements are undefined until written (XLA's `AllocateBuffer`):
    /// the initial value of a loop-carried buffer that the loop overwrites whole before any
    /// element is read, where a constant fill would be one more write of the whole buffer. Only
    /// TPU and GPU compilers implement it; XLA CPU rejects the program.
    pub fn uninitialized(&mut self, shape: Shape) -> Value {
        self.push1(Op::Uninitialized, vec![], shape)
    }

    /// Threefry random bits: returns (new state, bits of `shape`). `state` is `tensor<2xui64>`.
    pub fn rng_bit_generator(&mut self, state: Value, shape: Shape) -> Result<(Value, Value)> {
        let s = self.shape(state).clone();
        if s != Shape::new(&[2], DType::U64) {
            return err(
                "rng_bit_generator",
                format!("state must be tensor<2xui64>, got {s}"),
            );
        }
        if !shape.dtype.is_unsigned_int() {
            return err(
                "rng_bit_generator",
                format!("output must be unsigned integers, got {shape}"),
            );
        }
        let outs = self.push(Op::RngBitGenerator, vec![state], vec![s, shape]);
        Ok((outs[0], outs[1]))
    }
}

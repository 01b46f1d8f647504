//! Op constructors, each checking its operands and inferring its result type, and beside each
//! group the vjp rule autodiff uses for it (`vjp` at the bottom dispatches to them).
//!
//! A vjp rule gets the node (with the values it should read: recomputed ones inside a remat
//! region), the cotangent of each output, and which inputs need a gradient. It returns one
//! optional cotangent per input and must not emit work for inputs that need none.

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::{DType, Shape};

fn dims_str(d: &[i64]) -> String {
    format!("{d:?}")
}

// ------------------------------------------------------------------ constants, iota

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
}

// ------------------------------------------------------------------ elementwise

impl Builder {
    fn unary(&mut self, op: UnaryOp, x: Value) -> Result<Value> {
        let s = self.shape(x).clone();
        if op.float_only() && !s.dtype.is_float() {
            return err(op.mlir(), format!("needs a float operand, got {s}"));
        }
        if op == UnaryOp::Not && s.dtype.is_float() {
            return err(
                "not",
                format!("needs a boolean or integer operand, got {s}"),
            );
        }
        Ok(self.push1(Op::Unary(op), vec![x], s))
    }

    pub fn neg(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Neg, x)
    }
    pub fn abs(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Abs, x)
    }
    pub fn exp(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Exp, x)
    }
    pub fn log(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Log, x)
    }
    pub fn log1p(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Log1p, x)
    }
    pub fn sqrt(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Sqrt, x)
    }
    pub fn rsqrt(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Rsqrt, x)
    }
    pub fn tanh(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Tanh, x)
    }
    pub fn logistic(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Logistic, x)
    }
    pub fn sin(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Sin, x)
    }
    pub fn cos(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Cos, x)
    }
    pub fn floor(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Floor, x)
    }
    pub fn sign(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Sign, x)
    }
    pub fn not(&mut self, x: Value) -> Result<Value> {
        self.unary(UnaryOp::Not, x)
    }

    fn binary(&mut self, op: BinaryOp, a: Value, b: Value) -> Result<Value> {
        let (sa, sb) = (self.shape(a).clone(), self.shape(b).clone());
        if sa != sb {
            return err(
                op.mlir(),
                format!("operands must have the same type, got {sa} and {sb}"),
            );
        }
        if op.integer_only() && sa.dtype.is_float() {
            return err(op.mlir(), format!("needs integer operands, got {sa}"));
        }
        Ok(self.push1(Op::Binary(op), vec![a, b], sa))
    }

    pub fn add(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Div, a, b)
    }
    pub fn rem(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Rem, a, b)
    }
    pub fn max(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Max, a, b)
    }
    pub fn min(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Min, a, b)
    }
    pub fn pow(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Pow, a, b)
    }
    pub fn and(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::And, a, b)
    }
    pub fn or(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Or, a, b)
    }
    pub fn xor(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::Xor, a, b)
    }
    pub fn shift_left(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::ShiftLeft, a, b)
    }
    pub fn shift_right_logical(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::ShiftRightLogical, a, b)
    }
    pub fn shift_right_arithmetic(&mut self, a: Value, b: Value) -> Result<Value> {
        self.binary(BinaryOp::ShiftRightArithmetic, a, b)
    }

    /// `x * c` for a constant c.
    pub fn mul_scalar(&mut self, x: Value, c: f64) -> Result<Value> {
        let k = self.full_like(x, c);
        self.mul(x, k)
    }

    /// `x + c` for a constant c.
    pub fn add_scalar(&mut self, x: Value, c: f64) -> Result<Value> {
        let k = self.full_like(x, c);
        self.add(x, k)
    }

    pub fn compare(&mut self, a: Value, b: Value, dir: CmpDir) -> Result<Value> {
        let (sa, sb) = (self.shape(a).clone(), self.shape(b).clone());
        if sa != sb {
            return err(
                "compare",
                format!("operands must have the same type, got {sa} and {sb}"),
            );
        }
        Ok(self.push1(Op::Compare(dir), vec![a, b], sa.with_dtype(DType::Pred)))
    }

    /// `pred ? on_true : on_false`, elementwise (pred may also be a scalar).
    pub fn select(&mut self, pred: Value, on_true: Value, on_false: Value) -> Result<Value> {
        let (sp, st, sf) = (
            self.shape(pred).clone(),
            self.shape(on_true).clone(),
            self.shape(on_false).clone(),
        );
        if sp.dtype != DType::Pred {
            return err("select", format!("predicate must be i1, got {sp}"));
        }
        if st != sf {
            return err(
                "select",
                format!("branches must have the same type, got {st} and {sf}"),
            );
        }
        if sp.rank() != 0 && sp.dims != st.dims {
            return err(
                "select",
                format!("predicate {sp} does not match branches {st}"),
            );
        }
        Ok(self.push1(Op::Select, vec![pred, on_true, on_false], st))
    }

    /// `min(max(x, lo), hi)`; lo and hi may be scalars.
    pub fn clamp(&mut self, lo: Value, x: Value, hi: Value) -> Result<Value> {
        let sx = self.shape(x).clone();
        for b in [lo, hi] {
            let sb = self.shape(b).clone();
            if sb.dtype != sx.dtype || (sb.rank() != 0 && sb.dims != sx.dims) {
                return err("clamp", format!("bound {sb} does not match operand {sx}"));
            }
        }
        Ok(self.push1(Op::Clamp, vec![lo, x, hi], sx))
    }

    pub fn convert(&mut self, x: Value, dtype: DType) -> Result<Value> {
        let s = self.shape(x).clone();
        if s.dtype == dtype {
            return Ok(x);
        }
        Ok(self.push1(Op::Convert, vec![x], s.with_dtype(dtype)))
    }

    /// Reinterpret the bits as another element type of the same width (`x` itself when it
    /// already has that type, as [`Builder::convert`]).
    pub fn bitcast_convert(&mut self, x: Value, dtype: DType) -> Result<Value> {
        let s = self.shape(x).clone();
        if s.dtype == dtype {
            return Ok(x);
        }
        if s.dtype.bits() != dtype.bits() {
            return err(
                "bitcast_convert",
                format!("{s} cannot be reinterpreted as {dtype}: element widths differ"),
            );
        }
        Ok(self.push1(Op::BitcastConvert, vec![x], s.with_dtype(dtype)))
    }

    /// Identity in the forward pass; no gradient flows through it.
    pub fn stop_gradient(&mut self, x: Value) -> Value {
        let s = self.shape(x).clone();
        self.push1(Op::StopGradient, vec![x], s)
    }

    /// Evaluate to `saved` (a value the forward pass kept) while gradients flow into
    /// `recomputed`, whose computation then becomes dead code.
    pub fn use_saved(&mut self, recomputed: Value, saved: Value) -> Result<Value> {
        let (r, s) = (self.shape(recomputed).clone(), self.shape(saved).clone());
        if r != s {
            return err(
                "use_saved",
                format!("saved {s} does not match recomputed {r}"),
            );
        }
        Ok(self.push1(Op::UseSaved, vec![recomputed, saved], r))
    }
}

fn unary_vjp(b: &mut Builder, op: UnaryOp, x: Value, y: Value, g: Value) -> Result<Option<Value>> {
    Ok(Some(match op {
        UnaryOp::Neg => b.neg(g)?,
        UnaryOp::Abs => {
            let s = b.sign(x)?;
            b.mul(g, s)?
        }
        UnaryOp::Exp => b.mul(g, y)?,
        UnaryOp::Log => b.div(g, x)?,
        UnaryOp::Log1p => {
            let one_plus = b.add_scalar(x, 1.0)?;
            b.div(g, one_plus)?
        }
        // d sqrt(x) = 1 / (2 sqrt(x))
        UnaryOp::Sqrt => {
            let two_y = b.mul_scalar(y, 2.0)?;
            b.div(g, two_y)?
        }
        // d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
        UnaryOp::Rsqrt => {
            let y2 = b.mul(y, y)?;
            let y3 = b.mul(y2, y)?;
            let k = b.mul_scalar(y3, -0.5)?;
            b.mul(g, k)?
        }
        UnaryOp::Tanh => {
            let y2 = b.mul(y, y)?;
            let one = b.full_like(y, 1.0);
            let d = b.sub(one, y2)?;
            b.mul(g, d)?
        }
        UnaryOp::Logistic => {
            let one = b.full_like(y, 1.0);
            let one_minus = b.sub(one, y)?;
            let d = b.mul(y, one_minus)?;
            b.mul(g, d)?
        }
        UnaryOp::Sin => {
            let c = b.cos(x)?;
            b.mul(g, c)?
        }
        UnaryOp::Cos => {
            let s = b.sin(x)?;
            let ns = b.neg(s)?;
            b.mul(g, ns)?
        }
        UnaryOp::Floor | UnaryOp::Sign => b.zeros_like(x),
        UnaryOp::Not => return Ok(None),
    }))
}

fn binary_vjp(
    b: &mut Builder,
    op: BinaryOp,
    (x, y): (Value, Value),
    out: Value,
    g: Value,
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    let (nx, ny) = (needs[0], needs[1]);
    Ok(match op {
        BinaryOp::Add => vec![nx.then_some(g), ny.then_some(g)],
        BinaryOp::Sub => vec![nx.then_some(g), if ny { Some(b.neg(g)?) } else { None }],
        BinaryOp::Mul => vec![
            if nx { Some(b.mul(g, y)?) } else { None },
            if ny { Some(b.mul(g, x)?) } else { None },
        ],
        BinaryOp::Div => {
            let gx = b.div(g, y)?;
            let gy = if ny {
                // d(x/y)/dy = -x/y^2 = -(out / y)
                let t = b.mul(gx, out)?;
                Some(b.neg(t)?)
            } else {
                None
            };
            vec![nx.then_some(gx), gy]
        }
        BinaryOp::Max | BinaryOp::Min => {
            // The gradient goes to x where x was chosen (ties go to x), else to y.
            let dir = if op == BinaryOp::Max {
                CmpDir::Ge
            } else {
                CmpDir::Le
            };
            let pick_x = b.compare(x, y, dir)?;
            let zero = b.zeros_like(g);
            vec![
                if nx {
                    Some(b.select(pick_x, g, zero)?)
                } else {
                    None
                },
                if ny {
                    Some(b.select(pick_x, zero, g)?)
                } else {
                    None
                },
            ]
        }
        BinaryOp::Pow => {
            let gx = if nx {
                // y * x^(y-1) = y * out / x
                let t = b.mul(g, y)?;
                let t = b.mul(t, out)?;
                Some(b.div(t, x)?)
            } else {
                None
            };
            let gy = if ny {
                let lx = b.log(x)?;
                let t = b.mul(g, out)?;
                Some(b.mul(t, lx)?)
            } else {
                None
            };
            vec![gx, gy]
        }
        BinaryOp::Rem => {
            // x - y * trunc(x / y): d/dx = 1, d/dy = -trunc(x / y)
            let gy = if ny {
                let r = b.sub(x, out)?;
                let q = b.div(r, y)?;
                let t = b.mul(g, q)?;
                Some(b.neg(t)?)
            } else {
                None
            };
            vec![nx.then_some(g), gy]
        }
        _ => vec![None, None],
    })
}

// ------------------------------------------------------------------ shape ops

impl Builder {
    /// Place `x`'s dims at positions `dims` of a tensor of `out_dims`, repeating along the rest.
    pub fn broadcast_in_dim(&mut self, x: Value, out_dims: &[i64], dims: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        if dims.len() != s.rank() {
            return err(
                "broadcast_in_dim",
                format!(
                    "{s} has rank {} but {} dims were mapped",
                    s.rank(),
                    dims.len()
                ),
            );
        }
        for (i, &d) in dims.iter().enumerate() {
            if d < 0 || d as usize >= out_dims.len() {
                return err(
                    "broadcast_in_dim",
                    format!(
                        "dim {d} out of range for result dims {}",
                        dims_str(out_dims)
                    ),
                );
            }
            if dims[..i].contains(&d) {
                return err("broadcast_in_dim", format!("dim {d} mapped twice"));
            }
            let (from, to) = (s.dims[i], out_dims[d as usize]);
            if from != 1 && from != to {
                return err(
                    "broadcast_in_dim",
                    format!(
                        "operand dim {i} has size {from} but result dim {d} has size {to} ({s} -> {})",
                        dims_str(out_dims)
                    ),
                );
            }
        }
        if s.dims == out_dims {
            return Ok(x);
        }
        Ok(self.push1(
            Op::BroadcastInDim {
                dims: dims.to_vec(),
            },
            vec![x],
            s.with_dims(out_dims),
        ))
    }

    /// Numpy-style broadcast: `x`'s dims align with the trailing dims of `out_dims`.
    pub fn broadcast_to(&mut self, x: Value, out_dims: &[i64]) -> Result<Value> {
        let r = self.rank(x);
        if r > out_dims.len() {
            return err(
                "broadcast_in_dim",
                format!(
                    "cannot broadcast {} to {}",
                    self.shape(x),
                    dims_str(out_dims)
                ),
            );
        }
        let offset = (out_dims.len() - r) as i64;
        let dims: Vec<i64> = (0..r as i64).map(|i| i + offset).collect();
        self.broadcast_in_dim(x, out_dims, &dims)
    }

    pub fn reshape(&mut self, x: Value, dims: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        let n: i64 = dims.iter().product();
        if n != s.element_count() || dims.iter().any(|&d| d < 0) {
            return err(
                "reshape",
                format!(
                    "cannot reshape {s} ({} elements) to {}",
                    s.element_count(),
                    dims_str(dims)
                ),
            );
        }
        if s.dims == dims {
            return Ok(x);
        }
        Ok(self.push1(Op::Reshape, vec![x], s.with_dims(dims)))
    }

    pub fn transpose(&mut self, x: Value, perm: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        let mut seen = vec![false; s.rank()];
        if perm.len() != s.rank()
            || perm.iter().any(|&p| {
                p < 0 || p as usize >= s.rank() || std::mem::replace(&mut seen[p as usize], true)
            })
        {
            return err(
                "transpose",
                format!("{} is not a permutation of the dims of {s}", dims_str(perm)),
            );
        }
        if perm.iter().enumerate().all(|(i, &p)| i as i64 == p) {
            return Ok(x);
        }
        let dims: Vec<i64> = perm.iter().map(|&p| s.dims[p as usize]).collect();
        Ok(self.push1(
            Op::Transpose {
                perm: perm.to_vec(),
            },
            vec![x],
            s.with_dims(&dims),
        ))
    }

    pub fn slice(
        &mut self,
        x: Value,
        start: &[i64],
        limit: &[i64],
        strides: &[i64],
    ) -> Result<Value> {
        let s = self.shape(x).clone();
        if start.len() != s.rank() || limit.len() != s.rank() || strides.len() != s.rank() {
            return err(
                "slice",
                format!(
                    "start/limit/strides must each have {} entries for {s}",
                    s.rank()
                ),
            );
        }
        let mut out = Vec::new();
        for i in 0..s.rank() {
            if start[i] < 0 || start[i] > limit[i] || limit[i] > s.dims[i] || strides[i] < 1 {
                return err(
                    "slice",
                    format!(
                        "dim {i}: [{}:{}:{}] is outside 0..{} of {s}",
                        start[i], limit[i], strides[i], s.dims[i]
                    ),
                );
            }
            out.push((limit[i] - start[i] + strides[i] - 1) / strides[i]);
        }
        Ok(self.push1(
            Op::Slice {
                start: start.to_vec(),
                limit: limit.to_vec(),
                strides: strides.to_vec(),
            },
            vec![x],
            s.with_dims(&out),
        ))
    }

    /// `x[.., from:to, ..]` along one dim (stride 1).
    pub fn slice_dim(&mut self, x: Value, dim: usize, from: i64, to: i64) -> Result<Value> {
        let d = self.dims(x).to_vec();
        let mut start = vec![0; d.len()];
        let mut limit = d.clone();
        start[dim] = from;
        limit[dim] = to;
        self.slice(x, &start, &limit, &vec![1; d.len()])
    }

    pub fn dynamic_slice(&mut self, x: Value, starts: &[Value], sizes: &[i64]) -> Result<Value> {
        let s = self.shape(x).clone();
        if starts.len() != s.rank() || sizes.len() != s.rank() {
            return err(
                "dynamic_slice",
                format!("{s} needs {} start indices and sizes", s.rank()),
            );
        }
        self.check_index_scalars("dynamic_slice", starts)?;
        for (i, (&size, &dim)) in sizes.iter().zip(&s.dims).enumerate() {
            if size < 0 || size > dim {
                return err(
                    "dynamic_slice",
                    format!("size {size} of dim {i} exceeds {s}"),
                );
            }
        }
        let mut inputs = vec![x];
        inputs.extend_from_slice(starts);
        Ok(self.push1(
            Op::DynamicSlice {
                sizes: sizes.to_vec(),
            },
            inputs,
            s.with_dims(sizes),
        ))
    }

    pub fn dynamic_update_slice(
        &mut self,
        x: Value,
        update: Value,
        starts: &[Value],
    ) -> Result<Value> {
        let (s, u) = (self.shape(x).clone(), self.shape(update).clone());
        if u.rank() != s.rank() || u.dtype != s.dtype || starts.len() != s.rank() {
            return err(
                "dynamic_update_slice",
                format!(
                    "update {u} and {} indices do not fit operand {s}",
                    starts.len()
                ),
            );
        }
        if u.dims.iter().zip(&s.dims).any(|(a, b)| a > b) {
            return err(
                "dynamic_update_slice",
                format!("update {u} is larger than operand {s}"),
            );
        }
        self.check_index_scalars("dynamic_update_slice", starts)?;
        let mut inputs = vec![x, update];
        inputs.extend_from_slice(starts);
        Ok(self.push1(Op::DynamicUpdateSlice, inputs, s))
    }

    fn check_index_scalars(&self, op: &'static str, idx: &[Value]) -> Result<()> {
        let t0 = idx.first().map(|&v| self.shape(v).clone());
        for &v in idx {
            let t = self.shape(v);
            if t.rank() != 0 || !t.dtype.is_int() || Some(t) != t0.as_ref() {
                return err(
                    op,
                    format!("start indices must be integer scalars of one type, got {t}"),
                );
            }
        }
        Ok(())
    }

    pub fn concatenate(&mut self, xs: &[Value], dim: i64) -> Result<Value> {
        let Some(&first) = xs.first() else {
            return err("concatenate", "needs at least one operand");
        };
        let s0 = self.shape(first).clone();
        if dim < 0 || dim as usize >= s0.rank() {
            return err("concatenate", format!("dim {dim} out of range for {s0}"));
        }
        let mut total = 0;
        for &x in xs {
            let s = self.shape(x);
            let same_other = s.rank() == s0.rank()
                && s.dtype == s0.dtype
                && (0..s.rank()).all(|i| i == dim as usize || s.dims[i] == s0.dims[i]);
            if !same_other {
                return err(
                    "concatenate",
                    format!("{s} does not fit with {s0} along dim {dim}"),
                );
            }
            total += s.dims[dim as usize];
        }
        if xs.len() == 1 {
            return Ok(first);
        }
        let mut dims = s0.dims.clone();
        dims[dim as usize] = total;
        Ok(self.push1(Op::Concatenate { dim }, xs.to_vec(), s0.with_dims(&dims)))
    }

    pub fn pad(
        &mut self,
        x: Value,
        value: Value,
        low: &[i64],
        high: &[i64],
        interior: &[i64],
    ) -> Result<Value> {
        let (s, pv) = (self.shape(x).clone(), self.shape(value).clone());
        if pv.rank() != 0 || pv.dtype != s.dtype {
            return err(
                "pad",
                format!("padding value must be a scalar of {s}'s type, got {pv}"),
            );
        }
        if low.len() != s.rank() || high.len() != s.rank() || interior.len() != s.rank() {
            return err(
                "pad",
                format!("low/high/interior must each have {} entries", s.rank()),
            );
        }
        let mut dims = Vec::new();
        for i in 0..s.rank() {
            let d = s.dims[i];
            let inner = if d > 0 { (d - 1) * interior[i] } else { 0 };
            let out = low[i] + high[i] + d + inner;
            if interior[i] < 0 || out < 0 {
                return err("pad", format!("dim {i} of {s} would have size {out}"));
            }
            dims.push(out);
        }
        Ok(self.push1(
            Op::Pad {
                low: low.to_vec(),
                high: high.to_vec(),
                interior: interior.to_vec(),
            },
            vec![x, value],
            s.with_dims(&dims),
        ))
    }
}

/// Sum `g` (shaped like a broadcast's result) back to the operand's shape.
fn unbroadcast(b: &mut Builder, g: Value, operand: &Shape, dims: &[i64]) -> Result<Value> {
    let out_rank = b.rank(g) as i64;
    let gd = b.dims(g).to_vec();
    // Result dims the operand did not have, and operand dims of size 1 that were repeated.
    let reduce: Vec<i64> = (0..out_rank)
        .filter(|d| match dims.iter().position(|x| x == d) {
            None => true,
            Some(i) => operand.dims[i] == 1 && gd[*d as usize] != 1,
        })
        .collect();
    let summed = b.reduce_sum(g, &reduce)?;
    // `summed` keeps the other result dims in increasing order; put them in operand order.
    let kept: Vec<i64> = (0..out_rank).filter(|d| !reduce.contains(d)).collect();
    let perm: Vec<i64> = dims
        .iter()
        .filter_map(|d| kept.iter().position(|k| k == d))
        .map(|p| p as i64)
        .collect();
    let t = b.transpose(summed, &perm)?;
    b.reshape(t, &operand.dims)
}

pub(crate) fn slice_vjp(
    b: &mut Builder,
    x: &Shape,
    g: Value,
    start: &[i64],
    strides: &[i64],
) -> Result<Value> {
    let zero = b.scalar(0.0, x.dtype);
    let gd = b.dims(g).to_vec();
    let interior: Vec<i64> = strides.iter().map(|s| s - 1).collect();
    let high: Vec<i64> = (0..x.rank())
        .map(|i| {
            let last = if gd[i] > 0 {
                start[i] + (gd[i] - 1) * strides[i] + 1
            } else {
                start[i]
            };
            x.dims[i] - last
        })
        .collect();
    b.pad(g, zero, start, &high, &interior)
}

// ------------------------------------------------------------------ gather / scatter

impl Builder {
    pub fn gather(
        &mut self,
        operand: Value,
        indices: Value,
        dims: GatherDims,
        slice_sizes: &[i64],
    ) -> Result<Value> {
        let (s, idx) = (self.shape(operand).clone(), self.shape(indices).clone());
        if !idx.dtype.is_int() {
            return err("gather", format!("indices must be integers, got {idx}"));
        }
        if slice_sizes.len() != s.rank() {
            return err(
                "gather",
                format!(
                    "slice_sizes {} must have one entry per dim of {s}",
                    dims_str(slice_sizes)
                ),
            );
        }
        if slice_sizes
            .iter()
            .zip(&s.dims)
            .any(|(a, b)| a > b || *a < 0)
        {
            return err(
                "gather",
                format!("slice_sizes {} exceed {s}", dims_str(slice_sizes)),
            );
        }
        let ivd = dims.index_vector_dim as usize;
        let batch: Vec<i64> = idx
            .dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ivd)
            .map(|(_, &d)| d)
            .collect();
        let offsets: Vec<i64> = slice_sizes
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.collapsed_slice_dims.contains(&(*i as i64)))
            .map(|(_, &d)| d)
            .collect();
        if offsets.len() != dims.offset_dims.len() {
            return err(
                "gather",
                format!(
                    "{} offset dims for {} uncollapsed slice dims",
                    dims.offset_dims.len(),
                    offsets.len()
                ),
            );
        }
        let rank = batch.len() + offsets.len();
        let mut out = Vec::with_capacity(rank);
        let (mut bi, mut oi) = (0, 0);
        for i in 0..rank as i64 {
            if dims.offset_dims.contains(&i) {
                out.push(offsets[oi]);
                oi += 1;
            } else {
                out.push(batch[bi]);
                bi += 1;
            }
        }
        Ok(self.push1(
            Op::Gather {
                dims,
                slice_sizes: slice_sizes.to_vec(),
            },
            vec![operand, indices],
            s.with_dims(&out),
        ))
    }

    /// Rows of `table` [N, ...] picked by integer `ids` [...]: result [..ids dims, ...row dims].
    /// The embedding lookup.
    pub fn take_rows(&mut self, table: Value, ids: Value) -> Result<Value> {
        let (t, i) = (self.shape(table).clone(), self.shape(ids).clone());
        if t.rank() == 0 {
            return err("gather", format!("table must have rank >= 1, got {t}"));
        }
        let ir = i.rank() as i64;
        let mut slice = t.dims.clone();
        slice[0] = 1;
        let dims = GatherDims {
            offset_dims: (ir..ir + t.rank() as i64 - 1).collect(),
            collapsed_slice_dims: vec![0],
            start_index_map: vec![0],
            index_vector_dim: ir,
        };
        self.gather(table, ids, dims, &slice)
    }

    pub fn scatter(
        &mut self,
        operand: Value,
        indices: Value,
        updates: Value,
        dims: ScatterDims,
        combiner: Combiner,
    ) -> Result<Value> {
        let (s, idx, u) = (
            self.shape(operand).clone(),
            self.shape(indices).clone(),
            self.shape(updates).clone(),
        );
        if !idx.dtype.is_int() || u.dtype != s.dtype {
            return err(
                "scatter",
                format!("operand {s}, indices {idx}, updates {u}: types do not fit"),
            );
        }
        if combiner != Combiner::Add && combiner != Combiner::Replace {
            return err("scatter", "only add and replace combiners are supported");
        }
        let batch_rank = if dims.index_vector_dim as usize == idx.rank() {
            idx.rank()
        } else {
            idx.rank() - 1
        };
        if u.rank() != batch_rank + dims.update_window_dims.len() {
            return err(
                "scatter",
                format!(
                    "updates {u} do not match {} batch dims and {} window dims",
                    batch_rank,
                    dims.update_window_dims.len()
                ),
            );
        }
        Ok(self.push1(
            Op::Scatter { dims, combiner },
            vec![operand, indices, updates],
            s,
        ))
    }
}

fn gather_vjp(
    b: &mut Builder,
    operand: &Shape,
    indices: Value,
    g: Value,
    dims: &GatherDims,
) -> Result<Value> {
    let zeros = b.zeros(operand.clone());
    let sd = ScatterDims {
        update_window_dims: dims.offset_dims.clone(),
        inserted_window_dims: dims.collapsed_slice_dims.clone(),
        scatter_dims_to_operand_dims: dims.start_index_map.clone(),
        index_vector_dim: dims.index_vector_dim,
    };
    b.scatter(zeros, indices, g, sd, Combiner::Add)
}

fn scatter_vjp(
    b: &mut Builder,
    node: &Node,
    g: Value,
    needs: &[bool],
    dims: &ScatterDims,
    combiner: Combiner,
) -> Result<Vec<Option<Value>>> {
    let (indices, updates) = (node.inputs[1], node.inputs[2]);
    let operand_shape = b.shape(node.inputs[0]).clone();
    let gop = if needs[0] {
        Some(match combiner {
            Combiner::Add => g,
            _ => {
                let z = b.zeros_like(updates);
                b.scatter(g, indices, z, dims.clone(), Combiner::Replace)?
            }
        })
    } else {
        None
    };
    let gupd = if needs[2] {
        let ud = b.dims(updates).to_vec();
        let mut window = dims.update_window_dims.iter().map(|&d| ud[d as usize]);
        let slice: Vec<i64> = (0..operand_shape.rank() as i64)
            .map(|i| {
                if dims.inserted_window_dims.contains(&i) {
                    1
                } else {
                    window.next().unwrap_or(1)
                }
            })
            .collect();
        let gd = GatherDims {
            offset_dims: dims.update_window_dims.clone(),
            collapsed_slice_dims: dims.inserted_window_dims.clone(),
            start_index_map: dims.scatter_dims_to_operand_dims.clone(),
            index_vector_dim: dims.index_vector_dim,
        };
        Some(b.gather(g, indices, gd, &slice)?)
    } else {
        None
    };
    Ok(vec![gop, None, gupd])
}

// ------------------------------------------------------------------ dot_general

impl Builder {
    /// Generalised matrix product. Result dims: batch, then lhs free dims, then rhs free dims.
    /// `out` sets the result element type (e.g. f32 accumulation of bf16 operands).
    pub fn dot_general(
        &mut self,
        lhs: Value,
        rhs: Value,
        dims: DotDims,
        precision: Option<Precision>,
        out: Option<DType>,
    ) -> Result<Value> {
        let (l, r) = (self.shape(lhs).clone(), self.shape(rhs).clone());
        let ctx = format!("(lhs {l}, rhs {r})");
        if l.dtype != r.dtype {
            return err("dot_general", format!("operand element types differ {ctx}"));
        }
        if dims.lhs_batch.len() != dims.rhs_batch.len()
            || dims.lhs_contract.len() != dims.rhs_contract.len()
        {
            return err(
                "dot_general",
                format!("lhs and rhs must have as many batch and contracting dims {ctx}"),
            );
        }
        let check = |side: &str, s: &Shape, ds: &[i64]| -> Result<()> {
            for &d in ds {
                if d < 0 || d as usize >= s.rank() {
                    return err("dot_general", format!("{side} dim {d} out of range {ctx}"));
                }
            }
            Ok(())
        };
        for (side, s, ds) in [
            ("lhs batch", &l, &dims.lhs_batch),
            ("lhs contracting", &l, &dims.lhs_contract),
            ("rhs batch", &r, &dims.rhs_batch),
            ("rhs contracting", &r, &dims.rhs_contract),
        ] {
            check(side, s, ds)?;
        }
        for (kind, ls, rs) in [
            ("batch", &dims.lhs_batch, &dims.rhs_batch),
            ("contracting", &dims.lhs_contract, &dims.rhs_contract),
        ] {
            for (&a, &c) in ls.iter().zip(rs.iter()) {
                let (sa, sc) = (l.dims[a as usize], r.dims[c as usize]);
                if sa != sc {
                    return err(
                        "dot_general",
                        format!("lhs {kind} dim {a} has size {sa} but rhs {kind} dim {c} has size {sc} {ctx}"),
                    );
                }
            }
        }
        let mut out_dims: Vec<i64> = dims.lhs_batch.iter().map(|&d| l.dims[d as usize]).collect();
        for (i, &d) in l.dims.iter().enumerate() {
            let i = i as i64;
            if !dims.lhs_batch.contains(&i) && !dims.lhs_contract.contains(&i) {
                out_dims.push(d);
            }
        }
        for (i, &d) in r.dims.iter().enumerate() {
            let i = i as i64;
            if !dims.rhs_batch.contains(&i) && !dims.rhs_contract.contains(&i) {
                out_dims.push(d);
            }
        }
        let dtype = out.unwrap_or(l.dtype);
        Ok(self.push1(
            Op::DotGeneral { dims, precision },
            vec![lhs, rhs],
            Shape::new(&out_dims, dtype),
        ))
    }

    /// `a @ b`: contract the last dim of `a` with the first of `b`.
    pub fn matmul(&mut self, a: Value, b: Value) -> Result<Value> {
        let ra = self.rank(a) as i64;
        self.dot_general(
            a,
            b,
            DotDims {
                lhs_contract: vec![ra - 1],
                rhs_contract: vec![0],
                ..Default::default()
            },
            None,
            None,
        )
    }
}

fn free_dims(rank: usize, batch: &[i64], contract: &[i64]) -> Vec<i64> {
    (0..rank as i64)
        .filter(|d| !batch.contains(d) && !contract.contains(d))
        .collect()
}

/// Cotangent of one dot_general operand. `this`/`other` describe the operand to differentiate
/// and the other one; `g` has dims [batch, lhs free, rhs free]. `g_first` puts `g` on the lhs
/// of the product (right for the lhs operand), otherwise `other` goes first (right for the
/// rhs); either way the usual layouts come out without a transpose.
#[allow(clippy::too_many_arguments)]
fn dot_operand_vjp(
    b: &mut Builder,
    g: Value,
    other: Value,
    this_shape: &Shape,
    (this_batch, this_contract): (&[i64], &[i64]),
    (other_batch, other_contract): (&[i64], &[i64]),
    g_free_of_other: Vec<i64>,
    g_first: bool,
    precision: Option<Precision>,
    result_type: DType,
) -> Result<Value> {
    let other_rank = b.rank(other);
    let other_free = free_dims(other_rank, other_batch, other_contract);
    let nb = this_batch.len() as i64;
    let g_batch: Vec<i64> = (0..nb).collect();
    // Contract g's dims that belong to the other operand's free dims with those dims.
    let r = if g_first {
        let dims = DotDims {
            lhs_batch: g_batch,
            rhs_batch: other_batch.to_vec(),
            lhs_contract: g_free_of_other,
            rhs_contract: other_free,
        };
        b.dot_general(g, other, dims, precision, Some(result_type))?
    } else {
        let dims = DotDims {
            lhs_batch: other_batch.to_vec(),
            rhs_batch: g_batch,
            lhs_contract: other_free,
            rhs_contract: g_free_of_other,
        };
        b.dot_general(other, g, dims, precision, Some(result_type))?
    };
    let r = b.convert(r, this_shape.dtype)?;
    // r holds, after the batch dims, this operand's free dims (from g) and its contracting dims
    // (other's contracting dims, sorted by other's index), in an order that depends on g_first.
    let this_free = free_dims(this_shape.rank(), this_batch, this_contract);
    let mut other_c_sorted: Vec<(i64, i64)> = other_contract
        .iter()
        .zip(this_contract)
        .map(|(&o, &t)| (o, t))
        .collect();
    other_c_sorted.sort();
    let (free_base, contract_base) = if g_first {
        (nb, nb + this_free.len() as i64)
    } else {
        (nb + other_c_sorted.len() as i64, nb)
    };
    let mut pos = vec![0i64; this_shape.rank()];
    for (i, &d) in this_batch.iter().enumerate() {
        pos[d as usize] = i as i64;
    }
    for (i, &d) in this_free.iter().enumerate() {
        pos[d as usize] = free_base + i as i64;
    }
    for (i, &(_, t)) in other_c_sorted.iter().enumerate() {
        pos[t as usize] = contract_base + i as i64;
    }
    b.transpose(r, &pos)
}

fn dot_vjp(
    b: &mut Builder,
    node: &Node,
    g: Value,
    needs: &[bool],
    dims: &DotDims,
    precision: Option<Precision>,
) -> Result<Vec<Option<Value>>> {
    let (lhs, rhs) = (node.inputs[0], node.inputs[1]);
    let (ls, rs) = (b.shape(lhs).clone(), b.shape(rhs).clone());
    // A product accumulated in a wider type (bf16 x bf16 -> f32) has a wide cotangent: round it
    // to the operands' type once, so both sides of each backward product match, and let the
    // backward products give their results in the wide type too, rounded to the operand's type
    // after (the same arithmetic as a narrow result; the form a backend whose native bf16 GEMM
    // writes f32, such as XLA CPU's, runs directly).
    let result_type = if b.dtype(g).bits() > ls.dtype.bits() {
        b.dtype(g)
    } else {
        ls.dtype
    };
    let g = b.convert(g, ls.dtype)?;
    let nb = dims.lhs_batch.len() as i64;
    let nlf = free_dims(ls.rank(), &dims.lhs_batch, &dims.lhs_contract).len() as i64;
    let nrf = free_dims(rs.rank(), &dims.rhs_batch, &dims.rhs_contract).len() as i64;
    let gl = if needs[0] {
        Some(dot_operand_vjp(
            b,
            g,
            rhs,
            &ls,
            (&dims.lhs_batch, &dims.lhs_contract),
            (&dims.rhs_batch, &dims.rhs_contract),
            (nb + nlf..nb + nlf + nrf).collect(),
            true,
            precision,
            result_type,
        )?)
    } else {
        None
    };
    let gr = if needs[1] {
        Some(dot_operand_vjp(
            b,
            g,
            lhs,
            &rs,
            (&dims.rhs_batch, &dims.rhs_contract),
            (&dims.lhs_batch, &dims.lhs_contract),
            (nb..nb + nlf).collect(),
            false,
            precision,
            result_type,
        )?)
    } else {
        None
    };
    Ok(vec![gl, gr])
}

// ------------------------------------------------------------------ reductions

impl Builder {
    pub fn reduce(&mut self, x: Value, dims: &[i64], combiner: Combiner) -> Result<Value> {
        let s = self.shape(x).clone();
        if combiner == Combiner::Replace {
            return err("reduce", "replace is not a reduction");
        }
        for (i, &d) in dims.iter().enumerate() {
            if d < 0 || d as usize >= s.rank() || dims[..i].contains(&d) {
                return err("reduce", format!("bad dims {} for {s}", dims_str(dims)));
            }
        }
        if dims.is_empty() {
            return Ok(x);
        }
        let init = match combiner {
            Combiner::Add => 0.0,
            Combiner::Max => f64::NEG_INFINITY,
            _ => f64::INFINITY,
        };
        let init = if s.dtype.is_float() {
            self.scalar(init, s.dtype)
        } else {
            let v = match combiner {
                Combiner::Add => 0.0,
                Combiner::Max => i32::MIN as f64,
                _ => i32::MAX as f64,
            };
            self.scalar(v, s.dtype)
        };
        let out: Vec<i64> = s
            .dims
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(&(*i as i64)))
            .map(|(_, &d)| d)
            .collect();
        Ok(self.push1(
            Op::Reduce {
                dims: dims.to_vec(),
                combiner,
            },
            vec![x, init],
            s.with_dims(&out),
        ))
    }

    pub fn reduce_sum(&mut self, x: Value, dims: &[i64]) -> Result<Value> {
        self.reduce(x, dims, Combiner::Add)
    }

    pub fn reduce_max(&mut self, x: Value, dims: &[i64]) -> Result<Value> {
        self.reduce(x, dims, Combiner::Max)
    }

    /// Sum of every element, as a scalar.
    pub fn sum_all(&mut self, x: Value) -> Result<Value> {
        let dims: Vec<i64> = (0..self.rank(x) as i64).collect();
        self.reduce_sum(x, &dims)
    }
}

fn reduce_vjp(
    b: &mut Builder,
    node: &Node,
    g: Value,
    dims: &[i64],
    combiner: Combiner,
) -> Result<Option<Value>> {
    let x = node.inputs[0];
    let xs = b.shape(x).clone();
    let kept: Vec<i64> = (0..xs.rank() as i64)
        .filter(|d| !dims.contains(d))
        .collect();
    let gb = b.broadcast_in_dim(g, &xs.dims, &kept)?;
    Ok(Some(match combiner {
        Combiner::Add => gb,
        _ => {
            // The gradient goes to every element equal to the extreme value.
            let out = b.broadcast_in_dim(node.outputs[0], &xs.dims, &kept)?;
            let hit = b.compare(x, out, CmpDir::Eq)?;
            let zero = b.zeros_like(gb);
            b.select(hit, gb, zero)?
        }
    }))
}

// ------------------------------------------------------------------ control flow and the rest

impl Builder {
    /// `while cond(state) { state = body(state) }`. `cond` and `body` are functions whose
    /// parameters have the types of `init`; cond returns `tensor<i1>`, body the new state.
    pub fn while_loop(&mut self, cond: Func, body: Func, init: &[Value]) -> Result<Vec<Value>> {
        let types: Vec<Shape> = init.iter().map(|&v| self.shape(v).clone()).collect();
        let check_params = |f: &Func, what: &str| -> Result<()> {
            let got: Vec<&Shape> = f.params.iter().map(|p| f.shape(p.value)).collect();
            if got.len() != types.len() || got.iter().zip(&types).any(|(a, b)| *a != b) {
                return err(
                    "while",
                    format!("{what} parameters {got:?} do not match the loop state {types:?}"),
                );
            }
            Ok(())
        };
        check_params(&cond, "cond")?;
        check_params(&body, "body")?;
        if cond.results.len() != 1
            || *cond.shape(cond.results[0].value) != Shape::scalar(DType::Pred)
        {
            return err("while", "cond must return one tensor<i1>");
        }
        let outs: Vec<&Shape> = body.results.iter().map(|r| body.shape(r.value)).collect();
        if outs.len() != types.len() || outs.iter().zip(&types).any(|(a, b)| *a != b) {
            return err(
                "while",
                format!("body results {outs:?} do not match the loop state {types:?}"),
            );
        }
        Ok(self.push(
            Op::While {
                cond: Box::new(cond),
                body: Box::new(body),
            },
            init.to_vec(),
            types,
        ))
    }

    /// `for i in 0..n { carry = body(i, carry, invariants) }` as a `stablehlo.while`. The body
    /// gets its own builder (regions are self-contained), the loop index (s32 scalar), the carry
    /// and the invariants; it returns the new carry (same types). Returns the final carry.
    /// With [`Builder::unroll_loops`] the body is emitted inline once per iteration instead.
    pub fn fori_loop(
        &mut self,
        n: i64,
        init: &[Value],
        invariants: &[Value],
        mut body: impl FnMut(&mut Builder, Value, &[Value], &[Value]) -> Result<Vec<Value>>,
    ) -> Result<Vec<Value>> {
        if self.unroll_loops {
            let nc = init.len();
            let mut carry = init.to_vec();
            for k in 0..n {
                let state: Vec<Value> = carry.iter().chain(invariants).copied().collect();
                let state = self.optimization_barrier(&state);
                let i = self.scalar(k as f64, DType::S32);
                carry = body(self, i, &state[..nc], &state[nc..])?;
                if carry.len() != nc {
                    return err(
                        "while",
                        format!(
                            "loop body returned {} values for a carry of {nc}",
                            carry.len()
                        ),
                    );
                }
            }
            return Ok(carry);
        }
        let counter = Shape::scalar(DType::S32);
        let state_types: Vec<Shape> = std::iter::once(counter.clone())
            .chain(
                init.iter()
                    .chain(invariants)
                    .map(|&v| self.shape(v).clone()),
            )
            .collect();
        let nc = init.len();

        let mut cb = Builder::new("cond");
        let params: Vec<Value> = state_types
            .iter()
            .enumerate()
            .map(|(k, s)| cb.param(&format!("s{k}"), s.clone()))
            .collect();
        let limit = cb.scalar(n as f64, DType::S32);
        let go = cb.compare(params[0], limit, CmpDir::Lt)?;
        let cond = cb.finish(&[("go", go)]);

        let mut bb = Builder::new("body");
        bb.scope = self.scope.clone();
        // A rolled loop nested in this one is priced as the outer ones are.
        bb.trips_per_rolled_body = self.trips_per_rolled_body;
        let params: Vec<Value> = state_types
            .iter()
            .enumerate()
            .map(|(k, s)| bb.param(&format!("s{k}"), s.clone()))
            .collect();
        let (i, carry, inv) = (params[0], &params[1..1 + nc], &params[1 + nc..]);
        let new_carry = body(&mut bb, i, carry, inv)?;
        if new_carry.len() != nc {
            return err(
                "while",
                format!(
                    "loop body returned {} values for a carry of {nc}",
                    new_carry.len()
                ),
            );
        }
        let one = bb.scalar(1.0, DType::S32);
        let next = bb.add(i, one)?;
        let mut results = vec![("i".to_string(), next)];
        results.extend(
            new_carry
                .iter()
                .enumerate()
                .map(|(k, &v)| (format!("c{k}"), v)),
        );
        results.extend(inv.iter().enumerate().map(|(k, &v)| (format!("k{k}"), v)));
        let refs: Vec<(&str, Value)> = results.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        let body = bb.finish(&refs);

        let zero = self.scalar(0.0, DType::S32);
        let mut state = vec![zero];
        state.extend_from_slice(init);
        state.extend_from_slice(invariants);
        let out = self.while_loop(cond, body, &state)?;
        Ok(out[1..1 + nc].to_vec())
    }

    /// [`Builder::fori_loop`] as a `stablehlo.while` even where loops are unrolled: for loops
    /// inside a layer whose trip count grows with the sequence (attention's block pairs), which
    /// unrolled would make the program grow with it too.
    pub fn rolled_fori_loop(
        &mut self,
        n: i64,
        init: &[Value],
        invariants: &[Value],
        mut body: impl FnMut(&mut Builder, Value, &[Value], &[Value]) -> Result<Vec<Value>>,
    ) -> Result<Vec<Value>> {
        let unroll = std::mem::replace(&mut self.unroll_loops, false);
        let trips = self.trips_per_rolled_body;
        let out = if trips > 1 && n >= trips {
            // Pricing only (`price_rolled_loops`): `trips` trips per body.
            self.fori_loop(n / trips, init, invariants, |bb, i, carry, inv| {
                let k = bb.scalar(trips as f64, DType::S32);
                let first = bb.mul(i, k)?;
                let mut carry = carry.to_vec();
                for t in 0..trips {
                    let offset = bb.scalar(t as f64, DType::S32);
                    let at = bb.add(first, offset)?;
                    carry = body(bb, at, &carry, inv)?;
                }
                Ok(carry)
            })
        } else {
            self.fori_loop(n, init, invariants, body)
        };
        self.unroll_loops = unroll;
        out
    }

    /// Values that XLA may not move computations across (used to keep recomputation apart).
    pub fn optimization_barrier(&mut self, xs: &[Value]) -> Vec<Value> {
        if xs.is_empty() {
            return Vec::new();
        }
        let types = xs.iter().map(|&v| self.shape(v).clone()).collect();
        self.push(Op::OptimizationBarrier, xs.to_vec(), types)
    }

    /// A tensor of `shape` whose elements are undefined until written (XLA's `AllocateBuffer`):
    /// the initial value of a loop-carried buffer that the loop overwrites whole before any
    /// element is read, where a constant fill would be one more write of the whole buffer. Only
    /// TPU and GPU compilers implement it; XLA CPU rejects the program.
    pub fn uninitialized(&mut self, shape: Shape) -> Value {
        self.push1(Op::Uninitialized, vec![], shape)
    }

    /// `x`, placed in `memory` from here on: in host memory (offloaded) or back in the device's.
    /// XLA moves the bytes (asynchronously where it can) and keeps a loop-carried stack that is
    /// written with host-placed values in host memory.
    pub fn place(&mut self, x: Value, memory: MemoryKind) -> Value {
        let s = self.shape(x).clone();
        self.push1(Op::Place(memory), vec![x], s)
    }

    /// Ask the partitioner to lay `x` out as `sharding` here.
    pub fn sharding_constraint(&mut self, x: Value, sharding: Sharding) -> Result<Value> {
        let s = self.shape(x).clone();
        if sharding.dims.len() != s.rank() {
            return err(
                "sharding_constraint",
                format!(
                    "sharding has {} dims but {s} has {}",
                    sharding.dims.len(),
                    s.rank()
                ),
            );
        }
        Ok(self.push1(Op::ShardingConstraint(sharding), vec![x], s))
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

/// The vjp of one node. See the module docs for the contract.
pub(crate) fn vjp(
    b: &mut Builder,
    node: &Node,
    cts: &[Option<Value>],
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    let none = vec![None; node.inputs.len()];
    let g = |i: usize| cts[i];
    let first = match g(0) {
        Some(v) => v,
        None if matches!(node.op, Op::OptimizationBarrier) => b.zeros_like(node.outputs[0]),
        None => return Ok(none),
    };
    Ok(match &node.op {
        Op::Constant(_) | Op::Iota { .. } | Op::Compare(_) | Op::RngBitGenerator | Op::BitcastConvert | Op::StopGradient | Op::Uninitialized => none,
        Op::UseSaved => vec![Some(first), None],
        Op::CustomVjp(_) => unreachable!("autodiff applies a custom rule itself"),
        Op::Unary(u) => vec![unary_vjp(b, *u, node.inputs[0], node.outputs[0], first)?],
        Op::Binary(op) => binary_vjp(b, *op, (node.inputs[0], node.inputs[1]), node.outputs[0], first, needs)?,
        Op::Select => select_vjp(b, node, first, needs)?,
        Op::Clamp => clamp_vjp(b, node, first, needs)?,
        Op::Convert => {
            let dt = b.dtype(node.inputs[0]);
            vec![if dt.is_float() { Some(b.convert(first, dt)?) } else { None }]
        }
        Op::BroadcastInDim { dims } => {
            let s = b.shape(node.inputs[0]).clone();
            vec![Some(unbroadcast(b, first, &s, dims)?)]
        }
        Op::Reshape => {
            let d = b.dims(node.inputs[0]).to_vec();
            vec![Some(b.reshape(first, &d)?)]
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0i64; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p as usize] = i as i64;
            }
            vec![Some(b.transpose(first, &inv)?)]
        }
        // Slices along one dim do not come here from `vjp`: autodiff gathers their cotangents
        // per operand and concatenates those that tile it (`settle_bands` in autodiff.rs).
        Op::Slice { start, strides, .. } => {
            let s = b.shape(node.inputs[0]).clone();
            vec![Some(slice_vjp(b, &s, first, start, strides)?)]
        }
        Op::DynamicSlice { .. } => {
            let z = b.zeros_like(node.inputs[0]);
            let mut out = vec![Some(b.dynamic_update_slice(z, first, &node.inputs[1..])?)];
            out.extend(node.inputs[1..].iter().map(|_| None));
            out
        }
        Op::DynamicUpdateSlice => dynamic_update_slice_vjp(b, node, first, needs)?,
        Op::Concatenate { dim } => concatenate_vjp(b, node, first, needs, dim)?,
        Op::Pad { low, high, interior } => pad_vjp(b, node, first, needs, low, high, interior)?,
        Op::Gather { dims, .. } => {
            let s = b.shape(node.inputs[0]).clone();
            vec![if needs[0] { Some(gather_vjp(b, &s, node.inputs[1], first, dims)?) } else { None }, None]
        }
        Op::Scatter { dims, combiner } => scatter_vjp(b, node, first, needs, dims, *combiner)?,
        Op::DotGeneral { dims, precision } => dot_vjp(b, node, first, needs, dims, *precision)?,
        Op::Reduce { dims, combiner } => vec![reduce_vjp(b, node, first, dims, *combiner)?, None],
        Op::OptimizationBarrier => (0..node.inputs.len())
            .map(|i| match g(i) {
                Some(v) => Some(v),
                None if needs[i] => Some(b.zeros_like(node.outputs[i])),
                None => None,
            })
            .collect(),
        Op::ShardingConstraint(s) => vec![Some(b.sharding_constraint(first, s.clone())?)],
        // Where a value lives does not change it; its cotangent stays on the device.
        Op::Place(_) => vec![Some(first)],
        Op::While { .. } => {
            return crate::builder::err(
                "while",
                "has no generic vjp rule; differentiate the loop body and build the backward loop (see scan helpers)",
            )
        }
        Op::Composite(_) | Op::ManualComputation(_) => {
            return crate::builder::err(
                node.op.name(),
                "has no generic vjp rule; give the computation one with custom_vjp",
            )
        }
    })
}

fn select_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    let zero = b.zeros_like(first);
    let p = node.inputs[0];
    let p = if b.rank(p) == 0 && b.rank(first) != 0 {
        let d = b.dims(first).to_vec();
        b.broadcast_in_dim(p, &d, &[])?
    } else {
        p
    };
    Ok(vec![
        None,
        if needs[1] {
            Some(b.select(p, first, zero)?)
        } else {
            None
        },
        if needs[2] {
            Some(b.select(p, zero, first)?)
        } else {
            None
        },
    ])
}

fn clamp_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    // The gradient passes where lo <= x <= hi.
    let (lo, x, hi) = (node.inputs[0], node.inputs[1], node.inputs[2]);
    let xd = b.dims(x).to_vec();
    let lo = if b.rank(lo) == 0 {
        b.broadcast_in_dim(lo, &xd, &[])?
    } else {
        lo
    };
    let hi = if b.rank(hi) == 0 {
        b.broadcast_in_dim(hi, &xd, &[])?
    } else {
        hi
    };
    let a = b.compare(x, lo, CmpDir::Ge)?;
    let c = b.compare(x, hi, CmpDir::Le)?;
    let inside = b.and(a, c)?;
    let zero = b.zeros_like(first);
    Ok(vec![
        None,
        if needs[1] {
            Some(b.select(inside, first, zero)?)
        } else {
            None
        },
        None,
    ])
}

fn dynamic_update_slice_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
) -> Result<Vec<Option<Value>>> {
    let starts = &node.inputs[2..];
    let gx = if needs[0] {
        let z = b.zeros_like(node.inputs[1]);
        Some(b.dynamic_update_slice(first, z, starts)?)
    } else {
        None
    };
    let gu = if needs[1] {
        let d = b.dims(node.inputs[1]).to_vec();
        Some(b.dynamic_slice(first, starts, &d)?)
    } else {
        None
    };
    let mut out = vec![gx, gu];
    out.extend(starts.iter().map(|_| None));
    Ok(out)
}

fn concatenate_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
    dim: &i64,
) -> Result<Vec<Option<Value>>> {
    let mut at = 0;
    let mut out = Vec::new();
    for (i, &x) in node.inputs.iter().enumerate() {
        let n = b.dims(x)[*dim as usize];
        out.push(if needs[i] {
            Some(b.slice_dim(first, *dim as usize, at, at + n)?)
        } else {
            None
        });
        at += n;
    }
    Ok(out)
}

fn pad_vjp(
    b: &mut Builder,
    node: &Node,
    first: Value,
    needs: &[bool],
    low: &[i64],
    high: &[i64],
    interior: &[i64],
) -> Result<Vec<Option<Value>>> {
    let s = b.shape(node.inputs[0]).clone();
    let gd = b.dims(first).to_vec();
    let start: Vec<i64> = low.iter().map(|&l| l.max(0)).collect();
    let limit: Vec<i64> = (0..s.rank()).map(|i| gd[i] - high[i].max(0)).collect();
    let strides: Vec<i64> = interior.iter().map(|i| i + 1).collect();
    if low.iter().chain(high).any(|&p| p < 0) {
        return crate::builder::err("pad", "vjp of negative padding is not supported");
    }
    let gx = if needs[0] {
        Some(b.slice(first, &start, &limit, &strides)?)
    } else {
        None
    };
    let gv = if needs[1] {
        let total = b.sum_all(first)?;
        let inner = match gx {
            Some(v) => v,
            None => b.slice(first, &start, &limit, &strides)?,
        };
        let kept = b.sum_all(inner)?;
        Some(b.sub(total, kept)?)
    } else {
        None
    };
    Ok(vec![gx, gv])
}

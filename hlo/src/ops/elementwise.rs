//! Elementwise ops (unary, binary, compare, select, clamp, conversions, the gradient stops)
//! and their vjp rules.

use crate::builder::{err, Builder, Result};
use crate::graph::*;
use crate::types::DType;

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

pub(super) fn unary_vjp(
    b: &mut Builder,
    op: UnaryOp,
    x: Value,
    y: Value,
    g: Value,
) -> Result<Option<Value>> {
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

pub(super) fn binary_vjp(
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

pub(super) fn select_vjp(
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

pub(super) fn clamp_vjp(
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

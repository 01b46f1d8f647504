//! AdamW inside the step, with torch.optim.AdamW's formula:
//!
//! ```text
//! p  <- p * (1 - lr * wd)                       (decoupled weight decay)
//! m  <- b1 m + (1 - b1) g
//! v  <- b2 v + (1 - b2) g^2
//! p  <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)   (eps after the sqrt)
//! ```
//! plus optional clipping of the global gradient norm (torch's clip_grad_norm_).

use hlo::{Builder, CmpDir, DType, Result, Value};

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = no clipping).
    pub max_grad_norm: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 0.0,
        }
    }
}

impl AdamW {
    /// Refuse constants the update cannot use: betas outside [0, 1), a non-positive or
    /// non-finite epsilon (with eps 0 a zero gradient divides 0 by 0), a negative or non-finite
    /// weight decay or clipping norm. Messages name the flags.
    pub fn validate(&self) -> anyhow::Result<()> {
        let ok = |x: f64| (0.0..1.0).contains(&x);
        if !ok(self.beta1) || !ok(self.beta2) {
            anyhow::bail!(
                "--betas must each be in [0, 1), got {},{}",
                self.beta1,
                self.beta2
            );
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            anyhow::bail!("--eps must be a positive number, got {}", self.eps);
        }
        for (flag, v) in [
            ("--weight-decay", self.weight_decay),
            ("--max-grad-norm", self.max_grad_norm),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                anyhow::bail!("{flag} must be a number >= 0, got {v}");
            }
        }
        Ok(())
    }
}

/// One parameter with its gradient and moments.
pub struct Slot {
    pub param: Value,
    pub grad: Value,
    pub m: Value,
    pub v: Value,
}

/// A parameter and its moments after the update.
pub struct Updated {
    pub param: Value,
    pub m: Value,
    pub v: Value,
}

/// The global L2 norm of all gradients (f32 scalar).
pub fn global_norm(b: &mut Builder, grads: &[Value]) -> Result<Value> {
    let mut total = b.scalar(0.0, DType::F32);
    for &g in grads {
        let g = b.convert(g, DType::F32)?;
        let sq = b.mul(g, g)?;
        let s = b.sum_all(sq)?;
        total = b.add(total, s)?;
    }
    b.sqrt(total)
}

/// How far one update may move a parameter, in multiples of the largest |parameter| before it:
/// beyond that the update is blown up and refused ([`AdamW::update_guarded`]). AdamW moves each
/// parameter by about the learning rate, and a fresh LoRA's largest weight is about
/// 1/sqrt(hidden size) (0.016 for 4096), so a usual run (lr 1e-5 to 1e-3) moves them by less
/// than 0.1 times that; only a learning rate hundreds of times too large comes near the bound.
pub const BLOWN_UP: f32 = 1000.0;

/// What the guarded update saw (f32 scalars): the largest |parameter| after the update (not
/// finite when it overflowed), the largest move of a parameter, and the largest |parameter|
/// before it. The update was kept iff the first is finite and the move is at most
/// [`BLOWN_UP`] times the last.
#[derive(Clone, Copy, Debug)]
pub struct Guard {
    pub largest: Value,
    pub largest_move: Value,
    pub largest_before: Value,
}

impl AdamW {
    /// Apply one update. `step` is t (1-based, f32 scalar), `lr` the learning rate (f32 scalar).
    /// Returns the new (param, m, v) per slot and the gradient norm before clipping.
    pub fn update(
        &self,
        b: &mut Builder,
        slots: &[Slot],
        step: Value,
        lr: Value,
    ) -> Result<(Vec<Updated>, Value)> {
        let (out, norm, _) = self.update_guarded(b, slots, step, lr, None)?;
        Ok((out, norm))
    }

    /// [`AdamW::update`], and with `loss` given: when the loss or the gradient norm is not
    /// finite, the update is the identity (parameters and moments unchanged). The guard selects
    /// scalars and the gradient only, so XLA still updates the state in place. The updated
    /// parameters are checked too: if any is not finite (a learning rate such as 1e38 overflows
    /// them from a finite gradient), or the update blows them up ([`BLOWN_UP`]: it moves some
    /// parameter by more than that many times the largest |parameter| before it, as a learning
    /// rate of 1e30 does), every parameter and moment keeps its old value, so the state after a
    /// step is always as sound as it was before. Returns the updated slots, the gradient norm,
    /// and (with `loss`) what the check saw ([`Guard`]).
    pub fn update_guarded(
        &self,
        b: &mut Builder,
        slots: &[Slot],
        step: Value,
        lr: Value,
        loss: Option<Value>,
    ) -> Result<(Vec<Updated>, Value, Option<Guard>)> {
        b.scoped("adamw", |b| {
            let grads: Vec<Value> = slots.iter().map(|s| s.grad).collect();
            let norm = global_norm(b, &grads)?;
            let c = self.coefficients(b, norm, step, lr, loss)?;
            let out: Vec<Updated> = slots
                .iter()
                .map(|s| self.update_slot(b, s, &c))
                .collect::<Result<_>>()?;
            if loss.is_none() {
                return Ok((out, norm, None));
            }
            // max |x| over every slot's `x`: NaN or inf when any is (maximum propagates NaN).
            let largest_of = |b: &mut Builder, xs: &[Value]| -> Result<Value> {
                let mut largest = b.scalar(0.0, DType::F32);
                for &x in xs {
                    let a = b.abs(x)?;
                    let a = b.convert(a, DType::F32)?;
                    let dims: Vec<i64> = (0..b.rank(a) as i64).collect();
                    let m = b.reduce_max(a, &dims)?;
                    largest = b.max(largest, m)?;
                }
                Ok(largest)
            };
            let after: Vec<Value> = out.iter().map(|u| u.param).collect();
            let before: Vec<Value> = slots.iter().map(|s| s.param).collect();
            let moves: Vec<Value> = out
                .iter()
                .zip(slots)
                .map(|(u, s)| b.sub(u.param, s.param))
                .collect::<Result<_>>()?;
            let guard = Guard {
                largest: largest_of(b, &after)?,
                largest_move: largest_of(b, &moves)?,
                largest_before: largest_of(b, &before)?,
            };
            let inf = b.scalar(f64::INFINITY, DType::F32);
            let finite = b.compare(guard.largest, inf, CmpDir::Lt)?;
            let bound = b.scalar(BLOWN_UP as f64, DType::F32);
            let bound = b.mul(bound, guard.largest_before)?;
            let within = b.compare(guard.largest_move, bound, CmpDir::Le)?;
            let ok = b.and(finite, within)?;
            let kept = slots
                .iter()
                .zip(out)
                .map(|(s, u)| {
                    let dims = b.dims(s.param).to_vec();
                    let ok = b.broadcast_in_dim(ok, &dims, &[])?;
                    Ok(Updated {
                        param: b.select(ok, u.param, s.param)?,
                        m: b.select(ok, u.m, s.m)?,
                        v: b.select(ok, u.v, s.v)?,
                    })
                })
                .collect::<Result<_>>()?;
            Ok((kept, norm, Some(guard)))
        })
    }

    /// The scalars every parameter's update shares, computed once per step; each is already the
    /// identity's when the step is skipped.
    fn coefficients(
        &self,
        b: &mut Builder,
        norm: Value,
        step: Value,
        lr: Value,
        loss: Option<Value>,
    ) -> Result<Coefficients> {
        let ok = match loss {
            Some(l) => {
                let inf = b.scalar(f64::INFINITY, DType::F32);
                let la = b.abs(l)?;
                let l_ok = b.compare(la, inf, CmpDir::Lt)?;
                let n_ok = b.compare(norm, inf, CmpDir::Lt)?;
                Some(b.and(l_ok, n_ok)?)
            }
            None => None,
        };
        // `on_ok(a, b)`: a when the step is good, b when it is skipped.
        let on_ok = |b: &mut Builder, good: Value, skipped: f64| -> Result<Value> {
            match ok {
                Some(ok) => {
                    let s = b.scalar(skipped, DType::F32);
                    b.select(ok, good, s)
                }
                None => Ok(good),
            }
        };
        // clip_coef = min(1, max_norm / (norm + 1e-6))
        let clip = if self.max_grad_norm > 0.0 {
            let n = b.add_scalar(norm, 1e-6)?;
            let maxn = b.scalar(self.max_grad_norm, DType::F32);
            let c = b.div(maxn, n)?;
            let one = b.scalar(1.0, DType::F32);
            Some(b.min(c, one)?)
        } else {
            None
        };
        // Bias corrections from the step count: 1 - beta^t.
        let b1 = b.scalar(self.beta1, DType::F32);
        let b2 = b.scalar(self.beta2, DType::F32);
        let b1t = b.pow(b1, step)?;
        let b2t = b.pow(b2, step)?;
        let one = b.scalar(1.0, DType::F32);
        let bc1 = b.sub(one, b1t)?;
        let bc2 = b.sub(one, b2t)?;
        let step_size = b.div(lr, bc1)?;
        let step_size = on_ok(b, step_size, 0.0)?;
        let sqrt_bc2 = b.sqrt(bc2)?;
        let decay = if self.weight_decay != 0.0 {
            let lw = b.mul_scalar(lr, self.weight_decay)?;
            let d = b.sub(one, lw)?;
            Some(on_ok(b, d, 1.0)?)
        } else {
            None
        };
        let keep_m = on_ok(b, b1, 1.0)?;
        let b1c = b.scalar(1.0 - self.beta1, DType::F32);
        let take_m = on_ok(b, b1c, 0.0)?;
        let keep_v = on_ok(b, b2, 1.0)?;
        let b2c = b.scalar(1.0 - self.beta2, DType::F32);
        let take_v = on_ok(b, b2c, 0.0)?;
        Ok(Coefficients {
            ok,
            clip,
            step_size,
            sqrt_bc2,
            decay,
            keep_m,
            take_m,
            keep_v,
            take_v,
        })
    }

    /// One parameter's update with the step's [`Coefficients`].
    fn update_slot(&self, b: &mut Builder, s: &Slot, c: &Coefficients) -> Result<Updated> {
        let dims = b.dims(s.param).to_vec();
        let bcast = |b: &mut Builder, x: Value| b.broadcast_in_dim(x, &dims, &[]);
        let mut g = s.grad;
        if let Some(ok) = c.ok {
            // A non-finite gradient must not reach the moments, even multiplied by 0.
            let okb = bcast(b, ok)?;
            let zero = b.zeros_like(g);
            g = b.select(okb, g, zero)?;
        }
        if let Some(clip) = c.clip {
            let clip = bcast(b, clip)?;
            g = b.mul(g, clip)?;
        }
        let mut p = s.param;
        if let Some(d) = c.decay {
            let d = bcast(b, d)?;
            p = b.mul(p, d)?;
        }
        let (km, tm, kv, tv) = (
            bcast(b, c.keep_m)?,
            bcast(b, c.take_m)?,
            bcast(b, c.keep_v)?,
            bcast(b, c.take_v)?,
        );
        let m1 = b.mul(s.m, km)?;
        let m2 = b.mul(g, tm)?;
        let m = b.add(m1, m2)?;
        let gg = b.mul(g, g)?;
        let v1 = b.mul(s.v, kv)?;
        let v2 = b.mul(gg, tv)?;
        let v = b.add(v1, v2)?;
        let sv = b.sqrt(v)?;
        let sb = bcast(b, c.sqrt_bc2)?;
        let denom = b.div(sv, sb)?;
        let denom = b.add_scalar(denom, self.eps)?;
        let ss = bcast(b, c.step_size)?;
        let upd = b.div(m, denom)?;
        let upd = b.mul(upd, ss)?;
        let p = b.sub(p, upd)?;
        Ok(Updated { param: p, m, v })
    }
}

/// The per-step scalars of an AdamW update (f32 scalars).
struct Coefficients {
    /// Whether the step is applied (None: always).
    ok: Option<Value>,
    /// The gradient clipping factor (None: no clipping).
    clip: Option<Value>,
    /// lr / (1 - b1^t)
    step_size: Value,
    /// sqrt(1 - b2^t)
    sqrt_bc2: Value,
    /// 1 - lr * wd (None: no weight decay)
    decay: Option<Value>,
    /// The moments' factors: m <- keep_m m + take_m g, v <- keep_v v + take_v g^2.
    keep_m: Value,
    take_m: Value,
    keep_v: Value,
    take_v: Value,
}

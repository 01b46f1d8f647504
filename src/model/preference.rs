//! Preference training (DPO): the log-probability of each sequence's completion, its gradient
//! with respect to the logits, and the pairs' loss over those log-probabilities, with TRL's
//! meanings (`DPOTrainer`): sigmoid (`-log sigmoid(beta z)`, with cDPO's label smoothing), IPO
//! (`(z - 1/(2 beta))^2` over the log-ratios averaged per completion token) and hinge
//! (`relu(1 - beta z)`), where `z` is the chosen completion's log-ratio to the reference minus
//! the rejected one's.
//!
//! A batch's rows come in pairs: row 2i is pair i's chosen completion, row 2i + 1 its rejected
//! one, so that any run of whole pairs (a microbatch, a device's rows) holds both sides of each.
//!
//! The gradient is written out, as the cross entropy's is (`model::loss`): a row's completion
//! log-probability is a sum over its tokens, so its gradient with respect to the logits is
//! `valid * (onehot(target) - softmax(logits))`, computed in the pass that computes the
//! log-probability; the loss only scales each row of it by `d loss / d logp(row)`, a number per
//! row known once every row's log-probability (and the reference's) is.

use hlo::{Builder, CmpDir, DType, Result, Shape, Value};

/// The loss of a pair, as TRL names it (`--dpo-loss`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PairLoss {
    /// `-log sigmoid(beta z)`; with label smoothing `e` (cDPO), `-(1 - e) log sigmoid(beta z) -
    /// e log sigmoid(-beta z)`.
    Sigmoid,
    /// `(z' - 1/(2 beta))^2`, `z'` the difference of the log-ratios each averaged over its
    /// completion's tokens.
    Ipo,
    /// `relu(1 - beta z)`.
    Hinge,
}

impl PairLoss {
    pub const ALL: [PairLoss; 3] = [PairLoss::Sigmoid, PairLoss::Ipo, PairLoss::Hinge];

    pub fn name(self) -> &'static str {
        match self {
            PairLoss::Sigmoid => "sigmoid",
            PairLoss::Ipo => "ipo",
            PairLoss::Hinge => "hinge",
        }
    }

    pub fn parse(s: &str) -> std::result::Result<PairLoss, String> {
        PairLoss::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| format!("--dpo-loss must be sigmoid, ipo or hinge, got `{s}`"))
    }
}

/// The pair loss's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Objective {
    pub loss: PairLoss,
    pub beta: f64,
    /// cDPO's label smoothing (sigmoid only; 0 otherwise).
    pub label_smoothing: f64,
}

/// Per-row scores of the completion tokens: `targets` [B, T] as `next_token_targets` makes them
/// (-100: no loss), the logits [B, T, V] (f32). Returns (the sum over each row's valid targets of
/// `log softmax(logits)[target]` [B], and with `with_grad` its gradient with respect to the
/// logits, `valid * (onehot(target) - softmax(logits))` [B, T, V]).
pub fn sequence_logps(
    b: &mut Builder,
    logits: Value,
    targets: Value,
    with_grad: bool,
) -> Result<(Value, Option<Value>)> {
    b.scoped("logps", |b| {
        let dims = b.dims(logits).to_vec();
        let (bs, t) = (dims[0], dims[1]);
        let rows = [bs, t];
        let m = b.reduce_max(logits, &[2])?;
        let mb = b.broadcast_in_dim(m, &dims, &[0, 1])?;
        let shifted = b.sub(logits, mb)?;
        let e = b.exp(shifted)?;
        let s = b.reduce_sum(e, &[2])?;
        let ls = b.log(s)?;
        let lse = b.add(ls, m)?;
        let minus100 = b.full(-100.0, Shape::new(&rows, DType::S32));
        let valid = b.compare(targets, minus100, CmpDir::Ne)?;
        let zero = b.zeros_like(targets);
        let safe = b.max(targets, zero)?;
        // The target's logit: one gathered scalar per position (see `loss`).
        let index_dims = [bs, t, 1];
        let pos_b = b.iota(Shape::new(&index_dims, DType::S32), 0)?;
        let pos_t = b.iota(Shape::new(&index_dims, DType::S32), 1)?;
        let safe = b.reshape(safe, &index_dims)?;
        let index = b.concatenate(&[pos_b, pos_t, safe], 2)?;
        let picked = b.gather(
            logits,
            index,
            hlo::GatherDims {
                offset_dims: vec![],
                collapsed_slice_dims: vec![0, 1, 2],
                start_index_map: vec![0, 1, 2],
                index_vector_dim: 2,
            },
            &[1, 1, 1],
        )?;
        let logp = b.sub(picked, lse)?;
        let valid = b.convert(valid, DType::F32)?;
        let logp = b.mul(logp, valid)?;
        let per_row = b.reduce_sum(logp, &[1])?;
        if !with_grad {
            return Ok((per_row, None));
        }
        let lse_b = b.broadcast_in_dim(lse, &dims, &[0, 1])?;
        let centred = b.sub(logits, lse_b)?;
        let p = b.exp(centred)?;
        let vocab = b.iota(Shape::new(&dims, DType::S32), 2)?;
        let tb = b.broadcast_in_dim(targets, &dims, &[0, 1])?;
        let hit = b.compare(vocab, tb, CmpDir::Eq)?;
        let one_minus_p = b.neg(p)?;
        let one_minus_p = b.add_scalar(one_minus_p, 1.0)?;
        let minus_p = b.neg(p)?;
        let residual = b.select(hit, one_minus_p, minus_p)?;
        let vb = b.broadcast_in_dim(valid, &dims, &[0, 1])?;
        let grad = b.mul(residual, vb)?;
        Ok((per_row, Some(grad)))
    })
}

/// The number of valid targets (completion tokens) of each row [B] (f32), from `targets` [B, T].
pub fn completion_tokens(b: &mut Builder, targets: Value) -> Result<Value> {
    let minus100 = b.full(-100.0, b.shape(targets).clone());
    let valid = b.compare(targets, minus100, CmpDir::Ne)?;
    let valid = b.convert(valid, DType::F32)?;
    b.reduce_sum(valid, &[1])
}

/// `log sigmoid(x)`, computed without overflow: `min(x, 0) - log1p(exp(-|x|))`.
fn log_sigmoid(b: &mut Builder, x: Value) -> Result<Value> {
    let zero = b.zeros_like(x);
    let low = b.min(x, zero)?;
    let a = b.abs(x)?;
    let na = b.neg(a)?;
    let e = b.exp(na)?;
    let l = b.log1p(e)?;
    b.sub(low, l)
}

/// The pairs' loss and its gradient with respect to the policy's log-probabilities. `logps`
/// and `reference` are each row's completion log-probability [R] (R = 2 x pairs, chosen and
/// rejected alternating), `tokens` each row's completion tokens [R] (f32, for IPO's averages).
/// The loss is the sum of the pairs' losses divided by `pairs_in_step`, the pairs of the whole
/// step (so that microbatches add up to the step's mean). Returns (that share of the loss, its
/// gradient [R]).
pub fn pair_loss_and_grad(
    b: &mut Builder,
    objective: Objective,
    logps: Value,
    reference: Value,
    tokens: Value,
    pairs_in_step: i64,
) -> Result<(Value, Value)> {
    b.scoped("dpo_loss", |b| {
        let rows = b.dims(logps)[0];
        let pairs = rows / 2;
        let by_pair = [pairs, 2];
        let ratio = b.sub(logps, reference)?;
        let ratio = b.reshape(ratio, &by_pair)?;
        // IPO compares log-ratios averaged over each completion's tokens (TRL: at least 1).
        let per_token = match objective.loss {
            PairLoss::Ipo => {
                let one = b.full(1.0, Shape::new(&[rows], DType::F32));
                let n = b.max(tokens, one)?;
                Some(b.reshape(n, &by_pair)?)
            }
            _ => None,
        };
        let ratio = match per_token {
            Some(n) => b.div(ratio, n)?,
            None => ratio,
        };
        let chosen = b.slice_dim(ratio, 1, 0, 1)?;
        let rejected = b.slice_dim(ratio, 1, 1, 2)?;
        let z = b.sub(chosen, rejected)?;
        let z = b.reshape(z, &[pairs])?;
        let (loss, dz) = per_pair(b, objective, z)?;
        let total = b.sum_all(loss)?;
        let n = pairs_in_step as f64;
        let share = b.mul_scalar(total, 1.0 / n)?;
        let dz = b.mul_scalar(dz, 1.0 / n)?;
        // d z / d ratio: +1 for the chosen row, -1 for the rejected one.
        let dz = b.reshape(dz, &[pairs, 1])?;
        let minus = b.neg(dz)?;
        let d = b.concatenate(&[dz, minus], 1)?;
        let d = match per_token {
            Some(n) => b.div(d, n)?,
            None => d,
        };
        let d = b.reshape(d, &[rows])?;
        Ok((share, d))
    })
}

/// Each pair's loss of the score difference `z` [P] and its derivative [P].
fn per_pair(b: &mut Builder, o: Objective, z: Value) -> Result<(Value, Value)> {
    let beta = o.beta;
    match o.loss {
        PairLoss::Sigmoid => {
            let bz = b.mul_scalar(z, beta)?;
            let nbz = b.neg(bz)?;
            let e = o.label_smoothing;
            // -(1 - e) log sigmoid(bz) - e log sigmoid(-bz)
            let lp = log_sigmoid(b, bz)?;
            let ln = log_sigmoid(b, nbz)?;
            let a = b.mul_scalar(lp, -(1.0 - e))?;
            let loss = if e > 0.0 {
                let c = b.mul_scalar(ln, -e)?;
                b.add(a, c)?
            } else {
                a
            };
            // d/dz: -(1 - e) beta sigmoid(-bz) + e beta sigmoid(bz)
            let sn = b.logistic(nbz)?;
            let g = b.mul_scalar(sn, -(1.0 - e) * beta)?;
            let g = if e > 0.0 {
                let sp = b.logistic(bz)?;
                let c = b.mul_scalar(sp, e * beta)?;
                b.add(g, c)?
            } else {
                g
            };
            Ok((loss, g))
        }
        PairLoss::Ipo => {
            let d = b.add_scalar(z, -1.0 / (2.0 * beta))?;
            let loss = b.mul(d, d)?;
            let g = b.mul_scalar(d, 2.0)?;
            Ok((loss, g))
        }
        PairLoss::Hinge => {
            // relu(1 - bz); its derivative -beta where 1 - bz > 0 (0 at the kink, as torch's).
            let bz = b.mul_scalar(z, beta)?;
            let m = b.neg(bz)?;
            let m = b.add_scalar(m, 1.0)?;
            let zero = b.zeros_like(m);
            let loss = b.max(m, zero)?;
            let on = b.compare(m, zero, CmpDir::Gt)?;
            let minus_beta = b.full(-beta, b.shape(m).clone());
            let g = b.select(on, minus_beta, zero)?;
            Ok((loss, g))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::run;
    use pjrt::HostTensor;

    /// The pair loss and its gradient against the formulas computed here in f64, for each loss,
    /// on pairs whose scores straddle every branch (hinge's kink side, large |beta z|).
    #[test]
    fn the_pair_losses_and_their_gradients_are_trls() {
        let logps = [-3.0f32, -5.0, -40.0, -2.0, -1.0, -1.5, -7.0, -7.0];
        let reference = [-4.0f32, -4.5, -3.0, -3.0, -1.2, -1.0, -6.0, -8.5];
        let tokens = [3.0f32, 5.0, 10.0, 2.0, 1.0, 4.0, 6.0, 7.0];
        for (loss, beta, e) in [
            (PairLoss::Sigmoid, 0.1, 0.0),
            (PairLoss::Sigmoid, 2.0, 0.1),
            (PairLoss::Ipo, 0.1, 0.0),
            (PairLoss::Hinge, 0.5, 0.0),
        ] {
            let o = Objective {
                loss,
                beta,
                label_smoothing: e,
            };
            let mut b = Builder::new("main");
            let v = Shape::new(&[8], DType::F32);
            let (l, r, n) = (
                b.param("l", v.clone()),
                b.param("r", v.clone()),
                b.param("n", v),
            );
            let (share, grad) = pair_loss_and_grad(&mut b, o, l, r, n, 8).unwrap();
            let f = b.finish(&[("loss", share), ("grad", grad)]);
            let t = |x: &[f32]| HostTensor::from_f32(x, &[8]);
            let out = run(f, &[t(&logps), t(&reference), t(&tokens)]);
            let got_loss = out[0].to_f32().unwrap()[0] as f64;
            let got_grad = out[1].to_f32().unwrap();
            // The same in f64.
            let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
            let mut want_loss = 0.0;
            for p in 0..4 {
                let (c, r) = (2 * p, 2 * p + 1);
                let mut rc = (logps[c] - reference[c]) as f64;
                let mut rr = (logps[r] - reference[r]) as f64;
                if loss == PairLoss::Ipo {
                    rc /= tokens[c] as f64;
                    rr /= tokens[r] as f64;
                }
                let z = rc - rr;
                let (l, dz) = match loss {
                    PairLoss::Sigmoid => (
                        -(1.0 - e) * sig(beta * z).ln() - e * sig(-beta * z).ln(),
                        -(1.0 - e) * beta * sig(-beta * z) + e * beta * sig(beta * z),
                    ),
                    PairLoss::Ipo => {
                        let d = z - 1.0 / (2.0 * beta);
                        (d * d, 2.0 * d)
                    }
                    PairLoss::Hinge => {
                        let m = 1.0 - beta * z;
                        (m.max(0.0), if m > 0.0 { -beta } else { 0.0 })
                    }
                };
                want_loss += l / 8.0;
                let (sc, sr) = match loss {
                    PairLoss::Ipo => (tokens[c] as f64, tokens[r] as f64),
                    _ => (1.0, 1.0),
                };
                let (gc, gr) = (dz / 8.0 / sc, -dz / 8.0 / sr);
                for (k, w) in [(c, gc), (r, gr)] {
                    let d = (got_grad[k] as f64 - w).abs();
                    assert!(
                        d <= 1e-6 * (1.0 + w.abs()),
                        "{loss:?} grad[{k}] {} vs {w}",
                        got_grad[k]
                    );
                }
            }
            assert!(
                (got_loss - want_loss).abs() <= 1e-6 * (1.0 + want_loss.abs()),
                "{loss:?}: {got_loss} vs {want_loss}"
            );
        }
    }
}

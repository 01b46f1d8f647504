//! The preference-training (DPO) programs: the step, its loss and gradients (for checks), and
//! the completions' log-probabilities (evaluation, and `--precompute-reference`).
//!
//! The step is one program, as the supervised one is: the policy's forward pass over the
//! batch's rows (pairs of completions, chosen then rejected, stacked on the batch axis), the
//! reference's log-probabilities (a forward pass through the same frozen weights with the
//! reference adapter or none, from which no gradient is taken, or an argument when they were
//! precomputed), the pair loss (`model::preference`), the backward pass through the LoRA
//! parameters, and AdamW. With `--grad-accum` the microbatch loop runs all of it per microbatch
//! of whole pairs, and the loss and gradient are the mean over all the step's pairs.
//!
//! Argument order (after the supervised step's, `program` module docs): ... | [dropout_key] |
//! [precomputed_reference_logps] | [reference.* LoRA A/B of `--reference start`]. Results
//! after the supervised step's: `logps` and `reference_logps`, each row's completion
//! log-probability under the policy and the reference [rows], from which the host computes
//! TRL's metrics.

use super::builder::{ProgramBuilder, StepState};
use super::layout::{stack_type, Layout, ModelValues};
use crate::model::dropout::pass_key;
use crate::model::loss::next_token_targets;
use crate::model::preference::{completion_tokens, pair_loss_and_grad, sequence_logps};
use crate::model::tensors::lora_args;
use crate::program::signature::{Program, Role, TensorSpec};
use crate::program::spec::{check_spec, Reference, StepSpec};
use anyhow::Result;
use hlo::{Builder, DType, Shape, Value};

/// Where a DPO step's reference log-probabilities come from: a forward pass with these LoRA
/// values (none: the base model), or `given` (precomputed, [rows]).
#[derive(Clone)]
pub(super) struct ReferenceValues {
    lora: Vec<Value>,
    given: Option<Value>,
}

impl ReferenceValues {
    fn flat(&self) -> Vec<Value> {
        self.lora.iter().chain(&self.given).copied().collect()
    }

    fn rebind(&self, flat: &[Value]) -> ReferenceValues {
        let n = self.lora.len();
        ReferenceValues {
            lora: flat[..n].to_vec(),
            given: self.given.map(|_| flat[n]),
        }
    }
}

/// What one pass of the DPO step computes: the loss (its share of the step's), the gradients in
/// LoRA argument order, and each row's log-probability under the policy and the reference.
struct PairPass {
    loss: Value,
    grads: Vec<Value>,
    logps: Value,
    reference: Value,
}

impl ProgramBuilder<'_> {
    /// The reference's arguments of a DPO step, after the batch's.
    fn reference_params(&mut self, spec: &StepSpec) -> ReferenceValues {
        let p = spec.dpo.as_ref().expect("a DPO step");
        if p.precompute_reference {
            let given = self.param(
                "precomputed_reference_logps",
                &[spec.batch],
                DType::F32,
                Role::ReferenceLogps,
            );
            return ReferenceValues {
                lora: Vec::new(),
                given: Some(given),
            };
        }
        let lora = match p.reference {
            Reference::Base => Vec::new(),
            Reference::Start => lora_args(&spec.model, &spec.lora, spec.remat.scan())
                .into_iter()
                .map(|t| {
                    let name = format!("reference.{}", t.name);
                    self.param(&name, &t.shape, DType::F32, Role::ReferenceLora)
                })
                .collect(),
        };
        ReferenceValues { lora, given: None }
    }
}

/// The DPO training step (see the module docs); `unroll_loops` and `trips` as for the
/// supervised step (`build::train_step_with`).
pub(super) fn dpo_step(spec: &StepSpec, unroll_loops: bool, trips: i64) -> Result<Program> {
    let mut p = ProgramBuilder::new(spec, "train_step");
    p.b.unroll_loops(unroll_loops);
    p.b.price_rolled_loops(trips);
    let state: StepState = p.step_params();
    let (ids, labels, mask) = p.batch_params();
    let key = p.dropout_key();
    let reference = p.reference_params(spec);
    let layout = p.layout();
    let pass = layout.dpo_batch(&mut p.b, &state.mv, [ids, labels, mask], key, &reference)?;
    p.update(&state, pass.loss, &pass.grads)?;
    for (name, v, role) in [
        ("logps", pass.logps, Role::Logps),
        ("reference_logps", pass.reference, Role::ReferenceLogps),
    ] {
        p.result(TensorSpec::new(name, vec![spec.batch], DType::F32, role), v);
    }
    Ok(p.finish("xtrain_train_step"))
}

/// The DPO loss and the gradient of every LoRA tensor (no update), with each row's
/// log-probabilities: for checking the step's forms against each other.
pub(super) fn dpo_grads(spec: &StepSpec) -> Result<Program> {
    let mut p = ProgramBuilder::new(spec, "grads");
    let mv = p.model_params(true);
    let (ids, labels, mask) = p.batch_params();
    let reference = p.reference_params(spec);
    let layout = p.layout();
    let pass = layout.dpo_batch(&mut p.b, &mv, [ids, labels, mask], None, &reference)?;
    p.result(
        TensorSpec::new("loss", vec![], DType::F32, Role::Loss),
        pass.loss,
    );
    let lora: Vec<TensorSpec> = p
        .args
        .iter()
        .filter(|a| a.role == Role::Lora)
        .cloned()
        .collect();
    for (a, g) in lora.iter().zip(&pass.grads) {
        let name = format!("grad.{}", a.name);
        p.result(
            TensorSpec::new(name, a.shape.clone(), DType::F32, Role::Lora),
            *g,
        );
    }
    for (name, v, role) in [
        ("logps", pass.logps, Role::Logps),
        ("reference_logps", pass.reference, Role::ReferenceLogps),
    ] {
        p.result(TensorSpec::new(name, vec![spec.batch], DType::F32, role), v);
    }
    Ok(p.finish("xtrain_grads"))
}

/// Each row's completion log-probability [rows]: the sum over its labelled tokens (labels not
/// -100, after the first position) of the model's log-probability of the token, with the LoRA
/// adapter (`with_lora`, its tensors as the `Role::Lora` arguments: the policy's, or the
/// reference adapter's) or without (the base model). What a DPO step computes of its reference,
/// for evaluation and for `--precompute-reference`.
pub fn build_sequence_logps(spec: &StepSpec, with_lora: bool) -> Result<Program> {
    check_spec(spec)?;
    let mut p = ProgramBuilder::new(spec, "logps");
    let mv = p.model_params(with_lora);
    let (ids, labels, mask) = p.batch_params();
    let layout = p.layout();
    let targets = next_token_targets(&mut p.b, labels)?;
    let logps = layout.forward_logps(&mut p.b, &mv, ids, mask, targets)?;
    p.result(
        TensorSpec::new("logps", vec![spec.batch], DType::F32, Role::Logps),
        logps,
    );
    Ok(p.finish("xtrain_logps"))
}

impl Layout<'_> {
    /// The DPO step's loss, gradients and log-probabilities over the whole batch (`batch`:
    /// input_ids, labels, attention_mask), looping over microbatches of whole pairs when there
    /// are several.
    fn dpo_batch(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        batch: [Value; 3],
        key: Option<Value>,
        reference: &ReferenceValues,
    ) -> hlo::Result<PairPass> {
        let micro = self.spec.grad_accum;
        if micro <= 1 {
            let key = match key {
                Some(k) => {
                    let first_row = b.scalar(0.0, DType::U64);
                    Some(pass_key(b, k, first_row)?)
                }
                None => None,
            };
            return self.dpo_pass(b, m, batch, key, reference);
        }
        let rows = self.spec.batch / micro;
        let (all, t) = (self.spec.batch, self.spec.seq);
        let mut carry = vec![b.scalar(0.0, DType::F32)];
        for &v in &m.lora {
            carry.push(b.zeros_like(v));
        }
        for _ in 0..2 {
            carry.push(b.zeros(Shape::new(&[all], DType::F32)));
        }
        let mut inv = m.flat();
        inv.extend(batch);
        inv.extend(key);
        inv.extend(reference.flat());
        let nm = m.frozen.len() + m.lora.len();
        let nl = m.lora.len();
        let after_key = nm + 3 + usize::from(key.is_some());
        let out = b.fori_loop(micro, &carry, &inv, |bb, i, carry, inv| {
            let mv = m.rebind(&inv[..nm]);
            let r = bb.scalar(rows as f64, DType::S32);
            let start = bb.mul(i, r)?;
            let zero = bb.scalar(0.0, DType::S32);
            let mut slice = |x: Value| bb.dynamic_slice(x, &[start, zero], &[rows, t]);
            let batch = [slice(inv[nm])?, slice(inv[nm + 1])?, slice(inv[nm + 2])?];
            // A microbatch's rows draw the masks they draw in the whole batch (model::dropout).
            let key = match key {
                Some(_) => {
                    let first_row = bb.convert(start, DType::U64)?;
                    Some(pass_key(bb, inv[nm + 3], first_row)?)
                }
                None => None,
            };
            let mut refs = reference.rebind(&inv[after_key..]);
            if let Some(given) = refs.given {
                refs.given = Some(bb.dynamic_slice(given, &[start], &[rows])?);
            }
            let pass = self.dpo_pass(bb, &mv, batch, key, &refs)?;
            let mut next = vec![bb.add(carry[0], pass.loss)?];
            for (k, g) in pass.grads.into_iter().enumerate() {
                next.push(bb.add(carry[1 + k], g)?);
            }
            next.push(bb.dynamic_update_slice(carry[1 + nl], pass.logps, &[start])?);
            next.push(bb.dynamic_update_slice(carry[2 + nl], pass.reference, &[start])?);
            Ok(next)
        })?;
        Ok(PairPass {
            loss: out[0],
            grads: out[1..=nl].to_vec(),
            logps: out[1 + nl],
            reference: out[2 + nl],
        })
    }

    /// One (micro)batch of whole pairs: the reference's log-probabilities, the policy's forward
    /// pass and log-probabilities with their gradient per row, the pair loss, and the backward
    /// pass of the loss's gradient (each row's gradient scaled by `d loss / d logp(row)`).
    fn dpo_pass(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        [ids, labels, mask]: [Value; 3],
        key: Option<Value>,
        reference: &ReferenceValues,
    ) -> hlo::Result<PairPass> {
        let objective = self.spec.dpo.as_ref().expect("a DPO step").objective();
        let pairs = self.spec.batch / 2;
        let targets = next_token_targets(b, labels)?;
        let tokens = completion_tokens(b, targets)?;
        let ref_logps = match reference.given {
            Some(v) => v,
            None => b.scoped("reference", |b| {
                let mv = ModelValues {
                    frozen: m.frozen.clone(),
                    lora: reference.lora.clone(),
                };
                self.forward_logps(b, &mv, ids, mask, targets)
            })?,
        };
        let dropout = key.map(|k| (self.spec.lora.dropout, k));
        if !self.spec.remat.scan() {
            let logits = self.logits_unrolled(b, m, dropout, ids, mask)?;
            let (logps, unit) = sequence_logps(b, logits, targets, true)?;
            let (loss, dlogps) = pair_loss_and_grad(b, objective, logps, ref_logps, tokens, pairs)?;
            let dlogits = scale_rows(b, unit.expect("a gradient"), dlogps)?;
            let grads = b.vjp(&[(logits, dlogits)], &m.lora)?;
            return Ok(PairPass {
                loss,
                grads,
                logps,
                reference: ref_logps,
            });
        }
        let model = self.model();
        let (_, norm, lm_head) = self.ends(&m.frozen);
        let f = self.scanned_forward(b, m, ids, mask, key)?;
        let h_last = f.h_last;
        // With the loss in chunks each chunk's gradient is taken per row before the loss is
        // known and scaled after; whole, the logits' gradient is scaled before the head's vjp.
        let (logps, dh) = match self.spec.loss_chunk {
            Some(chunk) => {
                let (logps, unit) =
                    self.chunked_logps(b, h_last, norm, lm_head, targets, chunk, true)?;
                let (loss, dlogps) =
                    pair_loss_and_grad(b, objective, logps, ref_logps, tokens, pairs)?;
                let dh = scale_rows(b, unit.expect("a gradient"), dlogps)?;
                ((logps, loss), dh)
            }
            None => {
                let logits = model.head(b, h_last, norm, lm_head)?;
                let (logps, unit) = sequence_logps(b, logits, targets, true)?;
                let (loss, dlogps) =
                    pair_loss_and_grad(b, objective, logps, ref_logps, tokens, pairs)?;
                let dlogits = scale_rows(b, unit.expect("a gradient"), dlogps)?;
                let dh = b.vjp(&[(logits, dlogits)], &[h_last])?[0];
                ((logps, loss), dh)
            }
        };
        let (logps, loss) = logps;
        let grads = self.scanned_backward(b, m, &f, dh)?;
        Ok(PairPass {
            loss,
            grads,
            logps,
            reference: ref_logps,
        })
    }

    /// Each row's completion log-probability [rows] from a forward pass without gradients (the
    /// reference's, or evaluation's), the head over the whole sequence or in `--loss-chunk`s.
    fn forward_logps(
        &self,
        b: &mut Builder,
        m: &ModelValues,
        ids: Value,
        mask: Value,
        targets: Value,
    ) -> hlo::Result<Value> {
        let h = self.hidden(b, m, ids, mask)?;
        let (_, norm, lm_head) = self.ends(&m.frozen);
        match self.spec.loss_chunk.filter(|_| self.spec.remat.scan()) {
            Some(chunk) => Ok(self
                .chunked_logps(b, h, norm, lm_head, targets, chunk, false)?
                .0),
            None => {
                let logits = self.model().head(b, h, norm, lm_head)?;
                Ok(sequence_logps(b, logits, targets, false)?.0)
            }
        }
    }

    /// Each row's completion log-probability from the last hidden state `h` [B, T, H], `chunk`
    /// positions at a time (the logits [B, T, V] never whole), and `with_grad` its gradient with
    /// respect to `h` per row (the gradient of each row's own log-probability) [B, T, H].
    #[allow(clippy::too_many_arguments)]
    fn chunked_logps(
        &self,
        b: &mut Builder,
        h: Value,
        norm: Value,
        lm_head: Value,
        targets: Value,
        chunk: i64,
        with_grad: bool,
    ) -> hlo::Result<(Value, Option<Value>)> {
        let (bs, t, hd) = (b.dims(h)[0], b.dims(h)[1], b.dims(h)[2]);
        let chunk = if chunk > 0 && t % chunk == 0 {
            chunk
        } else {
            t
        };
        let mut carry = vec![b.zeros(Shape::new(&[bs], DType::F32))];
        if with_grad {
            // dh is written a chunk at a time: kept as bits, as a layer stack is.
            carry.push(b.zeros(Shape::new(&[bs, t, hd], stack_type(b.dtype(h)))));
        }
        let out = b.scoped("logps_chunks", |b| {
            b.fori_loop(
                t / chunk,
                &carry,
                &[h, norm, lm_head, targets],
                |bb, i, carry, inv| {
                    let c = bb.scalar(chunk as f64, DType::S32);
                    let start = bb.mul(i, c)?;
                    let zero = bb.scalar(0.0, DType::S32);
                    let hc = bb.dynamic_slice(inv[0], &[zero, start, zero], &[bs, chunk, hd])?;
                    let tc = bb.dynamic_slice(inv[3], &[zero, start], &[bs, chunk])?;
                    let logits = self.model().head(bb, hc, inv[1], inv[2])?;
                    let (share, unit) = sequence_logps(bb, logits, tc, with_grad)?;
                    let mut next = vec![bb.add(carry[0], share)?];
                    if let Some(unit) = unit {
                        let g = bb.vjp(&[(logits, unit)], &[hc])?[0];
                        let g = bb.bitcast_convert(g, bb.dtype(carry[1]))?;
                        next.push(bb.dynamic_update_slice(carry[1], g, &[zero, start, zero])?);
                    }
                    Ok(next)
                },
            )
        })?;
        let grad = match with_grad {
            true => Some(b.bitcast_convert(out[1], b.dtype(h))?),
            false => None,
        };
        Ok((out[0], grad))
    }
}

/// `x` [B, ...] with each row b multiplied by `w[b]` ([B], f32), in f32 and back to `x`'s type.
fn scale_rows(b: &mut Builder, x: Value, w: Value) -> hlo::Result<Value> {
    let dims = b.dims(x).to_vec();
    let dtype = b.dtype(x);
    let x32 = b.convert(x, DType::F32)?;
    let wb = b.broadcast_in_dim(w, &dims, &[0])?;
    let y = b.mul(x32, wb)?;
    b.convert(y, dtype)
}

/// The DPO step's forms give one result: every remat policy, the loss in chunks and gradient
/// accumulation against the unrolled step, with the base model and the starting adapter as the
/// reference, and the reference's log-probabilities precomputed by the log-probability program
/// against the reference inside the step. The tiny model with random weights and adapters; two
/// pairs, rows padded at different lengths. f32; 1e-5 relative to the largest gradient, as the
/// supervised step's forms (`passes`).
#[cfg(test)]
mod tests {
    use crate::model::lora::{LoraConfig, Projection};
    use crate::model::preference::PairLoss;
    use crate::program::spec::{Preference, Reference, Remat, StepSpec};
    use crate::program::{build_sequence_logps, Role};
    use crate::test_support::{assert_same, grads_program_on, max_diff, run_text, weights};
    use hlo::DType;
    use pjrt::HostTensor;

    const SEQ: i64 = 16;
    const ROWS: i64 = 4;

    fn spec(remat: Remat, reference: Reference, loss: PairLoss) -> StepSpec {
        let model = crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .expect("the tiny-llama3 preset");
        let lora = LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
        };
        StepSpec {
            remat,
            dpo: Some(Preference {
                reference,
                dpo_loss: loss,
                ..Preference::default()
            }),
            ..StepSpec::new(model, lora, ROWS, SEQ, DType::F32)
        }
    }

    /// Two pairs: a prompt of 5 (then 3) tokens, completions ending at different lengths; the
    /// labels are the completions' tokens.
    fn batch() -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        let (mut ids, mut labels, mut mask) = (Vec::new(), Vec::new(), Vec::new());
        for (row, (prompt, len)) in [(5, 9), (5, 16), (3, 7), (3, 12)].into_iter().enumerate() {
            for t in 0..SEQ as usize {
                let id = ((t * 7919 + row * 104_729 + 13) % 512) as i32;
                let real = t < len;
                ids.push(if real { id } else { 0 });
                labels.push(if real && t >= prompt { id } else { -100 });
                mask.push(i32::from(real));
            }
        }
        (ids, labels, mask)
    }

    fn run(
        s: &StepSpec,
        given: Option<&[f32]>,
    ) -> (crate::test_support::LossAndGrads, Vec<Vec<f32>>) {
        let (ids, labels, mask) = batch();
        grads_program_on(s, &ids, &labels, &mask, given)
    }

    #[test]
    fn every_form_of_the_dpo_step_gives_the_unrolled_steps_loss_and_gradients() {
        for (reference, loss) in [
            (Reference::Start, PairLoss::Sigmoid),
            (Reference::Base, PairLoss::Ipo),
            (Reference::Start, PairLoss::Hinge),
        ] {
            let plain = run(&spec(Remat::None, reference, loss), None);
            for (what, s) in [
                ("--remat layer", spec(Remat::Layer, reference, loss)),
                ("--remat save-proj", spec(Remat::SaveProj, reference, loss)),
                (
                    "--loss-chunk 4",
                    StepSpec {
                        loss_chunk: Some(4),
                        ..spec(Remat::Layer, reference, loss)
                    },
                ),
                (
                    "--grad-accum 2",
                    StepSpec {
                        grad_accum: 2,
                        ..spec(Remat::Layer, reference, loss)
                    },
                ),
                (
                    "--key-block 5",
                    StepSpec {
                        key_block: Some(5),
                        ..spec(Remat::Layer, reference, loss)
                    },
                ),
            ] {
                let got = run(&s, None);
                let what = format!("{what} ({reference:?}, {loss:?})");
                assert_same(&what, &got.0, &plain.0, 1e-5);
                for (k, v) in got.1.iter().enumerate() {
                    let d = max_diff(v, &plain.1[k]);
                    assert!(d <= 1e-4, "{what}: log-probabilities {k} differ by {d}");
                }
            }
            // The reference is not the policy: the first step's loss is not the one of equal
            // log-ratios (ln 2 for the sigmoid).
            let (policy, reference_logps) = (&plain.1[0], &plain.1[1]);
            assert!(max_diff(policy, reference_logps) > 1e-3, "{reference:?}");
        }
    }

    /// The log-probability program's reference log-probabilities, given to a
    /// `--precompute-reference` step, give what the reference forward inside the step gives.
    #[test]
    fn precomputed_reference_log_probabilities_are_the_steps_own() {
        for reference in [Reference::Base, Reference::Start] {
            let inside = spec(Remat::Layer, reference, PairLoss::Sigmoid);
            let want = run(&inside, None);
            let program = build_sequence_logps(&inside, reference == Reference::Start).unwrap();
            let (ids, labels, mask) = batch();
            let inputs: Vec<HostTensor> = program
                .args
                .iter()
                .map(|a| match a.role {
                    Role::Frozen => HostTensor::from_f32(&weights(&a.name, &a.shape), &a.shape),
                    // The step's reference adapter is named `reference.<name>`.
                    Role::Lora => {
                        let name = format!("reference.{}", a.name);
                        HostTensor::from_f32(&weights(&name, &a.shape), &a.shape)
                    }
                    Role::InputIds => HostTensor::from_i32(&ids, &a.shape),
                    Role::Labels => HostTensor::from_i32(&labels, &a.shape),
                    Role::AttentionMask => HostTensor::from_i32(&mask, &a.shape),
                    other => panic!("{other:?}"),
                })
                .collect();
            let given = run_text(&program.text, &inputs)[0].to_f32().unwrap();
            assert!(max_diff(&given, &want.1[1]) <= 1e-4, "{reference:?}");
            let mut p = inside.dpo.clone().unwrap();
            p.precompute_reference = true;
            let precomputed = StepSpec {
                dpo: Some(p),
                ..inside.clone()
            };
            let got = run(&precomputed, Some(&given));
            assert_same(&format!("precomputed {reference:?}"), &got.0, &want.0, 1e-5);
        }
    }
}

//! The trainer's part in preference training (`--method dpo`) beside the step (which
//! `trainer` runs, with the reference's arguments): the reference adapter put on the devices
//! (`--reference start`), and the log-probability program, the policy's or the reference's
//! over batches (evaluation and `--precompute-reference`). TRL's metrics are computed here from
//! those log-probabilities ([`PairMetrics`]).

use crate::data::Batch;
use crate::device::trainer::{LoraState, Trainer};
use crate::formats::host::convert;
use crate::model::preference::{Objective, PairLoss};
use crate::program::{self, Reference, Role};
use anyhow::{bail, Context, Result};
use pjrt::{Buffer, CompileOptions, ElementType};

/// Whose log-probabilities [`Trainer::sequence_logps`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scorer {
    /// The adapter being trained, as it is now.
    Policy,
    /// The DPO step's reference: the base model or the starting adapter.
    Reference,
}

/// TRL's metrics of a set of pairs, each the mean over the pairs: the loss, the rewards
/// (`beta` times the log-ratio to the reference) of the chosen and rejected completions, their
/// margin, the share of pairs whose chosen reward is strictly higher, and the policy's
/// log-probabilities.
///
/// "Strictly higher" at the log-probabilities' own resolution: they are f32 sums, and the
/// policy's and the reference's come from two forward passes whose roundings differ, so a
/// margin within a few units in the last place of the log-probabilities is a tie. (A policy
/// equal to its reference, a run's first step against its starting adapter, has margins of
/// that size: TRL's one program computes both sides alike and gets exactly 0, no pair ahead.)
#[derive(Clone, Copy, Debug, PartialEq, Default, serde::Serialize)]
pub struct PairMetrics {
    pub loss: f64,
    #[serde(rename = "rewards/chosen")]
    pub rewards_chosen: f64,
    #[serde(rename = "rewards/rejected")]
    pub rewards_rejected: f64,
    #[serde(rename = "rewards/margins")]
    pub rewards_margins: f64,
    #[serde(rename = "rewards/accuracies")]
    pub rewards_accuracies: f64,
    #[serde(rename = "logps/chosen")]
    pub logps_chosen: f64,
    #[serde(rename = "logps/rejected")]
    pub logps_rejected: f64,
    #[serde(skip)]
    pub pairs: usize,
}

impl PairMetrics {
    /// The metrics of the pairs of rows (2i chosen, 2i + 1 rejected) given each row's policy
    /// and reference log-probability and completion tokens; pairs whose chosen row has no
    /// completion token (an evaluation batch's padding) are left out. The loss is computed as
    /// the program computes it, in f64.
    pub fn of(o: Objective, logps: &[f32], reference: &[f32], tokens: &[usize]) -> PairMetrics {
        let mut m = PairMetrics::default();
        for p in 0..logps.len() / 2 {
            let (c, r) = (2 * p, 2 * p + 1);
            if tokens[c] == 0 {
                continue;
            }
            let ratio = |k: usize| (logps[k] - reference[k]) as f64;
            let (rc, rr) = (o.beta * ratio(c), o.beta * ratio(r));
            let z = match o.loss {
                PairLoss::Ipo => {
                    ratio(c) / tokens[c].max(1) as f64 - ratio(r) / tokens[r].max(1) as f64
                }
                _ => ratio(c) - ratio(r),
            };
            let log_sigmoid = |x: f64| x.min(0.0) - (-x.abs()).exp().ln_1p();
            let e = o.label_smoothing;
            m.loss += match o.loss {
                PairLoss::Sigmoid => {
                    -(1.0 - e) * log_sigmoid(o.beta * z) - e * log_sigmoid(-o.beta * z)
                }
                PairLoss::Ipo => (z - 1.0 / (2.0 * o.beta)).powi(2),
                PairLoss::Hinge => (1.0 - o.beta * z).max(0.0),
            };
            m.rewards_chosen += rc;
            m.rewards_rejected += rr;
            m.rewards_margins += rc - rr;
            let largest = [logps[c], logps[r], reference[c], reference[r]]
                .into_iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            let tie = 4.0 * o.beta * ulp(largest);
            m.rewards_accuracies += f64::from(u8::from(rc - rr > tie));
            m.logps_chosen += logps[c] as f64;
            m.logps_rejected += logps[r] as f64;
            m.pairs += 1;
        }
        let n = m.pairs.max(1) as f64;
        for v in [
            &mut m.loss,
            &mut m.rewards_chosen,
            &mut m.rewards_rejected,
            &mut m.rewards_margins,
            &mut m.rewards_accuracies,
            &mut m.logps_chosen,
            &mut m.logps_rejected,
        ] {
            *v /= n;
        }
        m
    }
}

/// The distance from |x| to the next f32 up.
fn ulp(x: f32) -> f64 {
    let x = x.abs();
    (f32::from_bits(x.to_bits() + 1) - x) as f64
}

/// Each row's completion tokens: the labels the loss sees ([`Batch::loss_labels`]) that are not
/// -100.
pub fn completion_tokens(batch: &Batch) -> Result<Vec<usize>> {
    let labels = batch.loss_labels().to_i32()?;
    let t = batch.dims().1 as usize;
    Ok(labels
        .chunks(t)
        .map(|row| row.iter().filter(|&&l| l != -100).count())
        .collect())
}

impl Trainer {
    /// The LoRA arguments' (name, shape) and shardings, in argument order.
    fn lora_args(&self) -> (Vec<(String, Vec<i64>)>, Vec<hlo::Sharding>) {
        self.program
            .args
            .iter()
            .zip(self.program.arg_shardings(&self.spec))
            .filter(|(a, _)| a.role == Role::Lora)
            .map(|(a, s)| ((a.name.clone(), a.shape.clone()), s))
            .unzip()
    }

    /// Put the DPO reference adapter (per-layer PEFT names, as the run started with) on the
    /// devices, where a `--reference start` step and the reference's log-probabilities read
    /// it.
    pub fn set_reference(&mut self, lora: &LoraState) -> Result<()> {
        let (specs, shardings) = self.lora_args();
        let tensors = crate::formats::host::to_program_layout(
            &specs,
            lora,
            self.spec.model.num_hidden_layers,
        )
        .context("the reference adapter")?;
        let mesh = self.spec.mesh.as_ref().map(|m| m.mesh());
        self.dpo.reference = tensors
            .iter()
            .zip(&shardings)
            .map(|(t, sh)| {
                self.rt
                    .upload_sharded(&convert(t, ElementType::F32)?, sh, mesh.as_ref())
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Each row's completion log-probability over `batches` (each of the same rows), under
    /// the policy or the reference; None on a process of a run of several that does not get
    /// results (every process must call it).
    pub fn sequence_logps(&mut self, batches: &[Batch], scorer: Scorer) -> Result<Vec<f32>> {
        let reference = self
            .spec
            .dpo
            .as_ref()
            .map_or(Reference::Base, |p| p.reference);
        let with_lora = scorer == Scorer::Policy || reference == Reference::Start;
        let Some(first) = batches.first() else {
            return Ok(Vec::new());
        };
        let rows = first.dims().0;
        let slot = match with_lora {
            true => &self.dpo.with_lora,
            false => &self.dpo.base,
        };
        if slot.as_ref().is_none_or(|(r, _)| *r != rows) {
            let mut spec = self.spec.clone();
            spec.batch = rows;
            spec.grad_accum = 1;
            let program = program::build_sequence_logps(&spec, with_lora)?;
            let (exe, _) = crate::device::cache::compile_cached(
                &self.rt,
                &program,
                &CompileOptions::default(),
                true,
            )?;
            match with_lora {
                true => self.dpo.with_lora = Some((rows, exe)),
                false => self.dpo.base = Some((rows, exe)),
            }
        }
        let n_lora = self.lora_args().0.len();
        let lora: &[Vec<Buffer>] = match (with_lora, scorer) {
            (false, _) => &[],
            (true, Scorer::Policy) => &self.state[..n_lora],
            (true, Scorer::Reference) => {
                if self.dpo.reference.is_empty() {
                    bail!("the reference is the starting adapter, but none was given");
                }
                &self.dpo.reference
            }
        };
        let exe = match with_lora {
            true => &self.dpo.with_lora.as_ref().expect("compiled").1,
            false => &self.dpo.base.as_ref().expect("compiled").1,
        };
        let mut all = Vec::new();
        for batch in batches {
            self.check_kernel_rows(batch)?;
            let inputs = [
                self.put_rows("input_ids", &[&batch.input_ids])?,
                self.put_rows("labels", &[&batch.loss_labels()])?,
                self.put_rows("attention_mask", &[&batch.attention_mask])?,
            ];
            let args: Vec<Vec<&Buffer>> = (0..self.devices())
                .map(|d| {
                    self.frozen
                        .iter()
                        .chain(lora)
                        .chain(&inputs)
                        .map(|per| &per[d])
                        .collect()
                })
                .collect();
            let out = exe.execute(&args)?;
            all.extend(out[0][0].to_host()?.to_f32()?);
        }
        Ok(all)
    }

    /// TRL's metrics on held-out pairs (`batches` of whole pairs, the last one's repeats
    /// without labels), with the policy as it is now.
    pub fn evaluate_pairs(&mut self, batches: &[Batch]) -> Result<PairMetrics> {
        let objective = self
            .spec
            .dpo
            .as_ref()
            .context("pairs are evaluated by a DPO step")?
            .objective();
        let policy = self.sequence_logps(batches, Scorer::Policy)?;
        let reference = self.sequence_logps(batches, Scorer::Reference)?;
        let mut tokens = Vec::new();
        for b in batches {
            tokens.extend(completion_tokens(b)?);
        }
        Ok(PairMetrics::of(objective, &policy, &reference, &tokens))
    }
}

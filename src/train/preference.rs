//! A preference run's own parts of [`super::run`] (`--method dpo`): the reference's
//! log-probabilities computed once over the data (`--precompute-reference`), TRL's metrics of
//! each step from the rows' log-probabilities the step returns, and how the progress line shows
//! them.

use crate::data::{Batch, Row, Source};
use crate::device::preference::{completion_tokens, PairMetrics, Scorer};
use crate::device::trainer::Trainer;
use anyhow::Result;

/// A DPO run's reference in place before its first step: the starting adapter on the devices
/// (`--reference start`), and with `--precompute-reference` each training row's
/// log-probability under the reference, given to `source`'s rows and returned (for the loaders
/// of other virtual hosts).
pub(super) fn reference(
    trainer: &mut Trainer,
    adapter: Option<&crate::device::trainer::LoraState>,
    source: &mut Source,
) -> Result<Option<Vec<f32>>> {
    if let Some(adapter) = adapter {
        trainer.set_reference(adapter)?;
    }
    match trainer.spec.dpo.as_ref() {
        Some(p) if p.precompute_reference => {
            let logps = precompute_reference(trainer, source)?;
            source.set_reference(&logps)?;
            Ok(Some(logps))
        }
        _ => Ok(None),
    }
}

/// Each training row's completion log-probability under the reference, in file order: the
/// log-probability program over batches of the step's rows (the last one filled up with
/// repeats of its first row, whose results are dropped). Every process of a run of several
/// computes them all.
fn precompute_reference(trainer: &mut Trainer, source: &Source) -> Result<Vec<f32>> {
    let rows = source.rows();
    let per_batch = trainer.spec.batch as usize;
    let batches: Vec<Batch> = rows
        .chunks(per_batch)
        .map(|c| {
            let mut picked: Vec<&Row> = c.iter().collect();
            while picked.len() < per_batch {
                picked.push(&c[0]);
            }
            crate::data::batch(&picked)
        })
        .collect();
    let t0 = std::time::Instant::now();
    let mut logps = trainer.sequence_logps(&batches, Scorer::Reference)?;
    logps.truncate(rows.len());
    crate::esay!(
        "xtrain: computed the reference's log-probabilities of {} pairs in {:.1}s \
         (--precompute-reference)",
        rows.len() / 2,
        t0.elapsed().as_secs_f64()
    );
    Ok(logps)
}

/// TRL's metrics of the step just taken on `batch` (None for a supervised step).
pub(super) fn step_metrics(trainer: &Trainer, batch: &Batch) -> Result<Option<PairMetrics>> {
    let (Some(p), Some((logps, reference))) = (trainer.spec.dpo.as_ref(), trainer.last_logps())
    else {
        return Ok(None);
    };
    let tokens = completion_tokens(batch)?;
    Ok(Some(PairMetrics::of(
        p.objective(),
        logps,
        reference,
        &tokens,
    )))
}

/// What the progress line adds for a DPO step: the reward margin and accuracy.
pub(super) fn shown(m: Option<&PairMetrics>) -> String {
    m.map_or(String::new(), |m| {
        format!(
            " margin {} acc {:.0}%",
            crate::words::fixed(m.rewards_margins, 4),
            100.0 * m.rewards_accuracies
        )
    })
}

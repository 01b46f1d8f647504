//! Where a run's batches come from: one fixed batch, or rows visited epoch by epoch in a seeded
//! order; and the held-out rows cut into evaluation batches.

use crate::data::batch::Batch;
use crate::data::examples::{read_jsonl, tokenize, Tokenized};
use crate::data::rows::{epoch_order, Row};
use crate::data::text::TextTokenizer;
use anyhow::Result;
use pjrt::HostTensor;
use std::path::Path;

/// Where the batches come from.
pub enum Source {
    /// One batch used for every step.
    Fixed(Batch),
    /// Rows visited epoch by epoch in a seeded order (the current epoch's order cached).
    Rows {
        rows: Vec<Row>,
        batch: usize,
        order: Option<(u64, Vec<usize>)>,
    },
}

impl Source {
    pub fn steps_per_epoch(&self) -> u64 {
        match self {
            Source::Fixed(_) => 1,
            Source::Rows { rows, batch, .. } => (rows.len() / batch).max(1) as u64,
        }
    }

    /// The batch at (epoch, position), and the position after it.
    pub fn next(&mut self, seed: u64, epoch: &mut u64, position: &mut u64) -> Batch {
        match self {
            Source::Fixed(b) => b.clone(),
            Source::Rows { rows, batch, order } => {
                if *position as usize + *batch > rows.len() {
                    *epoch += 1;
                    *position = 0;
                }
                // The shuffle of an epoch is computed once, not at every step.
                if order.as_ref().is_none_or(|(e, _)| e != epoch) {
                    *order = Some((*epoch, epoch_order(rows.len(), seed, *epoch)));
                }
                let ord = &order.as_ref().unwrap().1;
                let at = *position as usize;
                let picked: Vec<&Row> = ord[at..at + *batch].iter().map(|&i| &rows[i]).collect();
                *position += *batch as u64;
                crate::data::batch(&picked)
            }
        }
    }
}

/// Read a JSONL file's examples and tokenize them (bad lines skipped and reported when
/// `skip_bad_lines`; the loss on the prompt too when `train_on_prompt`).
pub fn read_rows(
    path: &Path,
    tok: &TextTokenizer,
    skip_bad_lines: bool,
    train_on_prompt: bool,
) -> Result<Vec<Tokenized>> {
    let report = read_jsonl(path, skip_bad_lines)?;
    if !report.skipped.is_empty() {
        eprintln!(
            "xtrain: skipped {} bad lines of {} (first: line {}: {})",
            report.skipped.len(),
            path.display(),
            report.skipped[0].0,
            report.skipped[0].1
        );
    }
    report
        .examples
        .iter()
        .map(|e| tokenize(tok, e, train_on_prompt))
        .collect()
}

/// Eval batches padded by repeating rows: turn the repeats' labels off so they do not count.
pub fn mask_repeats(mut batches: Vec<Batch>, real_rows: usize, b: usize) -> Vec<Batch> {
    if let Some(last) = batches.last_mut() {
        let real_in_last = real_rows - (real_rows.saturating_sub(1) / b) * b;
        let t = last.dims().1 as usize;
        let mut labels = last.labels.to_i32().unwrap_or_default();
        for l in labels.iter_mut().skip(real_in_last * t) {
            *l = -100;
        }
        last.labels = HostTensor::from_i32(&labels, &last.labels.dims);
    }
    batches
}

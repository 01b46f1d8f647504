//! Rows: tokenized examples packed (or padded one to a row) into rows of `--seq` tokens, a held-out
//! share split off for evaluation, and each epoch's seeded order.

use crate::data::examples::Tokenized;
use crate::model::lora::SplitMix;
use anyhow::{bail, Result};

/// Fixed-length rows ready for batching.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub ids: Vec<i32>,
    pub labels: Vec<i32>,
    pub mask: Vec<i32>,
}

/// What making rows did to the examples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowReport {
    pub truncated: usize,
    pub dropped_empty: usize,
}

/// Pack examples end to end into rows of `seq` tokens (`pack`), or give each its own row padded
/// with `pad_id`. Examples longer than `seq` are truncated (counted), or an error if `strict`.
pub fn make_rows(
    examples: &[Tokenized],
    seq: usize,
    pack: bool,
    pad_id: u32,
    strict: bool,
) -> Result<(Vec<Row>, RowReport)> {
    let mut report = RowReport::default();
    let mut rows = Vec::new();
    let (mut ids, mut labels): (Vec<i32>, Vec<i32>) = (Vec::new(), Vec::new());
    for (i, ex) in examples.iter().enumerate() {
        let mut e_ids: Vec<i32> = ex.ids.iter().map(|&x| x as i32).collect();
        let mut e_labels = ex.labels.clone();
        if e_ids.len() > seq {
            if strict {
                bail!("example {} has {} tokens, more than --seq {seq} (drop --strict-length to truncate)", i + 1, e_ids.len());
            }
            report.truncated += 1;
            e_ids.truncate(seq);
            e_labels.truncate(seq);
        }
        if e_labels.iter().skip(1).all(|&l| l == -100) {
            report.dropped_empty += 1;
            continue;
        }
        if !pack {
            let n = e_ids.len();
            let mut row = Row {
                ids: e_ids,
                labels: e_labels,
                mask: vec![1; n],
            };
            row.ids.resize(seq, pad_id as i32);
            row.labels.resize(seq, -100);
            row.mask.resize(seq, 0);
            rows.push(row);
            continue;
        }
        if ids.len() + e_ids.len() > seq {
            rows.push(finish_packed(
                std::mem::take(&mut ids),
                std::mem::take(&mut labels),
                seq,
                pad_id,
            ));
        }
        ids.extend(e_ids);
        labels.extend(e_labels);
    }
    if !ids.is_empty() {
        rows.push(finish_packed(ids, labels, seq, pad_id));
    }
    Ok((rows, report))
}

fn finish_packed(mut ids: Vec<i32>, mut labels: Vec<i32>, seq: usize, pad_id: u32) -> Row {
    let n = ids.len();
    ids.resize(seq, pad_id as i32);
    labels.resize(seq, -100);
    let mut mask = vec![1; n];
    mask.resize(seq, 0);
    Row { ids, labels, mask }
}

/// Split off `fraction` of the examples (deterministically, spread evenly over the file) as the
/// eval set: `round(fraction * n)` of them, and at least one when `fraction > 0`. The caller
/// checks that some are left to train on.
pub fn split_eval<T: Clone>(items: &[T], fraction: f64) -> (Vec<T>, Vec<T>) {
    if fraction <= 0.0 || items.is_empty() {
        return (items.to_vec(), Vec::new());
    }
    let n = items.len();
    let k = ((fraction * n as f64).round() as usize).clamp(1, n);
    let mut train = Vec::new();
    let mut eval = Vec::new();
    // Example i is held out when the running count of k/n steps past an integer there: exactly
    // k of them, evenly spaced (every m-th one when k = n/m).
    for (i, x) in items.iter().enumerate() {
        if (i + 1) * k / n > i * k / n {
            eval.push(x.clone());
        } else {
            train.push(x.clone());
        }
    }
    (train, eval)
}

/// The order rows are visited in during `epoch`: a seeded shuffle, the same on every run.
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::split_eval;

    /// `--eval-fraction` holds out round(f * n) examples, at least one, spread evenly.
    #[test]
    fn eval_fractions_hold_out_what_they_say() {
        let items: Vec<usize> = (0..94).collect();
        assert_eq!(
            split_eval(&items, 0.01).1.len(),
            1,
            "0.01 of 94 is still one"
        );
        assert_eq!(split_eval(&items, 0.6).1.len(), 56);
        assert_eq!(split_eval(&items, 0.9).1.len(), 85);
        assert_eq!(split_eval(&items, 0.5).1.len(), 47);
        let ten: Vec<usize> = (0..30).collect();
        assert_eq!(
            split_eval(&ten, 0.1).1,
            vec![9, 19, 29],
            "every 10th, as before"
        );
        assert_eq!(split_eval(&ten, 0.0).1.len(), 0);
    }
}

//! Rows: tokenized examples packed (or padded one to a row) into rows of `--seq` tokens, a held-out
//! share split off for evaluation, and each epoch's seeded order.

use crate::data::examples::Tokenized;
use crate::model::lora::SplitMix;
use anyhow::{bail, Result};

/// Fixed-length rows ready for batching.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub ids: Vec<i32>,
    pub labels: Vec<i32>,
    /// The program's `attention_mask`: 0 for padding, and for a real token 1 + the index in the
    /// row where its example starts (1 on every token of a row that holds one example).
    pub mask: Vec<i32>,
    /// With `--precompute-reference`: the row's completion log-probability under the DPO
    /// reference, computed once before training (None: not computed).
    pub reference: Option<f32>,
}

/// What making rows did to the examples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowReport {
    pub truncated: usize,
    pub dropped_empty: usize,
}

/// Pack examples end to end into rows of `seq` tokens (`pack`), or give each its own row padded
/// with `pad_id`. Examples longer than `seq` are truncated (counted), or an error if `strict`.
/// A packed example is its own document, as if it were alone in its row: it attends only to
/// itself, its positions start at 0 (its mask is 1 + where it starts), and the example before it
/// does not predict its first token (that label is -100).
pub fn make_rows(
    examples: &[Tokenized],
    seq: usize,
    pack: bool,
    pad_id: u32,
    strict: bool,
) -> Result<(Vec<Row>, RowReport)> {
    let mut report = RowReport::default();
    let mut rows = Vec::new();
    // The packed row being filled.
    let mut row = Row::default();
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
            let alone = Row {
                ids: e_ids,
                labels: e_labels,
                mask: vec![1; n],
                reference: None,
            };
            rows.push(finish_packed(alone, seq, pad_id));
            continue;
        }
        if row.ids.len() + e_ids.len() > seq {
            rows.push(finish_packed(std::mem::take(&mut row), seq, pad_id));
        }
        let start = row.ids.len();
        if start > 0 {
            e_labels[0] = -100;
        }
        row.mask
            .extend(std::iter::repeat_n(start as i32 + 1, e_ids.len()));
        row.ids.extend(e_ids);
        row.labels.extend(e_labels);
    }
    if !row.ids.is_empty() {
        rows.push(finish_packed(row, seq, pad_id));
    }
    Ok((rows, report))
}

fn finish_packed(mut row: Row, seq: usize, pad_id: u32) -> Row {
    row.ids.resize(seq, pad_id as i32);
    row.labels.resize(seq, -100);
    row.mask.resize(seq, 0);
    row
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
    use super::{make_rows, split_eval, Row};
    use crate::data::examples::Tokenized;
    use crate::model::lora::{LoraConfig, Projection};
    use crate::program::StepSpec;
    use crate::test_support::{assert_same, loss_and_grads_on, LossAndGrads};
    use hlo::DType;

    /// An example of `n` tokens whose first `prompt` are the prompt (no loss).
    fn example(n: usize, seed: usize, prompt: usize) -> Tokenized {
        let ids: Vec<u32> = (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 512) as u32)
            .collect();
        let labels = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| if i < prompt { -100 } else { t as i32 })
            .collect();
        Tokenized { ids, labels }
    }

    /// The tiny model's grads program (remat as given) on `rows` rows of 16 tokens.
    fn run(rows: &[Row], remat: crate::program::Remat) -> LossAndGrads {
        run_with(rows, remat, None)
    }

    /// [`run`] with attention over key/value blocks of `key_block` tokens.
    fn run_with(
        rows: &[Row],
        remat: crate::program::Remat,
        key_block: Option<i64>,
    ) -> LossAndGrads {
        let model = crate::model::presets::preset_config("tiny-llama3")
            .unwrap()
            .expect("the tiny-llama3 preset");
        let lora = LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: Projection::ALL.to_vec(),
        };
        let spec = StepSpec {
            remat,
            key_block,
            ..StepSpec::new(model, lora, rows.len() as i64, 16, DType::F32)
        };
        let cat = |f: fn(&Row) -> &Vec<i32>| rows.iter().flat_map(f).copied().collect::<Vec<_>>();
        loss_and_grads_on(
            &spec,
            &cat(|r| &r.ids),
            &cat(|r| &r.labels),
            &cat(|r| &r.mask),
        )
    }

    #[test]
    fn packed_examples_are_documents_of_their_own() {
        let (rows, _) =
            make_rows(&[example(5, 1, 2), example(7, 2, 0)], 16, true, 0, false).unwrap();
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        assert_eq!(row.mask, [vec![1; 5], vec![6; 7], vec![0; 4]].concat());
        assert_eq!(
            row.labels[5], -100,
            "the first example does not predict the second"
        );
        assert_eq!(row.labels[6..12], row.ids[6..12]);
        let (alone, _) = make_rows(&[example(5, 1, 2)], 16, false, 0, false).unwrap();
        assert_eq!(alone[0].mask, [vec![1; 5], vec![0; 11]].concat());
    }

    /// Three examples packed into one row give the loss and the gradients that the three,
    /// each alone in its row, give (f32; 1e-5, a few roundings of sums taken in another order):
    /// each attends only to itself, its positions start at 0, and the one before it does not
    /// predict its first token; with attention over every key at once and over key/value
    /// blocks. The same row as one document (positions running on, every example seeing the
    /// ones before it, as packing was before) does not.
    #[test]
    fn a_packed_row_computes_what_its_examples_alone_compute() {
        use crate::program::Remat;
        // Text (no prompt) and chats (a prompt): the first token of a text example is a label.
        let examples = [example(5, 1, 2), example(7, 2, 0), example(4, 3, 0)];
        let (packed, _) = make_rows(&examples, 16, true, 0, false).unwrap();
        assert_eq!(packed.len(), 1, "5 + 7 + 4 tokens fill one row of 16");
        let (alone, _) = make_rows(&examples, 16, false, 0, false).unwrap();
        let want = run(&alone, Remat::Layer);
        assert_same("packed", &run(&packed, Remat::Layer), &want, 1e-5);
        assert_same("packed, unrolled", &run(&packed, Remat::None), &want, 1e-5);
        // Over key/value blocks of 3 (the documents' edges inside blocks; padded to 18).
        let blocks = run_with(&packed, Remat::Layer, Some(3));
        assert_same("packed, key blocks of 3", &blocks, &want, 1e-5);
        let one_document = Row {
            mask: vec![1; 16],
            ..packed[0].clone()
        };
        let mixed = run(&[one_document], Remat::Layer);
        assert!(
            (mixed.0 - want.0).abs() > 1e-3,
            "one document over the row: loss {} against {}",
            mixed.0,
            want.0
        );
    }

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

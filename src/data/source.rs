//! Where a run's batches come from: one fixed batch, or rows visited epoch by epoch in a seeded
//! order; and the held-out rows cut into evaluation batches. [`load`] is the data stage of
//! `xtrain train`.

use crate::data::batch::Batch;
use crate::data::examples::{tokenize, Columns, Tokenized};
use crate::data::read::read_examples;
use crate::data::rows::{epoch_order, make_rows, split_eval, Row};
use crate::data::text::TextTokenizer;
use crate::model::config::LlamaConfig;
use anyhow::{bail, Context, Result};
use pjrt::HostTensor;
use std::path::{Path, PathBuf};

/// How `xtrain train` reads its data.
#[derive(Clone, Debug)]
pub struct DataOptions {
    /// `.safetensors` (one pre-tokenized batch used for every step), `.parquet` or JSONL (text
    /// data).
    pub path: PathBuf,
    /// Rows per step and tokens per row (JSONL data).
    pub batch_size: i64,
    pub seq: i64,
    pub pack: bool,
    pub train_on_prompt: bool,
    pub skip_bad_lines: bool,
    pub strict_length: bool,
    pub eval_fraction: f64,
    pub eval_data: Option<PathBuf>,
    /// The keys (JSONL) or columns (Parquet) of text and of chat messages.
    pub columns: Columns,
    /// Preference pairs (`--method dpo`): rows `{"prompt", "chosen", "rejected"}`, two rows each,
    /// never packed; `batch_size` counts pairs.
    pub pairs: bool,
}

impl DataOptions {
    /// Refuse sizes and fractions no run can use (before any work; the messages name the flags).
    pub fn validate(&self) -> Result<()> {
        if self.batch_size < 1 {
            bail!("--batch-size must be at least 1, got {}", self.batch_size);
        }
        if self.seq < 2 {
            bail!(
                "--seq must be at least 2 (a token and the next one it predicts), got {}",
                self.seq
            );
        }
        if !(0.0..1.0).contains(&self.eval_fraction) {
            bail!(
                "--eval-fraction must be in [0, 1), got {}",
                self.eval_fraction
            );
        }
        if self.eval_fraction > 0.0 && self.eval_data.is_some() {
            bail!("--eval-fraction and --eval-data were both given: evaluate on one or the other");
        }
        Ok(())
    }

    /// Whether the data is one pre-tokenized batch (a `.safetensors` file) rather than JSONL.
    pub fn is_batch_file(&self) -> bool {
        self.path.extension().is_some_and(|e| e == "safetensors")
    }
}

/// A run's data: where its batches come from, the evaluation batches, and the batch shape.
pub struct TrainingData {
    pub source: Source,
    pub eval_batches: Vec<Batch>,
    /// Rows per batch and tokens per row.
    pub batch: i64,
    pub seq: i64,
}

/// Read the training data for a model (its directory holds the tokenizer for text data): a
/// pre-tokenized batch file, or JSONL examples made into rows, with held-out evaluation batches.
pub fn load(opts: &DataOptions, model_dir: &Path, cfg: &LlamaConfig) -> Result<TrainingData> {
    if opts.pairs {
        return load_pairs(opts, &load_tokenizer(model_dir, cfg)?);
    }
    if opts.is_batch_file() {
        let (batch, notes) = Batch::read(&opts.path)?;
        batch
            .check_vocab(cfg.vocab_size)
            .map_err(|e| anyhow::anyhow!("{}: {e}", opts.path.display()))?;
        for n in notes {
            crate::esay!("xtrain: note: {n}");
        }
        let (rows, seq) = batch.dims();
        if opts.eval_fraction > 0.0 {
            bail!("--eval-fraction holds out JSONL examples; {} is one pre-tokenized batch (evaluate with --eval-data FILE.jsonl)", opts.path.display());
        }
        // Held-out JSONL examples, tokenized with the model's tokenizer into the batch's shape.
        let eval_batches = match &opts.eval_data {
            None => Vec::new(),
            Some(p) => {
                let tok = load_tokenizer(model_dir, cfg)?;
                let eval_ex = read_rows(p, &tok, opts)?;
                // The length is the batch's, not a --seq the user gave.
                let length = format!(
                    "the {seq} tokens of {}'s rows",
                    opts.path.file_name().unwrap_or_default().to_string_lossy()
                );
                let held_out = eval_rows(&eval_ex, p, opts, (seq as usize, &length), &tok)?;
                eval_batches(&held_out, rows as usize)
            }
        };
        return Ok(TrainingData {
            source: Source::Fixed(batch),
            eval_batches,
            batch: rows,
            seq,
        });
    }
    let tok = load_tokenizer(model_dir, cfg)?;
    let examples = read_rows(&opts.path, &tok, opts)?;
    let n_examples = examples.len();
    let (train_ex, eval_ex, eval_from) = match &opts.eval_data {
        Some(p) => (examples, read_rows(p, &tok, opts)?, p.clone()),
        None => {
            let (train, eval) = split_eval(&examples, opts.eval_fraction);
            if !eval.is_empty() {
                if train.is_empty() {
                    bail!(
                        "--eval-fraction {} holds out all {n_examples} examples of {}, leaving none to train on",
                        opts.eval_fraction,
                        opts.path.display()
                    );
                }
                crate::esay!(
                    "xtrain: holding out {} of {n_examples} examples for evaluation (--eval-fraction {})",
                    eval.len(),
                    opts.eval_fraction
                );
            }
            (train, eval, opts.path.clone())
        }
    };
    let seq = opts.seq as usize;
    let (rows, report) = make_rows(&train_ex, seq, opts.pack, tok.pad_id, opts.strict_length)
        .with_context(|| format!("{}", opts.path.display()))?;
    if report.truncated > 0 {
        crate::esay!(
            "xtrain: truncated {} examples to --seq {seq}",
            report.truncated
        );
    }
    if report.dropped_empty > 0 {
        crate::esay!(
            "xtrain: left out {} of {} training examples with no target token within --seq {seq}",
            report.dropped_empty,
            train_ex.len()
        );
    }
    if rows.len() < opts.batch_size as usize {
        bail!(
            "{} gives {} rows of {seq} tokens, fewer than one batch of {}",
            opts.path.display(),
            rows.len(),
            opts.batch_size
        );
    }
    let b = opts.batch_size as usize;
    Ok(TrainingData {
        source: Source::Rows {
            rows,
            batch: b,
            order: None,
            group: 1,
        },
        eval_batches: eval_batches(
            &eval_rows(
                &eval_ex,
                &eval_from,
                opts,
                (seq, &format!("--seq {seq}")),
                &tok,
            )?,
            b,
        ),
        batch: b as i64,
        seq: seq as i64,
    })
}

/// A preference run's data (`--method dpo`): pairs of rows, `batch_size` pairs a batch.
fn load_pairs(opts: &DataOptions, tok: &TextTokenizer) -> Result<TrainingData> {
    if opts.is_batch_file() {
        bail!(
            "--method dpo trains on preference pairs (JSONL or Parquet rows {{\"prompt\", \
             \"chosen\", \"rejected\"}}), but --data {} is one pre-tokenized batch",
            opts.path.display()
        );
    }
    let held_out = (opts.eval_data.as_deref(), opts.eval_fraction);
    let seq = opts.seq as usize;
    let (rows, eval_rows) = crate::data::pair_source::pair_rows(
        &opts.path,
        held_out,
        opts.skip_bad_lines,
        seq,
        opts.strict_length,
        tok,
    )?;
    let b = opts.batch_size as usize;
    if rows.len() / 2 < b {
        bail!(
            "{} gives {} preference pairs, fewer than one batch of {b} (--batch-size counts pairs)",
            opts.path.display(),
            rows.len() / 2
        );
    }
    let eval_batches = match eval_rows.is_empty() {
        true => Vec::new(),
        false => eval_batches(&eval_rows, 2 * b),
    };
    Ok(TrainingData {
        source: Source::Rows {
            rows,
            batch: b,
            order: None,
            group: 2,
        },
        eval_batches,
        batch: b as i64,
        seq: seq as i64,
    })
}

/// The model's tokenizer, checked to fit its vocabulary.
fn load_tokenizer(model_dir: &Path, cfg: &LlamaConfig) -> Result<TextTokenizer> {
    let tok = TextTokenizer::load(model_dir)?;
    if tok.vocab_size() as i64 > cfg.vocab_size {
        bail!(
            "the tokenizer has {} tokens but the model's vocabulary is {}",
            tok.vocab_size(),
            cfg.vocab_size
        );
    }
    Ok(tok)
}

/// Held-out examples as rows of `seq` tokens (the messages name that length as `length`: `--seq
/// 64`, or the length of a pre-tokenized batch's rows), one example per row (never packed, so
/// that accuracy is per example). An example cut to `seq` is counted and reported, or an error with
/// `--strict-length`; one with no target token left is left out and reported.
fn eval_rows(
    eval_ex: &[Tokenized],
    from: &Path,
    opts: &DataOptions,
    (seq, length): (usize, &str),
    tok: &TextTokenizer,
) -> Result<Vec<Row>> {
    if eval_ex.is_empty() {
        return Ok(Vec::new());
    }
    let (rows, report) = make_rows(eval_ex, seq, false, tok.pad_id, opts.strict_length)
        .with_context(|| format!("{} (evaluation examples)", from.display()))?;
    let n = eval_ex.len();
    if report.truncated > 0 {
        crate::esay!(
            "xtrain: eval: truncated {} of {n} examples to {length} (their loss and accuracy see only the first {seq} tokens; --strict-length refuses them)",
            report.truncated
        );
    }
    if report.dropped_empty > 0 {
        crate::esay!(
            "xtrain: eval: left out {} of {n} examples with no target token within {length}; evaluating on {}",
            report.dropped_empty,
            rows.len()
        );
    }
    if rows.is_empty() {
        bail!(
            "{}: none of the {n} evaluation examples has a target token within {length}",
            from.display()
        );
    }
    Ok(rows)
}

/// Held-out rows in batches of `b`, the last one padded by repeating its first row (the repeats'
/// labels are turned off, see [`mask_repeats`]).
fn eval_batches(eval_rows: &[Row], b: usize) -> Vec<Batch> {
    let batches: Vec<Batch> = eval_rows
        .chunks(b)
        .map(|c| {
            let mut refs: Vec<&Row> = c.iter().collect();
            while refs.len() < b {
                refs.push(&c[0]); // pad the last batch by repeating; repeated rows are skipped below
            }
            crate::data::batch(&refs)
        })
        .collect();
    mask_repeats(batches, eval_rows.len(), b)
}

/// Where the batches come from.
pub enum Source {
    /// One batch used for every step.
    Fixed(Batch),
    /// Rows visited epoch by epoch in a seeded order (the current epoch's order cached), in
    /// groups of `group` consecutive rows that stay together (2: a preference pair's chosen and
    /// rejected rows); `batch` counts groups.
    Rows {
        rows: Vec<Row>,
        batch: usize,
        order: Option<(u64, Vec<usize>)>,
        group: usize,
    },
}

impl Source {
    /// A fingerprint of what the batches are made of (sha256 of every row's tokens, labels and
    /// mask, in file order; hex), for a resumed run to check that its data is the same.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        match self {
            Source::Fixed(b) => {
                for t in [&b.input_ids, &b.labels, &b.attention_mask] {
                    h.update(&t.bytes);
                }
            }
            Source::Rows { rows, .. } => {
                let mut bytes = Vec::new();
                for r in rows {
                    bytes.clear();
                    for v in [&r.ids, &r.labels, &r.mask] {
                        bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
                    }
                    h.update(&bytes);
                }
            }
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Give each row its completion log-probability under the DPO reference (`logps`, one per
    /// row in file order), which its batches then carry.
    pub fn set_reference(&mut self, logps: &[f32]) -> Result<()> {
        let Source::Rows { rows, .. } = self else {
            bail!("the reference's log-probabilities are for rows of pairs, not a fixed batch");
        };
        if rows.len() != logps.len() {
            bail!(
                "{} reference log-probabilities for {} rows",
                logps.len(),
                rows.len()
            );
        }
        for (r, &l) in rows.iter_mut().zip(logps) {
            r.reference = Some(l);
        }
        Ok(())
    }

    /// Every row, in file order (a fixed batch: none).
    pub fn rows(&self) -> &[Row] {
        match self {
            Source::Fixed(_) => &[],
            Source::Rows { rows, .. } => rows,
        }
    }

    pub fn steps_per_epoch(&self) -> u64 {
        match self {
            Source::Fixed(_) => 1,
            Source::Rows {
                rows, batch, group, ..
            } => (rows.len() / group / batch).max(1) as u64,
        }
    }

    /// The batch at (epoch, position), and the position after it.
    pub fn next(&mut self, seed: u64, epoch: &mut u64, position: &mut u64) -> Batch {
        match self {
            Source::Fixed(b) => b.clone(),
            Source::Rows {
                rows,
                batch,
                order,
                group,
            } => {
                let groups = rows.len() / *group;
                if *position as usize + *batch > groups {
                    *epoch += 1;
                    *position = 0;
                }
                // The shuffle of an epoch is computed once, not at every step.
                if order.as_ref().is_none_or(|(e, _)| e != epoch) {
                    *order = Some((*epoch, epoch_order(groups, seed, *epoch)));
                }
                let ord = &order.as_ref().unwrap().1;
                let at = *position as usize;
                let picked: Vec<&Row> = ord[at..at + *batch]
                    .iter()
                    .flat_map(|&i| &rows[i * *group..(i + 1) * *group])
                    .collect();
                *position += *batch as u64;
                crate::data::batch(&picked)
            }
        }
    }
}

/// Read a JSONL or Parquet file's examples and tokenize them (bad lines skipped and reported
/// with `skip_bad_lines`; the loss on the prompt too with `train_on_prompt`).
fn read_rows(path: &Path, tok: &TextTokenizer, opts: &DataOptions) -> Result<Vec<Tokenized>> {
    let report = read_examples(path, opts.skip_bad_lines, &opts.columns)?;
    for note in &report.notes {
        crate::esay!("xtrain: {note}");
    }
    if let Some((at, reason)) = report.skipped.first() {
        let unit = report.unit;
        crate::esay!(
            "xtrain: skipped {} bad {unit}s of {} (first: {unit} {at}: {reason})",
            report.skipped.len(),
            path.display(),
        );
    }
    report
        .examples
        .iter()
        .map(|e| tokenize(tok, e, opts.train_on_prompt))
        .collect()
}

/// Eval batches padded by repeating rows: turn the repeats' labels off so they do not count.
fn mask_repeats(mut batches: Vec<Batch>, real_rows: usize, b: usize) -> Vec<Batch> {
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

//! The data stage of a preference run (`--method dpo`): pairs read and tokenized
//! (`data::pairs`), what that did to them said once, the held-out pairs, and the source of
//! batches of whole pairs (two rows each, chosen then rejected, never packed).

use crate::data::pairs::{pair_rows_of, read_pairs, Pair, PairReport, Place};
use crate::data::rows::{split_eval, Row};
use crate::data::text::TextTokenizer;
use anyhow::{bail, Result};
use std::path::Path;

/// A preference run's training and held-out pairs as rows (two each, chosen then rejected):
/// `path`'s pairs, and those of `eval_data` or else `eval_fraction` of `path`'s held out.
/// Rows have `seq` tokens; `strict`: a pair longer is refused instead of cut.
pub(crate) fn pair_rows(
    path: &Path,
    (eval_data, eval_fraction): (Option<&Path>, f64),
    skip_bad: bool,
    seq: usize,
    strict: bool,
    tok: &TextTokenizer,
) -> Result<(Vec<Row>, Vec<Row>)> {
    let pairs = read_reported(path, skip_bad)?;
    let n = pairs.len();
    let (train, eval) = match eval_data {
        Some(p) => (pairs, read_reported(p, skip_bad)?),
        None => {
            let (train, eval) = split_eval(&pairs, eval_fraction);
            if !eval.is_empty() {
                if train.is_empty() {
                    bail!(
                        "--eval-fraction {eval_fraction} holds out all {n} pairs of {}, leaving \
                         none to train on",
                        path.display()
                    );
                }
                crate::esay!(
                    "xtrain: holding out {} of {n} pairs for evaluation (--eval-fraction \
                     {eval_fraction})",
                    eval.len()
                );
            }
            (train, eval)
        }
    };
    let rows = rows_said(&train, tok, (seq, strict), "")?;
    let eval_rows = match eval.is_empty() {
        true => Vec::new(),
        false => rows_said(&eval, tok, (seq, strict), "eval: ")?,
    };
    Ok((rows, eval_rows))
}

/// A file's pairs, with the rows skipped by `--skip-bad-lines` said.
fn read_reported(path: &Path, skip_bad: bool) -> Result<Vec<(Place, Pair)>> {
    let read = read_pairs(path, skip_bad)?;
    if let Some((at, reason)) = read.skipped.first() {
        crate::esay!(
            "xtrain: skipped {} bad rows of {} (first: {at}: {reason})",
            read.skipped.len(),
            path.display(),
        );
    }
    Ok(read.pairs)
}

/// Pairs as rows of `--seq` tokens, with what that did said once (`what`: "" or "eval: ");
/// with `--strict-length` a pair longer than `--seq` is refused instead of truncated.
fn rows_said(
    pairs: &[(Place, Pair)],
    tok: &TextTokenizer,
    (seq, strict): (usize, bool),
    what: &str,
) -> Result<Vec<Row>> {
    let (rows, report) = pair_rows_of(pairs, tok, seq, strict)?;
    let n = pairs.len();
    let PairReport {
        truncated,
        same,
        prompt_cut,
    } = report;
    if truncated > 0 {
        crate::esay!(
            "xtrain: {what}truncated {truncated} of {n} pairs to --seq {seq} (prompt + \
             completion keeps its start, as TRL's keep_start; --strict-length refuses them)"
        );
    }
    if same > 0 {
        crate::esay!(
            "xtrain: warning: {what}{same} of {n} pairs have the same chosen and rejected \
             completion: their loss is constant and teaches nothing"
        );
    }
    if prompt_cut > 0 {
        crate::esay!(
            "xtrain: note: {what}in {prompt_cut} of {n} pairs the prompt alone tokenizes \
             otherwise than as the start of prompt + completion (the chat template renders it \
             differently, or tokens merge across the boundary): the completion starts where they \
             part, as TRL's does"
        );
    }
    Ok(rows)
}

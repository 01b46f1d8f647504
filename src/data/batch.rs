//! A batch as the programs take it: input_ids, labels and attention_mask, each s32 [B, T].

use crate::data::rows::Row;
use crate::formats::host::convert;
use crate::formats::safetensors::SafeTensors;
use anyhow::{bail, Context, Result};
use pjrt::{ElementType, HostTensor};
use std::path::Path;

/// One batch: input_ids, labels, attention_mask, each s32 [B, T].
#[derive(Clone, Debug)]
pub struct Batch {
    pub input_ids: HostTensor,
    pub labels: HostTensor,
    pub attention_mask: HostTensor,
    /// Each row's completion log-probability under the DPO reference [B] (f32), when the
    /// rows carry one (`--precompute-reference`).
    pub reference_logps: Option<HostTensor>,
}

impl Batch {
    pub fn dims(&self) -> (i64, i64) {
        (self.input_ids.dims[0], self.input_ids.dims[1])
    }

    /// Tokens that carry a loss: the labels of [`Batch::loss_labels`] that are not -100.
    pub fn target_tokens(&self) -> i64 {
        let labels = self.loss_labels().to_i32().unwrap_or_default();
        labels.iter().filter(|&&l| l != -100).count() as i64
    }

    /// The labels the step's loss sees: `labels` with -100 (no loss) wherever the token before
    /// is not of the same document: a row's first position, padding (`attention_mask` 0), the
    /// first token after padding, and a document's first token in a packed row (its mask value
    /// differs from the one before; see `data::rows`). A row's first token is never predicted,
    /// and the last token of one document does not predict the first of the next, whatever the
    /// labels say there: a user's `labels = input_ids` trains as Hugging Face's
    /// `DataCollatorWithFlattening` (which writes -100 there) does. Every batch the trainer runs
    /// goes through here.
    pub fn loss_labels(&self) -> HostTensor {
        let (Ok(labels), Ok(mask)) = (self.labels.to_i32(), self.attention_mask.to_i32()) else {
            return self.labels.clone();
        };
        let t = self.dims().1 as usize;
        let masked: Vec<i32> = labels
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let same_document = i % t != 0 && mask[i] != 0 && mask[i] == mask[i - 1];
                if same_document {
                    l
                } else {
                    -100
                }
            })
            .collect();
        HostTensor::from_i32(&masked, &self.labels.dims)
    }

    /// Read a pre-tokenized batch (`input_ids`, `labels`, optional `attention_mask`) from a
    /// safetensors file; integer types are converted to s32.
    pub fn from_safetensors(path: &Path) -> Result<Batch> {
        Ok(Batch::read(path)?.0)
    }

    /// [`Batch::from_safetensors`], with what the run should say about the file: that it has no
    /// `attention_mask` (taken as all ones), and how many of its labels carry no loss because
    /// of where they are (see [`Batch::loss_labels`]).
    pub fn read(path: &Path) -> Result<(Batch, Vec<String>)> {
        let st = SafeTensors::open(path)?;
        let get = |name: &str| -> Result<HostTensor> {
            let t = st.read(name)?;
            if t.dims.len() != 2 {
                bail!(
                    "{}: `{name}` must be [batch, seq], found {:?}",
                    path.display(),
                    t.dims
                );
            }
            use ElementType::{S32, S64, S8, U32, U8};
            if !matches!(t.ty, S64 | S32 | U32 | S8 | U8) {
                bail!(
                    "{}: `{name}` holds {} values, but token ids, labels and attention masks are \
                     whole numbers: save it as I64 (torch.long) or I32",
                    path.display(),
                    crate::formats::safetensors::dtype_name(t.ty)
                );
            }
            convert(&t, S32).with_context(|| format!("{}: `{name}`", path.display()))
        };
        let input_ids = get("input_ids")?;
        let labels = if st.tensors.contains_key("labels") {
            get("labels")?
        } else {
            input_ids.clone()
        };
        let mut notes = Vec::new();
        let attention_mask = if st.tensors.contains_key("attention_mask") {
            get("attention_mask")?
        } else {
            notes.push(format!(
                "{} has no `attention_mask`: taken as all ones (every token real, one document \
                 per row)",
                path.display()
            ));
            HostTensor::from_i32(&vec![1; input_ids.element_count()], &input_ids.dims)
        };
        for (name, t) in [("labels", &labels), ("attention_mask", &attention_mask)] {
            if t.dims != input_ids.dims {
                bail!(
                    "{}: `{name}` is {:?} but `input_ids` is {:?}",
                    path.display(),
                    t.dims,
                    input_ids.dims
                );
            }
        }
        check_documents(&attention_mask.to_i32()?, input_ids.dims[1] as usize)
            .map_err(|e| anyhow::anyhow!("{}: `attention_mask` {e}", path.display()))?;
        let batch = Batch {
            input_ids,
            labels,
            attention_mask,
            reference_logps: None,
        };
        let (given, trained) = (batch.given_targets(), batch.target_tokens());
        if given > trained {
            notes.push(format!(
                "{}: {} of its {given} labels after a row's first position are at a document's \
                 first token or on padding (by `attention_mask`): they carry no loss, since no \
                 token of the same document predicts them",
                path.display(),
                given - trained
            ));
        }
        Ok((batch, notes))
    }

    /// Labels after each row's first position that are not -100.
    fn given_targets(&self) -> i64 {
        let labels = self.labels.to_i32().unwrap_or_default();
        let t = self.dims().1 as usize;
        labels
            .iter()
            .enumerate()
            .filter(|(i, &l)| i % t != 0 && l != -100)
            .count() as i64
    }

    /// Check token ids and labels against the vocabulary (a label may also be -100, no loss),
    /// and that some position carries a loss.
    pub fn check_vocab(&self, vocab: i64) -> Result<()> {
        let t = self.dims().1 as usize;
        let ids = self.input_ids.to_i32()?;
        if let Some((i, &bad)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as i64 >= vocab)
        {
            bail!("token id {bad} at batch row {}, position {} is outside the vocabulary (0..{vocab})", i / t, i % t);
        }
        let labels = self.labels.to_i32()?;
        if let Some((i, &bad)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l != -100 && (l < 0 || l as i64 >= vocab))
        {
            bail!(
                "label {bad} at batch row {}, position {} is neither a token of the vocabulary \
                 (0..{vocab}) nor -100 (no loss)",
                i / t,
                i % t
            );
        }
        if self.target_tokens() == 0 {
            bail!(
                "no position carries a loss: every label after each row's first position is -100, \
                 on padding (`attention_mask` 0) or at a document's first token (the first \
                 token of a row or of a document is never predicted)"
            );
        }
        Ok(())
    }
}

/// An attention mask's values are 0 (padding) or 1 + where the token's document starts in its
/// row (see `data::rows`): 1 (a row of one document, as Hugging Face's masks are, after padding
/// or another 1), the position + 1 where a document starts, or the value before it, where it
/// goes on.
fn check_documents(mask: &[i32], seq: usize) -> std::result::Result<(), String> {
    for (row, values) in mask.chunks(seq).enumerate() {
        for (t, &v) in values.iter().enumerate() {
            let before = if t > 0 { values[t - 1] } else { 0 };
            let one_document = v == 1 && before <= 1;
            if v == 0 || one_document || v == t as i32 + 1 || (t > 0 && v == before) {
                continue;
            }
            let mut allowed = vec!["0 (padding)".to_string()];
            if before <= 1 {
                allowed.push("1".into());
            }
            allowed.push(format!("{} (a document starting there)", t + 1));
            if before > 1 {
                allowed.push(format!("{before} (its document going on)"));
            }
            let last = allowed.pop().expect("two at least");
            let why = if v == 1 {
                format!(
                    " (1 marks a document starting at the row's first token, which cannot \
                     start again after the document starting at position {} has)",
                    before - 1
                )
            } else {
                String::new()
            };
            return Err(format!(
                "holds {v} at row {row}, position {t}: expected {} or {last}{why}",
                allowed.join(", ")
            ));
        }
    }
    Ok(())
}

/// Stack rows into a batch.
pub fn batch(rows: &[&Row]) -> Batch {
    let (b, t) = (rows.len() as i64, rows[0].ids.len() as i64);
    let cat = |f: fn(&Row) -> &Vec<i32>| {
        rows.iter()
            .flat_map(|r| f(r).iter().copied())
            .collect::<Vec<i32>>()
    };
    let reference: Option<Vec<f32>> = rows.iter().map(|r| r.reference).collect();
    Batch {
        input_ids: HostTensor::from_i32(&cat(|r| &r.ids), &[b, t]),
        labels: HostTensor::from_i32(&cat(|r| &r.labels), &[b, t]),
        attention_mask: HostTensor::from_i32(&cat(|r| &r.mask), &[b, t]),
        reference_logps: reference.map(|v| HostTensor::from_f32(&v, &[b])),
    }
}

#[cfg(test)]
mod tests {
    use super::{check_documents, Batch};
    use pjrt::HostTensor;

    fn batch(ids: &[i32], labels: &[i32], mask: &[i32], t: i64) -> Batch {
        let dims = [ids.len() as i64 / t, t];
        Batch {
            input_ids: HostTensor::from_i32(ids, &dims),
            labels: HostTensor::from_i32(labels, &dims),
            attention_mask: HostTensor::from_i32(mask, &dims),
            reference_logps: None,
        }
    }

    /// `labels = input_ids` on packed rows: a document's first token (row 0, position 3; row 1,
    /// position 4), padding (row 0's end, row 1's start) and the first token after padding
    /// (row 1, position 2) carry no loss, as Hugging Face's `DataCollatorWithFlattening` writes
    /// -100 there; -100 given elsewhere stays.
    #[test]
    fn labels_at_a_documents_first_token_or_on_padding_carry_no_loss() {
        let ids: Vec<i32> = (10..22).collect();
        let mut labels = ids.clone();
        labels[8] = -100;
        let mask = [1, 1, 1, 4, 4, 0, 0, 0, 3, 3, 5, 5];
        let b = batch(&ids, &labels, &mask, 6);
        let got = b.loss_labels().to_i32().unwrap();
        let n = -100;
        assert_eq!(got, [n, 11, 12, n, 14, n, n, n, n, 19, n, 21]);
        assert_eq!(b.target_tokens(), 5);
        assert_eq!(b.given_targets(), 9);
    }

    /// A batch whose only labels are on padding or at documents' first tokens has no target:
    /// refused as having no loss (it trained on them).
    #[test]
    fn a_batch_whose_labels_are_all_on_padding_or_document_starts_has_no_loss() {
        let ids = [5, 6, 7, 8, 9, 10];
        let b = batch(&ids, &ids, &[1, 2, 3, 0, 0, 0], 6);
        let e = b.check_vocab(32).unwrap_err().to_string();
        assert!(e.contains("no position carries a loss"), "{e}");
    }

    #[test]
    fn masks_of_one_document_and_of_packed_documents_are_taken() {
        for mask in [
            [1, 1, 1, 1, 1, 0],
            [0, 0, 1, 1, 1, 1],
            [1, 1, 3, 3, 5, 0],
            [1, 2, 2, 4, 4, 4],
        ] {
            assert_eq!(check_documents(&mask, 6), Ok(()), "{mask:?}");
        }
    }

    #[test]
    fn a_mask_value_that_is_no_document_start_is_refused_naming_row_and_position() {
        let e = check_documents(&[1, 1, 1, 1, 1, 1, 1, 1, 7, 7], 5).unwrap_err();
        assert!(
            e.contains("holds 7 at row 1, position 3") && e.contains("expected 0"),
            "{e}"
        );
        // The refused value is not among those the message allows.
        let e = check_documents(&[1, 1, 3, 3, 1, 1], 6).unwrap_err();
        assert_eq!(
            e,
            "holds 1 at row 0, position 4: expected 0 (padding), 5 (a document starting there) \
             or 3 (its document going on) (1 marks a document starting at the row's first \
             token, which cannot start again after the document starting at position 2 has)"
        );
        assert!(check_documents(&[-1, 0], 2).is_err());
    }
}

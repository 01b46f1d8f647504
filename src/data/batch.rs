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
}

impl Batch {
    pub fn dims(&self) -> (i64, i64) {
        (self.input_ids.dims[0], self.input_ids.dims[1])
    }

    /// Tokens that carry a loss (labels != -100, excluding the first position).
    pub fn target_tokens(&self) -> i64 {
        let labels = self.labels.to_i32().unwrap_or_default();
        let t = self.dims().1 as usize;
        labels
            .iter()
            .enumerate()
            .filter(|(i, &l)| i % t != 0 && l != -100)
            .count() as i64
    }

    /// Read a pre-tokenized batch (`input_ids`, `labels`, optional `attention_mask`) from a
    /// safetensors file; integer types are converted to s32.
    pub fn from_safetensors(path: &Path) -> Result<Batch> {
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
            convert(&t, ElementType::S32).with_context(|| format!("{}: `{name}`", path.display()))
        };
        let input_ids = get("input_ids")?;
        let labels = if st.tensors.contains_key("labels") {
            get("labels")?
        } else {
            input_ids.clone()
        };
        let attention_mask = if st.tensors.contains_key("attention_mask") {
            get("attention_mask")?
        } else {
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
        Ok(Batch {
            input_ids,
            labels,
            attention_mask,
        })
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
                "no position carries a loss: every label after each row's first position is -100 \
                 (the first position's label is never predicted)"
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
            if !(v == 0 || one_document || v == t as i32 + 1 || (t > 0 && v == before)) {
                return Err(format!(
                    "holds {v} at row {row}, position {t}: expected 0 (padding), 1, {} (a \
                     document starting there) or the value before it (its document going on)",
                    t + 1
                ));
            }
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
    Batch {
        input_ids: HostTensor::from_i32(&cat(|r| &r.ids), &[b, t]),
        labels: HostTensor::from_i32(&cat(|r| &r.labels), &[b, t]),
        attention_mask: HostTensor::from_i32(&cat(|r| &r.mask), &[b, t]),
    }
}

#[cfg(test)]
mod tests {
    use super::check_documents;

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
        let e = check_documents(&[1, 1, 3, 3, 1, 1], 6).unwrap_err();
        assert!(e.contains("holds 1 at row 0, position 4"), "{e}");
        assert!(check_documents(&[-1, 0], 2).is_err());
    }
}

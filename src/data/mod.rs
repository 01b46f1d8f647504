//! Training data: JSONL or Parquet files of `{"text"}`, alpaca `{"instruction","input","output"}` or chat
//! `{"messages":[{"role","content"}]}` rows, rendered with the model's chat template, tokenized,
//! with the loss on the response tokens only (by default), packed or padded into fixed-length
//! rows, shuffled with a seed, and cut into batches; or one pre-tokenized batch from a
//! safetensors file. [`load`] is the data stage of a run. It may use `formats` and `model`; its
//! API is what this file exports, the files behind it are its stages.

mod batch;
mod examples;
mod pair_source;
pub mod pairs;
mod parquet_rows;
mod read;
mod rows;
mod source;
pub mod text;

pub use batch::{batch, Batch};
pub use examples::{tokenize, Columns, Example, ReadReport, Tokenized};
pub use read::{read_examples, read_jsonl};
pub use rows::{epoch_order, make_rows, split_eval, Row, RowReport};
pub use source::{load, DataOptions, Source, TrainingData};

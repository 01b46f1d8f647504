//! GGUF, llama.cpp's file format, both ways. The tables hold each fact of the format once:
//! [`ggml`] (tensor types and their layouts, metadata value types, token types, metadata keys)
//! and [`arch`] (per architecture: tensor names, the q/k row order, hyperparameter keys against
//! config.json's fields). On them stand, none importing another but as shown: [`read`] (the
//! container, with [`kquants`] for the K-quant blocks), [`write`] (the container and its block
//! encodings), [`vocab`] (a tokenizer both ways, with [`spm`] for SentencePiece-style
//! vocabularies; it uses `read`'s and `write`'s values),
//! [`import`] (a GGUF file as a Hugging Face model directory; `read`, `vocab`) and [`export`]
//! (a model, merged with an adapter or the adapter alone, as GGUF; `write`, `vocab`).

pub mod arch;
pub mod export;
pub mod ggml;
pub mod import;
pub mod kquants;
pub mod read;
pub mod spm;
pub mod vocab;
pub mod write;

//! ggml's tables, the one home of each number the GGUF format fixes: the tensor types (id, name,
//! and for the types xtrain reads the block size and bytes per block), the metadata value types,
//! llama.cpp's token types, and the metadata keys xtrain reads and writes. The reader, the
//! writer, the importer, the exporter and the vocabulary all take them from here.

/// ggml's id of each tensor type named here (ggml.h's `enum ggml_type`).
pub const F32: u32 = 0;
pub const F16: u32 = 1;
pub const Q4_0: u32 = 2;
pub const Q4_1: u32 = 3;
pub const Q5_0: u32 = 6;
pub const Q5_1: u32 = 7;
pub const Q8_0: u32 = 8;
pub const Q2_K: u32 = 10;
pub const Q3_K: u32 = 11;
pub const Q4_K: u32 = 12;
pub const Q5_K: u32 = 13;
pub const Q6_K: u32 = 14;
pub const BF16: u32 = 30;

/// Values per K-quant super-block.
pub const QK_K: u64 = 256;

/// How a tensor type lays out its values: blocks of `block` values in `bytes` bytes each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub block: u64,
    pub bytes: u64,
}

/// A ggml tensor type: its id, ggml's name, and its layout where xtrain reads the type (`None`:
/// named in messages only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    pub layout: Option<Layout>,
}

const fn read(id: u32, name: &'static str, block: u64, bytes: u64) -> GgmlType {
    GgmlType {
        id,
        name,
        layout: Some(Layout { block, bytes }),
    }
}

const fn named(id: u32, name: &'static str) -> GgmlType {
    GgmlType {
        id,
        name,
        layout: None,
    }
}

/// Every ggml type xtrain knows, by id.
pub const TYPES: &[GgmlType] = &[
    read(F32, "F32", 1, 4),
    read(F16, "F16", 1, 2),
    read(Q4_0, "Q4_0", 32, 18),
    read(Q4_1, "Q4_1", 32, 20),
    read(Q5_0, "Q5_0", 32, 22),
    read(Q5_1, "Q5_1", 32, 24),
    read(Q8_0, "Q8_0", 32, 34),
    named(9, "Q8_1"),
    read(Q2_K, "Q2_K", QK_K, 84),
    read(Q3_K, "Q3_K", QK_K, 110),
    read(Q4_K, "Q4_K", QK_K, 144),
    read(Q5_K, "Q5_K", QK_K, 176),
    read(Q6_K, "Q6_K", QK_K, 210),
    named(15, "Q8_K"),
    named(16, "IQ2_XXS"),
    named(17, "IQ2_XS"),
    named(18, "IQ3_XXS"),
    named(19, "IQ1_S"),
    named(20, "IQ4_NL"),
    named(21, "IQ3_S"),
    named(22, "IQ2_S"),
    named(23, "IQ4_XS"),
    named(24, "I8"),
    named(25, "I16"),
    named(26, "I32"),
    named(27, "I64"),
    named(28, "F64"),
    named(29, "IQ1_M"),
    read(BF16, "BF16", 1, 2),
    named(34, "TQ1_0"),
    named(35, "TQ2_0"),
    named(39, "MXFP4"),
];

/// The type of id `id`, if xtrain knows it.
pub fn ggml_type(id: u32) -> Option<&'static GgmlType> {
    TYPES.iter().find(|t| t.id == id)
}

/// The layout of type `id`, if xtrain reads it.
pub fn layout(id: u32) -> Option<Layout> {
    ggml_type(id).and_then(|t| t.layout)
}

/// The names of the types xtrain reads, in id order.
pub fn read_type_names() -> Vec<&'static str> {
    TYPES
        .iter()
        .filter(|t| t.layout.is_some())
        .map(|t| t.name)
        .collect()
}

/// The type of a metadata value (gguf's `gguf_type`), as the reader and the writer code it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    Str,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::Str,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The code in the file.
    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn from_id(id: u32) -> Option<ValueType> {
        ValueType::ALL.get(id as usize).copied()
    }
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_UNKNOWN: i32 = 2;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;
pub const TOKEN_BYTE: i32 = 6;

/// The metadata keys xtrain reads or writes, outside an architecture's own (see [`arch_key`]).
pub mod key {
    pub const ARCHITECTURE: &str = "general.architecture";
    pub const TYPE: &str = "general.type";
    pub const NAME: &str = "general.name";
    pub const BASENAME: &str = "general.basename";
    /// config.json's `model_type`, which xtrain writes where llama.cpp's architecture holds
    /// more than one family (Mistral is written as `llama`); llama.cpp ignores it.
    pub const MODEL_TYPE: &str = "xtrain.model_type";
    pub const FILE_TYPE: &str = "general.file_type";
    pub const QUANTIZATION_VERSION: &str = "general.quantization_version";
    pub const ALIGNMENT: &str = "general.alignment";
    pub const ADAPTER_TYPE: &str = "adapter.type";
    pub const ADAPTER_LORA_ALPHA: &str = "adapter.lora.alpha";
    pub const TOKENIZER_MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const SCORES: &str = "tokenizer.ggml.scores";
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
    pub const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
    pub const EOT_ID: &str = "tokenizer.ggml.eot_token_id";
    pub const UNKNOWN_ID: &str = "tokenizer.ggml.unknown_token_id";
    pub const PADDING_ID: &str = "tokenizer.ggml.padding_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
    pub const CHAT_TEMPLATE: &str = "tokenizer.chat_template";
}

/// The keys of an architecture's hyperparameters, after its name (`llama.block_count`).
pub mod hparam {
    pub const VOCAB_SIZE: &str = "vocab_size";
    pub const CONTEXT_LENGTH: &str = "context_length";
    pub const EMBEDDING_LENGTH: &str = "embedding_length";
    pub const BLOCK_COUNT: &str = "block_count";
    pub const FEED_FORWARD_LENGTH: &str = "feed_forward_length";
    pub const ROPE_DIMENSION_COUNT: &str = "rope.dimension_count";
    pub const ROPE_FREQ_BASE: &str = "rope.freq_base";
    pub const ROPE_SCALING_TYPE: &str = "rope.scaling.type";
    pub const HEAD_COUNT: &str = "attention.head_count";
    pub const HEAD_COUNT_KV: &str = "attention.head_count_kv";
    pub const KEY_LENGTH: &str = "attention.key_length";
    pub const VALUE_LENGTH: &str = "attention.value_length";
    pub const RMS_EPS: &str = "attention.layer_norm_rms_epsilon";
}

/// The key of hyperparameter `hparam` (one of [`hparam`]'s) in architecture `arch`.
pub fn arch_key(arch: &str, hparam: &str) -> String {
    format!("{arch}.{hparam}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tables_hold_each_id_once_and_value_types_round_trip() {
        let mut ids: Vec<u32> = TYPES.iter().map(|t| t.id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), TYPES.len());
        for v in ValueType::ALL {
            assert_eq!(ValueType::from_id(v.id()), Some(v));
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::Array.id(), 9);
        assert_eq!(ValueType::F64.id(), 12);
        assert_eq!(
            layout(Q6_K),
            Some(Layout {
                block: 256,
                bytes: 210
            })
        );
        assert_eq!(layout(16), None);
    }
}

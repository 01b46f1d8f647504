//! How the step's numbers are stored and computed: the element type (`--dtype`), the frozen
//! weights' quantization ([`Quant`]) and the types of intermediate results ([`ResultType`]),
//! with how specs and manifests write them (serde, and the names earlier manifests used).

use anyhow::{bail, Result};
use hlo::DType;

/// `--quant`: the frozen projections as the checkpoint has them, or as NF4 (QLoRA).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Quant {
    #[default]
    None,
    Nf4,
}

impl Quant {
    /// `--quant` as given.
    pub fn parse(s: &str) -> Result<Quant> {
        match s {
            "none" => Ok(Quant::None),
            "nf4" => Ok(Quant::Nf4),
            other => bail!("--quant must be nf4 or none, got `{other}`"),
        }
    }

    /// The `--quant` value that gives this.
    pub fn name(self) -> &'static str {
        match self {
            Quant::None => "none",
            Quant::Nf4 => "nf4",
        }
    }

    pub fn is_nf4(self) -> bool {
        self == Quant::Nf4
    }
}

/// The element type an intermediate result is given in: f32, or the step's compute type (bf16
/// with `--dtype bf16`; with f32 compute both are f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResultType {
    F32,
    Compute,
}

impl ResultType {
    pub(super) fn f32() -> ResultType {
        ResultType::F32
    }

    pub(super) fn compute() -> ResultType {
        ResultType::Compute
    }

    /// The type a result given as `self` has with compute type `dtype`: with f32 compute, f32
    /// and compute are one type, said as f32.
    pub fn in_effect(self, dtype: DType) -> ResultType {
        if dtype == DType::F32 {
            ResultType::F32
        } else {
            self
        }
    }

    /// The element type it is with compute type `compute`.
    pub fn dtype(self, compute: DType) -> DType {
        match self {
            ResultType::F32 => DType::F32,
            ResultType::Compute => compute,
        }
    }

    /// `--matmul-result` or `--attention-scores` (named by `flag`) as given.
    pub fn parse(flag: &str, s: &str) -> Result<ResultType> {
        match s {
            "f32" => Ok(ResultType::F32),
            "compute" => Ok(ResultType::Compute),
            other => bail!("--{flag} must be f32 or compute, got `{other}`"),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            ResultType::F32 => "f32",
            ResultType::Compute => "compute",
        }
    }
}

/// `--matmul-result`'s default, for every target.
pub const DEFAULT_MATMUL_RESULT: ResultType = ResultType::F32;
/// `--attention-scores`' default, for every target.
pub const DEFAULT_ATTENTION_SCORES: ResultType = ResultType::Compute;

/// `--dtype` as given.
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        other => bail!("--dtype must be f32 or bf16, got `{other}`"),
    }
}

/// Element types in specs and manifests are written as MLIR names (`f32`, `bf16`, `ui8`).
pub(in crate::program) fn ser_dtype<S: serde::Serializer>(
    d: &DType,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.mlir())
}

pub(in crate::program) fn de_dtype<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<DType, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    DType::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown element type `{s}`")))
}

/// `quant`, or an earlier manifest's `nf4` (true or false).
pub(super) fn de_quant<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Quant, D::Error> {
    use serde::Deserialize;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Written {
        Nf4(bool),
        Quant(Quant),
    }
    Ok(match Written::deserialize(d)? {
        Written::Nf4(true) => Quant::Nf4,
        Written::Nf4(false) => Quant::None,
        Written::Quant(q) => q,
    })
}

/// A result type, or an earlier manifest's bool that said it (`wide_matmul_results: true` is
/// f32, `narrow_attention_scores: true` the compute type); `yes` is the type a true said.
fn de_result_type<'de, D: serde::Deserializer<'de>>(
    d: D,
    yes: ResultType,
    no: ResultType,
) -> std::result::Result<ResultType, D::Error> {
    use serde::Deserialize;
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Written {
        Said(bool),
        Type(ResultType),
    }
    Ok(match Written::deserialize(d)? {
        Written::Said(true) => yes,
        Written::Said(false) => no,
        Written::Type(t) => t,
    })
}

pub(super) fn de_matmul_result<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<ResultType, D::Error> {
    de_result_type(d, ResultType::F32, ResultType::Compute)
}

pub(super) fn de_attention_scores<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<ResultType, D::Error> {
    de_result_type(d, ResultType::Compute, ResultType::F32)
}

//! Host-side tensors: bytes in row-major order plus an element type and dimensions.

use crate::{Error, Result};
use half::{bf16, f16};

/// Element types xtrain moves between host and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    Pred,
    S8,
    S32,
    S64,
    U8,
    U16,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
}

impl ElementType {
    pub fn size_bytes(self) -> usize {
        match self {
            ElementType::Pred | ElementType::S8 | ElementType::U8 => 1,
            ElementType::U16 | ElementType::F16 | ElementType::BF16 => 2,
            ElementType::S32 | ElementType::U32 | ElementType::F32 => 4,
            ElementType::S64 | ElementType::U64 | ElementType::F64 => 8,
        }
    }

    pub fn byte_size(self, elements: usize) -> usize {
        self.size_bytes() * elements
    }

    /// `PJRT_Buffer_Type` enum value.
    pub fn pjrt_code(self) -> i32 {
        match self {
            ElementType::Pred => 1,
            ElementType::S8 => 2,
            ElementType::S32 => 4,
            ElementType::S64 => 5,
            ElementType::U8 => 6,
            ElementType::U16 => 7,
            ElementType::U32 => 8,
            ElementType::U64 => 9,
            ElementType::F16 => 10,
            ElementType::F32 => 11,
            ElementType::F64 => 12,
            ElementType::BF16 => 13,
        }
    }

    pub fn from_pjrt_code(code: i32) -> Option<Self> {
        Some(match code {
            1 => ElementType::Pred,
            2 => ElementType::S8,
            4 => ElementType::S32,
            5 => ElementType::S64,
            6 => ElementType::U8,
            7 => ElementType::U16,
            8 => ElementType::U32,
            9 => ElementType::U64,
            10 => ElementType::F16,
            11 => ElementType::F32,
            12 => ElementType::F64,
            13 => ElementType::BF16,
            _ => return None,
        })
    }
}

/// A dense row-major tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub ty: ElementType,
    pub dims: Vec<i64>,
    pub bytes: Vec<u8>,
}

macro_rules! typed_access {
    ($from:ident, $to:ident, $t:ty, $et:expr) => {
        pub fn $from(values: &[$t], dims: &[i64]) -> HostTensor {
            HostTensor::check_count(values.len(), dims);
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            HostTensor {
                ty: $et,
                dims: dims.to_vec(),
                bytes,
            }
        }

        pub fn $to(&self) -> Result<Vec<$t>> {
            self.expect_type($et)?;
            const N: usize = std::mem::size_of::<$t>();
            Ok(self
                .bytes
                .chunks_exact(N)
                .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                .collect())
        }
    };
}

impl HostTensor {
    fn check_count(len: usize, dims: &[i64]) {
        let n: i64 = dims.iter().product();
        assert_eq!(
            len as i64, n,
            "HostTensor: {len} values do not fill dims {dims:?}"
        );
    }

    pub fn element_count(&self) -> usize {
        self.dims.iter().product::<i64>() as usize
    }

    fn expect_type(&self, ty: ElementType) -> Result<()> {
        if self.ty != ty {
            return Err(Error::Invalid(format!(
                "tensor has element type {:?}, read as {:?}",
                self.ty, ty
            )));
        }
        Ok(())
    }

    typed_access!(from_f32, to_f32, f32, ElementType::F32);
    typed_access!(from_f64, to_f64, f64, ElementType::F64);
    typed_access!(from_i32, to_i32, i32, ElementType::S32);
    typed_access!(from_i64, to_i64, i64, ElementType::S64);
    typed_access!(from_u32, to_u32, u32, ElementType::U32);
    typed_access!(from_i8, to_i8, i8, ElementType::S8);
    typed_access!(from_u8, to_u8, u8, ElementType::U8);
    typed_access!(from_bf16, to_bf16, bf16, ElementType::BF16);
    typed_access!(from_f16, to_f16, f16, ElementType::F16);

    pub fn from_pred(values: &[bool], dims: &[i64]) -> HostTensor {
        HostTensor::check_count(values.len(), dims);
        HostTensor {
            ty: ElementType::Pred,
            dims: dims.to_vec(),
            bytes: values.iter().map(|&b| b as u8).collect(),
        }
    }

    pub fn to_pred(&self) -> Result<Vec<bool>> {
        self.expect_type(ElementType::Pred)?;
        Ok(self.bytes.iter().map(|&b| b != 0).collect())
    }

    /// Any floating tensor widened to f32 (for comparisons and printing).
    pub fn to_f32_lossy(&self) -> Result<Vec<f32>> {
        Ok(match self.ty {
            ElementType::F32 => self.to_f32()?,
            ElementType::F64 => self.to_f64()?.iter().map(|&v| v as f32).collect(),
            ElementType::BF16 => self.to_bf16()?.iter().map(|v| v.to_f32()).collect(),
            ElementType::F16 => self.to_f16()?.iter().map(|v| v.to_f32()).collect(),
            ElementType::S32 => self.to_i32()?.iter().map(|&v| v as f32).collect(),
            ElementType::S64 => self.to_i64()?.iter().map(|&v| v as f32).collect(),
            other => return Err(Error::Invalid(format!("cannot widen {other:?} to f32"))),
        })
    }

    /// A scalar f32 tensor's value.
    pub fn scalar_f32(&self) -> Result<f32> {
        let v = self.to_f32_lossy()?;
        if v.len() != 1 {
            return Err(Error::Invalid(format!(
                "expected a scalar, found dims {:?}",
                self.dims
            )));
        }
        Ok(v[0])
    }
}

//! Element types and tensor types, printed the way StableHLO spells them (`tensor<2x3xbf16>`).

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
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

impl DType {
    /// The MLIR element type name.
    pub fn mlir(self) -> &'static str {
        match self {
            DType::Pred => "i1",
            DType::S8 => "i8",
            DType::S32 => "i32",
            DType::S64 => "i64",
            DType::U8 => "ui8",
            DType::U16 => "ui16",
            DType::U32 => "ui32",
            DType::U64 => "ui64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    pub fn is_signed_int(self) -> bool {
        matches!(self, DType::S8 | DType::S32 | DType::S64)
    }

    pub fn is_unsigned_int(self) -> bool {
        matches!(self, DType::U8 | DType::U16 | DType::U32 | DType::U64)
    }

    pub fn is_int(self) -> bool {
        self.is_signed_int() || self.is_unsigned_int()
    }

    pub fn bits(self) -> usize {
        match self {
            DType::Pred | DType::S8 | DType::U8 => 8,
            DType::U16 | DType::F16 | DType::BF16 => 16,
            DType::S32 | DType::U32 | DType::F32 => 32,
            DType::S64 | DType::U64 | DType::F64 => 64,
        }
    }

    pub fn size_bytes(self) -> usize {
        self.bits() / 8
    }

    /// Parse a name as users and files write it: `f32`, `bf16`, `float32`, `int64`, ...
    pub fn parse(name: &str) -> Option<DType> {
        Some(match name.to_ascii_lowercase().as_str() {
            "pred" | "bool" | "i1" => DType::Pred,
            "s8" | "i8" | "int8" => DType::S8,
            "s32" | "i32" | "int32" => DType::S32,
            "s64" | "i64" | "int64" => DType::S64,
            "u8" | "ui8" | "uint8" => DType::U8,
            "u16" | "ui16" | "uint16" => DType::U16,
            "u32" | "ui32" | "uint32" => DType::U32,
            "u64" | "ui64" | "uint64" => DType::U64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mlir())
    }
}

/// A ranked tensor type: dimensions (row-major) and element type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub dims: Vec<i64>,
    pub dtype: DType,
}

impl Shape {
    pub fn new(dims: &[i64], dtype: DType) -> Shape {
        Shape {
            dims: dims.to_vec(),
            dtype,
        }
    }

    pub fn scalar(dtype: DType) -> Shape {
        Shape::new(&[], dtype)
    }

    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    pub fn element_count(&self) -> i64 {
        self.dims.iter().product()
    }

    pub fn size_bytes(&self) -> i64 {
        self.element_count() * self.dtype.size_bytes() as i64
    }

    pub fn with_dtype(&self, dtype: DType) -> Shape {
        Shape {
            dims: self.dims.clone(),
            dtype,
        }
    }

    pub fn with_dims(&self, dims: &[i64]) -> Shape {
        Shape::new(dims, self.dtype)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.dims {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_types_print_as_mlir() {
        assert_eq!(
            Shape::new(&[2, 3], DType::BF16).to_string(),
            "tensor<2x3xbf16>"
        );
        assert_eq!(Shape::scalar(DType::F32).to_string(), "tensor<f32>");
        assert_eq!(Shape::new(&[4], DType::U8).to_string(), "tensor<4xui8>");
        assert_eq!(Shape::new(&[1], DType::Pred).to_string(), "tensor<1xi1>");
    }
}

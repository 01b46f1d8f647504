//! Constants' values as MLIR writes them: floats exactly (hex bits for NaN and Inf), dense
//! nested lists, and raw little-endian hex for large constants.

use crate::graph::*;
use crate::types::{DType, Shape};

/// A float in MLIR syntax for `dtype`: decimal when it round-trips, hex bits for NaN and Inf.
pub(super) fn float_text(v: f64, dtype: DType) -> String {
    if !v.is_finite() {
        let bits: u64 = match (dtype, v.is_nan(), v > 0.0) {
            (DType::F64, true, _) => 0x7FF8_0000_0000_0000,
            (DType::F64, _, true) => 0x7FF0_0000_0000_0000,
            (DType::F64, _, false) => 0xFFF0_0000_0000_0000,
            (DType::F32, true, _) => 0x7FC0_0000,
            (DType::F32, _, true) => 0x7F80_0000,
            (DType::F32, _, false) => 0xFF80_0000,
            (DType::BF16, true, _) => 0x7FC0,
            (DType::BF16, _, true) => 0x7F80,
            (DType::BF16, _, false) => 0xFF80,
            (_, true, _) => 0x7E00,
            (_, _, true) => 0x7C00,
            (_, _, false) => 0xFC00,
        };
        let width = dtype.bits() / 4;
        return format!("0x{bits:0width$X}");
    }
    // Shortest text that reads back to the same value of the tensor's type.
    let s = match dtype {
        DType::F64 => format!("{v:e}"),
        DType::F32 => format!("{:e}", v as f32),
        DType::BF16 => format!("{:e}", half::bf16::from_f64(v).to_f32()),
        _ => format!("{:e}", half::f16::from_f64(v).to_f32()),
    };
    // Rust writes "1e0" / "1.5e-7"; MLIR needs a '.' in the mantissa.
    match s.split_once('e') {
        Some((m, e)) if !m.contains('.') => format!("{m}.0e{e}"),
        _ => s,
    }
}

pub(super) fn literal_element(lit: &Literal, i: usize, dtype: DType) -> String {
    match lit {
        Literal::Float(v) => float_text(v[i], dtype),
        Literal::Int(v) => v[i].to_string(),
        Literal::Bool(v) => v[i].to_string(),
    }
}

pub(super) fn dense_text(lit: &Literal, shape: &Shape) -> String {
    let n = lit.len();
    let all_same = (1..n)
        .all(|i| literal_element(lit, i, shape.dtype) == literal_element(lit, 0, shape.dtype));
    if n == 1 || all_same {
        return format!("dense<{}>", literal_element(lit, 0, shape.dtype));
    }
    if n > 64 && !matches!(lit, Literal::Bool(_)) {
        return format!("dense<\"0x{}\">", hex_bytes(lit, shape.dtype));
    }
    fn nested(lit: &Literal, dims: &[i64], offset: usize, dtype: DType) -> String {
        if dims.is_empty() {
            return literal_element(lit, offset, dtype);
        }
        let inner: i64 = dims[1..].iter().product();
        let parts: Vec<String> = (0..dims[0])
            .map(|i| nested(lit, &dims[1..], offset + (i * inner) as usize, dtype))
            .collect();
        format!("[{}]", parts.join(", "))
    }
    format!("dense<{}>", nested(lit, &shape.dims, 0, shape.dtype))
}

/// Raw little-endian element bytes, as MLIR's hex dense form expects.
pub(super) fn hex_bytes(lit: &Literal, dtype: DType) -> String {
    let mut bytes: Vec<u8> = Vec::new();
    match lit {
        Literal::Float(v) => {
            for &x in v {
                match dtype {
                    DType::F64 => bytes.extend(x.to_le_bytes()),
                    DType::F32 => bytes.extend((x as f32).to_le_bytes()),
                    DType::BF16 => bytes.extend(half::bf16::from_f64(x).to_le_bytes()),
                    _ => bytes.extend(half::f16::from_f64(x).to_le_bytes()),
                }
            }
        }
        Literal::Int(v) => {
            for &x in v {
                let b = x.to_le_bytes();
                bytes.extend(&b[..dtype.size_bytes()]);
            }
        }
        Literal::Bool(v) => bytes.extend(v.iter().map(|&b| b as u8)),
    }
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_exactly_and_specials_as_hex() {
        assert_eq!(float_text(1.0, DType::F32), "1.0e0");
        assert_eq!(float_text(0.1, DType::F32), "1.0e-1");
        assert_eq!(float_text(-2.5e-7, DType::F64), "-2.5e-7");
        assert_eq!(float_text(f64::NAN, DType::F32), "0x7FC00000");
        assert_eq!(float_text(f64::NEG_INFINITY, DType::BF16), "0xFF80");
        assert_eq!(float_text(f64::INFINITY, DType::F64), "0x7FF0000000000000");
        assert_eq!(float_text(f64::INFINITY, DType::F16), "0x7C00");
    }
}

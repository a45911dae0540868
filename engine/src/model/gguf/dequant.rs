//! ggml tensor types and their dequantization to `f32`.
//!
//! Block layouts follow ggml (`ggml-common.h`), all little-endian:
//! - `Q8_0`: f16 scale `d`, 32 x i8 `q`; `w = d * q`.
//! - `Q4_0`: f16 `d`, 16 bytes of nibbles; `w = d * (q - 8)`.
//! - `Q4_1`: f16 `d`, f16 min `m`, 16 bytes of nibbles; `w = d * q + m`.
//!
//! In the 4-bit types byte `j` holds weight `j` in its low nibble and weight `j + 16` in its high
//! nibble. Dequantization is one pass over the bytes: O(n) time, one output allocation.

use half::{bf16, f16};
use std::fmt;

/// A ggml tensor type id as stored in GGUF. Unknown ids are kept, not rejected, so a file with a
/// tensor type we cannot decode still opens and the error names the tensor when it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: Self = Self(0);
    pub const F16: Self = Self(1);
    pub const Q4_0: Self = Self(2);
    pub const Q4_1: Self = Self(3);
    pub const Q5_0: Self = Self(6);
    pub const Q5_1: Self = Self(7);
    pub const Q8_0: Self = Self(8);
    pub const Q8_1: Self = Self(9);
    pub const Q2_K: Self = Self(10);
    pub const Q3_K: Self = Self(11);
    pub const Q4_K: Self = Self(12);
    pub const Q5_K: Self = Self(13);
    pub const Q6_K: Self = Self(14);
    pub const Q8_K: Self = Self(15);
    pub const I8: Self = Self(24);
    pub const I16: Self = Self(25);
    pub const I32: Self = Self(26);
    pub const I64: Self = Self(27);
    pub const F64: Self = Self(28);
    pub const BF16: Self = Self(30);

    /// The ggml name, or `None` for an id this table does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_K => "Q8_K",
            Self::I8 => "I8",
            Self::I16 => "I16",
            Self::I32 => "I32",
            Self::I64 => "I64",
            Self::F64 => "F64",
            Self::BF16 => "BF16",
            _ => return None,
        })
    }

    /// `(elements per block, bytes per block)`, or `None` for an unknown id.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        Some(match self {
            Self::F32 | Self::I32 => (1, 4),
            Self::F16 | Self::BF16 | Self::I16 => (1, 2),
            Self::I8 => (1, 1),
            Self::I64 | Self::F64 => (1, 8),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q8_1 => (32, 36),
            Self::Q2_K => (256, 84),
            Self::Q3_K => (256, 110),
            Self::Q4_K => (256, 144),
            Self::Q5_K => (256, 176),
            Self::Q6_K => (256, 210),
            Self::Q8_K => (256, 292),
            _ => return None,
        })
    }

    /// Whether [`dequantize`] decodes this type.
    pub fn is_supported(self) -> bool {
        matches!(
            self,
            Self::F32 | Self::F16 | Self::BF16 | Self::Q8_0 | Self::Q4_0 | Self::Q4_1
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown ggml type {}", self.0),
        }
    }
}

/// Why [`dequantize`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("type {0} cannot be dequantized")]
    Unsupported(GgmlType),
    #[error("{elements} elements of {ty} need {expected} bytes, got {got}")]
    Length {
        ty: GgmlType,
        elements: u64,
        expected: u64,
        got: usize,
    },
}

/// Bytes that `elements` values of type `ty` occupy, or `None` when the type is unknown, the
/// count is not a whole number of blocks, or the size overflows.
pub fn byte_size(ty: GgmlType, elements: u64) -> Option<u64> {
    let (block, bytes) = ty.block_layout()?;
    if !elements.is_multiple_of(block) {
        return None;
    }
    (elements / block).checked_mul(bytes)
}

/// Decodes `elements` values of type `ty` from `data`, which must be exactly their size.
pub fn dequantize(ty: GgmlType, data: &[u8], elements: u64) -> Result<Vec<f32>, DequantError> {
    if !ty.is_supported() {
        return Err(DequantError::Unsupported(ty));
    }
    let expected = byte_size(ty, elements);
    if expected != Some(data.len() as u64) {
        return Err(DequantError::Length {
            ty,
            elements,
            expected: expected.unwrap_or(u64::MAX),
            got: data.len(),
        });
    }
    // The length check above bounds `elements` by twice the byte count, so this cannot overflow.
    let mut out = Vec::with_capacity(elements as usize);
    match ty {
        GgmlType::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        GgmlType::F16 => out.extend(data.chunks_exact(2).map(|b| read_f16(b, 0))),
        GgmlType::BF16 => out.extend(
            data.chunks_exact(2)
                .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
        ),
        GgmlType::Q8_0 => data.chunks_exact(34).for_each(|b| q8_0_block(b, &mut out)),
        GgmlType::Q4_0 => data.chunks_exact(18).for_each(|b| q4_0_block(b, &mut out)),
        GgmlType::Q4_1 => data.chunks_exact(20).for_each(|b| q4_1_block(b, &mut out)),
        _ => return Err(DequantError::Unsupported(ty)),
    }
    Ok(out)
}

/// The little-endian f16 at `bytes[at..at + 2]`, widened.
fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

fn q8_0_block(block: &[u8], out: &mut Vec<f32>) {
    let d = read_f16(block, 0);
    out.extend(block[2..34].iter().map(|&q| d * f32::from(q as i8)));
}

fn q4_0_block(block: &[u8], out: &mut Vec<f32>) {
    let d = read_f16(block, 0);
    let qs = &block[2..18];
    out.extend(qs.iter().map(|&b| d * (f32::from(b & 0x0f) - 8.0)));
    out.extend(qs.iter().map(|&b| d * (f32::from(b >> 4) - 8.0)));
}

fn q4_1_block(block: &[u8], out: &mut Vec<f32>) {
    let d = read_f16(block, 0);
    let m = read_f16(block, 2);
    let qs = &block[4..20];
    out.extend(qs.iter().map(|&b| d * f32::from(b & 0x0f) + m));
    out.extend(qs.iter().map(|&b| d * f32::from(b >> 4) + m));
}

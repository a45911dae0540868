//! Block-quantized weights, in the formats GGUF files ship: 32 weights per block, each block
//! with its own scale. The CPU backend multiplies them as they are (integer dot products
//! against activations quantized per block, [`crate::cpu`]); backends without quantized
//! kernels widen them at upload ([`WeightData::dequantize`](crate::WeightData::dequantize)).
//!
//! - [`BlockQ8_0`]: `w = d * q`, q an i8 (34 bytes per 32 weights, 8.5 bits each).
//! - [`BlockQ4_1`]: `w = d * q + m`, q a nibble 0..=15 (20 bytes per 32 weights, 5 bits each);
//!   byte i of `qs` holds weight i in its low nibble and weight 16 + i in its high nibble.
//!
//! Byte layouts are GGUF's (`d` and `m` little-endian f16), so a file's tensor data is read
//! block by block without conversion; the quantizers follow llama.cpp's reference ones.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// A block-quantized weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quant {
    Q8_0,
    Q4_1,
}

impl Quant {
    /// Bytes per block of [`QK`] weights.
    pub fn block_bytes(self) -> usize {
        match self {
            Quant::Q8_0 => 34,
            Quant::Q4_1 => 20,
        }
    }

    /// Lower-case name (`q8_0`, `q4_1`), as in GGUF and engine.toml.
    pub fn name(self) -> &'static str {
        match self {
            Quant::Q8_0 => "q8_0",
            Quant::Q4_1 => "q4_1",
        }
    }

    /// The format a name stands for.
    pub fn parse(name: &str) -> Option<Quant> {
        match name {
            "q8_0" => Some(Quant::Q8_0),
            "q4_1" => Some(Quant::Q4_1),
            _ => None,
        }
    }
}

/// 32 weights `d * qs[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// 32 weights `d * q + m`: weight i is the low nibble of `qs[i]`, weight 16 + i the high one.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// A block format: parsing, quantizing and widening one block.
pub trait QuantBlock: Copy + Send + Sync + 'static {
    /// The format.
    const QUANT: Quant;

    /// The block stored in `bytes` (exactly `QUANT.block_bytes()` of them, GGUF layout).
    fn from_bytes(bytes: &[u8]) -> Self;

    /// The block's bytes in GGUF layout.
    fn to_bytes(&self, out: &mut Vec<u8>);

    /// The block nearest to `x` (llama.cpp's reference quantizer).
    fn quantize(x: &[f32; QK]) -> Self;

    /// The 32 weights, widened.
    fn dequantize(&self, out: &mut [f32; QK]);
}

impl QuantBlock for BlockQ8_0 {
    const QUANT: Quant = Quant::Q8_0;

    fn from_bytes(b: &[u8]) -> Self {
        assert_eq!(b.len(), 34, "Q8_0 block is 34 bytes");
        BlockQ8_0 {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs: std::array::from_fn(|i| b[2 + i] as i8),
        }
    }

    fn to_bytes(&self, out: &mut Vec<u8>) {
        out.extend(self.d.to_le_bytes());
        out.extend(self.qs.iter().map(|&q| q as u8));
    }

    fn quantize(x: &[f32; QK]) -> Self {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs: std::array::from_fn(|i| (x[i] * id).round() as i8),
        }
    }

    fn dequantize(&self, out: &mut [f32; QK]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * q as f32;
        }
    }
}

impl QuantBlock for BlockQ4_1 {
    const QUANT: Quant = Quant::Q4_1;

    fn from_bytes(b: &[u8]) -> Self {
        assert_eq!(b.len(), 20, "Q4_1 block is 20 bytes");
        BlockQ4_1 {
            d: f16::from_le_bytes([b[0], b[1]]),
            m: f16::from_le_bytes([b[2], b[3]]),
            qs: std::array::from_fn(|i| b[4 + i]),
        }
    }

    fn to_bytes(&self, out: &mut Vec<u8>) {
        out.extend(self.d.to_le_bytes());
        out.extend(self.m.to_le_bytes());
        out.extend(self.qs);
    }

    fn quantize(x: &[f32; QK]) -> Self {
        let min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
        let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
        BlockQ4_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            qs: std::array::from_fn(|i| q(x[i]) | (q(x[16 + i]) << 4)),
        }
    }

    fn dequantize(&self, out: &mut [f32; QK]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (i, &b) in self.qs.iter().enumerate() {
            out[i] = d * (b & 15) as f32 + m;
            out[16 + i] = d * (b >> 4) as f32 + m;
        }
    }
}

/// Quantizes `values` (a multiple of [`QK`] long) block by block.
pub fn quantize<B: QuantBlock>(values: &[f32]) -> Vec<B> {
    assert!(
        values.len().is_multiple_of(QK),
        "quantize: {} values is not a whole number of {QK}-value blocks",
        values.len()
    );
    values
        .chunks_exact(QK)
        .map(|c| B::quantize(c.try_into().expect("chunks_exact yields QK values")))
        .collect()
}

/// Widens `blocks` into `out` (`blocks.len() * QK` values).
pub fn dequantize<B: QuantBlock>(blocks: &[B], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK, "dequantize: output length");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        b.dequantize(o.try_into().expect("chunks_exact_mut yields QK values"));
    }
}

/// Parses GGUF-layout blocks (`bytes.len()` a multiple of the block size).
pub fn parse_blocks<B: QuantBlock>(bytes: &[u8]) -> Option<Vec<B>> {
    let size = B::QUANT.block_bytes();
    bytes
        .len()
        .is_multiple_of(size)
        .then(|| bytes.chunks_exact(size).map(B::from_bytes).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(seed: f32) -> [f32; QK] {
        std::array::from_fn(|i| ((i as f32 * 0.37 + seed).sin() * 2.0 - 0.3) * seed)
    }

    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        for seed in [0.5, 1.0, 3.0] {
            let x = ramp(seed);
            let b = BlockQ8_0::quantize(&x);
            let mut y = [0.0; QK];
            b.dequantize(&mut y);
            let step = b.d.to_f32();
            for (a, c) in x.iter().zip(&y) {
                assert!((a - c).abs() <= 0.5 * step + 1e-3 * step, "{a} vs {c}");
            }
            let mut bytes = Vec::new();
            b.to_bytes(&mut bytes);
            assert_eq!(BlockQ8_0::from_bytes(&bytes), b);
        }
    }

    #[test]
    fn q4_1_round_trips_within_half_a_step_and_keeps_the_nibble_order() {
        for seed in [0.5, 1.0, 3.0] {
            let x = ramp(seed);
            let b = BlockQ4_1::quantize(&x);
            let mut y = [0.0; QK];
            b.dequantize(&mut y);
            let step = b.d.to_f32();
            for (a, c) in x.iter().zip(&y) {
                assert!((a - c).abs() <= 0.5 * step + 2e-3 * seed, "{a} vs {c}");
            }
            let mut bytes = Vec::new();
            b.to_bytes(&mut bytes);
            assert_eq!(bytes.len(), 20);
            assert_eq!(BlockQ4_1::from_bytes(&bytes), b);
        }
        // Weight 0 in the low nibble of byte 0, weight 16 in its high nibble.
        let mut x = [0.0; QK];
        x[16] = 15.0;
        let b = BlockQ4_1::quantize(&x);
        assert_eq!(b.qs[0], 0xf0);
        assert!(b.qs[1..].iter().all(|&q| q == 0));
    }

    #[test]
    fn a_constant_block_quantizes_exactly() {
        let x = [0.25f32; QK];
        let mut y = [0.0; QK];
        BlockQ4_1::quantize(&x).dequantize(&mut y);
        assert_eq!(y, x);
        BlockQ8_0::quantize(&[0.0; QK]).dequantize(&mut y);
        assert_eq!(y, [0.0; QK]);
    }
}

//! `out = x @ w^T` over block-quantized weights (Q8_0, Q4_1), as llama.cpp computes it: each x
//! row is quantized to 8 bits per 32-value block ([`BlockQ8x`]: i8 values, a scale `d` and
//! `s = d * sum(q)`, both rounded through f16 as llama.cpp's `q8_0`/`q8_1` blocks are). A weight
//! block then costs one integer dot product of 32 pairs: `d_w * d_x * sum(q_w * q_x)`, plus
//! `m_w * s_x` for Q4_1's offset. The weights stream from memory in their file size: 5 bits per
//! weight for Q4_1, 8.5 for Q8_0.
//!
//! - **Decode and small batches** (`avx2`): with AVX2 a block's 32 products are one
//!   `vpmaddubsw` (u8 x i8 pairs to i16) and one `vpmaddwd` (to eight i32), or one `vpdpbusd`
//!   with AVX-512 VNNI; Q8_0's signed weights move their sign onto x first (`vpsignb`).
//! - **Batches and prefill on 16-row tiles**: 16 weight rows at a time meet the x rows, on the
//!   AMX tile unit (`amx`, x also packed in groups of 16 rows) or, without it, with AVX-512
//!   VNNI, a vector's 16 lanes the tile's rows and x broadcast (`vnni`).
//! - **Prefill elsewhere** (more than `QUANT_GEMV_MAX_ROWS` rows, no tiles): compute-bound, so
//!   the weights are widened to f32 while the AVX2 GEMM packs its panels (once per call, then
//!   used by every x row) and x stays f32.
//!
//! AVX-512 CPUs run the AVX2 kernels where they have nothing wider (every CPU with AVX-512 has
//! AVX2). The portable versions do the same integer arithmetic in plain Rust, and give the same
//! result up to float rounding.

use std::cell::RefCell;

use super::{Dims, SharedOut};
use crate::cpu::simd::Isa;
use crate::quant::{BlockQ4_1, BlockQ8_0, QuantBlock, QK};
use half::f16;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// 32 activations quantized to 8 bits: `x ~ d * qs`, and `s = d * sum(qs)`.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct BlockQ8x {
    pub(super) qs: [i8; QK],
    pub(super) d: f32,
    pub(super) s: f32,
}

/// 1.5 * 2^23: added to a float of magnitude below 2^22 it leaves no fraction bits, so the
/// default rounding mode rounds to an integer (ties to even); and an integer below 2^22 in
/// magnitude added to its bits lands in its mantissa exactly (`vnni`).
pub(super) const MANTISSA_MAGIC: f32 = 12_582_912.0;

thread_local! {
    /// The caller's quantized x rows, reused across calls.
    static XQ: RefCell<Vec<BlockQ8x>> = const { RefCell::new(Vec::new()) };
    /// What XQ and XP hold: the x tensor's stamp and how it was quantized and packed.
    static HELD: std::cell::Cell<Option<Held>> = const { std::cell::Cell::new(None) };
    /// The same rows packed for the tile kernels.
    #[cfg(target_arch = "x86_64")]
    static XP: RefCell<Vec<Packed>> = const { RefCell::new(Vec::new()) };
    /// A widened weight row (portable GEMM).
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Quantizes `x` (rows of `k` values, `k` a multiple of 32) into `out` (one block per 32
/// values), block by block: `d = max|x| / 127`, `q = round(x / d)` (ties to even, as
/// `vcvtps2dq` rounds).
pub(crate) fn quantize_x(x: &[f32], out: &mut [BlockQ8x]) {
    for (c, o) in x.chunks_exact(QK).zip(out) {
        let (d, id) = block_scale(c.iter().fold(0.0f32, |a, v| a.max(v.abs())));
        // Round to nearest, ties to even, without a libm call (|x * id| <= 127).
        const M: f32 = MANTISSA_MAGIC;
        let qs: [i8; QK] = std::array::from_fn(|i| ((c[i] * id + M) - M) as i8);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        *o = BlockQ8x {
            qs,
            d: f16::from_f32(d).to_f32(),
            s: f16::from_f32(d * sum as f32).to_f32(),
        };
    }
}

/// `d` and `1 / d` of a block whose largest magnitude is `amax` (0 for a block of zeros).
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    (amax / 127.0, if amax != 0.0 { 127.0 / amax } else { 0.0 })
}

/// `x` quantized block by block into `out`: `block` gives a block's bytes, its `d` and the sum
/// of its bytes (what each instruction set does its own way), and `d` and `s` are rounded
/// through f16 with F16C, to nearest even as `f16::from_f32` does.
///
/// # Safety
/// The CPU must support F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn quantize_blocks(
    x: &[f32],
    out: &mut [BlockQ8x],
    block: impl Fn(&[f32]) -> ([i8; QK], f32, i32),
) {
    // A plain loop, not an iterator: inlined into the caller with its features, so the F16C
    // conversions inline too (in a closure of their own they were calls, a visible share of a
    // batch's serial work).
    for (c, o) in x.chunks_exact(QK).zip(out) {
        let (qs, d, sum) = block(c);
        // SAFETY: F16C per the caller.
        let (d, s) = unsafe { (f16_round(d), f16_round(d * sum as f32)) };
        *o = BlockQ8x { qs, d, s };
    }
}

/// `v` rounded to the nearest f16 (ties to even) and widened back, with F16C.
///
/// # Safety
/// The CPU must support F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_round(v: f32) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: register-only F16C; the caller guarantees the feature.
    unsafe {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v));
        _mm_cvtss_f32(_mm_cvtph_ps(h))
    }
}

/// [`quantize_x`] with AVX-512: the same arithmetic (the same products `x * id`, rounded to
/// nearest even by `vcvtps2dq`), so the same blocks.
///
/// # Safety
/// The CPU must support AVX-512F and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn quantize_x_avx512(x: &[f32], out: &mut [BlockQ8x]) {
    use std::arch::x86_64::*;
    // SAFETY: each block holds 32 values; AVX-512F and F16C per the caller.
    unsafe {
        quantize_blocks(x, out, |c| {
            let lo = _mm512_loadu_ps(c.as_ptr());
            let hi = _mm512_loadu_ps(c.as_ptr().add(16));
            let (d, id) = block_scale(_mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_abs_ps(lo),
                _mm512_abs_ps(hi),
            )));
            let id = _mm512_set1_ps(id);
            let qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));
            let qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            let mut qs = [0i8; QK];
            _mm_storeu_si128(qs.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(qhi));
            (qs, d, sum)
        })
    }
}

/// [`quantize_x`] with AVX2: the same arithmetic as the portable and AVX-512 versions, so the
/// same blocks. A batch of decodes quantizes its activations before each matmul on the calling
/// thread, where the portable loop (scalar, with a call into `half` for each f16 rounding) was a
/// visible share of a step.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn quantize_x_avx2(x: &[f32], out: &mut [BlockQ8x]) {
    use std::arch::x86_64::*;
    // SAFETY: each block holds 32 values; AVX2 and F16C per the caller.
    unsafe {
        quantize_blocks(x, out, |c| {
            let v = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(c.as_ptr().add(o)));
            let sign = _mm256_set1_ps(-0.0);
            let abs = |a: __m256| _mm256_andnot_ps(sign, a);
            let m = _mm256_max_ps(
                _mm256_max_ps(abs(v[0]), abs(v[1])),
                _mm256_max_ps(abs(v[2]), abs(v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let (d, id) = block_scale(_mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m))));
            let id = _mm256_set1_ps(id);
            let q = v.map(|a| _mm256_cvtps_epi32(_mm256_mul_ps(a, id)));
            let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let sum = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let sum = _mm_add_epi32(sum, _mm_unpackhi_epi64(sum, sum));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32::<1>(sum)));
            // |q| <= 127, so the saturating packs are exact; they interleave the four vectors'
            // 128-bit halves, which one cross-lane permute puts back in order.
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let bytes =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let mut qs = [0i8; QK];
            _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes);
            (qs, d, sum)
        })
    }
}

/// A weight block format the quantized kernels multiply.
pub(crate) trait QDot: QuantBlock {
    /// `sum(w_i * x_i)` over the block, in integer arithmetic (portable).
    fn dot(&self, x: &BlockQ8x) -> f32;

    /// Whether blocks carry an offset `m` (Q4_1) besides the scale.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const HAS_OFFSET: bool;

    /// `[d, m, 0, 0]` widened (m = 0 for Q8_0).
    ///
    /// # Safety
    /// The CPU must support F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn scales128(&self) -> std::arch::x86_64::__m128;

    /// The 32 weights as bytes in value order: Q4_1's nibbles as u8, Q8_0's values as i8.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn weights256(&self) -> std::arch::x86_64::__m256i;

    /// Eight i32 partial sums of `w_i * x_i` for [`QDot::weights256`]'s bytes and 32 i8 x; with
    /// `VNNI`, from one `vpdpbusd` (the same sums).
    ///
    /// # Safety
    /// The CPU must support AVX2, and with `VNNI` AVX-512 VNNI and VL: inline it only where
    /// they are enabled.
    #[cfg(target_arch = "x86_64")]
    unsafe fn idot256<const VNNI: bool>(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i;

    /// Weights `off..off + 8` widened (`off` a multiple of 8).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(&self, off: usize) -> std::arch::x86_64::__m256;

    /// Whether [`QDot::weights256`]'s bytes are signed (Q8_0) or unsigned (Q4_1's nibbles): the
    /// batched kernels multiply them with `vpmaddubsw` (after moving the sign onto x) or
    /// `tdpbssd`, and `vpmaddubsw` directly or `tdpbusd`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const SIGNED: bool;

    /// The 16 rows of `nb` blocks at `w` as the AMX tile loads read them: block `b` of the 16
    /// rows is 16 rows of 32 bytes at `base + b * block_step`, `stride` bytes apart. Returns
    /// `(base, block_step, stride)`; formats stored otherwise are unpacked into `bytes`.
    ///
    /// # Safety
    /// `w` must point to 16 rows of `nb` blocks, and the CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn amx_stage(
        w: *const Self,
        nb: usize,
        bytes: &mut Vec<u8>,
    ) -> (*const u8, usize, usize);

    /// The 16 rows' scales widened, `dw[b * 16 + r]` for row r's block b (and the offsets
    /// `mw`, for formats that have them).
    ///
    /// # Safety
    /// `w` must point to 16 rows of `nb` blocks, `dw` and `mw` to `16 * nb` f32s each, and the
    /// CPU must support AVX-512F (and so F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_scales(w: *const Self, nb: usize, dw: *mut f32, mw: *mut f32);

    /// 16 rows of `nb` blocks at `w` staged for the VNNI tile kernel (`vnni::gemm_lanes`):
    /// block b's vector t, at `out + b * 512 + t * 64`, holds values `4t..4t + 4` of rows 0..16
    /// in turn, as unsigned bytes: Q4_1's nibbles as they are, Q8_0's values plus 128.
    ///
    /// # Safety
    /// `w` must point to 16 rows of `nb` blocks and `out` to `512 * nb` writable bytes; the CPU
    /// must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn stage_lanes(w: *const Self, nb: usize, out: *mut u8);
}

/// [`QDot::tile_scales`] for blocks of `size` bytes that begin with their f16 `d` (and, with
/// `mw`, the f16 `m` after it): one gather per block reads the first 4 bytes of all 16 rows'
/// blocks, and F16C widens the 16 `d` (and `m`) at once.
///
/// # Safety
/// As [`QDot::tile_scales`]; every block is at least 4 bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gather_scales(w: *const u8, size: usize, nb: usize, dw: *mut f32, mw: Option<*mut f32>) {
    use std::arch::x86_64::*;
    let stride = i32::try_from(nb * size).expect("a weight row fits a gather's offsets");
    assert!(size >= 4 && stride.checked_mul(15).is_some());
    // SAFETY: per the caller: the gathered dwords are the first 4 bytes of row r's block b,
    // the stores 16 scales each at b * 16; AVX-512F per the caller.
    unsafe {
        let rows = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(stride),
        );
        for b in 0..nb {
            let v = _mm512_i32gather_epi32::<1>(rows, w.add(b * size).cast());
            _mm512_storeu_ps(dw.add(b * 16), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
            if let Some(mw) = mw {
                let m = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v));
                _mm512_storeu_ps(mw.add(b * 16), _mm512_cvtph_ps(m));
            }
        }
    }
}

impl QDot for BlockQ8_0 {
    #[inline(always)]
    fn dot(&self, x: &BlockQ8x) -> f32 {
        let sum: i32 = self
            .qs
            .iter()
            .zip(&x.qs)
            .map(|(&w, &v)| w as i32 * v as i32)
            .sum();
        sum as f32 * (self.d.to_f32() * x.d)
    }

    const HAS_OFFSET: bool = false;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales128(&self) -> std::arch::x86_64::__m128 {
        use std::arch::x86_64::*;
        // SAFETY: register-only F16C; the caller guarantees the feature.
        unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(self.d.to_bits() as i32)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn weights256(&self) -> std::arch::x86_64::__m256i {
        // SAFETY: qs is 32 bytes; AVX per the caller.
        unsafe { std::arch::x86_64::_mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn idot256<const VNNI: bool>(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: register-only AVX2 (and VNNI/VL when asked for, per the caller);
        // |w| * (x * sign w) = w * x, and two products of at most 128 * 127 fit vpmaddubsw's
        // i16 sums.
        unsafe {
            let (a, b) = (_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            if VNNI {
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
            } else {
                _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, off: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: off + 8 <= 32 bytes of qs; AVX2 per the caller.
        unsafe {
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(self.qs.as_ptr().add(off).cast()));
            _mm256_mul_ps(
                _mm256_cvtepi32_ps(q),
                _mm256_set1_ps(f16_bits(self.d.to_bits())),
            )
        }
    }

    const SIGNED: bool = true;

    #[cfg(target_arch = "x86_64")]
    unsafe fn amx_stage(w: *const Self, nb: usize, _: &mut Vec<u8>) -> (*const u8, usize, usize) {
        let size = std::mem::size_of::<Self>();
        // The 32 values follow the 2-byte scale (repr(C)); rows are nb blocks apart.
        (w.cast::<u8>().wrapping_add(2), size, nb * size)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile_scales(w: *const Self, nb: usize, dw: *mut f32, _: *mut f32) {
        const { assert!(std::mem::offset_of!(BlockQ8_0, d) == 0) };
        // SAFETY: per the caller; `d` leads the 34-byte block.
        unsafe { gather_scales(w.cast(), std::mem::size_of::<Self>(), nb, dw, None) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn stage_lanes(w: *const Self, nb: usize, out: *mut u8) {
        use std::arch::x86_64::*;
        const {
            assert!(std::mem::offset_of!(BlockQ8_0, qs) == 2);
        };
        let stride = nb * std::mem::size_of::<Self>();
        // SAFETY: per the caller: 32 bytes of qs in each row's block b, the stores inside block
        // b's 512 bytes of `out`; AVX-512F per the caller. `w ^ 0x80` read unsigned is w + 128.
        unsafe {
            let flip = _mm512_set1_epi8(-128);
            for b in 0..nb {
                let qs = w.add(b).cast::<u8>().add(2);
                let block = out.add(b * super::vnni::STAGED_BLOCK);
                for half in 0..2 {
                    let dwords = super::vnni::dwords16(qs.add(16 * half), stride);
                    for (t, v) in dwords.into_iter().enumerate() {
                        let at = block.add((4 * half + t) * 64);
                        _mm512_storeu_si512(at.cast(), _mm512_xor_si512(v, flip));
                    }
                }
            }
        }
    }
}

impl QDot for BlockQ4_1 {
    #[inline(always)]
    fn dot(&self, x: &BlockQ8x) -> f32 {
        let mut sum = 0i32;
        for i in 0..QK / 2 {
            let b = self.qs[i];
            sum += (b & 15) as i32 * x.qs[i] as i32 + (b >> 4) as i32 * x.qs[QK / 2 + i] as i32;
        }
        sum as f32 * (self.d.to_f32() * x.d) + self.m.to_f32() * x.s
    }

    const HAS_OFFSET: bool = true;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales128(&self) -> std::arch::x86_64::__m128 {
        use std::arch::x86_64::*;
        // SAFETY: d and m are the block's first 4 bytes (repr(C)); F16C per the caller.
        unsafe {
            let dm = std::ptr::read_unaligned((self as *const Self).cast::<i32>());
            _mm_cvtph_ps(_mm_cvtsi32_si128(dm))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn weights256(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: qs is 16 bytes; AVX2 per the caller. Low nibbles are weights 0..16, high
        // nibbles 16..32: the 16 bytes in both halves, the upper half shifted down by 4.
        unsafe {
            let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(self.qs.as_ptr().cast()));
            let q = _mm256_srlv_epi64(q, _mm256_set_epi64x(4, 4, 0, 0));
            _mm256_and_si256(q, _mm256_set1_epi8(15))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn idot256<const VNNI: bool>(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: register-only AVX2 (and VNNI/VL when asked for, per the caller); nibbles are
        // u8 0..=15, so pair sums fit i16.
        unsafe {
            if VNNI {
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
            } else {
                _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, off: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the 8 bytes read are inside qs (off < 16: bytes off..off+8, low nibbles;
        // else bytes off-16..off-8, high nibbles); AVX2/FMA/F16C per the caller.
        unsafe {
            let (at, shift) = if off < 16 { (off, 0) } else { (off - 16, 4) };
            let b = _mm_loadl_epi64(self.qs.as_ptr().add(at).cast());
            let b = _mm_and_si128(
                _mm_srl_epi16(b, _mm_cvtsi32_si128(shift)),
                _mm_set1_epi8(15),
            );
            let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
            let d = _mm256_set1_ps(f16_bits(self.d.to_bits()));
            _mm256_fmadd_ps(q, d, _mm256_set1_ps(f16_bits(self.m.to_bits())))
        }
    }

    const SIGNED: bool = false;

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn amx_stage(
        w: *const Self,
        nb: usize,
        bytes: &mut Vec<u8>,
    ) -> (*const u8, usize, usize) {
        // SAFETY: per the caller (the AMX kernel runs with AVX-512, so AVX2).
        let out = unsafe { stage_rows(w, nb, bytes) };
        (out, 16 * QK, QK)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn tile_scales(w: *const Self, nb: usize, dw: *mut f32, mw: *mut f32) {
        const {
            assert!(std::mem::offset_of!(BlockQ4_1, d) == 0);
            assert!(std::mem::offset_of!(BlockQ4_1, m) == 2);
        };
        // SAFETY: per the caller; `d`, then `m`, lead the 20-byte block.
        unsafe { gather_scales(w.cast(), std::mem::size_of::<Self>(), nb, dw, Some(mw)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn stage_lanes(w: *const Self, nb: usize, out: *mut u8) {
        use std::arch::x86_64::*;
        const {
            assert!(std::mem::offset_of!(BlockQ4_1, qs) == 4);
        };
        let stride = nb * std::mem::size_of::<Self>();
        // SAFETY: per the caller: 16 bytes of qs in each row's block b, the stores inside block
        // b's 512 bytes of `out`; AVX-512F per the caller. Byte i of qs holds value i (low
        // nibble) and value i + 16 (high nibble), so dword t (t < 4) of the 16 rows gives vector
        // t from its low nibbles and vector t + 4 from its high ones.
        unsafe {
            let low = _mm512_set1_epi8(15);
            for b in 0..nb {
                let dwords = super::vnni::dwords16(w.add(b).cast::<u8>().add(4), stride);
                let block = out.add(b * super::vnni::STAGED_BLOCK);
                for (t, v) in dwords.into_iter().enumerate() {
                    _mm512_storeu_si512(block.add(t * 64).cast(), _mm512_and_si512(v, low));
                    let high = _mm512_and_si512(_mm512_srli_epi32::<4>(v), low);
                    _mm512_storeu_si512(block.add((t + 4) * 64).cast(), high);
                }
            }
        }
    }
}

/// An f16 (as bits) widened with F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_bits(bits: u16) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: register-only F16C; the caller guarantees the feature.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) }
}

/// The 16 rows of `nb` blocks at `w` as bytes in value order ([`QDot::weights256`]),
/// block-major: row r's block b at `out[(b * 16 + r) * 32..]`, for the tile kernels.
///
/// # Safety
/// `w` must point to 16 rows of `nb` blocks, and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn stage_rows<B: QDot>(w: *const B, nb: usize, out: &mut Vec<u8>) -> *const u8 {
    use std::arch::x86_64::*;
    out.resize(nb * 16 * QK, 0);
    let dst = out.as_mut_ptr();
    // SAFETY: per the caller; the 32 bytes written are block b of row r inside `out`.
    unsafe {
        for r in 0..16 {
            for b in 0..nb {
                let q = (*w.add(r * nb + b)).weights256();
                _mm256_storeu_si256(dst.add((b * 16 + r) * QK).cast(), q);
            }
        }
    }
    dst.cast_const()
}

/// What the calling thread's quantized x buffers hold.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Held {
    stamp: u64,
    m: usize,
    k: usize,
    packed: bool,
    isa: Isa,
}

/// Runs `f` with `x` quantized (`m` rows of `k` values) and, when `packed` is set, also packed
/// for the AMX tiles, into buffers of the calling thread reused across calls. The rows are
/// quantized and packed in groups of 16 (the AMX tiles' x groups), one task per group across
/// the CPU pool when there are several: in a batch of 32 decodes, done on the calling thread
/// alone while the other threads waited, they were about a tenth of a step.
///
/// With a `stamp` ([`crate::cpu::CpuTensor`]'s) equal to the last call's, the same shape,
/// packing and instruction set, x is the tensor the buffers already hold, unchanged, and is not
/// quantized again: the Q, K and V projections of one step read one quantized x.
pub(super) fn with_quantized_x<R>(
    isa: Isa,
    x: &[f32],
    stamp: Option<u64>,
    m: usize,
    k: usize,
    packed: bool,
    f: impl FnOnce(&[BlockQ8x], &[Packed]) -> R,
) -> R {
    let nb = k / QK;
    let held = stamp.map(|stamp| Held {
        stamp,
        m,
        k,
        packed,
        isa,
    });
    XQ.with(|cell| {
        let mut xq = cell.borrow_mut();
        if held.is_some() && HELD.get() == held {
            #[cfg(target_arch = "x86_64")]
            return XP.with(|cell| f(&xq, &cell.borrow()));
            #[cfg(not(target_arch = "x86_64"))]
            return f(&xq, &[]);
        }
        // Until the buffers are whole again, they hold nothing anyone may reuse (a task that
        // panics leaves them half written).
        HELD.set(None);
        // Every block is written below; the old contents only save a fill.
        xq.resize(m * nb, BlockQ8x::default());
        #[cfg(target_arch = "x86_64")]
        {
            XP.with(|cell| {
                let mut xp = cell.borrow_mut();
                let packed_groups = if packed { m.div_ceil(X_GROUP) } else { 0 };
                xp.resize(packed_groups * nb, super::amx::PackedX::ZERO);
                let mut packs = xp.chunks_mut(nb.max(1));
                let groups = x
                    .chunks(X_GROUP * k.max(1))
                    .zip(xq.chunks_mut(X_GROUP * nb.max(1)))
                    .map(|(xs, qs)| (xs, qs, packs.next()));
                super::pool().run_parts(groups, |_, (xs, qs, pack)| {
                    quantize_rows(isa, xs, qs);
                    if let Some(pack) = pack {
                        super::amx::pack_group(qs, nb, pack);
                    }
                });
                HELD.set(held);
                f(&xq, &xp)
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = packed;
            quantize_rows(isa, x, &mut xq);
            HELD.set(held);
            f(&xq, &[])
        }
    })
}

/// x rows per quantizing task (the tile kernels' group of x rows).
#[cfg(target_arch = "x86_64")]
const X_GROUP: usize = super::amx::GROUP;

/// `x` quantized into `out` with the widest quantizer the CPU has (all give the same blocks).
fn quantize_rows(isa: Isa, x: &[f32], out: &mut [BlockQ8x]) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx512() {
        // SAFETY: the AVX-512 ISAs are only chosen with AVX-512F and F16C.
        unsafe { quantize_x_avx512(x, out) };
    } else if isa == Isa::Avx2 {
        // SAFETY: Isa::Avx2 is only chosen with AVX2, FMA and F16C.
        unsafe { quantize_x_avx2(x, out) };
    } else {
        quantize_x(x, out);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        quantize_x(x, out);
    }
}

/// x rows packed for the tile kernels.
#[cfg(target_arch = "x86_64")]
pub(super) type Packed = super::amx::PackedX;
/// x rows packed for the tile kernels (none off x86_64).
#[cfg(not(target_arch = "x86_64"))]
pub(super) type Packed = ();

/// Columns `n0..n1` of `out = x @ w^T` for small m (any m on 16-row tiles), x already
/// quantized.
///
/// # Safety
/// `xq` holds `m * k / 32` blocks, `w` holds `n * k / 32`, and `out` points to `m * n` f32s of
/// which this call may write columns `n0..n1`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemv_range<B: QDot>(
    isa: Isa,
    xq: &[BlockQ8x],
    xp: &[Packed],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: SharedOut,
) {
    let nb = d.k / QK;
    assert!(xq.len() >= d.m * nb && w.len() >= d.n * nb);
    #[cfg(target_arch = "x86_64")]
    if super::tiled(isa, d.m) {
        // Whole tiles of 16 weight rows on the tile kernels, the rest as below.
        let tiles = n0 + (n1 - n0) / 16 * 16;
        // Tiles only run (`tiled`) on these two.
        assert!(isa == Isa::Amx || isa.vnni());
        // SAFETY: Isa::Amx is chosen with AVX-512F/BW, AMX-INT8 and its state enabled (x packed
        // there: `Tiles` checks); `Isa::vnni` holds with AVX-512F, VNNI and VL, and AVX2/FMA/F16C
        // as on every AVX-512 ISA; shapes per the caller.
        unsafe {
            if isa == Isa::Amx {
                let t = super::amx::Tiles {
                    xp,
                    w,
                    d,
                    n0,
                    n1: tiles,
                    out: out.0,
                };
                super::amx::gemm(&t);
            } else {
                super::vnni::gemm_lanes(xq, w, d, n0, tiles, out.0);
            }
            if tiles < n1 {
                avx2::range(xq, w, d, tiles, n1, out.0, isa.vnni());
            }
        }
        return;
    }
    let _ = xp;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: every ISA above Portable has AVX2/FMA/F16C, and `Isa::vnni` checks VNNI;
        // shapes per the caller.
        unsafe { avx2::range(xq, w, d, n0, n1, out.0, isa.vnni()) };
        return;
    }
    let _ = isa;
    for j in n0..n1 {
        let wr = &w[j * nb..(j + 1) * nb];
        for i in 0..d.m {
            let xr = &xq[i * nb..(i + 1) * nb];
            let v: f32 = wr.iter().zip(xr).map(|(b, x)| b.dot(x)).sum();
            // SAFETY: i < m and n0 <= j < n1, inside this call's columns per the caller.
            unsafe { *out.at(i * d.n + j) = v };
        }
    }
}

/// Columns `n0..n1` of `out = x @ w^T` for many rows (without 16-row tiles): f32 x against
/// widened weights.
///
/// # Safety
/// As for [`gemv_range`], with `x` holding `m * k` f32 values.
pub(super) unsafe fn gemm_range<B: QDot>(
    isa: Isa,
    x: &[f32],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: SharedOut,
) {
    let nb = d.k / QK;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: every ISA above Portable has AVX2/FMA/F16C; w has n rows of nb blocks.
        unsafe { super::avx2::gemm(x, &Rows { w, nb }, d, n0, n1, out.0) };
        return;
    }
    let _ = isa;
    ROW.with(|cell| {
        let mut row = cell.borrow_mut();
        row.resize(d.k, 0.0);
        for j in n0..n1 {
            crate::quant::dequantize(&w[j * nb..(j + 1) * nb], &mut row);
            for i in 0..d.m {
                let v = super::portable::dot(&x[i * d.k..(i + 1) * d.k], &row);
                // SAFETY: i < m and n0 <= j < n1, inside this call's columns per the caller.
                unsafe { *out.at(i * d.n + j) = v };
            }
        }
    });
}

/// Quantized rows as the AVX2 GEMM packs them.
#[cfg(target_arch = "x86_64")]
struct Rows<'a, B> {
    w: &'a [B],
    nb: usize,
}

#[cfg(target_arch = "x86_64")]
impl<B: QDot> super::avx2::PanelRows for Rows<'_, B> {
    #[inline(always)]
    unsafe fn load8(&self, j: usize, p: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: p + 8 <= k and p's block is row j's (p / 32); the packer reads 8-aligned
        // groups (its blocks start at multiples of 8), so they never straddle two blocks.
        unsafe { self.w[j * self.nb + p / QK].load8(p % QK) }
    }

    fn value(&self, j: usize, p: usize) -> f32 {
        let mut vals = [0.0f32; QK];
        self.w[j * self.nb + p / QK].dequantize(&mut vals);
        vals[p % QK]
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// 16 rows of `nb` blocks of `B`, each value distinct enough to catch a misplaced byte.
    fn rows16<B: QuantBlock>(nb: usize) -> Vec<B> {
        let x: Vec<f32> = (0..16 * nb * QK)
            .map(|i| ((i * 7919 % 211) as f32 - 105.0) * 0.031)
            .collect();
        crate::quant::quantize(&x)
    }

    /// Value `i` of a Q4_1 block: byte i's low nibble, or byte i - 16's high one.
    fn nibble(blk: &BlockQ4_1, i: usize) -> u8 {
        if i < QK / 2 {
            blk.qs[i] & 15
        } else {
            blk.qs[i - QK / 2] >> 4
        }
    }

    #[test]
    fn the_amx_staging_puts_each_weight_and_scale_where_the_tile_loads_read_it() {
        // Staging and scales are plain AVX-512, so this runs on any CPU with AVX-512, AMX or not.
        if !Isa::detect().avx512() {
            return;
        }
        for nb in [1, 3, 18] {
            let (mut bytes, mut dw, mut mw) = (Vec::new(), vec![0.0; 16 * nb], vec![0.0; 16 * nb]);
            let q8: Vec<BlockQ8_0> = rows16(nb);
            let q4: Vec<BlockQ4_1> = rows16(nb);
            // SAFETY: 16 rows of nb blocks, 16 * nb scales; AVX-512F detected above.
            unsafe {
                let (base, step, stride) = BlockQ8_0::amx_stage(q8.as_ptr(), nb, &mut bytes);
                BlockQ8_0::tile_scales(q8.as_ptr(), nb, dw.as_mut_ptr(), mw.as_mut_ptr());
                for (r, b, i) in
                    (0..16).flat_map(|r| (0..nb).flat_map(move |b| (0..QK).map(move |i| (r, b, i))))
                {
                    let blk = &q8[r * nb + b];
                    assert_eq!(*base.add(b * step + r * stride + i) as i8, blk.qs[i]);
                    assert_eq!(dw[b * 16 + r], blk.d.to_f32());
                }
                let (base, step, stride) = BlockQ4_1::amx_stage(q4.as_ptr(), nb, &mut bytes);
                BlockQ4_1::tile_scales(q4.as_ptr(), nb, dw.as_mut_ptr(), mw.as_mut_ptr());
                for (r, b, i) in
                    (0..16).flat_map(|r| (0..nb).flat_map(move |b| (0..QK).map(move |i| (r, b, i))))
                {
                    let blk = &q4[r * nb + b];
                    assert_eq!(*base.add(b * step + r * stride + i), nibble(blk, i));
                    assert_eq!(
                        (dw[b * 16 + r], mw[b * 16 + r]),
                        (blk.d.to_f32(), blk.m.to_f32())
                    );
                }
            }
        }
    }

    #[test]
    fn the_vnni_staging_puts_value_4t_plus_u_of_row_r_at_byte_4r_plus_u_of_vector_t() {
        // Staging is plain AVX-512F, so this runs on any CPU with AVX-512, VNNI or not.
        if !Isa::detect().avx512() {
            return;
        }
        for nb in [1, 3, 18] {
            // Stale bytes where the buffer is reused must not show through.
            let mut bytes = vec![0xA5u8; nb * super::super::vnni::STAGED_BLOCK];
            let q8: Vec<BlockQ8_0> = rows16(nb);
            let q4: Vec<BlockQ4_1> = rows16(nb);
            let block = super::super::vnni::STAGED_BLOCK;
            let at = |b: usize, r: usize, i: usize| b * block + (i / 4) * 64 + 4 * r + i % 4;
            // SAFETY: 16 rows of nb blocks, 512 * nb bytes; AVX-512F detected above.
            unsafe { BlockQ8_0::stage_lanes(q8.as_ptr(), nb, bytes.as_mut_ptr()) };
            for (r, b, i) in
                (0..16).flat_map(|r| (0..nb).flat_map(move |b| (0..QK).map(move |i| (r, b, i))))
            {
                let want = (i32::from(q8[r * nb + b].qs[i]) + 128) as u8;
                assert_eq!(bytes[at(b, r, i)], want, "q8_0 row {r} block {b} value {i}");
            }
            bytes.fill(0xA5);
            // SAFETY: as above.
            unsafe { BlockQ4_1::stage_lanes(q4.as_ptr(), nb, bytes.as_mut_ptr()) };
            for (r, b, i) in
                (0..16).flat_map(|r| (0..nb).flat_map(move |b| (0..QK).map(move |i| (r, b, i))))
            {
                let want = nibble(&q4[r * nb + b], i);
                assert_eq!(bytes[at(b, r, i)], want, "q4_1 row {r} block {b} value {i}");
            }
        }
    }

    #[test]
    fn the_simd_quantizers_give_the_portable_blocks() {
        let isa = Isa::detect();
        if isa == Isa::Portable {
            return;
        }
        // Random values, a block of zeros, a block of exact ties (x * 127 / max = n + 0.5) and
        // one of huge and tiny values.
        let mut x: Vec<f32> = (0..64 * QK)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 0.0137)
            .collect();
        x[QK..2 * QK].fill(0.0);
        for (i, v) in x[2 * QK..3 * QK].iter_mut().enumerate() {
            *v = if i == 0 { 127.0 } else { (i % 9) as f32 + 0.5 };
        }
        for (i, v) in x[3 * QK..4 * QK].iter_mut().enumerate() {
            *v = if i % 2 == 0 { 3.0e38 } else { -1.0e-30 };
        }
        let blocks = || vec![BlockQ8x::default(); x.len() / QK];
        let mut a = blocks();
        quantize_x(&x, &mut a);
        let mut simd: Vec<(&str, Vec<BlockQ8x>)> = Vec::new();
        let mut b = blocks();
        // SAFETY: every ISA above Portable has AVX2 and F16C.
        unsafe { quantize_x_avx2(&x, &mut b) };
        simd.push(("avx2", b));
        if isa.avx512() {
            let mut b = blocks();
            // SAFETY: AVX-512F (and F16C, which every AVX-512 CPU has) detected above.
            unsafe { quantize_x_avx512(&x, &mut b) };
            simd.push(("avx512", b));
        }
        for (name, b) in &simd {
            assert_eq!(a.len(), b.len(), "{name}");
            for (i, (p, q)) in a.iter().zip(b).enumerate() {
                assert_eq!(p.qs, q.qs, "{name}: block {i}");
                assert_eq!(
                    (p.d.to_bits(), p.s.to_bits()),
                    (q.d.to_bits(), q.s.to_bits()),
                    "{name}: block {i}"
                );
            }
        }
    }
}

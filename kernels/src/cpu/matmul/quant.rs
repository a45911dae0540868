//! `out = x @ w^T` over block-quantized weights (Q8_0, Q4_1), as llama.cpp computes it:
//!
//! - **GEMV** (decode, and batches up to `QUANT_GEMV_MAX_ROWS` rows): each x row is quantized to 8 bits per 32-value block ([`BlockQ8x`]:
//!   i8 values, a scale `d` and `s = d * sum(q)`, both rounded through f16 as llama.cpp's
//!   `q8_0`/`q8_1` blocks are). A weight block then costs one integer dot product of 32 pairs:
//!   `d_w * d_x * sum(q_w * q_x)`, plus `m_w * s_x` for Q4_1's offset. With AVX2 the 32 products
//!   are one `vpmaddubsw` (u8 x i8 pairs to i16) and one `vpmaddwd` (to eight i32); Q8_0's signed
//!   weights move their sign onto x first (`vpsignb`). The weights stream from memory in their
//!   file size: 5 bits per weight for Q4_1, 8.5 for Q8_0.
//! - **GEMM** (prefill, more rows): compute-bound, so the weights are widened to f32 while the AVX2 GEMM
//!   packs its panels (once per call, then used by every x row) and x stays f32.
//!
//! AVX-512 CPUs run the AVX2 kernels (every CPU with AVX-512 has AVX2). The portable versions
//! do the same integer arithmetic in plain Rust, and give the same result up to float rounding.

use std::cell::RefCell;

use super::{Dims, SharedOut};
use crate::cpu::simd::Isa;
use crate::quant::{BlockQ4_1, BlockQ8_0, QuantBlock, QK};
use half::f16;

/// 32 activations quantized to 8 bits: `x ~ d * qs`, and `s = d * sum(qs)`.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct BlockQ8x {
    pub(super) qs: [i8; QK],
    pub(super) d: f32,
    pub(super) s: f32,
}

thread_local! {
    /// The caller's quantized x rows, reused across calls.
    static XQ: RefCell<Vec<BlockQ8x>> = const { RefCell::new(Vec::new()) };
    /// The same rows packed for the AMX kernel.
    #[cfg(target_arch = "x86_64")]
    static XP: RefCell<Vec<Packed>> = const { RefCell::new(Vec::new()) };
    /// A widened weight row (portable GEMM).
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Quantizes `x` (rows of `k` values, `k` a multiple of 32) into `out`, block by block:
/// `d = max|x| / 127`, `q = round(x / d)` (ties to even, as `vcvtps2dq` rounds).
pub(crate) fn quantize_x(x: &[f32], out: &mut Vec<BlockQ8x>) {
    out.clear();
    out.extend(x.chunks_exact(QK).map(|c| {
        let amax = c.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        // Round to nearest, ties to even, without a libm call: adding 1.5 * 2^23 leaves no
        // fraction bits (|x * id| <= 127), so the default rounding mode does it.
        const ROUND: f32 = 12_582_912.0;
        let qs: [i8; QK] = std::array::from_fn(|i| ((c[i] * id + ROUND) - ROUND) as i8);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        BlockQ8x {
            qs,
            d: f16::from_f32(d).to_f32(),
            s: f16::from_f32(d * sum as f32).to_f32(),
        }
    }));
}

/// [`quantize_x`] with AVX-512: the same arithmetic (the same products `x * id`, rounded to
/// nearest even by `vcvtps2dq`), so the same blocks.
///
/// # Safety
/// The CPU must support AVX-512F and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn quantize_x_avx512(x: &[f32], out: &mut Vec<BlockQ8x>) {
    use std::arch::x86_64::*;
    let f16_round = |v: f32| {
        // Through f16 and back, rounding to nearest even as `f16::from_f32` does.
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v));
        _mm_cvtss_f32(_mm_cvtph_ps(h))
    };
    out.clear();
    out.extend(x.chunks_exact(QK).map(|c| {
        // SAFETY: c holds 32 values; AVX-512F per the caller.
        unsafe {
            let lo = _mm512_loadu_ps(c.as_ptr());
            let hi = _mm512_loadu_ps(c.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));
            let qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            let mut qs = [0i8; QK];
            _mm_storeu_si128(qs.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(qhi));
            BlockQ8x {
                qs,
                d: f16_round(d),
                s: f16_round(d * sum as f32),
            }
        }
    }));
}

/// A weight block format the quantized kernels multiply.
pub(crate) trait QDot: QuantBlock {
    /// `sum(w_i * x_i)` over the block, in integer arithmetic (portable).
    fn dot(&self, x: &BlockQ8x) -> f32;

    /// Whether blocks carry an offset `m` (Q4_1) besides the scale.
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

    /// Eight i32 partial sums of `w_i * x_i` for [`QDot::weights256`]'s bytes and 32 i8 x.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn idot256(
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
    const SIGNED: bool;

    /// The 16 rows of `nb` blocks at `w` as the AMX tile loads read them: block `b` of the 16
    /// rows is 16 rows of 32 bytes at `base + b * block_step`, `stride` bytes apart. Returns
    /// `(base, block_step, stride)`; formats stored otherwise are unpacked into `bytes`.
    ///
    /// # Safety
    /// `w` must point to 16 rows of `nb` blocks.
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
    /// CPU must support F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn amx_scales(w: *const Self, nb: usize, dw: *mut f32, mw: *mut f32);
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
    unsafe fn idot256(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: register-only AVX2; |w| * (x * sign w) = w * x, and two products of at most
        // 128 * 127 fit vpmaddubsw's i16 sums.
        unsafe {
            let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
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
    unsafe fn amx_scales(w: *const Self, nb: usize, dw: *mut f32, _: *mut f32) {
        for r in 0..16 {
            for b in 0..nb {
                // SAFETY: per the caller: 16 rows of nb blocks, 16 * nb scales, F16C.
                unsafe { *dw.add(b * 16 + r) = f16_bits((*w.add(r * nb + b)).d.to_bits()) };
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
    unsafe fn idot256(
        w: std::arch::x86_64::__m256i,
        x: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: register-only AVX2; nibbles are u8 0..=15, so pair sums fit i16.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)) }
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
    unsafe fn amx_stage(
        w: *const Self,
        nb: usize,
        bytes: &mut Vec<u8>,
    ) -> (*const u8, usize, usize) {
        // Block b of row r at bytes[(b * 16 + r) * 32..]: its 16 low nibbles (values 0..16),
        // then its 16 high ones.
        use std::arch::x86_64::*;
        bytes.resize(nb * 16 * QK, 0);
        let out = bytes.as_mut_ptr();
        for r in 0..16 {
            for b in 0..nb {
                // SAFETY: per the caller, 16 rows of nb blocks; the 32 bytes written are block
                // b of row r in `bytes` (16 * nb blocks of 32). SSE2 is part of x86_64.
                unsafe {
                    let q = _mm_loadu_si128((*w.add(r * nb + b)).qs.as_ptr().cast());
                    let nibble = _mm_set1_epi8(15);
                    let dst = out.add((b * 16 + r) * QK);
                    _mm_storeu_si128(dst.cast(), _mm_and_si128(q, nibble));
                    _mm_storeu_si128(
                        dst.add(QK / 2).cast(),
                        _mm_and_si128(_mm_srli_epi16::<4>(q), nibble),
                    );
                }
            }
        }
        (out.cast_const(), 16 * QK, QK)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn amx_scales(w: *const Self, nb: usize, dw: *mut f32, mw: *mut f32) {
        for r in 0..16 {
            for b in 0..nb {
                // SAFETY: per the caller: 16 rows of nb blocks, 16 * nb scales each, F16C.
                unsafe {
                    let blk = &*w.add(r * nb + b);
                    *dw.add(b * 16 + r) = f16_bits(blk.d.to_bits());
                    *mw.add(b * 16 + r) = f16_bits(blk.m.to_bits());
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

/// Runs `f` with `x` quantized (on the calling thread, into a buffer reused across calls), and,
/// when `amx` is set, also packed for the AMX kernel (`m` rows of `k` values).
pub(super) fn with_quantized_x<R>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    amx: bool,
    f: impl FnOnce(&[BlockQ8x], &[Packed]) -> R,
) -> R {
    XQ.with(|cell| {
        let mut xq = cell.borrow_mut();
        #[cfg(target_arch = "x86_64")]
        if isa.avx512() {
            // SAFETY: the AVX-512 ISAs are only chosen with AVX-512F and F16C.
            unsafe { quantize_x_avx512(x, &mut xq) };
        } else {
            quantize_x(x, &mut xq);
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = isa;
            quantize_x(x, &mut xq);
        }
        #[cfg(target_arch = "x86_64")]
        if amx {
            return XP.with(|packed| {
                let mut xp = packed.borrow_mut();
                super::amx::pack_x(&xq, m, k / QK, &mut xp);
                f(&xq, &xp)
            });
        }
        let _ = (m, k, amx);
        f(&xq, &[])
    })
}

/// x rows packed for the AMX kernel.
#[cfg(target_arch = "x86_64")]
pub(super) type Packed = super::amx::PackedX;
/// x rows packed for the AMX kernel (none off x86_64).
#[cfg(not(target_arch = "x86_64"))]
pub(super) type Packed = ();

/// Columns `n0..n1` of `out = x @ w^T` for small m, x already quantized.
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
    debug_assert!(xq.len() >= d.m * nb && w.len() >= d.n * nb);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && !xp.is_empty() {
        // Whole tiles of 16 weight rows on the tile unit, the rest as below.
        let tiles = n0 + (n1 - n0) / 16 * 16;
        // SAFETY: Isa::Amx is only chosen with AVX-512F/BW, AMX-INT8 and its state enabled; xp
        // is x packed (with_quantized_x); shapes per the caller.
        unsafe {
            super::amx::gemm(xp, w, d, n0, tiles, out.0);
            if tiles < n1 {
                avx2_range(xq, w, d, tiles, n1, out.0);
            }
        }
        return;
    }
    let _ = xp;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: every ISA above Portable has AVX2/FMA/F16C; shapes per the caller.
        unsafe { avx2_range(xq, w, d, n0, n1, out.0) };
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

/// Columns `n0..n1` of `out = x @ w^T` for many rows: f32 x against widened weights.
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

/// From this many x rows the AVX2 kernel stages each tile of weight rows once ([`Stage`]) and
/// multiplies every x row by the staged copy; fewer rows stream the weights ([`gemv_avx2`]).
pub(super) const STAGED_MIN_ROWS: usize = 4;

/// Columns `n0..n1` of `out = x @ w^T` with AVX2, staged or streamed by the number of rows.
///
/// # Safety
/// As for [`gemv_avx2`].
#[cfg(target_arch = "x86_64")]
unsafe fn avx2_range<B: QDot>(
    xq: &[BlockQ8x],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    if d.m >= STAGED_MIN_ROWS {
        // SAFETY: forwarded from the caller.
        STAGE
            .with(|cell| unsafe { gemm_staged_avx2(&mut cell.borrow_mut(), xq, w, d, n0, n1, out) })
    } else {
        // SAFETY: forwarded from the caller.
        unsafe { gemv_avx2(xq, w, d, n0, n1, out) }
    }
}

/// Weight rows per staged tile.
#[cfg(target_arch = "x86_64")]
const STAGED_COLS: usize = 4;

/// One tile of [`STAGED_COLS`] weight rows as the staged kernel reads it, block-major
/// (`[b * STAGED_COLS + c]` for row c's block b): the 32 weights as bytes ready for
/// `vpmaddubsw` (Q4_1's nibbles unpacked, Q8_0's magnitudes), Q8_0's signed bytes (which move
/// their sign onto x), and the scales and offsets widened to f32.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct Stage {
    bytes: Vec<std::arch::x86_64::__m256i>,
    signs: Vec<std::arch::x86_64::__m256i>,
    d: Vec<f32>,
    m: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static STAGE: RefCell<Stage> = RefCell::new(Stage::default());
}

#[cfg(target_arch = "x86_64")]
impl Stage {
    /// Stages the `STAGED_COLS` rows of `nb` blocks at `w`, and prefetches the `next` tile's
    /// bytes into L2 while the x rows are multiplied by this one.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fill<B: QDot>(&mut self, w: *const B, nb: usize, next: bool) {
        use std::arch::x86_64::*;
        let len = nb * STAGED_COLS;
        self.bytes.resize(len, _mm256_setzero_si256());
        self.d.resize(len, 0.0);
        self.m.resize(len, 0.0);
        if B::SIGNED {
            self.signs.resize(len, _mm256_setzero_si256());
        }
        // SAFETY: w holds STAGED_COLS rows of nb blocks per the caller; AVX2/F16C likewise.
        unsafe {
            for c in 0..STAGED_COLS {
                for b in 0..nb {
                    let blk = &*w.add(c * nb + b);
                    let (q, sc) = (blk.weights256(), blk.scales128());
                    let at = b * STAGED_COLS + c;
                    if B::SIGNED {
                        self.bytes[at] = _mm256_sign_epi8(q, q);
                        self.signs[at] = q;
                    } else {
                        self.bytes[at] = q;
                    }
                    self.d[at] = _mm_cvtss_f32(sc);
                    self.m[at] = _mm_cvtss_f32(_mm_movehdup_ps(sc));
                }
            }
            if next {
                let bytes = len * std::mem::size_of::<B>();
                let mut next = super::NextTile::new(w, bytes, true);
                next.keep_up(bytes);
            }
        }
    }
}

/// Columns `n0..n1` of `out = x @ w^T` for a batch of x rows: each tile of 4 weight rows is
/// staged once ([`Stage`]: unpacked, scales widened), then multiplied by 2 x rows at a time.
/// Per block pair that leaves `vpmaddubsw`, `vpmaddwd`, the conversion and one scaled add (Q8_0
/// adds a `vpsignb`); Q4_1's offsets `m_w * s_x` are summed apart, 4 weight rows per add.
///
/// # Safety
/// As for [`gemv_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_staged_avx2<B: QDot>(
    stage: &mut Stage,
    xq: &[BlockQ8x],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    let nb = d.k / QK;
    let tiles = n0 + (n1 - n0) / STAGED_COLS * STAGED_COLS;
    let mut j = n0;
    // SAFETY: rows i..i+2 of xq and j..j+4 of w exist (nb blocks each); out is valid per the
    // caller; AVX2/FMA/F16C per the caller.
    unsafe {
        while j < tiles {
            stage.fill(w.as_ptr().add(j * nb), nb, j + STAGED_COLS < tiles);
            let mut i = 0;
            while i < d.m {
                let (xt, ot) = (xq.as_ptr().add(i * nb), out.add(i * d.n + j));
                if d.m - i >= 2 {
                    staged_tile::<B, 2>(xt, stage, nb, ot, d.n);
                    i += 2;
                } else {
                    staged_tile::<B, 1>(xt, stage, nb, ot, d.n);
                    i += 1;
                }
            }
            j += STAGED_COLS;
        }
        if tiles < n1 {
            gemv_avx2(xq, w, d, tiles, n1, out);
        }
    }
}

/// `out[r * ldo + c] = dot(x row r, staged row c)` for `R` x rows and the staged tile.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
// Indexed loops: each staged block stays in a register while it meets every x row.
#[allow(clippy::needless_range_loop)]
unsafe fn staged_tile<B: QDot, const R: usize>(
    x: *const BlockQ8x,
    stage: &Stage,
    nb: usize,
    out: *mut f32,
    ldo: usize,
) {
    use crate::cpu::simd::hsum256;
    use std::arch::x86_64::*;
    const C: usize = STAGED_COLS;
    // SAFETY (whole body): the caller guarantees R rows of x of nb blocks, a staged tile of
    // nb blocks, an R x C output tile at `out` with row stride `ldo`, and AVX2/FMA/F16C.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        // Few values live beside the 8 accumulators (the x bytes, the constant), so that none
        // of them spills: the scales are broadcast from memory where they are used.
        for b in 0..nb {
            let mut xv = [_mm256_setzero_si256(); R];
            for (r, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_si256((*x.add(r * nb + b)).qs.as_ptr().cast());
            }
            for c in 0..C {
                let at = b * C + c;
                let wb = *stage.bytes.get_unchecked(at);
                for r in 0..R {
                    let q = if B::SIGNED {
                        _mm256_sign_epi8(xv[r], *stage.signs.get_unchecked(at))
                    } else {
                        xv[r]
                    };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wb, q), ones);
                    let scale = _mm256_mul_ps(
                        _mm256_broadcast_ss(stage.d.get_unchecked(at)),
                        _mm256_broadcast_ss(&(*x.add(r * nb + b)).d),
                    );
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][c]);
                }
            }
        }
        // Q4_1's offsets for the 4 weight rows, per x row: `sum_b m_w * s_x`.
        let mut offsets = [_mm_setzero_ps(); R];
        if B::HAS_OFFSET {
            for (r, off) in offsets.iter_mut().enumerate() {
                for b in 0..nb {
                    let m = _mm_loadu_ps(stage.m.as_ptr().add(b * C));
                    *off = _mm_fmadd_ps(m, _mm_set1_ps((*x.add(r * nb + b)).s), *off);
                }
            }
        }
        for r in 0..R {
            let mut offs = [0.0f32; C];
            _mm_storeu_ps(offs.as_mut_ptr(), offsets[r]);
            for c in 0..C {
                *out.add(r * ldo + c) = hsum256(acc[r][c]) + offs[c];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_avx2<B: QDot>(
    xq: &[BlockQ8x],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    let nb = d.k / QK;
    let (xp, wp) = (xq.as_ptr(), w.as_ptr());
    let mut j = n0;
    while j < n1 {
        let nr = if n1 - j >= 4 { 4 } else { 1 };
        let mut i = 0;
        while i < d.m {
            let mr = (d.m - i).min(2);
            // SAFETY: rows i..i+mr of xq and j..j+nr of w exist (nb blocks each); out is
            // valid per the caller.
            unsafe {
                let (xt, wt, ot) = (xp.add(i * nb), wp.add(j * nb), out.add(i * d.n + j));
                match (mr, nr) {
                    (2, 4) => qtile::<B, 2, 4>(xt, wt, nb, ot, d.n, i == 0),
                    (1, 4) => qtile::<B, 1, 4>(xt, wt, nb, ot, d.n, i == 0),
                    (2, _) => qtile::<B, 2, 1>(xt, wt, nb, ot, d.n, i == 0),
                    _ => qtile::<B, 1, 1>(xt, wt, nb, ot, d.n, i == 0),
                }
            }
            i += mr;
        }
        j += nr;
    }
}

/// `out[r * ldo + c] = dot(x row r, w row c)` for an `R x C` tile of rows `nb` blocks long.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn qtile<B: QDot, const R: usize, const C: usize>(
    x: *const BlockQ8x,
    w: *const B,
    nb: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
) {
    use crate::cpu::simd::hsum256;
    use std::arch::x86_64::*;
    // SAFETY (whole body): the caller guarantees R rows of x and C rows of w, nb blocks each,
    // an R x C output tile at `out` with row stride `ldo`, and AVX2/FMA/F16C.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let column_bytes = C * std::mem::size_of::<B>();
        let mut next = super::NextTile::new(w, nb * column_bytes, prefetch);
        for b in 0..nb {
            next.keep_up((b + 1) * column_bytes);
            let mut wv = [_mm256_setzero_si256(); C];
            let mut sc = [_mm_setzero_ps(); C];
            for c in 0..C {
                let blk = &*w.add(c * nb + b);
                wv[c] = blk.weights256();
                sc[c] = blk.scales128();
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                let xb = &*x.add(r * nb + b);
                let xv = _mm256_loadu_si256(xb.qs.as_ptr().cast());
                // [d_x, s_x, 0, 0]: the two floats after qs.
                let xds = _mm_castpd_ps(_mm_load_sd((&xb.d as *const f32).cast()));
                for c in 0..C {
                    // [d_w * d_x, m_w * s_x, 0, 0].
                    let prod = _mm_mul_ps(sc[c], xds);
                    let p = _mm256_cvtepi32_ps(B::idot256(wv[c], xv));
                    accr[c] = _mm256_fmadd_ps(p, _mm256_broadcastss_ps(prod), accr[c]);
                    if B::HAS_OFFSET {
                        // m_w * s_x into lane 0 (the lanes are summed at the end): source
                        // lane 1 to lane 0, the other lanes zeroed.
                        let off = _mm_insert_ps::<0b0100_1110>(prod, prod);
                        accr[c] = _mm256_add_ps(accr[c], _mm256_zextps128_ps256(off));
                    }
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            for (c, &a) in accr.iter().enumerate() {
                *out.add(r * ldo + c) = hsum256(a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_avx512_quantizer_gives_the_portable_blocks() {
        if !Isa::detect().avx512() {
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
        let (mut a, mut b) = (Vec::new(), Vec::new());
        quantize_x(&x, &mut a);
        // SAFETY: AVX-512F (and F16C, which every AVX-512 CPU has) detected above.
        unsafe { quantize_x_avx512(&x, &mut b) };
        assert_eq!(a.len(), b.len());
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert_eq!(p.qs, q.qs, "block {i}");
            assert_eq!(
                (p.d.to_bits(), p.s.to_bits()),
                (q.d.to_bits(), q.s.to_bits()),
                "block {i}"
            );
        }
    }
}

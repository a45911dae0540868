//! The quantized GEMV's AVX2 kernels (every x86_64 ISA above portable runs them, and AMX CPUs
//! for the columns left over from whole 16-row tiles).
//!
//! - Fewer than [`STAGED_MIN_ROWS`] x rows (decode of one sequence: bound by reading the
//!   weights): register tiles of 1-2 x rows by 4 weight rows stream the weights once, and each
//!   tile prefetches the next into L2 ([`gemv`]).
//! - A batch (bound by the arithmetic): each tile of 4 weight rows is staged once ([`Stage`]),
//!   then every pair of x rows is multiplied by the staged copy ([`gemm_staged`]).
//!
//! On AVX-512 CPUs with VNNI (Ice Lake, Sapphire Rapids, Zen 4), both take one `vpdpbusd` in
//! place of the `vpmaddubsw`/`vpmaddwd` pair ([`gemv_vnni`], [`gemm_staged_vnni`]): the same
//! exact i32 sums (no pair of products here can saturate `vpmaddubsw`'s i16), one instruction
//! fewer per block and x row.

use std::cell::RefCell;

use super::super::Dims;
use super::{BlockQ8x, QDot};
use crate::quant::QK;

/// From this many x rows the AVX2 kernel stages each tile of weight rows once ([`Stage`]) and
/// multiplies every x row by the staged copy; fewer rows stream the weights ([`gemv`]).
const STAGED_MIN_ROWS: usize = 4;

/// Columns `n0..n1` of `out = x @ w^T` with AVX2, staged or streamed by the number of rows;
/// `vnni`: the block sums take `vpdpbusd` (only where [`crate::cpu::Isa::vnni`] holds).
///
/// # Safety
/// As for [`gemv`].
pub(super) unsafe fn range<B: QDot>(
    xq: &[BlockQ8x],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
    vnni: bool,
) {
    let batch = Batch {
        xq,
        w,
        d,
        n0,
        n1,
        out,
    };
    let staged = d.m >= STAGED_MIN_ROWS;
    // SAFETY: forwarded from the caller, VNNI checked by the caller when asked for.
    unsafe {
        match (staged, vnni) {
            (true, true) => STAGE.with(|c| gemm_staged_vnni(&mut c.borrow_mut(), &batch)),
            (true, false) => STAGE.with(|c| gemm_staged(&mut c.borrow_mut(), &batch)),
            (false, true) => gemv_vnni(&batch),
            (false, false) => gemv(&batch),
        }
    }
}

/// Weight rows per staged tile.
const STAGED_COLS: usize = 4;
/// x rows per register tile of the staged kernel (8 accumulators with [`STAGED_COLS`]).
const STAGED_ROWS: usize = 2;

/// One tile of [`STAGED_COLS`] weight rows as the staged kernel reads it, block-major
/// (`[b * STAGED_COLS + c]` for row c's block b): the 32 weights as bytes ready for
/// `vpmaddubsw` (Q4_1's nibbles unpacked, Q8_0's magnitudes), Q8_0's signed bytes (which move
/// their sign onto x), and the scales and offsets widened to f32.
#[derive(Default)]
struct Stage {
    bytes: Vec<std::arch::x86_64::__m256i>,
    signs: Vec<std::arch::x86_64::__m256i>,
    d: Vec<f32>,
    m: Vec<f32>,
}

thread_local! {
    static STAGE: RefCell<Stage> = RefCell::new(Stage::default());
}

impl Stage {
    /// Stages the `STAGED_COLS` rows of `nb` blocks at `w`, and prefetches the `next` tile's
    /// bytes into L2 while the x rows are multiplied by this one.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fill<B: QDot>(&mut self, w: *const B, nb: usize, next: bool) {
        use std::arch::x86_64::*;
        let len = nb * STAGED_COLS;
        self.bytes.resize(len, _mm256_setzero_si256());
        self.d.resize(len, 0.0);
        if B::HAS_OFFSET {
            self.m.resize(len, 0.0);
        }
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
                    if B::HAS_OFFSET {
                        self.m[at] = _mm_cvtss_f32(_mm_movehdup_ps(sc));
                    }
                }
            }
            if next {
                let bytes = len * std::mem::size_of::<B>();
                let mut next = super::super::NextTile::new(w, bytes, true);
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
/// As for [`gemv`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_staged<B: QDot>(stage: &mut Stage, batch: &Batch<'_, B>) {
    // SAFETY: forwarded from the caller.
    unsafe { staged_tiles::<B, false>(stage, batch) }
}

/// [`gemm_staged`] with each block's sums from `vpdpbusd`.
///
/// # Safety
/// As for [`gemv`], and the CPU must have AVX-512 VNNI and VL ([`crate::cpu::Isa::vnni`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn gemm_staged_vnni<B: QDot>(stage: &mut Stage, batch: &Batch<'_, B>) {
    // SAFETY: forwarded from the caller.
    unsafe { staged_tiles::<B, true>(stage, batch) }
}

/// The operands of a staged batch: columns `n0..n1` of `out = x @ w^T`, x quantized.
struct Batch<'a, B> {
    xq: &'a [BlockQ8x],
    w: &'a [B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
}

/// The body of [`gemm_staged`] and [`gemm_staged_vnni`], inlined into each with its features.
#[inline(always)]
unsafe fn staged_tiles<B: QDot, const VNNI: bool>(stage: &mut Stage, batch: &Batch<'_, B>) {
    let Batch {
        xq,
        w,
        d,
        n0,
        n1,
        out,
    } = *batch;
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
                if d.m - i >= STAGED_ROWS {
                    staged_tile::<B, STAGED_ROWS, VNNI>(xt, stage, nb, ot, d.n);
                    i += STAGED_ROWS;
                } else {
                    staged_tile::<B, 1, VNNI>(xt, stage, nb, ot, d.n);
                    i += 1;
                }
            }
            j += STAGED_COLS;
        }
        if tiles < n1 {
            gemv_tiles::<B, VNNI>(&Batch {
                n0: tiles,
                ..*batch
            });
        }
    }
}

/// `out[r * ldo + c] = dot(x row r, staged row c)` for `R` x rows and the staged tile.
#[inline(always)]
// Indexed loops: each staged block stays in a register while it meets every x row.
#[allow(clippy::needless_range_loop)]
unsafe fn staged_tile<B: QDot, const R: usize, const VNNI: bool>(
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
        // The block's R x C scales `d_w * d_x`, four to a multiply, then broadcast from memory
        // where they are used: few values live beside the 8 accumulators (the x bytes, the
        // constant), so that none of them spills.
        const { assert!(R <= STAGED_ROWS) };
        let mut scales = [0.0f32; STAGED_ROWS * C];
        for b in 0..nb {
            let dw = _mm_loadu_ps(stage.d.as_ptr().add(b * C));
            let mut xv = [_mm256_setzero_si256(); R];
            for (r, v) in xv.iter_mut().enumerate() {
                let xb = &*x.add(r * nb + b);
                *v = _mm256_loadu_si256(xb.qs.as_ptr().cast());
                _mm_storeu_ps(
                    scales.as_mut_ptr().add(r * C),
                    _mm_mul_ps(dw, _mm_set1_ps(xb.d)),
                );
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
                    let p = if VNNI {
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), wb, q)
                    } else {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(wb, q), ones)
                    };
                    let scale = _mm256_broadcast_ss(scales.get_unchecked(r * C + c));
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

/// Columns `n0..n1` of `out = x @ w^T` streamed: register tiles of 1-2 x rows by 4 weight rows.
///
/// # Safety
/// `xq` holds `m` rows of `k / 32` blocks, `w` holds `n` rows of them, `out` points to `m * n`
/// f32s of which this call may write columns `n0..n1`, and the CPU supports AVX2/FMA/F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<B: QDot>(batch: &Batch<'_, B>) {
    // SAFETY: forwarded from the caller.
    unsafe { gemv_tiles::<B, false>(batch) }
}

/// [`gemv`] with each block's sums from `vpdpbusd`.
///
/// # Safety
/// As for [`gemv`], and the CPU must have AVX-512 VNNI and VL ([`crate::cpu::Isa::vnni`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn gemv_vnni<B: QDot>(batch: &Batch<'_, B>) {
    // SAFETY: forwarded from the caller.
    unsafe { gemv_tiles::<B, true>(batch) }
}

/// The body of [`gemv`] and [`gemv_vnni`], inlined into each with its features.
#[inline(always)]
unsafe fn gemv_tiles<B: QDot, const VNNI: bool>(batch: &Batch<'_, B>) {
    let (xq, w, d, n0, n1, out) = (batch.xq, batch.w, batch.d, batch.n0, batch.n1, batch.out);
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
                    (2, 4) => qtile::<B, 2, 4, VNNI>(xt, wt, nb, ot, d.n, i == 0),
                    (1, 4) => qtile::<B, 1, 4, VNNI>(xt, wt, nb, ot, d.n, i == 0),
                    (2, _) => qtile::<B, 2, 1, VNNI>(xt, wt, nb, ot, d.n, i == 0),
                    _ => qtile::<B, 1, 1, VNNI>(xt, wt, nb, ot, d.n, i == 0),
                }
            }
            i += mr;
        }
        j += nr;
    }
}

/// `out[r * ldo + c] = dot(x row r, w row c)` for an `R x C` tile of rows `nb` blocks long.
#[inline(always)]
unsafe fn qtile<B: QDot, const R: usize, const C: usize, const VNNI: bool>(
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
        let mut next = super::super::NextTile::new(w, nb * column_bytes, prefetch);
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
                    let p = _mm256_cvtepi32_ps(B::idot256::<VNNI>(wv[c], xv));
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

//! AVX-512 matmul kernels: a bandwidth-bound GEMV (dot-product register tiles, weights widened
//! in registers) and a compute-bound GEMM (packed `w^T` blocks, 12 x 32 outer-product
//! microkernel). See the parent module for when each runs.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{Dims, NextTile};
use crate::cpu::simd::{load_partial, reduce16, Elem};

/// Depth of a packed block: a 32-column panel of it (32 KiB) stays in L1 across x tiles.
const KC_TARGET: usize = 256;
/// Rows of x per microkernel call (24 accumulators + 2 panel vectors + 1 broadcast).
const MR: usize = 12;
/// Rows of x per L2 block.
const MC: usize = 12 * MR;

thread_local! {
    /// Per-thread packing buffer, reused across calls.
    static PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// GEMV: columns `n0..n1` of `out = x @ w^T` for small m.
///
/// # Safety
/// The CPU must support AVX-512F, FMA and F16C; `x` holds `m * k` values, `w` holds `n * k`,
/// and `out` points to `m * n` f32s of which this call may write columns `n0..n1`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn gemv<E: Elem>(
    x: &[f32],
    w: &[E],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut j = n0;
    while j < n1 {
        // One token: eight weight rows per tile, for more independent loads in flight.
        if d.m == 1 && n1 - j >= 8 {
            // SAFETY: row 0 of x and rows j..j+8 of w exist; out is valid per the caller.
            unsafe { dot_tile::<E, 1, 8>(xp, wp.add(j * d.k), d.k, out.add(j), d.n, true) };
            j += 8;
            continue;
        }
        let nr = if n1 - j >= 4 { 4 } else { 1 };
        let mut i = 0;
        while i < d.m {
            let mr = (d.m - i).min(4);
            // SAFETY: rows i..i+mr of x and j..j+nr of w exist; out is valid per the caller.
            unsafe {
                let (xt, wt, ot) = (xp.add(i * d.k), wp.add(j * d.k), out.add(i * d.n + j));
                match (mr, nr) {
                    (4, 4) => dot_tile::<E, 4, 4>(xt, wt, d.k, ot, d.n, i == 0),
                    (3, 4) => dot_tile::<E, 3, 4>(xt, wt, d.k, ot, d.n, i == 0),
                    (2, 4) => dot_tile::<E, 2, 4>(xt, wt, d.k, ot, d.n, i == 0),
                    (1, 4) => dot_tile::<E, 1, 4>(xt, wt, d.k, ot, d.n, i == 0),
                    (4, _) => dot_tile::<E, 4, 1>(xt, wt, d.k, ot, d.n, i == 0),
                    (3, _) => dot_tile::<E, 3, 1>(xt, wt, d.k, ot, d.n, i == 0),
                    (2, _) => dot_tile::<E, 2, 1>(xt, wt, d.k, ot, d.n, i == 0),
                    _ => dot_tile::<E, 1, 1>(xt, wt, d.k, ot, d.n, i == 0),
                }
            }
            i += mr;
        }
        j += nr;
    }
}

/// `out[r * ldo + c] = dot(x row r, w row c)` for an `R x C` tile; rows are `k` long. With
/// `prefetch`, the next tile's weights are prefetched while this one is read ([`NextTile`]).
#[inline(always)]
unsafe fn dot_tile<E: Elem, const R: usize, const C: usize>(
    x: *const f32,
    w: *const E,
    k: usize,
    out: *mut f32,
    ldo: usize,
    prefetch: bool,
) {
    // SAFETY (whole body): the caller guarantees R rows of x and C rows of w, each k long, an
    // R x C output tile at `out` with row stride `ldo`, and AVX-512F/F16C.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut wv = [_mm512_setzero_ps(); C];
        let k16 = k & !15;
        let mut next = NextTile::new(w, C * k * std::mem::size_of::<E>(), prefetch);
        let mut p = 0;
        while p < k16 {
            next.keep_up((p + 16) * C * std::mem::size_of::<E>());
            for (c, v) in wv.iter_mut().enumerate() {
                *v = E::load16(w.add(c * k + p));
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add(r * k + p));
                for c in 0..C {
                    accr[c] = _mm512_fmadd_ps(xv, wv[c], accr[c]);
                }
            }
            p += 16;
        }
        if p < k {
            let tail = k - p;
            for (c, v) in wv.iter_mut().enumerate() {
                *v = load_partial(w.add(c * k + p), tail);
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                let xv = load_partial(x.add(r * k + p), tail);
                for c in 0..C {
                    accr[c] = _mm512_fmadd_ps(xv, wv[c], accr[c]);
                }
            }
        }
        if R == 4 && C == 4 {
            let mut all = [_mm512_setzero_ps(); 16];
            for (i, v) in all.iter_mut().enumerate() {
                *v = acc[i / 4][i % 4];
            }
            let s = reduce16(&all);
            _mm_storeu_ps(out, _mm512_extractf32x4_ps::<0>(s));
            _mm_storeu_ps(out.add(ldo), _mm512_extractf32x4_ps::<1>(s));
            _mm_storeu_ps(out.add(2 * ldo), _mm512_extractf32x4_ps::<2>(s));
            _mm_storeu_ps(out.add(3 * ldo), _mm512_extractf32x4_ps::<3>(s));
        } else {
            for (r, accr) in acc.iter().enumerate() {
                for (c, &a) in accr.iter().enumerate() {
                    *out.add(r * ldo + c) = _mm512_reduce_add_ps(a);
                }
            }
        }
    }
}

/// GEMM: columns `n0..n1` of `out = x @ w^T`, for many rows of x.
///
/// # Safety
/// As for [`gemv`].
pub(super) unsafe fn gemm<E: Elem>(
    x: &[f32],
    w: &[E],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    if transposed_x(d.m) {
        // SAFETY: forwarded from the caller.
        return unsafe { gemm_xt(x, w, d, n0, n1, out) };
    }
    let kc_max = d.k.div_ceil(d.k.div_ceil(KC_TARGET)).next_multiple_of(16);
    let panels = (n1 - n0).div_ceil(32);
    // 16 spare floats let the packed block start on a 64-byte boundary.
    let needed = panels * kc_max * 32 + 16;
    PACK.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < needed {
            buf.resize(needed, 0.0);
        }
        let start = buf.as_ptr().align_offset(64).min(16);
        let block = &mut buf[start..start + needed - 16];
        // SAFETY: forwarded from the caller; `block` holds panels * kc_max * 32 floats.
        unsafe { gemm_packed(x, w, d, n0, n1, out, block, kc_max) }
    });
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_packed<E: Elem>(
    x: &[f32],
    w: &[E],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
    buf: &mut [f32],
    kc_max: usize,
) {
    let panels = (n1 - n0).div_ceil(32);
    let mut p0 = 0;
    while p0 < d.k {
        let kc = kc_max.min(d.k - p0);
        // SAFETY: w has n * k values; buf has panels * kc_max * 32 >= panels * kc * 32.
        unsafe { pack_block(w, d.k, n0, n1, p0, kc, 32, buf.as_mut_ptr()) };
        let mut i0 = 0;
        while i0 < d.m {
            let mc = MC.min(d.m - i0);
            for q in 0..panels {
                let j = n0 + q * 32;
                let ncols = (n1 - j).min(32);
                let mut i = i0;
                while i < i0 + mc {
                    let mr = (i0 + mc - i).min(MR);
                    // SAFETY: rows i..i+mr of x exist (columns p0..p0+kc); panel q holds
                    // kc x 32 packed values; the out tile is inside this task's columns.
                    unsafe {
                        let a = x.as_ptr().add(i * d.k + p0);
                        let b = buf.as_ptr().add(q * kc * 32);
                        let c = out.add(i * d.n + j);
                        micro_dispatch(mr, a, d.k, b, kc, c, d.n, ncols, p0 == 0);
                    }
                    i += mr;
                }
            }
            i0 += mc;
        }
        p0 += kc;
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_dispatch(
    mr: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    ncols: usize,
    first: bool,
) {
    // SAFETY: forwarded from the caller, with mr rows.
    unsafe {
        match mr {
            12 => micro::<12>(a, lda, b, kc, c, ldc, ncols, first),
            11 => micro::<11>(a, lda, b, kc, c, ldc, ncols, first),
            10 => micro::<10>(a, lda, b, kc, c, ldc, ncols, first),
            9 => micro::<9>(a, lda, b, kc, c, ldc, ncols, first),
            8 => micro::<8>(a, lda, b, kc, c, ldc, ncols, first),
            7 => micro::<7>(a, lda, b, kc, c, ldc, ncols, first),
            6 => micro::<6>(a, lda, b, kc, c, ldc, ncols, first),
            5 => micro::<5>(a, lda, b, kc, c, ldc, ncols, first),
            4 => micro::<4>(a, lda, b, kc, c, ldc, ncols, first),
            3 => micro::<3>(a, lda, b, kc, c, ldc, ncols, first),
            2 => micro::<2>(a, lda, b, kc, c, ldc, ncols, first),
            _ => micro::<1>(a, lda, b, kc, c, ldc, ncols, first),
        }
    }
}

/// `C[R x ncols] (+)= A[R x kc] * B[kc x 32]`: A rows with stride `lda`, B a packed panel,
/// C rows with stride `ldc`; `first` overwrites C instead of adding to it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<const R: usize>(
    a: *const f32,
    lda: usize,
    b: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    ncols: usize,
    first: bool,
) {
    // SAFETY (whole body): the caller guarantees R rows of A (kc long), a kc x 32 panel at b,
    // and R rows of C with ncols writable columns; masked loads and stores touch only those.
    unsafe {
        let mut acc0 = [_mm512_setzero_ps(); R];
        let mut acc1 = [_mm512_setzero_ps(); R];
        for p in 0..kc {
            let b0 = _mm512_loadu_ps(b.add(p * 32));
            let b1 = _mm512_loadu_ps(b.add(p * 32 + 16));
            for r in 0..R {
                let av = _mm512_set1_ps(*a.add(r * lda + p));
                acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
            }
        }
        let m0: __mmask16 = if ncols >= 16 {
            0xffff
        } else {
            (1u16 << ncols) - 1
        };
        let m1: __mmask16 = match ncols {
            32.. => 0xffff,
            17..=31 => (1u16 << (ncols - 16)) - 1,
            _ => 0,
        };
        for r in 0..R {
            let cr = c.add(r * ldc);
            if !first {
                acc0[r] = _mm512_add_ps(acc0[r], _mm512_maskz_loadu_ps(m0, cr));
                acc1[r] = _mm512_add_ps(acc1[r], _mm512_maskz_loadu_ps(m1, cr.add(16)));
            }
            _mm512_mask_storeu_ps(cr, m0, acc0[r]);
            _mm512_mask_storeu_ps(cr.add(16), m1, acc1[r]);
        }
    }
}

/// Most x rows the transposed-x GEMM ([`gemm_xt`]) takes: up to four vectors of them per
/// weight value.
const XT_MAX_ROWS: usize = 64;

/// Whether [`gemm`] runs `m` rows of x as a batch of decodes ([`gemm_xt`]).
fn transposed_x(m: usize) -> bool {
    m <= XT_MAX_ROWS
}
/// Most bytes of x^T per k block of [`gemm_xt`] (in L2).
const XT_BYTES: usize = 384 << 10;

/// Weight rows per microkernel call at `lanes` x rows: 24 accumulators from 32 rows up (12 at
/// 16 rows, where the broadcasts would otherwise outnumber the FMAs).
fn xt_rows(lanes: usize) -> usize {
    match lanes {
        16 | 32 => 12,
        48 => 8,
        _ => 6,
    }
}

thread_local! {
    /// Per-thread buffers of [`gemm_xt`]: x^T, widened weight rows, and out^T.
    static XT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Output columns per task of [`gemm`]. For a batch of decodes ([`gemm_xt`]): two tasks per
/// thread, whole 16-column tiles of the final transpose, and at most 512 columns so that a
/// task's out^T (512 x 64 f32, 128 KiB) stays in L2; otherwise the Goto GEMM's split.
pub(super) fn gemm_chunk(d: Dims, threads: usize) -> usize {
    if transposed_x(d.m) {
        d.n.div_ceil(2 * threads).next_multiple_of(16).min(512)
    } else {
        super::gemm_chunk(d.n, threads)
    }
}

/// GEMM for a batch of decodes (`m <= XT_MAX_ROWS`) with the operands' roles swapped: x^T is
/// packed once per k block (the x rows of a depth step as one to four vectors), and each
/// weight row is
/// read in place (f32) or widened once without a transpose (f16, bf16), then broadcast value by
/// value against the x^T vectors. The Goto GEMM above packs and transposes every weight tile
/// per call (64 permutes per 16 x 16 tile on the port the FMAs use), which at 32 x rows costs
/// more than the rows it serves; here only x (small) is transposed, and out^T once at the end.
///
/// # Safety
/// As for [`gemv`].
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn gemm_xt<E: Elem>(x: &[f32], w: &[E], d: Dims, n0: usize, n1: usize, out: *mut f32) {
    let lanes = d.m.next_multiple_of(16);
    let jr_max = xt_rows(lanes);
    // The whole depth at once where x^T fits in L2: a task's weights are then one contiguous
    // stream (its rows follow each other in memory), and the next microkernel call's rows are
    // prefetched while this one runs. With k blocks, rows are read in short pieces.
    let kc_cap = XT_BYTES / (4 * lanes);
    let kc_max = d.k.div_ceil(d.k.div_ceil(kc_cap)).next_multiple_of(16);
    let cols = n1 - n0;
    let in_place = std::any::TypeId::of::<E>() == std::any::TypeId::of::<f32>();
    let (xt_len, wb_len, acc_len) = (
        kc_max * lanes,
        if in_place { 0 } else { jr_max * kc_max },
        cols.next_multiple_of(16) * lanes,
    );
    XT.with(|cell| {
        let mut buf = cell.borrow_mut();
        // 16 spare floats for each part to start on a 64-byte boundary.
        let needed = xt_len + wb_len + acc_len + 48;
        if buf.len() < needed {
            buf.resize(needed, 0.0);
        }
        let base = buf.as_mut_ptr();
        let at = |off: usize| {
            // SAFETY: off + 16 <= needed; the result stays inside buf.
            let p = unsafe { base.add(off) };
            // SAFETY: at most 15 floats further, inside the 16 spare ones.
            unsafe { p.add(p.align_offset(64).min(15)) }
        };
        let xt = at(0);
        let wb = at(xt_len + 16);
        let acc = at(xt_len + wb_len + 32);
        let mut p0 = 0;
        while p0 < d.k {
            let kc = kc_max.min(d.k - p0);
            // x^T as one panel of `lanes` columns (its rows past m zero).
            // SAFETY: xt holds kc_max * lanes floats; rows 0..m of x have columns p0..p0+kc.
            unsafe { pack_block(x, d.k, 0, d.m, p0, kc, lanes, xt) };
            let mut j = n0;
            while j < n1 {
                let jr = jr_max.min(n1 - j);
                // SAFETY: rows j..j+jr of w have columns p0..p0+kc; wb holds jr_max * kc_max.
                let (wr, ldw) = unsafe {
                    if in_place {
                        (w.as_ptr().add(j * d.k + p0).cast::<f32>(), d.k)
                    } else {
                        widen_rows(w.as_ptr().add(j * d.k + p0), d.k, jr, kc, wb);
                        (wb.cast_const(), kc)
                    }
                };
                // While these rows are multiplied, the next ones (the bytes that follow them in
                // memory when the block is the whole depth) are prefetched into L2.
                let step = jr * std::mem::size_of::<E>();
                let mut next =
                    NextTile::new(w.as_ptr().wrapping_add(j * d.k), kc * step, kc == d.k);
                // SAFETY: acc holds out^T rows j - n0 .. j - n0 + jr, `lanes` floats each.
                unsafe {
                    let block = XtBlock {
                        w: wr,
                        ldw,
                        xt,
                        kc,
                        c: acc.add((j - n0) * lanes),
                        first: p0 == 0,
                    };
                    micro_xt_dispatch(jr, lanes, &block, &mut next, step);
                }
                j += jr;
            }
            p0 += kc;
        }
        // SAFETY: acc holds cols x lanes of out^T; out's rows 0..m, columns n0..n1 are ours.
        unsafe { store_transposed(acc, lanes, cols, d, n0, out) };
    });
}

/// Widens `rows` weight rows (stride `k`), `kc` values each, into `dst` (stride `kc`).
#[inline(always)]
unsafe fn widen_rows<E: Elem>(w: *const E, k: usize, rows: usize, kc: usize, dst: *mut f32) {
    // SAFETY (whole body): the caller guarantees `rows` rows of kc readable values and
    // rows * kc writable floats at dst; AVX-512F/F16C per the caller.
    unsafe {
        for r in 0..rows {
            let (src, to) = (w.add(r * k), dst.add(r * kc));
            let mut p = 0;
            while p + 16 <= kc {
                _mm512_storeu_ps(to.add(p), E::load16(src.add(p)));
                p += 16;
            }
            if p < kc {
                let m: __mmask16 = (1u16 << (kc - p)) - 1;
                _mm512_mask_storeu_ps(to.add(p), m, load_partial(src.add(p), kc - p));
            }
        }
    }
}

/// One microkernel call of [`gemm_xt`]: `C^T (+)= W * X^T` over a k block.
#[derive(Clone, Copy)]
struct XtBlock {
    /// Weight rows (f32) with stride `ldw`.
    w: *const f32,
    ldw: usize,
    /// x^T, `lanes` values per depth step.
    xt: *const f32,
    /// Depth of the block.
    kc: usize,
    /// out^T rows, `lanes` floats each.
    c: *mut f32,
    /// Overwrite C^T instead of adding to it (the first k block).
    first: bool,
}

#[inline(always)]
unsafe fn micro_xt_dispatch(
    jr: usize,
    lanes: usize,
    b: &XtBlock,
    next: &mut NextTile,
    step: usize,
) {
    macro_rules! by_rows {
        ($v:literal; $($j:literal)+) => {
            match jr {
                $($j => micro_xt::<$j, $v>(b, next, step),)+
                _ => unreachable!("{jr} weight rows at {lanes} x rows"),
            }
        };
    }
    // SAFETY: forwarded from the caller, with jr <= xt_rows(lanes) weight rows and `lanes`
    // x rows.
    unsafe {
        match lanes {
            16 => by_rows!(1; 1 2 3 4 5 6 7 8 9 10 11 12),
            32 => by_rows!(2; 1 2 3 4 5 6 7 8 9 10 11 12),
            48 => by_rows!(3; 1 2 3 4 5 6 7 8),
            _ => by_rows!(4; 1 2 3 4 5 6),
        }
    }
}

/// `C^T[J x 16V] (+)= W[J x kc] * X^T[kc x 16V]` for the block `b` (J weight rows, 16 V x rows).
/// Each depth step keeps `next` up to `step` more bytes.
#[inline(always)]
unsafe fn micro_xt<const J: usize, const V: usize>(b: &XtBlock, next: &mut NextTile, step: usize) {
    let XtBlock {
        w,
        ldw,
        xt,
        kc,
        c,
        first,
    } = *b;
    // SAFETY (whole body): the caller guarantees J rows of kc weights, kc * 16V packed x^T
    // values and J * 16V floats of C^T; AVX-512F per the caller.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); V]; J];
        for p in 0..kc {
            next.keep_up((p + 1) * step);
            let mut xv = [_mm512_setzero_ps(); V];
            for (v, xv) in xv.iter_mut().enumerate() {
                *xv = _mm512_loadu_ps(xt.add(p * 16 * V + v * 16));
            }
            for (j, accj) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*w.add(j * ldw + p));
                for v in 0..V {
                    accj[v] = _mm512_fmadd_ps(b, xv[v], accj[v]);
                }
            }
        }
        for (j, accj) in acc.iter().enumerate() {
            for (v, &a) in accj.iter().enumerate() {
                let at = c.add(j * 16 * V + v * 16);
                let sum = if first {
                    a
                } else {
                    _mm512_add_ps(a, _mm512_loadu_ps(at))
                };
                _mm512_storeu_ps(at, sum);
            }
        }
    }
}

/// Writes out^T (`cols` rows of `lanes` floats at `acc`) into columns `n0..n0 + cols` of the
/// first `m` rows of `out`, a 16 x 16 register transpose per tile.
#[inline(always)]
unsafe fn store_transposed(
    acc: *const f32,
    lanes: usize,
    cols: usize,
    d: Dims,
    n0: usize,
    out: *mut f32,
) {
    // SAFETY (whole body): acc holds cols.next_multiple_of(16) x lanes floats (the rows past
    // cols are read, not stored); the masked stores touch columns n0..n0+cols of rows < m.
    unsafe {
        let mut rows = [_mm512_setzero_ps(); 16];
        for c0 in (0..cols).step_by(16) {
            let width = (cols - c0).min(16);
            let mask: __mmask16 = if width == 16 {
                0xffff
            } else {
                (1u16 << width) - 1
            };
            for g in (0..lanes).step_by(16) {
                for (t, row) in rows.iter_mut().enumerate() {
                    *row = _mm512_loadu_ps(acc.add((c0 + t) * lanes + g));
                }
                transpose16(&mut rows);
                for (i, row) in rows.iter().enumerate().take(d.m.saturating_sub(g).min(16)) {
                    _mm512_mask_storeu_ps(out.add((g + i) * d.n + n0 + c0), mask, *row);
                }
            }
        }
    }
}

/// Packs `w[n0..n1, p0..p0+kc]^T` as f32 into panels of `width` columns (a multiple of 16):
/// panel q holds `dst[q * kc * width + p * width + jj] = w[n0 + width q + jj, p0 + p]`, zero
/// past `n1`. The Goto GEMM packs weights in 32-column panels; the batch GEMM packs x^T as one
/// panel of all its rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_block<E: Elem>(
    w: &[E],
    k: usize,
    n0: usize,
    n1: usize,
    p0: usize,
    kc: usize,
    width: usize,
    dst: *mut f32,
) {
    let panels = (n1 - n0).div_ceil(width);
    // SAFETY: AVX-512F per the caller.
    let mut rows = [unsafe { _mm512_setzero_ps() }; 16];
    for q in 0..panels {
        for half in 0..width / 16 {
            let j0 = n0 + q * width + half * 16;
            let mut pc = 0;
            while pc < kc {
                let kk = (kc - pc).min(16);
                // The next 16 rows' values at these columns, into L2: each row gives a packed
                // block only a few cache lines, too short a stream for the hardware prefetcher.
                for i in 0..16 {
                    let next = w.as_ptr().wrapping_add((j0 + 16 + i) * k + p0 + pc);
                    // SAFETY: a prefetch is a hint and never faults, whatever the address.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(next.cast()) };
                }
                for (i, row) in rows.iter_mut().enumerate() {
                    let j = j0 + i;
                    // SAFETY: row j < n exists and columns p0+pc..p0+pc+kk are inside it.
                    *row = unsafe {
                        match (j < n1, kk) {
                            (false, _) => _mm512_setzero_ps(),
                            (true, 16) => E::load16(w.as_ptr().add(j * k + p0 + pc)),
                            (true, _) => load_partial(w.as_ptr().add(j * k + p0 + pc), kk),
                        }
                    };
                }
                // SAFETY: register shuffles; AVX-512F per the caller.
                unsafe { transpose16(&mut rows) };
                for (t, col) in rows.iter().enumerate().take(kk) {
                    // SAFETY: panel q, row pc + t < kc, half `half`: inside the block.
                    unsafe {
                        let at = dst.add(q * kc * width + (pc + t) * width + half * 16);
                        _mm512_storeu_ps(at, *col);
                    }
                }
                pc += kk;
            }
        }
    }
}

/// Index vectors for `transpose16`: at scale s, rows i and i + s (bit s of i clear) swap their
/// off-diagonal s-blocks: `a'[l] = l & s == 0 ? a[l] : b[l - s]`,
/// `b'[l] = l & s == 0 ? a[l + s] : b[l]` (indices >= 16 pick from b).
static TRANSPOSE_IDX: [[[i32; 16]; 2]; 4] = {
    let mut t = [[[0i32; 16]; 2]; 4];
    let mut level = 0;
    while level < 4 {
        let s = 8 >> level;
        let mut l = 0;
        while l < 16 {
            let (li, si) = (l as i32, s as i32);
            if l & s == 0 {
                t[level][0][l] = li;
                t[level][1][l] = li + si;
            } else {
                t[level][0][l] = 16 + li - si;
                t[level][1][l] = 16 + li;
            }
            l += 1;
        }
        level += 1;
    }
    t
};

/// Transposes a 16 x 16 f32 tile held as 16 row vectors (64 two-source permutes).
#[inline(always)]
pub(super) unsafe fn transpose16(r: &mut [__m512; 16]) {
    // SAFETY: register permutes and loads of the static index table; AVX-512F per the caller.
    unsafe {
        for (level, idx) in TRANSPOSE_IDX.iter().enumerate() {
            let s = 8 >> level;
            let ia = _mm512_loadu_si512(idx[0].as_ptr().cast());
            let ib = _mm512_loadu_si512(idx[1].as_ptr().cast());
            for i in 0..16 {
                if i & s == 0 {
                    let (a, b) = (r[i], r[i + s]);
                    r[i] = _mm512_permutex2var_ps(a, ia, b);
                    r[i + s] = _mm512_permutex2var_ps(a, ib, b);
                }
            }
        }
    }
}

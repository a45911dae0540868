//! AVX2 matmul kernels, for x86 CPUs without AVX-512 (Haswell to Alder Lake clients, Zen 1 to
//! Zen 3): the same two algorithms as the AVX-512 ones at half the vector width. A GEMV of
//! dot-product register tiles (weights widened in registers, the next tile prefetched), and a GEMM
//! of
//! packed `w^T` panels with a 6 x 16 outer-product microkernel (12 accumulators, two panel
//! vectors and one broadcast: 15 of the 16 registers).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{Dims, NextTile};
use crate::cpu::simd::{hsum256, load_partial8, reduce8, Elem};

/// Depth of a packed block: a 16-column panel of it (16 KiB) stays in L1 across x tiles.
const KC_TARGET: usize = 256;
/// Rows of x per microkernel call.
const MR: usize = 6;
/// Rows of x per L2 block.
const MC: usize = 24 * MR;
/// Panel width of the packed `w^T`.
const NR: usize = 16;

thread_local! {
    /// Per-thread packing buffer, reused across calls.
    static PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// GEMV: columns `n0..n1` of `out = x @ w^T` for small m.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x` holds `m * k` values, `w` holds `n * k`, and
/// `out` points to `m * n` f32s of which this call may write columns `n0..n1`.
#[target_feature(enable = "avx2,fma,f16c")]
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
            let mr = (d.m - i).min(2);
            // SAFETY: rows i..i+mr of x and j..j+nr of w exist; out is valid per the caller.
            unsafe {
                let (xt, wt, ot) = (xp.add(i * d.k), wp.add(j * d.k), out.add(i * d.n + j));
                match (mr, nr) {
                    (2, 4) => dot_tile::<E, 2, 4>(xt, wt, d.k, ot, d.n, i == 0),
                    (1, 4) => dot_tile::<E, 1, 4>(xt, wt, d.k, ot, d.n, i == 0),
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
    // R x C output tile at `out` with row stride `ldo`, and AVX2/FMA/F16C.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let k16 = k & !15;
        let mut p = 0;
        let mut next = NextTile::new(w, C * k * std::mem::size_of::<E>(), prefetch);
        while p < k16 {
            next.keep_up((p + 16) * C * std::mem::size_of::<E>());
            for c in 0..C {
                let at = w.add(c * k + p);
                let (w0, w1) = (E::load8(at), E::load8(at.add(8)));
                for (r, accr) in acc.iter_mut().enumerate() {
                    let xr = x.add(r * k + p);
                    accr[c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, accr[c]);
                    accr[c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr.add(8)), w1, accr[c]);
                }
            }
            p += 16;
        }
        while p < k {
            let n = (k - p).min(8);
            for c in 0..C {
                let at = w.add(c * k + p);
                let wv = if n == 8 {
                    E::load8(at)
                } else {
                    load_partial8(at, n)
                };
                for (r, accr) in acc.iter_mut().enumerate() {
                    let xv = load_partial8(x.add(r * k + p), n);
                    accr[c] = _mm256_fmadd_ps(xv, wv, accr[c]);
                }
            }
            p += n;
        }
        if R * C == 8 {
            let mut all = [_mm256_setzero_ps(); 8];
            for (i, v) in all.iter_mut().enumerate() {
                *v = acc[i / C][i % C];
            }
            let mut sums = [0.0f32; 8];
            _mm256_storeu_ps(sums.as_mut_ptr(), reduce8(&all));
            for (i, &s) in sums.iter().enumerate() {
                *out.add((i / C) * ldo + i % C) = s;
            }
        } else {
            for (r, accr) in acc.iter().enumerate() {
                for (c, &a) in accr.iter().enumerate() {
                    *out.add(r * ldo + c) = hsum256(a);
                }
            }
        }
    }
}

/// Rows of a weight matrix as the GEMM's packing reads them: 8 values at a time, widened.
pub(super) trait PanelRows: Sync {
    /// Values `p..p + 8` of row `j`, widened.
    ///
    /// # Safety
    /// Row j exists, `p + 8 <= k`, and the CPU supports AVX2/FMA/F16C.
    unsafe fn load8(&self, j: usize, p: usize) -> __m256;

    /// Value `p` of row `j`, widened.
    fn value(&self, j: usize, p: usize) -> f32;
}

/// A dense row-major matrix `[n, k]`.
pub(super) struct Dense<'a, E> {
    pub w: &'a [E],
    pub k: usize,
}

impl<E: Elem> PanelRows for Dense<'_, E> {
    #[inline(always)]
    unsafe fn load8(&self, j: usize, p: usize) -> __m256 {
        // SAFETY: the caller guarantees row j and columns p..p+8 exist, and AVX2/F16C.
        unsafe { E::load8(self.w.as_ptr().add(j * self.k + p)) }
    }

    #[inline(always)]
    fn value(&self, j: usize, p: usize) -> f32 {
        self.w[j * self.k + p].to_f32()
    }
}

/// GEMM: columns `n0..n1` of `out = x @ w^T`, for many rows of x.
///
/// # Safety
/// As for [`gemv`], with `w` holding `n` rows of `k` values.
pub(super) unsafe fn gemm<W: PanelRows>(
    x: &[f32],
    w: &W,
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    let kc_max = d.k.div_ceil(d.k.div_ceil(KC_TARGET)).next_multiple_of(8);
    let panels = (n1 - n0).div_ceil(NR);
    // 8 spare floats let the packed block start on a 32-byte boundary.
    let needed = panels * kc_max * NR + 8;
    PACK.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < needed {
            buf.resize(needed, 0.0);
        }
        let start = buf.as_ptr().align_offset(32).min(8);
        let block = &mut buf[start..start + needed - 8];
        // SAFETY: forwarded from the caller; `block` holds panels * kc_max * NR floats.
        unsafe { gemm_packed(x, w, d, n0, n1, out, block, kc_max) }
    });
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_packed<W: PanelRows>(
    x: &[f32],
    w: &W,
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
    buf: &mut [f32],
    kc_max: usize,
) {
    let panels = (n1 - n0).div_ceil(NR);
    let mut p0 = 0;
    while p0 < d.k {
        let kc = kc_max.min(d.k - p0);
        // SAFETY: w has n rows of k values; buf has panels * kc_max * NR >= panels * kc * NR.
        unsafe { pack_block(w, n0, n1, p0, kc, buf.as_mut_ptr()) };
        let mut i0 = 0;
        while i0 < d.m {
            let mc = MC.min(d.m - i0);
            for q in 0..panels {
                let j = n0 + q * NR;
                let ncols = (n1 - j).min(NR);
                let mut i = i0;
                while i < i0 + mc {
                    let mr = (i0 + mc - i).min(MR);
                    // SAFETY: rows i..i+mr of x exist (columns p0..p0+kc); panel q holds
                    // kc x NR packed values; the out tile is inside this task's columns.
                    unsafe {
                        let a = x.as_ptr().add(i * d.k + p0);
                        let b = buf.as_ptr().add(q * kc * NR);
                        let c = out.add(i * d.n + j);
                        match mr {
                            6 => micro::<6>(a, d.k, b, kc, c, d.n, ncols, p0 == 0),
                            5 => micro::<5>(a, d.k, b, kc, c, d.n, ncols, p0 == 0),
                            4 => micro::<4>(a, d.k, b, kc, c, d.n, ncols, p0 == 0),
                            3 => micro::<3>(a, d.k, b, kc, c, d.n, ncols, p0 == 0),
                            2 => micro::<2>(a, d.k, b, kc, c, d.n, ncols, p0 == 0),
                            _ => micro::<1>(a, d.k, b, kc, c, d.n, ncols, p0 == 0),
                        }
                    }
                    i += mr;
                }
            }
            i0 += mc;
        }
        p0 += kc;
    }
}

/// `C[R x ncols] (+)= A[R x kc] * B[kc x 16]`: A rows with stride `lda`, B a packed panel,
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
    // SAFETY (whole body): the caller guarantees R rows of A (kc long), a kc x 16 panel at b,
    // and R rows of C with ncols writable columns; only those columns are read and written.
    unsafe {
        let mut acc0 = [_mm256_setzero_ps(); R];
        let mut acc1 = [_mm256_setzero_ps(); R];
        for p in 0..kc {
            let b0 = _mm256_loadu_ps(b.add(p * NR));
            let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
            for r in 0..R {
                let av = _mm256_broadcast_ss(&*a.add(r * lda + p));
                acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
            }
        }
        for r in 0..R {
            let cr = c.add(r * ldc);
            if ncols == NR {
                if !first {
                    acc0[r] = _mm256_add_ps(acc0[r], _mm256_loadu_ps(cr));
                    acc1[r] = _mm256_add_ps(acc1[r], _mm256_loadu_ps(cr.add(8)));
                }
                _mm256_storeu_ps(cr, acc0[r]);
                _mm256_storeu_ps(cr.add(8), acc1[r]);
            } else {
                let mut tile = [0.0f32; NR];
                _mm256_storeu_ps(tile.as_mut_ptr(), acc0[r]);
                _mm256_storeu_ps(tile.as_mut_ptr().add(8), acc1[r]);
                for (jj, &v) in tile.iter().enumerate().take(ncols) {
                    let o = cr.add(jj);
                    *o = if first { v } else { *o + v };
                }
            }
        }
    }
}

/// Packs `w[n0..n1, p0..p0+kc]^T` as f32 into 16-column panels: panel q holds
/// `dst[q * kc * 16 + p * 16 + jj] = w[n0 + 16 q + jj, p0 + p]`, zero past `n1`. Each value is
/// packed once per call and then used by every row of x, so plain stores suffice.
#[inline(always)]
unsafe fn pack_block<W: PanelRows>(
    w: &W,
    n0: usize,
    n1: usize,
    p0: usize,
    kc: usize,
    dst: *mut f32,
) {
    let panels = (n1 - n0).div_ceil(NR);
    let mut row = [0.0f32; 8];
    for q in 0..panels {
        let panel = dst.wrapping_add(q * kc * NR);
        for jj in 0..NR {
            let j = n0 + q * NR + jj;
            let mut p = 0;
            while p < kc {
                let n = (kc - p).min(8);
                // SAFETY: row j < n1 <= n exists and columns p0+p..p0+p+n are inside it; the
                // stores are inside panel q (kc x 16); AVX2/F16C per the caller.
                unsafe {
                    match (j < n1, n) {
                        (false, _) => row = [0.0; 8],
                        (true, 8) => _mm256_storeu_ps(row.as_mut_ptr(), w.load8(j, p0 + p)),
                        (true, _) => {
                            for (t, r) in row.iter_mut().enumerate().take(n) {
                                *r = w.value(j, p0 + p + t);
                            }
                        }
                    }
                    for (t, &val) in row.iter().enumerate().take(n) {
                        *panel.add((p + t) * NR + jj) = val;
                    }
                }
                p += n;
            }
        }
    }
}

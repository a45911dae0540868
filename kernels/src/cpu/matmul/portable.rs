//! Portable matmul: one dot product per output, eight independent f32 lanes so the compiler can
//! vectorize it for any target. Correct everywhere; the AVX-512 kernels are the fast path.

use super::Dims;
use crate::cpu::simd::Elem;

/// Columns `n0..n1` of `out = x @ w^T`.
///
/// # Safety
/// `out` must point to `m * n` f32s of which this call may write columns `n0..n1`; `x` and `w`
/// hold `m * k` and `n * k` values.
pub(super) unsafe fn matmul<E: Elem>(
    x: &[f32],
    w: &[E],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    for j in n0..n1 {
        let wr = &w[j * d.k..(j + 1) * d.k];
        for i in 0..d.m {
            let v = dot(&x[i * d.k..(i + 1) * d.k], wr);
            // SAFETY: i < m and n0 <= j < n1, inside this call's columns per the caller.
            unsafe { *out.add(i * d.n + j) = v };
        }
    }
}

/// `sum(x[i] * w[i])` with eight partial sums.
pub(crate) fn dot<E: Elem>(x: &[f32], w: &[E]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (xc, wc) = (x.chunks_exact(8), w.chunks_exact(8));
    let (xr, wr) = (xc.remainder(), wc.remainder());
    for (xs, ws) in xc.zip(wc) {
        for l in 0..8 {
            acc[l] += xs[l] * ws[l].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (a, b) in xr.iter().zip(wr) {
        s += a * b.to_f32();
    }
    s
}

//! AVX2 attention item: the shared tile loop ([`tiled`]) with an 8-lane row update. A tile's 16
//! dot products are two groups of 8 reduced with one transposing horizontal sum each (q is read
//! from L1 rather than held in registers: AVX2 has 16 of them), a vectorized `exp`, and the P·V
//! update into the row's accumulator.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::tiled::{self, RowKernel};
use super::{Job, KvLayout, Rows, TILE};
use crate::cpu::simd::{exp256, hsum256, reduce8, Elem};

/// Runs one item (see the parent module).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `head_dim` is a multiple of 8 and at most 256;
/// the item's rows are inside q and out, every offset the layout yields for tokens below each
/// row's limit is inside K and V, and no other thread writes this item's part of out.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn item<E: Elem, L: KvLayout>(
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    scratch: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe { tiled::item::<E, L, Avx2Row>(job, layout, kv_head, rows, scratch) }
}

/// The AVX2 tile update.
struct Avx2Row;

/// Lanes `0..n` of 8 set (n may be anything: at most 8 count).
#[inline(always)]
unsafe fn first_lanes(n: usize) -> __m256 {
    // SAFETY: register-only AVX2; the caller has it.
    unsafe {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let limit = _mm256_set1_epi32(n.min(8) as i32);
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane))
    }
}

impl RowKernel for Avx2Row {
    #[inline(always)]
    unsafe fn tile_scores<E: Elem, const HD: usize>(
        q: *const f32,
        k: *const E,
        offs: &[usize; TILE],
        n: usize,
        hd: usize,
        s: *mut f32,
    ) {
        let nv = if HD > 0 { HD / 8 } else { hd / 8 };
        // SAFETY: per the caller.
        unsafe {
            for half in 0..TILE / 8 {
                let mut sums = [_mm256_setzero_ps(); 8];
                for (i, sum) in sums.iter_mut().enumerate() {
                    let t = half * 8 + i;
                    if t < n {
                        let kp = k.add(offs[t]);
                        let mut a = _mm256_mul_ps(_mm256_loadu_ps(q), E::load8(kp));
                        for c in 1..nv {
                            a = _mm256_fmadd_ps(
                                _mm256_loadu_ps(q.add(8 * c)),
                                E::load8(kp.add(8 * c)),
                                a,
                            );
                        }
                        *sum = a;
                    }
                }
                _mm256_storeu_ps(s.add(half * 8), reduce8(&sums));
            }
        }
    }

    #[inline(always)]
    unsafe fn online(s: *mut f32, n: usize, m: &mut f32, l: &mut f32) -> f32 {
        // SAFETY: s holds 16 values; AVX2/FMA per the caller.
        unsafe {
            let tile_max = (0..n).fold(f32::NEG_INFINITY, |a, t| a.max(*s.add(t)));
            let m_new = m.max(tile_max);
            let mut psum = _mm256_setzero_ps();
            for half in 0..TILE / 8 {
                let at = s.add(half * 8);
                let p = exp256(_mm256_sub_ps(_mm256_loadu_ps(at), _mm256_set1_ps(m_new)));
                // Lanes past n are not tokens of this tile.
                let p = _mm256_and_ps(p, first_lanes(n.saturating_sub(half * 8)));
                psum = _mm256_add_ps(psum, p);
                _mm256_storeu_ps(at, p);
            }
            // Once the running max settles, most tiles leave it unchanged: skip the exp then.
            let corr = if m_new > *m { (*m - m_new).exp() } else { 1.0 };
            *l = *l * corr + hsum256(psum);
            *m = m_new;
            corr
        }
    }

    #[inline(always)]
    unsafe fn softmax(s: *mut f32, len: usize) -> f32 {
        // SAFETY: s holds len values with room to the next multiple of 16; AVX2/FMA per the
        // caller.
        unsafe {
            let vecs = len.div_ceil(8);
            let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut mx = ninf;
            for i in 0..vecs {
                let keep = first_lanes(len - 8 * i);
                let x = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s.add(8 * i)), keep);
                mx = _mm256_max_ps(mx, x);
            }
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
            let mx = _mm256_set1_ps(lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
            let mut sum = _mm256_setzero_ps();
            for i in 0..vecs {
                let at = s.add(8 * i);
                let p = exp256(_mm256_sub_ps(_mm256_loadu_ps(at), mx));
                let p = _mm256_and_ps(p, first_lanes(len - 8 * i));
                _mm256_storeu_ps(at, p);
                sum = _mm256_add_ps(sum, p);
            }
            hsum256(sum)
        }
    }

    #[inline(always)]
    unsafe fn tile_pv<E: Elem, const HD: usize>(
        p: *const f32,
        v: *const E,
        offs: &[usize; TILE],
        n: usize,
        hd: usize,
        corr: f32,
        acc: *mut f32,
    ) {
        let nv = if HD > 0 { HD / 8 } else { hd / 8 };
        // SAFETY: per the caller.
        unsafe {
            let corr = _mm256_set1_ps(corr);
            let mut av = [_mm256_setzero_ps(); 32];
            for (c, a) in av.iter_mut().enumerate().take(nv) {
                *a = _mm256_mul_ps(_mm256_loadu_ps(acc.add(8 * c)), corr);
            }
            for (t, &o) in offs.iter().enumerate().take(n) {
                let pt = _mm256_set1_ps(*p.add(t));
                let vp = v.add(o);
                for (c, a) in av.iter_mut().enumerate().take(nv) {
                    *a = _mm256_fmadd_ps(pt, E::load8(vp.add(8 * c)), *a);
                }
            }
            for (c, a) in av.iter().enumerate().take(nv) {
                _mm256_storeu_ps(acc.add(8 * c), *a);
            }
        }
    }
}

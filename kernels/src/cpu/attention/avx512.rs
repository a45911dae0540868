//! AVX-512 attention item: for each 16-token tile, 16 dot products per row reduced with one
//! transposing horizontal sum, a vectorized `exp`, and the P·V update with two accumulator
//! sets (even and odd tokens) so the FMA chains overlap. `head_dim` 64 and 128 are compiled with
//! the row held in registers; other multiples of 16 (up to 256) use the same code with loops.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::tiled::{self, RowKernel};
use super::{Job, KvLayout, Rows, TILE};
use crate::cpu::simd::{exp512, reduce16, Elem};

/// Runs one item (see the parent module).
///
/// # Safety
/// The CPU must support AVX-512F, FMA and F16C; `head_dim` is a multiple of 16 and at most 256;
/// the item's rows are inside q and out, every offset the layout yields for tokens below each
/// row's limit is inside K and V, and no other thread writes this item's part of out.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn item<E: Elem, L: KvLayout>(
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    scratch: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe { tiled::item::<E, L, Avx512Row>(job, layout, kv_head, rows, scratch) }
}

/// The AVX-512 row kernel.
struct Avx512Row;

impl RowKernel for Avx512Row {
    #[inline(always)]
    unsafe fn tile_scores<E: Elem, const HD: usize>(
        q: *const f32,
        k: *const E,
        offs: &[usize; TILE],
        n: usize,
        hd: usize,
        s: *mut f32,
    ) {
        let nv = if HD > 0 { HD / 16 } else { hd / 16 };
        // SAFETY: per the caller.
        unsafe {
            let mut qv = [_mm512_setzero_ps(); 16];
            for (c, qc) in qv.iter_mut().enumerate().take(nv) {
                *qc = _mm512_loadu_ps(q.add(16 * c));
            }
            let mut sums = [_mm512_setzero_ps(); TILE];
            for (t, sum) in sums.iter_mut().enumerate() {
                if t < n {
                    let kp = k.add(offs[t]);
                    let mut a = _mm512_mul_ps(qv[0], E::load16(kp));
                    for (c, qc) in qv.iter().enumerate().take(nv).skip(1) {
                        a = _mm512_fmadd_ps(*qc, E::load16(kp.add(16 * c)), a);
                    }
                    *sum = a;
                }
            }
            _mm512_storeu_ps(s, reduce16(&sums));
        }
    }

    #[inline(always)]
    unsafe fn online(s: *mut f32, n: usize, m: &mut f32, l: &mut f32) -> f32 {
        // SAFETY: s holds 16 values; AVX-512F per the caller.
        unsafe {
            let sv = _mm512_loadu_ps(s);
            let valid: __mmask16 = if n >= TILE { 0xffff } else { (1u16 << n) - 1 };
            let tile_max = _mm512_reduce_max_ps(_mm512_mask_mov_ps(
                _mm512_set1_ps(f32::NEG_INFINITY),
                valid,
                sv,
            ));
            let m_new = m.max(tile_max);
            let p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
            _mm512_storeu_ps(s, p);
            // Once the running max settles, most tiles leave it unchanged: skip the exp then.
            let corr = if m_new > *m { (*m - m_new).exp() } else { 1.0 };
            *l = *l * corr + _mm512_reduce_add_ps(p);
            *m = m_new;
            corr
        }
    }

    #[inline(always)]
    unsafe fn softmax(s: *mut f32, len: usize) -> f32 {
        // SAFETY: s holds len values with room to the next multiple of 16; AVX-512F per the
        // caller.
        unsafe {
            let full = len / TILE;
            let tail: __mmask16 = ((1u32 << (len % TILE)) - 1) as u16;
            let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
            let mut mx = ninf;
            for i in 0..full {
                mx = _mm512_max_ps(mx, _mm512_loadu_ps(s.add(TILE * i)));
            }
            if tail != 0 {
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, tail, s.add(TILE * full)));
            }
            let mx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            let mut sum = _mm512_setzero_ps();
            for i in 0..full + usize::from(tail != 0) {
                let at = s.add(TILE * i);
                let keep = if i < full { 0xffff } else { tail };
                let p = _mm512_maskz_mov_ps(keep, exp512(_mm512_sub_ps(_mm512_loadu_ps(at), mx)));
                _mm512_storeu_ps(at, p);
                sum = _mm512_add_ps(sum, p);
            }
            _mm512_reduce_add_ps(sum)
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
        let nv = if HD > 0 { HD / 16 } else { hd / 16 };
        // SAFETY: per the caller.
        unsafe {
            let corr = _mm512_set1_ps(corr);
            let mut even = [_mm512_setzero_ps(); 16];
            let mut odd = [_mm512_setzero_ps(); 16];
            for (c, e) in even.iter_mut().enumerate().take(nv) {
                *e = _mm512_mul_ps(_mm512_loadu_ps(acc.add(16 * c)), corr);
            }
            // Tokens in pairs, each set of accumulators named, not picked through a reference:
            // a reference chosen per token kept both sets in memory, every FMA a load and a
            // store on one chain.
            for t in (0..TILE).step_by(2) {
                if t < n {
                    let pt = _mm512_set1_ps(*p.add(t));
                    let vp = v.add(offs[t]);
                    for (c, a) in even.iter_mut().enumerate().take(nv) {
                        *a = _mm512_fmadd_ps(pt, E::load16(vp.add(16 * c)), *a);
                    }
                }
                if t + 1 < n {
                    let pt = _mm512_set1_ps(*p.add(t + 1));
                    let vp = v.add(offs[t + 1]);
                    for (c, a) in odd.iter_mut().enumerate().take(nv) {
                        *a = _mm512_fmadd_ps(pt, E::load16(vp.add(16 * c)), *a);
                    }
                }
            }
            for c in 0..nv {
                _mm512_storeu_ps(acc.add(16 * c), _mm512_add_ps(even[c], odd[c]));
            }
        }
    }
}

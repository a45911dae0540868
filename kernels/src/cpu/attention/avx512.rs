//! AVX-512 attention item: for each 16-token tile, 16 dot products per row reduced with one
//! transposing horizontal sum, a vectorized `exp`, and the P·V update with two accumulator
//! sets (even and odd tokens) so the FMA chains overlap. `head_dim` 64 and 128 are compiled with
//! the row held in registers; other multiples of 16 (up to 256) use the same code with loops.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

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
    unsafe {
        match job.shape.head_dim {
            64 => item_hd::<E, L, 64>(job, layout, kv_head, rows, scratch),
            128 => item_hd::<E, L, 128>(job, layout, kv_head, rows, scratch),
            _ => item_hd::<E, L, 0>(job, layout, kv_head, rows, scratch),
        }
    }
}

/// `HD` is the head dimension when known at compile time, 0 for "read it from the shape".
#[inline(always)]
unsafe fn item_hd<E: Elem, L: KvLayout, const HD: usize>(
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    scratch: &mut [f32],
) {
    let hd = if HD > 0 { HD } else { job.shape.head_dim };
    let width = job.shape.num_heads * hd;
    let nrows = rows.queries * rows.group;
    let (qs, rest) = scratch.split_at_mut(nrows * hd);
    let (acc, rest) = rest.split_at_mut(nrows * hd);
    let (ms, ls) = rest.split_at_mut(nrows);
    for qi in 0..rows.queries {
        for g in 0..rows.group {
            let r = qi * rows.group + g;
            let src = (rows.first_token + qi) * width + (rows.first_head + g) * hd;
            for (d, s) in qs[r * hd..(r + 1) * hd]
                .iter_mut()
                .zip(&job.q[src..src + hd])
            {
                *d = s * job.scale;
            }
        }
    }
    acc.fill(0.0);
    ms.fill(f32::NEG_INFINITY);
    ls.fill(0.0);
    let max_limit = rows.first_limit + rows.queries - 1;
    let (mut offs, mut next) = ([0usize; TILE], [0usize; TILE]);
    layout.offsets(0, TILE.min(max_limit), kv_head, &mut offs);
    let mut t0 = 0;
    while t0 < max_limit {
        let n = TILE.min(max_limit - t0);
        // Look up the next tile now and prefetch it: with paging, the next block is anywhere
        // in the pool, where the hardware prefetcher cannot follow.
        let n_next = TILE.min(max_limit - t0 - n);
        if n_next > 0 {
            layout.offsets(t0 + n, n_next, kv_head, &mut next);
            prefetch_tile(job.k.as_ptr(), job.v.as_ptr(), &next[..n_next], hd);
        }
        // Query qi sees first_limit + qi tokens; skip those that end before this tile.
        let q_from = (t0 + 1).saturating_sub(rows.first_limit);
        for qi in q_from..rows.queries {
            let nq = n.min(rows.first_limit + qi - t0);
            for g in 0..rows.group {
                let r = qi * rows.group + g;
                // SAFETY: row r's slices are hd long; offsets of tokens < nq are inside K/V
                // per the caller.
                unsafe {
                    tile_row::<E, HD>(
                        qs[r * hd..].as_ptr(),
                        job.k.as_ptr(),
                        job.v.as_ptr(),
                        &offs,
                        nq,
                        hd,
                        (&mut ms[r], &mut ls[r]),
                        acc[r * hd..].as_mut_ptr(),
                    )
                };
            }
        }
        t0 += n;
        std::mem::swap(&mut offs, &mut next);
    }
    for qi in 0..rows.queries {
        for g in 0..rows.group {
            let r = qi * rows.group + g;
            let dst = (rows.first_token + qi) * width + (rows.first_head + g) * hd;
            let inv = 1.0 / ls[r];
            for d in 0..hd {
                // SAFETY: dst + d is inside out (checked batch) and owned by this item.
                unsafe { *job.out.0.add(dst + d) = acc[r * hd + d] * inv };
            }
        }
    }
}

/// Prefetches the K and V vectors (`hd` values each) at `offs` into L2. (Into L1, a tile's
/// 128 lines would queue behind L1's few fill buffers; L2 tracks many more misses.)
#[inline(always)]
fn prefetch_tile<E: Elem>(k: *const E, v: *const E, offs: &[usize], hd: usize) {
    let per_line = 64 / std::mem::size_of::<E>();
    for &o in offs {
        for d in (0..hd).step_by(per_line) {
            // SAFETY: prefetches never fault; wrapping_add keeps the address computation
            // defined even if it were out of bounds (it is not: offsets are checked).
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(k.wrapping_add(o + d).cast());
                _mm_prefetch::<_MM_HINT_T1>(v.wrapping_add(o + d).cast());
            }
        }
    }
}

/// One row, one tile of `n` (1..=16) tokens: the online-softmax update.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_row<E: Elem, const HD: usize>(
    q: *const f32,
    k: *const E,
    v: *const E,
    offs: &[usize; TILE],
    n: usize,
    hd: usize,
    (m, l): (&mut f32, &mut f32),
    acc: *mut f32,
) {
    let nv = if HD > 0 { HD / 16 } else { hd / 16 };
    // SAFETY (whole body): q and acc hold hd values; offs[t] + hd is inside K and V for t < n;
    // AVX-512F per the caller.
    unsafe {
        let mut qv = [_mm512_setzero_ps(); 16];
        for (c, qc) in qv.iter_mut().enumerate().take(nv) {
            *qc = _mm512_loadu_ps(q.add(16 * c));
        }
        let mut sums = [_mm512_setzero_ps(); TILE];
        for (t, s) in sums.iter_mut().enumerate() {
            if t < n {
                let kp = k.add(offs[t]);
                let mut a = _mm512_mul_ps(qv[0], E::load16(kp));
                for (c, qc) in qv.iter().enumerate().take(nv).skip(1) {
                    a = _mm512_fmadd_ps(*qc, E::load16(kp.add(16 * c)), a);
                }
                *s = a;
            }
        }
        let s = reduce16(&sums);
        let valid: __mmask16 = if n >= TILE { 0xffff } else { (1u16 << n) - 1 };
        let tile_max = _mm512_reduce_max_ps(_mm512_mask_mov_ps(
            _mm512_set1_ps(f32::NEG_INFINITY),
            valid,
            s,
        ));
        let m_new = m.max(tile_max);
        let p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        // Once the running max settles, most tiles leave it unchanged: skip the exp then.
        let corr = if m_new > *m { (*m - m_new).exp() } else { 1.0 };
        *l = *l * corr + _mm512_reduce_add_ps(p);
        *m = m_new;
        let mut pa = [0.0f32; TILE];
        _mm512_storeu_ps(pa.as_mut_ptr(), p);

        let corr_v = _mm512_set1_ps(corr);
        let mut even = [_mm512_setzero_ps(); 16];
        let mut odd = [_mm512_setzero_ps(); 16];
        for (c, e) in even.iter_mut().enumerate().take(nv) {
            *e = _mm512_mul_ps(_mm512_loadu_ps(acc.add(16 * c)), corr_v);
        }
        for t in 0..TILE {
            if t < n {
                let pt = _mm512_set1_ps(pa[t]);
                let vp = v.add(offs[t]);
                let dst = if t % 2 == 0 { &mut even } else { &mut odd };
                for (c, a) in dst.iter_mut().enumerate().take(nv) {
                    *a = _mm512_fmadd_ps(pt, E::load16(vp.add(16 * c)), *a);
                }
            }
        }
        for c in 0..nv {
            _mm512_storeu_ps(acc.add(16 * c), _mm512_add_ps(even[c], odd[c]));
        }
    }
}

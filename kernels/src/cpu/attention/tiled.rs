//! The tile loop both SIMD attention items share (AVX-512 and AVX2): the item's rows scaled
//! into scratch, one online-softmax update per row and 16-token tile (the ISA's [`RowKernel`]),
//! the next tile's K/V prefetched into L2 while the current one is computed, and the rows
//! normalized into `out` at the end. Scratch holds `rows * (2 * head_dim + 2)` floats.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::{Job, KvLayout, Rows, TILE};
use crate::cpu::simd::Elem;

/// One row, one tile of `n` (1..=16) tokens: folds the tile into the row's running max `m`,
/// sum `l` and accumulator `acc` (`hd` values).
pub(super) trait RowKernel {
    /// # Safety
    /// q and acc hold hd values; `offs[t] + hd` is inside K and V for t < n; the CPU has the
    /// kernel's instruction set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_row<E: Elem, const HD: usize>(
        q: *const f32,
        k: *const E,
        v: *const E,
        offs: &[usize; TILE],
        n: usize,
        hd: usize,
        ml: (&mut f32, &mut f32),
        acc: *mut f32,
    );
}

/// Runs one item with row kernel `K`, compiled for head_dim 64 and 128 with the row in
/// registers, and for other head dims with loops.
///
/// # Safety
/// As for the ISA's `item`; must be inlined into a function compiled with `K`'s features.
#[inline(always)]
pub(super) unsafe fn item<E: Elem, L: KvLayout, K: RowKernel>(
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    scratch: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match job.shape.head_dim {
            64 => item_hd::<E, L, K, 64>(job, layout, kv_head, rows, scratch),
            128 => item_hd::<E, L, K, 128>(job, layout, kv_head, rows, scratch),
            _ => item_hd::<E, L, K, 0>(job, layout, kv_head, rows, scratch),
        }
    }
}

/// `HD` is the head dimension when known at compile time, 0 for "read it from the shape".
#[inline(always)]
unsafe fn item_hd<E: Elem, L: KvLayout, K: RowKernel, const HD: usize>(
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
                    K::tile_row::<E, HD>(
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

//! The tile loops both SIMD attention items share (AVX-512 and AVX2): the item's rows scaled
//! into scratch, the next tile's K or V prefetched into L2 while the current one is computed,
//! and the rows normalized into `out` at the end.
//!
//! - Several queries (prefill): one online-softmax update per row and 16-token tile (the ISA's
//!   [`RowKernel::tile_row`]), each K/V tile read once for all the item's rows.
//! - One query (decode): two passes. All the scores first, one tile and row at a time with no
//!   dependence between them; then each row's softmax at once; then P·V. The online update
//!   chains every tile to the one before (a horizontal max, a scalar compare and branch, the
//!   accumulators rescaled through memory), so a decode's few tiles ran one after the other at
//!   the chain's latency; here they overlap.
//!
//! Scratch holds [`super::scratch_len`] floats.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::{Job, KvLayout, Rows, TILE};
use crate::cpu::simd::Elem;

/// An instruction set's steps of attention for one row: on one tile of `n` (1..=16) tokens,
/// or (the softmax) on a decode's whole row of scores.
pub(super) trait RowKernel {
    /// One row's scores against one tile: `s[t] = q · k_t` for t < n. `s` has room for 16;
    /// what lands in lanes from n on is unspecified.
    ///
    /// # Safety
    /// q holds hd values, s 16; `offs[t] + hd` is inside K for t < n; the CPU has the kernel's
    /// instruction set.
    unsafe fn tile_scores<E: Elem, const HD: usize>(
        q: *const f32,
        k: *const E,
        offs: &[usize; TILE],
        n: usize,
        hd: usize,
        s: *mut f32,
    );

    /// The online softmax's step: folds the scores `s[..n]` into the row's running max `m` and
    /// sum `l`, turns them into `e^(s[t] - m)` at the new max (0 from n on), and returns the
    /// factor the row's accumulator must be scaled by.
    ///
    /// # Safety
    /// s holds 16 values; the CPU has the kernel's instruction set.
    unsafe fn online(s: *mut f32, n: usize, m: &mut f32, l: &mut f32) -> f32;

    /// `s[t] = e^(s[t] - max)` for t < len, the max over those `len` scores; returns the sum of
    /// the new values. `s` has room for `len` rounded up to 16.
    ///
    /// # Safety
    /// s holds `len` (at least 1) values, with room to the next multiple of 16; the CPU has
    /// the kernel's instruction set.
    unsafe fn softmax(s: *mut f32, len: usize) -> f32;

    /// `acc = acc * corr + sum of p[t] * v_t` over t < n.
    ///
    /// # Safety
    /// p holds n values, acc hd; `offs[t] + hd` is inside V for t < n; the CPU has the
    /// kernel's instruction set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_pv<E: Elem, const HD: usize>(
        p: *const f32,
        v: *const E,
        offs: &[usize; TILE],
        n: usize,
        hd: usize,
        corr: f32,
        acc: *mut f32,
    );

    /// One online update: folds the tile into the row's running max `m`, sum `l` and
    /// accumulator `acc` (`hd` values).
    ///
    /// # Safety
    /// q and acc hold hd values; `offs[t] + hd` is inside K and V for t < n; the CPU has the
    /// kernel's instruction set.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
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
        let mut s = [0.0f32; TILE];
        // SAFETY: per the caller; s holds 16.
        unsafe {
            Self::tile_scores::<E, HD>(q, k, offs, n, hd, s.as_mut_ptr());
            let corr = Self::online(s.as_mut_ptr(), n, m, l);
            Self::tile_pv::<E, HD>(s.as_ptr(), v, offs, n, hd, corr, acc);
        }
    }
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
    let nrows = rows.queries * rows.group;
    let (qs, rest) = scratch.split_at_mut(nrows * hd);
    let (acc, rest) = rest.split_at_mut(nrows * hd);
    let (ms, rest) = rest.split_at_mut(nrows);
    let (ls, scores) = rest.split_at_mut(nrows);
    scaled_queries(job, rows, hd, qs);
    acc.fill(0.0);
    if rows.queries == 1 {
        // SAFETY: forwarded from the caller; `scores` is the rest of the scratch
        // (`super::scratch_len`).
        unsafe { decode::<E, L, K, HD>(job, layout, kv_head, rows, hd, qs, acc, ls, scores) };
        write_out(job, rows, hd, acc, ls);
        return;
    }
    ms.fill(f32::NEG_INFINITY);
    ls.fill(0.0);
    let max_limit = rows.first_limit + rows.queries - 1;
    let (k, v) = (job.k.as_ptr(), job.v.as_ptr());
    for (t0, n, offs) in TileWalk::new(layout, kv_head, max_limit, &[k, v], hd) {
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
                        k,
                        v,
                        &offs,
                        nq,
                        hd,
                        (&mut ms[r], &mut ls[r]),
                        acc[r * hd..].as_mut_ptr(),
                    )
                };
            }
        }
    }
    write_out(job, rows, hd, acc, ls);
}

/// The item's query rows times the softmax scale, row `qi * group + g` at `qs[r * hd..]`.
#[inline(always)]
fn scaled_queries<E>(job: &Job<'_, E>, rows: &Rows, hd: usize, qs: &mut [f32]) {
    let width = job.shape.num_heads * hd;
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
}

/// Each row's accumulator over its softmax sum, into `out`.
#[inline(always)]
fn write_out<E>(job: &Job<'_, E>, rows: &Rows, hd: usize, acc: &[f32], ls: &[f32]) {
    let width = job.shape.num_heads * hd;
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

/// A decode item (one query, `group` rows) in two passes: every score, each row's softmax,
/// then P·V. Row g's scores are `scores[g * stride..]`, `stride` the context rounded up to a
/// tile.
///
/// # Safety
/// As for [`item`]; `scores` holds `group * stride` floats.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn decode<E: Elem, L: KvLayout, K: RowKernel, const HD: usize>(
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    hd: usize,
    qs: &[f32],
    acc: &mut [f32],
    ls: &mut [f32],
    scores: &mut [f32],
) {
    let ctx = rows.first_limit;
    let stride = ctx.next_multiple_of(TILE);
    assert!(scores.len() >= rows.group * stride && ctx > 0);
    let (k, v) = (job.k.as_ptr(), job.v.as_ptr());
    for (t0, n, offs) in TileWalk::new(layout, kv_head, ctx, &[k], hd) {
        for g in 0..rows.group {
            // SAFETY: q rows are hd long, the row's scores have room for a whole tile from t0
            // (stride is a multiple of 16); offsets of tokens < n are inside K per the caller.
            unsafe {
                let s = scores[g * stride + t0..].as_mut_ptr();
                K::tile_scores::<E, HD>(qs[g * hd..].as_ptr(), k, &offs, n, hd, s);
            }
        }
    }
    // Started before the softmax, so that V's first tile is on its way meanwhile.
    let vs = [v];
    let v_tiles = TileWalk::new(layout, kv_head, ctx, &vs, hd);
    for (g, l) in ls.iter_mut().enumerate().take(rows.group) {
        // SAFETY: the row's `ctx` scores, with room to the next multiple of 16.
        *l = unsafe { K::softmax(scores[g * stride..].as_mut_ptr(), ctx) };
    }
    for (t0, n, offs) in v_tiles {
        for g in 0..rows.group {
            // SAFETY: acc rows are hd long, the row's probabilities are its scores' place;
            // offsets of tokens < n are inside V per the caller.
            unsafe {
                let p = scores[g * stride + t0..].as_ptr();
                K::tile_pv::<E, HD>(p, v, &offs, n, hd, 1.0, acc[g * hd..].as_mut_ptr());
            }
        }
    }
}

/// Walks tokens `0..limit` a tile at a time, yielding each tile's first token, length and
/// tokens' offsets. Each tile is prefetched from `bases` (K, V or both) one step ahead, the
/// first on creation: with paging, the next block is anywhere in the pool, where the hardware
/// prefetcher cannot follow.
struct TileWalk<'a, L, E> {
    layout: &'a L,
    kv_head: usize,
    limit: usize,
    bases: &'a [*const E],
    hd: usize,
    t0: usize,
    offs: [usize; TILE],
}

impl<'a, L: KvLayout, E: Elem> TileWalk<'a, L, E> {
    #[inline(always)]
    fn new(layout: &'a L, kv_head: usize, limit: usize, bases: &'a [*const E], hd: usize) -> Self {
        let mut walk = TileWalk {
            layout,
            kv_head,
            limit,
            bases,
            hd,
            t0: 0,
            offs: [0; TILE],
        };
        walk.look_up(0);
        walk
    }

    /// Looks up the offsets of the tile from `t0` and prefetches it.
    #[inline(always)]
    fn look_up(&mut self, t0: usize) {
        let n = TILE.min(self.limit - t0);
        if n > 0 {
            self.layout.offsets(t0, n, self.kv_head, &mut self.offs);
            for &base in self.bases {
                prefetch(base, &self.offs[..n], self.hd);
            }
        }
    }
}

impl<L: KvLayout, E: Elem> Iterator for TileWalk<'_, L, E> {
    type Item = (usize, usize, [usize; TILE]);

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        let t0 = self.t0;
        if t0 >= self.limit {
            return None;
        }
        let n = TILE.min(self.limit - t0);
        let offs = self.offs;
        self.t0 = t0 + n;
        self.look_up(self.t0);
        Some((t0, n, offs))
    }
}

/// Prefetches the vectors (`hd` values each) at `offs` of `base` into L2. (Into L1, a tile's
/// lines would queue behind L1's few fill buffers; L2 tracks many more misses.)
#[inline(always)]
fn prefetch<E: Elem>(base: *const E, offs: &[usize], hd: usize) {
    let per_line = 64 / std::mem::size_of::<E>();
    for &o in offs {
        for d in (0..hd).step_by(per_line) {
            // SAFETY: prefetches never fault; wrapping_add keeps the address computation
            // defined even if it were out of bounds (it is not: offsets are checked).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(o + d).cast()) };
        }
    }
}

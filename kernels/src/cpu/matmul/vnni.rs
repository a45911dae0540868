//! Quantized weights times a batch of x rows on 16-row tiles with AVX-512 VNNI, for CPUs with
//! AVX-512 VNNI and no tile unit (Ice Lake, Zen 4, a Sapphire Rapids whose hypervisor hides AMX).
//!
//! A vector's 16 lanes are 16 weight rows. A tile of 16 rows is staged once ([`QDot::stage_lanes`])
//! into 8 vectors per block, vector `t` holding values `4t..4t + 4` of each row as unsigned bytes.
//! One `vpdpbusd` of vector `t` with 4 bytes of an x row broadcast to all 16 lanes adds those 4
//! products for each of the 16 rows, so 8 of them give the x row's block dot products with the 16
//! rows, exact i32; three float operations then apply the block's scales (and Q4_1's offset one
//! more). The AVX2 kernel spends a `vpdpbusd`, a conversion and a scaled add on each pair of one
//! x row and one weight row: about four times the instructions for the same multiply-adds.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones, and only its signed operand may be a
//! broadcast from memory, so x is the signed side, as quantized, and each x value is read by the
//! `vpdpbusd` itself as a broadcast from memory (no instruction of its own). Q4_1's nibbles are
//! unsigned as they are; Q8_0's values are staged plus 128 (`w ^ 0x80` read unsigned), and each
//! of its sums starts at `-128 * sum(x)` over the x block, once per x block for every tile.
//!
//! Each x row's 16 outputs come out in one vector and are stored as they are. x needs no packing,
//! and a batch smaller than 16 fills every lane. The rows' chains are interleaved a step at a
//! time, so [`PASS`] independent `vpdpbusd` cover each one's latency; the tile's next 16 rows are
//! prefetched into L2 meanwhile.
//!
//! (An earlier kernel had it the other way round: 16 x rows in the lanes, packed offset by 128,
//! against broadcast weights. Each tile then also paid for its rows' starting sums
//! `-128 * sum(w)` and a transpose of the outputs, and a batch under 16 left lanes idle. In the
//! kernels' `quant_batch` bench it ran Q4_1 batches of 32 at about 0.85x this one's speed and of
//! 8 at about 0.6x; Q8_0 at 32 as fast, at 8 about 0.8x.)

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::amx::{ROWS, SCRATCH};
use super::quant::{BlockQ8x, QDot, MANTISSA_MAGIC as MAGIC};
use super::{Dims, NextTile};
use crate::quant::QK;

/// x rows whose sums stay in registers at once, beside the block's 8 weight vectors.
const PASS: usize = 8;

/// Bytes of one block of a staged tile: 8 vectors of 64.
pub(super) const STAGED_BLOCK: usize = 8 * 64;

thread_local! {
    /// Per thread: each x block's starting sum (the bits of [`MAGIC`], less `128 * sum(x)` for
    /// signed weights) and `MAGIC * d`, for the rows of the call in progress.
    static X_TERMS: RefCell<(Vec<i32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Whole 16-row tiles `n0..n1` of `out = x @ w^T`, x quantized (`xq`).
///
/// # Safety
/// The CPU must have AVX-512F and VNNI, AVX2, FMA and F16C ([`crate::cpu::Isa::vnni`]); `xq`
/// holds `d.m` rows of `d.k / 32` blocks, `w` at least `n1` rows of them, `n1 - n0` is a
/// multiple of 16, and `out` points to `d.m * d.n` f32s of which this call may write columns
/// `n0..n1`.
#[target_feature(enable = "avx512f,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn gemm_lanes<B: QDot>(
    xq: &[BlockQ8x],
    w: &[B],
    d: Dims,
    n0: usize,
    n1: usize,
    out: *mut f32,
) {
    let nb = d.k / QK;
    assert!((n1 - n0).is_multiple_of(ROWS) && xq.len() >= d.m * nb && w.len() >= n1 * nb);
    X_TERMS.with(|terms| {
        let (starts, shifts) = &mut *terms.borrow_mut();
        x_terms::<B>(&xq[..d.m * nb], starts, shifts);
        SCRATCH.with(|cell| {
            let (scales, bytes) = &mut *cell.borrow_mut();
            scales.resize(2 * nb * ROWS, 0.0);
            bytes.resize(nb * STAGED_BLOCK, 0);
            let (dw, mw) = scales.split_at_mut(nb * ROWS);
            // SAFETY (whole block): rows j..j + 16 of w exist (n1 <= its rows, whole tiles),
            // x's rows i..i + R exist (the passes stop at d.m), `scales` and `bytes` sized
            // above, the x terms one per x block, out per the caller; the features per the
            // caller.
            unsafe {
                for j in (n0..n1).step_by(ROWS) {
                    let wt = w.as_ptr().add(j * nb);
                    B::tile_scales(wt, nb, dw.as_mut_ptr(), mw.as_mut_ptr());
                    B::stage_lanes(wt, nb, bytes.as_mut_ptr());
                    let tile_bytes = ROWS * nb * std::mem::size_of::<B>();
                    let mut tile = Tile {
                        nb,
                        staged: bytes.as_ptr(),
                        dw: dw.as_ptr(),
                        mw: mw.as_ptr(),
                        next: NextTile::new(wt, tile_bytes, j + ROWS < n1),
                        tile_bytes,
                    };
                    let mut i = 0;
                    while i < d.m {
                        let at = i * nb;
                        let x = XRows {
                            q: xq.as_ptr().add(at),
                            starts: starts.as_ptr().add(at),
                            shifts: shifts.as_ptr().add(at),
                        };
                        let o = out.add(i * d.n + j);
                        i += match d.m - i {
                            PASS.. => tile.pass::<B, PASS>(x, o, d.n),
                            4.. => tile.pass::<B, 4>(x, o, d.n),
                            2.. => tile.pass::<B, 2>(x, o, d.n),
                            _ => tile.pass::<B, 1>(x, o, d.n),
                        };
                    }
                }
            }
        });
    });
}

/// Each x block's terms for [`gemm_lanes`]: its starting sum and `MAGIC * d`.
///
/// A sum that starts at the bits of the float `MAGIC` (1.5 * 2^23) lands in its mantissa (the
/// block's sum is below 2^22 in magnitude: at most 32 * 128 * 127), so the float read of the
/// bits is `MAGIC + sum` exactly, with no conversion. Signed weights, staged plus 128, start
/// lower by `128 * sum(x)`. `MAGIC * d` is exact in f32 (d has f16's 11 significant bits, 1.5
/// two), so one fused `p * d - MAGIC * d` gives the sum times d rounded once, as
/// `(p - MAGIC) * d` does in two operations, for every finite d. (A block whose values pass
/// f16's range has an infinite d, and its outputs are NaN here where they are infinite there:
/// garbage either way.)
fn x_terms<B: QDot>(xq: &[BlockQ8x], starts: &mut Vec<i32>, shifts: &mut Vec<f32>) {
    let magic = MAGIC.to_bits() as i32;
    starts.clear();
    shifts.clear();
    starts.extend(xq.iter().map(|x| {
        if B::SIGNED {
            magic - 128 * x.qs.iter().map(|&q| i32::from(q)).sum::<i32>()
        } else {
            magic
        }
    }));
    shifts.extend(xq.iter().map(|x| MAGIC * x.d));
}

/// x rows from one row on: their blocks and each block's [`x_terms`], row after row.
#[derive(Clone, Copy)]
struct XRows {
    q: *const BlockQ8x,
    starts: *const i32,
    shifts: *const f32,
}

/// One staged tile of [`gemm_lanes`]: `nb` blocks of 8 vectors at `staged`, the 16 rows' scales
/// `dw[b * 16 + r]` and offsets `mw`, and the next tile to prefetch.
struct Tile {
    nb: usize,
    staged: *const u8,
    dw: *const f32,
    mw: *const f32,
    next: NextTile,
    tile_bytes: usize,
}

impl Tile {
    /// The tile times `R` x rows: x row i's 16 outputs stored at `out + i * n`. Returns `R`.
    ///
    /// # Safety
    /// AVX-512F/VNNI, FMA; `R` rows at `x`, 16 writable f32s at `out + i * n` for each.
    #[inline(always)]
    unsafe fn pass<B: QDot, const R: usize>(&mut self, x: XRows, out: *mut f32, n: usize) -> usize {
        let nb = self.nb;
        // SAFETY: per the caller and [`Tile`].
        unsafe {
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..nb {
                let staged = self.staged.add(b * STAGED_BLOCK);
                let wv: [__m512i; 8] =
                    std::array::from_fn(|t| _mm512_loadu_si512(staged.add(t * 64).cast()));
                let at = |i: usize| i * nb + b;
                let xs: [&BlockQ8x; R] = std::array::from_fn(|i| &*x.q.add(at(i)));
                let mut p: [__m512i; R] =
                    std::array::from_fn(|i| _mm512_set1_epi32(*x.starts.add(at(i))));
                // A step of each row's chain in turn.
                for (t, w) in wv.iter().enumerate() {
                    for (p, xb) in p.iter_mut().zip(&xs) {
                        let q = xb.qs.as_ptr().cast::<i32>().add(t).read_unaligned();
                        *p = _mm512_dpbusd_epi32(*p, *w, _mm512_set1_epi32(q));
                    }
                }
                let dw = _mm512_loadu_ps(self.dw.add(b * ROWS));
                for (i, ((a, p), xb)) in acc.iter_mut().zip(p).zip(&xs).enumerate() {
                    let dot = _mm512_fmsub_ps(
                        _mm512_castsi512_ps(p),
                        _mm512_set1_ps(xb.d),
                        _mm512_set1_ps(*x.shifts.add(at(i))),
                    );
                    *a = _mm512_fmadd_ps(dot, dw, *a);
                }
                if B::HAS_OFFSET {
                    let mw = _mm512_loadu_ps(self.mw.add(b * ROWS));
                    for (a, xb) in acc.iter_mut().zip(&xs) {
                        *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb.s), *a);
                    }
                }
                self.next.keep_up((b + 1) * self.tile_bytes / nb);
            }
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(i * n), *a);
            }
        }
        R
    }
}

/// Dwords `0..4` of 16 rows' 16 bytes at `at + r * stride`: vector `t` holds row r's dword t in
/// its dword r.
///
/// Vector `a` of the loads holds rows `a, a + 4, a + 8, a + 12` in its four 128-bit lanes; a
/// 4 x 4 transpose of dwords within each lane then puts row `4l + a`'s dword t at dword
/// `4l + a` of vector t.
///
/// # Safety
/// 16 bytes readable at each `at + r * stride`; AVX-512F.
#[inline(always)]
pub(super) unsafe fn dwords16(at: *const u8, stride: usize) -> [__m512i; 4] {
    // SAFETY: per the caller.
    unsafe {
        let lane = |r: usize| _mm_loadu_si128(at.add(r * stride).cast());
        let z: [__m512i; 4] = std::array::from_fn(|a| {
            let v = _mm512_castsi128_si512(lane(a));
            let v = _mm512_inserti32x4::<1>(v, lane(a + 4));
            let v = _mm512_inserti32x4::<2>(v, lane(a + 8));
            _mm512_inserti32x4::<3>(v, lane(a + 12))
        });
        let (lo01, lo23) = (
            _mm512_unpacklo_epi32(z[0], z[1]),
            _mm512_unpacklo_epi32(z[2], z[3]),
        );
        let (hi01, hi23) = (
            _mm512_unpackhi_epi32(z[0], z[1]),
            _mm512_unpackhi_epi32(z[2], z[3]),
        );
        [
            _mm512_unpacklo_epi64(lo01, lo23),
            _mm512_unpackhi_epi64(lo01, lo23),
            _mm512_unpacklo_epi64(hi01, hi23),
            _mm512_unpackhi_epi64(hi01, hi23),
        ]
    }
}

//! Quantized weights times a batch of x rows with AVX-512 VNNI, in the AMX kernel's layout
//! (`amx`), for CPUs with AVX-512 VNNI and no tile unit (Ice Lake, Zen 4, a Sapphire Rapids
//! whose hypervisor hides AMX).
//!
//! The x rows are packed as for the tile unit ([`PackedX`]): 16 rows to a group, and in a
//! block's 64-byte vector `t` the values `4t..4t + 4` of each of the 16 rows. One `vpdpbusd`
//! of that vector with 4 bytes of a weight row broadcast to all 16 lanes adds those 4 products
//! for each of the 16 x rows, so 8 of them give one weight row's block dot products with 16 x
//! rows, exact i32 (in two chains of four, for half the latency); a few float operations then
//! apply the block's scales to all 16. The AVX2 kernel spends a `vpdpbusd`, a conversion and a
//! scaled add on each pair of one x row and one weight row: about four times the instructions
//! for the same multiply-adds.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones. Q4_1's nibbles are unsigned. Q8_0's
//! signed weights are staged offset by 128 (`w ^ 0x80` is `w + 128` as a byte), and each
//! lane starts from `-128 * sum(x)`, the packed block's exact byte sum: the sums stay exact.
//!
//! Weight rows go 16 at a time, staged once as bytes for every group of x rows, the next 16
//! rows prefetched into L2 while the first group runs. The f32 scaling and its order are the
//! AMX kernel's, so both give the same outputs.

use std::arch::x86_64::*;

use super::amx::{PackedX, Tiles, GROUP, ROWS, SCRATCH};
use super::quant::{stage_rows, QDot, MANTISSA_MAGIC as MAGIC};
use super::NextTile;
use crate::quant::QK;

/// Weight rows whose sums stay in registers over all the blocks (16 would spill them).
const CHUNK: usize = 8;
const _: () = assert!(ROWS.is_multiple_of(CHUNK));

/// [`Tiles`] with AVX-512 VNNI.
///
/// # Safety
/// The CPU must have AVX-512F and VNNI, AVX2, FMA and F16C ([`crate::cpu::Isa::vnni`]); the
/// operands as [`Tiles`] says.
#[target_feature(enable = "avx512f,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn gemm<B: QDot>(t: &Tiles<'_, B>) {
    let nb = t.blocks();
    let Tiles {
        xp, w, d, n0, n1, ..
    } = *t;
    SCRATCH.with(|cell| {
        let (scales, bytes) = &mut *cell.borrow_mut();
        scales.resize(2 * nb * ROWS, 0.0);
        let mut j = n0;
        // SAFETY (whole block): rows j..j + 16 of w exist (n1 <= n, a whole tile), the packed
        // groups per the caller, `scales` sized above and `bytes` by `stage_rows`, out per the
        // caller; the features per the caller.
        unsafe {
            while j < n1 {
                let wt = w.as_ptr().add(j * nb);
                let (dw, mw) = scales.split_at_mut(nb * ROWS);
                B::tile_scales(wt, nb, dw.as_mut_ptr(), mw.as_mut_ptr());
                let staged = stage_rows(wt, nb, bytes, B::SIGNED);
                let tile_bytes = ROWS * nb * std::mem::size_of::<B>();
                let mut next = NextTile::new(wt, tile_bytes, j + ROWS < n1);
                for g in 0..d.m.div_ceil(GROUP) {
                    let xg = xp.as_ptr().add(g * nb);
                    let mut acc = [_mm512_setzero_ps(); ROWS];
                    // CHUNK weight rows at a time over all blocks, their sums in registers.
                    for (c, part) in acc.chunks_exact_mut(CHUNK).enumerate() {
                        let mut sums = [_mm512_setzero_ps(); CHUNK];
                        for b in 0..nb {
                            let wb = staged.add((b * ROWS + c * CHUNK) * QK);
                            let at = b * ROWS + c * CHUNK;
                            block::<B>(&*xg.add(b), wb, &dw[at..], &mw[at..], &mut sums);
                            if g == 0 && c == 0 {
                                next.keep_up((b + 1) * tile_bytes / nb);
                            }
                        }
                        part.copy_from_slice(&sums);
                    }
                    t.store(g, j, &mut acc);
                }
                j += ROWS;
            }
        }
    });
}

/// Adds one block's scaled dot products of the [`CHUNK`] staged weight rows at `wb` with the
/// packed group `x` to `acc` (lanes the group's x rows): `acc[jj] += p * d_x * d_w[jj]`, plus
/// `m_w[jj] * s_x` for Q4_1.
#[inline(always)]
unsafe fn block<B: QDot>(
    x: &PackedX,
    wb: *const u8,
    dw: &[f32],
    mw: &[f32],
    acc: &mut [__m512; CHUNK],
) {
    // SAFETY: per `gemm`: `wb` holds CHUNK staged rows of 32 bytes, dw/mw (and mw for Q4_1)
    // at least CHUNK scales; AVX-512 F/VNNI per the caller.
    unsafe {
        // Each lane starts at the bits of the float 1.5 * 2^23: the integer sum then lands in
        // its mantissa (a block's sum, once Q8_0's offset is taken off, is at most
        // 32 * 128 * 127 < 2^22; the chains' partial sums may be anything, i32 adds wrap), so
        // subtracting 1.5 * 2^23 as floats gives it exactly, with no conversion (which Intel's
        // cores issue on the same port as `vpdpbusd`).
        let magic = _mm512_set1_epi32(MAGIC.to_bits() as i32);
        let start = if B::SIGNED {
            // Q8_0's weights are offset by 128: start each lane at -128 * sum(x) too.
            let sum = _mm512_load_si512(x.sum.as_ptr().cast());
            _mm512_sub_epi32(magic, _mm512_slli_epi32::<7>(sum))
        } else {
            magic
        };
        let magic = _mm512_set1_ps(MAGIC);
        let dx = _mm512_load_ps(x.d.as_ptr());
        let sx = _mm512_load_ps(x.s.as_ptr());
        for (jj, a) in acc.iter_mut().enumerate() {
            let row = wb.add(jj * QK).cast::<i32>();
            // Two chains of four, for half the latency before the scaling.
            let (mut p, mut q) = (start, _mm512_setzero_si512());
            for t in 0..4 {
                let (xa, xb) = (
                    _mm512_load_si512(x.qs[t].as_ptr().cast()),
                    _mm512_load_si512(x.qs[t + 4].as_ptr().cast()),
                );
                p = _mm512_dpbusd_epi32(p, _mm512_set1_epi32(row.add(t).read_unaligned()), xa);
                q = _mm512_dpbusd_epi32(q, _mm512_set1_epi32(row.add(t + 4).read_unaligned()), xb);
            }
            let p = _mm512_add_epi32(p, q);
            *a = _mm512_fmadd_ps(
                _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(p), magic), dx),
                _mm512_set1_ps(*dw.get_unchecked(jj)),
                *a,
            );
            if B::HAS_OFFSET {
                *a = _mm512_fmadd_ps(sx, _mm512_set1_ps(*mw.get_unchecked(jj)), *a);
            }
        }
    }
}

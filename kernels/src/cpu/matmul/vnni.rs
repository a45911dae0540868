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
//! `vpdpbusd` multiplies unsigned bytes by signed ones, and only its signed operand may be a
//! broadcast from memory. So the weights are the signed side, read by each `vpdpbusd` as a
//! broadcast from memory (no instruction of their own: with a separate broadcast per 4 bytes,
//! the front end, not the vector ports, was the limit), and x is packed offset by 128
//! (`x ^ 0x80` is `x + 128` as an unsigned byte). Each sum then starts at `-128 * sum(w)` over
//! the weight row's block, computed once per 16 rows for every group of x rows: the sums stay
//! exact.
//!
//! Weight rows go 16 at a time, read where they lie (Q8_0) or staged once as bytes for every
//! group of x rows (Q4_1's nibbles unpacked), as the AMX kernel reads them; the next 16 rows
//! are prefetched into L2 while the first group runs. The f32 scaling and its order are the
//! AMX kernel's, so both give the same outputs.

use std::arch::x86_64::*;

use super::amx::{PackedX, Tiles, GROUP, ROWS, SCRATCH};
use super::quant::{QDot, MANTISSA_MAGIC as MAGIC};
use super::NextTile;

/// Weight rows whose sums stay in registers over all the blocks (16 would spill them).
const CHUNK: usize = 8;
const _: () = assert!(ROWS.is_multiple_of(CHUNK));

/// [`Tiles`] with AVX-512 VNNI; x packed offset by 128 (`pack_group` with `unsigned`).
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
        let (scales, bytes, st) = &mut *cell.borrow_mut();
        scales.resize(2 * nb * ROWS, 0.0);
        st.resize(nb * ROWS, 0);
        let mut j = n0;
        // SAFETY (whole block): rows j..j + 16 of w exist (n1 <= n, a whole tile), the packed
        // groups per the caller, `scales` sized above, the rows' bytes where `amx_stage` says,
        // out per the caller; the features per the caller.
        unsafe {
            while j < n1 {
                let wt = w.as_ptr().add(j * nb);
                let (dw, mw) = scales.split_at_mut(nb * ROWS);
                B::tile_scales(wt, nb, dw.as_mut_ptr(), mw.as_mut_ptr());
                // Row r's block b: 32 signed bytes at base + b * step + r * stride (Q8_0's
                // where they lie, Q4_1's nibbles unpacked).
                let (base, step, stride) = B::amx_stage(wt, nb, bytes);
                starts(base, step, stride, nb, st);
                let tile_bytes = ROWS * nb * std::mem::size_of::<B>();
                let mut next = NextTile::new(wt, tile_bytes, j + ROWS < n1);
                for g in 0..d.m.div_ceil(GROUP) {
                    let xg = xp.as_ptr().add(g * nb);
                    let mut acc = [_mm512_setzero_ps(); ROWS];
                    // CHUNK weight rows at a time over all blocks, their sums in registers.
                    for (c, part) in acc.chunks_exact_mut(CHUNK).enumerate() {
                        let mut sums = [_mm512_setzero_ps(); CHUNK];
                        let rows = base.add(c * CHUNK * stride);
                        for b in 0..nb {
                            let at = b * ROWS + c * CHUNK;
                            let (dw, mw, st) = (&dw[at..], &mw[at..], &st[at..]);
                            let wb = rows.add(b * step);
                            block::<B>(&*xg.add(b), wb, stride, dw, mw, st, &mut sums);
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

/// Each of the 16 rows' blocks' starting sum, `st[b * 16 + r]`: the bits of [`MAGIC`] less
/// `128 * sum(w)` over row r's block b (the offset x brings), row r's block b being 32 signed
/// bytes at `base + b * step + r * stride`.
///
/// Eight `vpdpbusd` of the block's 16 rows (two to a vector) with bytes of 1 give 8 partial
/// sums per row; three rounds of pairwise adds (two permutes and an add per pair of vectors)
/// fold them to one per row, in row order.
#[inline(always)]
unsafe fn starts(base: *const u8, step: usize, stride: usize, nb: usize, st: &mut [i32]) {
    assert!(st.len() >= nb * ROWS);
    // SAFETY: per the caller, 16 rows of nb blocks of 32 bytes where the arguments say; `st`
    // checked above; AVX-512F/VNNI per the caller.
    unsafe {
        let ones = _mm512_set1_epi8(1);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        let magic = _mm512_set1_epi32(MAGIC.to_bits() as i32);
        for b in 0..nb {
            let block = base.add(b * step);
            // Vector i: rows 2i and 2i + 1, 8 partial sums each.
            let mut s: [__m512i; 8] = std::array::from_fn(|i| {
                let lo = _mm256_loadu_si256(block.add(2 * i * stride).cast());
                let hi = _mm256_loadu_si256(block.add((2 * i + 1) * stride).cast());
                let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, v)
            });
            // Each round halves the partial sums per row and the vectors: the even lanes of a
            // pair of vectors plus their odd lanes.
            let mut n = s.len();
            while n > 1 {
                for i in 0..n / 2 {
                    let (lo, hi) = (s[2 * i], s[2 * i + 1]);
                    s[i] = _mm512_add_epi32(
                        _mm512_permutex2var_epi32(lo, even, hi),
                        _mm512_permutex2var_epi32(lo, odd, hi),
                    );
                }
                n /= 2;
            }
            let start = _mm512_sub_epi32(magic, _mm512_slli_epi32::<7>(s[0]));
            _mm512_storeu_si512(st.as_mut_ptr().add(b * ROWS).cast(), start);
        }
    }
}

/// Adds one block's scaled dot products of the [`CHUNK`] weight rows at `wb` (`stride` bytes
/// apart) with the packed group `x` to `acc` (lanes the group's x rows):
/// `acc[jj] += p * d_x * d_w[jj]`, plus `m_w[jj] * s_x` for Q4_1.
#[inline(always)]
unsafe fn block<B: QDot>(
    x: &PackedX,
    wb: *const u8,
    stride: usize,
    dw: &[f32],
    mw: &[f32],
    st: &[i32],
    acc: &mut [__m512; CHUNK],
) {
    // SAFETY: per `gemm`: CHUNK rows of 32 bytes at `wb`, dw, mw and st at least
    // CHUNK values; AVX-512 F/VNNI per the caller.
    unsafe {
        let magic = _mm512_set1_ps(MAGIC);
        let dx = _mm512_load_ps(x.d.as_ptr());
        let sx = _mm512_load_ps(x.s.as_ptr());
        for (jj, a) in acc.iter_mut().enumerate() {
            let row = wb.add(jj * stride).cast::<i32>();
            // Each lane starts at the bits of the float 1.5 * 2^23 (less x's offset times the
            // weights' sum): the block's sum then lands in its mantissa (it is at most
            // 32 * 128 * 128 < 2^22 in magnitude; the chains' partial sums may be anything,
            // i32 adds wrap), so subtracting 1.5 * 2^23 as floats gives it exactly, with no
            // conversion (which Intel's cores issue on the same port as `vpdpbusd`). Two
            // chains of four, for half the latency before the scaling.
            let (mut p, mut q) = (
                _mm512_set1_epi32(*st.get_unchecked(jj)),
                _mm512_setzero_si512(),
            );
            for t in 0..4 {
                let (xa, xb) = (
                    _mm512_load_si512(x.qs[t].as_ptr().cast()),
                    _mm512_load_si512(x.qs[t + 4].as_ptr().cast()),
                );
                p = _mm512_dpbusd_epi32(p, xa, _mm512_set1_epi32(row.add(t).read_unaligned()));
                q = _mm512_dpbusd_epi32(q, xb, _mm512_set1_epi32(row.add(t + 4).read_unaligned()));
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

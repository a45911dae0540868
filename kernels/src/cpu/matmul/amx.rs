//! Quantized weights times a batch of x rows on the AMX tile unit (AMX-INT8).
//!
//! One tile multiply (`tdpbssd` for Q8_0's signed weights, `tdpbusd` for Q4_1's unsigned
//! nibbles) takes one 32-value block of 16 weight rows and the same block of 16 x rows and gives
//! their 256 integer dot products: 16 x 16 x 32 multiply-adds in one instruction, where the AVX2
//! kernel does 32 per `vpmaddubsw` pair. The block's scales then apply in AVX-512: each weight
//! row's products, one i32 per x row, are widened and multiplied by `d_w * d_x` (and Q4_1's
//! `m_w * s_x` added), and summed over the row's blocks in f32. After the last block the
//! 16 x 16 sums are transposed so each x row's 16 outputs are stored together.
//!
//! The weight tile is read where it lies: a Q8_0 block's 32 values are contiguous, so 16 rows of
//! block `b` are one strided tile load from the GGUF layout. Q4_1's nibbles are unpacked to bytes
//! first, once per 16 rows for all x rows. The x rows are packed once per call, a group of 16
//! per task ([`pack_group`]): the tile multiply wants its right-hand tile as 8 rows of 64
//! bytes, row g holding values `4g..4g + 4` of each of the 16 x rows in turn.
//!
//! The arithmetic is the AVX2 kernel's: the same quantized x, exact integer block sums, f32
//! scaling; only the order in which the f32 sums are added differs.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::quant::{BlockQ8x, QDot};
use super::{Dims, NextTile};
use crate::quant::QK;

/// x rows per packed group (the tile's 16 i32 columns).
pub(super) const GROUP: usize = 16;

/// Weight rows per tile multiply (and per tile of the `vnni` kernel).
pub(super) const ROWS: usize = 16;

/// One block (32 values) of a group of 16 x rows, as the tile multiply reads it, with the rows'
/// scales: `qs[g][4 * r + t]` is value `4g + t` of row `r`; rows past the batch are zero.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct PackedX {
    pub(super) qs: [[i8; 64]; 8],
    pub(super) d: [f32; GROUP],
    pub(super) s: [f32; GROUP],
}

impl PackedX {
    pub(super) const ZERO: PackedX = PackedX {
        qs: [[0; 64]; 8],
        d: [0.0; GROUP],
        s: [0.0; GROUP],
    };
}

/// Packs one group of quantized x rows (at most [`GROUP`], `nb` blocks each, row after row in
/// `xq`) into its `nb` packed blocks `out`; rows past the group's end are zeros.
pub(super) fn pack_group(xq: &[BlockQ8x], nb: usize, out: &mut [PackedX]) {
    let rows = xq.len() / nb.max(1);
    assert!(rows <= GROUP && out.len() == nb);
    for (b, p) in out.iter_mut().enumerate() {
        for r in 0..GROUP {
            let Some(x) = xq.get(r * nb + b).filter(|_| r < rows) else {
                for qrow in &mut p.qs {
                    qrow[4 * r..4 * r + 4].fill(0);
                }
                p.d[r] = 0.0;
                p.s[r] = 0.0;
                continue;
            };
            // Four values at a time: value `4g + t` of the row goes to byte `4r + t` of tile
            // row `g`.
            for (g, qrow) in p.qs.iter_mut().enumerate() {
                qrow[4 * r..4 * r + 4].copy_from_slice(&x.qs[4 * g..4 * g + 4]);
            }
            p.d[r] = x.d;
            p.s[r] = x.s;
        }
    }
}

/// [`SCRATCH`]'s buffers: scales, staged bytes.
pub(super) type Scratch = (Vec<f32>, Vec<u8>);

thread_local! {
    /// Per thread, for the tile kernels (this one and `vnni`): the 16 weight rows' scales
    /// `[nb][16]` (d, then m) and their staged bytes where a kernel stages them.
    pub(super) static SCRATCH: RefCell<Scratch> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The tile configuration: tmm0/tmm1 the 16 x 16 i32 products, tmm2/tmm3 16 weight rows of 32
/// bytes, tmm4/tmm5 the packed x block (8 rows of 64 bytes). Two of each, for two blocks in
/// flight.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    fn new() -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, (colsb, rows)) in [(64, 16), (64, 16), (32, 16), (32, 16), (64, 8), (64, 8)]
            .into_iter()
            .enumerate()
        {
            c.colsb[t] = colsb;
            c.rows[t] = rows;
        }
        c
    }
}

/// The operands of a tile kernel: columns `n0..n1` (`n1 - n0` a
/// multiple of 16) of `out = x @ w^T`, x packed by [`pack_group`]. `xp` holds `ceil(m / 16) * nb`
/// packed blocks, `w` holds `n * nb` blocks, and `out` points to `m * n` f32s of which the
/// kernel may write columns `n0..n1`.
pub(super) struct Tiles<'a, B> {
    pub xp: &'a [PackedX],
    pub w: &'a [B],
    pub d: Dims,
    pub n0: usize,
    pub n1: usize,
    pub out: *mut f32,
}

impl<B> Tiles<'_, B> {
    /// Blocks per row, once the shapes are checked.
    pub fn blocks(&self) -> usize {
        let nb = self.d.k / QK;
        assert!(
            (self.n1 - self.n0).is_multiple_of(ROWS)
                && self.xp.len() >= self.d.m.div_ceil(GROUP) * nb
                && self.w.len() >= self.n1 * nb
        );
        nb
    }

    /// Stores group `g`'s outputs for weight rows `j..j + 16`: `acc[jj]` holds weight row
    /// `j + jj`'s outputs for the group's x rows; transposed, `acc[r]` holds x row r's 16.
    ///
    /// # Safety
    /// AVX-512F; `out` as the struct says, `j` inside `n0..n1`.
    #[inline(always)]
    pub unsafe fn store(&self, g: usize, j: usize, acc: &mut [__m512; ROWS]) {
        // SAFETY: per the caller; rows past the batch are not stored.
        unsafe {
            super::avx512::transpose16(acc);
            for (r, v) in acc
                .iter()
                .enumerate()
                .take(self.d.m - g * GROUP)
                .take(GROUP)
            {
                _mm512_storeu_ps(self.out.add((g * GROUP + r) * self.d.n + j), *v);
            }
        }
    }
}

/// [`Tiles`] on the AMX tile unit; x packed by [`pack_group`].
///
/// # Safety
/// The CPU must have AVX-512F/BW and AMX-INT8, with the tile state enabled for this process
/// ([`crate::cpu::Isa::Amx`] is only chosen then); the operands as [`Tiles`] says.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn gemm<B: QDot>(t: &Tiles<'_, B>) {
    let nb = t.blocks();
    let Tiles {
        xp, w, d, n0, n1, ..
    } = *t;
    let cfg = TileConfig::new();
    SCRATCH.with(|cell| {
        let (scales, bytes) = &mut *cell.borrow_mut();
        scales.resize(2 * nb * ROWS, 0.0);
        // SAFETY (whole block): the shapes per the caller; the tile instructions read and write
        // only the buffers named (tile loads of 16 rows of 32 bytes at the given stride inside
        // `w` or `bytes`, 8 rows of 64 bytes inside one PackedX, stores of 16 rows of 64 bytes
        // into `c`), and AMX is enabled per the caller.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
            // Two buffers of products: while the tile unit multiplies the next blocks into one,
            // AVX-512 scales the previous blocks' products out of the other.
            let mut c = [
                Products([[0; GROUP]; 2 * ROWS]),
                Products([[0; GROUP]; 2 * ROWS]),
            ];
            let c = c.as_mut_ptr();
            let mut j = n0;
            while j < n1 {
                let wt = w.as_ptr().add(j * nb);
                let (dw, mw) = scales.split_at_mut(nb * ROWS);
                B::tile_scales(wt, nb, dw.as_mut_ptr(), mw.as_mut_ptr());
                let (a, block_step, stride) = B::amx_stage(wt, nb, bytes);
                // The next 16 rows' blocks (they follow these in memory) into L2, at the pace
                // the first group reads these.
                let tile_bytes = ROWS * nb * std::mem::size_of::<B>();
                let mut next = NextTile::new(wt, tile_bytes, j + ROWS < n1);
                for g in 0..d.m.div_ceil(GROUP) {
                    let xg = xp.as_ptr().add(g * nb);
                    let mut acc = [_mm512_setzero_ps(); ROWS];
                    // The blocks whose products wait in a buffer: (first block, count, buffer).
                    let mut pending: Option<(usize, usize, usize)> = None;
                    let mut buf = 0;
                    let mut b = 0;
                    while b < nb {
                        // Two blocks per tile pass, one for an odd last block.
                        let blocks = (nb - b).min(2);
                        let at = a.add(b * block_step);
                        let cb = &mut *c.add(buf);
                        if blocks == 2 {
                            tile_products::<B, 2>(at, stride, block_step, xg.add(b), cb);
                        } else {
                            tile_products::<B, 1>(at, stride, block_step, xg.add(b), cb);
                        }
                        if let Some((pb, count, pbuf)) = pending {
                            scale_blocks::<B>(&*c.add(pbuf), xg, pb, count, dw, mw, &mut acc);
                        }
                        pending = Some((b, blocks, buf));
                        buf ^= 1;
                        b += blocks;
                        if g == 0 {
                            next.keep_up(b * tile_bytes / nb);
                        }
                    }
                    if let Some((pb, count, pbuf)) = pending {
                        scale_blocks::<B>(&*c.add(pbuf), xg, pb, count, dw, mw, &mut acc);
                    }
                    t.store(g, j, &mut acc);
                }
                j += ROWS;
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    });
}

/// Two blocks' 16 x 16 i32 products, one weight row per 16 values.
#[repr(C, align(64))]
struct Products([[i32; GROUP]; 2 * ROWS]);

/// The products of `N` (1 or 2) consecutive blocks of the staged weight tile at `a` (rows
/// `stride` bytes apart, blocks `block_step` apart) and the packed x blocks at `x` into `c`.
#[inline(always)]
unsafe fn tile_products<B: QDot, const N: usize>(
    a: *const u8,
    stride: usize,
    block_step: usize,
    x: *const PackedX,
    c: &mut Products,
) {
    let c0 = c.0.as_mut_ptr().cast::<u8>();
    // One block: load its weight and x tiles, multiply with `$op` into tmm0, store to c.
    macro_rules! one {
        ($op:literal) => {
            asm!(
                "tileloadd tmm2, [{a} + {s}*1]",
                "tileloadd tmm4, [{x} + {xs}*1]",
                "tilezero tmm0",
                concat!($op, " tmm0, tmm2, tmm4"),
                "tilestored [{c} + {cs}*1], tmm0",
                a = in(reg) a, s = in(reg) stride, x = in(reg) x, xs = in(reg) 64usize,
                c = in(reg) c0, cs = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    // Two consecutive blocks, in tmm0 and tmm1, stored one after the other.
    macro_rules! two {
        ($op:literal) => {
            asm!(
                "tileloadd tmm2, [{a} + {s}*1]",
                "tileloadd tmm3, [{a2} + {s}*1]",
                "tileloadd tmm4, [{x} + {xs}*1]",
                "tileloadd tmm5, [{x2} + {xs}*1]",
                "tilezero tmm0",
                "tilezero tmm1",
                concat!($op, " tmm0, tmm2, tmm4"),
                concat!($op, " tmm1, tmm3, tmm5"),
                "tilestored [{c} + {cs}*1], tmm0",
                "tilestored [{c2} + {cs}*1], tmm1",
                a = in(reg) a, a2 = in(reg) a.add(block_step), s = in(reg) stride,
                x = in(reg) x, x2 = in(reg) x.add(1), xs = in(reg) 64usize,
                c = in(reg) c0, c2 = in(reg) c0.add(ROWS * 64), cs = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    // SAFETY: per `gemm`: the staged tile holds 16 rows of 32 bytes for each block read, the
    // packed blocks exist, and `c` has room for N tiles of 16 rows of 64 bytes.
    unsafe {
        match (N, B::SIGNED) {
            (2, true) => two!("tdpbssd"),
            (2, false) => two!("tdpbusd"),
            (_, true) => one!("tdpbssd"),
            (_, false) => one!("tdpbusd"),
        }
    }
}

/// Adds the scaled products of `count` blocks from block `b` on (in `c`, one after the other) to
/// `acc`, the group's packed x blocks at `xg`.
#[inline(always)]
unsafe fn scale_blocks<B: QDot>(
    c: &Products,
    xg: *const PackedX,
    b: usize,
    count: usize,
    dw: &[f32],
    mw: &[f32],
    acc: &mut [__m512; ROWS],
) {
    for t in 0..count {
        let p = &c.0[t * ROWS..(t + 1) * ROWS];
        // SAFETY: per `gemm`: blocks b..b + count of the group are packed at xg.
        unsafe { scale_block::<B>(p, &*xg.add(b + t), dw, mw, b + t, acc) };
    }
}

/// Adds block `b`'s scaled products to `acc`: `acc[jj] += p[jj] * d_x * d_w[jj]` (plus
/// `m_w[jj] * s_x` for Q4_1), lanes the group's x rows.
#[inline(always)]
unsafe fn scale_block<B: QDot>(
    p: &[[i32; GROUP]],
    x: &PackedX,
    dw: &[f32],
    mw: &[f32],
    b: usize,
    acc: &mut [__m512; ROWS],
) {
    // SAFETY: AVX-512F per `gemm`; p has 16 rows of 16 i32, dw/mw hold [nb][16].
    unsafe {
        let dx = _mm512_loadu_ps(x.d.as_ptr());
        let sx = _mm512_loadu_ps(x.s.as_ptr());
        for (jj, a) in acc.iter_mut().enumerate() {
            let prod = _mm512_cvtepi32_ps(_mm512_loadu_si512(p[jj].as_ptr().cast()));
            *a = _mm512_fmadd_ps(
                _mm512_mul_ps(prod, dx),
                _mm512_set1_ps(*dw.get_unchecked(b * ROWS + jj)),
                *a,
            );
            if B::HAS_OFFSET {
                *a = _mm512_fmadd_ps(sx, _mm512_set1_ps(*mw.get_unchecked(b * ROWS + jj)), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_puts_value_4g_plus_t_of_row_r_at_4r_plus_t_of_tile_row_g() {
        // Packing is plain Rust, so this runs on any x86_64 CPU, AMX or not. 19 rows: one full
        // group and a partial one whose missing rows must be zeros.
        let (m, nb) = (19, 2);
        let xq: Vec<BlockQ8x> = (0..m * nb)
            .map(|i| BlockQ8x {
                qs: std::array::from_fn(|v| ((i * 31 + v * 7) % 256) as u8 as i8),
                d: i as f32 + 0.5,
                s: -(i as f32),
            })
            .collect();
        // Stale contents where the packed blocks are reused must not show through.
        let mut packed = vec![
            PackedX {
                qs: [[-3; 64]; 8],
                d: [7.0; GROUP],
                s: [9.0; GROUP],
            };
            2 * nb
        ];
        for (g, out) in packed.chunks_mut(nb).enumerate() {
            let rows = &xq[g * GROUP * nb..((g + 1) * GROUP).min(m) * nb];
            pack_group(rows, nb, out);
        }
        for (g, b) in (0..2).flat_map(|g| (0..nb).map(move |b| (g, b))) {
            let p = &packed[g * nb + b];
            for r in 0..GROUP {
                let row = g * GROUP + r;
                let (want_d, want_s) = if row < m {
                    let x = &xq[row * nb + b];
                    (x.d, x.s)
                } else {
                    (0.0, 0.0)
                };
                assert_eq!(
                    (p.d[r], p.s[r]),
                    (want_d, want_s),
                    "group {g} block {b} row {r}"
                );
                for (tile_row, t) in (0..8).flat_map(|gg| (0..4).map(move |t| (gg, t))) {
                    let got = p.qs[tile_row][4 * r + t];
                    if row >= m {
                        assert_eq!(got, 0, "group {g} block {b} row {r}");
                    } else {
                        let want = xq[row * nb + b].qs[4 * tile_row + t];
                        assert_eq!(got, want, "group {g} block {b} row {r}");
                    }
                }
            }
        }
    }
}

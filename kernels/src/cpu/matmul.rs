//! `out = x @ w^T (+ bias)`: x `[m, k]` f32 activations, w `[n, k]` weights in f32, f16 or bf16,
//! f32 accumulation. Work is `m * n * k` multiply-adds; the weights are read once per call.
//!
//! Three algorithms, chosen by `m`:
//! - **GEMV** (`m <= GEMV_MAX_ROWS`, `AVX2_GEMV_MAX_ROWS` with AVX2: decode and batches of
//!   decodes): each output is a dot product of an x row and a w row, in register tiles of up to
//!   4 x rows by 4 w rows (1 x 8 for a single token), w widened in registers; each tile
//!   prefetches the next one into L2. It streams the weights exactly once, so it runs at memory
//!   bandwidth. Output columns are split across threads.
//! - **GEMM for batches of decodes** (AVX-512, from `GEMV_MAX_ROWS + 1` to 64 rows): x^T is
//!   packed per k block and each weight row, read in place or widened without a transpose, is
//!   broadcast value by value against it (12 weight rows x 32 x rows per microkernel call,
//!   8 x 48, 6 x 64); the next rows are prefetched into L2 meanwhile, and out^T is transposed
//!   once at the end.
//! - **GEMM** (prefill, past 64 rows): Goto-style blocking. A `KC x NC` block of `w^T` is
//!   packed (widened to f32 and transposed with 16x16 register transposes) into a per-thread
//!   buffer, then a 12 x 32 outer-product microkernel runs over it, broadcasting x values.
//!   Output column ranges are split across threads.
//!
//! The GEMV and the Goto GEMM have AVX-512 versions (`avx512`), AVX2 versions at half the width
//! (`avx2`) and a portable fallback (`portable`); the batch GEMM is AVX-512 only.

#[cfg(target_arch = "x86_64")]
mod amx;
mod avx2;
mod avx512;
mod portable;
mod quant;
#[cfg(target_arch = "x86_64")]
mod vnni;

use super::pool::pool;
use super::simd::{Elem, Isa};
use super::tensor::{CpuTensor, CpuWeight, Store, WeightStore};
use super::SharedOut;
use crate::quant::QK;
use quant::QDot;

/// Up to this many rows, the GEMV path (weights streamed once, dot products) beats packing.
pub const GEMV_MAX_ROWS: usize = 8;

/// The same for the AVX2 kernels: their GEMM's packing (every weight widened and transposed per
/// call) costs a batch of 32 decodes more than the GEMV's register tiles, which read each
/// weight tile from cache once per pair of x rows (f16 batched decode 149 -> 284 tok/s on
/// SmolLM2, AMD EPYC, 2 threads).
pub const AVX2_GEMV_MAX_ROWS: usize = 64;

/// Up to this many rows, quantized weights run the integer dot products against x quantized per
/// block; beyond, the GEMM widens them while it packs. The integer path stays ahead well past
/// decode: a batch of decodes reads each weight block once per tile of x rows from cache.
/// On 16-row tiles the integer path takes every row count ([`quantized_x_max_rows`]).
pub const QUANT_GEMV_MAX_ROWS: usize = 64;

/// Up to this many x rows, a matmul over quantized weights quantizes x per block and runs the
/// integer dot products (llama.cpp's arithmetic); beyond, x stays f32 and the weights are
/// widened. With 16-row tiles ([`int8_tiles`]), every row count: a prefill's tile multiplies
/// run far ahead of the f32 GEMM (on AMX 16 x 16 x 32 multiply-adds per instruction, with VNNI
/// 16 x 4 per `vpdpbusd` and the scaling shared by 16 weight rows, against 16 per FMA), and
/// quantizing x costs one pass over it.
pub fn quantized_x_max_rows(isa: Isa) -> usize {
    if int8_tiles(isa) {
        usize::MAX
    } else {
        QUANT_GEMV_MAX_ROWS
    }
}

/// Whether quantized weights meet a batch of x rows 16 weight rows at a time: on the AMX tile
/// unit (`amx`, x packed once per call in groups of 16), or with AVX-512 VNNI (`vnni`).
fn int8_tiles(isa: Isa) -> bool {
    isa == Isa::Amx || isa.vnni()
}

/// From this many rows, quantized weights run on the AMX tile unit where the CPU has one; a
/// single token or two are bound by reading the weights, which the AVX2 kernel does as fast.
pub const AMX_MIN_ROWS: usize = 4;

/// From this many rows, quantized weights run on the VNNI tile kernel where there is no AMX: its
/// lanes are 16 weight rows, so even two x rows fill them, and two beat the AVX2 kernel
/// (`quant_batch` in the kernels' matmul bench: 1.1-1.6x at 2 rows; Q4_1 1.6-2.3x at 4).
pub const VNNI_MIN_ROWS: usize = 2;

/// Whether a quantized matmul of `m` x rows runs on 16-row tiles.
fn tiled(isa: Isa, m: usize) -> bool {
    if isa == Isa::Amx {
        m >= AMX_MIN_ROWS
    } else {
        int8_tiles(isa) && m >= VNNI_MIN_ROWS
    }
}

/// Whether x is packed for those tiles: on the tile unit only (the VNNI kernel broadcasts x
/// from its quantized blocks).
fn packs_x(isa: Isa, m: usize) -> bool {
    isa == Isa::Amx && tiled(isa, m)
}

/// Most x rows quantized (and, on AMX, packed) at once on the tile path: a longer prefill runs
/// in slices of this many rows, so the per-thread buffers of quantized x stay bounded (about 1.25
/// bytes per activation value, 2.5 with AMX's packing, kept for the thread's next call) whatever
/// the prompt's length.
const TILE_ROWS_PER_PASS: usize = 512;

/// Weight bytes per GEMV task, beyond one task per thread.
const GEMV_TASK_BYTES: usize = 1 << 20;

/// Below this many multiply-adds a matmul runs on the calling thread (threads cost microseconds).
const PARALLEL_MIN_WORK: usize = 1 << 16;

/// The GEMVs' software prefetch: while a register tile of weight rows is read, the next tile's
/// bytes (the rows that follow it in memory) are prefetched into L2, line by line in memory order
/// and at the pace the tile is read, so that by its end all of the next one has been asked for.
/// A fixed distance ahead within each row would land in the tile's own later rows whenever rows
/// are shorter than it, and each tile would start cold. L2, not L1: an L1 prefetch holds one of
/// the core's few fill buffers until its line arrives, which caps one core's reads from DRAM (f16
/// decode read 18 GiB/s that way on a 2-core Xeon, 24 GiB/s into L2).
#[cfg(target_arch = "x86_64")]
struct NextTile {
    next: *const u8,
    front: usize,
}

#[cfg(target_arch = "x86_64")]
impl NextTile {
    /// For a tile of `bytes` bytes at `tile` (its rows contiguous); `on` false prefetches
    /// nothing (a tile read again for more x rows, whose next tile was already asked for).
    #[inline(always)]
    fn new<T>(tile: *const T, bytes: usize, on: bool) -> NextTile {
        NextTile {
            next: tile.cast::<u8>().wrapping_add(bytes),
            front: if on { 0 } else { usize::MAX },
        }
    }

    /// The tile has been read up to `bytes` of its own: prefetch the next tile's lines up to
    /// the same offset.
    #[inline(always)]
    fn keep_up(&mut self, bytes: usize) {
        while self.front < bytes {
            // SAFETY: a prefetch is a hint and never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    self.next.wrapping_add(self.front).cast(),
                )
            };
            self.front += 64;
        }
    }
}

/// Shapes of one matmul: x `[m, k]`, w `[n, k]`, out `[m, n]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// `out = x @ w^T (+ bias)`; `out` is reshaped to `[m, n]`.
pub(crate) fn matmul(
    isa: Isa,
    x: &CpuTensor,
    w: &CpuWeight,
    bias: Option<&CpuWeight>,
    out: &mut CpuTensor,
) {
    let dims = Dims {
        m: x.rows(),
        n: w.rows,
        k: x.cols(),
    };
    assert_eq!(
        w.cols, dims.k,
        "matmul: x has {} columns, w has {}",
        dims.k, w.cols
    );
    out.set_shape(dims.m, dims.n);
    let (xs, os) = (x.as_slice(), out.as_mut_slice());
    match &w.store {
        WeightStore::Dense(Store::F32(ws)) => run(isa, xs, &ws[..], dims, os),
        WeightStore::Dense(Store::F16(ws)) => run(isa, xs, &ws[..], dims, os),
        WeightStore::Dense(Store::BF16(ws)) => run(isa, xs, &ws[..], dims, os),
        WeightStore::Q8_0(ws) => run_quant(isa, xs, Some(x.stamp()), ws, dims, os),
        WeightStore::Q4_1(ws) => run_quant(isa, xs, Some(x.stamp()), ws, dims, os),
    }
    if let Some(b) = bias {
        assert_eq!(
            b.store.len(),
            dims.n,
            "matmul: bias length != output columns"
        );
        add_bias(&b.store, dims.n, out.as_mut_slice());
    }
}

/// Weights as the parallel split sees them: how many bytes a row is, and how to compute a
/// range of output columns.
trait Weights: Sync {
    /// Bytes of one row of `k` values.
    fn row_bytes(&self, k: usize) -> usize;

    /// The GEMV's tasks are cut at multiples of this many rows of w.
    fn task_rows(&self, _: Isa, _: usize) -> usize {
        8
    }

    /// Up to this many x rows the GEMV runs, beyond it the GEMM.
    fn gemv_max_rows(&self, isa: Isa) -> usize {
        if isa == Isa::Avx2 {
            AVX2_GEMV_MAX_ROWS
        } else {
            GEMV_MAX_ROWS
        }
    }

    /// Columns per GEMM task.
    fn gemm_chunk(&self, _: Isa, d: Dims, threads: usize) -> usize {
        gemm_chunk(d.n, threads)
    }

    /// Columns `n0..n1` of `out`.
    ///
    /// # Safety
    /// As for [`run_range`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn range(
        &self,
        isa: Isa,
        gemv: bool,
        x: &[f32],
        d: Dims,
        n0: usize,
        n1: usize,
        out: SharedOut,
    );
}

impl<E: Elem> Weights for [E] {
    fn row_bytes(&self, k: usize) -> usize {
        k * std::mem::size_of::<E>()
    }

    /// The AVX-512 GEMM splits batches of decodes its own way.
    fn gemm_chunk(&self, isa: Isa, d: Dims, threads: usize) -> usize {
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Avx512 | Isa::Amx) {
            return avx512::gemm_chunk(d, threads);
        }
        let _ = isa;
        gemm_chunk(d.n, threads)
    }

    unsafe fn range(
        &self,
        isa: Isa,
        gemv: bool,
        x: &[f32],
        d: Dims,
        n0: usize,
        n1: usize,
        out: SharedOut,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { run_range(isa, gemv, x, self, d, n0, n1, out) }
    }
}

/// Quantized weights, with x already quantized for the GEMV (and packed for the AMX tiles).
struct Quantized<'a, B> {
    w: &'a [B],
    xq: &'a [quant::BlockQ8x],
    xp: &'a [quant::Packed],
}

impl<B: QDot> Weights for Quantized<'_, B> {
    fn row_bytes(&self, k: usize) -> usize {
        k / QK * B::QUANT.block_bytes()
    }

    fn gemv_max_rows(&self, isa: Isa) -> usize {
        quantized_x_max_rows(isa)
    }

    /// Whole tiles (16 rows of w) per task where the tile kernels run.
    fn task_rows(&self, isa: Isa, m: usize) -> usize {
        if tiled(isa, m) {
            16
        } else {
            8
        }
    }

    unsafe fn range(
        &self,
        isa: Isa,
        gemv: bool,
        x: &[f32],
        d: Dims,
        n0: usize,
        n1: usize,
        out: SharedOut,
    ) {
        // SAFETY: forwarded from the caller; xq holds x quantized when gemv is set.
        unsafe {
            if gemv {
                quant::gemv_range(isa, self.xq, self.xp, self.w, d, n0, n1, out)
            } else {
                quant::gemm_range(isa, x, self.w, d, n0, n1, out)
            }
        }
    }
}

/// `out = x @ w^T` for quantized `w`: x is quantized once per call, or not at all when the
/// calling thread's last call quantized the same tensor unchanged (`stamp`, [`CpuTensor`]'s).
fn run_quant<B: QDot>(isa: Isa, x: &[f32], stamp: Option<u64>, w: &[B], d: Dims, out: &mut [f32]) {
    if int8_tiles(isa) && d.m > TILE_ROWS_PER_PASS && d.k > 0 && d.n > 0 {
        // A long prefill in slices of rows (out is row-major, so each slice is contiguous).
        for (xs, os) in x
            .chunks(TILE_ROWS_PER_PASS * d.k)
            .zip(out.chunks_mut(TILE_ROWS_PER_PASS * d.n))
        {
            let rows = Dims {
                m: xs.len() / d.k,
                ..d
            };
            run_quant(isa, xs, None, w, rows, os);
        }
        return;
    }
    if d.m <= quantized_x_max_rows(isa) && d.k > 0 {
        quant::with_quantized_x(isa, x, stamp, d.m, d.k, packs_x(isa, d.m), |xq, xp| {
            run(isa, x, &Quantized { w, xq, xp }, d, out)
        });
    } else {
        run(
            isa,
            x,
            &Quantized {
                w,
                xq: &[],
                xp: &[],
            },
            d,
            out,
        );
    }
}

fn run<W: Weights + ?Sized>(isa: Isa, x: &[f32], w: &W, d: Dims, out: &mut [f32]) {
    if d.m == 0 || d.n == 0 {
        return;
    }
    if d.k == 0 {
        out.fill(0.0);
        return;
    }
    let threads = if d.m * d.n * d.k < PARALLEL_MIN_WORK {
        1
    } else {
        pool().threads()
    };
    let gemv = d.m <= w.gemv_max_rows(isa);
    let chunk = if gemv {
        gemv_chunk(d.n, w.row_bytes(d.k), threads, w.task_rows(isa, d.m))
    } else {
        w.gemm_chunk(isa, d, threads)
    };
    let ptr = SharedOut(out.as_mut_ptr());
    let task = |c: usize| {
        let n0 = c * chunk;
        let n1 = (n0 + chunk).min(d.n);
        // SAFETY: `out` has m * n elements; this task writes only columns n0..n1 of each row,
        // and the chunks are disjoint.
        unsafe { w.range(isa, gemv, x, d, n0, n1, ptr) }
    };
    let chunks = d.n.div_ceil(chunk);
    if chunks == 1 {
        task(0);
    } else {
        pool().run(chunks, &task);
    }
}

/// Columns per task for the GEMV, a multiple of `rows` rows of w: one task per thread, and for
/// large matrices up to four per thread, of at least `GEMV_TASK_BYTES` each, so a thread that is
/// descheduled for a while (a busy machine) does not hold up the whole call.
fn gemv_chunk(n: usize, row_bytes: usize, threads: usize, rows: usize) -> usize {
    let per_thread = (n * row_bytes / (GEMV_TASK_BYTES * threads)).clamp(1, 4);
    let tasks = per_thread * threads;
    n.div_ceil(tasks).next_multiple_of(rows).max(rows)
}

/// Widest column block a Goto GEMM task packs (`KC x NC_MAX` f32 = 256 KiB at the AVX-512
/// kernel's depth, in L2).
const NC_MAX: usize = 256;

/// Columns per task for the GEMM: a multiple of the 32-wide microkernel panel, at most about
/// `NC_MAX` (so a packed `KC x NC` block stays in L2), with the task count a multiple of the
/// thread count.
fn gemm_chunk(n: usize, threads: usize) -> usize {
    let per_thread = n.div_ceil(threads);
    let rounds = per_thread.div_ceil(NC_MAX);
    per_thread.div_ceil(rounds).next_multiple_of(32)
}

/// Computes columns `n0..n1` of `out`.
///
/// # Safety
/// `out` must point to `m * n` writable f32s that no other thread writes in columns `n0..n1`.
#[allow(clippy::too_many_arguments)]
unsafe fn run_range<E: Elem>(
    isa: Isa,
    gemv: bool,
    x: &[f32],
    w: &[E],
    d: Dims,
    n0: usize,
    n1: usize,
    out: SharedOut,
) {
    assert!(x.len() >= d.m * d.k && w.len() >= d.n * d.k);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => {
            if gemv {
                // SAFETY: Isa::Avx512 and Isa::Amx are only chosen when the CPU has AVX-512F/FMA/F16C;
                // slices cover the shapes (asserted above); out per the caller.
                unsafe { avx512::gemv(x, w, d, n0, n1, out.0) }
            } else {
                // SAFETY: as above.
                unsafe { avx512::gemm(x, w, d, n0, n1, out.0) }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            if gemv {
                // SAFETY: Isa::Avx2 is only chosen when the CPU has AVX2/FMA/F16C; slices
                // cover the shapes (asserted above); out per the caller.
                unsafe { avx2::gemv(x, w, d, n0, n1, out.0) }
            } else {
                // SAFETY: as above.
                unsafe { avx2::gemm(x, &avx2::Dense { w, k: d.k }, d, n0, n1, out.0) }
            }
        }
        _ => {
            let _ = gemv;
            // SAFETY: per the caller's contract.
            unsafe { portable::matmul(x, w, d, n0, n1, out.0) }
        }
    }
}

/// Adds `bias` (length n) to every row of `out` (`[m, n]`).
fn add_bias(bias: &WeightStore, n: usize, out: &mut [f32]) {
    match bias {
        WeightStore::Dense(Store::F32(b)) => add_rows(b, n, out),
        WeightStore::Dense(Store::F16(b)) => add_rows(b, n, out),
        WeightStore::Dense(Store::BF16(b)) => add_rows(b, n, out),
        quantized => add_rows(&quantized.to_f32(), n, out),
    }
}

fn add_rows<E: Elem>(b: &[E], n: usize, out: &mut [f32]) {
    for row in out.chunks_exact_mut(n) {
        for (o, &bv) in row.iter_mut().zip(b) {
            *o += bv.to_f32();
        }
    }
}

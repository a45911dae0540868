//! Paged attention for a batch that mixes prefill chunks and decodes, with grouped-query
//! attention, reading K/V straight from the paged pool through each sequence's block table.
//!
//! Algorithm (flash-style, never a dense copy of K or V): the work is split into items of
//! (sequence, kv head, chunk of up to `QUERY_CHUNK` queries); an item's rows are every query
//! head of the group for every query of the chunk, so each K/V vector it loads serves
//! `group * queries` rows from L1. The item walks the context in tiles of 16 tokens. A tile's
//! addresses come from the block table (so tiles are independent of the block size). With
//! several queries, each row keeps an online softmax (running max `m`, sum `l`, output
//! accumulator) that it updates once per tile. A decode item (one query) takes two passes in the
//! SIMD kernels instead: every score, each row's softmax, then P·V, so that its tiles do not wait
//! on each other. The next tile's K/V lines are prefetched while the current one is computed
//! (the next block is anywhere in the pool). Query j of a sequence sits at position `context_len - query_len + j` and sees
//! positions `0..=` its own (causal). Items run in parallel on the kernels' thread pool.
//!
//! Cost: O(sum over rows of attended tokens * head_dim) multiply-adds; K/V are read once per
//! item. The same tile loop also runs over contiguous K/V ([`dense_attention`]), which is the
//! baseline that measures what paging costs.

mod avx2;
mod avx512;
mod portable;
mod tiled;

use std::cell::RefCell;

use super::simd::{Elem, Isa};
use super::tensor::{CpuCache, CpuTensor, Store};
use super::SharedOut;
use crate::backend::{AttnSeq, AttnShape};

/// Queries per work item: enough rows to reuse each K/V tile, small enough to balance threads.
const QUERY_CHUNK: usize = 16;
/// Below this many (row, token) pairs an attention call stays on the calling thread.
const PARALLEL_MIN_PAIRS: usize = 4096;
/// Tokens per tile (one AVX-512 vector of scores).
pub(crate) const TILE: usize = 16;

/// Where token `t`'s K/V vector for one kv head lives, as an element offset into the pool.
pub(crate) trait KvLayout: Sync {
    /// Fills `offs[..n]` with the offsets of tokens `t0..t0 + n` (n <= 16) for kv head `h`.
    fn offsets(&self, t0: usize, n: usize, h: usize, offs: &mut [usize; TILE]);
}

/// A sequence's tokens scattered over pool blocks by its block table.
struct Paged<'a> {
    table: &'a [u32],
    block_size: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl KvLayout for Paged<'_> {
    #[inline(always)]
    fn offsets(&self, t0: usize, n: usize, h: usize, offs: &mut [usize; TILE]) {
        let bs = self.block_size;
        // Block sizes are almost always powers of two: a shift instead of a division.
        let (mut block, mut off) = if bs.is_power_of_two() {
            (t0 >> bs.trailing_zeros(), t0 & (bs - 1))
        } else {
            (t0 / bs, t0 % bs)
        };
        let row = self.kv_heads * self.head_dim;
        let head = h * self.head_dim;
        let mut at = (self.table[block] as usize * bs + off) * row + head;
        for o in offs.iter_mut().take(n) {
            if off == bs {
                (block, off) = (block + 1, 0);
                at = self.table[block] as usize * bs * row + head;
            }
            *o = at;
            at += row;
            off += 1;
        }
    }
}

/// A sequence's tokens stored contiguously from token `start` of a `[tokens, kv_heads, hd]` array.
struct Dense {
    start: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl KvLayout for Dense {
    #[inline(always)]
    fn offsets(&self, t0: usize, n: usize, h: usize, offs: &mut [usize; TILE]) {
        for (i, o) in offs.iter_mut().take(n).enumerate() {
            *o = ((self.start + t0 + i) * self.kv_heads + h) * self.head_dim;
        }
    }
}

/// One unit of parallel work: queries `q0..q1` of sequence `seq`, kv head `kv_head`.
#[derive(Clone, Copy)]
struct Item {
    seq: usize,
    kv_head: usize,
    q0: usize,
    q1: usize,
}

/// What every item of a call shares.
pub(crate) struct Job<'a, E> {
    pub q: &'a [f32],
    pub k: &'a [E],
    pub v: &'a [E],
    pub shape: AttnShape,
    pub scale: f32,
    pub out: SharedOut,
}

/// The rows of one item: `queries * group` rows, query-major.
pub(crate) struct Rows {
    /// Row of Q / out of the item's first query.
    pub first_token: usize,
    /// First query head of the group.
    pub first_head: usize,
    pub queries: usize,
    pub group: usize,
    /// Tokens the item's first query attends to; each later query sees one more.
    pub first_limit: usize,
}

thread_local! {
    /// Per-thread item state (scaled q, accumulators, m, l, and a decode's scores), reused
    /// across calls.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Paged attention over `k_cache` / `v_cache`; `out` takes q's shape.
pub(crate) fn paged_attention(
    isa: Isa,
    q: &CpuTensor,
    k_cache: &CpuCache,
    v_cache: &CpuCache,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut CpuTensor,
) {
    let shape = k_cache.shape;
    assert_eq!(
        shape, v_cache.shape,
        "paged_attention: K and V pools differ in shape"
    );
    assert_eq!(
        k_cache.num_blocks, v_cache.num_blocks,
        "paged_attention: pool sizes differ"
    );
    check_batch(
        q,
        shape,
        seqs.iter()
            .map(|s| (s.query_start, s.query_len, s.context_len)),
    );
    for s in seqs {
        let blocks = s.context_len.div_ceil(shape.block_size);
        assert!(
            s.block_table.len() >= blocks,
            "paged_attention: block table too short"
        );
        for &b in &s.block_table[..blocks] {
            assert!(
                (b as usize) < k_cache.num_blocks,
                "paged_attention: block {b} not in pool"
            );
        }
    }
    out.set_shape(q.rows(), q.cols());
    let layout = |i: usize| Paged {
        table: seqs[i].block_table,
        block_size: shape.block_size,
        kv_heads: shape.num_kv_heads,
        head_dim: shape.head_dim,
    };
    let meta: Vec<(usize, usize, usize)> = seqs
        .iter()
        .map(|s| (s.query_start, s.query_len, s.context_len))
        .collect();
    let out = SharedOut(out.as_mut_slice().as_mut_ptr());
    match (&k_cache.store, &v_cache.store) {
        (Store::F32(k), Store::F32(v)) => run(isa, job(q, k, v, shape, scale, out), &meta, layout),
        (Store::F16(k), Store::F16(v)) => run(isa, job(q, k, v, shape, scale, out), &meta, layout),
        (Store::BF16(k), Store::BF16(v)) => {
            run(isa, job(q, k, v, shape, scale, out), &meta, layout)
        }
        _ => panic!("paged_attention: K and V pools differ in storage type"),
    }
}

/// A sequence of a dense (contiguous K/V) attention batch.
#[derive(Debug, Clone, Copy)]
pub struct DenseSeq {
    /// First row of Q / out.
    pub query_start: usize,
    /// Number of queries (the last `query_len` positions of the context).
    pub query_len: usize,
    /// Tokens of context, the queries' own included.
    pub context_len: usize,
    /// First token of this sequence in `k` / `v` (`[tokens, kv_heads, head_dim]`).
    pub kv_start: usize,
}

/// Attention over contiguous K/V (`[tokens, kv_heads, head_dim]` f32) with exactly the tile
/// loop of the paged kernel: the baseline that measures the cost of paging. Same semantics as
/// `Backend::paged_attention`; `shape.block_size` is ignored.
pub fn dense_attention(
    q: &CpuTensor,
    k: &[f32],
    v: &[f32],
    seqs: &[DenseSeq],
    shape: AttnShape,
    scale: f32,
    out: &mut CpuTensor,
) {
    check_batch(
        q,
        shape,
        seqs.iter()
            .map(|s| (s.query_start, s.query_len, s.context_len)),
    );
    let row = shape.num_kv_heads * shape.head_dim;
    for s in seqs {
        assert!(
            (s.kv_start + s.context_len) * row <= k.len().min(v.len()),
            "dense: K/V short"
        );
    }
    out.set_shape(q.rows(), q.cols());
    let layout = |i: usize| Dense {
        start: seqs[i].kv_start,
        kv_heads: shape.num_kv_heads,
        head_dim: shape.head_dim,
    };
    let meta: Vec<(usize, usize, usize)> = seqs
        .iter()
        .map(|s| (s.query_start, s.query_len, s.context_len))
        .collect();
    let out = SharedOut(out.as_mut_slice().as_mut_ptr());
    run(
        Isa::detect(),
        job(q, k, v, shape, scale, out),
        &meta,
        layout,
    );
}

fn job<'a, E>(
    q: &'a CpuTensor,
    k: &'a [E],
    v: &'a [E],
    shape: AttnShape,
    scale: f32,
    out: SharedOut,
) -> Job<'a, E> {
    Job {
        q: q.as_slice(),
        k,
        v,
        shape,
        scale,
        out,
    }
}

/// Panics on shapes that would make the kernels read or write out of bounds.
fn check_batch(q: &CpuTensor, shape: AttnShape, seqs: impl Iterator<Item = (usize, usize, usize)>) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
    } = shape;
    assert!(
        num_kv_heads > 0 && block_size > 0 && head_dim > 0,
        "attention: zero kv heads, head dim or block size"
    );
    assert_eq!(
        num_heads % num_kv_heads,
        0,
        "attention: heads not a multiple of kv heads"
    );
    assert_eq!(
        q.cols(),
        num_heads * head_dim,
        "attention: q width != heads * head_dim"
    );
    for (start, len, ctx) in seqs {
        assert!(len <= ctx, "attention: query_len {len} > context_len {ctx}");
        assert!(
            start + len <= q.rows(),
            "attention: queries past the end of q"
        );
    }
}

/// Scratch floats an item needs: the scaled queries, the accumulators and the softmax state
/// of its rows, and for a decode (one query) on the SIMD kernels each row's scores over the
/// context, rounded up to a whole tile.
fn scratch_len(isa: Isa, rows: &Rows, hd: usize) -> usize {
    let n = rows.queries * rows.group;
    let scores = if rows.queries == 1 && simd_item(isa, hd).is_some() {
        n * rows.first_limit.next_multiple_of(TILE)
    } else {
        0
    };
    n * (2 * hd + 2) + scores
}

/// Splits the batch into items and runs them in parallel.
fn run<E: Elem, L: KvLayout>(
    isa: Isa,
    job: Job<'_, E>,
    meta: &[(usize, usize, usize)],
    layout: impl Fn(usize) -> L + Sync,
) {
    let kvh = job.shape.num_kv_heads;
    let mut items = Vec::new();
    for (seq, &(_, qlen, _)) in meta.iter().enumerate() {
        for q0 in (0..qlen).step_by(QUERY_CHUNK) {
            for kv_head in 0..kvh {
                items.push(Item {
                    seq,
                    kv_head,
                    q0,
                    q1: (q0 + QUERY_CHUNK).min(qlen),
                });
            }
        }
    }
    let group = job.shape.num_heads / kvh;
    let work = |it: &Item| {
        let (start, qlen, ctx) = meta[it.seq];
        let rows = Rows {
            first_token: start + it.q0,
            first_head: it.kv_head * group,
            queries: it.q1 - it.q0,
            group,
            first_limit: ctx - qlen + it.q0 + 1,
        };
        let lay = layout(it.seq);
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let need = scratch_len(isa, &rows, job.shape.head_dim);
            if s.len() < need {
                s.resize(need, 0.0);
            }
            run_item(isa, &job, &lay, it.kv_head, &rows, &mut s[..need]);
        });
    };
    // Row-token pairs (each a head_dim dot product and update): a few thousand pay for waking
    // the other threads.
    let pairs: usize = items
        .iter()
        .map(|it| (it.q1 - it.q0) * group * (meta[it.seq].2 - meta[it.seq].1 + it.q1))
        .sum();
    if items.len() == 1 || pairs < PARALLEL_MIN_PAIRS {
        items.iter().for_each(work);
    } else {
        super::pool::pool().run(items.len(), &|i| work(&items[i]));
    }
}

/// The SIMD kernel that runs an item of head dim `hd` on `isa`, if any (else the portable one).
fn simd_item(isa: Isa, hd: usize) -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    if isa.avx512() && hd.is_multiple_of(16) && hd <= 256 {
        return Some(Isa::Avx512);
    } else if isa == Isa::Avx2 && hd.is_multiple_of(8) && hd <= 256 {
        return Some(Isa::Avx2);
    }
    let _ = (isa, hd);
    None
}

fn run_item<E: Elem, L: KvLayout>(
    isa: Isa,
    job: &Job<'_, E>,
    layout: &L,
    kv_head: usize,
    rows: &Rows,
    scratch: &mut [f32],
) {
    match simd_item(isa, job.shape.head_dim) {
        // SAFETY: Isa::Avx512 is only detected on CPUs with AVX-512F/FMA/F16C (and
        // `Isa::avx512` holds for every ISA above it); the batch was checked (rows inside q and
        // out, block tables inside the pool, K/V long enough), and each item writes only its
        // own (query rows, heads) of out.
        #[cfg(target_arch = "x86_64")]
        Some(Isa::Avx512) => unsafe { avx512::item(job, layout, kv_head, rows, scratch) },
        // SAFETY: Isa::Avx2 is only detected on CPUs with AVX2/FMA/F16C; the rest as above.
        #[cfg(target_arch = "x86_64")]
        Some(Isa::Avx2) => unsafe { avx2::item(job, layout, kv_head, rows, scratch) },
        // SAFETY: as above, without the ISA requirement.
        _ => unsafe { portable::item(job, layout, kv_head, rows, scratch) },
    }
}

//! Paged attention on the device (kernels in `kernels/cuda/paged_attention_*.cu`).
//!
//! A batch is split by kind: decodes (`query_len == 1`) run the decode kernels, prefill chunks
//! (`query_len > 1`) the flash-style prefill kernel; both write disjoint rows of `out`. Decodes
//! whose longest context fits one partition (512 tokens) run v1 (one block per query head and
//! sequence, scores in shared memory); longer ones run v2 (split-KV over 512-token partitions,
//! grid `(heads, seqs, partitions)`) and its reduce kernel. All metadata of a call (block tables
//! padded to the longest, context lengths, query rows) goes up in one upload, reused by every
//! layer of the step. Cost: O(sum of query_len * context_len * heads * head_dim).

use super::tensor::{CudaCache, CudaTensor};
use super::upload::Meta;
use super::{launch, Cuda};
use crate::backend::AttnSeq;
use cudarc::driver::LaunchConfig;

/// Tokens per v2 partition (`KVGATE_PARTITION` in paged_attention_decode.cu).
const PARTITION: usize = 512;
/// Query rows per prefill block (`PF_BQ` in paged_attention_prefill.cu).
const PREFILL_ROWS: usize = 16;

pub(crate) fn paged_attention(
    cuda: &Cuda,
    q: &CudaTensor,
    k_cache: &CudaCache,
    v_cache: &CudaCache,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut CudaTensor,
) {
    let s = k_cache.shape;
    assert_eq!(s, v_cache.shape, "paged_attention: K and V shapes differ");
    assert_eq!(
        k_cache.dtype, v_cache.dtype,
        "paged_attention: K and V types differ"
    );
    assert!(
        !k_cache.is_host() && !v_cache.is_host(),
        "paged_attention: a host pool"
    );
    assert_eq!(q.cols, s.num_heads * s.head_dim, "paged_attention: q width");
    assert!(
        s.num_kv_heads > 0 && s.num_heads.is_multiple_of(s.num_kv_heads),
        "paged_attention: heads not a multiple of KV heads"
    );
    assert!(
        matches!(s.head_dim, 64 | 128) && matches!(s.block_size, 16 | 32),
        "paged_attention: the CUDA kernels support head_dim 64/128 and block_size 16/32, not {}/{}",
        s.head_dim,
        s.block_size
    );
    cuda.set_shape(out, q.rows, q.cols);
    for seq in seqs {
        assert!(
            seq.query_len <= seq.context_len && seq.query_start + seq.query_len <= q.rows,
            "paged_attention: sequence rows out of range"
        );
        let blocks = seq.context_len.div_ceil(s.block_size);
        assert!(
            blocks <= seq.block_table.len(),
            "paged_attention: block table too short"
        );
        if let Some(&b) = seq.block_table[..blocks]
            .iter()
            .find(|&&b| b as usize >= k_cache.num_blocks)
        {
            panic!("paged_attention: block {b} >= {}", k_cache.num_blocks);
        }
    }
    let decodes: Vec<&AttnSeq<'_>> = seqs.iter().filter(|x| x.query_len == 1).collect();
    let prefills: Vec<&AttnSeq<'_>> = seqs.iter().filter(|x| x.query_len > 1).collect();
    let variant = format!(
        "{}_hd{}_bs{}",
        k_cache.dtype.name(),
        s.head_dim,
        s.block_size
    );
    // One upload for both kinds: [decode meta | prefill meta].
    let dmeta = Packed::new(&decodes, s.block_size);
    let pmeta = Packed::new(&prefills, s.block_size);
    let mut all = dmeta.data.clone();
    all.extend_from_slice(&pmeta.data);
    if all.is_empty() {
        return;
    }
    let base = cuda.meta(Meta::Attention, &all);
    let args = Common {
        q: q.ptr(),
        k: k_cache.ptr(),
        v: v_cache.ptr(),
        heads: s.num_heads as i32,
        kv_heads: s.num_kv_heads as i32,
        head_dim: s.head_dim,
        scale,
    };
    if !decodes.is_empty() {
        decode(cuda, &args, &variant, &dmeta, base, out.ptr());
    }
    if !prefills.is_empty() {
        let pbase = base + 4 * dmeta.data.len() as u64;
        prefill(cuda, &args, &variant, &pmeta, pbase, out.ptr());
    }
}

struct Common {
    q: u64,
    k: u64,
    v: u64,
    heads: i32,
    kv_heads: i32,
    head_dim: usize,
    scale: f32,
}

/// Metadata of a set of sequences, as u32 words: block tables `[n, max_blocks]` (padded with
/// block 0, never read), then context lengths, query starts and query lengths (`[n]` each).
struct Packed {
    data: Vec<u32>,
    n: usize,
    max_blocks: usize,
    max_context: usize,
    max_query: usize,
}

impl Packed {
    fn new(seqs: &[&AttnSeq<'_>], block_size: usize) -> Self {
        let max_context = seqs.iter().map(|x| x.context_len).max().unwrap_or(0);
        let max_query = seqs.iter().map(|x| x.query_len).max().unwrap_or(0);
        let max_blocks = max_context.div_ceil(block_size).max(1);
        let n = seqs.len();
        let mut data = vec![0u32; n * max_blocks + 3 * n];
        for (i, x) in seqs.iter().enumerate() {
            let used = x.context_len.div_ceil(block_size);
            data[i * max_blocks..i * max_blocks + used].copy_from_slice(&x.block_table[..used]);
            data[n * max_blocks + i] = x.context_len as u32;
            data[n * max_blocks + n + i] = x.query_start as u32;
            data[n * max_blocks + 2 * n + i] = x.query_len as u32;
        }
        Packed {
            data,
            n,
            max_blocks,
            max_context,
            max_query,
        }
    }

    /// Addresses of the four arrays, given the address of the first word.
    fn ptrs(&self, base: u64) -> (u64, u64, u64, u64) {
        let tables = base;
        let ctx = tables + 4 * (self.n * self.max_blocks) as u64;
        let starts = ctx + 4 * self.n as u64;
        let lens = starts + 4 * self.n as u64;
        (tables, ctx, starts, lens)
    }
}

fn decode(cuda: &Cuda, a: &Common, variant: &str, m: &Packed, base: u64, out: u64) {
    let (tables, ctx, rows, _) = m.ptrs(base);
    let (q, k, v, heads, kv_heads, scale) = (a.q, a.k, a.v, a.heads, a.kv_heads, a.scale);
    let max_blocks = m.max_blocks as i32;
    let threads = (128, 1, 1);
    if m.max_context <= PARTITION {
        let cfg = LaunchConfig {
            grid_dim: (a.heads as u32, m.n as u32, 1),
            block_dim: threads,
            shared_mem_bytes: (m.max_context.max(1) * 4) as u32,
        };
        launch!(
            cuda,
            format!("paged_attention_v1_{variant}"),
            cfg,
            out,
            q,
            k,
            v,
            tables,
            max_blocks,
            ctx,
            rows,
            heads,
            kv_heads,
            scale
        );
        return;
    }
    let parts = m.max_context.div_ceil(PARTITION);
    let partial = m.n * a.heads as usize * parts;
    // Uninitialized: v2 writes every partition the reduce reads.
    let tmp = uninit(cuda, partial * a.head_dim);
    let maxes = uninit(cuda, partial);
    let sums = uninit(cuda, partial);
    let (t, mx, sm) = (
        super::tensor::dptr(&tmp, &cuda.stream),
        super::tensor::dptr(&maxes, &cuda.stream),
        super::tensor::dptr(&sums, &cuda.stream),
    );
    let cfg = LaunchConfig {
        grid_dim: (a.heads as u32, m.n as u32, parts as u32),
        block_dim: threads,
        shared_mem_bytes: 0,
    };
    launch!(
        cuda,
        format!("paged_attention_v2_{variant}"),
        cfg,
        t,
        mx,
        sm,
        q,
        k,
        v,
        tables,
        max_blocks,
        ctx,
        rows,
        heads,
        kv_heads,
        scale
    );
    let cfg = LaunchConfig {
        grid_dim: (a.heads as u32, m.n as u32, 1),
        block_dim: threads,
        shared_mem_bytes: 0,
    };
    let p = parts as i32;
    launch!(
        cuda,
        format!("paged_attention_v2_reduce_hd{}", a.head_dim),
        cfg,
        out,
        t,
        mx,
        sm,
        ctx,
        rows,
        heads,
        p
    );
    // The scratch buffers are freed in stream order, after the kernels that read them.
    drop((tmp, maxes, sums));
}

fn prefill(cuda: &Cuda, a: &Common, variant: &str, m: &Packed, base: u64, out: u64) {
    let (tables, ctx, starts, lens) = m.ptrs(base);
    let (q, k, v, heads, kv_heads, scale) = (a.q, a.k, a.v, a.heads, a.kv_heads, a.scale);
    let max_blocks = m.max_blocks as i32;
    let cfg = LaunchConfig {
        grid_dim: (
            m.max_query.div_ceil(PREFILL_ROWS) as u32,
            a.heads as u32,
            m.n as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        cuda,
        format!("paged_prefill_{variant}"),
        cfg,
        out,
        q,
        k,
        v,
        tables,
        max_blocks,
        starts,
        lens,
        ctx,
        heads,
        kv_heads,
        scale
    );
}

fn uninit(cuda: &Cuda, len: usize) -> cudarc::driver::CudaSlice<f32> {
    // SAFETY: stream-ordered allocation; the kernels write before they read (see the caller).
    let r = unsafe { cuda.stream.alloc::<f32>(len.max(1)) };
    cuda.check(r, "alloc")
}

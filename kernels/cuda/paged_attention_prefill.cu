// Paged prefill attention: a chunk of `query_len` new tokens of a sequence attends causally to its
// cached prefix plus the chunk itself (this step's K/V were written by reshape_and_cache first).
// Query j sits at position context_len - query_len + j and sees positions 0..= its own.
//
// Flash-style, never a materialized score matrix: grid (ceil(max_query_len / PF_BQ), num_heads,
// num_seqs), PF_THREADS threads. A block holds PF_BQ query rows of one head in shared memory; it
// walks the context in tiles of PF_BK tokens, gathering each tile's K/V rows through the block
// table into shared memory (f32). Each warp owns PF_BQ / warps rows; a lane scores one token of
// the tile, the row's online softmax (running max, sum) is updated once per tile, and lane i
// accumulates dims i, i+32, ... of the output. Scale is folded into Q on load.
#include "kvgate_common.cuh"

#define PF_BQ 16
#define PF_BK 32
#define PF_THREADS 128
#define PF_WARPS (PF_THREADS / KVGATE_WARP)
#define PF_ROWS_PER_WARP (PF_BQ / PF_WARPS)

namespace kvgate {

template <typename T, int HD, int BS>
__device__ __forceinline__ void prefill(float* __restrict__ out, const float* __restrict__ q,
                                        const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                        const unsigned* __restrict__ block_tables, int max_blocks_per_seq,
                                        const int* __restrict__ query_starts, const int* __restrict__ query_lens,
                                        const int* __restrict__ context_lens, int num_heads, int num_kv_heads,
                                        float scale) {
    constexpr int VEC = HD / KVGATE_WARP;
    __shared__ float qs[PF_BQ][HD];
    __shared__ float ks[PF_BK][HD + 1];  // +1: lane j reads row j, conflict-free
    __shared__ float vs[PF_BK][HD];

    const int head = blockIdx.y, seq = blockIdx.z;
    const int qlen = query_lens[seq];
    const int q0 = blockIdx.x * PF_BQ;
    if (q0 >= qlen) return;
    const int nrows = min(PF_BQ, qlen - q0);
    const int ctx = context_lens[seq];
    const int first_pos = ctx - qlen + q0;  // position of the tile's first query
    const int kv_end = first_pos + nrows;    // tokens the tile's last query sees
    const int kv_head = head / (num_heads / num_kv_heads);
    const unsigned* table = block_tables + (long)seq * max_blocks_per_seq;
    const long row = (long)num_kv_heads * HD;
    const long qrow0 = (long)query_starts[seq] + q0;
    const int lane = threadIdx.x % KVGATE_WARP, warp = threadIdx.x / KVGATE_WARP;

    for (int i = threadIdx.x; i < PF_BQ * HD; i += PF_THREADS) {
        const int r = i / HD, d = i % HD;
        qs[r][d] = r < nrows ? q[((qrow0 + r) * num_heads + head) * HD + d] * scale : 0.f;
    }

    float m[PF_ROWS_PER_WARP], l[PF_ROWS_PER_WARP], acc[PF_ROWS_PER_WARP][VEC];
#pragma unroll
    for (int j = 0; j < PF_ROWS_PER_WARP; ++j) {
        m[j] = KVGATE_NEG_INF;
        l[j] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[j][i] = 0.f;
    }

    for (int t0 = 0; t0 < kv_end; t0 += PF_BK) {
        __syncthreads();  // previous tile fully consumed (and Q stored, on the first pass)
        for (int i = threadIdx.x; i < PF_BK * HD; i += PF_THREADS) {
            const int tk = i / HD, d = i % HD, t = t0 + tk;
            float kf = 0.f, vf = 0.f;
            if (t < kv_end) {
                const long at = ((long)table[t / BS] * BS + t % BS) * row + (long)kv_head * HD + d;
                kf = to_f32(k_cache[at]);
                vf = to_f32(v_cache[at]);
            }
            ks[tk][d] = kf;
            vs[tk][d] = vf;
        }
        __syncthreads();

#pragma unroll
        for (int j = 0; j < PF_ROWS_PER_WARP; ++j) {
            const int r = warp * PF_ROWS_PER_WARP + j;
            if (r >= nrows) continue;  // warp-uniform
            const int pos = first_pos + r;
            const int t = t0 + lane;
            float s = 0.f;
#pragma unroll 8
            for (int d = 0; d < HD; ++d) s += qs[r][d] * ks[lane][d];
            s = t <= pos ? s : KVGATE_NEG_INF;
            const float tile_max = warp_max(s);
            if (tile_max == KVGATE_NEG_INF) continue;  // tile entirely in this row's future
            const float m_new = fmaxf(m[j], tile_max);
            const float corr = __expf(m[j] - m_new);
            const float p = __expf(s - m_new);
            l[j] = l[j] * corr + warp_sum(p);
            m[j] = m_new;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[j][i] *= corr;
#pragma unroll 4
            for (int tk = 0; tk < PF_BK; ++tk) {
                const float pt = __shfl_sync(0xffffffffu, p, tk);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[j][i] += pt * vs[tk][lane + i * KVGATE_WARP];
            }
        }
    }

#pragma unroll
    for (int j = 0; j < PF_ROWS_PER_WARP; ++j) {
        const int r = warp * PF_ROWS_PER_WARP + j;
        if (r >= nrows) continue;
        const float inv = 1.f / l[j];  // l > 0: every query sees at least itself
        float* o = out + ((qrow0 + r) * num_heads + head) * HD;
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[lane + i * KVGATE_WARP] = acc[j][i] * inv;
    }
}

}  // namespace kvgate

#define KVGATE_PREFILL(NAME, T, HD, BS)                                                                \
    extern "C" __global__ void __launch_bounds__(PF_THREADS) paged_prefill_##NAME##_hd##HD##_bs##BS(   \
        float* out, const float* q, const T* k_cache, const T* v_cache, const unsigned* block_tables, \
        int max_blocks_per_seq, const int* query_starts, const int* query_lens,                       \
        const int* context_lens, int num_heads, int num_kv_heads, float scale) {                      \
        kvgate::prefill<T, HD, BS>(out, q, k_cache, v_cache, block_tables, max_blocks_per_seq,        \
                                   query_starts, query_lens, context_lens, num_heads, num_kv_heads,   \
                                   scale);                                                            \
    }

#define KVGATE_PREFILL_DTYPE(NAME, T) \
    KVGATE_PREFILL(NAME, T, 64, 16)   \
    KVGATE_PREFILL(NAME, T, 64, 32)   \
    KVGATE_PREFILL(NAME, T, 128, 16)  \
    KVGATE_PREFILL(NAME, T, 128, 32)

KVGATE_PREFILL_DTYPE(f32, float)
KVGATE_PREFILL_DTYPE(f16, __half)
KVGATE_PREFILL_DTYPE(bf16, __nv_bfloat16)

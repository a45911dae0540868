// Paged attention for decode (one query token per sequence), grouped-query attention, reading
// K/V from the paged pool `[num_blocks, BS, num_kv_heads, HD]` through each sequence's block table.
//
// v1 (short contexts): grid (num_heads, num_seqs), 128 threads; the whole context's scores live in
//   dynamic shared memory (max_context_len * 4 bytes, set by the launcher), so v1 is for contexts
//   up to a few thousand tokens.
// v2 (split-KV, Flash-Decoding style): grid (num_heads, num_seqs, max_partitions), 128 threads;
//   each block attends to one partition of KVGATE_PARTITION tokens and writes its normalized
//   partial output, max score and exp-sum; paged_attention_v2_reduce merges partitions
//   (grid (num_heads, num_seqs), 128 threads).
//
// Scores: each warp takes a token, each lane HD/32 dims, reduced with shuffles. P.V: each thread
// owns one dim for a strided subset of tokens. All arithmetic in f32.
#include "kvgate_common.cuh"

#define KVGATE_PARTITION 512
#define DECODE_THREADS 128
#define DECODE_WARPS (DECODE_THREADS / KVGATE_WARP)

namespace kvgate {

// Attends one query head of one sequence to context tokens [t0, t1) (t1 > t0). `logits` holds
// t1 - t0 floats of shared memory, `red` DECODE_THREADS floats. Writes the softmax-normalized
// output over the range to out[0..HD) (global), and its max score and exp-sum (thread 0).
template <typename T, int HD, int BS>
__device__ __forceinline__ void decode_range(const float* __restrict__ q, const T* __restrict__ k_cache,
                                             const T* __restrict__ v_cache,
                                             const unsigned* __restrict__ table, int kv_head,
                                             int num_kv_heads, float scale, int t0, int t1,
                                             float* logits, float* red, float* __restrict__ out,
                                             float* __restrict__ out_max, float* __restrict__ out_sum) {
    constexpr int VEC = HD / KVGATE_WARP;
    const int lane = threadIdx.x % KVGATE_WARP, warp = threadIdx.x / KVGATE_WARP;
    const long row = (long)num_kv_heads * HD;
    const long head_off = (long)kv_head * HD;

    float qv[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) qv[i] = q[lane * VEC + i] * scale;

    float m = KVGATE_NEG_INF;
    for (int t = t0 + warp; t < t1; t += DECODE_WARPS) {
        const long slot = (long)table[t / BS] * BS + t % BS;
        const T* k = k_cache + slot * row + head_off + lane * VEC;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) s += qv[i] * to_f32(k[i]);
        s = warp_sum(s);
        if (lane == 0) logits[t - t0] = s;
        m = fmaxf(m, s);
    }
    m = block_max(m, red);

    float l = 0.f;
    for (int i = threadIdx.x; i < t1 - t0; i += DECODE_THREADS) {
        const float p = __expf(logits[i] - m);
        logits[i] = p;
        l += p;
    }
    l = block_sum(l, red);  // its barriers also publish the exponentiated logits
    const float inv = 1.f / l;

    // Each dim is owned by G threads that split the tokens; partial sums meet in `red`.
    constexpr int G = DECODE_THREADS / HD;
    const int d = threadIdx.x % HD, g = threadIdx.x / HD;
    float acc = 0.f;
    for (int t = t0 + g; t < t1; t += G) {
        const long slot = (long)table[t / BS] * BS + t % BS;
        acc += logits[t - t0] * to_f32(v_cache[slot * row + head_off + d]);
    }
    __syncthreads();
    red[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < HD) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < G; ++j) sum += red[j * HD + threadIdx.x];
        out[threadIdx.x] = sum * inv;
    }
    if (threadIdx.x == 0) {
        if (out_max) *out_max = m;
        if (out_sum) *out_sum = l;
    }
}

// v1: one block per (query head, sequence) over the whole context.
template <typename T, int HD, int BS>
__device__ __forceinline__ void decode_v1(float* __restrict__ out, const float* __restrict__ q,
                                          const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                          const unsigned* __restrict__ block_tables, int max_blocks_per_seq,
                                          const int* __restrict__ context_lens, const int* __restrict__ q_rows,
                                          int num_heads, int num_kv_heads, float scale) {
    extern __shared__ float logits[];
    __shared__ float red[DECODE_THREADS];
    const int head = blockIdx.x, seq = blockIdx.y;
    const int ctx = context_lens[seq];
    if (ctx <= 0) return;
    const int kv_head = head / (num_heads / num_kv_heads);
    const long q_off = ((long)q_rows[seq] * num_heads + head) * HD;
    decode_range<T, HD, BS>(q + q_off, k_cache, v_cache, block_tables + (long)seq * max_blocks_per_seq,
                            kv_head, num_kv_heads, scale, 0, ctx, logits, red, out + q_off, nullptr,
                            nullptr);
}

// v2: one block per (query head, sequence, partition). Partial results are laid out
// [num_seqs, num_heads, max_partitions, HD] and [num_seqs, num_heads, max_partitions].
template <typename T, int HD, int BS>
__device__ __forceinline__ void decode_v2(float* __restrict__ tmp_out, float* __restrict__ max_logits,
                                          float* __restrict__ exp_sums, const float* __restrict__ q,
                                          const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                          const unsigned* __restrict__ block_tables, int max_blocks_per_seq,
                                          const int* __restrict__ context_lens, const int* __restrict__ q_rows,
                                          int num_heads, int num_kv_heads, float scale) {
    __shared__ float logits[KVGATE_PARTITION];
    __shared__ float red[DECODE_THREADS];
    const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
    const int ctx = context_lens[seq];
    const int t0 = part * KVGATE_PARTITION;
    if (t0 >= ctx) return;
    const int t1 = min(ctx, t0 + KVGATE_PARTITION);
    const int kv_head = head / (num_heads / num_kv_heads);
    const long q_off = ((long)q_rows[seq] * num_heads + head) * HD;
    const long p_idx = ((long)seq * num_heads + head) * gridDim.z + part;
    decode_range<T, HD, BS>(q + q_off, k_cache, v_cache, block_tables + (long)seq * max_blocks_per_seq,
                            kv_head, num_kv_heads, scale, t0, t1, logits, red, tmp_out + p_idx * HD,
                            max_logits + p_idx, exp_sums + p_idx);
}

// Merges the partitions of v2: out = sum_p w_p * o_p / sum_p w_p, w_p = sum_p * exp(max_p - M).
template <int HD>
__device__ __forceinline__ void decode_v2_reduce(float* __restrict__ out, const float* __restrict__ tmp_out,
                                                 const float* __restrict__ max_logits,
                                                 const float* __restrict__ exp_sums,
                                                 const int* __restrict__ context_lens,
                                                 const int* __restrict__ q_rows, int num_heads,
                                                 int max_partitions) {
    const int head = blockIdx.x, seq = blockIdx.y;
    const int ctx = context_lens[seq];
    if (ctx <= 0) return;
    const int parts = (ctx + KVGATE_PARTITION - 1) / KVGATE_PARTITION;
    const long base = ((long)seq * num_heads + head) * max_partitions;
    float m = KVGATE_NEG_INF;
    for (int p = 0; p < parts; ++p) m = fmaxf(m, max_logits[base + p]);
    float total = 0.f;
    for (int p = 0; p < parts; ++p) total += exp_sums[base + p] * __expf(max_logits[base + p] - m);
    const float inv = 1.f / total;
    float* o = out + ((long)q_rows[seq] * num_heads + head) * HD;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < parts; ++p)
            acc += exp_sums[base + p] * __expf(max_logits[base + p] - m) * tmp_out[(base + p) * HD + d];
        o[d] = acc * inv;
    }
}

}  // namespace kvgate

#define KVGATE_DECODE(NAME, T, HD, BS)                                                                   \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_attention_v1_##NAME##_hd##HD##_bs##BS( \
        float* out, const float* q, const T* k_cache, const T* v_cache, const unsigned* block_tables,   \
        int max_blocks_per_seq, const int* context_lens, const int* q_rows, int num_heads,              \
        int num_kv_heads, float scale) {                                                                \
        kvgate::decode_v1<T, HD, BS>(out, q, k_cache, v_cache, block_tables, max_blocks_per_seq,        \
                                     context_lens, q_rows, num_heads, num_kv_heads, scale);             \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_attention_v2_##NAME##_hd##HD##_bs##BS( \
        float* tmp_out, float* max_logits, float* exp_sums, const float* q, const T* k_cache,           \
        const T* v_cache, const unsigned* block_tables, int max_blocks_per_seq, const int* context_lens,\
        const int* q_rows, int num_heads, int num_kv_heads, float scale) {                              \
        kvgate::decode_v2<T, HD, BS>(tmp_out, max_logits, exp_sums, q, k_cache, v_cache, block_tables,  \
                                     max_blocks_per_seq, context_lens, q_rows, num_heads, num_kv_heads, \
                                     scale);                                                            \
    }

#define KVGATE_DECODE_DTYPE(NAME, T) \
    KVGATE_DECODE(NAME, T, 64, 16)   \
    KVGATE_DECODE(NAME, T, 64, 32)   \
    KVGATE_DECODE(NAME, T, 128, 16)  \
    KVGATE_DECODE(NAME, T, 128, 32)

KVGATE_DECODE_DTYPE(f32, float)
KVGATE_DECODE_DTYPE(f16, __half)
KVGATE_DECODE_DTYPE(bf16, __nv_bfloat16)

#define KVGATE_DECODE_REDUCE(HD)                                                                       \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_attention_v2_reduce_hd##HD(     \
        float* out, const float* tmp_out, const float* max_logits, const float* exp_sums,             \
        const int* context_lens, const int* q_rows, int num_heads, int max_partitions) {              \
        kvgate::decode_v2_reduce<HD>(out, tmp_out, max_logits, exp_sums, context_lens, q_rows,        \
                                     num_heads, max_partitions);                                      \
    }

KVGATE_DECODE_REDUCE(64)
KVGATE_DECODE_REDUCE(128)

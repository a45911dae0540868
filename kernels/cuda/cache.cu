// KV cache writes and copy-on-write block copies. Pools are `[num_blocks, block_size, num_kv_heads,
// head_dim]`, so physical slot s = block * block_size + offset starts at element s * row
// (row = num_kv_heads * head_dim) whatever the block size.
//
// reshape_and_cache_<t>: grid (num_tokens), 256 threads; token i's K and V rows (f32) are stored in
//   slot slots[i], converted to the pool's type. A slot of 0xFFFFFFFF (padding) is skipped.
// copy_blocks: grid (num_pairs, num_caches), 256 threads; one launch copies every (src, dst) pair
//   of a step in every cache it is given (K and V of all layers), 16 bytes per thread per step.
//   block_bytes must be a multiple of 16 (true for head_dim 64/128 in f16/bf16/f32).
// Device <-> host swap is cuMemcpyAsync over pinned memory in the launcher, not a kernel.
#include "kvgate_common.cuh"

#define KVGATE_NO_SLOT 0xFFFFFFFFu

namespace kvgate {

template <typename T>
__device__ __forceinline__ void reshape_and_cache(const float* __restrict__ k, const float* __restrict__ v,
                                                  T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                  const unsigned* __restrict__ slots, int row) {
    const unsigned slot = slots[blockIdx.x];
    if (slot == KVGATE_NO_SLOT) return;
    const float* ks = k + (long)blockIdx.x * row;
    const float* vs = v + (long)blockIdx.x * row;
    T* kd = k_cache + (long)slot * row;
    T* vd = v_cache + (long)slot * row;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        kd[i] = from_f32<T>(ks[i]);
        vd[i] = from_f32<T>(vs[i]);
    }
}

}  // namespace kvgate

#define KVGATE_RESHAPE(NAME, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) reshape_and_cache_##NAME(                       \
        const float* k, const float* v, T* k_cache, T* v_cache, const unsigned* slots, int row) {    \
        kvgate::reshape_and_cache<T>(k, v, k_cache, v_cache, slots, row);                             \
    }

KVGATE_RESHAPE(f32, float)
KVGATE_RESHAPE(f16, __half)
KVGATE_RESHAPE(bf16, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(256) copy_blocks(const unsigned long long* cache_ptrs,
                                                             const unsigned* pairs, long block_bytes) {
    uint4* cache = reinterpret_cast<uint4*>(cache_ptrs[blockIdx.y]);
    const long n = block_bytes / 16;
    const long src = (long)pairs[2 * blockIdx.x] * n;
    const long dst = (long)pairs[2 * blockIdx.x + 1] * n;
    for (long i = threadIdx.x; i < n; i += blockDim.x) cache[dst + i] = cache[src + i];
}

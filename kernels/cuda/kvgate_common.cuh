// Shared helpers of the kvgate CUDA kernels: storage-type conversion (f32 / f16 / bf16, always
// accumulated in f32) and warp/block reductions. Included by every .cu file; NVRTC finds it
// through --include-path=kernels/cuda.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define KVGATE_WARP 32
// -inf without <cmath> (NVRTC has no host headers).
#define KVGATE_NEG_INF __int_as_float(0xff800000)

namespace kvgate {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = KVGATE_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = KVGATE_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; `scratch` holds one float per warp. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % KVGATE_WARP, warp = threadIdx.x / KVGATE_WARP;
    const int warps = (blockDim.x + KVGATE_WARP - 1) / KVGATE_WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// Max over the whole block; same contract as block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % KVGATE_WARP, warp = threadIdx.x / KVGATE_WARP;
    const int warps = (blockDim.x + KVGATE_WARP - 1) / KVGATE_WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : KVGATE_NEG_INF;
    return warp_max(v);
}

}  // namespace kvgate

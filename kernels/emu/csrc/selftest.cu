// Kernels for the harness's own tests (kernels/emu/tests/harness.rs): correct ones that exercise
// each primitive, and deliberately wrong ones, each with one mistake the harness must catch.
#include "kvgate_common.cuh"

// Correct: block-wide sum of n floats (one per thread) through kvgate_common's block_sum.
extern "C" __global__ void __launch_bounds__(1024) selftest_block_sum(const float* x, float* out) {
    __shared__ float scratch[KVGATE_WARP];
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    const float s = kvgate::block_sum(v, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// Correct: every warp intrinsic; out[i] per thread i, 6 values each.
extern "C" __global__ void __launch_bounds__(256) selftest_warp_ops(const int* x, int* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const int v = x[i];
    int* o = out + i * 6;
    o[0] = __shfl_sync(0xffffffffu, v, (lane + 5) % 32);
    o[1] = __shfl_up_sync(0xffffffffu, v, 3);
    o[2] = __shfl_down_sync(0xffffffffu, v, 3);
    o[3] = __shfl_xor_sync(0xffffffffu, v, 9);
    o[4] = (int)__ballot_sync(0xffffffffu, v % 3 == 0);
    o[5] = __any_sync(0xffffffffu, v == 7) * 2 + __all_sync(0xffffffffu, v >= 0);
}

// Correct: a device-wide counter and max through atomics from every thread of every block.
extern "C" __global__ void __launch_bounds__(1024) selftest_atomics(unsigned* counter, int* maximum, float* sum) {
    atomicAdd(counter, 1u);
    atomicMax(maximum, (int)(blockIdx.x * blockDim.x + threadIdx.x));
    atomicAdd(sum, 0.5f);
}

// Correct: f32 -> f16/bf16 -> f32 through CUDA's conversions, per element.
extern "C" __global__ void __launch_bounds__(256) selftest_convert(const float* x, unsigned short* h,
                                                                  unsigned short* b, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        h[i] = __half_as_ushort(__float2half_rn(x[i]));
        b[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    }
}

// Correct: dynamic shared memory, reversed through a barrier.
extern "C" __global__ void __launch_bounds__(1024) selftest_dyn_reverse(const float* x, float* out) {
    extern __shared__ float buf[];
    buf[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}

// Wrong: the same reduction with the barrier between the writes and the reads left out.
extern "C" __global__ void __launch_bounds__(1024) selftest_missing_barrier(const float* x, float* out) {
    __shared__ float vals[1024];
    vals[threadIdx.x] = x[threadIdx.x];
    // __syncthreads() belongs here.
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (unsigned i = 0; i < blockDim.x; ++i) s += vals[i];
        out[0] = s;
    }
}

// Wrong: reads one element past the end of x (the last thread).
extern "C" __global__ void __launch_bounds__(1024) selftest_oob_read(const float* x, float* out) {
    out[threadIdx.x] = x[threadIdx.x + 1];
}

// Wrong: writes one element past the end of out.
extern "C" __global__ void __launch_bounds__(1024) selftest_oob_write(const float* x, float* out) {
    out[threadIdx.x + 1] = x[threadIdx.x];
}

// Wrong: reads 1024 elements before the start of x.
extern "C" __global__ void __launch_bounds__(1024) selftest_underflow(const float* x, float* out) {
    out[threadIdx.x] = x[(long)threadIdx.x - 1024];
}

// Wrong: a barrier inside a branch only some threads take.
extern "C" __global__ void __launch_bounds__(1024) selftest_divergent_barrier(float* out) {
    if (threadIdx.x < 64) {
        __syncthreads();
        out[threadIdx.x] = 1.f;
    }
}

// Wrong: the two halves of the block wait at different barriers.
extern "C" __global__ void __launch_bounds__(1024) selftest_split_barrier(float* out) {
    if (threadIdx.x % 2) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.f;
}

// Wrong: lanes 16-31 take part in a shuffle whose mask names only lanes 0-15.
extern "C" __global__ void __launch_bounds__(1024) selftest_shfl_mask_excludes_caller(float* out) {
    out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, (float)threadIdx.x, 1);
}

// Wrong: lanes 0-15 shuffle among themselves but read from lanes 16-31.
extern "C" __global__ void __launch_bounds__(1024) selftest_shfl_reads_outside_mask(float* out) {
    const int lane = threadIdx.x % 32;
    if (lane < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, (float)threadIdx.x, lane + 16);
}

// Wrong: lanes 0-15 return early while the others shuffle with the full mask.
extern "C" __global__ void __launch_bounds__(1024) selftest_shfl_exited_lane(float* out) {
    if (threadIdx.x % 32 < 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}

// Wrong: writes past the dynamic shared memory the launch asked for.
extern "C" __global__ void __launch_bounds__(1024) selftest_dyn_overflow(float* out) {
    extern __shared__ float buf[];
    buf[threadIdx.x + blockDim.x] = 1.f;  // the launch gives blockDim.x floats
    out[threadIdx.x] = 0.f;
}

// Declares 256 threads at most (launched with more in the tests).
extern "C" __global__ void __launch_bounds__(256) selftest_bounded(float* out) { out[threadIdx.x] = 1.f; }

// Wrong: a 16-byte vector load from an address 4 bytes past a 16-byte boundary.
extern "C" __global__ void __launch_bounds__(1024) selftest_misaligned(const float* x, float* out) {
    const float4 v = *reinterpret_cast<const float4*>(x + 1);
    out[threadIdx.x] = v.x;
}

// Correct: the two half-warps exchange independently, each with its own mask.
extern "C" __global__ void __launch_bounds__(1024) selftest_half_warps(float* out) {
    const int lane = threadIdx.x % 32;
    const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    out[threadIdx.x] = __shfl_xor_sync(mask, (float)threadIdx.x, 1);
}

// Wrong: an integer division by zero (garbage on a GPU; the emulator stops the launch).
extern "C" __global__ void __launch_bounds__(1024) selftest_div_zero(const int* x, int* out) {
    out[threadIdx.x] = 7 / x[threadIdx.x];
}

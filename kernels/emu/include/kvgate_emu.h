// What NVCC/NVRTC would supply to a CUDA C++ source, for g++: the execution-space qualifiers,
// the built-in variables (threadIdx, blockIdx, blockDim, gridDim), __shared__ memory per block,
// barriers, warp intrinsics, atomics and the fast-math functions. Force-included (-include) in
// front of each kernels/cuda/*.cu file, which is otherwise compiled unchanged.
//
// A block's threads are cooperative fibers of the emulator (csrc/runtime.cpp): each has its own
// stack and runs until it reaches a barrier or a warp exchange, where the runtime checks what a
// GPU would refuse and switches to the next thread. __shared__ variables are thread-local
// storage of the worker running the block, poisoned (all bits set) at every block's start.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef KVGATE_EMU_SCAN
// The build script's scan (g++ -E) keeps these markers to find kernels and their launch bounds.
#define __global__ __global__
#define __launch_bounds__(...) __launch_bounds__(__VA_ARGS__)
#define __shared__ __shared__
#else
#define __global__
#define __launch_bounds__(...)
#define __shared__ thread_local
#endif

#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) alignas(n)

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};

namespace kvgate_emu {

// The running fiber's view: set by the runtime before a fiber runs.
struct ThreadView {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};
ThreadView& view();

void syncthreads(const char* file, int line);
// Warp exchanges. kind: 0 idx, 1 up, 2 down, 3 xor, 4 syncwarp, 5 ballot, 6 any, 7 all.
uint32_t warp_exchange(int kind, uint32_t mask, uint32_t value, int arg, int width,
                       const char* file, int line);
[[noreturn]] void trap(const char* what, const char* file, int line);

template <typename T>
inline uint32_t to_bits(T v) {
    static_assert(sizeof(T) == 4, "32-bit shuffle");
    uint32_t b;
    std::memcpy(&b, &v, 4);
    return b;
}
template <typename T>
inline T from_bits(uint32_t b) {
    T v;
    std::memcpy(&v, &b, 4);
    return v;
}
template <typename T>
inline T shfl(int kind, uint32_t mask, T v, int arg, int width, const char* file, int line) {
    if constexpr (sizeof(T) == 8) {
        uint64_t b;
        std::memcpy(&b, &v, 8);
        uint64_t lo = warp_exchange(kind, mask, (uint32_t)b, arg, width, file, line);
        uint64_t hi = warp_exchange(kind, mask, (uint32_t)(b >> 32), arg, width, file, line);
        uint64_t r = lo | (hi << 32);
        T out;
        std::memcpy(&out, &r, 8);
        return out;
    } else {
        return from_bits<T>(warp_exchange(kind, mask, to_bits(v), arg, width, file, line));
    }
}

}  // namespace kvgate_emu

#define threadIdx (kvgate_emu::view().thread_idx)
#define blockIdx (kvgate_emu::view().block_idx)
#define blockDim (kvgate_emu::view().block_dim)
#define gridDim (kvgate_emu::view().grid_dim)
#define warpSize 32

#define __syncthreads() kvgate_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) \
    ((void)kvgate_emu::warp_exchange(4, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 0xffffffffu, 0, 0, 32, __FILE__, __LINE__))
#define __shfl_sync(mask, v, src, ...) \
    kvgate_emu::shfl(0, mask, v, src, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...) \
    kvgate_emu::shfl(1, mask, v, d, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...) \
    kvgate_emu::shfl(2, mask, v, d, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, m, ...) \
    kvgate_emu::shfl(3, mask, v, m, (__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 32, __FILE__, __LINE__)
#define __ballot_sync(mask, p) kvgate_emu::warp_exchange(5, mask, (p) ? 1u : 0u, 0, 32, __FILE__, __LINE__)
#define __any_sync(mask, p) ((int)kvgate_emu::warp_exchange(6, mask, (p) ? 1u : 0u, 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, p) ((int)kvgate_emu::warp_exchange(7, mask, (p) ? 1u : 0u, 0, 32, __FILE__, __LINE__))
#define __trap() kvgate_emu::trap("__trap()", __FILE__, __LINE__)

// Fences: blocks run on several OS threads, so device-memory ordering is real.
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// Atomics on device or shared memory (blocks run concurrently on the worker threads).
template <typename T>
inline T atomicAdd(T* a, T v) {
    if constexpr (sizeof(T) == 4 && !std::is_integral<T>::value) {
        uint32_t* p = reinterpret_cast<uint32_t*>(a);
        uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
        for (;;) {
            T cur = kvgate_emu::from_bits<T>(old);
            uint32_t next = kvgate_emu::to_bits<T>(cur + v);
            if (__atomic_compare_exchange_n(p, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
                return cur;
        }
    } else if constexpr (!std::is_integral<T>::value) {
        uint64_t* p = reinterpret_cast<uint64_t*>(a);
        uint64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
        for (;;) {
            T cur;
            std::memcpy(&cur, &old, 8);
            T sum = cur + v;
            uint64_t next;
            std::memcpy(&next, &sum, 8);
            if (__atomic_compare_exchange_n(p, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
                return cur;
        }
    } else {
        return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
    }
}
template <typename T>
inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicCAS(T* a, T expected, T desired) {
    __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <typename T>
inline T atomicMax(T* a, T v) {
    T old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <typename T>
inline T atomicMin(T* a, T v) {
    T old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (old > v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return old;
}
template <typename T>
inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }

// Integer min/max as CUDA's device overloads (no std:: in kernel code).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// Reinterpretations and the fast-math intrinsics. The GPU's __expf is ex2.approx(x * log2 e):
// the product is rounded to f32 first, as here; ex2.approx itself is within 2 ulp of exp2f.
inline float __int_as_float(int x) { return kvgate_emu::from_bits<float>((uint32_t)x); }
inline float __uint_as_float(unsigned x) { return kvgate_emu::from_bits<float>(x); }
inline int __float_as_int(float x) { return (int)kvgate_emu::to_bits(x); }
inline unsigned __float_as_uint(float x) { return kvgate_emu::to_bits(x); }
inline float __expf(float x) { return exp2f(x * 1.44269504088896341f); }
inline float __exp10f(float x) { return exp2f(x * 3.32192809488736235f); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <typename T>
inline T __ldg(const T* p) { return *p; }

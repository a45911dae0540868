// Row-wise model operations on f32 activations (`[rows, cols]`, row-major); weights in f32, f16
// or bf16, always computed in f32. One block per row unless stated.
//
// rms_norm_<t>:      grid (rows), 256 threads: out = x / sqrt(mean(x^2) + eps) * w.
// rope_rotate_half:  grid (tokens), 128 threads, in place: for each head, with half = head_dim/2,
//                    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin tables are
//                    [max_positions, half] f32 (the CPU backend's tables), indexed by positions[i].
// silu_and_mul:      grid (rows), 256 threads: out[r, i] = silu(g) * u, gate_up row = [g | u].
// embedding_<t>:     grid (tokens), 256 threads: out[i] = table[ids[i]].
// gather_rows:       grid (n), 256 threads: out[i] = x[rows[i]] (logits of the last token of
//                    each sequence before the LM head).
// add_assign:        grid-stride over n elements: x += y.
// add_bias_<t>:      grid-stride over n = rows * cols elements: out[i] += bias[i % cols].
// convert_f32_to_<t>: grid-stride over n elements: out[i] = (t) x[i] (round to nearest even);
//                    activations narrowed for a cuBLAS half-precision GEMM.
#include "kvgate_common.cuh"

namespace kvgate {

template <typename T>
__device__ __forceinline__ void rms_norm(float* __restrict__ out, const float* __restrict__ x,
                                         const T* __restrict__ w, int cols, float eps) {
    __shared__ float red[KVGATE_WARP];
    const float* xr = x + (long)blockIdx.x * cols;
    float* o = out + (long)blockIdx.x * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float scale = rsqrtf(ss / cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = xr[i] * scale * to_f32(w[i]);
}

template <typename T>
__device__ __forceinline__ void embedding(float* __restrict__ out, const T* __restrict__ table,
                                          const unsigned* __restrict__ ids, int dim) {
    const T* src = table + (long)ids[blockIdx.x] * dim;
    float* o = out + (long)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = to_f32(src[i]);
}

}  // namespace kvgate

#define KVGATE_TYPED_OPS(NAME, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_##NAME(float* out, const float* x,   \
                                                                       const T* w, int cols,         \
                                                                       float eps) {                  \
        kvgate::rms_norm<T>(out, x, w, cols, eps);                                                    \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) embedding_##NAME(                              \
        float* out, const T* table, const unsigned* ids, int dim) {                                  \
        kvgate::embedding<T>(out, table, ids, dim);                                                   \
    }

KVGATE_TYPED_OPS(f32, float)
KVGATE_TYPED_OPS(f16, __half)
KVGATE_TYPED_OPS(bf16, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(1024) rope_rotate_half(float* x, const unsigned* positions,
                                                                   const float* cos_table,
                                                                   const float* sin_table,
                                                                   int num_heads, int head_dim) {
    const int half = head_dim / 2;
    const long pos = positions[blockIdx.x];
    const float* c = cos_table + pos * half;
    const float* s = sin_table + pos * half;
    float* xr = x + (long)blockIdx.x * num_heads * head_dim;
    for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
        const int h = i / half, j = i % half;
        float* hx = xr + h * head_dim;
        const float x1 = hx[j], x2 = hx[j + half];
        hx[j] = x1 * c[j] - x2 * s[j];
        hx[j + half] = x2 * c[j] + x1 * s[j];
    }
}

extern "C" __global__ void __launch_bounds__(1024) silu_and_mul(float* out, const float* gate_up, int ffn) {
    const float* g = gate_up + (long)blockIdx.x * 2 * ffn;
    const float* u = g + ffn;
    float* o = out + (long)blockIdx.x * ffn;
    for (int i = threadIdx.x; i < ffn; i += blockDim.x) {
        const float a = g[i];
        o[i] = a / (1.f + __expf(-a)) * u[i];
    }
}

extern "C" __global__ void __launch_bounds__(1024) gather_rows(float* out, const float* x,
                                                              const unsigned* rows, int cols) {
    const float* src = x + (long)rows[blockIdx.x] * cols;
    float* o = out + (long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = src[i];
}

extern "C" __global__ void __launch_bounds__(1024) add_assign(float* x, const float* y, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

#define KVGATE_ELEMENTWISE(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(1024) add_bias_##NAME(float* out, const T* bias,    \
                                                                       int cols, long n) {           \
        for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                             \
             i += (long)gridDim.x * blockDim.x)                                                       \
            out[i] += kvgate::to_f32(bias[i % cols]);                                                 \
    }

KVGATE_ELEMENTWISE(f32, float)
KVGATE_ELEMENTWISE(f16, __half)
KVGATE_ELEMENTWISE(bf16, __nv_bfloat16)

#define KVGATE_CONVERT(NAME, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) convert_f32_to_##NAME(T* out, const float* x, \
                                                                             long n) {               \
        for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                             \
             i += (long)gridDim.x * blockDim.x)                                                       \
            out[i] = kvgate::from_f32<T>(x[i]);                                                       \
    }

KVGATE_CONVERT(f16, __half)
KVGATE_CONVERT(bf16, __nv_bfloat16)

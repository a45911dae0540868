// The stand-in cuBLAS: handles, their stream, and the GEMMs kvgate's backend calls (cublasSgemm,
// and cublasGemmEx with f16/bf16/f32 inputs, f32 accumulation). Column-major, as cuBLAS: the
// arguments are checked as cuBLAS checks them (CUBLAS_STATUS_INVALID_VALUE), and every matrix's
// extent against its allocation when the GEMM runs, so a wrong leading dimension, transpose or
// offset fails (as an illegal address) instead of reading a neighbour's memory.
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../include/cuda_bf16.h"
#include "runtime.h"

using namespace kvgate_emu;

typedef int cublasStatus_t;

// Enqueues work on a stream of the stand-in driver (driver.cpp).
int kvgate_emu_enqueue(void* stream, std::function<int(std::string*)> fn);

namespace {
enum : int {
    kOk = 0,
    kBlasNotInitialized = 1,
    kInvalid = 7,
    kExecutionFailed = 13,
    kBlasNotSupported = 15,
};
enum : int { kOpN = 0, kOpT = 1, kOpC = 2 };
enum : int { kR32F = 0, kR16F = 2, kR16BF = 14 };

struct Handle {
    void* stream = nullptr;
};

float f16_to_f32(uint16_t b) { return __half2float(__half{b}); }
float bf16_to_f32(uint16_t b) { return __bfloat162float(__nv_bfloat16{b}); }

size_t elem_size(int ty) { return ty == kR32F ? 4 : 2; }

// op(X) is rows x cols; X is stored column-major with leading dimension ld.
struct Mat {
    uint64_t ptr;
    int ty;
    int op;
    long rows, cols, ld;
    // Element (r, c) of op(X).
    size_t index(long r, long c) const { return op == kOpN ? (size_t)(r + c * ld) : (size_t)(c + r * ld); }
    long stored_cols() const { return op == kOpN ? cols : rows; }
    long stored_rows() const { return op == kOpN ? rows : cols; }
    size_t bytes() const {
        if (rows == 0 || cols == 0) return 0;
        return ((size_t)(stored_cols() - 1) * ld + stored_rows()) * elem_size(ty);
    }
    float at(size_t i) const {
        switch (ty) {
            case kR32F: return reinterpret_cast<const float*>(ptr)[i];
            case kR16F: return f16_to_f32(reinterpret_cast<const uint16_t*>(ptr)[i]);
            default: return bf16_to_f32(reinterpret_cast<const uint16_t*>(ptr)[i]);
        }
    }
    // Row r of op(X) as f32.
    void row(long r, float* out) const {
        for (long c = 0; c < cols; ++c) out[c] = at(index(r, c));
    }
};

float dot(const float* a, const float* b, long k) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long i = 0;
    for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; ++l) s[l] += a[i + l] * b[i + l];
    float t = 0;
    for (; i < k; ++i) t += a[i] * b[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + t;
}

// C (m x n, ldc) = alpha op(A) op(B) + beta C, f32 accumulation.
int gemm(const char* name, Mat a, Mat b, uint64_t c, int cty, long ldc, float alpha, float beta, std::string* err) {
    const long m = a.rows, n = b.cols, k = a.cols;
    std::string why;
    const bool reads_ab = alpha != 0.f && k > 0;  // cuBLAS reads neither A nor B otherwise
    if (reads_ab && a.bytes() && !range_ok(a.ptr, a.bytes(), &why)) {
        *err = std::string(name) + ": matrix A (" + std::to_string(a.stored_rows()) + " x " +
               std::to_string(a.stored_cols()) + ", lda " + std::to_string(a.ld) + "): " + why;
        return kIllegalAddress;
    }
    if (reads_ab && b.bytes() && !range_ok(b.ptr, b.bytes(), &why)) {
        *err = std::string(name) + ": matrix B (" + std::to_string(b.stored_rows()) + " x " +
               std::to_string(b.stored_cols()) + ", ldb " + std::to_string(b.ld) + "): " + why;
        return kIllegalAddress;
    }
    const size_t cbytes = m && n ? ((size_t)(n - 1) * ldc + m) * elem_size(cty) : 0;
    if (cbytes && !range_ok(c, cbytes, &why)) {
        *err = std::string(name) + ": matrix C (" + std::to_string(m) + " x " + std::to_string(n) + ", ldc " +
               std::to_string(ldc) + "): " + why;
        return kIllegalAddress;
    }
    if (m == 0 || n == 0) return kSuccess;
    if (!reads_ab) {
        for (long j = 0; j < n; ++j)
            for (long i = 0; i < m; ++i) {
                const size_t at = (size_t)i + (size_t)j * ldc;
                if (cty == kR32F) {
                    float* cp = reinterpret_cast<float*>(c) + at;
                    *cp = beta == 0.f ? 0.f : beta * *cp;
                } else {
                    uint16_t* cp = reinterpret_cast<uint16_t*>(c) + at;
                    const float old = cty == kR16F ? f16_to_f32(*cp) : bf16_to_f32(*cp);
                    const float v = beta == 0.f ? 0.f : beta * old;
                    *cp = cty == kR16F ? __float2half_rn(v).__x : __float2bfloat16_rn(v).__x;
                }
            }
        return kSuccess;
    }
    // op(B) as n contiguous f32 columns of k; op(A) row by row, per chunk of rows.
    std::vector<float> bt((size_t)n * k);
    for (long j = 0; j < n; ++j)
        for (long l = 0; l < k; ++l) bt[(size_t)j * k + l] = b.at(b.index(l, j));
    const long chunk = 64;
    const size_t chunks = (size_t)((m + chunk - 1) / chunk);
    parallel_for(chunks, [&](size_t ci) {
        std::vector<float> arow(k);
        for (long i = (long)ci * chunk; i < std::min(m, (long)(ci + 1) * chunk); ++i) {
            a.row(i, arow.data());
            for (long j = 0; j < n; ++j) {
                const float acc = alpha * dot(arow.data(), bt.data() + (size_t)j * k, k);
                const size_t at = (size_t)i + (size_t)j * ldc;
                if (cty == kR32F) {
                    float* cp = reinterpret_cast<float*>(c) + at;
                    *cp = beta == 0.f ? acc : acc + beta * *cp;
                } else {
                    uint16_t* cp = reinterpret_cast<uint16_t*>(c) + at;
                    const float old = beta == 0.f ? 0.f : (cty == kR16F ? f16_to_f32(*cp) : bf16_to_f32(*cp));
                    const float v = acc + beta * old;
                    *cp = cty == kR16F ? __float2half_rn(v).__x : __float2bfloat16_rn(v).__x;
                }
            }
        }
    });
    return kSuccess;
}

// cuBLAS's argument checks (column-major: A is m x k after op, B k x n, C m x n).
cublasStatus_t check_args(int ta, int tb, int m, int n, int k, int lda, int ldb, int ldc) {
    if ((ta != kOpN && ta != kOpT && ta != kOpC) || (tb != kOpN && tb != kOpT && tb != kOpC)) return kInvalid;
    if (m < 0 || n < 0 || k < 0) return kInvalid;
    if (lda < std::max(1, ta == kOpN ? m : k)) return kInvalid;
    if (ldb < std::max(1, tb == kOpN ? k : n)) return kInvalid;
    if (ldc < std::max(1, m)) return kInvalid;
    return kOk;
}

cublasStatus_t submit(Handle* h, const char* name, int ta, int tb, int m, int n, int k, float alpha, uint64_t a,
                      int aty, int lda, uint64_t b, int bty, int ldb, float beta, uint64_t c, int cty, int ldc) {
    Mat ma{a, aty, ta == kOpN ? kOpN : kOpT, m, k, lda};
    Mat mb{b, bty, tb == kOpN ? kOpN : kOpT, k, n, ldb};
    const int code = kvgate_emu_enqueue(h->stream, [=](std::string* err) {
        return gemm(name, ma, mb, c, cty, ldc, alpha, beta, err);
    });
    return code == kSuccess ? kOk : kExecutionFailed;
}
}  // namespace

KVGATE_EMU_API cublasStatus_t cublasCreate_v2(Handle** out) {
    if (!out) return kInvalid;
    *out = new Handle;
    return kOk;
}

KVGATE_EMU_API cublasStatus_t cublasDestroy_v2(Handle* h) {
    if (!h) return kBlasNotInitialized;
    delete h;
    return kOk;
}

KVGATE_EMU_API cublasStatus_t cublasSetStream_v2(Handle* h, void* stream) {
    if (!h) return kBlasNotInitialized;
    h->stream = stream;
    return kOk;
}

KVGATE_EMU_API cublasStatus_t cublasGetStream_v2(Handle* h, void** stream) {
    if (!h || !stream) return kBlasNotInitialized;
    *stream = h->stream;
    return kOk;
}

KVGATE_EMU_API cublasStatus_t cublasSetMathMode(Handle* h, int) { return h ? kOk : kBlasNotInitialized; }
KVGATE_EMU_API cublasStatus_t cublasSetWorkspace_v2(Handle* h, void*, size_t) { return h ? kOk : kBlasNotInitialized; }
KVGATE_EMU_API cublasStatus_t cublasSetPointerMode_v2(Handle* h, int mode) {
    if (!h) return kBlasNotInitialized;
    return mode == 0 ? kOk : kBlasNotSupported;  // host pointers for alpha and beta only
}

KVGATE_EMU_API cublasStatus_t cublasSgemm_v2(Handle* h, int ta, int tb, int m, int n, int k, const float* alpha,
                                             const float* a, int lda, const float* b, int ldb, const float* beta,
                                             float* c, int ldc) {
    if (!h) return kBlasNotInitialized;
    if (!alpha || !beta) return kInvalid;
    if (const cublasStatus_t s = check_args(ta, tb, m, n, k, lda, ldb, ldc)) return s;
    return submit(h, "cublasSgemm", ta, tb, m, n, k, *alpha, (uint64_t)a, kR32F, lda, (uint64_t)b, kR32F, ldb, *beta,
                  (uint64_t)c, kR32F, ldc);
}

KVGATE_EMU_API cublasStatus_t cublasGemmEx(Handle* h, int ta, int tb, int m, int n, int k, const void* alpha,
                                           const void* a, int aty, int lda, const void* b, int bty, int ldb,
                                           const void* beta, void* c, int cty, int ldc, int compute, int) {
    if (!h) return kBlasNotInitialized;
    if (!alpha || !beta) return kInvalid;
    auto supported = [](int t) { return t == kR32F || t == kR16F || t == kR16BF; };
    if (!supported(aty) || !supported(bty) || !supported(cty)) return kBlasNotSupported;
    // The combinations cuBLAS documents for an f32 compute type: A and B of one type, C of that
    // type or f32 (f32 inputs: f32 C only); the _FAST_16F / _FAST_16BF / _FAST_TF32 compute types
    // only with f32 inputs.
    if (aty != bty) return kBlasNotSupported;
    if (aty == kR32F ? cty != kR32F : (cty != aty && cty != kR32F)) return kBlasNotSupported;
    if (compute != 68 && !(aty == kR32F && (compute == 74 || compute == 75 || compute == 77)))
        return kBlasNotSupported;
    if (const cublasStatus_t s = check_args(ta, tb, m, n, k, lda, ldb, ldc)) return s;
    return submit(h, "cublasGemmEx", ta, tb, m, n, k, *static_cast<const float*>(alpha), (uint64_t)a, aty, lda,
                  (uint64_t)b, bty, ldb, *static_cast<const float*>(beta), (uint64_t)c, cty, ldc);
}

//! `out = x @ w^T (+ bias)` through cuBLAS. x `[m, k]` f32, w `[n, k]`, out `[m, n]` f32.
//!
//! cuBLAS is column-major: the row-major `out [m, n]` is the column-major `n x m` matrix
//! `op(w) * x` with `w` read transposed (`w` row-major `[n, k]` is column-major `k x n`). An f32
//! weight runs `sgemm` (plain FP32 math: cuBLAS's default mode never uses TF32). An f16/bf16
//! weight runs `cublasGemmEx` on the tensor cores: x is first narrowed to the weight's type by
//! a kernel (so results differ from the CPU's f32 x times 16-bit w by the rounding of x, about
//! 2^-9 relative for bf16), accumulation and output are f32. Cost: 2mnk flops; for decode
//! (small m) it streams the weight once, bandwidth-bound.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys};

use super::tensor::{CudaTensor, CudaWeight, DevStore};
use super::{launch, strided, Cuda};
use crate::backend::DType;

pub(crate) fn matmul(
    cuda: &Cuda,
    x: &CudaTensor,
    w: &CudaWeight,
    bias: Option<&CudaWeight>,
    out: &mut CudaTensor,
) {
    let (m, k, n) = (x.rows, x.cols, w.rows);
    assert_eq!(w.cols, k, "matmul: x has {k} columns, w has {}", w.cols);
    cuda.set_shape(out, m, n);
    if m == 0 || n == 0 {
        return;
    }
    let r = cuda.context().bind_to_thread();
    cuda.check(r, "bind context");
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    let (one, zero) = (1.0f32, 0.0f32);
    let (op_t, op_n) = (
        sys::cublasOperation_t::CUBLAS_OP_T,
        sys::cublasOperation_t::CUBLAS_OP_N,
    );
    let handle = *cuda.blas.handle();
    match &w.store {
        DevStore::F32(_) => {
            let (wp, xp, op) = (w.store.ptr(), x.ptr(), out.ptr());
            // SAFETY: w is n*k, x m*k, out m*n f32 values on this context; the handle's stream
            // is the backend's stream.
            let r = unsafe {
                blas::sgemm(
                    handle,
                    op_t,
                    op_n,
                    ni,
                    mi,
                    ki,
                    &one,
                    wp as *const f32,
                    ki,
                    xp as *const f32,
                    ki,
                    &zero,
                    op as *mut f32,
                    ni,
                )
            };
            cuda.check(r, "cublasSgemm");
        }
        DevStore::Half(_) => {
            let (kernel, ty) = match w.dtype {
                DType::BF16 => ("convert_f32_to_bf16", sys::cudaDataType::CUDA_R_16BF),
                _ => ("convert_f32_to_f16", sys::cudaDataType::CUDA_R_16F),
            };
            let xh = narrowed(cuda, x, kernel);
            let (wp, op) = (w.store.ptr(), out.ptr());
            // SAFETY: as above; xh holds m*k 16-bit values of the weight's type.
            let r = unsafe {
                blas::gemm_ex(
                    handle,
                    op_t,
                    op_n,
                    ni,
                    mi,
                    ki,
                    &one as *const f32 as *const c_void,
                    wp as *const c_void,
                    ty,
                    ki,
                    xh as *const c_void,
                    ty,
                    ki,
                    &zero as *const f32 as *const c_void,
                    op as *mut c_void,
                    sys::cudaDataType::CUDA_R_32F,
                    ni,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            cuda.check(r, "cublasGemmEx");
        }
    }
    if let Some(b) = bias {
        assert_eq!(b.rows * b.cols, n, "matmul: bias length != output columns");
        let (o, bp, cols, len) = (out.ptr(), b.store.ptr(), n as i32, (m * n) as i64);
        let name = format!("add_bias_{}", b.dtype.name());
        launch!(cuda, name, strided(m * n), o, bp, cols, len);
    }
}

/// `x` narrowed to 16 bits in the backend's scratch buffer (grown as needed); its address.
fn narrowed(cuda: &Cuda, x: &CudaTensor, kernel: &str) -> u64 {
    let n = x.len();
    let mut scratch = cuda.half_scratch.lock().unwrap_or_else(|e| e.into_inner());
    if scratch.as_ref().is_none_or(|s| s.len() < n) {
        let r = cuda.stream.alloc_zeros::<u16>(n.next_power_of_two());
        *scratch = Some(cuda.check(r, "alloc"));
    }
    let dst = scratch
        .as_ref()
        .map(|s| super::tensor::dptr(s, &cuda.stream))
        .unwrap_or_default();
    let (xp, len) = (x.ptr(), n as i64);
    launch!(cuda, kernel, strided(n), dst, xp, len);
    dst
}

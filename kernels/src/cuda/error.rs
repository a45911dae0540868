//! Why the CUDA backend could not start. Once started, device errors inside a [`Backend`]
//! operation are fatal (the trait's operations are infallible, like the CPU's): they panic with
//! the operation's name and the driver's error.
//!
//! [`Backend`]: crate::Backend

use std::fmt;

/// A CUDA start-up failure, each with a stable code ([`CudaError::code`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaError {
    /// A shared library (`libcuda`, `libnvrtc` or `libcublas`) could not be loaded.
    LibraryMissing {
        library: &'static str,
        hint: &'static str,
    },
    /// The driver loaded but reports no usable device at that ordinal.
    NoDevice { ordinal: usize, detail: String },
    /// A driver call failed.
    Driver { op: &'static str, detail: String },
    /// NVRTC rejected the embedded kernels (the compile log is included).
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    /// cuBLAS failed to start.
    Blas(String),
}

impl CudaError {
    /// Stable short code for logs and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            CudaError::LibraryMissing { .. } => "cuda_library_missing",
            CudaError::NoDevice { .. } => "cuda_no_device",
            CudaError::Driver { .. } => "cuda_driver",
            CudaError::Compile { .. } => "cuda_compile",
            CudaError::Blas(_) => "cuda_blas",
        }
    }

    pub(crate) fn driver(op: &'static str, e: impl fmt::Debug) -> Self {
        CudaError::Driver {
            op,
            detail: format!("{e:?}"),
        }
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaError::LibraryMissing { library, hint } => {
                write!(f, "{library} not found ({hint})")
            }
            CudaError::NoDevice { ordinal, detail } => {
                write!(f, "no CUDA device {ordinal}: {detail}")
            }
            CudaError::Driver { op, detail } => write!(f, "CUDA driver error in {op}: {detail}"),
            CudaError::Compile { file, arch, log } => {
                write!(f, "NVRTC could not compile {file} for {arch}:\n{log}")
            }
            CudaError::Blas(e) => write!(f, "cuBLAS: {e}"),
        }
    }
}

impl std::error::Error for CudaError {}

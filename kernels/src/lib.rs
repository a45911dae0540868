//! Compute kernels for kvgate, behind one [`Backend`] trait the engine runs on: the CPU reference
//! and fast kernels in [`cpu`] (always built), and CUDA kernels behind the `cuda` feature.

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod quant;

pub use backend::{AttnSeq, AttnShape, Backend, DType, Llama3RopeScaling, RopeConfig, WeightData};
pub use cpu::Cpu;
#[cfg(feature = "cuda")]
pub use cuda::{Cuda, CudaError};
pub use quant::Quant;

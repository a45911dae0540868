//! Compute kernels for kvgate: CPU reference and fast kernels, and (behind the `cuda` feature) the
//! CUDA kernels launched through cudarc, all behind one `Backend` trait the engine runs on.
//!
//! Filled by the model-runtime issue; the crate exists so the workspace layout is final.

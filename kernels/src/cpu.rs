//! CPU kernels (to be written).

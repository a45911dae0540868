//! Sampling (in progress).

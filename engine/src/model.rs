//! Llama-family models: config, weights (safetensors, GGUF import), forward pass.

pub mod gguf;

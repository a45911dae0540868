//! Llama-family models: `config.json` ([`config`]), safetensors weights ([`weights`]), GGUF import
//! ([`gguf`]), the forward pass over a kernels backend ([`llama`]), and a single-request
//! generation loop through the real block manager ([`generate`]).

pub mod config;
mod error;
pub mod generate;
pub mod gguf;
pub mod llama;
pub mod weights;

pub use config::ModelConfig;
pub use error::ModelError;
pub use generate::{GenerateOptions, Generator};
pub use llama::{Batch, Blocks, Llama, LoadOptions};

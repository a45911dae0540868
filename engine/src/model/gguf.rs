//! GGUF v3 reading, dequantization and import into a Hugging Face-style model directory.
//!
//! The pipeline reads top to bottom in the file names:
//! - [`reader`]: memory-maps a `.gguf` file and parses its header and tensor table, with
//!   [`metadata`] decoding the key/value section; every read is bounds-checked ([`GgufFile`]).
//! - [`dequant`]: turns F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensor bytes into `f32`.
//! - [`permute`]: undoes llama.cpp's interleaved-RoPE row permutation of `attn_q`/`attn_k`.
//! - [`hf_config`]: Llama hyperparameters from the metadata, and `config.json`.
//! - [`tokenizer`]: `tokenizer.json` / `tokenizer_config.json` from the `tokenizer.*` metadata.
//! - [`import`]: [`import_gguf`] ties it together and streams `model.safetensors` out
//!   through [`st_writer`].
//!
//! Nothing here panics on bad input: a corrupt, truncated or unsupported file is a [`GgufError`]
//! that names the file and the field or tensor at fault.

pub mod dequant;
pub mod hf_config;
pub mod import;
pub mod metadata;
pub mod permute;
pub mod reader;
pub mod st_writer;
pub mod tokenizer;

#[cfg(test)]
mod corrupt_tests;
#[cfg(test)]
mod import_tests;
#[cfg(test)]
mod smollm2_tests;
#[cfg(test)]
mod test_writer;
#[cfg(test)]
mod tests;

pub use dequant::{dequantize, GgmlType};
pub use import::{import_gguf, import_gguf_with, ImportOptions, ImportSummary, StorageDtype};
pub use reader::{GgufFile, MetaValue, TensorInfo};

use std::path::PathBuf;

/// Why a GGUF file could not be read or imported. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", file.display())]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a GGUF file (magic {found:02x?}, expected \"GGUF\")", file.display())]
    BadMagic { file: PathBuf, found: [u8; 4] },
    #[error("{}: GGUF version {version} is not supported (only 3)", file.display())]
    UnsupportedVersion { file: PathBuf, version: u32 },
    #[error(
        "{}: truncated: {what} needs bytes {offset}..{end} but the file has {len}",
        file.display()
    )]
    Truncated {
        file: PathBuf,
        what: String,
        offset: u64,
        end: u64,
        len: u64,
    },
    #[error("{}: invalid {what}: {reason}", file.display())]
    Invalid {
        file: PathBuf,
        what: String,
        reason: String,
    },
    #[error("{}: missing metadata key `{key}`", file.display())]
    MissingMetadata { file: PathBuf, key: String },
    #[error("{}: metadata `{key}` is {found}, expected {expected}", file.display())]
    MetadataType {
        file: PathBuf,
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("{}: missing tensor `{tensor}`", file.display())]
    MissingTensor { file: PathBuf, tensor: String },
    #[error("{}: tensor `{tensor}` has type {ggml_type}, which is not supported", file.display())]
    UnsupportedTensorType {
        file: PathBuf,
        tensor: String,
        ggml_type: GgmlType,
    },
    #[error("{}: tensor `{tensor}`: {reason}", file.display())]
    TensorShape {
        file: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{}: unsupported: {what}", file.display())]
    Unsupported { file: PathBuf, what: String },
    #[error("{}: writing JSON: {source}", file.display())]
    Json {
        file: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl GgufError {
    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            GgufError::Io { .. } => "gguf_io",
            GgufError::BadMagic { .. } => "gguf_bad_magic",
            GgufError::UnsupportedVersion { .. } => "gguf_unsupported_version",
            GgufError::Truncated { .. } => "gguf_truncated",
            GgufError::Invalid { .. } => "gguf_invalid",
            GgufError::MissingMetadata { .. } => "gguf_missing_metadata",
            GgufError::MetadataType { .. } => "gguf_metadata_type",
            GgufError::MissingTensor { .. } => "gguf_missing_tensor",
            GgufError::UnsupportedTensorType { .. } => "gguf_unsupported_tensor_type",
            GgufError::TensorShape { .. } => "gguf_tensor_shape",
            GgufError::Unsupported { .. } => "gguf_unsupported",
            GgufError::Json { .. } => "gguf_json",
        }
    }

    /// The file the error is about.
    pub fn file(&self) -> &std::path::Path {
        match self {
            GgufError::Io { file, .. }
            | GgufError::BadMagic { file, .. }
            | GgufError::UnsupportedVersion { file, .. }
            | GgufError::Truncated { file, .. }
            | GgufError::Invalid { file, .. }
            | GgufError::MissingMetadata { file, .. }
            | GgufError::MetadataType { file, .. }
            | GgufError::MissingTensor { file, .. }
            | GgufError::UnsupportedTensorType { file, .. }
            | GgufError::TensorShape { file, .. }
            | GgufError::Unsupported { file, .. }
            | GgufError::Json { file, .. } => file,
        }
    }
}

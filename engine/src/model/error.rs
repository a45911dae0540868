//! Errors from loading and running a model. Each names the file and the field or tensor.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: {reason}")]
    Config { file: String, reason: String },
    #[error("{file}: {reason}")]
    Weights { file: String, reason: String },
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    #[error("tensor {name:?} has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{file}: {reason}")]
    Tokenizer { file: String, reason: String },
    #[error(transparent)]
    Gguf(#[from] super::gguf::GgufError),
    #[error("the prompt has {tokens} tokens; the context holds {max}")]
    PromptTooLong { tokens: usize, max: usize },
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io {
            file: path.display().to_string(),
            source,
        }
    }

    pub(crate) fn weights(path: &Path, reason: impl std::fmt::Display) -> Self {
        ModelError::Weights {
            file: path.display().to_string(),
            reason: reason.to_string(),
        }
    }
}

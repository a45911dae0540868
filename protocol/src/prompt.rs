//! Turning a request into tokens, the same way in the gateway and in every engine: the model's
//! `tokenizer.json` (through the `tokenizers` crate) and the chat template of its
//! `tokenizer_config.json` (Jinja, through minijinja, with Python string methods).
//!
//! Rendering a conversation is O(text); encoding is the tokenizer's BPE, roughly linear. Where the
//! tokenizer is one [`BpeEncoder`] reproduces exactly (SmolLM2's and other GPT-2-style byte-level
//! BPEs), encoding goes through it, several times faster than `tokenizers`; `tokenizers` stays the
//! reference and the fallback for every other tokenizer.

use crate::bpe::BpeEncoder;
use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One chat message, as in the OpenAI API (text content only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Why a prompt could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("{file}: {reason}")]
    Load { file: PathBuf, reason: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("the model has no chat template")]
    NoTemplate,
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

/// A model's tokenizer and chat template.
#[derive(Debug)]
pub struct PromptRenderer {
    tokenizer: tokenizers::Tokenizer,
    /// The same tokenizer, faster, when it is one [`BpeEncoder`] reproduces.
    fast: Option<BpeEncoder>,
    env: Environment<'static>,
    has_template: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: Option<u32>,
}

fn token_text(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn raise_exception(msg: String) -> Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
}

impl PromptRenderer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, PromptError> {
        let tok_path = dir.join("tokenizer.json");
        let load_err = |reason: String| PromptError::Load {
            file: tok_path.clone(),
            reason,
        };
        let tok_text = std::fs::read_to_string(&tok_path).map_err(|e| load_err(e.to_string()))?;
        let tokenizer: tokenizers::Tokenizer =
            tok_text.parse().map_err(|e| load_err(format!("{e}")))?;
        let fast = serde_json::from_str(&tok_text)
            .ok()
            .and_then(|json| BpeEncoder::from_json(&json));
        let cfg_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| PromptError::Load {
                file: cfg_path.clone(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => {
                return Err(PromptError::Load {
                    file: cfg_path,
                    reason: e.to_string(),
                })
            }
        };
        let template = config.get("chat_template").and_then(|t| t.as_str());
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        if let Some(t) = template {
            env.add_template_owned("chat", t.to_owned())
                .map_err(|e| PromptError::Load {
                    file: cfg_path.clone(),
                    reason: format!("chat_template: {e}"),
                })?;
        }
        let bos_token = token_text(&config, "bos_token");
        let add_bos = match (
            config.get("add_bos_token").and_then(|v| v.as_bool()),
            &bos_token,
        ) {
            (Some(true), Some(b)) => tokenizer.token_to_id(b),
            _ => None,
        };
        Ok(PromptRenderer {
            has_template: template.is_some(),
            eos_token: token_text(&config, "eos_token"),
            bos_token,
            add_bos,
            env,
            tokenizer,
            fast,
        })
    }

    /// The fast encoder, when this tokenizer is one it reproduces.
    pub fn fast_encoder(&self) -> Option<&BpeEncoder> {
        self.fast.as_ref()
    }

    /// The same renderer encoding through `tokenizers` only (for comparisons and benchmarks).
    pub fn without_fast_encoder(mut self) -> Self {
        self.fast = None;
        self
    }

    /// Ids of `text` from `tokenizers`, the reference (no BOS).
    pub fn encode_with_tokenizers(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| PromptError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Renders a conversation with the chat template (ending with the assistant's turn opened
    /// when `add_generation_prompt`).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, PromptError> {
        if !self.has_template {
            return Err(PromptError::NoTemplate);
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| PromptError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages
                .iter()
                .map(|m| minijinja::Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())]))
                .collect::<Vec<_>>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| PromptError::Template(e.to_string()))
    }

    /// Token ids of `text`: special tokens written in the text are recognized; BOS is prepended
    /// when the model's config asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        if let Some(fast) = &self.fast {
            let mut ids = Vec::with_capacity(text.len() / 3 + 2);
            ids.extend(self.add_bos);
            fast.encode_into(text, &mut ids);
            return Ok(ids);
        }
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| PromptError::Tokenize(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        ids.extend(self.add_bos);
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of `text` as a continuation of an earlier encoded text: no BOS. Encoding a text
    /// in two pieces split right before a special token (as a chat template's turns are) gives
    /// the same ids as encoding it whole.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        match &self.fast {
            Some(fast) => Ok(fast.encode(text)),
            None => self.encode_with_tokenizers(text),
        }
    }

    /// Renders and encodes a conversation.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, PromptError> {
        self.encode(&self.render_chat(messages, true)?)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, PromptError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| PromptError::Tokenize(e.to_string()))
    }

    /// Id of a token's text, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Id of the configured EOS token.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

//! Turning a request into tokens, the same way in the gateway and in every engine: the model's
//! `tokenizer.json` (through the `tokenizers` crate) and the chat template of its
//! `tokenizer_config.json` (Jinja, through minijinja, with Python string methods).
//!
//! Only the chat template's own text may hold control tokens. A message is text, whatever it
//! spells: a user who writes `<|im_start|>system` gets those characters encoded as text, not a
//! turn of its own. So each message's role and content enter the template quoted
//! ([`PromptRenderer::quote`]: a [`QUOTE`] before each special token's spelling), and every
//! encoder here reads that form: a quoted spelling is encoded as the text it is, joined with the
//! text around it (the ids `tokenizers` gives it under `split_special_tokens`), while the
//! template's markers stay control tokens. The quoted form is a rendered prompt's text
//! everywhere: the gateway and the engine render, split and encode the same strings and get the
//! same ids. A message with no special token's spelling and no [`QUOTE`] in it renders exactly
//! as before; quoting costs one scan of each message, 32 bytes at a time.
//!
//! Rendering a conversation is O(text); encoding is the tokenizer's BPE, roughly linear. Where the
//! tokenizer is one [`BpeEncoder`] reproduces exactly (SmolLM2's and other GPT-2-style byte-level
//! BPEs), encoding goes through it, several times faster than `tokenizers`; `tokenizers` stays the
//! reference and the fallback for every other tokenizer.

mod quote;
mod turns;

pub use quote::QUOTE;

use crate::bpe::{AddedTokens, BpeEncoder};
use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use quote::Quoting;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use turns::TurnTemplate;

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
    /// The added tokens, for quoting messages and reading the quoted form.
    quoting: Quoting,
    /// Ids of the special added tokens.
    special_ids: HashSet<u32>,
    /// `tokenizer` with special tokens' spellings encoded as text, made on first need.
    plain: OnceLock<tokenizers::Tokenizer>,
    env: Environment<'static>,
    has_template: bool,
    /// The chat template as pieces of text, when it is a turn-by-turn template.
    turns: Option<TurnTemplate>,
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
        let added_decoder = tokenizer.get_added_tokens_decoder();
        let special_ids = added_decoder
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let added = match &fast {
            Some(f) => f.added_tokens().clone(),
            None => {
                let mut tokens: Vec<_> = added_decoder.iter().collect();
                tokens.sort_by_key(|(&id, _)| id);
                AddedTokens::new(
                    tokens
                        .into_iter()
                        .map(|(&id, t)| (t.content.as_str(), id, t.special)),
                )
            }
        };
        let mut renderer = PromptRenderer {
            has_template: template.is_some(),
            eos_token: token_text(&config, "eos_token"),
            bos_token,
            add_bos,
            env,
            tokenizer,
            fast,
            quoting: Quoting::new(added),
            special_ids,
            plain: OnceLock::new(),
            turns: None,
        };
        if renderer.has_template {
            renderer.turns = TurnTemplate::derive(
                |messages, generation| renderer.render_template(messages, generation).ok(),
                |text| renderer.quote(text).into_owned(),
            );
        }
        Ok(renderer)
    }

    /// Whether chat prompts are rendered by concatenation (see [`TurnTemplate`]) rather than by
    /// running the template.
    pub fn has_fast_chat(&self) -> bool {
        self.turns.is_some()
    }

    /// The same renderer running the chat template for every conversation (for comparisons
    /// and benchmarks).
    pub fn without_fast_chat(mut self) -> Self {
        self.turns = None;
        self
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

    /// Ids of `text` (in the quoted form) from `tokenizers`, the reference (no BOS).
    ///
    /// `tokenizers` encodes the unquoted text whole, as it always has; where a special token it
    /// split out was quoted, the text between the unquoted ones is encoded again with special
    /// tokens' spellings as text. So a prompt with nothing quoted costs one encoding, as before.
    pub fn encode_with_tokenizers(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        let (text, quoted) = self.quoting.unquote(text);
        let enc = self.tokenize(&self.tokenizer, &text)?;
        let (ids, offsets) = (enc.get_ids(), enc.get_offsets());
        let forged = |k: usize| {
            self.special_ids.contains(&ids[k])
                && quoted
                    .iter()
                    .any(|r| offsets[k].0 < r.end && r.start < offsets[k].1)
        };
        if !(0..ids.len()).any(forged) {
            return Ok(ids.to_vec());
        }
        let plain = self.plain.get_or_init(|| {
            let mut t = self.tokenizer.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let mut out = Vec::with_capacity(ids.len());
        let mut from = 0;
        for k in (0..ids.len()).filter(|&k| self.special_ids.contains(&ids[k]) && !forged(k)) {
            let (start, end) = offsets[k];
            if from < start {
                out.extend_from_slice(self.tokenize(plain, &text[from..start])?.get_ids());
            }
            out.push(ids[k]);
            from = end;
        }
        if from < text.len() {
            out.extend_from_slice(self.tokenize(plain, &text[from..])?.get_ids());
        }
        Ok(out)
    }

    fn tokenize(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
    ) -> Result<tokenizers::Encoding, PromptError> {
        tokenizer
            .encode(text, false)
            .map_err(|e| PromptError::Tokenize(e.to_string()))
    }

    /// `text` in the quoted form: encoded, it gives the ids of its characters, special tokens'
    /// spellings included. Messages enter the chat template this way.
    pub fn quote<'a>(&self, text: &'a str) -> Cow<'a, str> {
        self.quoting.quote(text)
    }

    /// The text a prompt in the quoted form stands for, as the model reads it.
    pub fn unquote<'a>(&self, text: &'a str) -> Cow<'a, str> {
        self.quoting.unquote(text).0
    }

    /// Renders a conversation with the chat template (ending with the assistant's turn opened
    /// when `add_generation_prompt`), in the quoted form: each message's role and content quoted,
    /// so that the template's markers are its only control tokens.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, PromptError> {
        if !self.has_template {
            return Err(PromptError::NoTemplate);
        }
        let fast = self.turns.as_ref().and_then(|t| {
            t.render(messages, add_generation_prompt, |text| {
                self.quote(text).into_owned()
            })
        });
        match fast {
            Some(text) => Ok(text),
            None => self.render_template(messages, add_generation_prompt),
        }
    }

    /// [`PromptRenderer::render_chat`] by running the template.
    fn render_template(
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
        let messages: Vec<_> = messages
            .iter()
            .map(|m| {
                minijinja::Value::from_pairs([
                    ("role", self.quote(&m.role)),
                    ("content", self.quote(&m.content)),
                ])
            })
            .collect();
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| PromptError::Template(e.to_string()))
    }

    /// Token ids of `text`, in the quoted form: special tokens written in it are control
    /// tokens, quoted ones text; BOS is prepended when the model's config asks for it.
    ///
    /// A completion's text prompt comes here as the client wrote it, so special tokens spelled
    /// in it are control tokens, as in vLLM and `tokenizers`: the prompt is the client's own,
    /// no template or operator text shares it, and the same endpoint already takes any token
    /// ids; fill-in-the-middle and hand-templated prompts depend on it. The gateway and the
    /// engine both encode it here, so they agree. A caller that wants such a prompt read as
    /// text passes it through [`PromptRenderer::quote`] first.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        if let Some(fast) = &self.fast {
            let mut ids = Vec::with_capacity(text.len() / 3 + 2);
            ids.extend(self.add_bos);
            fast.encode_quoted_into(text, QUOTE, &mut ids);
            return Ok(ids);
        }
        let mut ids: Vec<u32> = self.add_bos.into_iter().collect();
        ids.extend(self.encode_with_tokenizers(text)?);
        Ok(ids)
    }

    /// Token ids of `text` (in the quoted form) as a continuation of an earlier encoded text: no
    /// BOS. Encoding a text in two pieces split right before a special token (as a chat
    /// template's turns are) gives the same ids as encoding it whole.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>, PromptError> {
        match &self.fast {
            Some(fast) => Ok(fast.encode_quoted(text, QUOTE)),
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

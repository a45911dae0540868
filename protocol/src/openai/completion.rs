//! `POST /v1/completions`: the request as sent, its `prompt` in all the shapes OpenAI accepts, and
//! its validation into a [`CompletionInput`].
//!
//! `prompt` may be a string, a list of token ids, or a one-element list of either (the official
//! client sends those for batched prompts; batches of more than one are rejected, one request is
//! one prompt here). Parsing is O(body); validation O(prompt + stop strings).

use super::error::ApiError;
use super::params::{Limits, SamplingParams, Stop, StreamOptions};
use super::validate::RawSampling;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// `prompt` as sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokenBatch(Vec<Vec<u32>>),
}

impl Default for Prompt {
    fn default() -> Self {
        Prompt::Text(String::new())
    }
}

/// One element of a `prompt` list, before we know which kind of list it is.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptItem {
    Text(String),
    Token(i64),
    Tokens(Vec<u32>),
}

struct PromptVisitor;

const PROMPT_SHAPES: &str =
    "a string, a list of token ids, or a list with one string or one list of token ids";

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROMPT_SHAPES)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mixed = || de::Error::custom(format!("invalid prompt: expected {PROMPT_SHAPES}"));
        let mut out = match seq.next_element::<PromptItem>()? {
            None => return Ok(Prompt::Tokens(Vec::new())),
            Some(PromptItem::Text(s)) => Prompt::TextBatch(vec![s]),
            Some(PromptItem::Token(t)) => Prompt::Tokens(vec![token_id(t)?]),
            Some(PromptItem::Tokens(t)) => Prompt::TokenBatch(vec![t]),
        };
        while let Some(item) = seq.next_element::<PromptItem>()? {
            match (&mut out, item) {
                (Prompt::TextBatch(v), PromptItem::Text(s)) => v.push(s),
                (Prompt::Tokens(v), PromptItem::Token(t)) => v.push(token_id(t)?),
                (Prompt::TokenBatch(v), PromptItem::Tokens(t)) => v.push(t),
                _ => return Err(mixed()),
            }
        }
        Ok(out)
    }
}

fn token_id<E: de::Error>(t: i64) -> Result<u32, E> {
    u32::try_from(t).map_err(|_| E::custom(format!("invalid prompt: token id {t} is out of range")))
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

/// The prompt of a validated request: text to tokenize, or tokens as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptInput {
    /// Rejects token ids outside a vocabulary of `vocab_size` (text prompts always pass).
    pub fn check_token_ids(&self, vocab_size: usize) -> Result<(), ApiError> {
        let PromptInput::Tokens(ids) = self else {
            return Ok(());
        };
        match ids.iter().find(|&&t| t as usize >= vocab_size) {
            None => Ok(()),
            Some(t) => Err(ApiError::invalid_value(
                "prompt",
                format!("Invalid 'prompt': token id {t} is out of range for a vocabulary of {vocab_size}."),
            )),
        }
    }
}

/// The body of `POST /v1/completions`. Unknown fields are ignored; so is a client `cache_salt`
/// (the cache scope is the gateway's to set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// A client's `cache_salt` / `cache_scope`: never honored (the cache scope is the
    /// gateway's to set); recorded so that a proxy knows to remove them.
    #[serde(
        default,
        skip_serializing,
        rename = "cache_salt",
        deserialize_with = "super::present"
    )]
    pub sent_cache_salt: bool,
    #[serde(
        default,
        skip_serializing,
        rename = "cache_scope",
        deserialize_with = "super::present"
    )]
    pub sent_cache_scope: bool,
    pub model: String,
    pub prompt: Prompt,
    /// Defaults to 16, as in OpenAI's legacy API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<serde_json::Number>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// The number of top logprobs per token (0: only the chosen token's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Accepted only when false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// Accepted only when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// A kvgate extension on this endpoint (vLLM has it too): the chat endpoint's formats
    /// ([`super::structured::response_format`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<serde_json::Value>,
}

/// A validated completion request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionInput {
    pub prompt: PromptInput,
    pub params: SamplingParams,
    /// Answer with SSE chunks.
    pub stream: bool,
    /// Streaming only: end with a usage chunk.
    pub include_usage: bool,
}

/// Completions default to 16 tokens (OpenAI's legacy API, vLLM).
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

impl CompletionRequest {
    /// Whether the client sent a cache-scope field (which a proxy must remove).
    pub fn has_client_scope(&self) -> bool {
        self.sent_cache_salt || self.sent_cache_scope
    }

    /// Parses a request body (a JSON object); errors are 400s naming what is wrong.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        super::parse_object(body)
    }

    /// Checks every field and normalizes the sampling parameters.
    pub fn validate(&self, limits: &Limits) -> Result<CompletionInput, ApiError> {
        let prompt = match &self.prompt {
            Prompt::Text(s) => PromptInput::Text(s.clone()),
            Prompt::Tokens(t) => PromptInput::Tokens(t.clone()),
            Prompt::TextBatch(v) => PromptInput::Text(single(v)?.clone()),
            Prompt::TokenBatch(v) => PromptInput::Tokens(single(v)?.clone()),
        };
        if matches!(&prompt, PromptInput::Tokens(t) if t.is_empty()) {
            return Err(ApiError::invalid_value("prompt", "The prompt is empty."));
        }
        if self.echo == Some(true) {
            return Err(ApiError::unsupported("echo", "'echo' is not supported."));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported(
                "suffix",
                "'suffix' is not supported.",
            ));
        }
        let mut params = self.raw().validate(limits)?;
        params.max_tokens = params.max_tokens.or(Some(DEFAULT_COMPLETION_MAX_TOKENS));
        params.grammar = super::structured::response_format(self.response_format.as_ref())?;
        super::structured::check_ends(&params)?;
        let stream = self.stream.unwrap_or(false);
        Ok(CompletionInput {
            prompt,
            params,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .as_ref()
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
        })
    }

    fn raw(&self) -> RawSampling<'_> {
        RawSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed.as_ref(),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self.logit_bias.as_ref(),
            stop: self.stop.as_ref(),
            stop_token_ids: self.stop_token_ids.as_deref(),
            max_tokens_param: "max_tokens",
            // The default is filled in before validation, so `min_tokens` is checked against
            // the length that will really be generated.
            max_tokens: Some(
                self.max_tokens
                    .unwrap_or(i64::from(DEFAULT_COMPLETION_MAX_TOKENS)),
            ),
            min_tokens: self.min_tokens,
            n: self.n,
            best_of: self.best_of,
            logprobs_param: "logprobs",
            logprobs: self.logprobs,
            ignore_eos: self.ignore_eos,
        }
    }
}

/// The one element of a batched prompt.
fn single<T>(batch: &[T]) -> Result<&T, ApiError> {
    match batch {
        [one] => Ok(one),
        [] => Err(ApiError::invalid_value("prompt", "The prompt is empty.")),
        _ => Err(ApiError::unsupported(
            "prompt",
            format!(
                "Batched prompts are not supported: got {} prompts; send one per request.",
                batch.len()
            ),
        )),
    }
}

//! `POST /v1/chat/completions`: the request as sent (messages with string or text-part content)
//! and its validation into a [`ChatInput`], whose messages go to the chat template
//! ([`crate::prompt::PromptRenderer`]).
//!
//! Text parts of one message are joined with newlines, as vLLM does. Tools, non-text content and
//! structured output are rejected, not ignored: silently dropping them would answer a different
//! question than the one asked. O(body) to parse and validate.

use super::error::ApiError;
use super::params::{Limits, SamplingParams, Stop, StreamOptions};
use super::validate::RawSampling;
use crate::prompt::ChatMessage;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Roles a message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// One message as sent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    /// Required except on assistant messages.
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl RequestMessage {
    /// A message with text content.
    pub fn new(role: &str, content: &str) -> Self {
        RequestMessage {
            role: role.to_owned(),
            content: Some(MessageContent::Text(content.to_owned())),
            name: None,
        }
    }
}

/// Message content: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content; only `{"type":"text","text":...}` is served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// The body of `POST /v1/chat/completions`. Unknown fields are ignored; so is a client
/// `cache_salt` (the cache scope is the gateway's to set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
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
    pub messages: Vec<RequestMessage>,
    /// Deprecated by OpenAI in favour of `max_completion_tokens`, which wins when both are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
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
    /// Return logprobs of the chosen tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// With `logprobs`: how many top alternatives per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Rejected when non-empty (unless `tool_choice` is `"none"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<serde_json::Value>,
    /// Only `{"type":"text"}` is served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<serde_json::Value>,
}

/// A validated chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatInput {
    /// The conversation, ready for the chat template.
    pub messages: Vec<ChatMessage>,
    pub params: SamplingParams,
    /// Answer with SSE chunks.
    pub stream: bool,
    /// Streaming only: end with a usage chunk.
    pub include_usage: bool,
}

impl ChatCompletionRequest {
    /// Whether the client sent a cache-scope field (which a proxy must remove).
    pub fn has_client_scope(&self) -> bool {
        self.sent_cache_salt || self.sent_cache_scope
    }

    /// Parses a request body (a JSON object); errors are 400s naming what is wrong.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        super::parse_object(body)
    }

    /// Checks every field and normalizes messages and sampling parameters.
    pub fn validate(&self, limits: &Limits) -> Result<ChatInput, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid_value(
                "messages",
                "Invalid 'messages': expected at least one message, but got an empty array.",
            ));
        }
        let messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| flatten_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        self.check_unsupported()?;
        if self.top_logprobs.is_some() && self.logprobs != Some(true) {
            return Err(ApiError::invalid_value(
                "top_logprobs",
                "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.",
            ));
        }
        let params = self.raw().validate(limits)?;
        let stream = self.stream.unwrap_or(false);
        Ok(ChatInput {
            messages,
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

    fn check_unsupported(&self) -> Result<(), ApiError> {
        let no_tools = match &self.tools {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(_) => false,
        };
        let choice_none = self.tool_choice.as_ref().and_then(|c| c.as_str()) == Some("none");
        if !no_tools && !choice_none {
            return Err(ApiError::unsupported(
                "tools",
                "Tool calling is not supported.",
            ));
        }
        let format = self.response_format.as_ref().filter(|f| !f.is_null());
        if let Some(f) = format {
            if f.get("type").and_then(|t| t.as_str()) != Some("text") {
                return Err(ApiError::unsupported(
                    "response_format",
                    "Only response_format {\"type\": \"text\"} is supported.",
                ));
            }
        }
        Ok(())
    }

    fn raw(&self) -> RawSampling<'_> {
        let (max_tokens_param, max_tokens) = match self.max_completion_tokens {
            Some(m) => ("max_completion_tokens", Some(m)),
            None => ("max_tokens", self.max_tokens),
        };
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
            max_tokens_param,
            max_tokens,
            min_tokens: self.min_tokens,
            n: self.n,
            best_of: None,
            logprobs_param: "top_logprobs",
            logprobs: (self.logprobs == Some(true)).then(|| self.top_logprobs.unwrap_or(0)),
            ignore_eos: self.ignore_eos,
        }
    }
}

/// Message `i` as role and plain text.
fn flatten_message(i: usize, m: &RequestMessage) -> Result<ChatMessage, ApiError> {
    if !ROLES.contains(&m.role.as_str()) {
        return Err(ApiError::invalid_value(
            format!("messages[{i}].role"),
            format!(
                "Invalid 'messages[{i}].role': expected one of {}, but got {:?}.",
                ROLES.join(", "),
                m.role
            ),
        ));
    }
    let content = match &m.content {
        Some(MessageContent::Text(s)) => s.clone(),
        Some(MessageContent::Parts(parts)) => join_parts(i, parts)?,
        None if m.role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid_value(
                format!("messages[{i}].content"),
                format!(
                    "Invalid 'messages[{i}].content': a {} message needs content.",
                    m.role
                ),
            ))
        }
    };
    Ok(ChatMessage {
        role: m.role.clone(),
        content,
    })
}

fn join_parts(i: usize, parts: &[ContentPart]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        match (part.type_.as_str(), &part.text) {
            ("text", Some(t)) => texts.push(t.as_str()),
            ("text", None) => {
                return Err(ApiError::invalid_value(
                    format!("messages[{i}].content[{j}].text"),
                    format!("Invalid 'messages[{i}].content[{j}]': a text part needs 'text'."),
                ))
            }
            (other, _) => {
                return Err(ApiError::unsupported(
                    format!("messages[{i}].content[{j}].type"),
                    format!("Content parts of type {other:?} are not supported; only text is."),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

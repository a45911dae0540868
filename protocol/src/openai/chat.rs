//! `POST /v1/chat/completions`: the request as sent (messages with string or text-part content)
//! and its validation into a [`ChatInput`], whose messages go to the chat template
//! ([`crate::prompt::PromptRenderer`]).
//!
//! Text parts of one message are joined with newlines, as vLLM does. Non-text content is
//! rejected, not ignored: silently dropping it would answer a different question than the one
//! asked. Tools, tool calls and tool results are rendered into the messages' text, and
//! `response_format` / `tool_choice` become the output's grammar ([`super::structured`]).
//! O(body) to parse and validate.

use super::error::ApiError;
use super::params::{Limits, SamplingParams, Stop, StreamOptions};
use super::structured::{self, RequestToolCall, Structured, ToolChoice};
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
    /// An assistant message's tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<RequestToolCall>>,
    /// A tool message's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl RequestMessage {
    /// A message with text content.
    pub fn new(role: &str, content: &str) -> Self {
        RequestMessage {
            role: role.to_owned(),
            content: Some(MessageContent::Text(content.to_owned())),
            ..Default::default()
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
    /// Function tools ([`structured::tools`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<serde_json::Value>,
    /// With required tool calls: more than one call allowed (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// `text`, `json_object`, `json_schema`, `regex` or `lark` ([`structured::response_format`]).
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
    /// The tools whose calls are parsed out of the output (the grammar is in `params`).
    pub structured: Structured,
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
        let mut messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| flatten_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        if self.top_logprobs.is_some() && self.logprobs != Some(true) {
            return Err(ApiError::invalid_value(
                "top_logprobs",
                "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.",
            ));
        }
        let mut params = self.raw().validate(limits)?;
        let structured = self.structured(&mut messages)?;
        params.grammar = structured.grammar.clone();
        structured::check_ends(&params)?;
        let stream = self.stream.unwrap_or(false);
        Ok(ChatInput {
            messages,
            params,
            structured,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .as_ref()
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
        })
    }

    /// The output's grammar and tools; renders the tools into the system turn when the model
    /// may call them.
    fn structured(&self, messages: &mut Vec<ChatMessage>) -> Result<Structured, ApiError> {
        let tools = structured::tools(self.tools.as_ref())?;
        let choice = structured::tool_choice(self.tool_choice.as_ref(), &tools)?;
        let format = structured::response_format(self.response_format.as_ref())?;
        if choice == ToolChoice::None {
            return Ok(Structured {
                grammar: format,
                tools: Vec::new(),
            });
        }
        structured::add_tools_to_system(messages, &tools);
        let parallel = self.parallel_tool_calls.unwrap_or(true);
        let grammar = match (&choice, format) {
            (ToolChoice::Auto, None) => None,
            (ToolChoice::Auto, Some(structured::Grammar::JsonSchema(answer))) => {
                Some(structured::tool_call_grammar(
                    &tools.iter().collect::<Vec<_>>(),
                    parallel,
                    Some(&answer),
                ))
            }
            (_, Some(_)) => {
                return Err(ApiError::unsupported(
                    "response_format",
                    "Invalid 'response_format': with tools, only text and JSON formats are \
                     served, and only when 'tool_choice' is \"auto\".",
                ))
            }
            (ToolChoice::Function(name), None) => {
                let only: Vec<_> = tools.iter().filter(|t| &t.name == name).collect();
                Some(structured::tool_call_grammar(&only, false, None))
            }
            (_, None) => Some(structured::tool_call_grammar(
                &tools.iter().collect::<Vec<_>>(),
                parallel,
                None,
            )),
        };
        Ok(Structured { grammar, tools })
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
    let mut content = match &m.content {
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
    if let Some(calls) = m.tool_calls.as_deref().filter(|c| !c.is_empty()) {
        if m.role != "assistant" {
            return Err(ApiError::invalid_value(
                format!("messages[{i}].tool_calls"),
                format!(
                    "Invalid 'messages[{i}].tool_calls': only assistant messages have tool calls."
                ),
            ));
        }
        content = structured::render_tool_calls(&content, calls);
    }
    if m.role == "tool" {
        content = structured::render_tool_result(&content);
    }
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

//! Streaming (`stream: true`): chunk types for both endpoints and the SSE framing.
//!
//! A chat stream is: a chunk with `delta.role`, chunks with `delta.content`, a chunk with
//! `finish_reason` per choice, with `include_usage` a last chunk with no choices and `usage`, then
//! `data: [DONE]`. A completions stream is the same without the role chunk. Each event is one
//! `data: <json>\n\n` line; O(chunk) to frame.

use super::response::{ChatLogprobs, CompletionChoice, FinishReason, Usage};
use serde::{Deserialize, Serialize};

/// The event that ends every stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// Frames a value as one SSE event: `data: <json>\n\n`.
pub fn sse_event<T: Serialize>(value: &T) -> String {
    // Our chunk types always serialize; an empty object is the harmless fallback.
    let json = serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned());
    format!("data: {json}\n\n")
}

/// A streamed piece of a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChunk {
    pub id: String,
    /// `"text_completion"`, as OpenAI sends.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Only on the last chunk, when `stream_options.include_usage` was set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl CompletionChunk {
    /// A chunk carrying `choices`.
    pub fn new(id: &str, created: u64, model: &str, choices: Vec<CompletionChoice>) -> Self {
        CompletionChunk {
            id: id.to_owned(),
            object: "text_completion".to_owned(),
            created,
            model: model.to_owned(),
            choices,
            usage: None,
        }
    }

    /// The last chunk of an `include_usage` stream: no choices, the usage.
    pub fn usage(id: &str, created: u64, model: &str, usage: Usage) -> Self {
        CompletionChunk {
            usage: Some(usage),
            ..CompletionChunk::new(id, created, model, Vec::new())
        }
    }
}

/// What a chat chunk adds to a choice's message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A streamed piece of tool call `index`: the first carries its id, type and name, the later
/// ones more of its arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// One choice of a chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

impl ChatChunkChoice {
    /// The first chunk of choice `index`: the role, empty content.
    pub fn role(index: u32) -> Self {
        ChatChunkChoice {
            index,
            delta: Delta {
                role: Some("assistant".to_owned()),
                content: Some(String::new()),
                tool_calls: Vec::new(),
            },
            logprobs: None,
            finish_reason: None,
        }
    }

    /// New text of choice `index` (with the logprobs of its tokens when asked).
    pub fn content(index: u32, text: String, logprobs: Option<ChatLogprobs>) -> Self {
        ChatChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: Some(text),
                tool_calls: Vec::new(),
            },
            logprobs,
            finish_reason: None,
        }
    }

    /// The end of choice `index`; `text` is any last text (may be empty: the delta is then `{}`).
    pub fn finish(index: u32, text: String, reason: FinishReason) -> Self {
        ChatChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: (!text.is_empty()).then_some(text),
                tool_calls: Vec::new(),
            },
            logprobs: None,
            finish_reason: Some(reason),
        }
    }
}

impl ChatChunkChoice {
    /// Tool call deltas of choice `index`.
    pub fn tool_calls(index: u32, calls: Vec<ToolCallDelta>) -> Self {
        ChatChunkChoice {
            index,
            delta: Delta {
                tool_calls: calls,
                ..Delta::default()
            },
            logprobs: None,
            finish_reason: None,
        }
    }
}

/// A streamed piece of a chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// `"chat.completion.chunk"`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Only on the last chunk, when `stream_options.include_usage` was set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl ChatCompletionChunk {
    /// A chunk carrying `choices`.
    pub fn new(id: &str, created: u64, model: &str, choices: Vec<ChatChunkChoice>) -> Self {
        ChatCompletionChunk {
            id: id.to_owned(),
            object: "chat.completion.chunk".to_owned(),
            created,
            model: model.to_owned(),
            choices,
            usage: None,
        }
    }

    /// The last chunk of an `include_usage` stream: no choices, the usage.
    pub fn usage(id: &str, created: u64, model: &str, usage: Usage) -> Self {
        ChatCompletionChunk {
            usage: Some(usage),
            ..ChatCompletionChunk::new(id, created, model, Vec::new())
        }
    }
}

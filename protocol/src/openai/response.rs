//! Non-streaming responses: completions, chat completions, usage, logprobs and the model list,
//! in OpenAI's exact JSON shapes. Plain data; building one is O(output).

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` (or the context) was reached.
    Length,
    /// The output is tool calls (chat only).
    ToolCalls,
}

/// Token counts of a request; on every response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default)]
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: u32,
}

impl Usage {
    /// Usage of a request; `total_tokens` is the sum.
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// Top alternatives of one token as a JSON object `{token: logprob}`, most likely first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl TopLogprobMap {
    /// From `(token text, logprob)` pairs, most likely first. Two token ids can decode to the
    /// same text; a JSON object holds one, so later duplicates are dropped.
    pub fn new(pairs: impl IntoIterator<Item = (String, f32)>) -> Self {
        let mut out: Vec<(String, f32)> = Vec::new();
        for (token, lp) in pairs {
            if !out.iter().any(|(t, _)| *t == token) {
                out.push((token, lp));
            }
        }
        TopLogprobMap(out)
    }
}

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, lp) in &self.0 {
            map.serialize_entry(token, lp)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for TopLogprobMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TopLogprobMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of token to logprob")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<TopLogprobMap, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = m.next_entry::<String, f32>()? {
                    out.push(entry);
                }
                Ok(TopLogprobMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Legacy completions logprobs: parallel arrays, one entry per generated token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<TopLogprobMap>,
    /// Byte offset of each token in the choice's text.
    pub text_offset: Vec<u32>,
}

/// One choice of a completion (also one choice of a streamed chunk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<CompletionLogprobs>,
    /// Always set on a full response; `null` on stream chunks before the last.
    pub finish_reason: Option<FinishReason>,
}

/// The response to `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    /// `"text_completion"`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

impl CompletionResponse {
    /// A completion response with `object` set.
    pub fn new(
        id: &str,
        created: u64,
        model: &str,
        choices: Vec<CompletionChoice>,
        usage: Usage,
    ) -> Self {
        CompletionResponse {
            id: id.to_owned(),
            object: "text_completion".to_owned(),
            created,
            model: model.to_owned(),
            choices,
            usage,
        }
    }
}

/// An alternative token in chat logprobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    /// UTF-8 bytes of the token (a token may hold part of a character).
    pub bytes: Option<Vec<u8>>,
}

/// One generated token in chat logprobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
    /// Most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// `choices[i].logprobs` of a chat completion.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// The assistant's message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// `"assistant"`.
    pub role: String,
    /// `null` when the message is only tool calls.
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A tool call in a response: `arguments` is the arguments object serialized, as OpenAI sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    /// `"function"`.
    #[serde(rename = "type")]
    pub type_: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// A function call with a fresh id (`call_` and 24 random letters and digits).
    pub fn function(name: &str, arguments: &str) -> Self {
        ToolCall {
            id: new_call_id(),
            type_: "function".to_owned(),
            function: FunctionCall {
                name: name.to_owned(),
                arguments: arguments.to_owned(),
            },
        }
    }
}

/// A tool call id: `call_` and 24 characters of `[A-Za-z0-9]`, from the process's random state.
pub fn new_call_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut id = String::from("call_");
    let mut bits = 0u64;
    for i in 0..24 {
        if i % 8 == 0 {
            // RandomState is seeded from the OS per instance.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_usize(i);
            bits = h.finish();
        }
        id.push(ALPHABET[(bits % ALPHABET.len() as u64) as usize] as char);
        bits /= ALPHABET.len() as u64;
    }
    id
}

/// One choice of a chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: FinishReason,
}

impl ChatChoice {
    /// Choice `index` with the assistant's `content`.
    pub fn new(
        index: u32,
        content: String,
        logprobs: Option<ChatLogprobs>,
        finish_reason: FinishReason,
    ) -> Self {
        ChatChoice {
            index,
            message: AssistantMessage {
                role: "assistant".to_owned(),
                content: Some(content),
                tool_calls: Vec::new(),
            },
            logprobs,
            finish_reason,
        }
    }
}

impl ChatChoice {
    /// Choice `index` answered with tool calls (and any text before them, `None` when empty).
    pub fn tool_calls(
        index: u32,
        content: Option<String>,
        calls: Vec<ToolCall>,
        logprobs: Option<ChatLogprobs>,
    ) -> Self {
        ChatChoice {
            index,
            message: AssistantMessage {
                role: "assistant".to_owned(),
                content,
                tool_calls: calls,
            },
            logprobs,
            finish_reason: FinishReason::ToolCalls,
        }
    }
}

/// The response to `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    /// `"chat.completion"`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

impl ChatCompletionResponse {
    /// A chat completion response with `object` set.
    pub fn new(
        id: &str,
        created: u64,
        model: &str,
        choices: Vec<ChatChoice>,
        usage: Usage,
    ) -> Self {
        ChatCompletionResponse {
            id: id.to_owned(),
            object: "chat.completion".to_owned(),
            created,
            model: model.to_owned(),
            choices,
            usage,
        }
    }
}

/// One served model in `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    /// `"model"`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    pub owned_by: String,
    /// The context length (a vLLM extension; absent when unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
}

impl ModelCard {
    /// A model card with `object` set.
    pub fn new(id: &str, created: u64, owned_by: &str, max_model_len: Option<u32>) -> Self {
        ModelCard {
            id: id.to_owned(),
            object: "model".to_owned(),
            created,
            owned_by: owned_by.to_owned(),
            max_model_len,
        }
    }
}

/// The response to `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    /// `"list"`.
    pub object: String,
    pub data: Vec<ModelCard>,
}

impl ModelList {
    /// A model list with `object` set.
    pub fn new(data: Vec<ModelCard>) -> Self {
        ModelList {
            object: "list".to_owned(),
            data,
        }
    }
}

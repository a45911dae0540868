//! OpenAI-compatible wire types: requests, their validation, responses, streaming chunks and
//! errors. Serde only; no IO.
//!
//! The path of a request: the server reads the body, [`CompletionRequest::parse`] (or
//! [`ChatCompletionRequest::parse`]) turns it into the request as sent, `validate` checks every
//! field against the server's [`Limits`] and yields a [`CompletionInput`] / [`ChatInput`] whose
//! [`SamplingParams`] drive the engine's sampler. After tokenizing,
//! [`SamplingParams::max_tokens_for`] checks the context. Any failure is an [`ApiError`], which
//! serializes exactly as OpenAI's `{"error":{"message","type","code","param"}}`.
//!
//! - [`params`]: normalized sampling parameters (validated in `validate.rs`, shared by both
//!   request types).
//! - [`completion`], [`chat`]: the two request types.
//! - [`response`]: full responses, usage (always with `prompt_tokens_details.cached_tokens`),
//!   logprobs, the model list.
//! - [`stream`]: SSE chunks and framing.
//! - [`error`]: errors with stable codes.

pub mod chat;
pub mod completion;
pub mod error;
pub mod params;
pub mod response;
pub mod stream;
pub mod structured;
mod validate;

pub use chat::{ChatCompletionRequest, ChatInput, ContentPart, MessageContent, RequestMessage};
pub use completion::{CompletionInput, CompletionRequest, Prompt, PromptInput};
pub use error::{ApiError, ErrorBody, ErrorCode, ErrorObject};
pub use params::{Limits, SamplingDefaults, SamplingParams, Stop, StreamOptions, MAX_LOGPROBS};
pub use response::{
    AssistantMessage, ChatChoice, ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob,
    CompletionChoice, CompletionLogprobs, CompletionResponse, FinishReason, FunctionCall,
    ModelCard, ModelList, PromptTokensDetails, ToolCall, TopLogprob, TopLogprobMap, Usage,
};
pub use stream::{
    sse_event, ChatChunkChoice, ChatCompletionChunk, CompletionChunk, Delta, FunctionDelta,
    ToolCallDelta, SSE_DONE,
};
pub use structured::{Grammar, ParsedToolCall, Structured, Tool, ToolChoice};
pub use validate::GREEDY_EPSILON;

/// Request fields a client may not set, because they pick the prefix-cache scope: the gateway
/// removes them before forwarding and injects the tenant's own scope out of band.
pub const CLIENT_SCOPE_FIELDS: [&str; 2] = ["cache_salt", "cache_scope"];

/// Deserializes a request field whose value is ignored and whose presence is recorded (`true`
/// whatever the value, `null` included): a client's [`CLIENT_SCOPE_FIELDS`], which a proxy must
/// remove. serde matches keys after unescaping, so `"cache\u005fsalt"` counts too.
pub(crate) fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    <serde::de::IgnoredAny as serde::Deserialize>::deserialize(d).map(|_| true)
}

/// The error for a request body that is JSON but not an object.
pub fn body_not_an_object() -> ApiError {
    ApiError::invalid_value("body", "The request body must be a JSON object.")
}

/// Reads a request body as `T`: a JSON object only. serde's derived structs would also read an
/// array as the struct's fields in order, so `["model", ...]` would pass for a request; any body
/// that does not open with `{` is refused, with the JSON parser's own message when it is not
/// JSON at all.
pub(crate) fn parse_object<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        serde_json::from_slice::<serde::de::IgnoredAny>(body)
            .map_err(|e| ApiError::from_json_error(&e))?;
        return Err(body_not_an_object());
    }
    serde_json::from_slice(body).map_err(|e| ApiError::from_json_error(&e))
}

/// Removes [`CLIENT_SCOPE_FIELDS`] from a request body object; returns whether any was present.
/// For proxies that forward the body as JSON rather than re-serializing a typed request (which
/// drops them anyway, as unknown fields).
pub fn strip_client_scope(body: &mut serde_json::Value) -> bool {
    let Some(obj) = body.as_object_mut() else {
        return false;
    };
    let mut removed = false;
    for field in CLIENT_SCOPE_FIELDS {
        removed |= obj.remove(field).is_some();
    }
    removed
}

//! OpenAI-shaped API errors: an HTTP status, a stable machine-readable code and a human message,
//! serialized exactly as OpenAI does: `{"error":{"message","type","code","param"}}`.
//!
//! Gateway and engine build every error response from [`ApiError`]; the conversion to an HTTP
//! response happens in one place in each server. `type` is a function of the status, `code` is a
//! stable string per [`ErrorCode`] that clients and tests can match on.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A stable error code, serialized as the `code` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 400: the body is not JSON (or not UTF-8).
    InvalidJson,
    /// 400: a field has the wrong JSON type.
    InvalidType,
    /// 400: a required field is missing.
    MissingRequiredParameter,
    /// 400: a field has a value out of range.
    InvalidValue,
    /// 400: a parameter or value the server does not support (`echo`, `tools`, ...).
    UnsupportedParameter,
    /// 400: prompt plus `max_tokens` exceed the model's context.
    ContextLengthExceeded,
    /// 401: missing or wrong API key / engine token.
    InvalidApiKey,
    /// 403: the key may not do this (model not allowed, admin only).
    PermissionDenied,
    /// 404: the requested model is not served.
    ModelNotFound,
    /// 404: no such path.
    UnknownUrl,
    /// 404: a named resource (tenant, key, engine) does not exist.
    NotFound,
    /// 405: the path exists, the method does not.
    MethodNotAllowed,
    /// 408: the client sent its request too slowly.
    RequestTimeout,
    /// 413: the body is over the limit.
    RequestTooLarge,
    /// 429: a rate limit or concurrency limit was hit.
    RateLimitExceeded,
    /// 429: a monthly budget (tokens or cost) is used up; it renews with the month.
    InsufficientQuota,
    /// 500: a bug or an engine failure.
    InternalError,
    /// 503: the server is draining.
    Draining,
    /// 503: no healthy engine can take the request.
    NoHealthyEngine,
    /// 503: the server is not ready or over capacity.
    ServiceUnavailable,
    /// 504: the request took longer than allowed.
    Timeout,
}

impl ErrorCode {
    /// The code's wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::InvalidType => "invalid_type",
            ErrorCode::MissingRequiredParameter => "missing_required_parameter",
            ErrorCode::InvalidValue => "invalid_value",
            ErrorCode::UnsupportedParameter => "unsupported_parameter",
            ErrorCode::ContextLengthExceeded => "context_length_exceeded",
            ErrorCode::InvalidApiKey => "invalid_api_key",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::ModelNotFound => "model_not_found",
            ErrorCode::UnknownUrl => "unknown_url",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::RequestTooLarge => "request_too_large",
            ErrorCode::RateLimitExceeded => "rate_limit_exceeded",
            ErrorCode::InsufficientQuota => "insufficient_quota",
            ErrorCode::InternalError => "internal_error",
            ErrorCode::Draining => "draining",
            ErrorCode::NoHealthyEngine => "no_healthy_engine",
            ErrorCode::ServiceUnavailable => "service_unavailable",
            ErrorCode::Timeout => "timeout",
        }
    }

    /// The HTTP status this code is sent with.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidJson
            | ErrorCode::InvalidType
            | ErrorCode::MissingRequiredParameter
            | ErrorCode::InvalidValue
            | ErrorCode::UnsupportedParameter
            | ErrorCode::ContextLengthExceeded => 400,
            ErrorCode::InvalidApiKey => 401,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::ModelNotFound | ErrorCode::UnknownUrl | ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::RequestTooLarge => 413,
            ErrorCode::RateLimitExceeded | ErrorCode::InsufficientQuota => 429,
            ErrorCode::InternalError => 500,
            ErrorCode::Draining | ErrorCode::NoHealthyEngine | ErrorCode::ServiceUnavailable => 503,
            ErrorCode::Timeout => 504,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The OpenAI `type` of an error with this HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// An error to send to an API client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {code}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub type_: &'static str,
    pub code: ErrorCode,
    /// The request field at fault, when there is one (`temperature`, `messages[2].content`).
    pub param: Option<String>,
    /// Seconds for a `Retry-After` header (429 and 503); not part of the body.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with `code`'s status and type.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let status = code.status();
        ApiError {
            status,
            message: message.into(),
            type_: error_type(status),
            code,
            param: None,
            retry_after: None,
        }
    }

    /// Names the request field at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets the `Retry-After` seconds.
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// 400: `param` has a value out of range.
    pub fn invalid_value(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InvalidValue, message).with_param(param)
    }

    /// 400: `param` asks for something this server does not do.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::UnsupportedParameter, message).with_param(param)
    }

    /// 400 from a `serde_json` error: bad syntax, bad UTF-8, a wrong type or a missing field.
    pub fn from_json_error(err: &serde_json::Error) -> Self {
        use serde_json::error::Category;
        match err.classify() {
            Category::Data => {
                let msg = err.to_string();
                let code = if msg.starts_with("missing field") {
                    ErrorCode::MissingRequiredParameter
                } else {
                    ErrorCode::InvalidType
                };
                ApiError::new(code, format!("Invalid request body: {msg}"))
            }
            Category::Syntax | Category::Eof | Category::Io => ApiError::new(
                ErrorCode::InvalidJson,
                format!("We could not parse the JSON body of your request: {err}"),
            ),
        }
    }

    /// 400: prompt plus completion do not fit in the context (OpenAI's wording).
    pub fn context_length_exceeded(context: usize, prompt: usize, completion: usize) -> Self {
        ApiError::new(
            ErrorCode::ContextLengthExceeded,
            format!(
                "This model's maximum context length is {context} tokens. However, you requested \
                 {} tokens ({prompt} in the messages, {completion} in the completion). Please \
                 reduce the length of the messages or completion.",
                prompt + completion
            ),
        )
        .with_param("messages")
    }

    /// 401: no key, or a key that is not valid.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InvalidApiKey, message)
    }

    /// 403: the caller may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::PermissionDenied, message)
    }

    /// 404: the model is not served here (OpenAI's status and wording).
    pub fn model_not_found(model: &str) -> Self {
        ApiError::new(
            ErrorCode::ModelNotFound,
            format!("The model `{model}` does not exist or you do not have access to it."),
        )
        .with_param("model")
    }

    /// 404: no route for `method path`.
    pub fn not_found(method: &str, path: &str) -> Self {
        ApiError::new(
            ErrorCode::UnknownUrl,
            format!("Unknown request URL: {method} {path}. Please check the URL for typos."),
        )
    }

    /// 405: `path` does not take `method`.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        ApiError::new(
            ErrorCode::MethodNotAllowed,
            format!("Method {method} is not allowed on {path}."),
        )
    }

    /// 413: the body is larger than `limit` bytes.
    pub fn payload_too_large(limit: usize) -> Self {
        ApiError::new(
            ErrorCode::RequestTooLarge,
            format!("Request body too large: the limit is {limit} bytes."),
        )
    }

    /// 429: a limit was hit; retry after `retry_after` seconds.
    pub fn rate_limited(message: impl Into<String>, retry_after: u64) -> Self {
        ApiError::new(ErrorCode::RateLimitExceeded, message).with_retry_after(retry_after)
    }

    /// 429: a monthly budget is used up (OpenAI's `insufficient_quota`); retrying before the
    /// budget renews or is raised will not help, so there is no `Retry-After`.
    pub fn budget_exceeded(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InsufficientQuota, message)
    }

    /// 500: something failed on our side. The message must not leak internals or prompts.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InternalError, message)
    }

    /// 503: the server is draining and takes no new requests.
    pub fn draining() -> Self {
        ApiError::new(
            ErrorCode::Draining,
            "The server is draining and is not accepting new requests.",
        )
        .with_retry_after(1)
    }

    /// 503: no engine is available to serve the request.
    pub fn no_healthy_engine() -> Self {
        ApiError::new(
            ErrorCode::NoHealthyEngine,
            "No healthy engine is available to serve the request.",
        )
        .with_retry_after(1)
    }

    /// 503: not ready, or over capacity.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::ServiceUnavailable, message).with_retry_after(1)
    }

    /// 408: the client took too long to send its request.
    pub fn request_timeout(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::RequestTimeout, message)
    }

    /// 504: the request timed out.
    pub fn timeout() -> Self {
        ApiError::new(ErrorCode::Timeout, "The request timed out.")
    }

    /// The body object.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.message.clone(),
                type_: self.type_.to_owned(),
                code: Some(self.code.as_str().to_owned()),
                param: self.param.clone(),
            },
        }
    }

    /// The JSON body: `{"error":{"message","type","code","param"}}`.
    pub fn to_json(&self) -> String {
        // Serializing strings and options cannot fail.
        serde_json::to_string(&self.body()).unwrap_or_default()
    }

    /// The error as one SSE event, for failures after a stream has started.
    pub fn to_sse(&self) -> String {
        format!("data: {}\n\n", self.to_json())
    }
}

/// The wire form of an error, also for clients reading one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

/// The `error` object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub type_: String,
    pub code: Option<String>,
    pub param: Option<String>,
}

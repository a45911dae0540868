//! HTTP plumbing shared by the engine and the gateway: response bodies (whole or streamed), JSON,
//! SSE and error responses, bounded body reads, bearer-token checks, and the bounded HTTP/1.1
//! server loop (`serve`).

pub mod metrics;
pub mod trace;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::{header, Request, Response, StatusCode};
use kvgate_protocol::openai::ApiError;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

/// Every response body: whole, or streamed from a channel (SSE).
pub type RespBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// A body fed by a channel; dropping it (the client went away) closes the channel, which the
/// producer sees as a failed send.
#[derive(Debug)]
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

/// A streamed response and the sender that feeds it.
pub fn stream_channel(capacity: usize) -> (mpsc::Sender<Bytes>, RespBody) {
    let (tx, rx) = mpsc::channel(capacity);
    (tx, ChannelBody { rx }.boxed())
}

pub fn full(body: impl Into<Bytes>) -> RespBody {
    Full::new(body.into()).boxed()
}

pub fn json_response(status: StatusCode, json: String) -> Response<RespBody> {
    let mut r = Response::new(full(json));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

pub fn ok_json<T: serde::Serialize>(value: &T) -> Response<RespBody> {
    match serde_json::to_string(value) {
        Ok(s) => json_response(StatusCode::OK, s),
        Err(e) => error_response(&ApiError::internal(e.to_string())),
    }
}

pub fn text_response(content_type: &'static str, text: String) -> Response<RespBody> {
    let mut r = Response::new(full(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

/// The header by which an engine marks a 5xx as its own fault (not the request's): the only 5xx
/// a gateway counts against the engine's circuit breaker.
pub const FAULT_HEADER: &str = "x-kvgate-fault";

/// The one place an [`ApiError`] becomes an HTTP response.
pub fn error_response(e: &ApiError) -> Response<RespBody> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = json_response(status, e.to_json());
    if let Some(secs) = e.retry_after {
        r.headers_mut().insert(header::RETRY_AFTER, secs.into());
    }
    r
}

pub fn sse_response(body: RespBody) -> Response<RespBody> {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    r
}

/// How long a client may take to send a request body once its headers are in: a client that
/// trickles its body holds a connection and a buffer, so it gets 408 instead.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads a request body of at most `limit` bytes (413 beyond, 408 when it comes too slowly).
pub async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        if len > limit {
            return Err(ApiError::payload_too_large(limit));
        }
    }
    let read = tokio::time::timeout(
        BODY_READ_TIMEOUT,
        Limited::new(req.into_body(), limit).collect(),
    );
    let Ok(read) = read.await else {
        return Err(ApiError::request_timeout(format!(
            "The request body did not arrive within {} s.",
            BODY_READ_TIMEOUT.as_secs()
        )));
    };
    match read {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::payload_too_large(limit))
        }
        Err(e) => Err(ApiError::new(
            kvgate_protocol::openai::ErrorCode::InvalidValue,
            format!("could not read the request body: {e}"),
        )),
    }
}

/// The token of an `Authorization: Bearer <token>` header. The scheme is matched without regard
/// to case (RFC 7235: `bearer` and `BEARER` are the same scheme); surrounding spaces are dropped.
pub fn bearer_token<B>(req: &Request<B>) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Whether the request carries `Authorization: Bearer <token>` (constant-time comparison).
pub fn has_bearer<B>(req: &Request<B>, token: &str) -> bool {
    bearer_token(req).is_some_and(|got| constant_time_eq(got.as_bytes(), token.as_bytes()))
}

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A request header as text.
pub fn header_str<'a, B>(req: &'a Request<B>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

mod serve;
pub use serve::{serve, serve_with, ServeLimits};

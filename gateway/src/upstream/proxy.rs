//! Forwarding one request to one engine, and relaying its answer.
//!
//! A streamed answer is relayed event by event as it arrives (nothing but an incomplete SSE event
//! is ever held back). The gateway waits for the engine's first event before answering the
//! client, so an engine that fails before producing anything is retried elsewhere; once the first
//! byte is out, a broken upstream ends the client's stream with an SSE error event. The usage the
//! engine reports at the end is what the tenant's tokens/min is charged; the gateway always asks
//! the engine for it and drops the usage chunk again when the client did not ask for it. When the
//! client goes away, dropping the relay drops the upstream connection, which cancels the request
//! on the engine.

use super::{Engine, HttpClient};
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{header, Request, Response, StatusCode};
use kvgate_protocol::openai::{ApiError, ErrorCode};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// What goes to the engine.
#[derive(Debug, Clone)]
pub struct Forward {
    pub path: &'static str,
    pub body: Bytes,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub engine_token: Option<Arc<str>>,
    pub stream: bool,
    /// The client asked for the final usage chunk (`stream_options.include_usage`).
    pub client_wants_usage: bool,
}

/// How an attempt on one engine went.
#[derive(Debug)]
pub enum Outcome {
    /// A streamed answer whose first event arrived: relay it.
    Stream {
        status: StatusCode,
        headers: hyper::HeaderMap,
        relay: SseRelay,
    },
    /// A whole answer (JSON), with the tokens it used when it reports usage.
    Whole {
        status: StatusCode,
        headers: hyper::HeaderMap,
        body: Bytes,
        tokens: u64,
    },
    /// Nothing reached the client; another engine may take the request. `failure` says whether
    /// it counts against the engine's circuit breaker (an engine that answers "draining" is fine).
    Retry { why: String, failure: bool },
}

/// Largest whole answer relayed.
const MAX_WHOLE: usize = 64 << 20;

/// Sends `fwd` to `engine` and waits for the start of its answer (bounded by `first_byte`).
pub async fn attempt(
    client: &HttpClient,
    engine: &Engine,
    fwd: &Forward,
    first_byte: Duration,
) -> Outcome {
    match tokio::time::timeout(first_byte, attempt_inner(client, engine, fwd)).await {
        Ok(o) => o,
        Err(_) => Outcome::Retry {
            why: "timed out before the first byte".into(),
            failure: true,
        },
    }
}

async fn attempt_inner(client: &HttpClient, engine: &Engine, fwd: &Forward) -> Outcome {
    let mut req = Request::post(format!("{}{}", engine.url, fwd.path))
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(t) = &fwd.engine_token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    for (k, v) in &fwd.headers {
        req = req.header(k, v);
    }
    let req = match req.body(Full::new(fwd.body.clone())) {
        Ok(r) => r,
        Err(e) => {
            return Outcome::Retry {
                why: e.to_string(),
                failure: false,
            }
        }
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            return Outcome::Retry {
                why: format!("{e:?}"),
                failure: true,
            }
        }
    };
    let status = resp.status();
    if status == StatusCode::SERVICE_UNAVAILABLE || status.is_server_error() {
        return Outcome::Retry {
            why: format!("engine answered {status}"),
            failure: status != StatusCode::SERVICE_UNAVAILABLE,
        };
    }
    let is_sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let (parts, body) = resp.into_parts();
    let headers = relay_headers(&parts.headers);
    if is_sse {
        let mut relay = SseRelay::new(body, fwd.client_wants_usage);
        // The first event: until it arrives, the request can still go elsewhere.
        match relay.prime().await {
            Ok(()) => Outcome::Stream {
                status,
                headers,
                relay,
            },
            Err(why) => Outcome::Retry { why, failure: true },
        }
    } else {
        match Limited::new(body, MAX_WHOLE).collect().await {
            Ok(c) => {
                let body = c.to_bytes();
                let tokens = usage_tokens(&body).unwrap_or(0);
                Outcome::Whole {
                    status,
                    headers,
                    body,
                    tokens,
                }
            }
            Err(e) => Outcome::Retry {
                why: format!("answer broken: {e}"),
                failure: true,
            },
        }
    }
}

/// Response headers worth passing on (content type, cache control, request id).
fn relay_headers(from: &hyper::HeaderMap) -> hyper::HeaderMap {
    let mut out = hyper::HeaderMap::new();
    for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
        if let Some(v) = from.get(&name) {
            out.insert(name, v.clone());
        }
    }
    out
}

/// `usage.prompt_tokens + usage.completion_tokens` of a JSON answer or chunk (`None` when it is
/// not a JSON object or has no `usage`; a count that is not a number counts 0).
///
/// Runs on every answer, so only `usage` is kept: the rest of the document is checked and
/// skipped without building a tree (`serde_json::Value` would allocate every field).
pub fn usage_tokens(json: &[u8]) -> Option<u64> {
    let doc: UsageDoc = serde_json::from_slice(json).ok()?;
    let u = doc.0.filter(|u| !u.is_null())?;
    let p = u.get("prompt_tokens").and_then(|x| x.as_u64()).unwrap_or(0);
    let c = u
        .get("completion_tokens")
        .and_then(|x| x.as_u64())
        .unwrap_or(0);
    Some(p + c)
}

/// A JSON object's `usage` member (the last one, as `serde_json::Value` keeps); every other
/// member is skipped. Only an object is accepted.
struct UsageDoc(Option<serde_json::Value>);

impl<'de> serde::Deserialize<'de> for UsageDoc {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UsageDoc;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UsageDoc, A::Error> {
                let mut usage = None;
                while let Some(IsUsage(is_usage)) = map.next_key()? {
                    if is_usage {
                        usage = Some(map.next_value::<serde_json::Value>()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(UsageDoc(usage))
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// Whether an object key is `usage` (read without allocating).
struct IsUsage(bool);

impl<'de> serde::Deserialize<'de> for IsUsage {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = IsUsage;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<IsUsage, E> {
                Ok(IsUsage(v == "usage"))
            }
        }
        d.deserialize_identifier(Visitor)
    }
}

/// How a relayed stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The engine finished it (`[DONE]`).
    Clean,
    /// The engine's stream broke or ended early.
    Broken,
    /// The client went away first.
    ClientGone,
}

/// Called once when a relayed stream ends, however it ends, with the tokens it used (0 if the
/// engine never reported usage).
pub type OnEnd = Box<dyn FnOnce(u64, StreamEnd) + Send + Sync>;

/// Relays an engine's SSE stream event by event.
pub struct SseRelay {
    inner: Incoming,
    /// Bytes of an event not yet complete.
    partial: BytesMut,
    /// Complete events ready to go out.
    ready: Option<Bytes>,
    wants_usage: bool,
    tokens: u64,
    done: bool,
    clean: bool,
    on_end: Option<OnEnd>,
}

impl std::fmt::Debug for SseRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseRelay")
            .field("tokens", &self.tokens)
            .field("done", &self.done)
            .finish()
    }
}

impl SseRelay {
    fn new(inner: Incoming, wants_usage: bool) -> Self {
        SseRelay {
            inner,
            partial: BytesMut::new(),
            ready: None,
            wants_usage,
            tokens: 0,
            done: false,
            clean: false,
            on_end: None,
        }
    }

    /// Waits for the first complete event.
    async fn prime(&mut self) -> Result<(), String> {
        while self.ready.is_none() {
            match self.inner.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.take(&data);
                    }
                }
                Some(Err(e)) => return Err(format!("stream broke before the first event: {e}")),
                None => return Err("stream ended before the first event".into()),
            }
        }
        Ok(())
    }

    /// Sets what runs when the stream ends (or the client goes away).
    pub fn on_end(&mut self, f: OnEnd) {
        self.on_end = Some(f);
    }

    /// Splits `data` into complete events, notes usage, drops usage-only chunks the client did
    /// not ask for, and queues the rest.
    fn take(&mut self, data: &[u8]) {
        self.partial.extend_from_slice(data);
        let mut out = BytesMut::new();
        while let Some(end) = self.partial.windows(2).position(|w| w == b"\n\n") {
            let event = self.partial.split_to(end + 2);
            let payload = event
                .strip_prefix(b"data: ")
                .or_else(|| event.strip_prefix(b"data:"))
                .map(|p| &p[..p.len().saturating_sub(2)]);
            if let Some(p) = payload {
                if p == b"[DONE]" {
                    self.clean = true;
                } else if contains(p, b"\"usage\"") {
                    if let Some(t) = usage_tokens(p) {
                        self.tokens = t;
                        if !self.wants_usage && contains(p, b"\"choices\":[]") {
                            continue;
                        }
                    }
                }
            }
            out.extend_from_slice(&event);
        }
        if !out.is_empty() {
            match self.ready.take() {
                Some(prev) => {
                    let mut joined = BytesMut::from(&prev[..]);
                    joined.extend_from_slice(&out);
                    self.ready = Some(joined.freeze());
                }
                None => self.ready = Some(out.freeze()),
            }
        }
    }

    fn finish(&mut self, end: StreamEnd) {
        self.done = true;
        if let Some(f) = self.on_end.take() {
            f(self.tokens, end);
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

impl Body for SseRelay {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        loop {
            if let Some(b) = self.ready.take() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.take(&data);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::warn!(error = %e, "engine stream broke mid-response");
                    let err = ApiError::new(
                        ErrorCode::ServiceUnavailable,
                        "The engine serving this request failed mid-stream.",
                    );
                    self.ready = Some(Bytes::from(format!("{}data: [DONE]\n\n", err.to_sse())));
                    self.finish(StreamEnd::Broken);
                }
                Poll::Ready(None) => {
                    let end = if self.clean {
                        StreamEnd::Clean
                    } else {
                        StreamEnd::Broken
                    };
                    if !self.clean {
                        let err = ApiError::new(
                            ErrorCode::ServiceUnavailable,
                            "The engine serving this request closed the stream early.",
                        );
                        self.ready = Some(Bytes::from(format!("{}data: [DONE]\n\n", err.to_sse())));
                    }
                    self.finish(end);
                }
            }
        }
    }
}

impl Drop for SseRelay {
    fn drop(&mut self) {
        // The client went away (or the stream ended): settle the request exactly once.
        if let Some(f) = self.on_end.take() {
            f(self.tokens, StreamEnd::ClientGone);
        }
    }
}

/// A whole response for the client.
pub fn whole_response(
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Bytes,
) -> Response<kvgate_http::RespBody> {
    let mut r = Response::new(kvgate_http::full(body));
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

/// A streamed response for the client.
pub fn stream_response(
    status: StatusCode,
    headers: hyper::HeaderMap,
    relay: SseRelay,
) -> Response<kvgate_http::RespBody> {
    let mut r = Response::new(relay.boxed());
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

#[cfg(test)]
mod tests {
    use super::usage_tokens;

    /// The previous implementation (a whole `serde_json::Value`), as the reference.
    fn reference(json: &[u8]) -> Option<u64> {
        let v: serde_json::Value = serde_json::from_slice(json).ok()?;
        let u = v.get("usage").filter(|u| !u.is_null())?;
        let p = u.get("prompt_tokens").and_then(|x| x.as_u64()).unwrap_or(0);
        let c = u
            .get("completion_tokens")
            .and_then(|x| x.as_u64())
            .unwrap_or(0);
        Some(p + c)
    }

    #[test]
    fn usage_tokens_match_a_full_parse() {
        for json in [
            r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":24,"completion_tokens":12,"total_tokens":36}}"#,
            r#"{"usage":{"prompt_tokens":3},"choices":[]}"#,
            r#"{"usage":null}"#,
            r#"{"choices":[]}"#,
            r#"{"usage":{"prompt_tokens":"7","completion_tokens":2}}"#,
            r#"{"usage":5}"#,
            r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2,"completion_tokens":3}}"#,
            r#"{"us\u0061ge":{"prompt_tokens":4,"completion_tokens":4}}"#,
            r#"{"nested":{"usage":{"prompt_tokens":9}}}"#,
            r#"[{"prompt_tokens":1}]"#,
            r#"{"usage":{"prompt_tokens":1}"#,
            r#"{"usage":{"prompt_tokens":1}} trailing"#,
            "null",
            "",
        ] {
            assert_eq!(
                usage_tokens(json.as_bytes()),
                reference(json.as_bytes()),
                "{json}"
            );
        }
    }
}

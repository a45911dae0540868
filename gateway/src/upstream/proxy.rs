//! Forwarding one request to one engine, and relaying its answer.
//!
//! A streamed answer is relayed event by event as it arrives (nothing but an incomplete SSE event
//! is ever held back). The gateway waits for the engine's first event before answering the
//! client, so an engine that fails before producing anything is retried elsewhere; once the first
//! byte is out, a broken upstream ends the client's stream with an SSE error event, and every
//! stream ends with `[DONE]`. What was served is counted as it is relayed (a chunk with a choice
//! is a token), and the usage the engine reports at the end, when it gets that far, replaces the
//! count; the gateway always asks the engine for usage and drops the usage chunk again when the
//! client did not ask for it. When the client goes away, dropping the relay drops the upstream
//! connection, which cancels the request on the engine.
//!
//! Only the engine's own faults count against its circuit breaker: connect errors, a first byte
//! that never comes, a stream that breaks, and a 5xx the engine marks as its own
//! (`x-kvgate-fault: engine`). Anything else an engine answers is the request's own outcome and
//! goes back to the client as it is.

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
    /// The longest silence of a streaming engine after its first event: past it the stream is
    /// ended as broken (an engine whose host vanished sends no FIN, and its stream would hold
    /// the request's lease and the engine's load for good).
    pub stream_idle: Duration,
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
    /// A whole answer (JSON), with the usage it reports.
    Whole {
        status: StatusCode,
        headers: hyper::HeaderMap,
        body: Bytes,
        usage: Option<Usage>,
    },
    /// Nothing reached the client; another engine may take the request. `failure` says whether
    /// it counts against the engine's circuit breaker (an engine that answers "draining" is fine).
    Retry { why: String, failure: bool },
    /// No first byte within the attempt's time.
    TimedOut,
    /// A whole answer longer than [`MAX_WHOLE`]: the request asked for more than is relayed
    /// whole; no fault of the engine's, and no other engine would do better.
    TooLarge,
}

pub use kvgate_http::FAULT_HEADER;

/// Token counts an engine reports (`usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
    /// Prompt tokens served from the engine's prefix cache (`prompt_tokens_details`).
    pub cached: u64,
}

impl Usage {
    pub fn total(self) -> u64 {
        self.prompt + self.completion
    }
}

/// Largest whole answer relayed.
pub const MAX_WHOLE: usize = 64 << 20;

/// Sends `fwd` to `engine` and waits for the start of its answer (bounded by `first_byte`).
pub async fn attempt(
    client: &HttpClient,
    engine: &Engine,
    fwd: &Forward,
    first_byte: Duration,
) -> Outcome {
    tokio::time::timeout(first_byte, attempt_inner(client, engine, fwd))
        .await
        .unwrap_or(Outcome::TimedOut)
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
    let engine_fault = resp
        .headers()
        .get(FAULT_HEADER)
        .is_some_and(|v| v.as_bytes() == b"engine");
    if status == StatusCode::SERVICE_UNAVAILABLE || (status.is_server_error() && engine_fault) {
        // Draining or over capacity (503), or a fault of the engine's own: another engine may
        // serve the request. Only the latter counts against this engine.
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
        let mut relay = SseRelay::new(body, fwd.client_wants_usage, fwd.stream_idle);
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
                let usage = usage(&body);
                Outcome::Whole {
                    status,
                    headers,
                    body,
                    usage,
                }
            }
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Outcome::TooLarge,
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

/// `usage.prompt_tokens` and `usage.completion_tokens` of a JSON answer or chunk (`None` when it
/// is not a JSON object or has no `usage`; a count that is not a number counts 0).
///
/// Runs on every answer, so only `usage` is kept: the rest of the document is checked and
/// skipped without building a tree (`serde_json::Value` would allocate every field).
pub fn usage(json: &[u8]) -> Option<Usage> {
    let doc: UsageDoc = serde_json::from_slice(json).ok()?;
    let u = doc.0.filter(|u| !u.is_null())?;
    let count = |name: &str| u.get(name).and_then(|x| x.as_u64()).unwrap_or(0);
    let cached = u
        .pointer("/prompt_tokens_details/cached_tokens")
        .and_then(|x| x.as_u64())
        .unwrap_or(0);
    Some(Usage {
        prompt: count("prompt_tokens"),
        completion: count("completion_tokens"),
        cached,
    })
}

/// The finish reasons an engine sends, as the ledger records them.
const FINISH_REASONS: &[&str] = &["stop", "length", "tool_calls", "content_filter"];

/// The first choice's `finish_reason` in a JSON answer or chunk, when it is one of the known
/// reasons (a byte search: the engine writes `"finish_reason":"stop"` with no spaces).
pub fn finish_reason(json: &[u8]) -> Option<&'static str> {
    const FIELD: &[u8] = b"\"finish_reason\":\"";
    let at = json.windows(FIELD.len()).position(|w| w == FIELD)? + FIELD.len();
    let rest = &json[at..];
    FINISH_REASONS
        .iter()
        .copied()
        .find(|r| rest.len() > r.len() && rest.starts_with(r.as_bytes()) && rest[r.len()] == b'"')
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
    /// The engine finished it (`[DONE]`), possibly with an error event of its own before.
    Clean,
    /// The engine's stream broke or ended early: an engine fault.
    Broken,
    /// The client went away first.
    ClientGone,
    /// An event grew past [`MAX_EVENT_BYTES`]. An engine merges what a slow client has not read
    /// yet into its next event, so a request that streams much per token (logprobs, several
    /// answers) to a slow reader gets there: the request's doing, not the engine's fault.
    Oversized,
}

/// What a stream served, as far as the gateway saw it. Two are equal when they served the same
/// (when the first chunk went out is not compared).
#[derive(Debug, Clone, Copy, Default)]
pub struct Served {
    /// The engine's final usage, when the stream got that far.
    pub usage: Option<Usage>,
    /// Chunks relayed that carried a choice (one generated token each).
    pub chunks: u64,
    /// The last finish reason seen.
    pub finish_reason: Option<&'static str>,
    /// When the first chunk with a choice was relayed.
    pub first_chunk: Option<std::time::Instant>,
}

impl PartialEq for Served {
    fn eq(&self, other: &Served) -> bool {
        (self.usage, self.chunks, self.finish_reason)
            == (other.usage, other.chunks, other.finish_reason)
    }
}

impl Eq for Served {}

impl Served {
    /// Completion tokens served: the engine's count when it reported one, else the relayed
    /// chunks (never less than what went out).
    pub fn completion(self) -> u64 {
        self.usage
            .map_or(self.chunks, |u| u.completion.max(self.chunks))
    }
}

/// Called once when a relayed stream ends, however it ends, with what it served.
pub type OnEnd = Box<dyn FnOnce(Served, StreamEnd) + Send + Sync>;

/// Relays an engine's SSE stream event by event.
pub struct SseRelay {
    inner: Incoming,
    /// Wakes the relay to check for an engine gone silent ([`Forward::stream_idle`]).
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_limit: Duration,
    /// When the engine last sent anything.
    heard: tokio::time::Instant,
    /// The stream's events so far: what was served, whether it ended.
    events: SseEvents,
    /// Complete events ready to go out.
    ready: Option<Bytes>,
    done: bool,
    on_end: Option<OnEnd>,
}

impl std::fmt::Debug for SseRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SseRelay")
            .field("served", &self.events.served())
            .field("done", &self.done)
            .finish()
    }
}

/// Longest incomplete event held while waiting for its end; an engine never sends one this
/// long, so past it the stream is treated as broken rather than buffered without bound.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

impl SseRelay {
    fn new(inner: Incoming, wants_usage: bool, idle_limit: Duration) -> Self {
        // Held to a year, so that no configured limit overflows an instant.
        let idle_limit = idle_limit.min(Duration::from_secs(365 * 86_400));
        let heard = tokio::time::Instant::now();
        SseRelay {
            inner,
            idle: Box::pin(tokio::time::sleep_until(heard + idle_limit)),
            idle_limit,
            heard,
            events: SseEvents::new(wants_usage),
            ready: None,
            done: false,
            on_end: None,
        }
    }

    /// Waits for the first complete event.
    async fn prime(&mut self) -> Result<(), String> {
        while self.ready.is_none() {
            match self.inner.frame().await {
                Some(Ok(frame)) => {
                    // The silence allowed after the first event counts from it, not from the
                    // headers (sent before the queue and the prefill).
                    self.heard = tokio::time::Instant::now();
                    if let Ok(data) = frame.into_data() {
                        self.take(&data);
                    }
                    if self.events.buffered() > MAX_EVENT_BYTES {
                        return Err("the engine sent an oversized event".into());
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

    /// Queues the complete events of `data` (see [`SseEvents::push`]).
    fn take(&mut self, data: &[u8]) {
        if let Some(out) = self.events.push(data) {
            self.ready = Some(match self.ready.take() {
                Some(prev) => {
                    let mut joined = BytesMut::from(&prev[..]);
                    joined.extend_from_slice(&out);
                    joined.freeze()
                }
                None => out,
            });
        }
    }

    /// The upstream is over (closed, broken, or oversized): queue the stream's last words and
    /// settle. An engine that already sent its own error event gets `[DONE]` added if it left it
    /// out, and no second error; otherwise an early end is the engine's fault.
    fn close(&mut self, why: &str) {
        self.end_early(why, StreamEnd::Broken);
    }

    /// Ends the stream at an event past [`MAX_EVENT_BYTES`] (see [`StreamEnd::Oversized`]).
    fn cut_oversized(&mut self) {
        self.events.clear_buffer();
        self.end_early("oversized event", StreamEnd::Oversized);
    }

    fn end_early(&mut self, why: &str, early: StreamEnd) {
        let end = if self.events.clean() || self.events.engine_error() {
            StreamEnd::Clean
        } else {
            early
        };
        let tail = if self.events.clean() {
            None
        } else if self.events.engine_error() {
            Some(Bytes::from_static(b"data: [DONE]\n\n"))
        } else {
            tracing::warn!(why, "engine stream ended early");
            let err = if early == StreamEnd::Oversized {
                ApiError::new(
                    ErrorCode::InvalidValue,
                    format!(
                        "An event of this answer grew past {} MiB: the engine sends what a slow \
                         client has not read yet in one event. Read faster, or ask for less per \
                         token (fewer logprobs, fewer answers).",
                        MAX_EVENT_BYTES >> 20
                    ),
                )
            } else {
                ApiError::new(
                    ErrorCode::ServiceUnavailable,
                    "The engine serving this request failed mid-stream.",
                )
            };
            Some(Bytes::from(format!("{}data: [DONE]\n\n", err.to_sse())))
        };
        if let Some(tail) = tail {
            self.ready = Some(match self.ready.take() {
                Some(prev) => [prev, tail].concat().into(),
                None => tail,
            });
        }
        self.finish(end);
    }

    fn finish(&mut self, end: StreamEnd) {
        self.done = true;
        if let Some(f) = self.on_end.take() {
            f(self.events.served(), end);
        }
    }
}

/// An engine's SSE stream, split into events as its bytes arrive; no IO, so it runs (and is
/// fuzzed) without a live body.
///
/// Each [`push`](SseEvents::push) appends to the incomplete event held back and returns the
/// complete events (`...\n\n`) to relay, byte for byte, except: a usage-only chunk (a `usage`
/// and `"choices":[]`) when the client did not ask for usage, and anything after `[DONE]`. On the
/// way it counts chunks with a choice, keeps the last usage reported, and notes `[DONE]` and an
/// error event of the engine's own. Each push costs O(bytes held + bytes pushed).
#[derive(Debug, Default)]
pub struct SseEvents {
    /// Bytes of an event not yet complete.
    partial: BytesMut,
    wants_usage: bool,
    served: Served,
    /// The engine sent `[DONE]`.
    clean: bool,
    /// The engine sent an error event of its own: its stream is over, however it closes.
    engine_error: bool,
}

impl SseEvents {
    /// A stream not yet started; `wants_usage`: the client asked for the usage chunk.
    pub fn new(wants_usage: bool) -> Self {
        SseEvents {
            wants_usage,
            ..SseEvents::default()
        }
    }

    /// Splits `data` into complete events, counts what they serve, drops usage-only chunks the
    /// client did not ask for, and returns the rest (`None` when nothing is complete to relay).
    pub fn push(&mut self, data: &[u8]) -> Option<Bytes> {
        self.partial.extend_from_slice(data);
        let mut out = BytesMut::new();
        while let Some(end) = find(&self.partial, b"\n\n") {
            let event = self.partial.split_to(end + 2);
            if self.clean {
                // Nothing after `[DONE]` is relayed.
                continue;
            }
            let payload = event
                .strip_prefix(b"data: ")
                .or_else(|| event.strip_prefix(b"data:"))
                .map(|p| &p[..p.len().saturating_sub(2)]);
            if let Some(p) = payload {
                if p == b"[DONE]" {
                    self.clean = true;
                } else if p.starts_with(b"{\"error\"") {
                    self.engine_error = true;
                } else if let Some(u) = contains(p, b"\"usage\"").then(|| usage(p)).flatten() {
                    self.served.usage = Some(u);
                    if contains(p, b"\"choices\":[]") {
                        if !self.wants_usage {
                            continue;
                        }
                    } else {
                        self.choice(p);
                    }
                } else if contains(p, b"\"choices\":[{") {
                    self.choice(p);
                }
            }
            out.extend_from_slice(&event);
        }
        (!out.is_empty()).then(|| out.freeze())
    }

    /// Counts a chunk with a choice: one more token, maybe the first, maybe the last.
    fn choice(&mut self, chunk: &[u8]) {
        self.served.chunks += 1;
        if self.served.first_chunk.is_none() {
            self.served.first_chunk = Some(std::time::Instant::now());
        }
        if let Some(r) = contains(chunk, b"\"finish_reason\":\"")
            .then(|| finish_reason(chunk))
            .flatten()
        {
            self.served.finish_reason = Some(r);
        }
    }

    /// What the events so far served.
    pub fn served(&self) -> Served {
        self.served
    }

    /// The engine sent `[DONE]`: nothing after it is relayed.
    pub fn clean(&self) -> bool {
        self.clean
    }

    /// The engine sent an error event of its own.
    pub fn engine_error(&self) -> bool {
        self.engine_error
    }

    /// Bytes held back: the start of an event not yet complete.
    pub fn buffered(&self) -> usize {
        self.partial.len()
    }

    /// Drops the bytes held back (an oversized event that will never be relayed).
    pub fn clear_buffer(&mut self) {
        self.partial.clear();
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    find(hay, needle).is_some()
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
                Poll::Pending => {
                    // The timer is moved only when it fires, not on every frame.
                    if std::future::Future::poll(self.idle.as_mut(), cx).is_pending() {
                        return Poll::Pending;
                    }
                    let due = self.heard + self.idle_limit;
                    if tokio::time::Instant::now() < due {
                        self.idle.as_mut().reset(due);
                        continue;
                    }
                    let why = format!("no data for {} s", self.idle_limit.as_secs());
                    self.close(&why);
                }
                Poll::Ready(Some(Ok(frame))) => {
                    self.heard = tokio::time::Instant::now();
                    if let Ok(data) = frame.into_data() {
                        self.take(&data);
                    }
                    if self.events.clean() {
                        // `[DONE]` is the last event: settle now rather than when the engine
                        // closes its side (read to its end still, so the connection is reused).
                        if let Some(f) = self.on_end.take() {
                            f(self.events.served(), StreamEnd::Clean);
                        }
                        // Whatever follows is dropped, so none of it is held either.
                        if self.events.buffered() > MAX_EVENT_BYTES {
                            self.cut_oversized();
                        }
                    } else if self.events.buffered() > MAX_EVENT_BYTES {
                        self.cut_oversized();
                    }
                }
                Poll::Ready(Some(Err(e))) => self.close(&e.to_string()),
                Poll::Ready(None) => self.close("closed before [DONE]"),
            }
        }
    }
}

impl Drop for SseRelay {
    fn drop(&mut self) {
        // The client went away (or the stream ended): settle the request exactly once.
        if let Some(f) = self.on_end.take() {
            f(self.events.served(), StreamEnd::ClientGone);
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
    use super::usage;

    fn usage_tokens(json: &[u8]) -> Option<u64> {
        usage(json).map(super::Usage::total)
    }

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

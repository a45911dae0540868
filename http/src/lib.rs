//! HTTP plumbing shared by the engine and the gateway: response bodies (whole or streamed), JSON,
//! SSE and error responses, bounded body reads, bearer-token checks.

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

/// Reads a request body of at most `limit` bytes (413 beyond).
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
    match Limited::new(req.into_body(), limit).collect().await {
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

/// Whether the request carries `Authorization: Bearer <token>` (constant-time comparison).
pub fn has_bearer<B>(req: &Request<B>, token: &str) -> bool {
    let Some(got) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    constant_time_eq(got.as_bytes(), token.as_bytes())
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

/// Serves HTTP/1.1 connections from `listener` with a fresh service per connection (from
/// `make`), TCP_NODELAY on every socket, until `shutdown` completes; connections in flight then
/// finish (streams included) before this returns.
pub async fn serve<S>(
    listener: tokio::net::TcpListener,
    make: impl Fn() -> S,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()>
where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response<RespBody>,
            Error = Infallible,
        > + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut shutdown = std::pin::pin!(shutdown);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), make());
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    graceful.shutdown().await;
    Ok(())
}

//! The tenants' API as a tower stack:
//! request id -> trace -> body limit -> auth -> (deadline -> rate limit -> route -> proxy).
//! Each layer is a named `tower::Layer` whose service forwards `poll_ready`; the last one is
//! [`crate::api`], which owns the request's deadline (a timeout layer here would race the
//! proxy's own per-engine deadline and drop an attempt before it could be retried elsewhere).

use crate::api;
use crate::auth::{AuthError, Principal};
use crate::extensions::{BodyLimit, RequestId};
use crate::state::Gateway;
use hyper::body::Incoming;
use hyper::{header, Request, Response};
use kvgate_http::trace::{Attr, Kind, Parent, Trace, Tracer, TRACEPARENT};
use kvgate_http::{error_response, RespBody};
use kvgate_protocol::openai::ApiError;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tower::{Layer, Service, ServiceBuilder};
use tracing::Instrument;

type Req = Request<Incoming>;
type Resp = Response<RespBody>;
type BoxFut = Pin<Box<dyn Future<Output = Result<Resp, Infallible>> + Send>>;

/// The whole stack for one connection, as a hyper service.
pub fn stack(
    gw: Arc<Gateway>,
) -> hyper_util::service::TowerToHyperService<
    impl Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone + Send + 'static,
> {
    let svc = ServiceBuilder::new()
        .layer(RequestIdLayer {
            stopping: gw.stopping.clone(),
        })
        .layer(TraceLayer {
            tracer: gw.tracer.clone(),
        })
        .layer(BodyLimitLayer {
            limit: gw.config.max_body_bytes,
        })
        .layer(AuthLayer { gw: gw.clone() })
        .service(ApiService { gw });
    hyper_util::service::TowerToHyperService::new(svc)
}

/// Each layer's service forwards `poll_ready` to the service it wraps, and calls the instance
/// that was made ready (a fresh clone stays behind for the next request), so a layer that
/// applies backpressure (`ConcurrencyLimit`, `LoadShed`) works anywhere in the stack.
macro_rules! forward_ready {
    () => {
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            self.inner.poll_ready(cx)
        }
    };
}

/// The ready inner service, taken for one call; a clone takes its place.
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let fresh = inner.clone();
    std::mem::replace(inner, fresh)
}

/// Gives each request its [`RequestId`] and echoes it in the answer's `x-request-id`; once the
/// gateway is stopping, the answer to each request that arrives also closes its connection
/// (`connection: close`), so that kept-alive clients reconnect elsewhere before the listeners
/// close.
#[derive(Debug, Clone, Default)]
pub struct RequestIdLayer {
    pub stopping: Arc<AtomicBool>,
}

impl<S> Layer<S> for RequestIdLayer {
    type Service = RequestIdService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RequestIdService {
            inner,
            stopping: self.stopping.clone(),
        }
    }
}

/// A `debug` span per request (its id, method and path; tenant and engine once known) and,
/// when tracing is on, the request's [`Trace`]: its root span, in the request's extensions for
/// the layers and handler below, which add their own spans.
#[derive(Debug, Clone, Default)]
pub struct TraceLayer {
    pub tracer: Tracer,
}

impl<S> Layer<S> for TraceLayer {
    type Service = TraceService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        TraceService {
            inner,
            tracer: self.tracer.clone(),
        }
    }
}

/// Refuses a body declared larger than `limit` (413) and hands the limit to the handler, which
/// enforces it while reading.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimitLayer {
    pub limit: usize,
}

impl<S> Layer<S> for BodyLimitLayer {
    type Service = BodyLimitService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        BodyLimitService {
            inner,
            limit: self.limit,
        }
    }
}

/// Authenticates the API key and attaches the `Arc<Principal>`; 401 otherwise.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    pub gw: Arc<Gateway>,
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            gw: self.gw.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RequestIdService<S> {
    inner: S,
    stopping: Arc<AtomicBool>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn new_request_id() -> String {
    // A process-random prefix plus a counter: unique across replicas without a syscall per call.
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let p = PREFIX.get_or_init(rand::random::<u32>);
    format!(
        "req_{p:08x}{:012x}",
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    )
}

impl<S> Service<Req> for RequestIdService<S>
where
    S: Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone + Send + 'static,
{
    type Response = Resp;
    type Error = Infallible;
    type Future = BoxFut;
    forward_ready!();

    fn call(&mut self, mut req: Req) -> BoxFut {
        let id: Arc<str> = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| {
                !v.is_empty()
                    && v.len() <= 64
                    && v.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            })
            .map_or_else(|| Arc::from(new_request_id()), Arc::from);
        req.extensions_mut().insert(RequestId(id.clone()));
        let mut inner = take_ready(&mut self.inner);
        // Read as the request arrives (no per-request handle on the flag): the requests the stop's
        // grace exists for arrive after it began.
        let stopping = self.stopping.load(Ordering::Relaxed);
        Box::pin(async move {
            let mut resp = inner.call(req).await?;
            if let Ok(v) = header::HeaderValue::from_str(&id) {
                resp.headers_mut().insert("x-request-id", v);
            }
            if stopping {
                resp.headers_mut().insert(
                    header::CONNECTION,
                    header::HeaderValue::from_static("close"),
                );
            }
            Ok(resp)
        })
    }
}

#[derive(Debug, Clone)]
pub struct TraceService<S> {
    inner: S,
    tracer: Tracer,
}

/// Longest path recorded in a span.
const MAX_TRACED_PATH: usize = 256;

/// The request's trace (none for health checks): the client's `traceparent`, if well formed,
/// gives its trace id and the root's parent; the gateway's sampler decides whether it is made.
/// It is exported only if the request is authenticated.
fn start_trace(tracer: &Tracer, req: &Req, id: &str) -> Option<Arc<Trace>> {
    if !tracer.enabled() || req.uri().path() == "/health" {
        return None;
    }
    let parent = req
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(Parent::parse);
    let trace = tracer.trace("gateway.request", Kind::Server, parent, false)?;
    let mut path = req.uri().path();
    if path.len() > MAX_TRACED_PATH {
        let mut end = MAX_TRACED_PATH;
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        path = &path[..end];
    }
    trace.set(Attr::new("http.request.method", req.method().to_string()));
    trace.set(Attr::new("url.path", path.to_owned()));
    trace.set(Attr::new("kvgate.request_id", id.to_owned()));
    // Kept once the caller is authenticated: anyone can send requests that are refused before.
    trace.discard();
    Some(trace)
}

/// The answer's status on the root span (the handler's guard may change it later: a stream
/// whose client leaves ends as 499).
pub fn trace_status(trace: &Trace, status: u16) {
    trace.set(Attr::new("http.response.status_code", i64::from(status)));
    if status >= 500 {
        trace.fail(format!("status {status}"));
    }
}

impl<S> Service<Req> for TraceService<S>
where
    S: Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone + Send + 'static,
{
    type Response = Resp;
    type Error = Infallible;
    type Future = BoxFut;
    forward_ready!();

    fn call(&mut self, mut req: Req) -> BoxFut {
        let id = req
            .extensions()
            .get::<RequestId>()
            .map(|r| r.0.clone())
            .unwrap_or_else(|| Arc::from(""));
        let trace = start_trace(&self.tracer, &req, &id);
        if let Some(t) = &trace {
            req.extensions_mut().insert(t.clone());
        }
        // Never the body: no prompt text reaches the logs.
        let span = tracing::debug_span!(
            "request",
            id = %id,
            method = %req.method(),
            path = %req.uri().path(),
            tenant = tracing::field::Empty,
            engine = tracing::field::Empty,
        );
        let mut inner = take_ready(&mut self.inner);
        let start = Instant::now();
        Box::pin(
            async move {
                let resp = inner.call(req).await?;
                if let Some(t) = trace {
                    trace_status(&t, resp.status().as_u16());
                }
                tracing::debug!(
                    status = resp.status().as_u16(),
                    micros = start.elapsed().as_micros() as u64,
                    "answered"
                );
                Ok(resp)
            }
            .instrument(span),
        )
    }
}

#[derive(Debug, Clone)]
pub struct BodyLimitService<S> {
    inner: S,
    limit: usize,
}

impl<S> Service<Req> for BodyLimitService<S>
where
    S: Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone + Send + 'static,
{
    type Response = Resp;
    type Error = Infallible;
    type Future = BoxFut;
    forward_ready!();

    fn call(&mut self, mut req: Req) -> BoxFut {
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > self.limit) {
            let e = ApiError::payload_too_large(self.limit);
            return Box::pin(async move { Ok(error_response(&e)) });
        }
        req.extensions_mut().insert(BodyLimit(self.limit));
        let mut inner = take_ready(&mut self.inner);
        Box::pin(async move { inner.call(req).await })
    }
}

#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    gw: Arc<Gateway>,
}

/// The API key in `Authorization: Bearer` (any case of the scheme) or OpenAI's `api-key`
/// header.
fn api_key(req: &Req) -> Option<&str> {
    kvgate_http::bearer_token(req)
        .or_else(|| req.headers().get("api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim)
}

impl<S> Service<Req> for AuthService<S>
where
    S: Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone + Send + 'static,
{
    type Response = Resp;
    type Error = Infallible;
    type Future = BoxFut;
    forward_ready!();

    fn call(&mut self, mut req: Req) -> BoxFut {
        let gw = self.gw.clone();
        let mut inner = take_ready(&mut self.inner);
        Box::pin(async move {
            if req.uri().path() == "/health" {
                return inner.call(req).await;
            }
            let key = api_key(&req).map(str::to_owned);
            let trace = req.extensions().get::<Arc<Trace>>().cloned();
            let mut span = trace
                .as_ref()
                .map(|t| t.span("gateway.auth", Kind::Internal));
            let authenticated = gw.auth.authenticate(key.as_deref()).await;
            if let (Some(span), Some(trace)) = (span.as_mut(), trace.as_ref()) {
                match &authenticated {
                    Ok(p) => {
                        trace.keep();
                        trace.set(Attr::new("kvgate.tenant", p.tenant.id.clone()));
                        span.set(Attr::new("kvgate.tenant", p.tenant.id.clone()));
                        span.set(Attr::new("kvgate.key_id", p.key_id.clone()));
                    }
                    Err(e) => span.fail(e.to_string()),
                }
            }
            drop(span);
            match authenticated {
                Ok(p) => {
                    tracing::Span::current().record("tenant", p.tenant.id.as_str());
                    req.extensions_mut().insert::<Arc<Principal>>(p);
                    inner.call(req).await
                }
                Err(e) => {
                    let err = match e {
                        AuthError::Missing => ApiError::unauthorized(
                            "Missing API key: send it as 'Authorization: Bearer kvg_...'.",
                        ),
                        AuthError::Invalid => ApiError::unauthorized("Incorrect API key provided."),
                        AuthError::Expired(at) => ApiError::unauthorized(format!(
                            "The API key expired on {} (unix time {at}); use its successor or \
                             ask the operator for a new key.",
                            crate::usage::day_of(at)
                        )),
                        AuthError::Unavailable => ApiError::unavailable(
                            "The key store is unavailable; try again shortly.",
                        ),
                    };
                    if !matches!(e, AuthError::Unavailable) {
                        gw.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    gw.metrics.request("-", err.status);
                    Ok(error_response(&err))
                }
            }
        })
    }
}

#[derive(Debug, Clone)]
struct ApiService {
    gw: Arc<Gateway>,
}

impl Service<Req> for ApiService {
    type Response = Resp;
    type Error = Infallible;
    type Future = BoxFut;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> BoxFut {
        let gw = self.gw.clone();
        Box::pin(async move { Ok(api::handle(gw, req).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A service that is ready only while its gate is open, like a concurrency limit.
    #[derive(Clone)]
    struct Gate(Arc<AtomicBool>);

    impl Service<Req> for Gate {
        type Response = Resp;
        type Error = Infallible;
        type Future = BoxFut;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            if self.0.load(Ordering::SeqCst) {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }

        fn call(&mut self, _: Req) -> BoxFut {
            unreachable!("only readiness is tested")
        }
    }

    #[test]
    fn layers_forward_the_inner_services_readiness() {
        let open = Arc::new(AtomicBool::new(false));
        let mut svc = ServiceBuilder::new()
            .layer(RequestIdLayer::default())
            .layer(TraceLayer::default())
            .layer(BodyLimitLayer { limit: 16 })
            .service(Gate(open.clone()));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(svc.poll_ready(&mut cx).is_pending());
        open.store(true, Ordering::SeqCst);
        assert!(svc.poll_ready(&mut cx).is_ready());
    }
}

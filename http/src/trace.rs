//! Distributed tracing: W3C trace context in and out, a request's spans recorded as it runs, and
//! their export over OTLP/HTTP (protobuf) through `opentelemetry-otlp`.
//!
//! With no endpoint configured the [`Tracer`] is disabled: no trace is made and no span recorded,
//! so tracing costs a branch per request.
//!
//! A request's spans live in its [`Trace`] (one per request and process). The trace's root span
//! ends when its last holder drops it, however the request ended (answered, failed, its client
//! gone mid-stream), and then every span goes to the export task in one piece. The queue between
//! them is bounded: what does not fit is dropped and counted, never waited for, and a collector
//! that is down or slow costs requests nothing.
//!
//! A caller's `traceparent` gives the trace its id and the root its parent, so a client's own
//! trace joins up with the gateway's and the engine's. Whether a request is recorded is the
//! sampler's decision (`sample_ratio`) unless the caller is trusted (an engine trusts its gateway,
//! which has already decided): a client's sampled flag neither forces nor hides a recording.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use serde::Deserialize;
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, oneshot};

pub use opentelemetry::trace::SpanKind as Kind;
pub use opentelemetry::KeyValue as Attr;

/// The W3C trace-context header.
pub const TRACEPARENT: &str = "traceparent";

/// Finished traces waiting for the export task; past this they are dropped and counted.
const QUEUE_TRACES: usize = 8192;
/// Spans per export request, at most (about 100 KiB of protobuf: buffers that stay small
/// enough to be reused rather than mapped and zeroed afresh for every batch).
const BATCH_SPANS: usize = 512;
/// Room made up front for a root span's attributes and its children (a request's usual count).
const ROOT_ATTRS: usize = 12;
const CHILD_SPANS: usize = 6;
/// How long the export task lets traces gather after the first of a batch arrives.
const FLUSH: Duration = Duration::from_millis(200);
/// Flushes asked for and not yet begun, at most.
const FLUSH_ASKS: usize = 8;
/// One export request's time, connecting, sending and reading the answer; a collector that does
/// not answer within it loses that batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest status message a span carries.
const MAX_STATUS_BYTES: usize = 128;
/// Bytes of a collector's answer read, at most.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// `[tracing]` in `gateway.toml` and `engine.toml`.
///
/// ```toml
/// [tracing]
/// otlp_endpoint = "http://otel-collector:4318"  # OTLP/HTTP; `/v1/traces` is added to a bare host
/// sample_ratio = 1.0                            # share of requests recorded
/// service_name = "kvgate-gateway"               # default: kvgate-gateway / kvgate-engine
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP address; none: tracing is off.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// The share of requests (not trusted callers') that are recorded, 0 to 1.
    #[serde(default = "one")]
    pub sample_ratio: f64,
    #[serde(default)]
    pub service_name: Option<String>,
}

fn one() -> f64 {
    1.0
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            sample_ratio: 1.0,
            service_name: None,
        }
    }
}

impl TracingConfig {
    /// Errors name the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(format!(
                "tracing.sample_ratio: {} is not between 0 and 1",
                self.sample_ratio
            ));
        }
        if let Some(name) = &self.service_name {
            if name.trim().is_empty() || name.len() > 128 {
                return Err("tracing.service_name: 1 to 128 characters".into());
            }
        }
        self.traces_url().map(|_| ())
    }

    /// The collector's traces URL: the endpoint as given when it has a path, else with
    /// `/v1/traces` (as `OTEL_EXPORTER_OTLP_ENDPOINT` is read).
    fn traces_url(&self) -> Result<Option<String>, String> {
        let Some(endpoint) = &self.otlp_endpoint else {
            return Ok(None);
        };
        let uri: hyper::Uri = endpoint
            .parse()
            .map_err(|e| format!("tracing.otlp_endpoint: '{endpoint}' is not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "tracing.otlp_endpoint: '{endpoint}': https is not supported; send to a \
                     collector on the same host or pod over http"
                ))
            }
            _ => {
                return Err(format!(
                    "tracing.otlp_endpoint: '{endpoint}' must be an http:// URL"
                ))
            }
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(format!("tracing.otlp_endpoint: '{endpoint}' has no host"));
        }
        let url = endpoint.trim_end_matches('/');
        Ok(Some(match uri.path() {
            "" | "/" => format!("{url}/v1/traces"),
            _ => endpoint.clone(),
        }))
    }
}

/// A caller's trace context, from its `traceparent` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: u128,
    pub span_id: u64,
    pub sampled: bool,
}

impl Parent {
    /// Parses a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`); anything malformed, an
    /// all-zero id or the forbidden version `ff` is no parent (the request starts a new trace).
    pub fn parse(value: &str) -> Option<Parent> {
        fn hex<const N: usize>(s: &str) -> Option<&str> {
            (s.len() == N && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(s)
        }
        let mut parts = value.trim().split('-');
        let version = hex::<2>(parts.next()?)?;
        let trace_id = u128::from_str_radix(hex::<32>(parts.next()?)?, 16).ok()?;
        let span_id = u64::from_str_radix(hex::<16>(parts.next()?)?, 16).ok()?;
        let flags = u8::from_str_radix(hex::<2>(parts.next()?)?, 16).ok()?;
        // Version 00 has exactly these four fields; a later version may add more after them.
        if version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        (trace_id != 0 && span_id != 0).then_some(Parent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The `traceparent` that makes `span_id` of `trace_id` the receiver's parent.
    pub fn header(trace_id: u128, span_id: u64, sampled: bool) -> String {
        format!(
            "00-{trace_id:032x}-{span_id:016x}-{:02x}",
            u8::from(sampled)
        )
    }
}

/// What the export has done, for the metrics.
#[derive(Debug, Default)]
pub struct TraceCounters {
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans dropped because the export queue was full.
    pub dropped: AtomicU64,
    /// Spans lost to failed export requests.
    pub failed: AtomicU64,
}

/// Makes traces and exports them; disabled (the default) when no endpoint is configured.
#[derive(Debug, Clone, Default)]
pub struct Tracer(Option<Arc<Exporter>>);

#[derive(Debug)]
struct Exporter {
    tx: mpsc::Sender<Vec<Record>>,
    /// Asks the export task to send what it holds now, and to answer once it has.
    flush: mpsc::Sender<oneshot::Sender<()>>,
    ratio: f64,
    counters: Arc<TraceCounters>,
}

impl Tracer {
    /// Exports to the configured endpoint, as `service` unless the config names another, from a
    /// thread of its own (whatever runtime the requests run on; it ends once the tracer and
    /// every trace are gone); disabled when the config has no endpoint.
    pub fn start(config: &TracingConfig, service: &str) -> Result<Tracer, String> {
        config.validate()?;
        let Some(url) = config.traces_url()? else {
            return Ok(Tracer(None));
        };
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(OtlpClient::new(EXPORT_TIMEOUT))
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("tracing.otlp_endpoint: {e}"))?;
        let service = config.service_name.as_deref().unwrap_or(service).to_owned();
        exporter.set_resource(
            &opentelemetry_sdk::Resource::builder_empty()
                .with_service_name(service)
                .build(),
        );
        let (tx, rx) = mpsc::channel(QUEUE_TRACES);
        let (flush, flushes) = mpsc::channel(FLUSH_ASKS);
        let counters = Arc::new(TraceCounters::default());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tracing: the export thread's runtime: {e}"))?;
        let task = export(exporter, rx, flushes, counters.clone());
        std::thread::Builder::new()
            .name("kvgate-otlp".into())
            .spawn(move || runtime.block_on(task))
            .map_err(|e| format!("tracing: the export thread: {e}"))?;
        Ok(Tracer(Some(Arc::new(Exporter {
            tx,
            flush,
            ratio: config.sample_ratio,
            counters,
        }))))
    }

    pub fn enabled(&self) -> bool {
        self.0.is_some()
    }

    /// Sends the traces finished so far to the collector now rather than with the next batch,
    /// waiting up to `within` (at a stop, so that the last requests' traces are not lost with the
    /// process). True when they went (or tracing is off).
    pub async fn flush(&self, within: Duration) -> bool {
        let Some(export) = &self.0 else {
            return true;
        };
        let (done, sent) = oneshot::channel();
        if export.flush.try_send(done).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, sent).await, Ok(Ok(())))
    }

    pub fn counters(&self) -> Option<&TraceCounters> {
        self.0.as_ref().map(|e| &*e.counters)
    }

    /// The export's counters in the Prometheus text format, named `{prefix}_trace_spans_*`
    /// (nothing when tracing is off).
    pub fn render_metrics(&self, prefix: &str, out: &mut String) {
        use std::fmt::Write;
        let Some(c) = self.counters() else { return };
        for (what, help, v) in [
            (
                "exported",
                "Spans the OTLP collector accepted.",
                &c.exported,
            ),
            (
                "dropped",
                "Spans dropped because the export queue was full.",
                &c.dropped,
            ),
            ("failed", "Spans lost to failed export requests.", &c.failed),
        ] {
            let name = format!("{prefix}_trace_spans_{what}_total");
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
    }

    /// A new request's trace, or `None` when tracing is off or the request is not sampled.
    /// `parent` (the caller's context) gives the trace id and the root's parent. A `trusted`
    /// caller (a gateway, which sampled already) decides: its request is recorded when it sent
    /// a sampled parent, and not when it sent none. For anyone else `sample_ratio` decides.
    pub fn trace(
        &self,
        name: &'static str,
        kind: SpanKind,
        parent: Option<Parent>,
        trusted: bool,
    ) -> Option<Arc<Trace>> {
        let export = self.0.as_ref()?;
        let sampled = if trusted {
            parent.is_some_and(|p| p.sampled)
        } else {
            export.ratio >= 1.0 || rand::random::<f64>() < export.ratio
        };
        if !sampled {
            return None;
        }
        Some(Arc::new(Trace {
            export: export.clone(),
            trace_id: parent.map_or_else(new_trace_id, |p| p.trace_id),
            root: new_span_id(),
            remote_parent: parent.map(|p| p.span_id),
            name,
            kind,
            start: Instant::now(),
            wall: SystemTime::now(),
            inner: Mutex::new(Spans {
                attrs: Vec::with_capacity(ROOT_ATTRS),
                error: None,
                done: Vec::with_capacity(CHILD_SPANS),
                discard: false,
            }),
        }))
    }
}

fn new_trace_id() -> u128 {
    rand::random::<u128>().max(1)
}

fn new_span_id() -> u64 {
    rand::random::<u64>().max(1)
}

/// One request's spans in this process, under one root span that lasts as long as the trace.
#[derive(Debug)]
pub struct Trace {
    export: Arc<Exporter>,
    trace_id: u128,
    root: u64,
    remote_parent: Option<u64>,
    name: &'static str,
    kind: SpanKind,
    start: Instant,
    wall: SystemTime,
    inner: Mutex<Spans>,
}

#[derive(Debug, Default)]
struct Spans {
    attrs: Vec<KeyValue>,
    error: Option<String>,
    done: Vec<Record>,
    discard: bool,
}

/// A finished span, as the export task gets it.
#[derive(Debug)]
struct Record {
    trace_id: u128,
    id: u64,
    parent: u64,
    remote_parent: bool,
    name: &'static str,
    kind: SpanKind,
    start: SystemTime,
    end: SystemTime,
    attrs: Vec<KeyValue>,
    error: Option<String>,
}

impl Trace {
    pub fn trace_id(&self) -> u128 {
        self.trace_id
    }

    /// The root span's id.
    pub fn root_id(&self) -> u64 {
        self.root
    }

    fn spans(&self) -> std::sync::MutexGuard<'_, Spans> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets an attribute of the root span (replacing one of the same key).
    pub fn set(&self, attr: KeyValue) {
        set_attr(&mut self.spans().attrs, attr);
    }

    /// Marks the root span failed (the message cut to 128 bytes).
    pub fn fail(&self, why: impl Into<String>) {
        self.spans().error = Some(status_message(why.into()));
    }

    /// Records nothing of this trace unless [`Trace::keep`] is called later: a request refused
    /// before it was authenticated, which anyone can send, fills neither the export queue nor
    /// the collector.
    pub fn discard(&self) {
        self.spans().discard = true;
    }

    /// Records this trace after all (its caller proved who it is).
    pub fn keep(&self) {
        self.spans().discard = false;
    }

    /// Opens a child of the root span, from now until it is dropped.
    pub fn span(self: &Arc<Self>, name: &'static str, kind: SpanKind) -> Span {
        Span {
            trace: self.clone(),
            id: new_span_id(),
            name,
            kind,
            start: Instant::now(),
            attrs: Vec::with_capacity(4),
            error: None,
        }
    }

    /// Records a finished child of the root span.
    pub fn record(
        &self,
        name: &'static str,
        kind: SpanKind,
        start: Instant,
        end: Instant,
        attrs: Vec<KeyValue>,
    ) {
        let record = self.child(new_span_id(), name, kind, start, end, attrs, None);
        self.spans().done.push(record);
    }

    #[allow(clippy::too_many_arguments)]
    fn child(
        &self,
        id: u64,
        name: &'static str,
        kind: SpanKind,
        start: Instant,
        end: Instant,
        attrs: Vec<KeyValue>,
        error: Option<String>,
    ) -> Record {
        Record {
            trace_id: self.trace_id,
            id,
            parent: self.root,
            remote_parent: false,
            name,
            kind,
            start: self.wall_at(start),
            end: self.wall_at(end.max(start)),
            attrs,
            error,
        }
    }

    /// The wall-clock time of `t`, from the trace's own start (one clock reading per trace).
    fn wall_at(&self, t: Instant) -> SystemTime {
        match t.checked_duration_since(self.start) {
            Some(after) => self.wall + after,
            None => self.wall - self.start.duration_since(t),
        }
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        let spans = std::mem::take(self.inner.get_mut().unwrap_or_else(|p| p.into_inner()));
        if spans.discard {
            return;
        }
        let mut records = spans.done;
        records.push(Record {
            trace_id: self.trace_id,
            id: self.root,
            parent: self.remote_parent.unwrap_or(0),
            remote_parent: self.remote_parent.is_some(),
            name: self.name,
            kind: self.kind.clone(),
            start: self.wall,
            end: self.wall_at(Instant::now()),
            attrs: spans.attrs,
            error: spans.error,
        });
        let n = records.len() as u64;
        if self.export.tx.try_send(records).is_err() {
            self.export.counters.dropped.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// A span's status message, bounded.
fn status_message(mut why: String) -> String {
    if why.len() > MAX_STATUS_BYTES {
        let mut end = MAX_STATUS_BYTES;
        while !why.is_char_boundary(end) {
            end -= 1;
        }
        why.truncate(end);
    }
    why
}

fn set_attr(attrs: &mut Vec<KeyValue>, attr: KeyValue) {
    match attrs.iter_mut().find(|a| a.key == attr.key) {
        Some(a) => *a = attr,
        None => attrs.push(attr),
    }
}

/// An open child span of a trace's root, recorded (ending now) when dropped.
#[derive(Debug)]
pub struct Span {
    trace: Arc<Trace>,
    id: u64,
    name: &'static str,
    kind: SpanKind,
    start: Instant,
    attrs: Vec<KeyValue>,
    error: Option<String>,
}

impl Span {
    pub fn set(&mut self, attr: KeyValue) {
        set_attr(&mut self.attrs, attr);
    }

    pub fn fail(&mut self, why: impl Into<String>) {
        self.error = Some(status_message(why.into()));
    }

    /// The `traceparent` that makes this span the receiver's parent.
    pub fn traceparent(&self) -> String {
        Parent::header(self.trace.trace_id, self.id, true)
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let record = self.trace.child(
            self.id,
            self.name,
            self.kind.clone(),
            self.start,
            Instant::now(),
            std::mem::take(&mut self.attrs),
            self.error.take(),
        );
        self.trace.spans().done.push(record);
    }
}

/// The export task: batches of finished traces to the collector, one request at a time.
async fn export(
    exporter: opentelemetry_otlp::SpanExporter,
    mut rx: mpsc::Receiver<Vec<Record>>,
    mut flushes: mpsc::Receiver<oneshot::Sender<()>>,
    counters: Arc<TraceCounters>,
) {
    let scope = InstrumentationScope::builder("kvgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut traces = Vec::new();
    let mut last_warning: Option<Instant> = None;
    let mut dropped_seen = 0;
    let mut backlog = false;
    // Flushes asked for: answered once the task has sent everything queued before them.
    let mut asked: Vec<oneshot::Sender<()>> = Vec::new();
    loop {
        // Idle, the task waits for a trace; then it sleeps while more arrive (a sleeping
        // receiver is not woken by each send) and takes them all at once. Behind (the last
        // batch was full), it takes the next batch at once. A flush cuts the wait short.
        if !backlog {
            if asked.is_empty() {
                tokio::select! {
                    n = rx.recv_many(&mut traces, 1) => {
                        if n == 0 {
                            return; // every sender is gone and the queue is empty
                        }
                        tokio::select! {
                            () = tokio::time::sleep(FLUSH) => {}
                            Some(ask) = flushes.recv() => asked.push(ask),
                        }
                    }
                    Some(ask) = flushes.recv() => asked.push(ask),
                }
            }
            while let Ok(ask) = flushes.try_recv() {
                asked.push(ask);
            }
        }
        let mut spans: usize = traces.iter().map(Vec::len).sum();
        let mut closed = false;
        while spans < BATCH_SPANS {
            match rx.try_recv() {
                Ok(t) => {
                    spans += t.len();
                    traces.push(t);
                }
                Err(e) => {
                    closed = e == mpsc::error::TryRecvError::Disconnected;
                    break;
                }
            }
        }
        backlog = spans >= BATCH_SPANS;
        if traces.is_empty() {
            answer(&mut asked);
            if closed {
                return;
            }
            continue;
        }
        let mut batch: Vec<SpanData> = Vec::with_capacity(spans);
        batch.extend(traces.drain(..).flatten().map(|r| span_data(r, &scope)));
        let n = batch.len() as u64;
        let dropped = counters.dropped.load(Ordering::Relaxed);
        let warn_now = last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
        if dropped > dropped_seen && warn_now {
            last_warning = Some(Instant::now());
            tracing::warn!(
                spans = dropped - dropped_seen,
                "trace export queue full; spans dropped (the collector is slow or down)"
            );
            dropped_seen = dropped;
        }
        match exporter.export(batch).await {
            Ok(()) => {
                counters.exported.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                counters.failed.fetch_add(n, Ordering::Relaxed);
                if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    last_warning = Some(Instant::now());
                    tracing::warn!(error = %e, spans = n, "trace export failed; spans lost");
                }
            }
        }
        if !backlog {
            answer(&mut asked);
        }
    }
}

/// Tells each flush asked for that what was queued before it has been sent.
fn answer(asked: &mut Vec<oneshot::Sender<()>>) {
    for ask in asked.drain(..) {
        let _ = ask.send(());
    }
}

fn span_data(r: Record, scope: &InstrumentationScope) -> SpanData {
    SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(r.trace_id.to_be_bytes()),
            SpanId::from_bytes(r.id.to_be_bytes()),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id: SpanId::from_bytes(r.parent.to_be_bytes()),
        parent_span_is_remote: r.remote_parent,
        span_kind: r.kind,
        name: Cow::Borrowed(r.name),
        start_time: r.start,
        end_time: r.end,
        attributes: r.attrs,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: r.error.map_or(Status::Unset, Status::error),
        instrumentation_scope: scope.clone(),
    }
}

/// The exporter's HTTP client: hyper on the export task's runtime, answers read up to a bound,
/// each exchange within `timeout`.
#[derive(Debug)]
struct OtlpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl OtlpClient {
    fn new(timeout: Duration) -> OtlpClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT.min(timeout)));
        OtlpClient {
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
        }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for OtlpClient {
    async fn send_bytes(
        &self,
        request: hyper::Request<Bytes>,
    ) -> Result<hyper::Response<Bytes>, opentelemetry_http::HttpError> {
        let (head, body) = request.into_parts();
        let exchange = async {
            let response = self
                .client
                .request(hyper::Request::from_parts(head, Full::new(body)))
                .await?;
            let (head, body) = response.into_parts();
            let body = Limited::new(body, MAX_RESPONSE_BYTES)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(hyper::Response::from_parts(head, body))
        };
        // The whole exchange has its deadline: a collector that accepts and never answers (or
        // trickles) costs one batch, not the export for good.
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("no answer from the collector in {:?}", self.timeout))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_refuses_what_the_spec_refuses() {
        let p = Parent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(p.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(p.span_id, 0x00f067aa0ba902b7);
        assert!(p.sampled);
        assert_eq!(
            Parent::header(p.trace_id, p.span_id, true),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let not_sampled =
            Parent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!not_sampled.sampled);
        // A later version may carry more fields after the four it shares with 00.
        assert!(
            Parent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra")
                .is_some()
        );
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(Parent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn endpoints_are_checked_and_a_bare_host_gets_the_traces_path() {
        let with = |e: &str| TracingConfig {
            otlp_endpoint: Some(e.into()),
            ..TracingConfig::default()
        };
        assert_eq!(
            with("http://collector:4318").traces_url().unwrap().unwrap(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            with("http://collector:4318/")
                .traces_url()
                .unwrap()
                .unwrap(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            with("http://collector:4318/custom/traces")
                .traces_url()
                .unwrap()
                .unwrap(),
            "http://collector:4318/custom/traces"
        );
        for bad in [
            "collector:4318",
            "https://collector:4318",
            "not a url",
            "ftp://x",
        ] {
            let err = with(bad).validate().unwrap_err();
            assert!(err.starts_with("tracing.otlp_endpoint"), "{bad}: {err}");
        }
        let ratio = TracingConfig {
            sample_ratio: 1.5,
            ..TracingConfig::default()
        };
        assert!(ratio
            .validate()
            .unwrap_err()
            .starts_with("tracing.sample_ratio"));
        assert_eq!(TracingConfig::default().traces_url(), Ok(None));
    }

    /// A collector that takes the connection and never answers costs one exchange its timeout,
    /// not the export thread for good.
    #[tokio::test]
    async fn a_collector_that_never_answers_times_out() {
        use opentelemetry_http::HttpClient;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(conn);
        });
        let client = OtlpClient::new(Duration::from_millis(300));
        let request = hyper::Request::post(format!("http://{addr}/v1/traces"))
            .body(Bytes::from_static(b"x"))
            .unwrap();
        let started = Instant::now();
        let err = client.send_bytes(request).await.unwrap_err();
        assert!(err.to_string().contains("no answer"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        held.abort();
    }

    /// A flush returns once the traces finished before it are at the collector; with tracing
    /// off it has nothing to do.
    #[tokio::test]
    async fn a_flush_sends_the_finished_traces_before_it_returns() {
        use std::sync::atomic::AtomicUsize;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        assert!(
            Tracer::start(&TracingConfig::default(), "x")
                .unwrap()
                .flush(Duration::from_secs(1))
                .await
        );
        // A collector that answers every export with an empty success and counts them.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let exports = Arc::new(AtomicUsize::new(0));
        let counted = exports.clone();
        let collector = tokio::spawn(async move {
            loop {
                let (mut conn, _) = listener.accept().await.unwrap();
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        while buf.len() < end + 4 + len {
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..end + 4 + len);
                        counted.fetch_add(1, Ordering::SeqCst);
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                        if conn.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let config = TracingConfig {
            otlp_endpoint: Some(format!("http://{addr}")),
            ..TracingConfig::default()
        };
        let tracer = Tracer::start(&config, "x").unwrap();
        drop(
            tracer
                .trace("request", SpanKind::Server, None, false)
                .unwrap(),
        );
        assert!(tracer.flush(Duration::from_secs(5)).await);
        assert_eq!(exports.load(Ordering::SeqCst), 1);
        assert_eq!(
            tracer.counters().unwrap().exported.load(Ordering::Relaxed),
            1
        );
        // Nothing left: the next flush answers at once and sends nothing.
        assert!(tracer.flush(Duration::from_secs(5)).await);
        assert_eq!(exports.load(Ordering::SeqCst), 1);
        collector.abort();
    }

    #[test]
    fn status_messages_are_bounded() {
        assert_eq!(status_message("short".into()), "short");
        let long = "é".repeat(100);
        let cut = status_message(long);
        assert!(cut.len() <= MAX_STATUS_BYTES && cut.chars().all(|c| c == 'é'));
    }

    #[tokio::test]
    async fn a_disabled_tracer_makes_no_trace() {
        let t = Tracer::start(&TracingConfig::default(), "x").unwrap();
        assert!(!t.enabled());
        assert!(t.trace("r", SpanKind::Server, None, false).is_none());
    }

    /// A trace's spans reach the queue when its last holder lets go, children of the root, the
    /// root a child of the caller's span; an untrusted caller's sampled flag decides nothing.
    #[tokio::test]
    async fn a_trace_is_sent_whole_when_it_ends() {
        let (tx, mut rx) = mpsc::channel(4);
        let export = |ratio| {
            Tracer(Some(Arc::new(Exporter {
                tx: tx.clone(),
                flush: mpsc::channel(1).0,
                ratio,
                counters: Arc::default(),
            })))
        };
        let parent = Parent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
        let never = export(0.0);
        assert!(never.trace("r", SpanKind::Server, parent, false).is_none());
        let sampled = Parent {
            sampled: true,
            ..parent.unwrap()
        };
        assert!(never
            .trace("r", SpanKind::Server, Some(sampled), false)
            .is_none());
        assert!(never
            .trace("r", SpanKind::Server, Some(sampled), true)
            .is_some());
        assert!(
            rx.try_recv().is_ok(),
            "the trusted caller's trace, dropped at once"
        );
        let always = export(1.0);
        assert!(always.trace("r", SpanKind::Server, parent, true).is_none());
        assert!(always.trace("r", SpanKind::Server, None, true).is_none());

        let trace = always
            .trace("request", SpanKind::Server, parent, false)
            .unwrap();
        let mut upstream = trace.span("upstream", SpanKind::Client);
        upstream.set(KeyValue::new("attempt", 1));
        let header = upstream.traceparent();
        let t0 = Instant::now();
        trace.record("route", SpanKind::Internal, t0, t0, vec![]);
        trace.set(KeyValue::new("status", 200));
        let held = trace.clone();
        drop(trace);
        drop(upstream);
        assert!(rx.try_recv().is_err(), "the trace is still held");
        drop(held);
        let spans = rx.try_recv().unwrap();
        let discarded = always
            .trace("request", SpanKind::Server, None, false)
            .unwrap();
        discarded.discard();
        drop(discarded.span("auth", SpanKind::Internal));
        drop(discarded);
        assert!(rx.try_recv().is_err(), "a discarded trace is not sent");
        let kept = always
            .trace("request", SpanKind::Server, None, false)
            .unwrap();
        kept.discard();
        kept.keep();
        drop(kept);
        assert!(rx.try_recv().is_ok(), "kept after all");
        let names: Vec<_> = spans.iter().map(|s| s.name).collect();
        assert_eq!(names, ["route", "upstream", "request"]);
        let root = &spans[2];
        assert_eq!(root.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(
            (root.parent, root.remote_parent),
            (0x00f067aa0ba902b7, true)
        );
        assert!(spans[..2]
            .iter()
            .all(|s| s.parent == root.id && !s.remote_parent));
        assert_eq!(
            Parent::parse(&header),
            Some(Parent {
                trace_id: root.trace_id,
                span_id: spans[1].id,
                sampled: true
            })
        );
        assert!(spans.iter().all(|s| s.end >= s.start));
    }
}

//! The engine's HTTP server (hyper on tokio): the OpenAI-compatible API, health, metrics, admin
//! endpoints and the KV event stream for the gateway.
//!
//! The engine loop runs on its own thread ([`crate::worker`]) and owns every sequence; handlers
//! only validate, tokenize, hand the request over a channel and turn the events that come back
//! into JSON or SSE. Files: [`http`] (plumbing), [`api`] (completions and chat), [`admin`]
//! (drain, flush, status, KV events), [`metrics`], [`config`].

pub mod admin;
pub mod api;
pub mod config;
pub mod http;
pub mod launch;
pub mod metrics;
pub mod peer;

use crate::stats::Stats;
use crate::worker::{Command, EngineThread};
use http::{error_response, RespBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use kvgate_protocol::openai::{ApiError, Limits};
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_protocol::KvEventRecord;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use tokio::net::TcpListener;
use tokio::sync::broadcast;

/// Everything the handlers share.
#[derive(Debug)]
pub struct ServerState {
    /// What the model runs on: `cpu`, or the GPU's name and architecture.
    pub device: String,
    pub model_id: String,
    pub context_len: usize,
    pub vocab_size: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    pub renderer: Arc<PromptRenderer>,
    /// Compiles structured-output grammars; `None` when the tokenizer is not one llguidance
    /// reads (structured outputs are then refused).
    pub grammars: Option<Arc<crate::sampling::GrammarCompiler>>,
    /// Bounds concurrent compiles, in all and per tenant.
    pub grammar_gate: crate::sampling::CompileGate,
    pub commands: mpsc::Sender<Command>,
    /// Peers' asks for blocks, which the engine thread answers between steps and between a
    /// step's layers (each is followed by [`Command::PeerAsks`] on `commands`).
    pub export_asks: mpsc::Sender<crate::worker::ExportJob>,
    /// This engine's fetches' asks for what to fetch, answered the same way.
    pub want_asks: mpsc::Sender<crate::worker::WantJob>,
    /// Blocks fetched from peers and sent to the engine thread that it has not stored yet (one
    /// is added before each [`Command::Import`]).
    pub imports_pending: Arc<AtomicUsize>,
    /// The engine thread behind `commands`, for `/health`.
    pub engine: EngineThread,
    pub metrics: Arc<Stats>,
    pub kv_events: broadcast::Sender<KvEventRecord>,
    pub limits: Limits,
    pub max_body_bytes: usize,
    /// Required on `/v1/*` and `/kv/events` when set (the gateway's shared token).
    pub engine_token: Option<String>,
    /// Required on `/admin/*` when set.
    pub operator_token: Option<String>,
    pub draining: AtomicBool,
    /// How peer frames are made and checked (peer transfer needs the engine token).
    pub peer: Option<crate::worker::disk::PeerCodec>,
    /// Peer transfers this engine serves at once.
    pub exports: Arc<tokio::sync::Semaphore>,
    /// Peer transfers this engine runs at once as the requester.
    pub fetches: tokio::sync::Semaphore,
    /// Those transfers, for requests that want the same blocks to wait for.
    pub fetching: peer::Fetching,
    /// Peers not to ask for a while, after they failed.
    pub peer_backoff: peer::Backoff,
    pub inflight: AtomicUsize,
    pub next_id: AtomicU64,
    pub started: u64,
    /// Set when the server shuts down: endless streams (`/kv/events`) end, so the graceful
    /// shutdown, which waits for every connection, can finish.
    pub closing: tokio::sync::watch::Sender<bool>,
    /// Each request's spans, under the gateway's (`[tracing]`).
    pub tracer: kvgate_http::trace::Tracer,
}

impl ServerState {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Hands a block fetched from a peer to the engine thread, counted in `imports_pending`
    /// until that thread has stored it (false: the engine stopped, and the count is taken back).
    /// Synchronous, with no await between the count and the send: a transfer dropped at any of
    /// its awaits leaves no count behind, and a block sent is uncounted by the engine thread
    /// whether or not its transfer goes on.
    pub fn send_import(&self, frame: crate::worker::disk::Frame) -> bool {
        self.imports_pending.fetch_add(1, Ordering::SeqCst);
        if self.commands.send(Command::Import(frame)).is_ok() {
            return true;
        }
        self.imports_pending.fetch_sub(1, Ordering::SeqCst);
        false
    }
}

/// Serves connections from `listener` until `shutdown` completes; in-flight connections finish.
pub async fn run(
    listener: TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let closing = state.closing.clone();
    let commands = state.commands.clone();
    let tracer = state.tracer.clone();
    let shutdown = async move {
        shutdown.await;
        let _ = closing.send(true);
    };
    let served = http::serve(
        listener,
        move || {
            let state = state.clone();
            service_fn(move |req| route(state.clone(), req))
        },
        shutdown,
    )
    .await;
    // Every connection has finished: the prefix cache outlives the process, so what is cached
    // goes to the disk tier (when there is one) before the engine stops.
    let (tx, rx) = tokio::sync::oneshot::channel();
    if commands
        .send(crate::worker::Command::Persist(true, tx))
        .is_ok()
    {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(70), rx).await;
    }
    // The last requests' traces go to the collector before the process ends.
    if !tracer.flush(std::time::Duration::from_secs(5)).await {
        tracing::warn!("the last traces were not exported before the stop");
    }
    served
}

/// The engine's metrics in the Prometheus text format: its statistics and the peer transfers
/// running now.
pub fn render_metrics(state: &ServerState) -> String {
    let mut text = metrics::render(&state.metrics);
    metrics::render_transfers(
        &mut text,
        peer::MAX_FETCHES.saturating_sub(state.fetches.available_permits()),
        peer::MAX_EXPORTS.saturating_sub(state.exports.available_permits()),
    );
    text
}

async fn route(
    state: Arc<ServerState>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, std::convert::Infallible> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let resp = match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => admin::health(&state),
        (Method::GET, "/health/live") => admin::liveness(&state),
        (Method::GET, "/metrics") => {
            let mut text = render_metrics(&state);
            state.tracer.render_metrics("kvgate_engine", &mut text);
            http::text_response("text/plain; version=0.0.4; charset=utf-8", text)
        }
        (Method::GET, "/v1/models") => api::models(&state, &req),
        (Method::POST, "/v1/completions") => api::completions(state, req).await,
        (Method::POST, "/v1/chat/completions") => api::chat(state, req).await,
        (Method::GET, "/kv/events") => admin::kv_events(state, req).await,
        (Method::POST, "/kv/blocks") => peer::export(state, req).await,
        (_, p) if p.starts_with("/admin/") => admin::route(state, req).await,
        (
            _,
            "/health"
            | "/health/live"
            | "/metrics"
            | "/v1/models"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/kv/events"
            | "/kv/blocks",
        ) => error_response(&ApiError::method_not_allowed(method.as_str(), &path)),
        _ => error_response(&ApiError::not_found(method.as_str(), &path)),
    };
    Ok(resp)
}

//! Engines: the registry (static config plus `kvgate admin engines add`, persisted in the store),
//! each engine's live state (health, drain, load, circuit breaker), the KV-event consumers that
//! feed the prefix index, and the pooled HTTP client the proxy uses.

pub mod events;
pub mod health;
pub mod proxy;

use crate::routing::index::{PrefixIndex, MAX_ENGINES};
use crate::routing::{engine_id, Candidate};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;

/// The pooled upstream client (HTTP/1.1, TCP_NODELAY).
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// This thread's client to engines (a pool of kept-alive connections per thread). On the
/// gateway's API threads, each a single-threaded event loop, a request and its engine
/// connection are then served by the same thread: no wake-up crosses threads.
pub fn local_client() -> HttpClient {
    thread_local! {
        static CLIENT: HttpClient = http_client();
    }
    CLIENT.with(Clone::clone)
}

pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build(connector)
}

/// Consecutive failures that open an engine's circuit.
const BREAKER_FAILURES: u32 = 3;
/// How long an open circuit keeps the engine out of routing before one trial request.
const BREAKER_OPEN: Duration = Duration::from_secs(5);

/// One engine, as this gateway sees it.
#[derive(Debug)]
pub struct Engine {
    pub name: String,
    /// Base URL without a trailing slash.
    pub url: String,
    /// Its bit in the prefix index.
    pub slot: usize,
    /// Rendezvous id (a hash of the name).
    pub id: u64,
    /// Passes active health checks.
    pub up: AtomicBool,
    /// Health checks in a row that timed out.
    pub slow_checks: AtomicU32,
    /// Drained by an operator through this gateway: no new requests.
    pub draining: AtomicBool,
    /// The engine itself reports draining (drained through any gateway or directly).
    pub engine_draining: AtomicBool,
    /// Requests this gateway has in flight on it.
    pub inflight: AtomicU64,
    /// Prompt tokens routed to it whose prefill has not started streaming back yet.
    pub queued_prefill: AtomicU64,
    /// Its KV usage (allocated / capacity) at the last health check, as f64 bits.
    kv_usage: AtomicU64,
    /// Its own in-flight count at the last health check.
    pub engine_inflight: AtomicU64,
    failures: AtomicU32,
    open_until_ms: AtomicU64,
    /// Whether the KV event stream is connected and in sync.
    pub events_live: AtomicBool,
    /// Set to true when the engine leaves the registry: its tasks stop.
    stop: watch::Sender<bool>,
}

impl Engine {
    fn new(name: &str, url: &str, slot: usize) -> Self {
        Engine {
            name: name.to_owned(),
            url: url.trim_end_matches('/').to_owned(),
            slot,
            id: engine_id(name),
            up: AtomicBool::new(false),
            slow_checks: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            engine_draining: AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            queued_prefill: AtomicU64::new(0),
            kv_usage: AtomicU64::new(0f64.to_bits()),
            engine_inflight: AtomicU64::new(0),
            failures: AtomicU32::new(0),
            open_until_ms: AtomicU64::new(0),
            events_live: AtomicBool::new(false),
            stop: watch::channel(false).0,
        }
    }

    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage.load(Ordering::Relaxed))
    }

    pub fn set_kv_usage(&self, v: f64) {
        self.kv_usage.store(v.to_bits(), Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst) || self.engine_draining.load(Ordering::SeqCst)
    }

    /// May take new requests: healthy, not draining, circuit closed (or half-open).
    pub fn routable(&self, now_ms: u64) -> bool {
        self.up.load(Ordering::SeqCst)
            && !self.is_draining()
            && self.open_until_ms.load(Ordering::Relaxed) <= now_ms
    }

    /// Whether its circuit is open (out of routing after repeated faults) at `now_ms`.
    pub fn circuit_open(&self, now_ms: u64) -> bool {
        self.open_until_ms.load(Ordering::Relaxed) > now_ms
    }

    /// A request to it failed (connect error, 5xx, broken stream).
    pub fn record_failure(&self, now_ms: u64) {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= BREAKER_FAILURES {
            self.open_until_ms
                .store(now_ms + BREAKER_OPEN.as_millis() as u64, Ordering::Relaxed);
            tracing::warn!(engine = %self.name, failures = n, "circuit open");
        }
    }

    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open_until_ms.store(0, Ordering::Relaxed);
    }

    /// Load in tokens for the routing score.
    pub fn load(&self, kv_weight: f64) -> f64 {
        self.queued_prefill.load(Ordering::Relaxed) as f64 + kv_weight * self.kv_usage()
    }

    pub fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

/// All engines and the prefix index over them.
#[derive(Debug, Default)]
pub struct Registry {
    engines: RwLock<Vec<Arc<Engine>>>,
    pub index: RwLock<PrefixIndex>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("an engine named {0:?} already exists")]
    Exists(String),
    #[error("at most {MAX_ENGINES} engines")]
    Full,
}

impl Registry {
    pub fn new() -> Self {
        Registry {
            engines: RwLock::new(Vec::new()),
            index: RwLock::new(PrefixIndex::new()),
        }
    }

    pub fn all(&self) -> Vec<Arc<Engine>> {
        self.engines
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Engine>> {
        self.all().into_iter().find(|e| e.name == name)
    }

    /// Adds an engine in the first free slot; the caller starts its tasks.
    pub fn add(&self, name: &str, url: &str) -> Result<Arc<Engine>, RegistryError> {
        let mut engines = self.engines.write().unwrap_or_else(|p| p.into_inner());
        if engines.iter().any(|e| e.name == name) {
            return Err(RegistryError::Exists(name.to_owned()));
        }
        let slot = (0..MAX_ENGINES)
            .find(|s| engines.iter().all(|e| e.slot != *s))
            .ok_or(RegistryError::Full)?;
        let engine = Arc::new(Engine::new(name, url, slot));
        engines.push(engine.clone());
        Ok(engine)
    }

    /// Removes an engine: stops its tasks and forgets its cache.
    pub fn remove(&self, name: &str) -> Option<Arc<Engine>> {
        let mut engines = self.engines.write().unwrap_or_else(|p| p.into_inner());
        let i = engines.iter().position(|e| e.name == name)?;
        let engine = engines.remove(i);
        drop(engines);
        let _ = engine.stop.send(true);
        self.index
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear(engine.slot);
        Some(engine)
    }

    /// Routing candidates for a request with these block hashes, skipping `exclude` (a slot
    /// bitmask of engines already tried).
    pub fn candidates(
        &self,
        hashes: &[kvgate_protocol::BlockHash],
        exclude: u64,
        kv_weight: f64,
        now_ms: u64,
    ) -> (Vec<Candidate>, Vec<Arc<Engine>>) {
        let engines: Vec<Arc<Engine>> = self
            .all()
            .into_iter()
            .filter(|e| exclude & (1 << e.slot) == 0 && e.routable(now_ms))
            .collect();
        let mask = engines.iter().fold(0u64, |m, e| m | (1 << e.slot));
        let matched = self
            .index
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .longest_matches(hashes, mask);
        let candidates = engines
            .iter()
            .map(|e| Candidate {
                slot: e.slot,
                id: e.id,
                matched_blocks: matched[e.slot],
                load: e.load(kv_weight),
            })
            .collect();
        (candidates, engines)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

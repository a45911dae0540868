//! Engines: the registry (static config plus `kvgate admin engines add`, persisted in the store),
//! each engine's live state (health, drain, load, circuit breaker), the KV-event consumers that
//! feed the prefix index, and the pooled HTTP client the proxy uses.

pub mod events;
pub mod health;
pub mod peer;
pub mod proxy;

use crate::routing::index::{PrefixIndex, TierMatch, MAX_ENGINES};
use crate::routing::{engine_id, Candidate, RouterConfig};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use kvgate_protocol::load::upper_median;
use kvgate_protocol::{Ask, LoadReport};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
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
    // An engine whose host vanishes sends no FIN: keepalive probes find the dead connection.
    connector.set_keepalive(Some(Duration::from_secs(30)));
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
    /// Of those, the requests other gateways had sent it (its count less this gateway's then).
    pub others_inflight: AtomicU64,
    /// Its queue and measured speed at the last health check, and when that was.
    report: Mutex<(Arc<LoadReport>, Option<Instant>)>,
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
            others_inflight: AtomicU64::new(0),
            report: Mutex::new((Arc::default(), None)),
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

    /// May send a prefix to another engine: up and its circuit closed (draining or not).
    pub fn can_be_peer(&self, now_ms: u64) -> bool {
        self.up.load(Ordering::SeqCst) && !self.circuit_open(now_ms)
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

    /// The load report of the last health check and its age in seconds (`None`: no usable
    /// report yet).
    pub fn report(&self) -> (Arc<LoadReport>, Option<f64>) {
        let (report, at) = &*self.report.lock().unwrap_or_else(|p| p.into_inner());
        (report.clone(), at.map(|t| t.elapsed().as_secs_f64()))
    }

    /// Stores a report read from the engine (made safe first), or forgets the last one.
    pub fn set_report(&self, report: Option<LoadReport>) {
        let entry = match report {
            Some(r) => (Arc::new(r.sanitized()), Some(Instant::now())),
            None => (Arc::default(), None),
        };
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = entry;
    }

    /// Records the engine's own in-flight count, as its health check read it.
    pub fn set_engine_inflight(&self, n: u64) {
        let n = n.min(MAX_REPORTED_INFLIGHT);
        self.engine_inflight.store(n, Ordering::Relaxed);
        let mine = self.inflight.load(Ordering::Relaxed);
        self.others_inflight
            .store(n.saturating_sub(mine), Ordering::Relaxed);
    }

    /// What routing reads of it now, with its last report (`report`, from [`Engine::report`]).
    pub fn view<'a>(&self, report: &'a Report, now_ms: u64) -> EngineView<'a> {
        EngineView {
            slot: self.slot,
            id: self.id,
            routable: self.routable(now_ms),
            peer: self.can_be_peer(now_ms),
            draining: self.is_draining(),
            report: &report.0,
            age_secs: report.1,
            inflight: self.total_inflight(),
            queued_prefill: self.queued_prefill.load(Ordering::Relaxed),
        }
    }

    /// Requests in flight on it: this gateway's now, and other gateways' at the last report.
    fn total_inflight(&self) -> u64 {
        self.inflight
            .load(Ordering::Relaxed)
            .saturating_add(self.others_inflight.load(Ordering::Relaxed))
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

    /// Routing candidates for `req`, skipping `exclude` (a slot bitmask of engines already
    /// tried), and the engines they are, in the same order.
    pub fn candidates(
        &self,
        req: &RouteRequest<'_>,
        exclude: u64,
        now_ms: u64,
    ) -> (Vec<Candidate>, Vec<Arc<Engine>>) {
        let all = self.all();
        let reports: Vec<Report> = all.iter().map(|e| e.report()).collect();
        let views: Vec<EngineView<'_>> = all
            .iter()
            .zip(&reports)
            .map(|(e, r)| e.view(r, now_ms))
            .collect();
        let index = self.index.read().unwrap_or_else(|p| p.into_inner());
        let candidates = candidates(&views, &index, req, exclude);
        drop(index);
        let engines = all
            .into_iter()
            .filter(|e| candidates.iter().any(|c| c.slot == e.slot))
            .collect();
        (candidates, engines)
    }
}

pub use peer::{peer_for, Peer, PEER_MIN_GAIN_BLOCKS};

/// A request's prompt blocks, counted as routed to its engine ([`PrefixIndex::route`]) until
/// this is dropped: when the request ends, however it ends.
#[derive(Debug)]
pub struct RoutedPrompt {
    registry: Arc<Registry>,
    slot: usize,
    hashes: Vec<kvgate_protocol::BlockHash>,
}

impl Registry {
    /// Counts `hashes` as routed to engine `slot` while the returned guard lives, expected to
    /// be computed there at `ready_ms` (gateway clock; `u64::MAX` when not known).
    pub fn route(
        self: &Arc<Self>,
        slot: usize,
        hashes: &[kvgate_protocol::BlockHash],
        ready_ms: u64,
    ) -> RoutedPrompt {
        self.index
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .route_ready(slot, hashes, ready_ms);
        RoutedPrompt {
            registry: self.clone(),
            slot,
            hashes: hashes.to_vec(),
        }
    }
}

impl Drop for RoutedPrompt {
    fn drop(&mut self) {
        self.registry
            .index
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .unroute(self.slot, &self.hashes);
    }
}

/// What routing reads of one engine: its state at the gateway and its last load report. The
/// gateway takes one of each engine per decision ([`Engine::view`]); the routing simulator makes
/// them from its simulated engines, so both route through [`candidates`].
#[derive(Debug, Clone, Copy)]
pub struct EngineView<'a> {
    pub slot: usize,
    /// Rendezvous id (a hash of the name).
    pub id: u64,
    /// May take new requests ([`Engine::routable`]).
    pub routable: bool,
    /// May send a prefix to another engine ([`Engine::can_be_peer`]).
    pub peer: bool,
    pub draining: bool,
    pub report: &'a LoadReport,
    /// How old the report is, in seconds (`None`: no usable report yet).
    pub age_secs: Option<f64>,
    /// Requests in flight on it: this gateway's now, and other gateways' at the last report.
    pub inflight: u64,
    /// Prompt tokens routed to it whose prefill has not started streaming back.
    pub queued_prefill: u64,
}

impl EngineView<'_> {
    /// The routing candidate this engine is for `req`, of which it caches `matched_blocks`
    /// blocks: its wait in seconds from its last report (less the report's age), at least the
    /// prefill routed to it that has not started; and its requests in flight. An engine that
    /// has not measured its speed is taken at `req`'s prior seconds per token.
    ///
    /// Matched blocks in the engine's host tier or on its disk save their prefill but must be
    /// loaded first: their load time, at the engine's measured rates, adds to its wait.
    fn candidate(&self, matched: TierMatch, req: &RouteRequest<'_>) -> Candidate {
        let report = self.report;
        let matched_blocks = matched.blocks;
        let block = req.block_size.max(1) as usize;
        let uncached = req
            .prompt_tokens
            .saturating_sub(matched_blocks as usize * block);
        let ask = Ask {
            tenant: Some(req.tenant),
            own_tokens: uncached as u64,
            blocks_needed: uncached.div_ceil(block) as u64,
            queued_tokens: self.queued_prefill,
        };
        let load_secs = report.tier_load_secs(matched.host, matched.disk);
        Candidate {
            slot: self.slot,
            id: self.id,
            matched_blocks,
            peer_blocks: 0,
            inflight: self.inflight,
            compute_inflight: 0,
            wait_secs: report.wait_now(self.age_secs.unwrap_or(0.0), ask, req.prior_secs_per_token)
                + load_secs,
            load_secs,
            secs_per_token: report.secs_per_token(req.prior_secs_per_token),
            peer_secs_per_block: if report.peer_load_secs_per_block > 0.0 {
                report.peer_load_secs_per_block
            } else {
                req.prior_peer_secs_per_block
            },
            max_seqs: report.max_seqs,
            free_blocks: report.free_blocks,
            computing_blocks: 0,
        }
    }
}

/// Routing candidates for `req` among `engines` (those routable and not in `exclude`, a slot
/// bitmask of engines already tried), in their order, with what `index` says each caches.
pub fn candidates(
    engines: &[EngineView<'_>],
    index: &PrefixIndex,
    req: &RouteRequest<'_>,
    exclude: u64,
) -> Vec<Candidate> {
    let open: Vec<&EngineView<'_>> = engines
        .iter()
        .filter(|e| exclude & (1 << e.slot) == 0 && e.routable)
        .collect();
    let mask = open.iter().fold(0u64, |m, e| m | (1 << e.slot));
    // Engines a candidate may count on to send it the prefix: those `best_peer` picks from
    // (up, circuit closed). An engine answers a fetch between the layers of its step in
    // progress, so its own work does not hold a transfer up. Each is listed with its compute
    // and whether it would not take the request itself (draining, or with a full batch): such
    // a holder counts for every candidate. The others (those that reported) count so that a
    // tenant may move off a busier batch for the price of a transfer: for candidates on other
    // compute only (moving work within one machine's cores gains nothing), and whose free
    // blocks hold the request and as many blocks again as the pool caches. A pool that far from
    // full is not evicting, so the copy does not trade another tenant's cached prefix for a
    // second copy of this one. (Counting free blocks alone let copies fill a small pool while
    // it warmed up, and the tenants evicted later.)
    let holders: Vec<(usize, &str, bool)> = engines
        .iter()
        .filter(|e| exclude & (1 << e.slot) == 0 && e.peer)
        .filter_map(|e| {
            let r = e.report;
            let busy = e.draining || (r.max_seqs > 0 && r.running >= r.max_seqs);
            (busy || e.age_secs.is_some()).then_some((e.slot, r.compute.as_str(), busy))
        })
        .collect();
    let peers = holders.iter().fold(0u64, |m, (s, ..)| m | (1 << s));
    let matched = index.longest_tier_matches(req.hashes, mask | peers);
    // An engine that has not measured its speed yet is taken to be as fast as the median of
    // those that have (the configured prior only when none has).
    // Likewise for the time a fetch from a peer takes.
    let median = |rate: fn(&LoadReport) -> f64, prior: f64| {
        let measured = open
            .iter()
            .filter(|e| e.age_secs.is_some() && rate(e.report) > 0.0)
            .map(|e| rate(e.report))
            .collect();
        upper_median(measured).unwrap_or(prior)
    };
    let req = RouteRequest {
        prior_secs_per_token: median(|r| r.secs_per_token, req.prior_secs_per_token),
        // (Only where some engine has not measured its own: the median is for those.)
        prior_peer_secs_per_block: if open.iter().all(|e| e.report.peer_load_secs_per_block > 0.0) {
            req.prior_peer_secs_per_block
        } else {
            median(
                |r| r.peer_load_secs_per_block,
                req.prior_peer_secs_per_block,
            )
        },
        ..*req
    };
    let mut candidates: Vec<Candidate> = open
        .iter()
        .map(|e| e.candidate(matched[e.slot], &req))
        .collect();
    let prompt_blocks = req.prompt_tokens.div_ceil(req.block_size.max(1) as usize) as u64;
    for (c, e) in candidates.iter_mut().zip(&open) {
        let r = e.report;
        let own = r.compute.as_str();
        let cached = r.available_blocks.saturating_sub(r.free_blocks);
        let room = c.free_blocks
            >= prompt_blocks
                .saturating_sub(u64::from(c.matched_blocks))
                .saturating_add(cached);
        let best = holders
            .iter()
            .filter(|&&(s, compute, busy)| {
                s != c.slot && (busy || (room && (own.is_empty() || compute != own)))
            })
            .map(|&(s, ..)| matched[s].fast)
            .max()
            .unwrap_or(0);
        if best > c.matched_blocks {
            c.peer_blocks = best;
        }
    }
    // Engines that report the same compute share it: each one's count is all of theirs (every
    // engine's, routable or not: a draining one still computes), and each is priced at one
    // rate, the median of theirs (the slower of the middle two). They run at one speed, and
    // each one's fit of its own steps is bent by the others' work on the same cores: one read
    // a tenth of the others' rate, and would have drawn tenants away from the engines caching
    // their prefixes.
    for (c, e) in candidates.iter_mut().zip(&open) {
        let r = e.report;
        c.compute_inflight = c.inflight;
        if r.compute.is_empty() {
            continue;
        }
        let group = || engines.iter().filter(|o| o.report.compute == r.compute);
        c.compute_inflight = group()
            .fold(0u64, |sum, o| sum.saturating_add(o.inflight))
            .max(c.inflight);
        let rates: Vec<f64> = group()
            .map(|o| o.report.secs_per_token(req.prior_secs_per_token))
            .collect();
        let sharing = rates.len() > 1;
        if let Some(rate) = upper_median(rates) {
            c.secs_per_token = rate;
        }
        // Free blocks are no reason to recompute a prefix beside its holder on the same cores:
        // the prefill takes the compute the holder's queue waits for. Its blocks are counted
        // as evicting, wherever they land.
        if sharing {
            c.free_blocks = 0;
        }
    }
    // A peer's blocks count where fetching them costs less than computing them, at the rate
    // and beside the requests just worked out.
    for c in &mut candidates {
        if !c.fetch_pays(
            c.peer_blocks.saturating_sub(c.matched_blocks),
            req.block_size,
        ) {
            c.peer_blocks = 0;
        }
    }
    // Cached nowhere: where requests routed earlier and not ended compute the prompt's leading
    // blocks (a tenant's first request, still queued or in prefill at its home).
    if candidates.iter().all(|c| c.matched_blocks == 0) {
        let routed = index.longest_routed(req.hashes, mask);
        for c in &mut candidates {
            c.computing_blocks = routed[c.slot];
        }
    }
    candidates
}

/// An engine's load report and its age (see [`Engine::report`]).
pub type Report = (Arc<LoadReport>, Option<f64>);

/// In-flight counts an engine reports are capped here (a count past it is nonsense).
const MAX_REPORTED_INFLIGHT: u64 = 1 << 32;

/// What routing knows of one request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Its prompt's block hashes.
    pub hashes: &'a [kvgate_protocol::BlockHash],
    pub prompt_tokens: usize,
    /// Its tenant, as the engines name it.
    pub tenant: &'a str,
    pub block_size: u32,
    /// Seconds per prefill token of an engine that has not reported its own.
    pub prior_secs_per_token: f64,
    /// Seconds per block of a peer fetch by an engine that has not measured its own (0: the
    /// protocol's prior).
    pub prior_peer_secs_per_block: f64,
}

impl<'a> RouteRequest<'a> {
    pub fn new(
        hashes: &'a [kvgate_protocol::BlockHash],
        prompt_tokens: usize,
        tenant: &'a str,
        router: &RouterConfig,
    ) -> Self {
        RouteRequest {
            hashes,
            prompt_tokens,
            tenant,
            block_size: router.block_size,
            prior_secs_per_token: router.prior_secs_per_token,
            prior_peer_secs_per_block: 0.0,
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{Policy, Reason, Router};

    pub(super) fn config() -> RouterConfig {
        RouterConfig {
            policy: Policy::Prefix,
            load_factor: 1.25,
            block_size: 16,
            prior_secs_per_token: 0.001,
        }
    }

    pub(super) fn candidates(
        registry: &Registry,
        hashes: &[kvgate_protocol::BlockHash],
        tenant: &str,
    ) -> Vec<Candidate> {
        let req = RouteRequest::new(hashes, 270, tenant, &config());
        registry.candidates(&req, 0, now_ms()).0
    }

    /// `n` healthy engines, those in `cached` holding 16 blocks whose hashes it returns.
    pub(super) fn fleet(
        n: usize,
        cached: &[usize],
    ) -> (
        Arc<Registry>,
        Vec<Arc<Engine>>,
        Vec<kvgate_protocol::BlockHash>,
    ) {
        let registry = Registry::new();
        let engines: Vec<_> = (0..n)
            .map(|i| {
                let e = registry
                    .add(&format!("e{i}"), &format!("http://127.0.0.1:{}", 9000 + i))
                    .unwrap();
                e.up.store(true, Ordering::SeqCst);
                e
            })
            .collect();
        let hashes: Vec<_> = (0..16u128).map(kvgate_protocol::BlockHash).collect();
        {
            let mut index = registry.index.write().unwrap();
            for &i in cached {
                for h in &hashes {
                    index.insert(engines[i].slot, *h);
                }
            }
        }
        (Arc::new(registry), engines, hashes)
    }

    #[test]
    fn a_draining_engine_gets_nothing_new_however_much_it_caches() {
        let (registry, engines, hashes) = fleet(3, &[1]);
        let router = Router::new(config());
        let choose = || {
            router
                .choose(7, 270, 0, &candidates(&registry, &hashes, "t"))
                .unwrap()
        };
        assert_eq!(
            (choose().slot, choose().reason),
            (engines[1].slot, Reason::Prefix)
        );
        // Drained here, or by the engine itself: never a candidate.
        engines[1].draining.store(true, Ordering::SeqCst);
        assert_ne!(choose().slot, engines[1].slot);
        engines[1].draining.store(false, Ordering::SeqCst);
        engines[1].engine_draining.store(true, Ordering::SeqCst);
        let c = candidates(&registry, &hashes, "t");
        assert!(c.iter().all(|c| c.slot != engines[1].slot));
        assert_ne!(choose().slot, engines[1].slot);
    }

    #[test]
    fn engines_that_share_their_compute_are_counted_together() {
        let (registry, engines, hashes) = fleet(3, &[0]);
        let report = |compute: &str| LoadReport {
            max_seqs: 8,
            max_batched_tokens: 4096,
            available_blocks: 1000,
            free_blocks: 1000,
            secs_per_token: 0.001,
            compute: compute.to_owned(),
            ..LoadReport::default()
        };
        // Engine 0 caches the prefix and has 1 s of queue; 1 and 2 are idle, with 3 and 2 of
        // this gateway's requests still in flight on 0 and 2.
        engines[0].set_report(Some(LoadReport {
            pending_prefill_tokens: 1000,
            running_prefill_tokens: 1000,
            ..report("a")
        }));
        engines[1].set_report(Some(report("b")));
        engines[2].set_report(Some(report("c")));
        engines[0].inflight.store(3, Ordering::Relaxed);
        engines[2].inflight.store(2, Ordering::Relaxed);
        let router = Router::new(config());
        let choose = || {
            let c = candidates(&registry, &hashes, "t");
            (router.choose(7, 270, 0, &c).unwrap().slot, c)
        };
        // Each on its own compute: recomputing on the idle engine 1 (0.54 s) beats waiting
        // 1 s for the cached prefix.
        let (slot, c) = choose();
        assert_eq!(slot, engines[1].slot);
        assert_eq!(
            c.iter().map(|c| c.compute_inflight).collect::<Vec<_>>(),
            [3, 0, 2]
        );
        // On one machine's cores, each counts the requests of all three.
        for e in &engines[1..] {
            e.set_report(Some(report("a")));
        }
        engines[0].set_report(Some(LoadReport {
            pending_prefill_tokens: 1000,
            running_prefill_tokens: 1000,
            ..report("a")
        }));
        let (slot, c) = choose();
        assert!(c.iter().all(|c| c.compute_inflight == 5), "{c:?}");
        // Engine 1's prefill would slow every request of the three, and engine 0, 1 s into a
        // step, cannot be counted on to send the blocks in time: the tenant stays.
        assert_eq!((slot, c[1].peer_blocks), (engines[0].slot, 0), "{c:?}");
        // With engine 0's queue made of short steps (0.3 s of prefill pending, 0.9 s of
        // waiting), engine 1 fetches the 16 blocks (0.29 s) instead: a transfer costs the
        // shared compute nothing.
        engines[0].set_report(Some(LoadReport {
            pending_prefill_tokens: 300,
            running_prefill_tokens: 300,
            next_finish_secs: 0.6,
            running: 8,
            ..report("a")
        }));
        let (slot, c) = choose();
        assert_eq!((slot, c[1].peer_blocks), (engines[1].slot, 16), "{c:?}");
    }

    #[test]
    fn fetches_are_priced_at_each_engines_measured_rate() {
        let (registry, engines, hashes) = fleet(4, &[0]);
        let rates = || {
            candidates(&registry, &hashes, "t")
                .iter()
                .map(|c| c.peer_secs_per_block)
                .collect::<Vec<_>>()
        };
        // Nothing measured: the protocol's prior (0).
        assert_eq!(rates(), [0.0; 4]);
        // Each engine that has fetched is priced at its own rate; one that has not, at the
        // median of theirs; a rate that is nonsense reads as unmeasured.
        let measured = [0.03, 0.0, 0.01, f64::NAN];
        for (e, &rate) in engines.iter().zip(&measured) {
            e.set_report(Some(LoadReport {
                peer_load_secs_per_block: rate,
                ..LoadReport::default()
            }));
        }
        assert_eq!(rates(), [0.03, 0.03, 0.01, 0.03]);
        let c = candidates(&registry, &hashes, "t");
        assert_eq!(c[2].fetch_secs(16), 17.0 * 0.01);
    }

    #[test]
    fn engines_that_share_their_compute_are_priced_at_one_rate() {
        let (registry, engines, hashes) = fleet(3, &[0]);
        let report = |compute: &str, secs_per_token: f64| LoadReport {
            max_seqs: 8,
            max_batched_tokens: 4096,
            available_blocks: 1000,
            free_blocks: 1000,
            secs_per_token,
            compute: compute.to_owned(),
            ..LoadReport::default()
        };
        // Engine 0 caches the prefix and has 300 tokens of prefill queued at 4.4 ms a token
        // (1.32 s); engine 1 reads ten times faster (0.4 ms), engine 2 3.2 ms.
        let set = |computes: [&str; 3]| {
            engines[0].set_report(Some(LoadReport {
                pending_prefill_tokens: 300,
                running_prefill_tokens: 300,
                ..report(computes[0], 0.0044)
            }));
            engines[1].set_report(Some(report(computes[1], 0.0004)));
            engines[2].set_report(Some(report(computes[2], 0.0032)));
        };
        let router = Router::new(config());
        let choose = || {
            let c = candidates(&registry, &hashes, "t");
            (router.choose(7, 270, 0, &c).unwrap().slot, c)
        };
        let rates = |c: &[Candidate]| c.iter().map(|c| c.secs_per_token).collect::<Vec<_>>();
        // Each on its own compute, engine 1 is as fast as it reads: recomputing the prompt
        // there (0.11 s, into free blocks) beats the queue.
        set(["a", "b", "c"]);
        let (slot, c) = choose();
        assert_eq!(rates(&c), [0.0044, 0.0004, 0.0032]);
        assert_eq!(slot, engines[1].slot);
        // On one machine's cores, its reading is noise bent by the others' work: all three are
        // priced at the median, 3.2 ms, and recomputing there (1.73 s) costs more than waiting
        // for the cached prefix.
        set(["a", "a", "a"]);
        let (slot, c) = choose();
        assert_eq!(rates(&c), [0.0032; 3]);
        assert_eq!(slot, engines[0].slot);
    }

    #[test]
    fn candidates_know_what_a_peer_could_send_them() {
        let (registry, engines, hashes) = fleet(3, &[0]);
        let peers = |c: &[Candidate]| c.iter().map(|c| c.peer_blocks).collect::<Vec<_>>();
        // Engine 0 holds the 16 blocks and has not reported: no one counts on fetching from it.
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 0, 0]);
        let on = |compute: &str, pending: u64, free_blocks: u64| LoadReport {
            available_blocks: free_blocks + 10,
            max_seqs: 8,
            running: 2,
            pending_prefill_tokens: pending,
            running_prefill_tokens: pending,
            compute: compute.to_owned(),
            free_blocks,
            ..LoadReport::default()
        };
        // Engine 0 reports; the others have not, so their free blocks are unknown: no one.
        engines[0].set_report(Some(on("a", 200, 100)));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 0, 0]);
        // Engines on other compute whose pools have room count on it, prefill pending or not
        // (it answers between the layers of its steps); not one on its own cores.
        engines[1].set_report(Some(on("b", 0, 100)));
        engines[2].set_report(Some(on("a", 0, 100)));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 16, 0]);
        // Nor one whose free blocks do not hold the request and as much again as its pool
        // caches (10 blocks here): the 17-block copy needs 27.
        engines[1].set_report(Some(on("b", 0, 26)));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 0, 0]);
        engines[1].set_report(Some(on("b", 0, 27)));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 16, 0]);
        engines[1].set_report(Some(on("b", 0, 15)));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 0, 0]);
        for e in &engines {
            e.set_report(None);
        }
        // With its batch full, the others could fetch them; engine 0 needs nothing.
        engines[0].set_report(Some(LoadReport {
            max_seqs: 8,
            running: 8,
            ..LoadReport::default()
        }));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 16, 16]);
        engines[0].set_report(None);
        // Draining, engine 0 takes nothing new but still sends what it holds.
        engines[0].draining.store(true, Ordering::SeqCst);
        let c = candidates(&registry, &hashes, "t");
        assert_eq!(
            (c.iter().map(|c| c.slot).collect::<Vec<_>>(), peers(&c)),
            (vec![engines[1].slot, engines[2].slot], vec![16, 16])
        );
        // Three blocks more are worth a transfer where they would be computed at the prior
        // rate: 48 tokens' prefill (0.048 s) against four blocks' transfer time (0.008 s).
        for h in &hashes[..13] {
            registry.index.write().unwrap().insert(engines[1].slot, *h);
        }
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [16, 16]);
        // Where computing a block is cheaper than sending it (10 us a token: 0.48 ms for the
        // three blocks, against 8 ms), the three are computed; the sixteen engine 2 lacks are
        // still fetched (PEER_MIN_GAIN_BLOCKS or more: the transfer spares its compute).
        engines[1].set_report(Some(LoadReport {
            secs_per_token: 1e-5,
            ..LoadReport::default()
        }));
        assert_eq!(peers(&candidates(&registry, &hashes, "t")), [0, 16]);
    }

    #[test]
    fn a_tenant_that_floods_its_engine_spills_and_the_others_stay() {
        let (registry, engines, hashes) = fleet(2, &[0]);
        for e in &engines {
            e.set_report(Some(LoadReport {
                max_seqs: 8,
                max_batched_tokens: 4096,
                available_blocks: 1000,
                free_blocks: 1000,
                secs_per_token: 0.001,
                ..LoadReport::default()
            }));
        }
        // Engine 0 has 3,000 tokens of "hot"'s requests waiting.
        engines[0].set_report(Some(LoadReport {
            pending_prefill_tokens: 3000,
            waiting_by_tenant: [("hot".to_owned(), 3000)].into(),
            ..(*engines[1].report().0).clone()
        }));
        let router = Router::new(config());
        let choose = |tenant| {
            router
                .choose(7, 270, 0, &candidates(&registry, &hashes, tenant))
                .unwrap()
        };
        // "calm" waits for its share only (14 tokens): it stays with its cached prefix.
        assert_eq!(
            (choose("calm").slot, choose("calm").reason),
            (engines[0].slot, Reason::Prefix)
        );
        // "hot" waits behind its own 3 s: recomputing on the idle engine is cheaper.
        assert_eq!(
            (choose("hot").slot, choose("hot").reason),
            (engines[1].slot, Reason::LeastLoaded)
        );
    }

    #[test]
    fn a_candidate_waits_for_what_its_engine_reports_and_what_this_gateway_queued() {
        let registry = Registry::new();
        let e = registry.add("e0", "http://127.0.0.1:9000").unwrap();
        e.up.store(true, Ordering::SeqCst);
        let one = |tenant: &str| candidates(&registry, &[], tenant)[0];
        let c = one("t");
        assert_eq!((c.wait_secs, c.secs_per_token, c.inflight), (0.0, 0.001, 0));
        // Queued here and not yet started: 500 tokens at the prior speed.
        e.queued_prefill.store(500, Ordering::Relaxed);
        e.inflight.store(2, Ordering::Relaxed);
        let c = one("t");
        assert!((c.wait_secs - 0.5).abs() < 1e-9 && c.inflight == 2);
        // The engine's own report: its measured speed, its longer queue, its in-flight count.
        e.set_report(Some(LoadReport {
            pending_prefill_tokens: 2000,
            running_prefill_tokens: 1000,
            waiting_by_tenant: [("flood".to_owned(), 1000)].into(),
            max_seqs: 8,
            max_batched_tokens: 4096,
            available_blocks: 100,
            free_blocks: 40,
            secs_per_token: 0.002,
            ..LoadReport::default()
        }));
        // Five in flight there, two of them this gateway's: three are other gateways'.
        e.set_engine_inflight(5);
        let c = one("flood");
        assert!((c.wait_secs - 4.0).abs() < 1e-3, "{}", c.wait_secs);
        assert_eq!((c.secs_per_token, c.inflight, c.max_seqs), (0.002, 5, 8));
        // Another tenant waits for the running prefills and its share of the flood only.
        let c = one("other");
        assert!(
            (c.wait_secs - 0.002 * (1000.0 + 270.0)).abs() < 1e-3,
            "{}",
            c.wait_secs
        );
        // This gateway's requests end: the others' three remain until the next report.
        e.inflight.store(0, Ordering::Relaxed);
        assert_eq!(one("t").inflight, 3);
        // An engine without a report is taken at the speed the others measured.
        let fresh = registry.add("e1", "http://127.0.0.1:9001").unwrap();
        fresh.up.store(true, Ordering::SeqCst);
        let c = candidates(&registry, &[], "t");
        assert!(c.iter().all(|c| c.secs_per_token == 0.002), "{c:?}");
        // A nonsense in-flight count saturates instead of overflowing.
        e.set_engine_inflight(u64::MAX);
        e.inflight.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(one("t").inflight, u64::MAX);
        let _ = Router::new(config()).choose(1, 270, 0, &candidates(&registry, &[], "t"));
        // An unreadable report is forgotten, not kept as the figures of an idle engine.
        e.set_report(None);
        assert!(e.report().1.is_none());
        assert_eq!(one("t").max_seqs, 0);
    }
}

//! What a request holds while it runs, each released by `Drop` so that no way of ending (done,
//! failed, timed out, its client gone before the first byte or mid-stream, its future dropped)
//! can leak it:
//! - [`Lease`]: the tenant's concurrency slot and the tokens still to charge to tokens/min;
//!   renewed while the request lives, released (with the charge) when it ends; held from the
//!   moment the store is asked for it ([`Admitting`]), so a request dropped while its admission
//!   is on the wire releases what the store took;
//! - [`EngineLoad`]: the engine's in-flight count and queued prefill tokens, the load routing
//!   and `drain --wait` read;
//! - [`Outcome`]: the request's status and duration in the metrics (499 when the client left
//!   before an answer), and, once it was admitted, its record in the usage ledger.

use crate::state::{Gateway, InFlight};
use crate::tenant::RateLimits;
use crate::upstream::{now_ms, Engine, RoutedPrompt};
use crate::usage::{self, Ending, Prices, UsageRecord};
use kvgate_http::trace::{Attr, Trace};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a concurrency lease lasts unless renewed: a crashed gateway's slots come back
/// within this.
pub const LEASE: Duration = Duration::from_secs(60);
/// How often a live request renews its lease.
const RENEW_EVERY: Duration = Duration::from_secs(20);
/// How soon a failed renewal is tried again (instead of at the next [`RENEW_EVERY`]): a lease
/// survives two missed renewals only if the third comes well before it lapses.
const RENEW_RETRY: Duration = Duration::from_secs(2);
/// The first pause before a failed release is tried again; each pause doubles, up to
/// [`RELEASE_RETRY_MAX`], until the lease would have lapsed anyway ([`LEASE`]). A release cut
/// off by a reconnection or an outage of the store goes through once the store is back instead
/// of holding the tenant's slot for the rest of the lease. A try whose answer was lost may have
/// charged its tokens already, so a retry can charge them twice: it errs toward charging, never
/// toward a free request.
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(100);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(5);

/// The status recorded for a request whose client left before it was answered (as nginx does).
pub const CLIENT_CLOSED: u16 = 499;

static NEXT_LEASE: AtomicU64 = AtomicU64::new(0);

/// A fresh lease id: random per process, counted within it. Never the client's request id,
/// which a client could repeat to hold one slot for many requests.
fn lease_id() -> String {
    static PREFIX: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let p = PREFIX.get_or_init(rand::random::<u64>);
    format!("{p:016x}{:x}", NEXT_LEASE.fetch_add(1, Ordering::Relaxed))
}

/// A tenant's admitted request. Dropping it frees the concurrency slot and charges the tokens
/// generated (the prompt's were charged at admission), in every bucket that admitted it (the
/// tenant's, and its key's own when the key has limits).
#[derive(Debug)]
pub struct Lease {
    gw: Arc<Gateway>,
    /// Rate-limit buckets and their limits.
    buckets: Arc<[(String, RateLimits)]>,
    id: Arc<str>,
    /// Tokens to charge on release.
    owed: u64,
    renewer: Option<tokio::task::JoinHandle<()>>,
    /// The release has started (it runs once, however the lease ends).
    released: bool,
}

impl Lease {
    /// Holds a lease admitted by `buckets`, renewing it while the request lives in those that
    /// count it against a concurrency limit.
    fn held(gw: &Arc<Gateway>, buckets: Vec<(String, RateLimits)>, id: Arc<str>) -> Lease {
        let buckets: Arc<[(String, RateLimits)]> = buckets.into();
        let counted = buckets.iter().any(|(_, l)| l.max_concurrent.is_some());
        let renewer = counted.then(|| {
            let (gw, buckets, id) = (gw.clone(), buckets.clone(), id.clone());
            tokio::spawn(async move {
                let mut wait = RENEW_EVERY;
                loop {
                    tokio::time::sleep(wait).await;
                    wait = RENEW_EVERY;
                    let ms = LEASE.as_millis() as u64;
                    for (bucket, _) in buckets.iter().filter(|(_, l)| l.max_concurrent.is_some()) {
                        if let Err(e) = gw.store.renew(bucket, &id, ms).await {
                            gw.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "lease renewal failed");
                            wait = RENEW_RETRY;
                        }
                    }
                }
            })
        });
        let mut lease = Lease::unrenewed(gw, buckets, id);
        lease.renewer = renewer;
        lease
    }

    /// A lease of `buckets` that nothing renews (released when dropped).
    fn unrenewed(gw: &Arc<Gateway>, buckets: Arc<[(String, RateLimits)]>, id: Arc<str>) -> Lease {
        Lease {
            gw: gw.clone(),
            buckets,
            id,
            owed: 0,
            renewer: None,
            released: false,
        }
    }

    /// Adds tokens to charge when the lease is released.
    pub fn charge(&mut self, tokens: u64) {
        self.owed = self.owed.saturating_add(tokens);
    }
}

impl Lease {
    /// Releases the lease and waits until the store has it back, so that the tenant's next
    /// request, sent once this one's answer arrives, finds its slot free. Waits for the first
    /// try only: retries after a failure go on in the background. A release cut short (the
    /// caller dropped) still completes in the background.
    pub async fn release(mut self) {
        if let Some(tried) = self.start_release() {
            let _ = tried.await;
        }
    }

    /// Starts the release, once: on the gateway's own runtime, which outlives the API threads,
    /// so a release started as an API thread stops still runs. (Once that runtime is gone, the
    /// lease lapses on its own.) The answer comes once every bucket has been tried once.
    fn start_release(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        if std::mem::replace(&mut self.released, true) {
            return None;
        }
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        let (gw, buckets, id) = (self.gw.clone(), self.buckets.clone(), self.id.clone());
        let owed = self.owed;
        // Counted in `pending_releases` (which a graceful stop waits on) from now, not from when
        // the task first runs, so a stop that begins in between still waits for it; uncounted
        // when the task ends or is dropped unfinished.
        let pending = InFlight::start(&gw.pending_releases);
        let (tried, answer) = tokio::sync::oneshot::channel();
        self.gw.background.spawn(async move {
            let _pending = pending;
            let release = |i: usize| {
                let (bucket, limits) = &buckets[i];
                gw.store.release(bucket, *limits, &id, owed)
            };
            // Every bucket is tried, then those that failed again after each pause; the
            // caller hears once every bucket has had its first try.
            let mut tried = Some(tried);
            let mut failed: Vec<usize> = (0..buckets.len()).collect();
            let lapses = tokio::time::Instant::now() + LEASE;
            let mut pause = RELEASE_RETRY_FIRST;
            loop {
                let mut still = Vec::new();
                for i in failed {
                    if release(i).await.is_err() {
                        still.push(i);
                    }
                }
                failed = still;
                if let Some(t) = tried.take() {
                    let _ = t.send(());
                }
                if failed.is_empty() {
                    break;
                }
                gw.metrics
                    .store_errors
                    .fetch_add(failed.len() as u64, Ordering::Relaxed);
                if tokio::time::Instant::now() + pause > lapses {
                    tracing::warn!(
                        buckets = failed.len(),
                        "rate-limit release failed until its lease lapsed"
                    );
                    break;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RELEASE_RETRY_MAX);
            }
        });
        Some(answer)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.start_release();
    }
}

/// A lease while the store is asked to admit it, bucket by bucket. A bucket holds the lease
/// from the moment it is asked: the store may take it though its answer never arrives (the
/// client left, the request's deadline passed, the call timed out). Dropped before
/// [`Admitting::admitted`], it releases every bucket asked and not refused.
#[derive(Debug)]
pub struct Admitting {
    gw: Arc<Gateway>,
    id: Arc<str>,
    buckets: Vec<(String, RateLimits)>,
}

impl Admitting {
    pub fn new(gw: &Arc<Gateway>) -> Admitting {
        Admitting {
            gw: gw.clone(),
            id: Arc::from(lease_id()),
            buckets: Vec::new(),
        }
    }

    /// The lease id to ask `bucket` for; from now on `bucket` is released with the rest.
    pub fn ask(&mut self, bucket: &str, limits: RateLimits) -> &str {
        self.buckets.push((bucket.to_owned(), limits));
        &self.id
    }

    /// The bucket asked last refused: it holds nothing to release.
    pub fn refused(&mut self) {
        self.buckets.pop();
    }

    /// Every bucket admitted the request: the lease, renewed while it lives.
    pub fn admitted(mut self) -> Lease {
        let buckets = std::mem::take(&mut self.buckets);
        Lease::held(&self.gw, buckets, self.id.clone())
    }
}

impl Drop for Admitting {
    fn drop(&mut self) {
        if !self.buckets.is_empty() {
            let buckets = std::mem::take(&mut self.buckets);
            drop(Lease::unrenewed(&self.gw, buckets.into(), self.id.clone()));
        }
    }
}

/// A request's share of an engine's load, counted from routing until its answer is over, and
/// its prompt's blocks, counted as routed there for as long.
#[derive(Debug)]
pub struct EngineLoad {
    engine: Arc<Engine>,
    /// Prompt tokens counted in `queued_prefill` until the engine starts answering.
    prefill: u64,
    /// The prompt's blocks, counted as routed to the engine while the request is there (not
    /// for a request told to fetch them from a peer: until its fetch ends it computes none).
    _routed: Option<RoutedPrompt>,
}

impl EngineLoad {
    pub fn enter(engine: &Arc<Engine>, prefill: u64, routed: Option<RoutedPrompt>) -> EngineLoad {
        engine.inflight.fetch_add(1, Ordering::SeqCst);
        engine.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        EngineLoad {
            engine: engine.clone(),
            prefill,
            _routed: routed,
        }
    }

    /// The engine answered: its prefill is no longer queued.
    pub fn started(&mut self) {
        let n = std::mem::take(&mut self.prefill);
        self.engine.queued_prefill.fetch_sub(n, Ordering::Relaxed);
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
}

impl Drop for EngineLoad {
    fn drop(&mut self) {
        self.started();
        self.engine.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An admitted request's usage so far: what its ledger record will say.
#[derive(Debug, Clone)]
pub struct Billed {
    pub request_id: String,
    pub key_id: String,
    /// The key's rotation chain, when the key is not its first.
    pub key_lineage: Option<String>,
    pub model: String,
    pub prices: Prices,
    pub engine: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    pub finish_reason: Option<String>,
    /// When the first token (or the whole answer) went out.
    pub first_token: Option<Instant>,
    /// The answer started but the engine broke it off.
    pub broken: bool,
}

/// A request's line in the metrics and, once admitted, in the usage ledger, written when it is
/// dropped.
#[derive(Debug)]
pub struct Outcome {
    gw: Arc<Gateway>,
    tenant: Arc<str>,
    start: Instant,
    /// The answer's status; `None` until there is one.
    pub status: Option<u16>,
    /// The ledger's record, from admission on.
    pub billed: Option<Billed>,
    /// The request's trace, when it is traced: its root span ends with this line.
    pub trace: Option<Arc<Trace>>,
    /// Whether dropping this one writes the line (a moved-out original does not).
    armed: bool,
}

impl Outcome {
    pub fn new(gw: &Arc<Gateway>, tenant: &str, start: Instant) -> Outcome {
        Outcome {
            gw: gw.clone(),
            tenant: Arc::from(tenant),
            start,
            status: None,
            billed: None,
            trace: None,
            armed: true,
        }
    }

    /// Moves the line into a new guard (one that goes with a streamed body); this one then
    /// records nothing.
    pub fn take(&mut self) -> Outcome {
        self.armed = false;
        Outcome {
            gw: self.gw.clone(),
            tenant: self.tenant.clone(),
            start: self.start,
            status: self.status,
            billed: self.billed.take(),
            trace: self.trace.take(),
            armed: true,
        }
    }

    /// The ledger record of a request that ends now with `status`.
    fn record(&self, b: Billed, status: u16) -> UsageRecord {
        let ending = if status == CLIENT_CLOSED {
            Ending::Cancelled
        } else if (200..300).contains(&status) && !b.broken {
            Ending::Completed
        } else {
            Ending::Failed
        };
        let ms = |d: Duration| d.as_millis().min(u128::from(u64::MAX)) as u64;
        UsageRecord {
            id: usage::record_id(),
            request_id: b.request_id,
            tenant: self.tenant.to_string(),
            key_id: b.key_id,
            key_lineage: b.key_lineage,
            cost_micros: b.prices.cost_micros(
                b.prompt_tokens,
                b.cached_tokens,
                b.completion_tokens,
            ),
            model: b.model,
            engine: b.engine,
            prompt_tokens: b.prompt_tokens,
            cached_tokens: b.cached_tokens.min(b.prompt_tokens),
            completion_tokens: b.completion_tokens,
            status,
            ending,
            finish_reason: b.finish_reason,
            ttft_ms: b.first_token.map(|t| ms(t.duration_since(self.start))),
            duration_ms: ms(self.start.elapsed()),
            at_ms: now_ms(),
        }
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let status = self.status.unwrap_or(CLIENT_CLOSED);
        let m = &self.gw.metrics;
        m.request(&self.tenant, status);
        m.request_duration
            .observe(self.start.elapsed().as_secs_f64());
        if let Some(t) = self.trace.take() {
            crate::service::trace_status(&t, status);
            if let Some(b) = &self.billed {
                if let Some(engine) = &b.engine {
                    t.set(Attr::new("kvgate.engine", engine.clone()));
                }
                for (key, n) in [
                    ("kvgate.prompt_tokens", b.prompt_tokens),
                    ("kvgate.cached_tokens", b.cached_tokens),
                    ("kvgate.completion_tokens", b.completion_tokens),
                ] {
                    t.set(Attr::new(key, n.min(i64::MAX as u64) as i64));
                }
            }
        }
        if let Some(b) = self.billed.take() {
            let record = self.record(b, status);
            self.gw.ledger.push(record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A release whose task is cancelled before the store answers is uncounted all the same, so
    /// a graceful stop never waits for it.
    #[tokio::test]
    async fn a_cancelled_release_is_uncounted() {
        let count = Arc::new(AtomicUsize::new(0));
        let pending = InFlight::start(&count);
        let done = InFlight::start(&count);
        assert_eq!(count.load(Ordering::SeqCst), 2);
        let stuck = tokio::spawn(async move {
            let _pending = pending;
            std::future::pending::<()>().await;
        });
        tokio::spawn(async move { drop(done) }).await.unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 1);
        stuck.abort();
        assert!(stuck.await.unwrap_err().is_cancelled());
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }
}

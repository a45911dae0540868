//! The gateway's shared state and its start-up: engines from config and store, their health and
//! KV-event tasks, the registry sync between replicas. Handlers ([`crate::api`],
//! [`crate::admin`]) and the tower stack ([`crate::service`]) read it; [`crate::server`] serves it.

use crate::auth::{Auth, Operators};
use crate::config::GatewayConfig;
use crate::metrics::Metrics;
use crate::routing::prefix::PromptHasher;
use crate::routing::{Router, RouterConfig};
use crate::store::{Store, StoreError};
use crate::tenant::{generate_key, unix_now, EngineRecord, KeyRecord, KeySpec};
use crate::upstream::{self, events, health, Engine, HttpClient, Registry, RegistryError};
use crate::usage::Ledger;
use kvgate_protocol::prompt::PromptRenderer;
use kvgate_protocol::{BlockHasher, HashParams};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Weak;
use std::time::Duration;

/// Everything the handlers share.
#[derive(Debug)]
pub struct Gateway {
    pub config: GatewayConfig,
    pub store: Arc<dyn Store>,
    pub registry: Arc<Registry>,
    pub router: Router,
    pub hasher: PromptHasher,
    pub auth: Auth,
    pub metrics: Metrics,
    pub client: HttpClient,
    pub engine_token: Option<Arc<str>>,
    /// Most bytes of prompt text a request may carry (see [`max_prompt_bytes`]).
    pub max_prompt_bytes: usize,
    /// The runtime the gateway started on, which runs its background work (health checks, KV
    /// events, store follow-ups such as rate-limit releases) whatever thread a request is on.
    pub background: tokio::runtime::Handle,
    /// Rate-limit releases on their way to the store: stopping waits for them, so a request
    /// answered before a graceful stop is charged and its slot given back.
    pub pending_releases: Arc<std::sync::atomic::AtomicUsize>,
    /// Usage records on their way to the store (a graceful stop waits for them too).
    pub ledger: Arc<Ledger>,
    /// Named operator tokens, verified against the store (the admin API's callers).
    pub operators: Operators,
    /// Budget thresholds this process has announced (tenant or key, month, percent), so each
    /// is logged and counted once.
    pub budget_alerts: std::sync::Mutex<std::collections::HashSet<(String, String, u8)>>,
    /// Each request's spans, exported over OTLP when `[tracing]` names an endpoint.
    pub tracer: kvgate_http::trace::Tracer,
    /// Set when a graceful stop begins: `/health` answers 503 and each answer closes its
    /// connection, through the stop's grace.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
    /// Admin actions running (each runs to its end even when its caller hangs up): a stop
    /// waits for them.
    pub admin_actions: Arc<std::sync::atomic::AtomicUsize>,
}

/// One piece of work a graceful stop waits for (a rate-limit release, an admin action),
/// counted from [`InFlight::start`] until dropped: done, failed, or its task cancelled.
#[derive(Debug)]
pub struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl InFlight {
    pub fn start(count: &Arc<std::sync::atomic::AtomicUsize>) -> InFlight {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("engines: {0}")]
    Registry(#[from] RegistryError),
    #[error("config: {0}")]
    Config(String),
}

/// Least time a stop gives the last traces' export, whatever the settling before it took.
const TRACE_FLUSH_MIN: std::time::Duration = std::time::Duration::from_secs(2);

impl Gateway {
    /// Builds the gateway and starts following every engine in the config and the store.
    /// Must run inside a tokio runtime.
    pub async fn start(
        config: GatewayConfig,
        store: Arc<dyn Store>,
        renderer: Arc<PromptRenderer>,
    ) -> Result<Arc<Gateway>, StartError> {
        config.validate().map_err(StartError::Config)?;
        let pepper = config.pepper.clone().ok_or_else(|| {
            StartError::Config("pepper: required (or KVGATE_PEPPER), 16+ characters".into())
        })?;
        let hasher = BlockHasher::new(&HashParams {
            model_id: config.model_id.clone(),
            weight_version: "1".into(),
            kv_dtype: config.kv_dtype.clone(),
            block_size: config.block_size,
            seed: config.seed(),
        });
        if config.engine_token.is_none() {
            tracing::warn!(
                "no engine_token (KVGATE_ENGINE_TOKEN): engines ignore the tenant and scope \
                 headers of an unauthenticated gateway, so every tenant shares one cache scope"
            );
        }
        let policy = config.routing.policy;
        let tracer = kvgate_http::trace::Tracer::start(&config.tracing, "kvgate-gateway")
            .map_err(StartError::Config)?;
        let gw = Arc::new(Gateway {
            tracer,
            router: Router::new(RouterConfig {
                policy,
                load_factor: config.routing.load_factor,
                block_size: config.block_size,
                prior_secs_per_token: 1.0 / config.routing.prefill_tokens_per_sec,
            }),
            max_prompt_bytes: max_prompt_bytes(&renderer, config.context_tokens()),
            background: tokio::runtime::Handle::current(),
            pending_releases: Arc::default(),
            stopping: Arc::default(),
            admin_actions: Arc::default(),
            ledger: Arc::default(),
            operators: Operators::new(store.clone(), &pepper, config.operator_token.clone()),
            budget_alerts: Default::default(),
            hasher: PromptHasher::new(renderer, hasher),
            auth: Auth::new(
                store.clone(),
                &pepper,
                Duration::from_secs(config.key_cache_ttl_secs),
            ),
            engine_token: config.engine_token.as_deref().map(Arc::from),
            registry: Arc::new(Registry::new()),
            metrics: Metrics::default(),
            client: upstream::http_client(),
            store,
            config,
        });
        for e in gw.config.engines.clone() {
            gw.follow_engine(&e.name, &e.url)?;
        }
        for e in gw.store.list_engines().await? {
            if gw.registry.get(&e.name).is_none() {
                gw.follow_engine(&e.name, &e.url)?;
            }
        }
        if gw.config.redis.is_some() {
            tokio::spawn(sync_engines(Arc::downgrade(&gw)));
        }
        tokio::spawn(write_ledger(Arc::downgrade(&gw), gw.ledger.clone()));
        let weak = Arc::downgrade(&gw);
        gw.store
            .follow_tenant_changes(Arc::new(move |tenant: Option<&str>| {
                let Some(gw) = weak.upgrade() else {
                    return false;
                };
                match tenant {
                    Some(crate::auth::OPERATOR_TOKENS_CHANGED) => gw.operators.invalidate(),
                    Some(t) => gw.auth.invalidate_tenant(t),
                    None => {
                        gw.auth.invalidate_all();
                        gw.operators.invalidate();
                    }
                }
                true
            }));
        // First health round now, so the gateway routes as soon as it listens.
        let first =
            gw.registry
                .all()
                .into_iter()
                .map(|e| {
                    let gw = gw.clone();
                    async move {
                        health::check(&e, &gw.client, gw.config.operator_token.as_deref()).await
                    }
                })
                .collect::<Vec<_>>();
        for f in first {
            f.await;
        }
        Ok(gw)
    }

    /// Adds an engine to this process's registry and starts its health and event tasks.
    pub fn follow_engine(&self, name: &str, url: &str) -> Result<Arc<Engine>, RegistryError> {
        let engine = self.registry.add(name, url)?;
        tokio::spawn(health::watch(
            engine.clone(),
            self.client.clone(),
            self.config.operator_token.clone(),
        ));
        tokio::spawn(events::follow(
            engine.clone(),
            self.registry.clone(),
            self.client.clone(),
            self.config.engine_token.clone(),
        ));
        Ok(engine)
    }

    /// Adds an engine and persists it, so every replica (and this one after a restart) has it.
    pub async fn add_engine(&self, name: &str, url: &str) -> Result<Arc<Engine>, String> {
        if name.is_empty() || !url.starts_with("http://") {
            return Err("an engine needs a name and an http:// url".into());
        }
        if self.registry.get(name).is_some() {
            return Err(RegistryError::Exists(name.to_owned()).to_string());
        }
        // Stored first: the registry sync never sees it here but missing from the store.
        let rec = EngineRecord {
            name: name.to_owned(),
            url: url.to_owned(),
            added_at: unix_now(),
        };
        self.store
            .put_engine(&rec)
            .await
            .map_err(|e| e.to_string())?;
        let engine = self.follow_engine(name, url).map_err(|e| e.to_string())?;
        health::check(&engine, &self.client, self.config.operator_token.as_deref()).await;
        Ok(engine)
    }

    /// Issues a new API key for `tenant` (which must exist) as `spec` describes it: returns the
    /// key, to be shown once, and the stored record (its hash only).
    pub async fn issue_key(
        &self,
        tenant: &str,
        spec: &KeySpec,
    ) -> Result<(String, KeyRecord), StoreError> {
        let key = generate_key();
        let mut rec = KeyRecord::new(tenant, self.auth.hash(&key), &key[..8]);
        spec.apply(&mut rec);
        self.store.put_key(&rec).await?;
        Ok((key, rec))
    }

    /// Removes an engine from this process and the store.
    pub async fn remove_engine(&self, name: &str) -> Result<bool, StoreError> {
        let stored = self.store.remove_engine(name).await?;
        let here = self.registry.remove(name).is_some();
        self.metrics.forget_engine(name);
        self.router.forget_homes();
        Ok(here || stored)
    }

    /// Waits up to `limit` for the admin actions still running (their callers may have hung
    /// up), then for the rate-limit releases and the usage records still on their way to the
    /// store (at a stop), and logs what did not finish; then sends the last traces to the
    /// collector.
    pub async fn settle(&self, limit: std::time::Duration) {
        use std::sync::atomic::Ordering::SeqCst;
        let deadline = tokio::time::Instant::now() + limit;
        let releases = || self.pending_releases.load(SeqCst);
        let actions = || self.admin_actions.load(SeqCst);
        while (actions() > 0 || releases() > 0 || self.ledger.pending() > 0)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        if actions() > 0 {
            tracing::warn!(
                actions = actions(),
                "admin actions still running at the stop; they and their audit entries are cut"
            );
        }
        if releases() > 0 {
            tracing::warn!(
                releases = releases(),
                "rate-limit releases not done before the stop; their leases will lapse"
            );
        }
        if self.ledger.pending() > 0 {
            tracing::error!(
                records = self.ledger.pending(),
                "usage records not written before the stop; they are lost"
            );
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if !self.tracer.flush(left.max(TRACE_FLUSH_MIN)).await {
            tracing::warn!("the last traces were not exported before the stop");
        }
    }

    /// Notes how much of a budget is used (`budget`: `tenant` or `key:{id}`) and announces,
    /// once per process and month, that it crossed 80% or 100%.
    pub fn budget_used(&self, tenant: &str, budget: &str, month: &str, ratio: f64) {
        self.metrics.budget_used(tenant, budget, ratio);
        for percent in [80u8, 100] {
            if ratio * 100.0 < f64::from(percent) {
                continue;
            }
            let first = self
                .budget_alerts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((format!("{tenant}/{budget}"), month.to_owned(), percent));
            if first {
                self.metrics.budget_alert(tenant, budget, percent);
                tracing::warn!(
                    tenant,
                    budget,
                    percent,
                    month,
                    "monthly budget threshold reached"
                );
            }
        }
    }

    /// Stops following every engine (health checks, KV event streams), for shutdown: an engine
    /// shutting down gracefully waits for the event stream's connection to close.
    pub fn stop_following(&self) {
        for e in self.registry.all() {
            self.registry.remove(&e.name);
        }
    }
}

/// The most prompt text, in bytes, that can fit in `context_tokens`: every token at the
/// vocabulary's longest. Anything longer is refused before the tokenizer sees it, so a huge
/// prompt costs a length check, not seconds of tokenizing.
pub fn max_prompt_bytes(renderer: &PromptRenderer, context_tokens: usize) -> usize {
    let longest = (0..renderer.vocab_size() as u32)
        .filter_map(|id| renderer.decode(&[id]).ok())
        .map(|t| t.len())
        .max()
        .unwrap_or(16)
        .max(1);
    context_tokens.saturating_mul(longest)
}

/// How often a gateway re-reads the engine registry from the store, so engines added or removed
/// through any replica reach every replica.
const REGISTRY_SYNC: Duration = Duration::from_secs(5);

/// Follows engines added to the store by other replicas and drops the ones removed there
/// (engines from this gateway's own config stay). Ends with the gateway.
async fn sync_engines(gw: std::sync::Weak<Gateway>) {
    loop {
        tokio::time::sleep(REGISTRY_SYNC).await;
        let Some(gw) = gw.upgrade() else { return };
        let stored = match gw.store.list_engines().await {
            Ok(list) => list,
            Err(e) => {
                tracing::debug!(error = %e, "engine registry sync skipped");
                continue;
            }
        };
        for e in &stored {
            if gw.registry.get(&e.name).is_none() {
                match gw.follow_engine(&e.name, &e.url) {
                    Ok(_) => tracing::info!(engine = %e.name, "engine added by another gateway"),
                    Err(err) => {
                        tracing::warn!(engine = %e.name, error = %err, "cannot follow engine")
                    }
                }
            }
        }
        for e in gw.registry.all() {
            let configured = gw.config.engines.iter().any(|c| c.name == e.name);
            if !configured && !stored.iter().any(|s| s.name == e.name) {
                gw.registry.remove(&e.name);
                gw.metrics.forget_engine(&e.name);
                tracing::info!(engine = %e.name, "engine removed by another gateway");
            }
        }
    }
}

/// Drains `ledger` into the gateway's store until the gateway is gone, retrying a failed batch
/// with backoff (100 ms doubling to 5 s); the records wait in the queue meanwhile.
async fn write_ledger(gw: Weak<Gateway>, ledger: Arc<Ledger>) {
    let mut pause = Duration::from_millis(100);
    // A batch the store did not take, retried as it is, under its id, so that a batch the store
    // took but whose answer was lost is recognised and not counted twice.
    let mut held: Option<crate::usage::Batch> = None;
    loop {
        let batch = match held.take() {
            Some(b) => b,
            None => {
                let batch = ledger.take_batch();
                if batch.records.is_empty() {
                    // Every LEDGER_FLUSH, or at once when a push fills a batch (a push while
                    // nobody waits leaves a permit); and it notices when the gateway is gone.
                    let wake = ledger.wake.notified();
                    let _ = tokio::time::timeout(crate::usage::LEDGER_FLUSH, wake).await;
                    if gw.strong_count() == 0 {
                        return;
                    }
                    continue;
                }
                batch
            }
        };
        let Some(g) = gw.upgrade() else { return };
        let n = batch.records.len() as u64;
        match g.store.record_usage(&batch.id, &batch.records).await {
            Ok(()) => {
                ledger.written.fetch_add(n, Ordering::Relaxed);
                // Dropping the batch takes its records out of the pending count.
                drop(batch);
                pause = Duration::from_millis(100);
            }
            Err(e) => {
                g.metrics.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, records = n, "usage ledger write failed; will retry");
                held = Some(batch);
                drop(g);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}

//! `kvgate gateway --config gateway.toml` (the distributed gateway role) and
//! `kvgate migrate --redis URL` (Redis keyspace migrations).

use crate::backoff::Backoff;
use crate::model_cmd;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvgate_gateway::config::redact_url;
use kvgate_gateway::store::{MemoryStore, RedisStore, Store};
use kvgate_gateway::{Gateway, GatewayConfig};
use kvgate_protocol::prompt::PromptRenderer;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct GatewayArgs {
    /// gateway.toml (see gateway/src/config.rs for every field).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides `listen`.
    #[arg(long)]
    listen: Option<String>,
    /// Overrides `admin_listen`.
    #[arg(long)]
    admin_listen: Option<String>,
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Redis URL, for example redis://127.0.0.1:6379.
    #[arg(long, env = "KVGATE_REDIS", hide_env_values = true)]
    redis: String,
}

pub fn gateway(args: GatewayArgs) -> Result<()> {
    let text = match &args.config {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => String::new(),
    };
    let mut config = GatewayConfig::parse(&text).map_err(|e| match &args.config {
        Some(p) => anyhow::anyhow!("{}: {e}", p.display()),
        None => anyhow::anyhow!("{e}"),
    })?;
    if let Some(l) = args.listen {
        config.listen = l;
    }
    if let Some(l) = args.admin_listen {
        config.admin_listen = l;
    }
    config.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    crate::engine_cmd::init_tracing();
    let dir = model_cmd::resolve(config.model.as_deref(), false)?;
    if config.context_tokens.is_none() {
        config.context_tokens = model_context_tokens(&dir);
    }
    let renderer = Arc::new(
        PromptRenderer::from_dir(&dir)
            .with_context(|| format!("loading the tokenizer in {}", dir.display()))?,
    );
    runtime()?.block_on(async move {
        let store = open_store(config.redis.as_deref()).await?;
        let gw = Gateway::start(config, store, renderer).await?;
        serve_gateway(gw, None::<fn(SocketAddr, SocketAddr) -> String>).await
    })
}

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// The model's context length (`max_position_embeddings` in its `config.json`), when it says.
fn model_context_tokens(dir: &std::path::Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json.get("max_position_embeddings")?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
}

/// How long a gateway that starts while Redis cannot be reached keeps trying: a restart that
/// lands inside a Redis restart (a few seconds down) comes up when Redis does, rather than exit.
const STORE_CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// The store named by the config: Redis (schema checked), or in-memory. Redis that cannot be
/// reached is tried again ([`Backoff`]'s pauses) for [`STORE_CONNECT_PATIENCE`]; a malformed URL
/// or an unmigrated keyspace fails at once.
pub async fn open_store(redis: Option<&str>) -> Result<Arc<dyn Store>> {
    let Some(url) = redis else {
        return Ok(Arc::new(MemoryStore::new()));
    };
    redis::Client::open(url).with_context(|| format!("bad redis url {}", redact_url(url)))?;
    let started = Instant::now();
    let mut backoff = Backoff::new();
    let store = loop {
        match RedisStore::connect(url).await {
            Ok(store) => break store,
            Err(e) if started.elapsed() < STORE_CONNECT_PATIENCE => {
                tracing::warn!(redis = %redact_url(url), error = %e, "cannot reach redis; trying again");
                backoff.wait().await;
            }
            Err(e) => {
                return Err(e).with_context(|| format!("connecting to {}", redact_url(url)));
            }
        }
    };
    store
        .check_schema()
        .await
        .context("run `kvgate migrate --redis URL` first")?;
    Ok(Arc::new(store))
}

/// Serves `gw` until SIGTERM or Ctrl-C; requests and streams in flight finish first. The
/// tenants' API runs on `api_threads` threads of its own (one per CPU by default), the admin API
/// and the background work on this runtime. `banner(api address, admin address)`, when given, is
/// printed once both listeners are bound (so `:0` ports print as the ports they got).
pub async fn serve_gateway(
    gw: Arc<Gateway>,
    banner: Option<impl FnOnce(SocketAddr, SocketAddr) -> String>,
) -> Result<()> {
    let api_addr = tokio::net::lookup_host(&gw.config.listen)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .with_context(|| format!("listen: cannot resolve {}", gw.config.listen))?;
    let admin = tokio::net::TcpListener::bind(&gw.config.admin_listen)
        .await
        .with_context(|| format!("binding {}", gw.config.admin_listen))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let threads = gw.config.api_threads();
    let api = gw
        .clone()
        .run_threads(api_addr, threads, stop_rx.clone())
        .with_context(|| format!("binding {}", gw.config.listen))?;
    tracing::info!(
        addr = %api.addr,
        admin = %admin.local_addr()?,
        threads,
        engines = gw.registry.all().len(),
        "gateway listening"
    );
    if let Some(b) = banner {
        println!("{}", b(api.addr, admin.local_addr()?));
    }
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let admin_task = tokio::spawn(gw.clone().run_admin(admin, wait(stop_rx)));
    shutdown_signal().await;
    // A grace first: health says stopping and answers close their connections, while requests
    // sent as the stop began are still taken; then the listeners close.
    let grace = std::time::Duration::from_millis(gw.config.stop_grace_ms);
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: health reports stopping; then finishing requests in flight"
    );
    gw.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(grace).await;
    let _ = stop_tx.send(true);
    let api = tokio::task::spawn_blocking(move || api.join()).await;
    let admin = admin_task.await;
    // The last answers' rate-limit releases and usage records reach the store before the
    // process goes, whatever became of the listeners.
    gw.settle(std::time::Duration::from_secs(10)).await;
    gw.stop_following();
    api??;
    admin??;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

pub fn migrate(args: MigrateArgs) -> Result<()> {
    runtime()?.block_on(async move {
        let store = RedisStore::connect(&args.redis)
            .await
            .with_context(|| format!("connecting to {}", redact_url(&args.redis)))?;
        let before = store.schema_version().await?;
        let applied = store.migrate().await?;
        let after = store.schema_version().await?;
        if after < before {
            bail!("schema went backwards: {before} -> {after}");
        }
        if applied.is_empty() {
            println!("schema is current (version {after}); nothing to apply");
        } else {
            for v in &applied {
                println!("applied migration {v:04}");
            }
            println!("schema version {before} -> {after}");
        }
        Ok(())
    })
}

//! `kvgate engine --config engine.toml`: one engine instance.

use crate::model_cmd;
use anyhow::{Context, Result};
use clap::Args;
use kvgate_engine::server::{self, config::EngineConfig, launch};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct EngineArgs {
    /// engine.toml (see engine/src/server/config.rs for every field).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides `listen`.
    #[arg(long)]
    listen: Option<String>,
    /// Overrides `model` (a model directory or .gguf file).
    #[arg(long)]
    model: Option<PathBuf>,
}

pub fn engine(args: EngineArgs) -> Result<()> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            EngineConfig::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => EngineConfig::default(),
    };
    if let Some(l) = args.listen {
        config.listen = l;
    }
    if let Some(m) = args.model {
        config.model = Some(m);
    }
    config.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    run(config)
}

fn run(config: EngineConfig) -> Result<()> {
    init_tracing();
    let dir = model_cmd::resolve(config.model.as_deref(), config.dtype.quant().is_some())?;
    let state = launch::start(&config, &dir)
        .with_context(|| format!("starting the engine on {}", dir.display()))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let addr = listener.local_addr()?;
        tracing::info!(%addr, model = %state.model_id, "engine listening");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        server::run(listener, state, shutdown).await?;
        Ok(())
    })
}

pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

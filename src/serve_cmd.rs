//! `kvgate serve`: everything on one machine with zero configuration. The gateway (in-memory
//! store, one default tenant) on 127.0.0.1:8080 in front of one in-process engine on a loopback
//! port, with fresh random secrets. Prints a ready-to-use API key and a `curl` example.

use crate::{gateway_cmd, model_cmd};
use anyhow::{Context, Result};
use clap::Args;
use kvgate_engine::server::config::{AuthSection, EngineConfig, KvSection};
use kvgate_engine::server::{self, launch};
use kvgate_gateway::config::EngineEntry;
use kvgate_gateway::store::MemoryStore;
use kvgate_gateway::tenant::Tenant;
use kvgate_gateway::{Gateway, GatewayConfig};
use std::path::PathBuf;
use std::sync::Arc;

pub const DEFAULT_MODEL_ID: &str = "smollm2-135m-instruct";

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The OpenAI-compatible API, for tenants.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// The admin API and /metrics.
    #[arg(long, default_value = "127.0.0.1:9090")]
    admin_listen: String,
    /// Model directory or .gguf file (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(long)]
    model: Option<PathBuf>,
    /// KV cache blocks (16 tokens each).
    #[arg(long, default_value_t = 2048)]
    kv_blocks: u32,
}

fn secret() -> String {
    let b: [u8; 32] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn serve(args: ServeArgs) -> Result<()> {
    crate::engine_cmd::init_tracing();
    let dir = model_cmd::resolve(args.model.as_deref())?;
    let operator_token = secret();
    let engine_token = secret();
    let seed = secret();
    let engine_config = EngineConfig {
        listen: "127.0.0.1:0".into(),
        model: Some(dir.clone()),
        model_id: Some(DEFAULT_MODEL_ID.into()),
        kv: KvSection {
            blocks: Some(args.kv_blocks),
            hash_seed: Some(seed.clone()),
            ..KvSection::default()
        },
        auth: AuthSection {
            engine_token: Some(engine_token.clone()),
            operator_token: Some(operator_token.clone()),
        },
        ..EngineConfig::default()
    };
    engine_config
        .validate()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let state = launch::start(&engine_config, &dir)
        .with_context(|| format!("starting the engine on {}", dir.display()))?;
    let renderer = state.renderer.clone();
    let context_tokens = state.context_len;
    gateway_cmd::runtime()?.block_on(async move {
        let engine_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let engine_addr = engine_listener.local_addr()?;
        let (stop_engine, engine_stopped) = tokio::sync::oneshot::channel::<()>();
        let engine = tokio::spawn(server::run(engine_listener, state, async {
            let _ = engine_stopped.await;
        }));
        let config = GatewayConfig {
            listen: args.listen,
            admin_listen: args.admin_listen,
            model: Some(dir),
            model_id: DEFAULT_MODEL_ID.into(),
            context_tokens: Some(context_tokens),
            operator_token: Some(operator_token.clone()),
            engine_token: Some(engine_token),
            pepper: Some(secret()),
            hash_seed: Some(seed),
            engines: vec![EngineEntry {
                name: "local".into(),
                url: format!("http://{engine_addr}"),
            }],
            ..GatewayConfig::default()
        };
        let gw = Gateway::start(config, Arc::new(MemoryStore::new()), renderer).await?;
        gw.store.put_tenant(&Tenant::new("default")).await?;
        let (key, _) = gw.issue_key("default").await?;
        let banner = format!(
            "kvgate is serving {model} on http://{listen} (admin API and /metrics on http://{admin})\n\
             API key for tenant 'default' (shown once): {key}\n\
             operator token for the admin API: {operator_token}\n\n\
             try:\n  curl http://{listen}/v1/chat/completions \\\n    \
             -H 'authorization: Bearer {key}' -H 'content-type: application/json' \\\n    \
             -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}]}}'",
            model = DEFAULT_MODEL_ID,
            listen = gw.config.listen,
            admin = gw.config.admin_listen,
        );
        gateway_cmd::serve_gateway(gw, Some(banner)).await?;
        let _ = stop_engine.send(());
        engine.await??;
        Ok(())
    })
}

//! `kvgate serve`: everything on one machine with zero configuration. The gateway (in-memory
//! store, one default tenant) on 127.0.0.1:8080 in front of one in-process engine on a loopback
//! port, with fresh random secrets. Prints a ready-to-use API key, a `curl` example, and where
//! the metrics are: the admin listener's `/metrics` serves the gateway's and the engine's
//! (`kvgate_kv_*`, prefix-cache hits, preemptions) together.

use crate::{gateway_cmd, model_cmd};
use anyhow::{Context, Result};
use clap::Args;
use kvgate_engine::server::config::{AuthSection, EngineConfig, KvSection, WeightDType};
use kvgate_engine::server::{self, launch};
use kvgate_gateway::config::EngineEntry;
use kvgate_gateway::store::MemoryStore;
use kvgate_gateway::tenant::{KeySpec, Tenant};
use kvgate_gateway::{Gateway, GatewayConfig};
use kvgate_http::trace::TracingConfig;
use kvgate_protocol::openai::SamplingDefaults;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

pub const DEFAULT_MODEL_ID: &str = "smollm2-135m-instruct";

/// `kvgate serve --help`: what to do with the running service.
pub const AFTER_HELP: &str = "\
Once it runs, it prints an API key, the operator token and a curl command. Then:
  metrics of the gateway and the engine (KV blocks, prefix-cache hits, preemptions):
    curl -s http://127.0.0.1:9090/metrics | grep kvgate_kv_
  a tenant and its key (the operator token is printed at start):
    export KVGATE_ADMIN_URL=http://127.0.0.1:9090 KVGATE_OPERATOR_TOKEN=...
    kvgate admin tenants create acme
    kvgate admin keys issue acme
  the KV cache dashboard: Prometheus scraping this serve, and dashboards/kv-cache.json in Grafana:
    prometheus --config.file=deploy/prometheus/serve.yml --web.listen-address=127.0.0.1:9091";

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
    /// The weights' type in memory: `q4_1` runs the default model's Q4_1 file as shipped.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: crate::generate_cmd::DTypeArg,
    /// Bytes of the disk tier under `$KVGATE_HOME/kv-cache`, where evicted prefixes live on and
    /// which a restart serves from (0: no disk tier).
    #[arg(long, default_value_t = 4 << 30)]
    disk_tier_bytes: u64,
    /// An OpenTelemetry collector's OTLP/HTTP address (`http://host:4318`): every request's
    /// gateway and engine spans are exported there (docs/tracing.md).
    #[arg(long)]
    otlp_endpoint: Option<String>,
}

/// `--otlp-endpoint` as the gateway's or the engine's `[tracing]`.
fn tracing_config(endpoint: &Option<String>, service: &str) -> TracingConfig {
    TracingConfig {
        otlp_endpoint: endpoint.clone(),
        service_name: Some(service.into()),
        ..TracingConfig::default()
    }
}

/// The disk tier's directory and the hash seed it is keyed by, both under `$KVGATE_HOME`: the
/// seed is made once and kept (owner-only), so a restarted `serve` hits the blocks it wrote.
/// `None` (no disk tier, a fresh seed) when the directory cannot be used.
fn disk_tier(model: &std::path::Path, dtype: WeightDType) -> Option<(PathBuf, String)> {
    let home = crate::assets::home().ok()?;
    let seed_path = home.join("serve-hash-seed");
    let seed = match std::fs::read_to_string(&seed_path) {
        Ok(s) if kvgate_protocol::hash::parse_hash_seed(s.trim()).is_some() => s.trim().to_owned(),
        _ => {
            let seed = secret();
            std::fs::create_dir_all(&home).ok()?;
            write_private(&seed_path, &seed).ok()?;
            seed
        }
    };
    // Named by the model, a digest of its weights and the type they run in (quantized weights
    // compute other K/V): other weights get a directory of their own rather than a refusal to
    // start.
    let name = model.file_name()?.to_string_lossy().into_owned();
    let digest = kvgate_engine::server::launch::model_digest(model).ok()?;
    let kind = match dtype {
        WeightDType::F32 => String::new(),
        other => format!("-{}", format!("{other:?}").to_ascii_lowercase()),
    };
    Some((
        home.join("kv-cache")
            .join(format!("{name}-{}{kind}", &digest[..12])),
        seed,
    ))
}

fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(text.as_bytes())
}

/// Sampling defaults for the default model: greedy. SmolLM2-135M-Instruct in its Q4_1 GGUF puts
/// nearly equal probability on its first two answers to the quick start's question (15% and 14%,
/// "The capital..." and "L'Étoile..."), so even the model card's temperature 0.2 answers in
/// broken French four times in ten; greedy decoding gives its best answer. A request that sets
/// `temperature` samples as asked.
fn default_model_sampling() -> SamplingDefaults {
    SamplingDefaults {
        temperature: Some(0.0),
        ..SamplingDefaults::default()
    }
}

/// What `serve` prints once it listens: the key, a first request, and where to look next.
fn banner(api: SocketAddr, admin: SocketAddr, key: &str, operator_token: &str) -> String {
    let model = DEFAULT_MODEL_ID;
    let exe = std::env::current_exe()
        .ok()
        .map_or_else(|| "kvgate".into(), |p| p.display().to_string());
    format!(
        "kvgate is serving {model} on http://{api}\n\
         API key for tenant 'default' (shown once): {key}\n\
         operator token for the admin API on http://{admin}: {operator_token}\n\n\
         try:\n  curl http://{api}/v1/chat/completions \\\n    \
         -H 'authorization: Bearer {key}' -H 'content-type: application/json' \\\n    \
         -d '{{\"model\":\"{model}\",\"max_tokens\":64,\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}]}}'\n\n\
         metrics (gateway and engine: KV blocks, prefix-cache hits, preemptions):\n  \
         curl -s http://{admin}/metrics | grep kvgate_kv_\n\
         add a tenant and a key for it:\n  \
         export KVGATE_ADMIN_URL=http://{admin} KVGATE_OPERATOR_TOKEN={operator_token}\n  \
         {exe} admin tenants create acme\n  \
         {exe} admin keys issue acme\n\
         the KV cache dashboard (dashboards/kv-cache.json in Grafana), scraping this serve:\n  \
         prometheus --config.file=deploy/prometheus/serve.yml --web.listen-address=127.0.0.1:9091"
    )
}

fn secret() -> String {
    let b: [u8; 32] = rand::random();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn serve(args: ServeArgs) -> Result<()> {
    crate::engine_cmd::init_tracing();
    let dtype = WeightDType::from(args.dtype);
    let dir = model_cmd::resolve(args.model.as_deref(), dtype.quant().is_some())?;
    let operator_token = secret();
    let engine_token = secret();
    let tier = (args.disk_tier_bytes > 0)
        .then(|| disk_tier(&dir, dtype))
        .flatten();
    let seed = tier.as_ref().map_or_else(secret, |(_, seed)| seed.clone());
    let engine_config = EngineConfig {
        listen: "127.0.0.1:0".into(),
        sampling: if args.model.is_none() {
            default_model_sampling()
        } else {
            SamplingDefaults::default()
        },
        model: Some(dir.clone()),
        model_id: Some(DEFAULT_MODEL_ID.into()),
        kv: KvSection {
            blocks: Some(args.kv_blocks),
            hash_seed: Some(seed.clone()),
            disk_dir: tier.map(|(dir, _)| dir),
            disk_bytes: args.disk_tier_bytes.max(1),
            ..KvSection::default()
        },
        auth: AuthSection {
            engine_token: Some(engine_token.clone()),
            operator_token: Some(operator_token.clone()),
        },
        tracing: tracing_config(&args.otlp_endpoint, "kvgate-engine"),
        dtype,
        ..EngineConfig::default()
    };
    engine_config
        .validate()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let state = launch::start(&engine_config, &dir)
        .with_context(|| format!("starting the engine on {}", dir.display()))?;
    let renderer = state.renderer.clone();
    let context_tokens = state.context_len;
    let engine_state = state.clone();
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
            tracing: tracing_config(&args.otlp_endpoint, "kvgate-gateway"),
            ..GatewayConfig::default()
        };
        let gw = Gateway::start(config, Arc::new(MemoryStore::new()), renderer).await?;
        gw.store.put_tenant(&Tenant::new("default")).await?;
        let (key, _) = gw.issue_key("default", &KeySpec::default()).await?;
        gw.metrics
            .also_export(move || server::render_metrics(&engine_state));
        let banner = move |api, admin| banner(api, admin, &key, &operator_token);
        gateway_cmd::serve_gateway(gw, Some(banner)).await?;
        let _ = stop_engine.send(());
        engine.await??;
        Ok(())
    })
}

//! `kvgate admin ...`: the operator CLI over the gateway's admin API. Prints the JSON answers.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Args, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper::{header, Method, Request};
use serde_json::{json, Map, Value};

#[derive(Args, Debug)]
pub struct AdminArgs {
    /// The gateway's admin listener.
    #[arg(
        long,
        env = "KVGATE_ADMIN_URL",
        default_value = "http://127.0.0.1:9090"
    )]
    url: String,
    /// The operator token.
    #[arg(long, env = "KVGATE_OPERATOR_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Subcommand, Debug)]
enum AdminCommand {
    /// Tenants: create, get, update, list, delete.
    #[command(subcommand)]
    Tenants(TenantCmd),
    /// API keys: issue (shown once), list, revoke.
    #[command(subcommand)]
    Keys(KeyCmd),
    /// Engines: list, add, remove, drain, undrain.
    #[command(subcommand)]
    Engines(EngineCmd),
    /// Prefix caches.
    #[command(subcommand)]
    Cache(CacheCmd),
}

#[derive(Args, Debug, Default)]
struct TenantFields {
    #[arg(long)]
    name: Option<String>,
    /// Requests per minute.
    #[arg(long)]
    rpm: Option<u32>,
    /// Tokens (prompt + completion) per minute.
    #[arg(long)]
    tpm: Option<u64>,
    #[arg(long)]
    max_concurrent: Option<u32>,
    /// KV blocks the tenant may hold on one engine.
    #[arg(long)]
    kv_quota: Option<u32>,
    /// A shared cache scope (tenants with the same scope share prefix caches).
    #[arg(long)]
    scope: Option<String>,
    /// Scheduler weight (>= 1).
    #[arg(long)]
    priority: Option<u32>,
    /// Allowed models, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    /// Default system prompt for chat requests without one.
    #[arg(long)]
    system_prompt: Option<String>,
}

impl TenantFields {
    fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.to_owned(), v);
            }
        };
        put("name", self.name.clone().map(Value::from));
        put("requests_per_min", self.rpm.map(Value::from));
        put("tokens_per_min", self.tpm.map(Value::from));
        put("max_concurrent", self.max_concurrent.map(Value::from));
        put("kv_block_quota", self.kv_quota.map(Value::from));
        put("cache_scope", self.scope.clone().map(Value::from));
        put("priority", self.priority.map(Value::from));
        put("allowed_models", self.models.clone().map(Value::from));
        put("system_prompt", self.system_prompt.clone().map(Value::from));
        m
    }
}

#[derive(Subcommand, Debug)]
enum TenantCmd {
    Create {
        id: String,
        #[command(flatten)]
        fields: TenantFields,
    },
    Get {
        id: String,
    },
    List,
    Update {
        id: String,
        #[command(flatten)]
        fields: TenantFields,
    },
    Delete {
        id: String,
    },
}

#[derive(Subcommand, Debug)]
enum KeyCmd {
    Issue { tenant: String },
    List { tenant: String },
    Revoke { tenant: String, key_id: String },
}

#[derive(Subcommand, Debug)]
enum EngineCmd {
    List,
    Add {
        name: String,
        url: String,
    },
    Remove {
        name: String,
    },
    /// Stop routing to the engine; in-flight requests finish.
    Drain {
        name: String,
        /// Wait up to this many seconds for in-flight requests to reach zero, reporting progress.
        #[arg(long, default_value_t = 0)]
        wait: u64,
    },
    Undrain {
        name: String,
    },
}

#[derive(Subcommand, Debug)]
enum CacheCmd {
    /// Flush engine caches and the gateway's index: all, one engine, or one tenant's scope.
    Flush {
        #[arg(long)]
        engine: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
    },
}

pub fn run(args: AdminArgs) -> Result<()> {
    let (method, path, body): (Method, String, Option<Value>) = match args.command {
        AdminCommand::Tenants(c) => match c {
            TenantCmd::Create { id, fields } => {
                let mut m = fields.to_json();
                m.insert("id".into(), Value::from(id));
                (
                    Method::POST,
                    "/admin/tenants".into(),
                    Some(Value::Object(m)),
                )
            }
            TenantCmd::Get { id } => (Method::GET, format!("/admin/tenants/{id}"), None),
            TenantCmd::List => (Method::GET, "/admin/tenants".into(), None),
            TenantCmd::Update { id, fields } => (
                Method::PATCH,
                format!("/admin/tenants/{id}"),
                Some(Value::Object(fields.to_json())),
            ),
            TenantCmd::Delete { id } => (Method::DELETE, format!("/admin/tenants/{id}"), None),
        },
        AdminCommand::Keys(c) => match c {
            KeyCmd::Issue { tenant } => {
                (Method::POST, format!("/admin/tenants/{tenant}/keys"), None)
            }
            KeyCmd::List { tenant } => (Method::GET, format!("/admin/tenants/{tenant}/keys"), None),
            KeyCmd::Revoke { tenant, key_id } => (
                Method::DELETE,
                format!("/admin/tenants/{tenant}/keys/{key_id}"),
                None,
            ),
        },
        AdminCommand::Engines(c) => match c {
            EngineCmd::List => (Method::GET, "/admin/engines".into(), None),
            EngineCmd::Add { name, url } => (
                Method::POST,
                "/admin/engines".into(),
                Some(json!({"name": name, "url": url})),
            ),
            EngineCmd::Remove { name } => (Method::DELETE, format!("/admin/engines/{name}"), None),
            EngineCmd::Drain { name, wait } => {
                return drain(&args.url, args.token.as_deref(), &name, wait)
            }
            EngineCmd::Undrain { name } => {
                (Method::POST, format!("/admin/engines/{name}/undrain"), None)
            }
        },
        AdminCommand::Cache(CacheCmd::Flush { engine, tenant }) => (
            Method::POST,
            "/admin/cache/flush".into(),
            Some(json!({"engine": engine, "tenant": tenant})),
        ),
    };
    let v = call(&args.url, args.token.as_deref(), method, &path, body)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// Drains, then polls every second until in-flight reaches zero or `wait` runs out, printing
/// progress.
fn drain(url: &str, token: Option<&str>, name: &str, wait: u64) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait);
    loop {
        let v = call(
            url,
            token,
            Method::POST,
            &format!("/admin/engines/{name}/drain?wait=1"),
            None,
        )?;
        let drained = v.get("drained").and_then(Value::as_bool) == Some(true);
        eprintln!(
            "{name}: draining, in flight here {} / on the engine {}",
            v.get("inflight").unwrap_or(&Value::Null),
            v.get("engine_inflight").unwrap_or(&Value::Null)
        );
        if drained || std::time::Instant::now() >= deadline {
            println!("{}", serde_json::to_string_pretty(&v)?);
            if !drained && wait > 0 {
                bail!("{name} still has requests in flight after {wait} s");
            }
            return Ok(());
        }
    }
}

fn call(
    base: &str,
    token: Option<&str>,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Value> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let client = kvgate_gateway::upstream::http_client();
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", base.trim_end_matches('/')))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
        let resp = client
            .request(req.body(Full::new(body))?)
            .await
            .with_context(|| format!("calling {base}{path}"))?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        let v: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        if !status.is_success() {
            let msg = v
                .pointer("/error/message")
                .and_then(Value::as_str)
                .map_or_else(|| v.to_string(), str::to_owned);
            bail!("{status}: {msg}");
        }
        Ok(v)
    })
}

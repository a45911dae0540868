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
    /// Usage from the ledger's aggregates: requests, prompt, cached and completion tokens, cost.
    Usage(UsageArgs),
    /// The audit log of admin actions, newest first.
    Audit(AuditArgs),
    /// Named operator tokens: issue (shown once), list, revoke.
    #[command(subcommand)]
    Tokens(TokenCmd),
}

#[derive(Args, Debug)]
struct UsageArgs {
    #[arg(long)]
    tenant: Option<String>,
    /// First day, YYYY-MM-DD (default: the first of this month, UTC).
    #[arg(long)]
    since: Option<String>,
    /// Last day, YYYY-MM-DD (default: today, UTC).
    #[arg(long)]
    until: Option<String>,
    /// tenant (default), day, key or model.
    #[arg(long, default_value = "tenant")]
    group_by: String,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Args, Debug)]
struct AuditArgs {
    /// From this day (YYYY-MM-DD, UTC) or unix milliseconds.
    #[arg(long)]
    since: Option<String>,
    /// Up to this day (YYYY-MM-DD, UTC, the whole day) or unix milliseconds.
    #[arg(long)]
    until: Option<String>,
    #[arg(long, default_value_t = 100)]
    limit: u32,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Table,
    Json,
    Csv,
}

#[derive(Subcommand, Debug)]
enum TokenCmd {
    /// Issue a named token with a role: admin, operator (drain, undrain, flush) or viewer.
    Issue {
        name: String,
        #[arg(long)]
        role: String,
    },
    List,
    Revoke {
        name: String,
    },
}

#[derive(Args, Debug, Default)]
struct BudgetFields {
    /// Monthly budget in tokens (prompt + completion).
    #[arg(long)]
    budget_tokens: Option<u64>,
    /// Monthly budget in USD (at the configured prices).
    #[arg(long)]
    budget_usd: Option<f64>,
}

impl BudgetFields {
    fn to_json(&self) -> Option<Value> {
        (self.budget_tokens.is_some() || self.budget_usd.is_some()).then(
            || json!({"monthly_tokens": self.budget_tokens, "monthly_cost_usd": self.budget_usd}),
        )
    }
}

#[derive(Args, Debug, Default)]
struct KeyFields {
    #[arg(long)]
    name: Option<String>,
    /// A label, `name=value` (repeat for more).
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Expires this many seconds from now.
    #[arg(long)]
    expires_in: Option<u64>,
    /// The key's own requests per minute (on top of its tenant's).
    #[arg(long)]
    rpm: Option<u32>,
    /// The key's own tokens per minute.
    #[arg(long)]
    tpm: Option<u64>,
    #[command(flatten)]
    budget: BudgetFields,
}

fn parse_label(s: &str) -> std::result::Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected name=value, got {s:?}"))
}

impl KeyFields {
    fn to_json(&self) -> Value {
        let mut m = Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.to_owned(), v);
            }
        };
        put("name", self.name.clone().map(Value::from));
        let labels: Map<String, Value> = (self.labels.iter())
            .map(|(k, v)| (k.clone(), Value::from(v.clone())))
            .collect();
        put(
            "labels",
            (!labels.is_empty()).then_some(Value::Object(labels)),
        );
        put("expires_in_secs", self.expires_in.map(Value::from));
        put("requests_per_min", self.rpm.map(Value::from));
        put("tokens_per_min", self.tpm.map(Value::from));
        put("budget", self.budget.to_json());
        Value::Object(m)
    }
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
    #[command(flatten)]
    budget: BudgetFields,
    /// The tenant's own prices, USD per million prompt tokens (with --price-completion).
    #[arg(long, requires = "price_completion")]
    price_prompt: Option<f64>,
    /// USD per million cached prompt tokens (default: the prompt price).
    #[arg(long, requires = "price_prompt")]
    price_cached: Option<f64>,
    /// USD per million completion tokens.
    #[arg(long, requires = "price_prompt")]
    price_completion: Option<f64>,
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
        put("budget", self.budget.to_json());
        put(
            "prices",
            self.price_prompt.map(|p| {
                json!({"prompt": p, "cached_prompt": self.price_cached,
                       "completion": self.price_completion})
            }),
        );
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
    Issue {
        tenant: String,
        #[command(flatten)]
        fields: KeyFields,
    },
    List {
        tenant: String,
    },
    /// Change a key's name, labels, expiry, limits or budget.
    Update {
        tenant: String,
        key_id: String,
        #[command(flatten)]
        fields: KeyFields,
    },
    /// Issue a successor (same name, labels, limits, budget); the old key keeps working for
    /// the grace time, then gets 401 "expired".
    Rotate {
        tenant: String,
        key_id: String,
        /// Seconds the old key keeps working.
        #[arg(long, default_value_t = 86_400)]
        grace: u64,
    },
    Revoke {
        tenant: String,
        key_id: String,
    },
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
            KeyCmd::Issue { tenant, fields } => (
                Method::POST,
                format!("/admin/tenants/{tenant}/keys"),
                Some(fields.to_json()),
            ),
            KeyCmd::Update {
                tenant,
                key_id,
                fields,
            } => (
                Method::PATCH,
                format!("/admin/tenants/{tenant}/keys/{key_id}"),
                Some(fields.to_json()),
            ),
            KeyCmd::Rotate {
                tenant,
                key_id,
                grace,
            } => (
                Method::POST,
                format!("/admin/tenants/{tenant}/keys/{key_id}/rotate"),
                Some(json!({ "grace_secs": grace })),
            ),
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
        AdminCommand::Tokens(c) => match c {
            TokenCmd::Issue { name, role } => (
                Method::POST,
                "/admin/tokens".into(),
                Some(json!({"name": name, "role": role})),
            ),
            TokenCmd::List => (Method::GET, "/admin/tokens".into(), None),
            TokenCmd::Revoke { name } => (Method::DELETE, format!("/admin/tokens/{name}"), None),
        },
        AdminCommand::Usage(u) => return usage(&args.url, args.token.as_deref(), &u),
        AdminCommand::Audit(a) => return audit(&args.url, args.token.as_deref(), &a),
    };
    let v = call(&args.url, args.token.as_deref(), method, &path, body)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// `kvgate admin usage`: the aggregates as a table, JSON or CSV.
fn usage(url: &str, token: Option<&str>, u: &UsageArgs) -> Result<()> {
    let mut query = vec![format!("group_by={}", u.group_by)];
    for (k, v) in [
        ("tenant", &u.tenant),
        ("since", &u.since),
        ("until", &u.until),
    ] {
        if let Some(v) = v {
            query.push(format!("{k}={v}"));
        }
    }
    let v = call(
        url,
        token,
        Method::GET,
        &format!("/admin/usage?{}", query.join("&")),
        None,
    )?;
    let mut columns = vec!["tenant"];
    if u.group_by != "tenant" {
        columns.push(u.group_by.as_str());
    }
    columns.extend([
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cost_usd",
    ]);
    print_rows(&v, "rows", &columns, u.format)
}

/// `kvgate admin audit`: the audit log, newest first.
fn audit(url: &str, token: Option<&str>, a: &AuditArgs) -> Result<()> {
    let mut query = vec![format!("limit={}", a.limit)];
    if let Some(s) = &a.since {
        query.push(format!("since_ms={}", time_ms(s, false)?));
    }
    if let Some(s) = &a.until {
        query.push(format!("until_ms={}", time_ms(s, true)?));
    }
    let v = call(
        url,
        token,
        Method::GET,
        &format!("/admin/audit?{}", query.join("&")),
        None,
    )?;
    let columns = [
        "at_ms", "actor", "role", "action", "target", "status", "error",
    ];
    print_rows(&v, "entries", &columns, a.format)
}

/// A day (`YYYY-MM-DD`, UTC: its first or, with `end`, its last millisecond) or unix ms.
fn time_ms(s: &str, end: bool) -> Result<u64> {
    if let Some(days) = kvgate_gateway::usage::parse_day(s) {
        let start = u64::try_from(days).context("a day before 1970")? * 86_400_000;
        return Ok(if end { start + 86_399_999 } else { start });
    }
    s.parse()
        .with_context(|| format!("{s:?} is neither YYYY-MM-DD nor unix milliseconds"))
}

/// Prints `v[list]`'s objects as a table, JSON or CSV with these columns.
fn print_rows(v: &Value, list: &str, columns: &[&str], format: Format) -> Result<()> {
    if format == Format::Json {
        println!("{}", serde_json::to_string_pretty(v)?);
        return Ok(());
    }
    let empty = Vec::new();
    let rows = v.get(list).and_then(Value::as_array).unwrap_or(&empty);
    let cell = |row: &Value, c: &str| match row.get(c) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) if c == "cost_usd" => format!("{:.6}", n.as_f64().unwrap_or(0.0)),
        Some(other) => other.to_string(),
    };
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| columns.iter().map(|c| cell(r, c)).collect())
        .collect();
    if format == Format::Csv {
        let quote = |s: &str| {
            if s.contains([',', '"', '\n']) {
                format!("\"{}\"", s.replace('"', "\"\""))
            } else {
                s.to_owned()
            }
        };
        println!("{}", columns.join(","));
        for row in &table {
            let cells: Vec<String> = row.iter().map(|c| quote(c)).collect();
            println!("{}", cells.join(","));
        }
        return Ok(());
    }
    let widths: Vec<usize> = (0..columns.len())
        .map(|i| {
            table
                .iter()
                .map(|r| r[i].chars().count())
                .chain([columns[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(columns.to_vec());
    for row in &table {
        line(row.iter().map(String::as_str).collect());
    }
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

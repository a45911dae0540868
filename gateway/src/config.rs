//! `gateway.toml`: parsed once into typed structs; errors name the field. Secrets may come from
//! the environment instead of the file (`KVGATE_OPERATOR_TOKEN`, `KVGATE_ENGINE_TOKEN`,
//! `KVGATE_PEPPER`, `KVGATE_HASH_SEED`, `KVGATE_REDIS`), which wins over the file.
//!
//! ```toml
//! listen = "0.0.0.0:8080"            # tenants' OpenAI API
//! admin_listen = "0.0.0.0:9090"      # admin API and /metrics (operator token)
//! redis = "redis://redis:6379"       # omit: in-memory store (one process only)
//! model = "/models/smollm2"          # tokenizer.json + chat template, the same as the engines'
//! model_id = "smollm2-135m-instruct" # the id engines serve and hash with
//! operator_token = "..."             # admin API; also sent to engines' /admin/*
//! engine_token = "..."               # sent to engines on /v1/* and /kv/events
//! pepper = "..."                     # API keys are stored as SHA-256(pepper | key)
//! hash_seed = "<64 hex>"             # the engines' kv.hash_seed
//! block_size = 16                    # the engines' kv.block_size
//! kv_dtype = "f32"                   # the engines' KV storage type
//! max_body_bytes = 4194304
//! context_tokens = 8192              # the model's context (default: the model's config.json)
//! request_timeout_secs = 600         # until the response starts (streams may run longer)
//! first_byte_timeout_secs = 120      # one engine's first byte; past it, the next engine is tried
//!                                    # (and the longest silence mid-stream: past it, the stream ends)
//! header_timeout_secs = 30           # a client's request head, and its idle keep-alive time
//! max_connections = 4096             # client connections held at once
//! api_threads = 0                    # threads serving the tenants' API; 0: one per CPU
//! stall_timeout_secs = 30            # a client that stops reading its answer is cut off
//! stop_grace_ms = 1000               # at a stop: still serving (health 503, connections closed
//!                                    # after each answer) before the listeners close; <= 60000
//! [routing]
//! policy = "prefix"                  # prefix | round_robin | least_loaded | consistent_hash
//! load_factor = 1.25                 # bounded load: an engine given this x the mean of the
//!                                    # recent requests is passed over for one that serves as much
//!                                    # of the prompt from cache; a full batch starting a prompt
//!                                    # cold takes none past this x the mean in flight
//! prefill_tokens_per_sec = 1000.0    # an engine's prefill speed until it reports its own
//! [[engines]]
//! name = "engine-0"
//! url = "http://127.0.0.1:8081"
//! usage_ledger = true                # record every request (docs/tenancy.md); false: no ledger,
//!                                    # and no budgets
//! [prices."smollm2-135m-instruct"]   # USD per million tokens, per model (a tenant's own
//! prompt = 0.10                      # `prices` win); cached prompt tokens priced apart
//! cached_prompt = 0.02               # (default: the prompt price)
//! completion = 0.40
//! [tracing]                          # off unless an endpoint is set (docs/tracing.md)
//! otlp_endpoint = "http://otel-collector:4318"
//! sample_ratio = 1.0                 # share of requests recorded
//! ```

use serde::Deserialize;
use std::path::PathBuf;

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    #[serde(default)]
    pub redis: Option<String>,
    #[serde(default)]
    pub model: Option<PathBuf>,
    #[serde(default = "default_model_id")]
    pub model_id: String,
    #[serde(default)]
    pub operator_token: Option<String>,
    #[serde(default)]
    pub engine_token: Option<String>,
    #[serde(default)]
    pub pepper: Option<String>,
    #[serde(default)]
    pub hash_seed: Option<String>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    #[serde(default = "default_kv_dtype")]
    pub kv_dtype: String,
    #[serde(default = "default_body_limit")]
    pub max_body_bytes: usize,
    /// The model's context length in tokens. A prompt whose text could not fit even if every
    /// token were the vocabulary's longest is refused before it is tokenized.
    /// `None`: the model directory's `max_position_embeddings`, else 8192.
    #[serde(default)]
    pub context_tokens: Option<usize>,
    /// Until the response starts, retries included (the request's one deadline).
    #[serde(default = "default_timeout")]
    pub request_timeout_secs: u64,
    /// One engine's time to its first byte; a hung engine is then tried no more and counted
    /// against its circuit, and the request goes to the next engine within the deadline. A
    /// whole (not streamed) answer may take longer while the engine keeps stepping; one whose
    /// engine has not finished a step for this long is a hang. Also the longest an engine may
    /// go silent mid-stream: the stream then ends as broken.
    #[serde(default = "default_first_byte_timeout")]
    pub first_byte_timeout_secs: u64,
    /// A client's time to send a request head, and the idle time of a kept-alive connection.
    #[serde(default = "default_header_timeout")]
    pub header_timeout_secs: u64,
    /// Client connections held at once, per listener.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Threads serving the tenants' API (`kvgate gateway`), each with its own event loop,
    /// listener and engine connections; 0 is one per CPU.
    #[serde(default)]
    pub api_threads: usize,
    /// How long a client may leave its answer unread before its connection is closed (which
    /// cancels the request on the engine).
    #[serde(default = "default_header_timeout")]
    pub stall_timeout_secs: u64,
    /// At a graceful stop, how long the gateway goes on serving before its listeners close:
    /// `/health` answers 503 and every answer closes its connection, so that load balancers and
    /// clients leave, and a request sent as the stop began is served rather than cut.
    #[serde(default = "default_stop_grace_ms")]
    pub stop_grace_ms: u64,
    /// How long a verified API key is trusted without asking the store again.
    #[serde(default = "default_key_ttl")]
    pub key_cache_ttl_secs: u64,
    #[serde(default)]
    pub routing: RoutingSection,
    #[serde(default)]
    pub engines: Vec<EngineEntry>,
    /// Model id -> prices (the ledger's costs and cost budgets); a model with none costs 0.
    #[serde(default)]
    pub prices: std::collections::BTreeMap<String, crate::usage::Prices>,
    /// Record every admitted request in the usage ledger (which budgets are checked against:
    /// with the ledger off, budgets are not enforced).
    #[serde(default = "default_true")]
    pub usage_ledger: bool,
    /// Spans of each request, exported over OTLP when an endpoint is set (docs/tracing.md).
    #[serde(default)]
    pub tracing: kvgate_http::trace::TracingConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingSection {
    #[serde(default = "default_policy")]
    pub policy: crate::routing::Policy,
    #[serde(default = "default_load_factor")]
    pub load_factor: f64,
    /// The prefill speed assumed for an engine that has not measured its own yet.
    #[serde(default = "default_prefill_tokens_per_sec")]
    pub prefill_tokens_per_sec: f64,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EngineEntry {
    pub name: String,
    pub url: String,
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}
fn default_model_id() -> String {
    "smollm2-135m-instruct".into()
}
fn default_block_size() -> u32 {
    16
}
fn default_kv_dtype() -> String {
    "f32".into()
}
fn default_body_limit() -> usize {
    4 << 20
}
fn default_timeout() -> u64 {
    600
}
fn default_first_byte_timeout() -> u64 {
    120
}
/// Longest `stop_grace_ms`: a stop that serves on for longer is a misconfiguration.
const MAX_STOP_GRACE_MS: u64 = 60_000;

fn default_stop_grace_ms() -> u64 {
    1000
}
fn default_header_timeout() -> u64 {
    30
}
fn default_max_connections() -> usize {
    4096
}
fn default_true() -> bool {
    true
}
fn default_key_ttl() -> u64 {
    30
}
fn default_policy() -> crate::routing::Policy {
    crate::routing::Policy::Prefix
}
fn default_prefill_tokens_per_sec() -> f64 {
    1000.0
}
fn default_load_factor() -> f64 {
    1.25
}

impl Default for RoutingSection {
    fn default() -> Self {
        toml::from_str("").expect("every field has a default")
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        toml::from_str("").expect("every field has a default")
    }
}

impl GatewayConfig {
    /// Parses TOML text, applies `KVGATE_*` environment overrides, and validates.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut c: GatewayConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.apply_env(|k| std::env::var(k).ok());
        c.validate()?;
        Ok(c)
    }

    /// Secrets and the store from the environment (`get` is `std::env::var` outside tests).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) {
        let pairs: [(&str, &mut Option<String>); 5] = [
            ("KVGATE_OPERATOR_TOKEN", &mut self.operator_token),
            ("KVGATE_ENGINE_TOKEN", &mut self.engine_token),
            ("KVGATE_PEPPER", &mut self.pepper),
            ("KVGATE_HASH_SEED", &mut self.hash_seed),
            ("KVGATE_REDIS", &mut self.redis),
        ];
        for (key, field) in pairs {
            if let Some(v) = get(key).filter(|v| !v.is_empty()) {
                *field = Some(v);
            }
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        self.tracing.validate()?;
        for (field, addr) in [
            ("listen", &self.listen),
            ("admin_listen", &self.admin_listen),
        ] {
            addr.parse::<std::net::SocketAddr>()
                .map_err(|e| format!("{field}: {e}"))?;
        }
        if !(1..=256).contains(&self.block_size) {
            return Err("block_size: must be 1 to 256".into());
        }
        if let Some(seed) = &self.hash_seed {
            parse_seed(seed)?;
        }
        let tps = self.routing.prefill_tokens_per_sec;
        if !(tps > 0.0 && tps.is_finite() && (1.0 / tps).is_finite()) {
            return Err("routing.prefill_tokens_per_sec: must be a finite number > 0".into());
        }
        if !(self.routing.load_factor >= 1.0 && self.routing.load_factor.is_finite()) {
            return Err("routing.load_factor: must be >= 1".into());
        }
        for (model, p) in &self.prices {
            if let Some(f) = p.invalid_field() {
                return Err(format!(
                    "prices.{model}.{f}: must be a finite price >= 0 (USD per million tokens)"
                ));
            }
        }
        if self.pepper.as_deref().is_some_and(|p| p.len() < 16) {
            return Err("pepper: must be at least 16 characters".into());
        }
        for (i, e) in self.engines.iter().enumerate() {
            if e.name.is_empty() || !e.url.starts_with("http://") {
                return Err(format!(
                    "engines[{i}]: needs a name and an http:// url (got {:?})",
                    e.url
                ));
            }
        }
        if self.max_body_bytes == 0 || self.request_timeout_secs == 0 {
            return Err("max_body_bytes and request_timeout_secs: must be positive".into());
        }
        if self.stop_grace_ms > MAX_STOP_GRACE_MS {
            return Err(format!(
                "stop_grace_ms: at most {MAX_STOP_GRACE_MS} (got {})",
                self.stop_grace_ms
            ));
        }
        if self.first_byte_timeout_secs == 0
            || self.header_timeout_secs == 0
            || self.stall_timeout_secs == 0
        {
            return Err(
                "first_byte_timeout_secs, header_timeout_secs and stall_timeout_secs: must be positive"
                    .into(),
            );
        }
        if self.context_tokens == Some(0) {
            return Err("context_tokens: must be positive".into());
        }
        if self.max_connections == 0 {
            return Err("max_connections: must be positive".into());
        }
        Ok(())
    }

    /// The engines' context length in tokens.
    pub fn context_tokens(&self) -> usize {
        self.context_tokens.unwrap_or(8192)
    }

    /// The bounds on client connections of both listeners.
    /// The API threads to start: `api_threads`, or one per CPU.
    pub fn api_threads(&self) -> usize {
        match self.api_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    pub fn serve_limits(&self) -> kvgate_http::ServeLimits {
        kvgate_http::ServeLimits {
            max_connections: self.max_connections,
            header_timeout: std::time::Duration::from_secs(self.header_timeout_secs),
            write_stall: std::time::Duration::from_secs(self.stall_timeout_secs),
        }
    }

    /// The deployment seed the engines hash with (zeros when unset, as on the engines).
    pub fn seed(&self) -> [u8; 32] {
        self.hash_seed
            .as_deref()
            .and_then(|s| parse_seed(s).ok())
            .unwrap_or([0; 32])
    }
}

/// Secrets never reach a log line or an error message through `{:?}`: tokens, the pepper and the
/// seed are elided, and the Redis URL loses its password.
impl std::fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = |v: &Option<String>| v.as_ref().map(|_| "<redacted>");
        f.debug_struct("GatewayConfig")
            .field("listen", &self.listen)
            .field("admin_listen", &self.admin_listen)
            .field("redis", &self.redis.as_deref().map(redact_url))
            .field("model", &self.model)
            .field("model_id", &self.model_id)
            .field("operator_token", &secret(&self.operator_token))
            .field("engine_token", &secret(&self.engine_token))
            .field("pepper", &secret(&self.pepper))
            .field("hash_seed", &secret(&self.hash_seed))
            .field("block_size", &self.block_size)
            .field("kv_dtype", &self.kv_dtype)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("context_tokens", &self.context_tokens)
            .field("request_timeout_secs", &self.request_timeout_secs)
            .field("first_byte_timeout_secs", &self.first_byte_timeout_secs)
            .field("header_timeout_secs", &self.header_timeout_secs)
            .field("max_connections", &self.max_connections)
            .field("stall_timeout_secs", &self.stall_timeout_secs)
            .field("stop_grace_ms", &self.stop_grace_ms)
            .field("key_cache_ttl_secs", &self.key_cache_ttl_secs)
            .field("routing", &self.routing)
            .field("engines", &self.engines)
            .field("prices", &self.prices)
            .field("usage_ledger", &self.usage_ledger)
            .field("tracing", &self.tracing)
            .finish()
    }
}

/// A URL fit to print: any password in it is replaced by `***`
/// (`redis://:s3cret@host:6379/0` -> `redis://:***@host:6379/0`).
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
    if user.len() == userinfo.len() && !userinfo.is_empty() && !userinfo.contains(':') {
        // A lone user part is a password in Redis URLs (`redis://password@host`).
        return format!("{scheme}://***@{host}{tail}");
    }
    format!("{scheme}://{user}:***@{host}{tail}")
}

fn parse_seed(s: &str) -> Result<[u8; 32], String> {
    kvgate_protocol::parse_hash_seed(s)
        .ok_or_else(|| "hash_seed (KVGATE_HASH_SEED): expected 64 hex digits".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_env_and_errors_name_the_field() {
        let c = GatewayConfig::parse("").unwrap();
        assert_eq!(c.routing.policy, crate::routing::Policy::Prefix);
        assert_eq!(c.block_size, 16);
        for (text, field) in [
            ("listen = \"x\"", "listen"),
            ("[routing]\npolicy = \"random\"", "expected one of `prefix`"),
            ("hash_seed = \"abc\"", "hash_seed"),
            ("pepper = \"short\"", "pepper"),
            ("[[engines]]\nname = \"e\"\nurl = \"ftp://x\"", "engines[0]"),
            ("bogus = 1", "bogus"),
        ] {
            let e = GatewayConfig::parse(text).unwrap_err();
            assert!(e.contains(field), "{e} should name {field}");
        }
        let mut c = GatewayConfig {
            operator_token: Some("file".into()),
            ..GatewayConfig::default()
        };
        c.apply_env(|k| (k == "KVGATE_OPERATOR_TOKEN").then(|| "env".to_owned()));
        assert_eq!(c.operator_token.as_deref(), Some("env"));
    }

    #[test]
    fn secrets_are_redacted_in_debug_output() {
        let c = GatewayConfig {
            redis: Some("redis://kvgate:hunter2-password@redis:6379/0".into()),
            operator_token: Some("op-secret-token".into()),
            engine_token: Some("engine-secret-token".into()),
            pepper: Some("pepper-secret-0123456789".into()),
            ..GatewayConfig::default()
        };
        let shown = format!("{c:?}");
        for secret in ["hunter2", "op-secret", "engine-secret", "pepper-secret"] {
            assert!(!shown.contains(secret), "{secret} leaked: {shown}");
        }
        assert!(shown.contains("redis://kvgate:***@redis:6379/0"), "{shown}");
    }

    #[test]
    fn a_stop_grace_past_a_minute_is_refused() {
        let mut c = GatewayConfig {
            pepper: Some("pepper-0123456789abcdef".into()),
            ..GatewayConfig::default()
        };
        assert_eq!(c.stop_grace_ms, 1000);
        c.stop_grace_ms = 0;
        assert_eq!(c.validate(), Ok(()));
        c.stop_grace_ms = MAX_STOP_GRACE_MS + 1;
        let e = c.validate().unwrap_err();
        assert!(e.starts_with("stop_grace_ms:"), "{e}");
    }

    #[test]
    fn redact_url_hides_passwords_only() {
        for (url, shown) in [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
            ("redis://user:pw@h:1", "redis://user:***@h:1"),
            ("redis://pw@h", "redis://***@h"),
            ("rediss://u:p@ss@h/0?x=1", "rediss://u:***@h/0?x=1"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}

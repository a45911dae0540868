//! The gateway's Prometheus metrics (every name the dashboards and alert rules use), rendered in
//! the text exposition format on the admin listener's `/metrics`. Tenant labels only carry configured tenant ids
//! (unauthenticated requests count under `tenant="-"`), so label sets stay bounded.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

pub use kvgate_http::metrics::Histogram;

const LATENCY: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const BLOCKS: &[f64] = &[
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
];

/// A counter family keyed by label values.
#[derive(Debug, Default)]
struct Family(Mutex<BTreeMap<Vec<String>, f64>>);

impl Family {
    fn add(&self, labels: &[&str], v: f64) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(labels.iter().map(|s| (*s).to_owned()).collect())
            .or_insert(0.0) += v;
    }

    fn set(&self, labels: &[&str], v: f64) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(labels.iter().map(|s| (*s).to_owned()).collect(), v);
    }

    fn remove(&self, labels: &[&str]) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(&labels.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
    }

    fn render(&self, out: &mut String, name: &str, kind: &str, help: &str, keys: &[&str]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for (values, v) in m.iter() {
            let labels: Vec<String> = keys
                .iter()
                .zip(values)
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {v}", labels.join(","));
        }
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Every gateway metric.
#[derive(Debug)]
pub struct Metrics {
    requests: Family,
    route_decisions: Family,
    /// Requests sent with a peer hint, by the peer engine.
    peer_hints: Family,
    ratelimited: Family,
    engine_up: Family,
    engine_inflight: Family,
    engine_draining: Family,
    /// Share of a monthly budget used, by tenant and budget (`tenant` or `key:{id}`).
    budget_used: Family,
    /// Budget thresholds (80, 100 percent) crossed, by tenant, budget and percent.
    budget_alerts: Family,
    budget_refused: Family,
    pub budget_check_failures: AtomicU64,
    /// The usage ledger: records written to the store, dropped (buffer full), waiting.
    pub ledger_written: AtomicU64,
    pub ledger_dropped: AtomicU64,
    pub ledger_pending: AtomicU64,
    pub auth_failures: AtomicU64,
    pub store_errors: AtomicU64,
    pub request_duration: Histogram,
    pub routed_prefix_blocks: Histogram,
    /// Other metrics served on the same `/metrics`: `kvgate serve`'s in-process engine.
    also: std::sync::OnceLock<Also>,
}

/// Renders more metrics in the text format, appended to the gateway's own.
struct Also(Box<dyn Fn() -> String + Send + Sync>);

impl std::fmt::Debug for Also {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Also(<metrics renderer>)")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Family::default(),
            route_decisions: Family::default(),
            peer_hints: Family::default(),
            ratelimited: Family::default(),
            engine_up: Family::default(),
            engine_inflight: Family::default(),
            engine_draining: Family::default(),
            budget_used: Family::default(),
            budget_alerts: Family::default(),
            budget_refused: Family::default(),
            budget_check_failures: AtomicU64::new(0),
            ledger_written: AtomicU64::new(0),
            ledger_dropped: AtomicU64::new(0),
            ledger_pending: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            store_errors: AtomicU64::new(0),
            request_duration: Histogram::new(LATENCY),
            routed_prefix_blocks: Histogram::new(BLOCKS),
            also: std::sync::OnceLock::new(),
        }
    }
}

impl Metrics {
    pub fn request(&self, tenant: &str, code: u16) {
        self.requests.add(&[tenant, &code.to_string()], 1.0);
    }

    pub fn route_decision(&self, reason: &str) {
        self.route_decisions.add(&[reason], 1.0);
    }

    /// A request went with a hint to fetch its prefix from engine `peer`.
    pub fn peer_hint(&self, peer: &str) {
        self.peer_hints.add(&[peer], 1.0);
    }

    pub fn ratelimited(&self, tenant: &str) {
        self.ratelimited.add(&[tenant], 1.0);
    }

    /// How much of a monthly budget is used (1.0: all of it), as last seen at an admission.
    pub fn budget_used(&self, tenant: &str, budget: &str, ratio: f64) {
        self.budget_used.set(&[tenant, budget], ratio);
    }

    /// A budget crossed `percent` (80 or 100) this month.
    pub fn budget_alert(&self, tenant: &str, budget: &str, percent: u8) {
        self.budget_alerts
            .add(&[tenant, budget, &percent.to_string()], 1.0);
    }

    /// A request refused because a budget was used up.
    pub fn budget_refused(&self, tenant: &str) {
        self.budget_refused.add(&[tenant], 1.0);
    }

    /// Engine gauges, refreshed before each scrape.
    pub fn engine(&self, name: &str, up: bool, inflight: u64, draining: bool) {
        self.engine_up.set(&[name], f64::from(u8::from(up)));
        self.engine_inflight.set(&[name], inflight as f64);
        self.engine_draining
            .set(&[name], f64::from(u8::from(draining)));
    }

    pub fn forget_engine(&self, name: &str) {
        self.engine_up.remove(&[name]);
        self.engine_inflight.remove(&[name]);
        self.engine_draining.remove(&[name]);
    }

    /// Text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        self.requests.render(
            &mut out,
            "kvgate_gateway_requests_total",
            "counter",
            "Requests answered, by tenant and HTTP status.",
            &["tenant", "code"],
        );
        self.request_duration.render(
            &mut out,
            "kvgate_gateway_request_duration_seconds",
            "Time from request to the end of the response.",
        );
        self.route_decisions.render(
            &mut out,
            "kvgate_gateway_route_decisions_total",
            "counter",
            "Routing decisions by reason.",
            &["reason"],
        );
        self.peer_hints.render(
            &mut out,
            "kvgate_gateway_peer_hints_total",
            "counter",
            "Requests routed away from the engine holding their prefix, told to fetch it from there.",
            &["engine"],
        );
        self.routed_prefix_blocks.render(
            &mut out,
            "kvgate_gateway_routed_prefix_blocks",
            "Prefix blocks already cached on the chosen engine, per routed request.",
        );
        self.engine_up.render(
            &mut out,
            "kvgate_gateway_engine_up",
            "gauge",
            "Whether the engine passes health checks (1) or not (0).",
            &["engine"],
        );
        self.engine_inflight.render(
            &mut out,
            "kvgate_gateway_engine_inflight",
            "gauge",
            "Requests this gateway has in flight on the engine.",
            &["engine"],
        );
        self.engine_draining.render(
            &mut out,
            "kvgate_gateway_engine_draining",
            "gauge",
            "Whether the engine is draining (1) or not (0).",
            &["engine"],
        );
        self.ratelimited.render(
            &mut out,
            "kvgate_gateway_ratelimited_total",
            "counter",
            "Requests refused by a tenant's rate limits.",
            &["tenant"],
        );
        self.budget_used.render(
            &mut out,
            "kvgate_gateway_budget_used_ratio",
            "gauge",
            "Share of a monthly budget used (1 = all), by tenant and budget (tenant or key:ID).",
            &["tenant", "budget"],
        );
        self.budget_alerts.render(
            &mut out,
            "kvgate_gateway_budget_alerts_total",
            "counter",
            "Monthly budgets crossing 80% and 100%, by tenant, budget and percent.",
            &["tenant", "budget", "percent"],
        );
        self.budget_refused.render(
            &mut out,
            "kvgate_gateway_budget_refused_total",
            "counter",
            "Requests refused because a monthly budget was used up.",
            &["tenant"],
        );
        let _ = writeln!(
            out,
            "# HELP kvgate_gateway_usage_records_pending Usage records waiting for the store.\n\
             # TYPE kvgate_gateway_usage_records_pending gauge\n\
             kvgate_gateway_usage_records_pending {}",
            self.ledger_pending.load(Ordering::Relaxed)
        );
        for (name, help, v) in [
            (
                "kvgate_gateway_usage_records_total",
                "Usage records written to the store.",
                &self.ledger_written,
            ),
            (
                "kvgate_gateway_usage_records_dropped_total",
                "Usage records dropped because the ledger's buffer was full (the store was down).",
                &self.ledger_dropped,
            ),
            (
                "kvgate_gateway_budget_check_failures_total",
                "Budget checks the store could not answer (the request was admitted).",
                &self.budget_check_failures,
            ),
            (
                "kvgate_gateway_auth_failures_total",
                "Requests with a missing, wrong or revoked API key.",
                &self.auth_failures,
            ),
            (
                "kvgate_gateway_store_errors_total",
                "Store (Redis) calls that failed.",
                &self.store_errors,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        if let Some(also) = self.also.get() {
            out.push_str(&(also.0)());
        }
        out
    }

    /// Serves `render`'s metrics on this gateway's `/metrics` too (set once; later calls are
    /// ignored). Their names must not repeat the gateway's.
    pub fn also_export(&self, render: impl Fn() -> String + Send + Sync + 'static) {
        let _ = self.also.set(Also(Box::new(render)));
    }
}

//! The engine's Prometheus metrics: every name the dashboards and alert rules use, declared here
//! once with its help text, rendered in the text exposition format on `GET /metrics`.
//!
//! The engine thread updates gauges and counters once per step and observes latencies as tokens
//! go out; a scrape locks the state briefly and renders it. Labels are bounded: states and modes
//! are fixed enums, tenants are the ids the gateway sends (configured tenants).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// A cumulative histogram with fixed buckets.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const DURATION_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Everything `/metrics` shows.
#[derive(Debug, Clone)]
pub struct MetricsState {
    pub blocks_used: u64,
    pub blocks_cached: u64,
    pub blocks_free: u64,
    pub blocks_capacity: u64,
    pub filled_slots: u64,
    pub block_size: u64,
    pub queried_tokens: BTreeMap<String, u64>,
    pub hit_tokens: BTreeMap<String, u64>,
    pub evicted_blocks: u64,
    pub cow_copies: u64,
    pub preemptions_recompute: u64,
    pub preemptions_swap: u64,
    pub swapped_out_blocks: u64,
    pub swapped_in_blocks: u64,
    pub running: u64,
    pub waiting: u64,
    pub swapped: u64,
    pub tenant_blocks: BTreeMap<String, u64>,
    /// KV block quota per tenant (tenants with a quota only).
    pub tenant_quota: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Streams cancelled because their client stopped reading.
    pub stalled_clients: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub request_duration: Histogram,
    pub batch_tokens: Histogram,
    pub model: String,
    pub device: String,
}

/// Shared between the engine thread (writer) and the HTTP handlers (readers).
#[derive(Debug)]
pub struct Metrics {
    state: Mutex<MetricsState>,
}

impl Metrics {
    pub fn new(model: &str, device: &str, block_size: usize, capacity: usize) -> Self {
        Metrics {
            state: Mutex::new(MetricsState {
                blocks_used: 0,
                blocks_cached: 0,
                blocks_free: capacity as u64,
                blocks_capacity: capacity as u64,
                filled_slots: 0,
                block_size: block_size as u64,
                queried_tokens: BTreeMap::new(),
                hit_tokens: BTreeMap::new(),
                evicted_blocks: 0,
                cow_copies: 0,
                preemptions_recompute: 0,
                preemptions_swap: 0,
                swapped_out_blocks: 0,
                swapped_in_blocks: 0,
                running: 0,
                waiting: 0,
                swapped: 0,
                tenant_blocks: BTreeMap::new(),
                tenant_quota: BTreeMap::new(),
                prompt_tokens: 0,
                generation_tokens: 0,
                stalled_clients: 0,
                ttft: Histogram::new(LATENCY_BUCKETS),
                itl: Histogram::new(LATENCY_BUCKETS),
                request_duration: Histogram::new(DURATION_BUCKETS),
                batch_tokens: Histogram::new(TOKEN_BUCKETS),
                model: model.to_owned(),
                device: device.to_owned(),
            }),
        }
    }

    /// Runs `f` on the state under the lock (a poisoned lock still yields the data: metrics
    /// must never take the engine down).
    pub fn update<R>(&self, f: impl FnOnce(&mut MetricsState) -> R) -> R {
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.update(|m| render(m))
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn scalar(out: &mut String, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {v}");
}

fn by_label(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    label: &str,
    values: &[(&str, f64)],
) {
    header(out, name, kind, help);
    for (l, v) in values {
        let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {v}", escape(l));
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn tenant_map(m: &BTreeMap<String, u64>) -> Vec<(&str, f64)> {
    m.iter().map(|(k, v)| (k.as_str(), *v as f64)).collect()
}

fn render(m: &MetricsState) -> String {
    let mut o = String::with_capacity(8192);
    let cap = m.blocks_capacity.max(1) as f64;
    by_label(
        &mut o,
        "kvgate_kv_blocks",
        "gauge",
        "KV blocks by state.",
        "state",
        &[
            ("used", m.blocks_used as f64),
            ("cached", m.blocks_cached as f64),
            ("free", m.blocks_free as f64),
        ],
    );
    scalar(
        &mut o,
        "kvgate_kv_blocks_capacity",
        "gauge",
        "KV blocks in the device pool.",
        m.blocks_capacity,
    );
    scalar(
        &mut o,
        "kvgate_kv_usage_ratio",
        "gauge",
        "Allocated KV blocks over capacity.",
        m.blocks_used as f64 / cap,
    );
    let allocated_slots = (m.blocks_used * m.block_size).max(1) as f64;
    let util = if m.blocks_used == 0 {
        0.0
    } else {
        m.filled_slots as f64 / allocated_slots
    };
    scalar(
        &mut o,
        "kvgate_kv_token_utilization_ratio",
        "gauge",
        "Filled token slots over allocated slots.",
        util,
    );
    by_label(
        &mut o,
        "kvgate_prefix_cache_queried_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        "tenant",
        &tenant_map(&m.queried_tokens),
    );
    by_label(
        &mut o,
        "kvgate_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
        "tenant",
        &tenant_map(&m.hit_tokens),
    );
    scalar(
        &mut o,
        "kvgate_kv_evicted_blocks_total",
        "counter",
        "Cached blocks evicted for reuse.",
        m.evicted_blocks,
    );
    scalar(
        &mut o,
        "kvgate_kv_cow_copies_total",
        "counter",
        "Copy-on-write block copies.",
        m.cow_copies,
    );
    by_label(
        &mut o,
        "kvgate_preemptions_total",
        "counter",
        "Preempted sequence groups by mode.",
        "mode",
        &[
            ("recompute", m.preemptions_recompute as f64),
            ("swap", m.preemptions_swap as f64),
        ],
    );
    by_label(
        &mut o,
        "kvgate_swapped_blocks_total",
        "counter",
        "Blocks copied between device and host.",
        "direction",
        &[
            ("out", m.swapped_out_blocks as f64),
            ("in", m.swapped_in_blocks as f64),
        ],
    );
    by_label(
        &mut o,
        "kvgate_sequences",
        "gauge",
        "Sequence groups by state.",
        "state",
        &[
            ("running", m.running as f64),
            ("waiting", m.waiting as f64),
            ("swapped", m.swapped as f64),
        ],
    );
    by_label(
        &mut o,
        "kvgate_tenant_kv_blocks",
        "gauge",
        "KV blocks held per tenant.",
        "tenant",
        &tenant_map(&m.tenant_blocks),
    );
    by_label(
        &mut o,
        "kvgate_tenant_kv_quota_blocks",
        "gauge",
        "KV block quota per tenant (set by the gateway; tenants without a quota are absent).",
        "tenant",
        &tenant_map(&m.tenant_quota),
    );
    scalar(
        &mut o,
        "kvgate_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests.",
        m.prompt_tokens,
    );
    scalar(
        &mut o,
        "kvgate_generation_tokens_total",
        "counter",
        "Generated tokens.",
        m.generation_tokens,
    );
    scalar(
        &mut o,
        "kvgate_stalled_clients_total",
        "counter",
        "Streaming requests cancelled (their KV blocks freed) because the client read nothing \
         while its output buffer stayed full for the stall timeout.",
        m.stalled_clients,
    );
    for (name, help, h) in [
        (
            "kvgate_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            &m.ttft,
        ),
        (
            "kvgate_inter_token_latency_seconds",
            "Time between tokens of one sequence.",
            &m.itl,
        ),
        (
            "kvgate_request_duration_seconds",
            "Time from arrival to the last token.",
            &m.request_duration,
        ),
        (
            "kvgate_batch_tokens",
            "Tokens per engine step.",
            &m.batch_tokens,
        ),
    ] {
        header(&mut o, name, "histogram", help);
        h.render(&mut o, name);
    }
    header(&mut o, "kvgate_engine_info", "gauge", "Engine identity.");
    let _ = writeln!(
        o,
        "kvgate_engine_info{{model=\"{}\",block_size=\"{}\",device=\"{}\"}} 1",
        escape(&m.model),
        m.block_size,
        escape(&m.device)
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_design_metric() {
        let m = Metrics::new("smollm2", "cpu", 16, 100);
        m.update(|s| {
            s.ttft.observe(0.02);
            s.hit_tokens.insert("acme".into(), 32);
        });
        let text = m.render();
        for name in [
            "kvgate_kv_blocks{state=\"used\"}",
            "kvgate_kv_blocks_capacity 100",
            "kvgate_kv_usage_ratio",
            "kvgate_kv_token_utilization_ratio",
            "kvgate_prefix_cache_hit_tokens_total{tenant=\"acme\"} 32",
            "kvgate_kv_evicted_blocks_total",
            "kvgate_kv_cow_copies_total",
            "kvgate_preemptions_total{mode=\"swap\"}",
            "kvgate_swapped_blocks_total{direction=\"in\"}",
            "kvgate_sequences{state=\"waiting\"}",
            "kvgate_prompt_tokens_total",
            "kvgate_generation_tokens_total",
            "kvgate_stalled_clients_total 0",
            "kvgate_time_to_first_token_seconds_bucket{le=\"0.025\"} 1",
            "kvgate_inter_token_latency_seconds_count",
            "kvgate_request_duration_seconds_sum",
            "kvgate_batch_tokens_bucket",
            "kvgate_engine_info{model=\"smollm2\",block_size=\"16\",device=\"cpu\"} 1",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}

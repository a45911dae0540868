//! The engine's Prometheus metrics: every name the dashboards and alert rules use, declared here
//! once with its help text, rendered from the worker's [`Stats`] in the text exposition format on
//! `GET /metrics`. A scrape locks the statistics briefly and renders them.

pub use crate::stats::{EngineStats, Stats};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The Prometheus text exposition of `stats`.
pub fn render(stats: &Stats) -> String {
    stats.update(|m| {
        // The peer rate as of now: its old samples are forgotten.
        m.tiers.peer_rate();
        render_stats(m)
    })
}

/// Appends the peer transfers running now: `fetching` as the requester, `serving` for peers.
pub fn render_transfers(out: &mut String, fetching: usize, serving: usize) {
    by_label(
        out,
        "kvgate_kv_peer_transfers",
        "gauge",
        "Peer transfers running now, by this engine's role in them.",
        "role",
        &[("fetching", fetching as f64), ("serving", serving as f64)],
    );
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

fn render_stats(m: &EngineStats) -> String {
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
    tier_metrics(&mut o, &m.tiers);
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
    scalar(
        &mut o,
        "kvgate_grammar_masks_total",
        "counter",
        "Token masks computed for constrained outputs (one per constrained sample per step).",
        m.grammar_masks,
    );
    scalar(
        &mut o,
        "kvgate_grammar_mask_seconds_total",
        "counter",
        "Time spent computing those masks, beside the forward passes.",
        m.grammar_mask_seconds,
    );
    scalar(
        &mut o,
        "kvgate_grammar_deferred_decodes_total",
        "counter",
        "Decodes of constrained requests held back a step: their tenant's masks had spent its \
         share of the step's mask time.",
        m.grammar_deferred_decodes,
    );
    scalar(
        &mut o,
        "kvgate_grammar_compiles_total",
        "counter",
        "Structured-output grammars compiled (each tenant's grammar once, while it stays cached).",
        m.grammar_compiles,
    );
    scalar(
        &mut o,
        "kvgate_grammar_compile_seconds_total",
        "counter",
        "Time spent compiling those grammars, on the blocking pool.",
        m.grammar_compile_seconds,
    );
    scalar(
        &mut o,
        "kvgate_grammar_cache_hits_total",
        "counter",
        "Requests whose grammar was already compiled for their tenant.",
        m.grammar_cache_hits,
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
        (
            "kvgate_step_seconds",
            "Wall time of each engine step, from its forward pass to its last sample (the sum's \
             rate: the share of time the engine spends in steps, on a shared CPU with what other \
             processes take of it).",
            &m.step_seconds,
        ),
    ] {
        h.render(&mut o, name, help);
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

/// The prefix cache's tiers: the device pool's own figures are above; these add the host and
/// disk tiers (`tier` label) and the moves between them.
fn tier_metrics(o: &mut String, t: &crate::stats::TierStats) {
    let pair = |host: u64, disk: u64| [("host", host as f64), ("disk", disk as f64)];
    by_label(
        o,
        "kvgate_kv_tier_blocks",
        "gauge",
        "Cached blocks held in each slower tier.",
        "tier",
        &pair(t.host_blocks, t.disk_blocks),
    );
    by_label(
        o,
        "kvgate_kv_tier_capacity_blocks",
        "gauge",
        "Block slots of each slower tier.",
        "tier",
        &pair(t.host_capacity, t.disk_capacity),
    );
    by_label(
        o,
        "kvgate_kv_tier_bytes",
        "gauge",
        "Bytes of KV held in each slower tier.",
        "tier",
        &pair(t.host_blocks * t.block_bytes, t.disk_blocks * t.block_bytes),
    );
    by_label(
        o,
        "kvgate_kv_tier_hit_tokens_total",
        "counter",
        "Prompt tokens served from a slower tier (or a peer engine) instead of computed.",
        "tier",
        &[
            ("host", t.host_hit_tokens as f64),
            ("disk", t.disk_hit_tokens as f64),
            ("peer", t.peer_hit_tokens as f64),
        ],
    );
    let f = t.peer_fetches;
    by_label(
        o,
        "kvgate_kv_peer_fetches_total",
        "counter",
        "Prefix fetches from peer engines, by how they ended.",
        "result",
        &[
            ("complete", f.complete as f64),
            ("partial", f.partial as f64),
            ("busy", f.busy as f64),
            ("failed", f.failed as f64),
            ("timed_out", f.timed_out as f64),
            ("joined", f.joined as f64),
            ("refused", f.refused as f64),
            ("held_off", f.held_off as f64),
        ],
    );
    scalar(
        o,
        "kvgate_kv_peer_blocks_total",
        "counter",
        "Blocks peer fetches brought (checked, and handed to the host tier).",
        t.peer_blocks,
    );
    scalar(
        o,
        "kvgate_kv_peer_fetch_seconds_per_block",
        "gauge",
        "Median seconds per block of the last minute's fetches from holders, one block more for \
         the ask (the rate the gateway prices fetches here at; 0: none).",
        t.peer_secs_per_block,
    );
    by_label(
        o,
        "kvgate_kv_peer_exports_total",
        "counter",
        "Peer transfers this engine served, and those it refused (at its limit).",
        "result",
        &[
            ("served", t.exports as f64),
            ("refused", t.exports_refused as f64),
        ],
    );
    scalar(
        o,
        "kvgate_kv_peer_exported_blocks_total",
        "counter",
        "Blocks this engine sent to peers.",
        t.exported_blocks,
    );
    scalar(
        o,
        "kvgate_kv_peer_export_waits_total",
        "counter",
        "Asks of peer transfers that waited for this engine to compute the blocks asked for.",
        t.export_waits,
    );
    by_label(
        o,
        "kvgate_kv_tier_promotions_total",
        "counter",
        "Blocks moved up out of a tier (host to device, disk to host).",
        "tier",
        &pair(t.promoted_blocks, t.loaded_blocks),
    );
    by_label(
        o,
        "kvgate_kv_tier_demotions_total",
        "counter",
        "Blocks moved down into a tier (device to host, host to disk).",
        "tier",
        &pair(t.demoted_blocks, t.spilled_blocks),
    );
    scalar(
        o,
        "kvgate_kv_tier_dropped_blocks_total",
        "counter",
        "Cached blocks evicted from the last tier that held them.",
        t.dropped_blocks,
    );
    by_label(
        o,
        "kvgate_kv_tier_load_seconds_total",
        "counter",
        "Time spent moving blocks: host copies (host), disk reads (disk), peer fetches (peer).",
        "tier",
        &[
            ("host", t.copy_seconds),
            ("disk", t.load_seconds),
            ("peer", t.peer_seconds),
        ],
    );
    scalar(
        o,
        "kvgate_kv_tier_disk_loads_total",
        "counter",
        "Prefix loads from the disk tier.",
        t.loads,
    );
    scalar(
        o,
        "kvgate_kv_tier_corrupt_blocks_total",
        "counter",
        "Disk-tier blocks found corrupt or cut short (deleted and recomputed, never served).",
        t.corrupt_blocks,
    );
    scalar(
        o,
        "kvgate_kv_tier_failed_writes_total",
        "counter",
        "Disk-tier writes that failed or found the write queue full.",
        t.failed_writes,
    );
    scalar(
        o,
        "kvgate_kv_tier_disk_up",
        "gauge",
        "1 while the disk tier is on; 0 when it is configured and was turned off (disk full).",
        u64::from(t.disk_up || !t.disk_configured),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_design_metric() {
        let m = Stats::new("smollm2", "cpu", 16, 100);
        m.update(|s| {
            s.ttft.observe(0.02);
            s.hit_tokens.insert("acme".into(), 32);
        });
        let text = render(&m);
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
            "kvgate_step_seconds_sum",
            "kvgate_engine_info{model=\"smollm2\",block_size=\"16\",device=\"cpu\"} 1",
            "kvgate_kv_tier_blocks{tier=\"disk\"} 0",
            "kvgate_kv_tier_hit_tokens_total{tier=\"host\"} 0",
            "kvgate_kv_peer_fetch_seconds_per_block 0",
            "kvgate_kv_tier_disk_up 1",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}

#!/usr/bin/env python3
"""Writes the kvgate Grafana dashboards (kv-cache.json, engine.json, gateway.json) next to this
file. The JSON files are committed; edit this script and rerun it rather than editing them by
hand. `--check` exits non-zero when a committed file differs from what this script writes
(scripts/check-ops runs it).

Every metric name here is one the engine or the gateway exports: scripts/check-ops checks each
against live scrapes of both.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DS = {"type": "prometheus", "uid": "${datasource}"}
ENGINE = 'instance=~"$instance"'
TENANT = 'instance=~"$instance", tenant=~"$tenant"'
RATE = "[$__rate_interval]"


def target(expr, legend, ref, instant=False):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": not instant}
    if instant:
        t["instant"] = True
        t["format"] = "table"
    return t


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self):
        self.x, self.y, self.row_h, self.next_id, self.panels = 0, 0, 0, 1, []

    def add(self, title, targets, w=12, h=8, kind="timeseries", unit="short", description="",
            stack=False, minmax=None, thresholds=None, options=None, overrides=None):
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        refs = "ABCDEFGHIJ"
        defaults = {"unit": unit}
        if minmax:
            defaults["min"], defaults["max"] = minmax
        if kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 25 if stack else 10,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            }
        if thresholds:
            defaults["thresholds"] = {
                "mode": "absolute",
                "steps": [{"color": "green", "value": None}]
                + [{"color": c, "value": v} for v, c in thresholds],
            }
            if kind == "timeseries":
                defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
        panel = {
            "id": self.next_id,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "targets": [dict(t, refId=refs[i]) for i, t in enumerate(targets)],
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": options
            or (
                {
                    "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"},
                }
                if kind == "timeseries"
                else {}
            ),
        }
        self.panels.append(panel)
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        return panel


def q(expr, legend="{{instance}}"):
    return target(expr, legend, "A")


def quantiles(metric, selector, by=""):
    grp = f"le{', ' + by if by else ''}"
    return [
        q(
            f"histogram_quantile({p}, sum by ({grp}) (rate({metric}_bucket{{{selector}}}{RATE})))",
            f"p{int(p * 100)}" + (f" {{{{{by}}}}}" if by else ""),
        )
        for p in (0.5, 0.9, 0.99)
    ]


def variables(instance_metric, tenant_metric):
    def query_var(name, label, metric, extra=""):
        query = f"label_values({metric}{extra}, {label})"
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }

    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {"selected": False, "text": "Prometheus", "value": "prometheus"},
                "hide": 0,
                "refresh": 1,
                "regex": "",
            },
            query_var("instance", "instance", instance_metric),
            query_var("tenant", "tenant", tenant_metric, '{instance=~"$instance"}'),
        ]
    }


def dashboard(uid, title, description, layout, instance_metric, tenant_metric, tags):
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvgate"] + tags,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {"type": "dashboards", "tags": ["kvgate"], "asDropdown": True, "title": "kvgate",
             "includeVars": True, "keepTime": True}
        ],
        "templating": variables(instance_metric, tenant_metric),
        "panels": layout.panels,
    }


def kv_cache():
    L = Layout()
    L.add("KV usage (allocated / capacity)", [q(f"kvgate_kv_usage_ratio{{{ENGINE}}}")],
          unit="percentunit", minmax=(0, 1), thresholds=[(0.8, "orange"), (0.95, "red")],
          description="Allocated KV blocks over the pool's capacity, per engine. Above 95% for "
          "10 minutes alerts (KvgateKvUsageHigh).")
    L.add("Token utilization (filled / allocated slots)",
          [q(f"kvgate_kv_token_utilization_ratio{{{ENGINE}}}")], unit="percentunit",
          minmax=(0, 1), description="Filled token slots over allocated slots: what paged "
          "allocation wastes is only the partial last block of each sequence.")
    L.add("KV blocks by state", [q(f"sum by (state) (kvgate_kv_blocks{{{ENGINE}}})", "{{state}}"),
                                 q(f"sum(kvgate_kv_blocks_capacity{{{ENGINE}}})", "capacity")],
          stack=True, description="used: held by running sequences; cached: free but still "
          "hashed, so a later prompt can hit them; free: empty. Stacked, they add up to capacity.",
          overrides=[{"matcher": {"id": "byName", "options": "capacity"},
                      "properties": [{"id": "custom.stacking", "value": {"mode": "none"}},
                                     {"id": "custom.fillOpacity", "value": 0},
                                     {"id": "custom.lineStyle",
                                      "value": {"fill": "dash", "dash": [10, 10]}}]}])
    hit = "kvgate_prefix_cache_hit_tokens_total"
    queried = "kvgate_prefix_cache_queried_tokens_total"
    L.add("Prefix-cache hit rate per engine",
          [q(f"sum by (instance) (rate({hit}{{{TENANT}}}{RATE}))\n  /\n"
             f"sum by (instance) (rate({queried}{{{TENANT}}}{RATE}))")],
          unit="percentunit", minmax=(0, 1),
          description="Prompt tokens found in the prefix cache over prompt tokens looked up.")
    L.add("Prefix-cache hit rate per tenant",
          [q(f"sum by (tenant) (rate({hit}{{{TENANT}}}{RATE}))\n  /\n"
             f"sum by (tenant) (rate({queried}{{{TENANT}}}{RATE}))", "{{tenant}}")],
          unit="percentunit", minmax=(0, 1),
          description="Tenants are isolated by default (their own cache scope): a tenant only "
          "hits its own prefixes, or those of its shared scope.")
    L.add("Prompt tokens looked up / hit per second",
          [q(f"sum(rate({queried}{{{TENANT}}}{RATE}))", "queried"),
           q(f"sum(rate({hit}{{{TENANT}}}{RATE}))", "hit")], unit="short",
          description="Prefill tokens the prefix cache saved (hit) out of all prompt tokens.")
    L.add("Evictions and copy-on-write copies /s",
          [q(f"sum by (instance) (rate(kvgate_kv_evicted_blocks_total{{{ENGINE}}}{RATE}))",
             "evicted {{instance}}"),
           q(f"sum by (instance) (rate(kvgate_kv_cow_copies_total{{{ENGINE}}}{RATE}))",
             "cow {{instance}}")], w=8, unit="short",
          description="Evicted: cached blocks reused for new data (their prefix is lost). CoW: "
          "shared partial blocks copied before a write (n > 1 sampling).")
    L.add("Preemptions /s by mode",
          [q(f"sum by (mode) (rate(kvgate_preemptions_total{{{ENGINE}}}{RATE}))", "{{mode}}")],
          w=8, unit="short", description="Sequence groups preempted because the pool ran out "
          "of blocks (recompute or swap).")
    L.add("Swapped blocks /s",
          [q(f"sum by (direction) (rate(kvgate_swapped_blocks_total{{{ENGINE}}}{RATE}))",
             "{{direction}}")], w=8, unit="short",
          description="Blocks copied between device and host by swap preemption.")
    L.add("Slower tiers: cached blocks held",
          [q(f"sum by (tier) (kvgate_kv_tier_blocks{{{ENGINE}}})", "{{tier}}"),
           q(f"sum by (tier) (kvgate_kv_tier_capacity_blocks{{{ENGINE}}})", "capacity {{tier}}")],
          w=8, unit="short",
          description="Cached blocks evicted from the device pool live on in the host tier, "
          "then on disk, until hit again (and promoted back) or evicted from the last tier.",
          overrides=[{"matcher": {"id": "byRegexp", "options": "capacity .*"},
                      "properties": [{"id": "custom.fillOpacity", "value": 0},
                                     {"id": "custom.lineStyle",
                                      "value": {"fill": "dash", "dash": [10, 10]}}]}])
    L.add("Prompt tokens served from a slower tier /s",
          [q(f"sum by (tier) (rate(kvgate_kv_tier_hit_tokens_total{{{ENGINE}}}{RATE}))",
             "{{tier}}")], w=8, unit="short",
          description="Prefill the host and disk tiers saved: tokens loaded back instead of "
          "computed again.")
    L.add("Tier moves /s and disk faults",
          [q(f"sum by (tier) (rate(kvgate_kv_tier_demotions_total{{{ENGINE}}}{RATE}))",
             "down to {{tier}}"),
           q(f"sum by (tier) (rate(kvgate_kv_tier_promotions_total{{{ENGINE}}}{RATE}))",
             "up from {{tier}}"),
           q(f"sum(rate(kvgate_kv_tier_corrupt_blocks_total{{{ENGINE}}}{RATE}))", "corrupt"),
           q(f"min(kvgate_kv_tier_disk_up{{{ENGINE}}})", "disk up")], w=8, unit="short",
          description="Blocks demoted (device to host, host to disk) and promoted back; disk "
          "blocks that failed their checksum (deleted, recomputed); the disk tier is off "
          "(disk up = 0) after a full disk, which alerts (KvgateDiskTierOff).")
    L.add("Peer fetches /s by result, and transfers running",
          [q(f"sum by (result) (rate(kvgate_kv_peer_fetches_total{{{ENGINE}}}{RATE}))",
             "{{result}}"),
           q(f"sum by (role) (kvgate_kv_peer_transfers{{{ENGINE}}})", "running: {{role}}")],
          w=16, unit="short",
          description="Prefix fetches from peer engines (the gateway names the peer that holds "
          "a request's prefix) by how they ended: complete or partial (blocks came), joined "
          "(another request's transfer brought them), refused (no transfer slot freed in time), "
          "held_off (the peer failed moments before), busy, failed, timed_out; and the "
          "transfers running now, as requester and for peers (at most 2 of each).")
    L.add("Peer fetch time per block",
          [q(f"max by (instance) (kvgate_kv_peer_fetch_seconds_per_block{{{ENGINE}}})",
             "{{instance}}")],
          w=8, unit="s",
          description="Each engine's measured peer rate: the median seconds per block (one "
          "block more for the ask) of its fetches from holders in the last minute, waits for a "
          "transfer slot included. The gateway prices this engine's fetches at it; 0 when it "
          "fetched nothing lately (the gateway then uses the other engines' median).")
    L.add("KV blocks per tenant (against quota)",
          [q(f"max by (tenant) (kvgate_tenant_kv_blocks{{{TENANT}}})", "{{tenant}}"),
           q(f"max by (tenant) (kvgate_tenant_kv_quota_blocks{{{TENANT}}})", "quota {{tenant}}"),
           q(f"max(kvgate_kv_blocks_capacity{{{ENGINE}}})", "capacity")],
          w=24, stack=False,
          description="Blocks held by each tenant's running sequences on its busiest engine "
          "(the quota applies per engine), the tenant's KV block quota (kvgate admin tenants --kv-quota; dashed), and the pool's "
          "capacity.",
          overrides=[{"matcher": {"id": "byRegexp", "options": "quota .*|capacity"},
                      "properties": [{"id": "custom.stacking", "value": {"mode": "none"}},
                                     {"id": "custom.fillOpacity", "value": 0},
                                     {"id": "custom.lineStyle",
                                      "value": {"fill": "dash", "dash": [10, 10]}}]}])
    return dashboard("kvgate-kv-cache", "kvgate / KV cache",
                     "Paged KV cache of the engines: usage, prefix-cache hits, evictions, "
                     "preemptions and per-tenant blocks.", L,
                     "kvgate_engine_info", "kvgate_prefix_cache_queried_tokens_total", ["kv"])


def engine():
    L = Layout()
    L.add("Time to first token", quantiles("kvgate_time_to_first_token_seconds", ENGINE),
          unit="s", description="From arrival at the engine to the first token, p50/p90/p99.")
    L.add("Inter-token latency", quantiles("kvgate_inter_token_latency_seconds", ENGINE),
          unit="s", description="Time between two tokens of one sequence, p50/p90/p99.")
    L.add("Request duration",
          quantiles("kvgate_request_duration_seconds", ENGINE)
          + [q(f"sum(rate(kvgate_request_duration_seconds_sum{{{ENGINE}}}{RATE}))\n  /\n"
               f"sum(rate(kvgate_request_duration_seconds_count{{{ENGINE}}}{RATE}))", "mean")],
          unit="s", description="From arrival to the last token.")
    L.add("Requests finished /s",
          [q(f"sum by (instance) (rate(kvgate_request_duration_seconds_count{{{ENGINE}}}{RATE}))")],
          unit="reqps")
    L.add("Prompt and generation tokens /s",
          [q(f"sum by (instance) (rate(kvgate_prompt_tokens_total{{{ENGINE}}}{RATE}))",
             "prompt {{instance}}"),
           q(f"sum by (instance) (rate(kvgate_generation_tokens_total{{{ENGINE}}}{RATE}))",
             "generation {{instance}}")], unit="short")
    L.add("Prompt tokens /s per tenant",
          [q(f"sum by (tenant) (rate(kvgate_prefix_cache_queried_tokens_total{{{TENANT}}}{RATE}))",
             "{{tenant}}")], unit="short",
          description="Prompt tokens each tenant sends (every prompt token is looked up in the "
          "prefix cache once).")
    L.add("Sequences by state",
          [q(f"sum by (state) (kvgate_sequences{{{ENGINE}}})", "{{state}}")], unit="short",
          description="Running: in the batch. Waiting: queued for blocks or a batch slot. "
          "Swapped: preempted to host memory.")
    L.add("Batch tokens per step",
          quantiles("kvgate_batch_tokens", ENGINE)
          + [q(f"sum(rate(kvgate_batch_tokens_sum{{{ENGINE}}}{RATE}))\n  /\n"
               f"sum(rate(kvgate_batch_tokens_count{{{ENGINE}}}{RATE}))", "mean")],
          unit="short", description="Tokens (prefill chunks plus decodes) per engine step.")
    L.add("Engine steps /s",
          [q(f"sum by (instance) (rate(kvgate_batch_tokens_count{{{ENGINE}}}{RATE}))")],
          unit="short")
    L.add("Engine busy",
          [q(f"sum by (instance) (rate(kvgate_step_seconds_sum{{{ENGINE}}}{RATE}))")],
          unit="percentunit",
          description="The share of wall time each engine spends in its steps (forward pass "
          "to last sample; on a CPU shared with other processes, their time in it counts). "
          "Near 100%, the engine is the bottleneck; well below it while requests wait, the "
          "time goes elsewhere (transfers, the network, clients).")
    L.add("Engines", [target(f"kvgate_engine_info{{{ENGINE}}}", "", "A", instant=True)],
          kind="table", unit="none", options={"showHeader": True},
          description="Model, block size and device of each engine.")
    return dashboard("kvgate-engine", "kvgate / Engine",
                     "Engine latency, throughput, queues and batches.", L,
                     "kvgate_engine_info", "kvgate_prefix_cache_queried_tokens_total", ["engine"])


def gateway():
    L = Layout()
    req = "kvgate_gateway_requests_total"
    L.add("Requests /s by tenant",
          [q(f"sum by (tenant) (rate({req}{{{TENANT}}}{RATE}))", "{{tenant}}")], unit="reqps")
    L.add("Requests /s by status code",
          [q(f"sum by (code) (rate({req}{{{TENANT}}}{RATE}))", "{{code}}")], unit="reqps")
    L.add("Request latency",
          quantiles("kvgate_gateway_request_duration_seconds", ENGINE), unit="s",
          description="Whole request through the gateway, streaming included, p50/p90/p99.")
    L.add("5xx ratio",
          [q(f'sum(rate({req}{{{TENANT}, code=~"5.."}}{RATE}))\n  /\n'
             f"sum(rate({req}{{{TENANT}}}{RATE}))", "5xx")],
          unit="percentunit", thresholds=[(0.05, "red")],
          description="Above 5% for 5 minutes alerts (KvgateGateway5xxRatioHigh).")
    L.add("Route decisions /s by reason",
          [q(f"sum by (reason) (rate(kvgate_gateway_route_decisions_total{{{ENGINE}}}{RATE}))",
             "{{reason}}")], stack=True, unit="short",
          description="prefix: an engine held the longest matching prefix; affinity: "
          "rendezvous hash of the tenant's system prompt; least_loaded / round_robin / "
          "consistent_hash: fallbacks.")
    L.add("Matched prefix blocks per routed request",
          quantiles("kvgate_gateway_routed_prefix_blocks", ENGINE), unit="short",
          description="Blocks of the request's prefix already cached on the chosen engine.")
    L.add("Engines up",
          [q(f"max by (engine) (kvgate_gateway_engine_up{{{ENGINE}}})", "{{engine}}")],
          w=8, kind="state-timeline", unit="none",
          options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                   "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False}},
          thresholds=[(1, "green")],
          description="As the gateways' health checks see them (1 = up).")
    L.add("In-flight requests per engine",
          [q(f"sum by (engine) (kvgate_gateway_engine_inflight{{{ENGINE}}})", "{{engine}}")],
          w=8, unit="short")
    L.add("Draining engines",
          [q(f"max by (engine) (kvgate_gateway_engine_draining{{{ENGINE}}})", "{{engine}}")],
          w=8, unit="none", minmax=(0, 1),
          description="1 while an engine drains. Draining with requests in flight for 15 "
          "minutes alerts (KvgateDrainStuck).")
    L.add("Rate-limited requests /s by tenant",
          [q(f"sum by (tenant) (rate(kvgate_gateway_ratelimited_total{{{TENANT}}}{RATE}))",
             "{{tenant}}")], unit="reqps")
    L.add("Authentication failures /s",
          [q(f"sum by (instance) (rate(kvgate_gateway_auth_failures_total{{{ENGINE}}}{RATE}))")],
          unit="reqps", description="Requests with a missing, unknown or revoked API key.")
    L.add("Monthly budget used by tenant",
          [q(f"max by (tenant, budget) (kvgate_gateway_budget_used_ratio{{{TENANT}}})",
             "{{tenant}} {{budget}}")],
          unit="percentunit", minmax=(0, 1.2),
          description="Share of each monthly budget used (tenant, or key:ID). 80% and 100% "
          "alert (KvgateBudgetNearlyUsed, KvgateBudgetUsedUp); at 100% requests get 429 "
          "insufficient_quota.")
    L.add("Budget refusals /s by tenant",
          [q(f"sum by (tenant) (rate(kvgate_gateway_budget_refused_total{{{TENANT}}}{RATE}))",
             "{{tenant}}")], unit="reqps")
    L.add("Usage ledger",
          [q(f"sum(rate(kvgate_gateway_usage_records_total{{{ENGINE}}}{RATE}))", "written /s"),
           q(f"sum(rate(kvgate_gateway_usage_records_dropped_total{{{ENGINE}}}{RATE}))",
             "dropped /s"),
           q(f"sum(kvgate_gateway_usage_records_pending{{{ENGINE}}})", "waiting")],
          unit="short", description="Records written to the store, waiting for it (the store "
          "is slow or down), and dropped once the gateway's buffer of 50,000 is full.")
    return dashboard("kvgate-gateway", "kvgate / Gateway",
                     "Gateway traffic, latency, routing and engine health.", L,
                     "kvgate_gateway_engine_up", "kvgate_gateway_requests_total", ["gateway"])


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for name, build in (("kv-cache.json", kv_cache), ("engine.json", engine),
                        ("gateway.json", gateway)):
        text = json.dumps(build(), indent=2) + "\n"
        path = os.path.join(HERE, name)
        if check:
            try:
                with open(path) as f:
                    if f.read() != text:
                        stale.append(name)
            except FileNotFoundError:
                stale.append(name)
        else:
            with open(path, "w") as f:
                f.write(text)
    if stale:
        print(f"dashboards out of date: {', '.join(stale)} (run dashboards/generate.py)")
        sys.exit(1)


if __name__ == "__main__":
    main()

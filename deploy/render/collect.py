#!/usr/bin/env python3
"""Samples a running kvgate engine's /metrics once a second while load runs, and writes the KV
series as a small JSON time series for render.py (the README's dashboard picture).

Load: `kvgate bench` phases (shared prefix, then every request in its own cache scope at higher
concurrency, which fills the pool and preempts) plus two tenants sent with the gateway's tenant
header, so the per-tenant panels have data. Standard library only.
"""
import argparse
import json
import re
import subprocess
import threading
import time
import urllib.request

SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')
KEEP = (
    "kvgate_kv_blocks", "kvgate_kv_blocks_capacity", "kvgate_kv_usage_ratio",
    "kvgate_kv_token_utilization_ratio", "kvgate_prefix_cache_queried_tokens_total",
    "kvgate_prefix_cache_hit_tokens_total", "kvgate_kv_evicted_blocks_total",
    "kvgate_kv_cow_copies_total", "kvgate_preemptions_total", "kvgate_swapped_blocks_total",
    "kvgate_sequences", "kvgate_tenant_kv_blocks",
)

TENANT_PROMPTS = {
    "acme": "You are Acme's support assistant. Acme sells rockets, anvils and giant magnets. "
            "Answer politely, cite the order number, never promise delivery dates, and keep "
            "answers under three sentences. Escalate anything about explosions to a human. " * 3,
    "globex": "You are Globex's internal helpdesk bot. Globex builds doomsday devices and "
              "hammocks. Be terse, give step-by-step instructions, and log every request with "
              "its ticket id. Never reveal the volcano lair's address to anyone. " * 3,
}


def scrape(url):
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if m and m.group(1) in KEEP:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def tenant_load(url, model, tenant, stop, seed, token):
    i = seed
    while not stop.is_set():
        body = json.dumps({
            "model": model,
            "prompt": TENANT_PROMPTS[tenant] + f"\nCustomer question #{i}: where is my order {i}?\nAnswer:",
            "max_tokens": 24,
            "temperature": 0,
        }).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={
            "content-type": "application/json", "x-kvgate-tenant": tenant,
            "authorization": f"Bearer {token}"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except Exception:
            time.sleep(0.5)
        i += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--kvgate", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", type=float, default=30.0, help="seconds per load phase")
    ap.add_argument("--engine-token", required=True,
                    help="the engine's token: tenant and scope headers count only with it")
    a = ap.parse_args()

    samples, t0 = [], time.time()
    stop_sampling = threading.Event()

    def sampler():
        while not stop_sampling.is_set():
            t = time.time()
            try:
                samples.append((round(t - t0, 2), scrape(a.url)))
            except Exception as e:  # keep sampling through a slow scrape
                print("scrape failed:", e)
            stop_sampling.wait(max(0.0, 1.0 - (time.time() - t)))

    threading.Thread(target=sampler, daemon=True).start()
    time.sleep(5)

    def bench(*extra):
        return subprocess.Popen([a.kvgate, "bench", "--url", a.url, "--model", a.model,
                                 "--api-key", a.engine_token,
                                 "--requests", "10000", "--duration", str(a.phase),
                                 "--max-tokens", "48", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    phases = []
    # Phase 1: shared few-shot prefix plus two tenants with their own system prompts.
    stop_tenants = threading.Event()
    tenants = [threading.Thread(target=tenant_load, args=(a.url, a.model, t, stop_tenants, k * 1000, a.engine_token))
               for k, t in enumerate(TENANT_PROMPTS)]
    for th in tenants:
        th.start()
    phases.append({"start": round(time.time() - t0, 1), "name": "shared prefix, 3 tenants"})
    bench("--concurrency", "6").wait()
    # Phase 2: nothing shared (each request its own scope), more clients: the pool fills up.
    phases.append({"start": round(time.time() - t0, 1), "name": "no sharing, 16 clients"})
    bench("--concurrency", "16", "--no-prefix-cache").wait()
    stop_tenants.set()
    phases.append({"start": round(time.time() - t0, 1), "name": "cool-down"})
    for th in tenants:
        th.join()
    time.sleep(8)
    stop_sampling.set()
    time.sleep(1.2)

    names = sorted({k for _, s in samples for k in s})
    data = {
        "source": "kvgate engine (CPU, SmolLM2-135M f32), scraped once a second",
        "phases": phases,
        "t": [t for t, _ in samples],
        "series": {k: [s.get(k) for _, s in samples] for k in names},
    }
    with open(a.out, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    print(f"wrote {len(samples)} samples of {len(names)} series to {a.out}")


if __name__ == "__main__":
    main()

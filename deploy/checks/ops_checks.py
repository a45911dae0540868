#!/usr/bin/env python3
"""The checks of scripts/check-ops that need more than a command line: dashboards, metric names
against live scrapes, rendered Kubernetes manifests, the compose file and Dockerfiles. Each subcommand prints what it checked and exits non-zero on any failure.

Runs in target/venv (PyYAML, kubernetes-validate, grafana-foundation-sdk).
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print(f"  FAIL {msg}")


def done(what):
    if FAILURES:
        print(f"{what}: {len(FAILURES)} failure(s)")
        sys.exit(1)
    print(f"{what}: ok")


def rel(p):
    return os.path.relpath(p, ROOT)


# ---------------------------------------------------------------------------------------------
# PromQL: the metric names an expression reads.

PROMQL_WORDS = {
    # aggregations, operators and modifiers
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "by", "without", "on", "ignoring", "group_left", "group_right", "and",
    "or", "unless", "offset", "bool", "atan2", "inf", "nan",
}
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metrics(expr):
    """Metric names in a PromQL expression (Grafana's $variables allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    s = re.sub(r"#[^\n]*", "", s)  # comments
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # dashboard variables
    s = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?(ms|s|m|h|d|w|y)?\b", " ", s)  # numbers, durations
    names = set()
    for m in IDENT.finditer(s):
        word = m.group(0)
        rest = s[m.end():].lstrip()
        if word.lower() in PROMQL_WORDS or rest.startswith("("):
            continue  # a keyword or a function call
        names.add(word)
    return names


def variable_metrics(query):
    """Metric names in a Grafana Prometheus variable query."""
    q = query.get("query", "") if isinstance(query, dict) else str(query)
    m = re.match(r"\s*label_values\(\s*(.*),\s*\w+\s*\)\s*$", q, re.S)
    if m:
        return promql_metrics(m.group(1))
    m = re.match(r"\s*label_names\(\s*(.*)\)\s*$", q, re.S)
    if m:
        return promql_metrics(m.group(1)) if m.group(1).strip() else set()
    m = re.match(r"\s*query_result\((.*)\)\s*$", q, re.S)
    if m:
        return promql_metrics(m.group(1))
    m = re.match(r"\s*metrics\((.*)\)\s*$", q, re.S)
    if m:
        return set()
    return promql_metrics(q)


def dashboard_exprs(d):
    """(where, kind, expr) for every panel target and query variable of a dashboard."""
    out = []
    for p in all_panels(d):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('id')} {p.get('title')!r} target {t.get('refId')}",
                        "expr", t.get("expr", "")))
    for v in d.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            out.append((f"variable ${v.get('name')}", "var", v.get("query")))
    return out


def all_panels(d):
    out = []
    for p in d.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows
    return out


# ---------------------------------------------------------------------------------------------
# dashboards


def check_dashboards(args):
    files = sorted(glob.glob(os.path.join(args.dir, "*.json")))
    if not files:
        fail(f"no dashboards in {rel(args.dir)}")
    for f in files:
        name = rel(f)
        try:
            d = json.load(open(f))
        except ValueError as e:
            fail(f"{name}: not JSON: {e}")
            continue
        if d.get("schemaVersion", 0) < 39:
            fail(f"{name}: schemaVersion {d.get('schemaVersion')} (want 39 or newer)")
        if not d.get("uid") or not d.get("title"):
            fail(f"{name}: needs a uid and a title")
        variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
        for want in ("datasource", "instance", "tenant"):
            if want not in variables:
                fail(f"{name}: no ${want} variable")
        ds = variables.get("datasource", {})
        if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
            fail(f"{name}: $datasource must be a datasource variable of type prometheus")
        defined = set(variables) | {"__rate_interval", "__interval", "__range", "__all",
                                    "__interval_ms", "__range_s", "__dashboard"}
        ids, panels = set(), all_panels(d)
        if not panels:
            fail(f"{name}: no panels")
        for p in panels:
            where = f"{name}: panel {p.get('id')} {p.get('title')!r}"
            if p.get("type") == "row":
                continue
            pid = p.get("id")
            if not isinstance(pid, int):
                fail(f"{where}: no integer id")
            elif pid in ids:
                fail(f"{where}: duplicate panel id {pid}")
            ids.add(pid)
            if not p.get("title"):
                fail(f"{where}: no title")
            gp = p.get("gridPos", {})
            if not all(isinstance(gp.get(k), int) for k in ("x", "y", "w", "h")) or \
                    gp.get("x", 0) + gp.get("w", 0) > 24:
                fail(f"{where}: bad gridPos {gp}")
            pds = p.get("datasource")
            if not isinstance(pds, dict) or pds.get("uid") != "${datasource}":
                fail(f"{where}: datasource must be {{uid: ${{datasource}}}}, got {pds}")
            targets = p.get("targets")
            if not targets:
                fail(f"{where}: no targets")
                continue
            refs = [t.get("refId") for t in targets]
            if len(set(refs)) != len(refs) or not all(refs):
                fail(f"{where}: refIds must be set and unique: {refs}")
            for t in targets:
                tds = t.get("datasource")
                if not isinstance(tds, dict) or tds.get("uid") != "${datasource}":
                    fail(f"{where} target {t.get('refId')}: datasource must be ${{datasource}}")
                if not t.get("expr", "").strip():
                    fail(f"{where} target {t.get('refId')}: empty expr")
        # Every $variable used anywhere is defined.
        text = json.dumps(d)
        for m in re.finditer(r"\$\{?(\w+)(?::\w+)?\}?", text):
            if m.group(1) not in defined:
                fail(f"{name}: uses ${m.group(1)}, which is not a variable of the dashboard")
        roundtrip(name, d)
        print(f"  {name}: {len(panels)} panels, variables {sorted(variables)}")
    done("dashboards")


def roundtrip(name, d):
    """Parse with Grafana's own schema types (grafana-foundation-sdk) and serialize back: every
    field of the file must survive, which catches misspelt or misplaced fields."""
    try:
        from grafana_foundation_sdk.cog import plugins
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
        from grafana_foundation_sdk.models import dashboard as dm
    except ImportError as e:
        fail(f"{name}: grafana-foundation-sdk not importable ({e})")
        return
    plugins.register_default_plugins()
    try:
        back = json.loads(json.dumps(dm.Dashboard.from_json(d), cls=JSONEncoder))
    except Exception as e:  # noqa: BLE001 - any parse error is a failure
        fail(f"{name}: Grafana schema rejects it: {e!r}")
        return
    for path in lost(d, back):
        fail(f"{name}: {path} does not survive a round trip through Grafana's schema")


def lost(a, b, path=""):
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return [path or "/"]
        out = []
        for k, v in a.items():
            out += [f"{path}.{k}"] if k not in b else lost(v, b[k], f"{path}.{k}")
        return out
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [path]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in lost(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path} ({a!r} became {b!r})"]


# ---------------------------------------------------------------------------------------------
# metric names against scrapes

# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                     "scrape_samples_post_metric_relabeling", "scrape_series_added", "ALERTS",
                     "ALERTS_FOR_STATE"}


def scrape_names(path):
    """Names a text exposition defines: sample names, and the declared families (a family with
    no series yet, such as a per-tenant counter before any tenant, still exists) with their
    histogram/summary suffixes."""
    names, families = set(), {}
    for line in open(path):
        line = line.strip()
        m = re.match(r"#\s+TYPE\s+(\S+)\s+(\S+)", line)
        if m:
            families[m.group(1)] = m.group(2)
            continue
        if not line or line.startswith("#"):
            continue
        m = IDENT.match(line)
        if m:
            names.add(m.group(0))
    for fam, kind in families.items():
        names.add(fam)
        if kind == "histogram":
            names |= {fam + "_bucket", fam + "_sum", fam + "_count"}
        elif kind == "summary":
            names |= {fam + "_sum", fam + "_count"}
    return names


def check_metrics(args):
    defined = set()
    for s in args.scrape:
        n = scrape_names(s)
        print(f"  {rel(s)}: {len(n)} names")
        if not n:
            fail(f"{rel(s)}: no metrics")
        defined |= n
    used = []  # (where, name)
    for f in sorted(glob.glob(os.path.join(args.dashboards, "*.json"))):
        d = json.load(open(f))
        for where, kind, q in dashboard_exprs(d):
            names = promql_metrics(q) if kind == "expr" else variable_metrics(q)
            if kind == "expr" and not names:
                fail(f"{rel(f)} {where}: reads no metric")
            used += [(f"{rel(f)} {where}", n) for n in names]
    recorded = set()
    for f in args.rules:
        for g in yaml.safe_load(open(f))["groups"]:
            for r in g["rules"]:
                if "record" in r:
                    recorded.add(r["record"])
    for f in args.rules:
        for g in yaml.safe_load(open(f))["groups"]:
            for r in g["rules"]:
                what = r.get("record") or r.get("alert")
                names = promql_metrics(r["expr"])
                if not names:
                    fail(f"{rel(f)} {what}: reads no metric")
                used += [(f"{rel(f)} {what}", n) for n in names]
    known = defined | recorded | PROMETHEUS_SERIES
    missing = [(w, n) for w, n in used if n not in known]
    for w, n in missing:
        fail(f"{w}: {n} is in no scrape and is no recording rule")
    names = sorted({n for _, n in used})
    print(f"  {len(used)} uses of {len(names)} names checked: "
          f"{len([n for n in names if n in defined])} scraped, "
          f"{len([n for n in names if n in recorded])} recorded, "
          f"{len([n for n in names if n in PROMETHEUS_SERIES])} from Prometheus itself")
    done("metric names")


# ---------------------------------------------------------------------------------------------
# rendered Kubernetes manifests

CRDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("monitoring.coreos.com/v1", "ServiceMonitor")}


def pod_spec(o):
    spec = o.get("spec", {})
    if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return spec.get("template", {}).get("spec", {}), spec.get("template", {}).get("metadata", {})
    return None, None


def check_k8s(args):
    docs = [d for d in yaml.safe_load_all(open(args.rendered)) if d]
    name = f"{args.overlay} overlay"
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d["metadata"]["name"])
    print(f"  {name}: {len(docs)} objects: " + ", ".join(f"{k} x{len(v)}" for k, v in sorted(kinds.items())))

    # 1. kubernetes-validate (strict) on every built-in kind, offline, one file per object.
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, d in enumerate(docs):
            if (d["apiVersion"], d["kind"]) in CRDS:
                continue
            p = os.path.join(tmp, f"{i:03d}-{d['kind']}-{d['metadata']['name']}.yaml")
            with open(p, "w") as f:
                yaml.safe_dump(d, f)
            files.append(p)
        r = subprocess.run([args.kubernetes_validate, "--strict", "--quiet", "-k", args.k8s_version]
                           + files, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{name}: kubernetes-validate {args.k8s_version} failed:\n{r.stdout}{r.stderr}")
        else:
            print(f"  {name}: kubernetes-validate --strict -k {args.k8s_version}: "
                  f"{len(files)} objects valid")
    skipped = [f"{d['kind']}/{d['metadata']['name']}" for d in docs
               if (d["apiVersion"], d["kind"]) in CRDS]
    print(f"  {name}: CRDs without a schema offline, checked structurally: {', '.join(skipped)}")

    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    required = [("Deployment", "kvgate-gateway"), ("HorizontalPodAutoscaler", "kvgate-gateway"),
                ("Service", "kvgate-gateway"), ("PodDisruptionBudget", "kvgate-gateway"),
                ("StatefulSet", "kvgate-engine"), ("Service", "kvgate-engine"),
                ("StatefulSet", "kvgate-redis"), ("Job", "kvgate-migrate"),
                ("NetworkPolicy", "kvgate-engine"), ("PodMonitor", "kvgate-engine"),
                ("PodMonitor", "kvgate-gateway"), ("PrometheusRule", "kvgate")]
    for k in required:
        if k not in by:
            fail(f"{name}: no {k[0]}/{k[1]}")
    secrets = [d for d in docs if d["kind"] == "Secret"]
    cms = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    secret_keys = {d["metadata"]["name"]: set(d.get("data", {})) | set(d.get("stringData", {}))
                   for d in secrets}
    for want in ("operator-token", "engine-token", "pepper", "hash-seed"):
        if not any(want in keys for keys in secret_keys.values()):
            fail(f"{name}: no Secret holds {want}")

    # 2. Workloads: references resolve, pods are non-root, images are pinned.
    for d in docs:
        spec, meta = pod_spec(d)
        if spec is None:
            continue
        where = f"{name}: {d['kind']}/{d['metadata']['name']}"
        psc = spec.get("securityContext", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            csc = c.get("securityContext", {})
            if not (psc.get("runAsNonRoot") or csc.get("runAsNonRoot")):
                fail(f"{where} {c['name']}: not runAsNonRoot")
            if csc.get("allowPrivilegeEscalation") is not False:
                fail(f"{where} {c['name']}: allowPrivilegeEscalation must be false")
            img = c.get("image", "")
            if ":" not in img.split("/")[-1] or img.endswith(":latest"):
                fail(f"{where} {c['name']}: image {img!r} has no pinned tag")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref.get("key") not in secret_keys.get(ref.get("name"), set()):
                    fail(f"{where} {c['name']}: env {e['name']} names a missing secret key {ref}")
        for v in spec.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] not in cms:
                fail(f"{where}: volume {v['name']} names a missing ConfigMap {v['configMap']['name']}")
        sel = d.get("spec", {}).get("selector", {}).get("matchLabels")
        if sel and not all(meta.get("labels", {}).get(k) == v for k, v in sel.items()):
            fail(f"{where}: selector {sel} does not match its pod template")
    pods = [(d, pod_spec(d)[1].get("labels", {})) for d in docs if pod_spec(d)[0] is not None]
    for d in docs:
        if d["kind"] in ("Service", "PodDisruptionBudget", "NetworkPolicy", "PodMonitor"):
            s = d.get("spec", {})
            sel = s.get("selector", {}) if d["kind"] == "Service" else \
                s.get("selector", s.get("podSelector", {})).get("matchLabels", {})
            if sel and not any(all(l.get(k) == v for k, v in sel.items()) for _, l in pods):
                fail(f"{name}: {d['kind']}/{d['metadata']['name']} selects no pod")

    # 3. Engines: readiness on /health, liveness on /health/live (it fails for a stopped or stalled
    #    engine thread, never for a draining engine), a preStop drain that waits, a grace period.
    eng = by.get(("StatefulSet", "kvgate-engine"))
    if eng:
        spec = eng["spec"]["template"]["spec"]
        c = spec["containers"][0]
        rp = c.get("readinessProbe", {}).get("httpGet", {})
        if rp.get("path") != "/health":
            fail(f"{name}: engine readinessProbe is not GET /health")
        lp = c.get("livenessProbe", {}).get("httpGet", {})
        if lp.get("path") == "/health":
            fail(f"{name}: engine livenessProbe on /health would restart draining engines")
        elif lp.get("path") != "/health/live":
            fail(f"{name}: engine livenessProbe is not GET /health/live (a TCP check passes "
                 f"while the engine thread is dead)")
        elif lp.get("port") != rp.get("port"):
            fail(f"{name}: engine liveness and readiness probes use different ports")
        pre = " ".join(c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", []))
        for want in ("/admin/drain", "/admin/status", "drained"):
            if want not in pre:
                fail(f"{name}: engine preStop does not use {want}")
        m = re.search(r"\+\s*(\d+)\s*\)\)", pre)
        wait = int(m.group(1)) if m else None
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if wait is None or grace < wait + 30:
            fail(f"{name}: terminationGracePeriodSeconds {grace} must exceed the preStop wait "
                 f"({wait} s) by 30 s or more")
        gpu = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if args.overlay == "gpu" and not gpu:
            fail(f"{name}: engines have no nvidia.com/gpu limit")
        if args.overlay != "gpu" and gpu:
            fail(f"{name}: CPU engines ask for nvidia.com/gpu")
        cm = next((v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v), None)
        cmd = next((d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm), None)
        if cmd:
            conf = tomllib.loads(fill_placeholders(cmd["data"]["engine.toml"]))
            want_dev = "cuda" if args.overlay == "gpu" else "cpu"
            if conf.get("device") != want_dev:
                fail(f"{name}: engine.toml device {conf.get('device')!r}, want {want_dev!r}")

    # 4. NetworkPolicy: engines take traffic only from gateways (and the monitoring namespace).
    np = by.get(("NetworkPolicy", "kvgate-engine"))
    if np:
        for rule in np["spec"].get("ingress", []):
            peers = rule.get("from")
            if not peers:
                fail(f"{name}: an engine ingress rule allows every source")
                continue
            for peer in peers:
                pod = peer.get("podSelector", {}).get("matchLabels", {})
                ns = peer.get("namespaceSelector", {}).get("matchLabels", {})
                if pod and pod.get("app.kubernetes.io/component") != "gateway":
                    fail(f"{name}: engines accept traffic from {pod}")
                if ns and ns.get("kubernetes.io/metadata.name") != "monitoring":
                    fail(f"{name}: engines accept traffic from namespace {ns}")
                if not pod and not ns:
                    fail(f"{name}: engine ingress peer {peer} is too wide")

    # 5. CRDs, structurally.
    for d in docs:
        if d["kind"] == "PodMonitor":
            s = d["spec"]
            if not s.get("selector", {}).get("matchLabels") or not s.get("podMetricsEndpoints"):
                fail(f"{name}: PodMonitor/{d['metadata']['name']} needs a selector and endpoints")
            for ep in s.get("podMetricsEndpoints", []):
                sel = s["selector"]["matchLabels"]
                ports = {p.get("name") for dd, l in pods if all(l.get(k) == v for k, v in sel.items())
                         for c in pod_spec(dd)[0]["containers"] for p in c.get("ports", [])}
                if ep.get("port") not in ports:
                    fail(f"{name}: PodMonitor/{d['metadata']['name']} port {ep.get('port')} is no "
                         f"port of the pods it selects ({sorted(ports)})")
                if ep.get("path") != "/metrics":
                    fail(f"{name}: PodMonitor/{d['metadata']['name']} path is not /metrics")
        if d["kind"] == "PrometheusRule":
            groups = []
            for f in ("recording.yml", "alerts.yml"):
                groups += yaml.safe_load(open(os.path.join(ROOT, "deploy/prometheus/rules", f)))["groups"]
            if d["spec"].get("groups") != groups:
                fail(f"{name}: PrometheusRule differs from deploy/prometheus/rules "
                     "(run deploy/prometheus/sync-k8s-rules.py)")
    done(f"kubernetes ({args.overlay})")


# ---------------------------------------------------------------------------------------------
# config placeholders (the config files themselves go through kvgate's own parsers in
# tests/tests/shipped_configs.rs)

def fill_placeholders(text):
    return re.sub(r"\$\{(KVGATE_[A-Z0-9_]+)\}",
                  lambda m: "00" * 32 if m.group(1) == "KVGATE_HASH_SEED" else "placeholder", text)


# ---------------------------------------------------------------------------------------------
# docker-compose.yml

def check_compose(args):
    path = args.file
    base = os.path.dirname(os.path.abspath(path))
    text = open(path).read()
    for m in re.finditer(r"\$\{([A-Z0-9_]+)(:?-[^}]*)?\}", text):
        if not m.group(2):
            fail(f"{rel(path)}: ${{{m.group(1)}}} has no default: `up` would need the variable set")
    # Interpolate the defaults as `docker compose config` would.
    text = re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", text)
    c = yaml.safe_load(text)
    services = c.get("services", {})
    volumes = set((c.get("volumes") or {}).keys())
    for want in ("redis", "migrate", "gateway", "prometheus", "grafana"):
        if want not in services:
            fail(f"{rel(path)}: no {want} service")
    engines = [s for s, v in services.items() if v.get("command", [None])[0] == "engine"]
    if len(engines) < 2:
        fail(f"{rel(path)}: {len(engines)} engine services, want 2")
    for name, s in services.items():
        where = f"{rel(path)} service {name}"
        if not s.get("image") and not s.get("build"):
            fail(f"{where}: neither image nor build")
        img = s.get("image", "")
        if img and (":" not in img or img.endswith(":latest")):
            fail(f"{where}: image {img!r} is not pinned")
        b = s.get("build")
        if b:
            ctx = os.path.normpath(os.path.join(base, b.get("context", ".")))
            df = os.path.join(ctx, b.get("dockerfile", "Dockerfile"))
            if not os.path.isdir(ctx):
                fail(f"{where}: build context {rel(ctx)} missing")
            if not os.path.isfile(df):
                fail(f"{where}: Dockerfile {rel(df)} missing")
        for v in s.get("volumes", []):
            src = v.split(":")[0] if isinstance(v, str) else v.get("source")
            if src.startswith((".", "/")):
                p = os.path.normpath(os.path.join(base, src))
                if not os.path.exists(p):
                    fail(f"{where}: bind mount source {src} ({rel(p)}) missing")
            elif src not in volumes:
                fail(f"{where}: named volume {src} is not declared")
        deps = s.get("depends_on", {})
        for dep, cond in (deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps)):
            if dep not in services:
                fail(f"{where}: depends on unknown service {dep}")
            cond = (cond or {}).get("condition", "service_started")
            if cond == "service_healthy" and "healthcheck" not in services.get(dep, {}) \
                    and not services.get(dep, {}).get("build"):
                fail(f"{where}: waits for {dep} to be healthy, which has no healthcheck")
        env = s.get("environment", {})
        tmpl = env.get("KVGATE_CONFIG_TEMPLATE") if isinstance(env, dict) else None
        if tmpl and not any(isinstance(v, str) and v.split(":")[1] == tmpl for v in s.get("volumes", [])):
            fail(f"{where}: KVGATE_CONFIG_TEMPLATE {tmpl} is not mounted")
        cmd = s.get("command", [])
        if "--config" in cmd:
            target = cmd[cmd.index("--config") + 1]
            if not any(isinstance(v, str) and v.split(":")[1] == target for v in s.get("volumes", [])):
                fail(f"{where}: --config {target} is not mounted")
    print(f"  {rel(path)}: {len(services)} services ({', '.join(services)}), "
          f"{len(volumes)} volumes; mounts and build files exist")
    done("compose")


# ---------------------------------------------------------------------------------------------
# Dockerfiles (beyond hadolint)

def check_dockerfiles(args):
    for f in args.files:
        where = rel(f)
        lines, cur = [], ""
        for raw in open(f):
            line = raw.rstrip("\n")
            if line.strip().startswith("#") and not cur:
                continue
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            cur += line
            if cur.strip():
                lines.append(cur.strip())
            cur = ""
        args_default = {}
        for l in lines:
            m = re.match(r"ARG\s+(\w+)=(\S+)", l)
            if m and m.group(1) not in args_default:
                args_default[m.group(1)] = m.group(2)
        froms = [l for l in lines if l.upper().startswith("FROM ")]
        if len(froms) < 2:
            fail(f"{where}: not multi-stage ({len(froms)} FROM)")
        images = []
        for l in froms:
            img = l.split()[1]
            img = re.sub(r"\$\{?(\w+)\}?", lambda m: args_default.get(m.group(1), m.group(0)), img)
            images.append(img)
            if "$" in img or ":" not in img or img.endswith(":latest"):
                fail(f"{where}: base image {img!r} is not pinned to a version")
        users = [l.split()[1] for l in lines if l.upper().startswith("USER ")]
        if not users or users[-1].split(":")[0] in ("root", "0"):
            fail(f"{where}: the final stage does not switch to a non-root USER")
        last_from = max(i for i, l in enumerate(lines) if l.upper().startswith("FROM "))
        if not any(l.upper().startswith("USER ") for l in lines[last_from:]):
            fail(f"{where}: no USER in the final stage")
        if not any(l.upper().startswith("ENTRYPOINT ") for l in lines[last_from:]):
            fail(f"{where}: no ENTRYPOINT in the final stage")
        for l in lines:
            if l.upper().startswith("COPY ") and "--from=" not in l:
                for src in l.split()[1:-1]:
                    if not src.startswith("--") and not os.path.exists(os.path.join(ROOT, src)):
                        fail(f"{where}: COPY source {src} missing")
        builds = " ".join(l for l in lines if "cargo build" in l)
        if "--release" not in builds or "--locked" not in builds:
            fail(f"{where}: cargo build must be --release --locked")
        rust = args_default.get("RUST_VERSION") or next(
            (re.search(r"rust:(\d+\.\d+(\.\d+)?)", i).group(1) for i in images if i.startswith("rust:")), None)
        if not rust or tuple(int(x) for x in rust.split(".")[:2]) < (1, 89):
            fail(f"{where}: Rust {rust} is older than the workspace's rust-version 1.89")
        if "cuda" in os.path.basename(f):
            if "--features cuda" not in builds:
                fail(f"{where}: does not build --features cuda")
            if not re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu22\.04", images[-1]):
                fail(f"{where}: runtime base {images[-1]} is not nvidia/cuda:12.x.y-runtime-ubuntu22.04")
        ignore = f + ".dockerignore"
        if not os.path.exists(ignore) or "target/" not in open(ignore).read():
            fail(f"{where}: no {rel(ignore)} keeping target/ out of the build context")
        print(f"  {where}: stages {images}, user {users[-1] if users else None}, Rust {rust}")
    done("dockerfiles")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dashboards")
    p.add_argument("dir")
    p.set_defaults(run=check_dashboards)
    p = sub.add_parser("metrics")
    p.add_argument("--scrape", nargs="+", required=True)
    p.add_argument("--dashboards", required=True)
    p.add_argument("--rules", nargs="+", required=True)
    p.set_defaults(run=check_metrics)
    p = sub.add_parser("k8s")
    p.add_argument("rendered")
    p.add_argument("--overlay", required=True)
    p.add_argument("--k8s-version", default="1.32.0")
    p.add_argument("--kubernetes-validate", default="kubernetes-validate")
    p.set_defaults(run=check_k8s)
    p = sub.add_parser("compose")
    p.add_argument("file")
    p.set_defaults(run=check_compose)
    p = sub.add_parser("dockerfiles")
    p.add_argument("files", nargs="+")
    p.set_defaults(run=check_dockerfiles)
    a = ap.parse_args()
    a.run(a)


if __name__ == "__main__":
    main()

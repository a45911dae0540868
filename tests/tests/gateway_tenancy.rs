//! Running a business on the gateway, end to end on real engines and a real Redis: the usage
//! ledger (every admitted request, however it ends, exactly once), monthly budgets enforced
//! across two gateways, key rotation with a grace time under load, per-key limits, scoped
//! operator tokens and the audit log, and the ledger riding out a Redis outage.

use kvgate_tests::gateway::{
    chat_body, config, gated_engine, stream_and_leave, StoreKind, TestGateway,
};
use kvgate_tests::redis::RedisServer;
use kvgate_tests::{request, Response};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Opens a streamed chat request and leaves after the first token's chunk: returns the tokens
/// the client saw (1).
fn stream_and_cut(addr: SocketAddr, key: &str, user: &str) -> u64 {
    let body = chat_body(None, user, r#","max_tokens":48,"stream":true"#);
    stream_and_leave(addr, key, "", &body);
    1
}

/// The ledger's records (all tenants), as the admin API reads them.
fn records(gw: &TestGateway) -> Vec<Value> {
    let r = gw.admin("GET", "/admin/usage/records?limit=10000", "");
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["records"].as_array().cloned().unwrap_or_default()
}

/// Waits until the ledger holds `n` records, then checks that it stays at `n` (no duplicate
/// arrives late).
fn wait_records(gw: &TestGateway, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = records(gw);
        if got.len() >= n {
            std::thread::sleep(Duration::from_millis(300));
            let again = records(gw);
            assert_eq!(again.len(), n, "records: expected exactly {n}");
            return again;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} records after 30 s",
            got.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Redis, an engine and a gateway on that Redis, ready.
fn on_redis() -> (RedisServer, kvgate_tests::Engine, TestGateway) {
    let redis = RedisServer::start();
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(
        config(&[("e0", engine.addr)]),
        StoreKind::Redis(redis.url()),
    );
    gw.wait_ready(1);
    (redis, engine, gw)
}

fn u(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

#[test]
fn the_ledger_records_every_admitted_request_once_however_it_ends() {
    let (_redis, _engine, gw) = on_redis();
    let keys: Vec<(String, String)> = ["alpha", "beta", "gamma"]
        .iter()
        .map(|t| ((*t).to_owned(), gw.tenant(t, json!({}))))
        .collect();
    // 3 tenants x 40 requests: whole answers, whole streams, streams the client cuts after
    // the first token. What the clients saw, per tenant: (prompt, completion) of the finished,
    // and the cut ones' count.
    let per_tenant = 40;
    let mut seen: Vec<(u64, u64, u64)> = vec![(0, 0, 0); keys.len()];
    std::thread::scope(|s| {
        let handles: Vec<_> = keys
            .iter()
            .map(|(_, key)| {
                let gw = &gw;
                s.spawn(move || {
                    let mut mine = (0u64, 0u64, 0u64);
                    for i in 0..per_tenant {
                        let user = format!("Say something about the number {i}.");
                        match i % 4 {
                            0 | 1 => {
                                let r = gw.chat(key, None, &user, r#","max_tokens":3"#);
                                assert_eq!(r.status, 200, "{}", r.body);
                                let usage = &r.json()["usage"];
                                mine.0 += u(usage, "prompt_tokens");
                                mine.1 += u(usage, "completion_tokens");
                            }
                            2 => {
                                let extra = r#","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}"#;
                                let r = gw.chat(key, None, &user, extra);
                                assert_eq!(r.status, 200, "{}", r.body);
                                let data = r.sse_data();
                                let last: Value = data
                                    .iter()
                                    .rev()
                                    .find_map(|d| serde_json::from_str::<Value>(d).ok())
                                    .expect("usage chunk");
                                mine.0 += u(&last["usage"], "prompt_tokens");
                                mine.1 += u(&last["usage"], "completion_tokens");
                            }
                            _ => mine.2 += stream_and_cut(gw.addr, key, &user),
                        }
                    }
                    mine
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            seen[i] = h.join().expect("client");
        }
    });
    // A refused request (bad input) is not billed.
    let r = gw.chat(&keys[0].1, None, "x", r#","max_tokens":-1"#);
    assert_eq!(r.status, 400, "{}", r.body);

    let all = wait_records(&gw, keys.len() * per_tenant);
    let mut ids: Vec<&str> = all.iter().map(|r| r["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), all.len(), "record ids are unique");
    for (i, (tenant, _)) in keys.iter().enumerate() {
        let mine: Vec<&Value> = all.iter().filter(|r| r["tenant"] == *tenant).collect();
        assert_eq!(mine.len(), per_tenant, "{tenant}");
        let done: Vec<&&Value> = mine.iter().filter(|r| r["ending"] == "completed").collect();
        let cut: Vec<&&Value> = mine.iter().filter(|r| r["ending"] == "cancelled").collect();
        assert_eq!(done.len(), per_tenant * 3 / 4, "{tenant}: {mine:?}");
        assert_eq!(cut.len() as u64, seen[i].2, "{tenant}");
        let sum = |rs: &[&&Value], f: &str| rs.iter().map(|r| u(r, f)).sum::<u64>();
        assert_eq!(sum(&done, "prompt_tokens"), seen[i].0, "{tenant}");
        assert_eq!(sum(&done, "completion_tokens"), seen[i].1, "{tenant}");
        for r in &cut {
            // A cut stream is billed what it was served: at least the token the client saw,
            // never more than it asked for.
            let served = u(r, "completion_tokens");
            assert!((1..=48).contains(&served), "{r}");
            assert_eq!(r["status"], 499, "{r}");
            assert!(u(r, "prompt_tokens") > 0, "{r}");
        }
        for r in &done {
            assert_eq!(r["engine"], "e0");
            assert_eq!(r["finish_reason"], "length", "{r}");
            assert!(r["ttft_ms"].as_u64().is_some(), "{r}");
            assert!(u(r, "duration_ms") >= u(r, "ttft_ms"), "{r}");
        }
        // The daily aggregate says the same as the records.
        let day = gw.admin(
            "GET",
            &format!("/admin/usage?tenant={tenant}&group_by=day"),
            "",
        );
        assert_eq!(day.status, 200, "{}", day.body);
        let rows = day.json()["rows"].as_array().cloned().unwrap();
        assert_eq!(rows.len(), 1, "one day: {rows:?}");
        assert_eq!(u(&rows[0], "requests"), per_tenant as u64);
        let all_mine: Vec<&&Value> = mine.iter().collect();
        assert_eq!(
            u(&rows[0], "prompt_tokens"),
            sum(&all_mine, "prompt_tokens")
        );
        assert_eq!(
            u(&rows[0], "completion_tokens"),
            sum(&all_mine, "completion_tokens")
        );
        assert_eq!(
            u(&rows[0], "cached_tokens"),
            sum(&all_mine, "cached_tokens")
        );
    }
    // Grouped by key: one key per tenant, the same totals.
    let by_key = gw.admin("GET", "/admin/usage?group_by=key", "").json();
    assert_eq!(
        by_key["rows"].as_array().unwrap().len(),
        keys.len(),
        "{by_key}"
    );
    assert_eq!(u(&by_key["totals"], "requests"), all.len() as u64);
    // A bad query is the caller's 400, naming the parameter.
    for (q, param) in [
        ("group_by=week", "group_by"),
        ("since=2026-02-30", "since"),
        ("since=2026-12-02&until=2026-12-01", "since"),
        ("tenant=No%20Such", "tenant"),
    ] {
        let r = gw.admin("GET", &format!("/admin/usage?{q}"), "");
        assert_eq!(r.status, 400, "{q}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{q}");
    }
}

#[test]
fn a_budget_stops_its_tenant_within_one_request_across_two_gateways() {
    let redis = RedisServer::start();
    let engine = gated_engine("blocks = 1024");
    let mut cfg = config(&[("e0", engine.addr)]);
    cfg.prices.insert(
        kvgate_tests::MODEL.into(),
        serde_json::from_value(json!({"prompt": 1.0, "cached_prompt": 0.5, "completion": 2.0}))
            .unwrap(),
    );
    let gw1 = TestGateway::start(cfg.clone(), StoreKind::Redis(redis.url()));
    let gw2 = TestGateway::start(cfg, StoreKind::Redis(redis.url()));
    gw1.wait_ready(1);
    gw2.wait_ready(1);
    // One request here is about 35 tokens: a budget of 300 lasts about 8 of them.
    let budget = 300;
    let key = gw1.tenant("metered", json!({"budget": {"monthly_tokens": budget}}));
    let other = gw1.tenant("unmetered", json!({}));
    let mut spent = 0;
    let mut per_request = 0;
    let mut admitted = 0;
    let mut refusal = None;
    for i in 0..40 {
        let gw = if i % 2 == 0 { &gw1 } else { &gw2 };
        let r = gw.chat(&key, None, "Count to three.", r#","max_tokens":3"#);
        if r.status == 429 {
            refusal = Some(r);
            break;
        }
        assert_eq!(r.status, 200, "{}", r.body);
        let usage = &r.json()["usage"];
        per_request = u(usage, "total_tokens");
        spent += per_request;
        admitted += 1;
    }
    let r = refusal.expect("the budget ran out");
    let e = &r.json()["error"];
    assert_eq!(e["code"], "insufficient_quota", "{}", r.body);
    assert!(
        e["message"].as_str().unwrap().contains("tenant 'metered'"),
        "{}",
        r.body
    );
    // Stopped once the budget is used up, give or take the one request in flight.
    assert!(spent >= budget, "refused early: {spent} of {budget}");
    assert!(
        spent < budget + 2 * per_request,
        "{admitted} requests, {spent} tokens of {budget}"
    );
    // Both gateways refuse it now; other tenants are untouched.
    for gw in [&gw1, &gw2] {
        let r = gw.chat(&key, None, "Again?", r#","max_tokens":1"#);
        assert_eq!(r.status, 429, "{}", r.body);
        let r = gw.chat(&other, None, "Hi", r#","max_tokens":1"#);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let metrics = gw1.metrics() + &gw2.metrics();
    for percent in ["80", "100"] {
        let line = format!(
            "kvgate_gateway_budget_alerts_total{{tenant=\"metered\",budget=\"tenant\",percent=\"{percent}\"}}"
        );
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    assert!(metrics.contains("kvgate_gateway_budget_refused_total{tenant=\"metered\"}"));
    // The records carry the cost at the configured prices.
    let recs = records(&gw1);
    let r = recs.iter().find(|r| r["tenant"] == "metered").unwrap();
    let (p, c, o) = (
        u(r, "prompt_tokens"),
        u(r, "cached_tokens"),
        u(r, "completion_tokens"),
    );
    let want = ((p - c) as f64 + c as f64 * 0.5 + o as f64 * 2.0).round() as u64;
    assert_eq!(u(r, "cost_micros"), want, "{r}");

    // A key's own budget stops that key only.
    let capped = gw1.admin(
        "POST",
        "/admin/tenants/unmetered/keys",
        &json!({"name": "capped", "budget": {"monthly_tokens": 1}}).to_string(),
    );
    assert_eq!(capped.status, 201, "{}", capped.body);
    let capped_id = capped.json()["id"].as_str().unwrap().to_owned();
    let capped = capped.json()["key"].as_str().unwrap().to_owned();
    let r = gw2.chat(&capped, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = gw2.chat(&capped, None, "Hi", r#","max_tokens":1"#);
        if r.status == 429 || Instant::now() > deadline {
            break r;
        }
    };
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("key '"), "{}", r.body);
    let r = gw2.chat(&other, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "the tenant's other key: {}", r.body);
    // Rotating a key does not renew its budget: the successor continues the chain's.
    let rotated = gw1.admin(
        "POST",
        &format!("/admin/tenants/unmetered/keys/{capped_id}/rotate"),
        "{}",
    );
    assert_eq!(rotated.status, 201, "{}", rotated.body);
    let successor = rotated.json()["key"].as_str().unwrap().to_owned();
    let r = gw2.chat(&successor, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "insufficient_quota");
}

#[test]
fn a_rotated_key_keeps_working_through_its_grace_then_expires() {
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", engine.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    gw.tenant("acme", json!({}));
    let issued = gw.admin(
        "POST",
        "/admin/tenants/acme/keys",
        &json!({"name": "prod", "labels": {"team": "search"}, "requests_per_min": 1000})
            .to_string(),
    );
    assert_eq!(issued.status, 201, "{}", issued.body);
    let old = issued.json();
    let old_key = old["key"].as_str().unwrap().to_owned();
    let old_id = old["id"].as_str().unwrap().to_owned();

    // Clients keep calling with whatever key they hold while the key rotates under them.
    let current = std::sync::Mutex::new(old_key.clone());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (ok, failed) = std::thread::scope(|s| {
        let load: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    let (mut ok, mut failed) = (0, Vec::new());
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        let key = current.lock().unwrap().clone();
                        let r = gw.chat(&key, None, "Hi", r#","max_tokens":1"#);
                        if r.status == 200 {
                            ok += 1;
                        } else {
                            failed.push(r.body);
                        }
                    }
                    (ok, failed)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let rotated = gw.admin(
            "POST",
            &format!("/admin/tenants/acme/keys/{old_id}/rotate"),
            r#"{"grace_secs": 3}"#,
        );
        assert_eq!(rotated.status, 201, "{}", rotated.body);
        let new = rotated.json();
        assert_eq!(new["replaces"], old_id.as_str());
        assert_eq!(new["name"], "prod", "the successor keeps the name");
        assert_eq!(new["labels"]["team"], "search");
        assert_eq!(new["requests_per_min"], 1000);
        std::thread::sleep(Duration::from_millis(500));
        *current.lock().unwrap() = new["key"].as_str().unwrap().to_owned();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        load.into_iter().fold((0, Vec::new()), |(ok, mut f), h| {
            let (o, mut more) = h.join().unwrap();
            f.append(&mut more);
            (ok + o, f)
        })
    });
    assert!(failed.is_empty(), "failed during rotation: {failed:?}");
    assert!(ok > 3, "{ok} requests");
    // After the grace time, the old key is refused as expired; the new one works.
    std::thread::sleep(Duration::from_secs(3));
    let r = gw.chat(&old_key, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.body.contains("expired"), "{}", r.body);
    let r = gw.chat(&current.lock().unwrap(), None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);
    // The listing shows both, the old one expired and pointing at its successor, both used.
    let keys = gw.admin("GET", "/admin/tenants/acme/keys", "").json();
    let keys = keys["keys"].as_array().unwrap();
    let old_view = keys.iter().find(|k| k["id"] == old_id.as_str()).unwrap();
    assert_eq!(old_view["expired"], true, "{old_view}");
    assert!(old_view["rotated_to"].is_string());
    let new_view = keys
        .iter()
        .find(|k| k["id"] == old_view["rotated_to"])
        .unwrap();
    assert!(old_view["last_used_at"].is_u64(), "{old_view}");
    assert!(new_view["last_used_at"].is_u64(), "{new_view}");
    assert!(
        !keys.iter().any(|k| k.to_string().contains(&old_key[4..])),
        "a listing never shows a key"
    );
    // A rotated key cannot be rotated again; a second rotation goes through its successor.
    let again = gw.admin(
        "POST",
        &format!("/admin/tenants/acme/keys/{old_id}/rotate"),
        "{}",
    );
    assert_eq!(again.status, 400, "{}", again.body);
}

#[test]
fn a_keys_own_limits_and_expiry_apply_to_that_key_only() {
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", engine.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let free = gw.tenant("acme", json!({}));
    let slow = gw.admin(
        "POST",
        "/admin/tenants/acme/keys",
        r#"{"name": "batch", "requests_per_min": 2}"#,
    );
    let slow = slow.json()["key"].as_str().unwrap().to_owned();
    for _ in 0..2 {
        let r = gw.chat(&slow, None, "Hi", r#","max_tokens":1"#);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = gw.chat(&slow, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("of key"), "{}", r.body);
    let r = gw.chat(&free, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(
        r.status, 200,
        "the tenant's other key is not limited: {}",
        r.body
    );

    let short = gw.admin(
        "POST",
        "/admin/tenants/acme/keys",
        r#"{"expires_in_secs": 1}"#,
    );
    let short = short.json()["key"].as_str().unwrap().to_owned();
    let r = gw.chat(&short, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);
    std::thread::sleep(Duration::from_millis(2100));
    let r = gw.chat(&short, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.body.contains("expired"), "{}", r.body);

    // Bad key and tenant fields are 400s naming the field.
    for (path, method, body, param) in [
        (
            "/admin/tenants/acme/keys",
            "POST",
            r#"{"expires_at": 5}"#,
            "expires_at",
        ),
        (
            "/admin/tenants/acme/keys",
            "POST",
            r#"{"expires_at": "soon"}"#,
            "",
        ),
        (
            "/admin/tenants/acme/keys",
            "POST",
            r#"{"budget": {"monthly_cost_usd": -1}}"#,
            "budget.monthly_cost_usd",
        ),
        (
            "/admin/tenants/acme/keys",
            "POST",
            r#"{"labels": {"": "x"}}"#,
            "labels.",
        ),
        (
            "/admin/tenants/acme",
            "PATCH",
            r#"{"prices": {"prompt": -1, "completion": 1}}"#,
            "prices.prompt",
        ),
        (
            "/admin/tenants/acme",
            "PATCH",
            r#"{"budget": {"monthly_tokens": "lots"}}"#,
            "",
        ),
        (
            "/admin/tokens",
            "POST",
            r#"{"name": "ci", "role": "root"}"#,
            "role",
        ),
        (
            "/admin/tokens",
            "POST",
            r#"{"name": "Bad Name", "role": "viewer"}"#,
            "name",
        ),
    ] {
        let r = gw.admin(method, path, body);
        assert_eq!(r.status, 400, "{method} {path} {body}: {}", r.body);
        if !param.is_empty() {
            assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.body);
        }
    }
}

/// An admin API call with another token.
fn admin_as(gw: &TestGateway, token: &str, method: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {token}");
    request(
        gw.admin_addr,
        method,
        path,
        &[("authorization", &auth)],
        body,
    )
}

#[test]
fn operator_tokens_have_roles_and_every_admin_action_is_audited() {
    let (_redis, _engine, gw) = on_redis();
    let mut tokens = std::collections::HashMap::new();
    for (name, role) in [("ci", "admin"), ("oncall", "operator"), ("dash", "viewer")] {
        let r = gw.admin(
            "POST",
            "/admin/tokens",
            &json!({"name": name, "role": role}).to_string(),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        tokens.insert(name, r.json()["token"].as_str().unwrap().to_owned());
    }
    let dup = gw.admin(
        "POST",
        "/admin/tokens",
        r#"{"name": "ci", "role": "viewer"}"#,
    );
    assert_eq!(dup.status, 400, "{}", dup.body);

    // The admin token manages tenants and keys.
    let r = admin_as(
        &gw,
        &tokens["ci"],
        "POST",
        "/admin/tenants",
        r#"{"id": "acme"}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let r = admin_as(&gw, &tokens["ci"], "POST", "/admin/tenants/acme/keys", "");
    assert_eq!(r.status, 201, "{}", r.body);
    let api_key = r.json()["key"].as_str().unwrap().to_owned();
    let key_id = r.json()["id"].as_str().unwrap().to_owned();

    let writes = [
        ("POST", "/admin/tenants", r#"{"id": "evil"}"#.to_owned()),
        (
            "PATCH",
            "/admin/tenants/acme",
            r#"{"requests_per_min": 1}"#.to_owned(),
        ),
        ("DELETE", "/admin/tenants/acme", String::new()),
        ("POST", "/admin/tenants/acme/keys", String::new()),
        (
            "PATCH",
            &*format!("/admin/tenants/acme/keys/{key_id}"),
            r#"{"name": "x"}"#.to_owned(),
        ),
        (
            "POST",
            &*format!("/admin/tenants/acme/keys/{key_id}/rotate"),
            String::new(),
        ),
        (
            "DELETE",
            &*format!("/admin/tenants/acme/keys/{key_id}"),
            String::new(),
        ),
        (
            "POST",
            "/admin/engines",
            r#"{"name": "x", "url": "http://127.0.0.1:1"}"#.to_owned(),
        ),
        ("DELETE", "/admin/engines/e0", String::new()),
        ("POST", "/admin/engines/e0/drain", String::new()),
        ("POST", "/admin/engines/e0/undrain", String::new()),
        ("POST", "/admin/cache/flush", "{}".to_owned()),
        (
            "POST",
            "/admin/tokens",
            r#"{"name": "mine", "role": "admin"}"#.to_owned(),
        ),
        ("DELETE", "/admin/tokens/ci", String::new()),
    ]
    .map(|(m, p, b)| (m, p.to_owned(), b));
    // A viewer reads everything and writes nothing.
    for (m, p, b) in &writes {
        let r = admin_as(&gw, &tokens["dash"], m, p, b);
        assert_eq!(r.status, 403, "viewer {m} {p}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "permission_denied");
    }
    for p in [
        "/admin/tenants",
        "/admin/tenants/acme/keys",
        "/admin/engines",
        "/admin/usage",
        "/admin/usage/records",
        "/admin/audit",
        "/admin/tokens",
    ] {
        let r = admin_as(&gw, &tokens["dash"], "GET", p, "");
        assert_eq!(r.status, 200, "viewer GET {p}: {}", r.body);
    }
    // An operator drains, undrains and flushes, and nothing else.
    for (m, p, b) in &writes {
        let allowed = p.ends_with("/drain") || p.ends_with("/undrain") || p.ends_with("/flush");
        let r = admin_as(&gw, &tokens["oncall"], m, p, b);
        if allowed {
            assert_eq!(r.status, 200, "operator {m} {p}: {}", r.body);
        } else {
            assert_eq!(r.status, 403, "operator {m} {p}: {}", r.body);
        }
    }
    // The tenants' API key is not an operator token, and a revoked token stops at once.
    let r = admin_as(&gw, &api_key, "GET", "/admin/tenants", "");
    assert_eq!(r.status, 401, "{}", r.body);
    // A key or token pasted where its id belongs is refused before anything sees it.
    for path in [
        format!("/admin/tenants/acme/keys/{api_key}"),
        format!("/admin/tokens/{}", tokens["oncall"]),
    ] {
        let r = admin_as(&gw, &tokens["ci"], "DELETE", &path, "");
        assert_eq!(r.status, 400, "{}", r.body);
    }
    let r = admin_as(&gw, &tokens["ci"], "DELETE", "/admin/tokens/dash", "");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = admin_as(&gw, &tokens["dash"], "GET", "/admin/tenants", "");
    assert_eq!(r.status, 401, "revoked: {}", r.body);
    let list = gw.admin("GET", "/admin/tokens", "").json();
    assert!(!list.to_string().contains(&tokens["ci"][4..]), "{list}");

    // The audit log: each action above, by whom, with its result, and no secret.
    let audit = gw.admin("GET", "/admin/audit?limit=1000", "").json();
    let entries = audit["entries"].as_array().unwrap();
    let has = |actor: &str, action: &str, status: u16| {
        entries
            .iter()
            .any(|e| e["actor"] == actor && e["action"] == action && e["status"] == status)
    };
    assert!(has("bootstrap", "token.issue", 201), "{audit}");
    assert!(
        has("bootstrap", "token.issue", 400),
        "the duplicate: {audit}"
    );
    assert!(has("ci", "tenant.create", 201), "{audit}");
    assert!(has("ci", "key.issue", 201), "{audit}");
    assert!(has("ci", "token.revoke", 200), "{audit}");
    assert!(has("oncall", "engine.drain", 200), "{audit}");
    assert!(has("oncall", "engine.undrain", 200), "{audit}");
    assert!(has("oncall", "cache.flush", 200), "{audit}");
    assert!(has("oncall", "tenant.delete", 403), "{audit}");
    for (m, p, _) in &writes {
        let parts: Vec<&str> = p.trim_start_matches("/admin/").split('/').collect();
        let (action, _) = kvgate_gateway::audit::describe(m, &parts);
        assert!(has("dash", &action, 403), "viewer {action}: {audit}");
    }
    let created = entries
        .iter()
        .find(|e| e["action"] == "tenant.create" && e["status"] == 201)
        .unwrap();
    assert_eq!(created["target"], "tenant:acme");
    assert_eq!(created["role"], "admin");
    let text = audit.to_string();
    for secret in tokens.values().chain([&api_key]) {
        assert!(!text.contains(&secret[4..]), "a secret in the audit log");
    }
    // Newest first.
    let times: Vec<u64> = entries.iter().map(|e| u(e, "at_ms")).collect();
    assert!(times.windows(2).all(|w| w[0] >= w[1]), "{times:?}");
}

#[test]
fn the_ledger_and_budgets_ride_out_a_redis_outage() {
    let (redis, _engine, gw) = on_redis();
    let key = gw.tenant("acme", json!({"budget": {"monthly_tokens": 1000000}}));
    let r = gw.chat(&key, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);
    wait_records(&gw, 1);

    // Redis stops answering: a verified key keeps working, the budget fails open (counted),
    // and the records wait in the gateway.
    redis.pause();
    for _ in 0..3 {
        let r = gw.chat(&key, None, "Hi", r#","max_tokens":1"#);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let m = gw.metrics();
    let failures = m
        .lines()
        .find_map(|l| l.strip_prefix("kvgate_gateway_budget_check_failures_total "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(failures >= 3.0, "{m}");
    redis.resume();
    // Back: the buffered records arrive, each once.
    let all = wait_records(&gw, 4);
    assert!(all.iter().all(|r| r["ending"] == "completed"), "{all:?}");
}

#[test]
fn with_the_ledger_off_nothing_is_recorded_and_budgets_are_off() {
    let engine = gated_engine("blocks = 1024");
    let mut cfg = config(&[("e0", engine.addr)]);
    cfg.usage_ledger = false;
    let gw = TestGateway::start(cfg, StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("acme", json!({"budget": {"monthly_tokens": 0}}));
    for _ in 0..3 {
        let r = gw.chat(&key, None, "Hi", r#","max_tokens":1"#);
        assert_eq!(
            r.status, 200,
            "a zero budget is not enforced without the ledger: {}",
            r.body
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(records(&gw).is_empty());
    let usage = gw.admin("GET", "/admin/usage", "").json();
    assert_eq!(usage["totals"]["requests"], 0, "{usage}");
}

//! The gateway against a hostile tenant and faults, on real SmolLM2 engines: one tenant's bad
//! requests never open an engine's circuit for the others; limits hold against a repeated
//! request id and against clients that leave early; everything a request holds (lease, engine
//! load) comes back however it ends; a hung engine is given up and the request retried
//! elsewhere; a revoked key stops working on every replica at once.

use kvgate_tests::gateway::{chat_body, config, gated_engine, HungEngine, StoreKind, TestGateway};
use kvgate_tests::redis::{RedisServer, Reply};
use kvgate_tests::{request, Engine};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// One test at a time: each runs real engines, and on a small machine two at once would turn
/// the deadlines under test into a measure of CPU contention.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sends a request by hand and returns the open connection (nothing read yet).
fn send(gw: &TestGateway, key: &str, body: &str, extra_headers: &str) -> TcpStream {
    let mut s = TcpStream::connect(gw.addr).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\n{extra_headers}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

/// Reads until `marker` (or the end); returns what was read.
fn read_until(s: &mut TcpStream, marker: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(marker) {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn status_of(head: &str) -> u16 {
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// The gateway's view of one engine.
fn engine_view(gw: &TestGateway, name: &str) -> Value {
    let engines = gw.admin("GET", "/admin/engines", "").json();
    engines["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

/// A gateway with `cfg`, once it routes to every one of `engines`.
fn routable(cfg: kvgate_gateway::GatewayConfig, engines: &[&str]) -> TestGateway {
    let gw = TestGateway::start(cfg, StoreKind::Memory);
    let deadline = Instant::now() + Duration::from_secs(30);
    while engines
        .iter()
        .any(|e| engine_view(&gw, e)["routable"] != true)
    {
        assert!(Instant::now() < deadline, "engines not routable");
        std::thread::sleep(Duration::from_millis(50));
    }
    gw
}

/// A streamed request's answer, read to its `[DONE]` (or 20 s), after a 200.
fn streamed(gw: &TestGateway, key: &str, body: &str) -> String {
    let mut s = send(gw, key, body, "");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let got = read_until(&mut s, "data: [DONE]");
    assert_eq!(status_of(&got), 200, "{got}");
    got
}

/// Waits until the gateway counts nothing in flight on `engine`, and no prompt block as routed
/// to an engine (each request's blocks count as routed there until it ends).
fn wait_idle(gw: &TestGateway, engine: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = engine_view(gw, engine);
        let routed = gw.gw.registry.index.read().unwrap().routed_len();
        if v["inflight"] == 0 && routed == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "in-flight never settled: {v}, {routed} blocks routed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A real engine `e` behind a gateway, both ready.
fn one_engine(store: StoreKind) -> (Engine, TestGateway) {
    let e = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e", e.addr)]), store);
    gw.wait_ready(1);
    (e, gw)
}

/// Waits until a short chat of `key` succeeds, allowing `transient` statuses meanwhile.
fn wait_admitted(gw: &TestGateway, key: &str, transient: &[u16]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = gw.chat(key, None, "Hi", r#","max_tokens":1"#);
        if r.status == 200 {
            return;
        }
        assert!(
            transient.contains(&r.status),
            "{} {} engines: {}",
            r.status,
            r.body,
            gw.admin("GET", "/admin/engines", "").body
        );
        assert!(Instant::now() < deadline, "the lease was never released");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn stream_body(system: &str, max_tokens: u32) -> String {
    chat_body(
        Some(system),
        "Write a very long story about the sea.",
        &format!(r#","max_tokens":{max_tokens},"ignore_eos":true,"stream":true"#),
    )
}

#[test]
fn bad_requests_of_one_tenant_never_open_the_circuit() {
    let _serial = serial();
    let (_e, gw) = one_engine(StoreKind::Memory);
    let hostile = gw.tenant("hostile", json!({}));
    let good = gw.tenant("good", json!({}));
    // Sampling that cannot succeed: at least 2 tokens, yet every token stops.
    let vocab: Vec<u32> = (0..49152).collect();
    let extra = format!(
        r#","max_tokens":4,"min_tokens":2,"stop_token_ids":{}"#,
        serde_json::to_string(&vocab).unwrap()
    );
    for _ in 0..6 {
        let r = gw.chat(&hostile, None, "Hello", &extra);
        assert!(
            (400..500).contains(&r.status),
            "the request's own mistake is its 4xx: {} {}",
            r.status,
            r.body
        );
    }
    assert_eq!(engine_view(&gw, "e")["routable"], true);
    // The scheme of `Authorization` is case-insensitive.
    let auth = format!("bearer {good}");
    let r = request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", &auth)],
        &chat_body(None, "Hi", r#","max_tokens":1"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

fn repeated_request_id_holds_one_slot_each(store: StoreKind) {
    let (_e, gw) = one_engine(store);
    let key = gw.tenant("t", json!({"max_concurrent": 2}));
    let mut open = Vec::new();
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let mut s = send(
            &gw,
            &key,
            &stream_body("You are a storyteller.", 400),
            "x-request-id: same-id\r\n",
        );
        let head = read_until(&mut s, "\r\n");
        statuses.push(status_of(&head));
        open.push(s);
    }
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    assert_eq!(admitted, 2, "a limit of 2 with one client id: {statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 429).count(), 4);
    drop(open);
    wait_idle(&gw, "e");
}

#[test]
fn repeated_request_id_holds_one_slot_each_memory() {
    let _serial = serial();
    repeated_request_id_holds_one_slot_each(StoreKind::Memory);
}

#[test]
fn repeated_request_id_holds_one_slot_each_redis() {
    let _serial = serial();
    let redis = RedisServer::start();
    repeated_request_id_holds_one_slot_each(StoreKind::Redis(redis.url()));
}

#[test]
fn leaving_a_stream_early_is_still_charged() {
    let _serial = serial();
    let (_e, gw) = one_engine(StoreKind::Memory);
    let key = gw.tenant("t", json!({"tokens_per_min": 300}));
    let system =
        "You are the storyteller of a harbor town. Your stories are about ships, sailors, \
                  storms, lighthouses, fish markets and the long winters by the sea.";
    let mut refused = None;
    for i in 0..15 {
        let mut s = send(&gw, &key, &stream_body(system, 500), "");
        let head = read_until(&mut s, "data: {");
        if status_of(&head) == 429 {
            refused = Some(i);
            break;
        }
        assert_eq!(status_of(&head), 200, "{head}");
        drop(s);
    }
    let refused = refused.expect("tokens/min charged to clients that leave early");
    assert!(refused >= 2, "refused too early: request {refused}");
    wait_idle(&gw, "e");
}

/// A prompt whose prefill takes a while on the CPU (about 1,500 tokens).
fn long_prompt_body() -> String {
    let user = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(110);
    chat_body(None, &user, r#","max_tokens":1"#)
}

#[test]
fn a_client_leaving_before_the_first_byte_releases_everything() {
    let _serial = serial();
    let (_e, gw) = one_engine(StoreKind::Memory);
    let key = gw.tenant("t", json!({"max_concurrent": 1}));
    for _ in 0..2 {
        let s = send(&gw, &key, &long_prompt_body(), "");
        std::thread::sleep(Duration::from_millis(300));
        drop(s);
    }
    wait_idle(&gw, "e");
    // The lease came back with the request: the tenant's one slot is free again.
    wait_admitted(&gw, &key, &[429]);
}

/// A client that leaves while its admission is on its way through Redis (which holds writes
/// for a second, as a busy or failing-over primary would) gets its slot back at once: the store
/// takes the lease after the request is gone, and the release follows it, instead of the slot
/// staying taken until the lease lapses a minute later.
#[test]
fn a_client_leaving_during_admission_releases_its_lease() {
    let _serial = serial();
    let redis = RedisServer::start();
    let (_e, gw) = one_engine(StoreKind::Redis(redis.url()));
    // A slow tokens/min (2 a second), so that every admission's charge shows for seconds.
    let key = gw.tenant("t", json!({"max_concurrent": 1, "tokens_per_min": 120}));
    // Served once, so the key's last-used time is written now and not during the next request.
    wait_admitted(&gw, &key, &[]);
    let (conc, tok) = ("kvgate:rl:t:conc", "kvgate:rl:t:tok");
    assert_eq!(redis.cmd(&["ZCARD", conc]), Reply::Int(0));
    let charged = || {
        redis
            .cmd(&["GET", tok])
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
    };
    let before = charged().expect("the first request's tokens are charged");
    redis.cmd(&["CLIENT", "PAUSE", "1000", "WRITE"]);
    let s = send(&gw, &key, &chat_body(None, "Hi", r#","max_tokens":1"#), "");
    std::thread::sleep(Duration::from_millis(300));
    drop(s);
    std::thread::sleep(Duration::from_millis(1200));
    // The admission did run (it charged the prompt), after its client had left ...
    let deadline = Instant::now() + Duration::from_secs(5);
    while charged().is_none_or(|t| t <= before) {
        assert!(
            Instant::now() < deadline,
            "the admission never reached Redis"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... and the lease it took is released.
    wait_released(&redis, conc, deadline);
    wait_admitted(&gw, &key, &[]);
}

/// Waits until no lease is left in `conc` (a tenant's concurrency set), failing at `deadline`.
fn wait_released(redis: &RedisServer, conc: &str, deadline: Instant) {
    while redis.cmd(&["ZCARD", conc]) != Reply::Int(0) {
        assert!(Instant::now() < deadline, "the lease stayed taken");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A release the store refuses (here: Redis's ACL forbids scripts for a moment) is tried again,
/// so the tenant's slot comes back once the store does, instead of staying taken until the lease
/// lapses a minute later. The answer does not wait for the retries.
#[test]
fn a_refused_release_is_retried() {
    let _serial = serial();
    let redis = RedisServer::start();
    let (_e, gw) = one_engine(StoreKind::Redis(redis.url()));
    let key = gw.tenant("t", json!({"max_concurrent": 1}));
    wait_admitted(&gw, &key, &[]);
    let conc = "kvgate:rl:t:conc";
    assert_eq!(redis.cmd(&["ZCARD", conc]), Reply::Int(0));
    // Admitted, then the store refuses scripts while the engine works on the prompt.
    let mut s = send(&gw, &key, &long_prompt_body(), "");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(redis.cmd(&["ZCARD", conc]), Reply::Int(1), "admitted");
    redis.cmd(&["ACL", "SETUSER", "default", "-evalsha", "-eval"]);
    let answer = read_until(&mut s, "\r\n\r\n");
    assert_eq!(status_of(&answer), 200, "{answer}");
    // The first try was refused: the lease is still there. The store refuses for a while
    // longer (three seconds, as a restart that loads its data takes).
    assert_eq!(
        redis.cmd(&["ZCARD", conc]),
        Reply::Int(1),
        "released though refused?"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(redis.cmd(&["ZCARD", conc]), Reply::Int(1));
    redis.cmd(&["ACL", "SETUSER", "default", "+evalsha", "+eval"]);
    wait_released(&redis, conc, Instant::now() + Duration::from_secs(5));
    wait_admitted(&gw, &key, &[]);
}

/// An engine that goes silent mid-stream without closing (its host gone, no FIN) is given up
/// after `first_byte_timeout_secs` of silence: the client gets an error event and `[DONE]`, and
/// the lease and the engine's load come back. The stream used to wait for good.
#[test]
fn a_stream_whose_engine_goes_silent_ends_and_releases_everything() {
    let _serial = serial();
    let silent = HungEngine::mid_stream();
    let mut cfg = config(&[("silent", silent.addr)]);
    cfg.first_byte_timeout_secs = 1;
    let gw = routable(cfg, &["silent"]);
    let key = gw.tenant("t", json!({"max_concurrent": 1}));
    let body = chat_body(None, "Hi", r#","max_tokens":8,"stream":true"#);
    for _ in 0..2 {
        // The second is admitted only if the first one's lease came back.
        let started = Instant::now();
        let got = streamed(&gw, &key, &body);
        assert!(got.contains("\"content\":\"Hi\""), "{got}");
        assert!(got.contains("failed mid-stream"), "{got}");
        assert!(
            got.contains("data: [DONE]"),
            "no end after {:?}: {got}",
            started.elapsed()
        );
        wait_idle(&gw, "silent");
    }
}

/// A whole (not streamed) answer takes as long as it needs while its engine keeps stepping:
/// past `first_byte_timeout_secs`, a long one is neither taken for a hang, counted against its
/// engine, nor retried elsewhere. (It used to be all three, so that one tenant's long answers
/// opened an engine's circuit for everyone.) An engine that stops stepping still is a hang:
/// `a_hung_engine_is_given_up_and_the_request_served_elsewhere`.
#[test]
fn a_long_whole_answer_is_not_a_hang() {
    let _serial = serial();
    let e = gated_engine("blocks = 1024");
    let mut cfg = config(&[("e", e.addr)]);
    cfg.first_byte_timeout_secs = 1;
    let gw = TestGateway::start(cfg, StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("t", json!({}));
    for _ in 0..2 {
        let t = Instant::now();
        let r = gw.chat(
            &key,
            None,
            "Count to a thousand.",
            r#","max_tokens":256,"ignore_eos":true"#,
        );
        assert_eq!(r.status, 200, "after {:?}: {}", t.elapsed(), r.body);
        assert_eq!(r.json()["usage"]["completion_tokens"], 256);
        assert!(t.elapsed() > Duration::from_secs(1), "too quick to test");
    }
    assert_eq!(engine_view(&gw, "e")["circuit_open"], false);
}

/// A whole answer too large to relay is the request's own 400, charged as the whole answer it
/// asked for; never a fault of the engine's, and never retried elsewhere.
#[test]
fn an_oversized_whole_answer_is_the_requests_own_error() {
    let _serial = serial();
    let big = HungEngine::oversized();
    let mut cfg = config(&[("big", big.addr)]);
    cfg.first_byte_timeout_secs = 20;
    let gw = routable(cfg, &["big"]);
    let key = gw.tenant("t", json!({}));
    for _ in 0..4 {
        let r = gw.chat(&key, None, "Hi", r#","max_tokens":8"#);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "stream", "{}", r.body);
    }
    assert_eq!(
        big.requests.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "retried"
    );
    assert_eq!(engine_view(&gw, "big")["circuit_open"], false);
    wait_idle(&gw, "big");
}

/// An event past the relay's 1 MiB (what an engine sends a slow reader of a large answer at
/// once) ends the stream with the request's own error, and never counts against the engine:
/// four in a row leave its circuit closed (three engine faults open it).
#[test]
fn an_oversized_event_is_the_requests_own_error() {
    let _serial = serial();
    let big = HungEngine::huge_event();
    let gw = routable(config(&[("big", big.addr)]), &["big"]);
    let key = gw.tenant("t", json!({}));
    let body = chat_body(None, "Hi", r#","max_tokens":8,"stream":true"#);
    for _ in 0..4 {
        let got = streamed(&gw, &key, &body);
        assert!(got.contains("grew past 1 MiB"), "{got}");
        assert!(got.contains("data: [DONE]"), "{got}");
        wait_idle(&gw, "big");
    }
    assert_eq!(engine_view(&gw, "big")["circuit_open"], false);
}

#[test]
fn a_request_timeout_releases_everything() {
    let _serial = serial();
    // An engine that never answers: every request runs into the request's own deadline.
    let hung = HungEngine::start();
    let mut cfg = config(&[("hung", hung.addr)]);
    cfg.request_timeout_secs = 1;
    let gw = routable(cfg, &["hung"]);
    let key = gw.tenant("t", json!({"max_concurrent": 1}));
    for _ in 0..4 {
        // Each is admitted (the last one's lease came back), then times out: never a 429.
        let r = gw.chat(&key, None, "Hi", r#","max_tokens":1"#);
        assert_eq!(r.status, 504, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "timeout");
    }
    wait_idle(&gw, "hung");
    // The request's deadline is no fault of the engine's: its circuit stays closed.
    assert_eq!(engine_view(&gw, "hung")["circuit_open"], false);
}

#[test]
fn a_hung_engine_is_given_up_and_the_request_served_elsewhere() {
    let _serial = serial();
    let hung = HungEngine::start();
    let e = gated_engine("blocks = 1024");
    let mut cfg = config(&[("hung", hung.addr), ("real", e.addr)]);
    // Long enough for the real engine's first answer on a loaded machine.
    cfg.first_byte_timeout_secs = 5;
    cfg.request_timeout_secs = 30;
    let gw = routable(cfg, &["hung", "real"]);
    let key = gw.tenant("t", json!({}));
    for i in 0..8 {
        let system = format!("You are assistant number {i} of the lighthouse keepers.");
        let r = gw.chat(&key, Some(&system), "Hi", r#","max_tokens":1"#);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvgate-engine"), Some("real"));
    }
    assert!(
        hung.requests.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "some request was routed to the hung engine first"
    );
    wait_idle(&gw, "hung");
    wait_idle(&gw, "real");
}

#[test]
fn a_revoked_key_stops_on_every_replica_within_a_second() {
    let _serial = serial();
    let redis = RedisServer::start();
    let e = gated_engine("blocks = 1024");
    let a = TestGateway::start(config(&[("e", e.addr)]), StoreKind::Redis(redis.url()));
    let b = TestGateway::start(config(&[("e", e.addr)]), StoreKind::Redis(redis.url()));
    a.wait_ready(1);
    b.wait_ready(1);
    let key = a.tenant("t", json!({}));
    // Cached as valid on b.
    let r = b.chat(&key, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let keys = a.admin("GET", "/admin/tenants/t/keys", "").json();
    let id = keys["keys"][0]["id"].as_str().unwrap().to_owned();
    let revoked_at = Instant::now();
    let r = a.admin("DELETE", &format!("/admin/tenants/t/keys/{id}"), "");
    assert_eq!(r.status, 200, "{}", r.body);
    loop {
        // Timed from when the probe was sent: a probe that b let through is a model request,
        // and on a loaded machine its answer can come back well after it was admitted.
        let sent = revoked_at.elapsed();
        let r = b.chat(&key, None, "Hi", r#","max_tokens":1"#);
        if r.status == 401 {
            break;
        }
        assert!(
            sent < Duration::from_secs(1),
            "the revoked key still works on the other replica {sent:?} after its revocation"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn huge_prompts_are_refused_unread_and_stall_no_one() {
    let _serial = serial();
    let (_e, gw) = one_engine(StoreKind::Memory);
    let hostile = gw.tenant("hostile", json!({}));
    let good = gw.tenant("good", json!({}));
    let word = "a".repeat(3_900_000);
    let body = chat_body(None, &word, r#","max_tokens":1"#);
    let hostile_threads: Vec<_> = (0..4)
        .map(|_| {
            let (addr, body, key) = (gw.addr, body.clone(), hostile.clone());
            std::thread::spawn(move || {
                let auth = format!("Bearer {key}");
                let t = Instant::now();
                let r = request(
                    addr,
                    "POST",
                    "/v1/chat/completions",
                    &[("authorization", &auth)],
                    &body,
                );
                (r.status, r.json()["error"]["code"].clone(), t.elapsed())
            })
        })
        .collect();
    // Meanwhile, another tenant is served.
    let t = Instant::now();
    let r = gw.chat(&good, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let good_took = t.elapsed();
    let health = request(gw.addr, "GET", "/health", &[], "");
    assert_eq!(health.status, 200);
    for h in hostile_threads {
        let (status, code, took) = h.join().unwrap();
        assert_eq!(status, 400);
        // Refused on its length, before any tokenizing.
        assert_eq!(code, "context_length_exceeded", "after {took:?}");
    }
    eprintln!("another tenant's chat took {good_took:?} during the attack");
}

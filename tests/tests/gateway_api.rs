//! The gateway in front of a real SmolLM2 engine (in-memory store): keys, the golden answer
//! through the proxy (whole and streamed), bad input, admin auth, tenant rewriting.

use kvgate_tests::gateway::{chat_body, config, gated_engine, StoreKind, TestGateway};
use kvgate_tests::{request, MODEL};
use serde_json::json;

const GOLDEN: &str = "The capital of France is Paris.";

#[test]
fn keys_proxy_and_admin() {
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", engine.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("acme", json!({"name": "Acme"}));
    assert!(key.starts_with("kvg_") && key.len() == 47, "{key}");

    // Auth: missing, wrong and good keys.
    let body = chat_body(None, "What is the capital of France?", "");
    let r = request(gw.addr, "POST", "/v1/chat/completions", &[], &body);
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let wrong = format!("kvg_{}", "A".repeat(43));
    assert_eq!(gw.post(&wrong, "/v1/chat/completions", &body).status, 401);
    let r = gw.post(&key, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], GOLDEN);
    assert_eq!(r.header("x-kvgate-engine"), Some("e0"));
    assert!(r
        .header("x-request-id")
        .is_some_and(|id| id.starts_with("req_")));

    // Streamed, with the usage chunk only because the client asked for it.
    let stream = gw.post(
        &key,
        "/v1/chat/completions",
        &chat_body(None, "What is the capital of France?", r#","stream":true"#),
    );
    assert_eq!(stream.status, 200);
    let data = stream.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let text: String = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, GOLDEN);
    assert!(
        !stream.body.contains("\"usage\""),
        "usage chunk leaked to a client that did not ask: {}",
        stream.body
    );
    let with_usage = gw.post(
        &key,
        "/v1/chat/completions",
        &chat_body(
            None,
            "What is the capital of France?",
            r#","stream":true,"stream_options":{"include_usage":true}"#,
        ),
    );
    assert!(with_usage.body.contains("\"usage\""), "{}", with_usage.body);

    // Bad input fails at the gateway with the engine's errors.
    for (body, status, code) in [
        ("{not json".to_owned(), 400, "invalid_json"),
        (
            r#"{"model":"nope","messages":[{"role":"user","content":"hi"}]}"#.to_owned(),
            404,
            "model_not_found",
        ),
        (
            format!(r#"{{"model":"{MODEL}","messages":[]}}"#),
            400,
            "invalid_value",
        ),
        (
            chat_body(None, "hi", r#","max_tokens":-1"#),
            400,
            "invalid_value",
        ),
    ] {
        let r = gw.post(&key, "/v1/chat/completions", &body);
        assert_eq!(r.status, status, "{body} -> {}", r.body);
        assert_eq!(r.json()["error"]["code"], code, "{}", r.body);
    }
    let huge = format!(
        r#"{{"model":"{MODEL}","prompt":"{}"}}"#,
        "a".repeat(5 << 20)
    );
    assert_eq!(gw.post(&key, "/v1/completions", &huge).status, 413);

    // Completions and the model list.
    let r = gw.post(
        &key,
        "/v1/completions",
        &format!(
            r#"{{"model":"{MODEL}","prompt":"The quick brown fox","max_tokens":4,"temperature":0}}"#
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(
        gw.addr,
        "GET",
        "/v1/models",
        &[("authorization", &format!("Bearer {key}"))],
        "",
    );
    assert_eq!(r.json()["data"][0]["id"], MODEL);

    // Admin: no token, wrong token.
    assert_eq!(
        request(gw.admin_addr, "GET", "/admin/tenants", &[], "").status,
        401
    );
    let r = request(
        gw.admin_addr,
        "GET",
        "/admin/tenants",
        &[("authorization", "Bearer nope")],
        "",
    );
    assert_eq!(r.status, 401);

    // Revocation takes effect at once on this gateway.
    let keys = gw.admin("GET", "/admin/tenants/acme/keys", "").json();
    let id = keys["keys"][0]["id"].as_str().unwrap().to_owned();
    assert!(keys.to_string().find("kvg_").is_some_and(|_| {
        // Only the 8-character display prefix, never the key.
        !keys.to_string().contains(&key)
    }));
    let r = gw.admin("DELETE", &format!("/admin/tenants/acme/keys/{id}"), "");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(gw.post(&key, "/v1/chat/completions", &body).status, 401);

    // Metrics name the tenant and the route reasons.
    let m = gw.metrics();
    assert!(
        m.contains("kvgate_gateway_requests_total{tenant=\"acme\",code=\"200\"}"),
        "{m}"
    );
    assert!(
        m.contains("kvgate_gateway_route_decisions_total{reason="),
        "{m}"
    );
    assert!(m.contains("kvgate_gateway_auth_failures_total 3"), "{m}");
}

#[test]
fn tenant_rewrites_scope_and_system_prompt() {
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", engine.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let system = "You are a terse assistant for the Acme company. Answer in one short sentence. \
                  Never mention competitors, and always be polite to the customer.";
    let a = gw.tenant(
        "a",
        json!({"system_prompt": system, "allowed_models": [MODEL], "kv_block_quota": 256}),
    );
    let b = gw.tenant("b", json!({"allowed_models": ["other-model"]}));

    // B may not use the model.
    let r = gw.chat(&b, None, "hi", "");
    assert_eq!(r.status, 403, "{}", r.body);

    // A's default system prompt is applied: the second request hits the cached prefix, and a
    // client-sent cache_salt changes nothing.
    let first = gw.chat(
        &a,
        None,
        "What is the capital of France?",
        r#","max_tokens":2"#,
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let prompt_tokens = first.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        prompt_tokens > 40,
        "the system prompt was injected: {prompt_tokens}"
    );
    let second = gw.chat(
        &a,
        None,
        "What is the capital of Spain?",
        r#","max_tokens":2,"cache_salt":"attacker-chosen""#,
    );
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 32, "prefix reuse across A's requests: {cached}");
}

/// A gateway in front of one engine (`e0`), and a key of tenant `acme`.
fn one_engine_and_acme() -> (kvgate_tests::Engine, TestGateway, String) {
    let engine = gated_engine("blocks = 256");
    let gw = TestGateway::start(config(&[("e0", engine.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("acme", json!({"name": "Acme"}));
    (engine, gw, key)
}

/// The status line and headers (lowercase) of one request on a kept-alive connection: no
/// `connection: close` from the client, so any in the answer is the server's.
fn keep_alive_head(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    auth: &str,
    body: &str,
) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let auth = if auth.is_empty() {
        String::new()
    } else {
        format!("authorization: Bearer {auth}\r\n")
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap_or(0) == 1 {
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).to_ascii_lowercase()
}

#[test]
fn a_stopping_gateway_reports_it_and_closes_each_connection_after_its_answer() {
    let (_engine, gw, key) = one_engine_and_acme();
    let body = chat_body(None, "What is the capital of France?", r#","max_tokens":2"#);
    let chat = |auth: &str| keep_alive_head(gw.addr, "POST", "/v1/chat/completions", auth, &body);
    let head = chat(&key);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    let head = keep_alive_head(gw.addr, "GET", "/health", "", "");
    assert!(
        head.starts_with("http/1.1 200") && !head.contains("connection: close"),
        "{head}"
    );
    // The stop's grace (what `kvgate gateway` does on SIGTERM before its listeners close): a
    // request sent now is still answered, and its connection closed after it, so a kept-alive
    // client reconnects elsewhere; the health check tells load balancers to go.
    gw.gw
        .stopping
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let health = request(gw.addr, "GET", "/health", &[], "");
    assert_eq!(health.status, 503, "{}", health.body);
    assert_eq!(health.json()["status"], "stopping");
    let head = chat(&key);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    let head = chat("");
    assert!(
        head.starts_with("http/1.1 401") && head.contains("connection: close"),
        "{head}"
    );
}

#[test]
fn a_stop_waits_for_an_admin_action_whose_caller_hung_up() {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let (engine, gw, key) = one_engine_and_acme();
    // A long answer in flight, then a drain that waits for it, whose caller hangs up at once.
    let long = {
        let (addr, auth) = (gw.addr, format!("Bearer {key}"));
        let body = chat_body(
            None,
            "Tell me a story.",
            r#","max_tokens":160,"ignore_eos":true"#,
        );
        std::thread::spawn(move || {
            request(
                addr,
                "POST",
                "/v1/chat/completions",
                &[("authorization", &auth)],
                &body,
            )
        })
    };
    let in_flight = || {
        gw.gw
            .registry
            .all()
            .iter()
            .map(|e| e.inflight.load(Ordering::SeqCst))
            .sum::<u64>()
    };
    // Running on the engine, not only sent by the gateway: a drain refuses what an engine has
    // not started (the gateway then has no other engine to send it to).
    let deadline = Instant::now() + Duration::from_secs(30);
    while engine.metric("kvgate_sequences{state=\"running\"}") < 1.0 {
        assert!(Instant::now() < deadline, "the long answer never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(in_flight() > 0);
    let mut hung_up = std::net::TcpStream::connect(gw.admin_addr).unwrap();
    write!(
        hung_up,
        "POST /admin/engines/e0/drain?wait=60 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\ncontent-length: 0\r\n\r\n",
        kvgate_tests::OPERATOR
    )
    .unwrap();
    while gw.gw.admin_actions.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the drain never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(hung_up);
    // The stop's settling waits for the drain (which waits for the answer) and its audit entry.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(gw.gw.settle(Duration::from_secs(120)));
    assert_eq!(gw.gw.admin_actions.load(Ordering::SeqCst), 0);
    assert_eq!(in_flight(), 0);
    let audit = gw.admin("GET", "/admin/audit?limit=100", "").json();
    let drained = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["action"] == "engine.drain" && e["status"] == 200);
    assert!(drained, "{audit}");
    assert_eq!(long.join().unwrap().status, 200);
}

//! The engine against hostile callers, with the real SmolLM2: a request's own mistake is its own
//! 4xx (never a 5xx the gateway would count against the engine), a stream that fails ends like
//! every other, scope headers count only from the gateway, a client that stops reading its
//! stream is cut off instead of buffered without end, and a tenant whose grammar masks are slow
//! takes turns within its share of each step.

use kvgate_tests::{request, Engine, MODEL};
use serde_json::Value;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

const PARIS: &str = "The capital of France is Paris.";
const VOCAB: u32 = 49_152;

fn chat_body(extra: &str) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"What is the capital of France?"}}],"temperature":0{extra}}}"#
    )
}

/// The value of a metric line, if the engine exports it.
fn metric(e: &Engine, line_prefix: &str) -> Option<f64> {
    e.get("/metrics")
        .body
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn a_request_whose_sampling_cannot_succeed_is_its_own_400() {
    let e = Engine::start("");
    let every_token: Vec<u32> = (0..VOCAB).collect();
    let ids = serde_json::to_string(&every_token).unwrap();
    // min_tokens masks EOS and every stop token: with all of them stop tokens, nothing is left.
    let masked = format!(r#","min_tokens":2,"max_tokens":4,"stop_token_ids":{ids}"#);
    let cases = [
        ("/v1/chat/completions", chat_body(&masked)),
        (
            "/v1/chat/completions",
            chat_body(&format!(r#"{masked},"stream":true"#)),
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"Hello"{masked}}}"#),
        ),
    ];
    for (path, body) in cases {
        let r = e.post(path, &body);
        assert_eq!(r.status, 400, "{path}: {:.300}", r.body);
        let err = &r.json()["error"];
        assert_eq!(err["type"], "invalid_request_error", "{}", r.body);
        assert_eq!(err["param"], "stop_token_ids", "{}", r.body);
        assert_eq!(r.header("x-kvgate-fault"), None);
    }
    // A drain is the operator's choice, not the engine failing: no fault mark either.
    assert_eq!(e.admin("POST", "/admin/drain", "").status, 200);
    let r = e.chat("What is the capital of France?", "");
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("x-kvgate-fault"), None);
    assert_eq!(e.admin("POST", "/admin/undrain", "").status, 200);
    // Neither hurt the engine.
    let ok = e.chat("What is the capital of France?", "");
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["choices"][0]["message"]["content"], PARIS);
}

#[test]
fn a_stream_that_fails_after_it_started_ends_with_an_error_event_then_done() {
    // 8 blocks of 16 tokens: a request that may need more is refused by the engine thread, after
    // the stream's head went out.
    let e = Engine::start("[kv]\nblocks = 8");
    let body = |stream: bool| {
        chat_body(&format!(
            r#","max_tokens":400,"ignore_eos":true,"stream":{stream}"#
        ))
    };
    let r = e.post("/v1/chat/completions", &body(true));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("KV blocks"));
    assert!(r.body.ends_with("\n\ndata: [DONE]\n\n"), "{:?}", r.body);
    // The same request unstreamed is a plain 400.
    let r = e.post("/v1/chat/completions", &body(false));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.header("x-kvgate-fault"), None);
}

#[test]
fn scope_headers_count_only_with_the_engine_token() {
    let cached = |r: &kvgate_tests::Response| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let body = chat_body("");
    // No engine token: nobody can prove to be the gateway, so nobody picks a scope.
    let open = Engine::start("");
    let spoof = |tenant: &str| {
        request(
            open.addr,
            "POST",
            "/v1/chat/completions",
            &[
                ("x-kvgate-tenant", tenant),
                ("x-kvgate-scope", "acme"),
                ("x-kvgate-priority", "1000"),
            ],
            &body,
        )
    };
    // acme's prefix, labelled the way the gateway labels acme's traffic: it lands in the default
    // scope, and acme's scope stays empty.
    assert_eq!(cached(&spoof("acme")), 0);
    let flushed = open.admin("POST", "/admin/cache/flush", r#"{"scope":"acme"}"#);
    assert_eq!(flushed.status, 200, "{}", flushed.body);
    assert_eq!(
        flushed.json()["flushed_blocks"],
        0,
        "nothing went to acme's scope"
    );
    // Then the default scope is cleared: the prefix exists nowhere. A caller naming acme's scope
    // finds none of it, where an engine that believed the header reads it back from acme's.
    let flushed = open.admin("POST", "/admin/cache/flush", r#"{"scope":"default"}"#);
    assert!(flushed.json()["flushed_blocks"].as_u64().unwrap() >= 2);
    assert_eq!(cached(&spoof("mallory")), 0);
    // Nor does a named quota bind anyone: one block would refuse this request.
    let quota = request(
        open.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-kvgate-kv-quota", "1")],
        &body,
    );
    assert_eq!(quota.status, 200, "{}", quota.body);
    // Both ran as the default tenant.
    for tenant in ["acme", "mallory"] {
        let line = format!("kvgate_prefix_cache_queried_tokens_total{{tenant=\"{tenant}\"}}");
        assert_eq!(metric(&open, &line), None, "{line}");
    }
    let line = "kvgate_prefix_cache_queried_tokens_total{tenant=\"default\"}";
    assert!(metric(&open, line).is_some_and(|v| v > 0.0));

    // With a token, the gateway's headers are honoured, and a caller without it gets nowhere.
    let gated = Engine::start("[auth]\nengine_token = \"gw-secret\"");
    let ask = |token: Option<&str>, scope: &str| {
        let auth = token.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("x-kvgate-tenant", "acme"), ("x-kvgate-scope", scope)];
        if let Some(a) = &auth {
            headers.push(("authorization", a));
        }
        request(gated.addr, "POST", "/v1/chat/completions", &headers, &body)
    };
    assert_eq!(cached(&ask(Some("gw-secret"), "acme")), 0);
    assert_eq!(cached(&ask(Some("gw-secret"), "acme")), 32);
    assert_eq!(cached(&ask(Some("gw-secret"), "globex")), 0);
    let r = ask(None, "acme");
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(ask(Some("guess"), "acme").status, 401);
}

#[test]
fn a_client_that_stops_reading_its_stream_is_cancelled_and_its_blocks_freed() {
    let e = Engine::start("stalled_client_timeout_ms = 300");
    // The socket buffers of a client that reads nothing hold megabytes on loopback, so every step
    // writes as much as a request can: sixteen samples, each token with its 20 top logprobs, and
    // those pushed by logit_bias onto SmolLM2's twenty longest tokens (runs of 40 to 81 spaces,
    // dashes and hashes), about 100 KB a step. Even so the buffers take dozens of steps to fill,
    // far fewer than the 2,000 tokens asked for.
    const LONG_TOKENS: [u32; 20] = [
        46778, 45855, 39910, 40672, 45462, 26675, 25102, 40686, 28909, 17794, 15069, 48259, 40944,
        48818, 42057, 9225, 37541, 30799, 18470, 36328,
    ];
    let bias: serde_json::Map<String, Value> = LONG_TOKENS
        .iter()
        .map(|t| (t.to_string(), Value::from(100)))
        .collect();
    let (n, max_tokens) = (16u32, 2000u32);
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Draw a long line."}}],"max_tokens":{max_tokens},"n":{n},"temperature":0,"ignore_eos":true,"logprobs":true,"top_logprobs":20,"logit_bias":{},"stream":true}}"#,
        Value::Object(bias)
    );
    let mut conn = TcpStream::connect(e.addr).expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        e.addr,
        body.len()
    );
    conn.write_all(head.as_bytes()).expect("write");
    // ... and never reads.
    let t0 = Instant::now();
    while metric(&e, "kvgate_stalled_clients_total").unwrap_or(0.0) < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "the unread stream was never cancelled: {:?} tokens generated",
            metric(&e, "kvgate_generation_tokens_total")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Cancelled with the client still connected: every block is back, nothing runs, and the
    // output stopped far short of what was asked.
    let status = e.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "{status}");
    assert_eq!(status["queues"]["running"], 0, "{status}");
    let generated = metric(&e, "kvgate_generation_tokens_total").unwrap();
    assert!(
        generated < f64::from(n * max_tokens) / 2.0,
        "{generated} tokens generated for a client that read none"
    );
    assert_eq!(
        e.chat("What is the capital of France?", "").json()["choices"][0]["message"]["content"],
        PARIS
    );
    drop(conn);
}

#[test]
fn a_tenant_whose_grammar_masks_are_slow_is_held_to_its_share_of_each_step() {
    let e = Engine::start("[auth]\nengine_token = \"gw-secret\"");
    let post = |tenant: &'static str, body: String| {
        let addr = e.addr;
        std::thread::spawn(move || {
            let headers = [
                ("x-kvgate-tenant", tenant),
                ("authorization", "Bearer gw-secret"),
            ];
            request(addr, "POST", "/v1/chat/completions", &headers, &body)
        })
    };
    // An ambiguous grammar over single letters: its Earley items grow with the text, and each
    // mask with them (to tens of milliseconds, below the parser's limits, for dozens of tokens).
    let grammar = r#"start: s\ns: s s | \"a\" | \"b\" | \"c\" | \"d\" | \"e\""#;
    let slow = post(
        "mallory",
        chat_body(&format!(
            r#","n":8,"max_tokens":48,"response_format":{{"type":"lark","lark":"{grammar}"}}"#
        )),
    );
    std::thread::sleep(Duration::from_millis(300));
    let light = post("alice", chat_body(r#","max_tokens":48,"ignore_eos":true"#));
    let light = light.join().unwrap();
    assert_eq!(light.status, 200, "{}", light.body);
    assert_eq!(light.json()["usage"]["completion_tokens"], 48);
    // The slow grammar's samples waited their turns beside alice's decodes (what that saves
    // alice is measured by scripts/bench-mask-shares); its request ends as its grammar allows
    // (done, or its own 400 at the parser's limits), never as an engine fault.
    let slow = slow.join().unwrap();
    assert!(slow.status == 200 || slow.status == 400, "{}", slow.body);
    assert_eq!(slow.header("x-kvgate-fault"), None);
    let deferred = metric(&e, "kvgate_grammar_deferred_decodes_total ").unwrap_or(0.0);
    assert!(deferred > 0.0, "no decode waited for its tenant's share");
    let status = e.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "{status}");
}

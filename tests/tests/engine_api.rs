//! The engine's HTTP API end to end with the real SmolLM2: golden answers, prefix reuse and its
//! isolation, streaming, `n` samples, drain, flush, disconnects, and the bad-input matrix.

use kvgate_tests::{request, request_bytes, start_stream, Engine, MODEL};
use serde_json::Value;

const PARIS: &str = "The capital of France is Paris.";

#[test]
fn chat_answers_golden_and_reuses_the_prefix_only_within_a_scope() {
    // Scopes come from the gateway, which proves itself with the engine token.
    let e = Engine::start("[auth]\nengine_token = \"gw-secret\"");
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"What is the capital of France?"}}],"temperature":0}}"#
    );
    let ask = |tenancy: &[(&str, &str)]| {
        let mut headers = vec![("authorization", "Bearer gw-secret")];
        headers.extend_from_slice(tenancy);
        let r = request(e.addr, "POST", "/v1/chat/completions", &headers, &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let j = ask(&[]);
    assert_eq!(j["choices"][0]["message"]["content"], PARIS);
    assert_eq!(j["choices"][0]["finish_reason"], "stop");
    assert_eq!(j["usage"]["prompt_tokens"], 37);
    assert_eq!(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Same prompt, same scope: the two full blocks of the 37-token prompt are hits.
    let again = ask(&[]);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    assert_eq!(again["choices"][0]["message"]["content"], PARIS);
    // Another scope shares nothing, and then has its own cache.
    let other = |scope: &str| ask(&[("x-kvgate-tenant", "t2"), ("x-kvgate-scope", scope)]);
    assert_eq!(
        other("scope-b")["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert_eq!(
        other("scope-b")["usage"]["prompt_tokens_details"]["cached_tokens"],
        32
    );
    assert!(e.metric("kvgate_prefix_cache_hit_tokens_total{tenant=\"default\"}") >= 32.0);
    // Nothing is held once every request is done (asked of the engine thread, between steps).
    assert_eq!(
        e.admin("GET", "/admin/status", "").json()["blocks"]["used"],
        0
    );
}

#[test]
fn completions_stream_and_usage() {
    let e = Engine::start("");
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"The quick brown fox","max_tokens":12,"temperature":0,"stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    let r = e.post("/v1/completions", &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    // docs/golden-outputs.md's golden ids [351, 253, 2365, 6354, 7012, 30, 198, 198, 504, 2798, 6330, 314].
    assert_eq!(
        text,
        " with a quick brown bear.\n\nThe original sentence is"
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(usage["prompt_tokens"], 4);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_number());
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&Value::from("length")]);
}

#[test]
fn n_samples_each_match_the_sample_run_alone() {
    let e = Engine::start("");
    let ask = |n: u32, seed: u64| {
        let body = format!(
            r#"{{"model":"{MODEL}","prompt":"Once upon a time","max_tokens":10,"temperature":0.9,"seed":{seed},"n":{n}}}"#
        );
        let r = e.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let group = ask(4, 1234);
    let choices = group["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        let alone = ask(1, kvgate_engine::sampling::derive_seed(1234, i as u32));
        assert_eq!(c["text"], alone["choices"][0]["text"], "sample {i}");
        assert_eq!(c["index"], i);
    }
    let distinct: std::collections::HashSet<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(
        distinct.len() > 1,
        "four samples at temperature 0.9 differ: {distinct:?}"
    );
    assert!(
        e.metric("kvgate_kv_cow_copies_total") >= 1.0,
        "forked samples copied the shared partial block"
    );
}

#[test]
fn drain_finishes_in_flight_refuses_new_and_undrain_restores() {
    let e = Engine::start("");
    let addr = e.addr;
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"Count to fifty: one, two,","max_tokens":60,"temperature":0,"ignore_eos":true}}"#
    );
    let b2 = body.clone();
    let inflight = std::thread::spawn(move || request(addr, "POST", "/v1/completions", &[], &b2));
    // Wait until the request is running, then drain.
    let t0 = std::time::Instant::now();
    while e.metric("kvgate_sequences{state=\"running\"}") < 1.0 {
        assert!(t0.elapsed().as_secs() < 60, "request never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let drained = e.admin("POST", "/admin/drain", "");
    assert_eq!(drained.status, 200, "{}", drained.body);
    assert_eq!(drained.json()["draining"], true);
    let refused = e.post("/v1/completions", &body);
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json()["error"]["code"], "draining");
    assert_eq!(e.get("/health").status, 503);
    let done = inflight.join().unwrap();
    assert_eq!(
        done.status, 200,
        "the in-flight request completes: {}",
        done.body
    );
    assert_eq!(done.json()["usage"]["completion_tokens"], 60);
    let status = e.admin("GET", "/admin/status", "").json();
    assert_eq!(status["inflight"], 0);
    assert_eq!(status["drained"], true);
    assert_eq!(e.admin("POST", "/admin/undrain", "").status, 200);
    assert_eq!(e.get("/health").status, 200);
    assert_eq!(e.post("/v1/completions", &body).status, 200);
}

/// `/admin/status` carries what the gateways' routing score needs: the queue, the batch's
/// limits and the measured step costs.
#[test]
fn status_reports_the_queue_and_the_measured_speed() {
    let e = Engine::start("");
    let load = e.admin("GET", "/admin/status", "").json()["load"].clone();
    assert_eq!(load["pending_prefill_tokens"], 0, "{load}");
    assert_eq!(load["running"], 0);
    assert!(load["max_seqs"].as_u64().unwrap() >= 1);
    assert!(load["max_batched_tokens"].as_u64().unwrap() >= 1);
    assert_eq!(load["secs_per_token"], 0.0, "nothing measured yet");
    // What it computes on: a hash (no host name), the same for a second engine on the same
    // CPUs of this machine, so that the gateway knows they share compute.
    let compute = load["compute"].as_str().unwrap().to_owned();
    assert!(
        compute.len() == 16 && compute.bytes().all(|b| b.is_ascii_hexdigit()),
        "{load}"
    );
    let twin = Engine::start("");
    assert_eq!(
        twin.admin("GET", "/admin/status", "").json()["load"]["compute"],
        compute.as_str()
    );
    drop(twin);
    let addr = e.addr;
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"Count to fifty: one, two,","max_tokens":60,"temperature":0,"ignore_eos":true}}"#
    );
    let inflight = std::thread::spawn(move || request(addr, "POST", "/v1/completions", &[], &body));
    let t0 = std::time::Instant::now();
    let during = loop {
        let load = e.admin("GET", "/admin/status", "").json()["load"].clone();
        if load["running"] == 1 && load["next_finish_secs"].as_f64().unwrap() > 0.0 {
            break load;
        }
        assert!(
            t0.elapsed().as_secs() < 60,
            "the request never showed: {load}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert!(during["secs_per_token"].as_f64().unwrap() > 0.0, "{during}");
    assert_eq!(inflight.join().unwrap().status, 200);
    let after = e.admin("GET", "/admin/status", "").json()["load"].clone();
    assert_eq!(
        (
            after["running"].clone(),
            after["pending_prefill_tokens"].clone()
        ),
        (0.into(), 0.into())
    );
    let per_token = after["secs_per_token"].as_f64().unwrap();
    assert!(per_token > 0.0 && per_token < 1.0, "{after}");
    assert!(after["available_blocks"].as_u64().unwrap() > 0);
}

#[test]
fn flush_drops_cached_prefixes() {
    let e = Engine::start("");
    e.chat("What is the capital of France?", "");
    assert_eq!(
        e.chat("What is the capital of France?", "").json()["usage"]["prompt_tokens_details"]
            ["cached_tokens"],
        32
    );
    let f = e.admin("POST", "/admin/cache/flush", "{}");
    assert_eq!(f.status, 200, "{}", f.body);
    assert!(f.json()["flushed_blocks"].as_u64().unwrap() >= 2);
    assert_eq!(
        e.chat("What is the capital of France?", "").json()["usage"]["prompt_tokens_details"]
            ["cached_tokens"],
        0
    );
    // Flushing another scope leaves this one's cache alone.
    e.admin("POST", "/admin/cache/flush", r#"{"scope":"someone-else"}"#);
    assert_eq!(
        e.chat("What is the capital of France?", "").json()["usage"]["prompt_tokens_details"]
            ["cached_tokens"],
        32
    );
    // Admin needs the operator token.
    assert_eq!(e.post("/admin/cache/flush", "{}").status, 401);
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let e = Engine::start("");
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"Tell me a very long story about dragons.","max_tokens":400,"temperature":0,"ignore_eos":true,"stream":true}}"#
    );
    let conn = start_stream(e.addr, "/v1/completions", &body, 600);
    assert!(e.metric("kvgate_kv_blocks{state=\"used\"}") > 0.0);
    drop(conn);
    let t0 = std::time::Instant::now();
    while e.metric("kvgate_kv_blocks{state=\"used\"}") > 0.0 {
        assert!(
            t0.elapsed().as_secs() < 30,
            "blocks were not freed after the disconnect"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        e.metric("kvgate_generation_tokens_total") < 400.0,
        "generation stopped early"
    );
    // The engine still serves.
    assert_eq!(
        e.chat("What is the capital of France?", "").json()["choices"][0]["message"]["content"],
        PARIS
    );
}

#[test]
fn bad_input_gets_openai_errors_and_the_engine_keeps_serving() {
    let e = Engine::start("");
    let chat = |extra: &str| {
        format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#)
    };
    let long_prompt = "hello ".repeat(9000);
    let cases: Vec<(String, String, u16, &str)> = vec![
        (
            "/v1/chat/completions".into(),
            "{not json".into(),
            400,
            "invalid_json",
        ),
        (
            "/v1/chat/completions".into(),
            chat(r#","temperature":"hot""#),
            400,
            "invalid_type",
        ),
        (
            "/v1/chat/completions".into(),
            r#"{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}"#.into(),
            404,
            "model_not_found",
        ),
        (
            "/v1/chat/completions".into(),
            format!(r#"{{"model":"{MODEL}","messages":[]}}"#),
            400,
            "",
        ),
        (
            "/v1/chat/completions".into(),
            chat(r#","max_tokens":0"#),
            400,
            "",
        ),
        (
            "/v1/chat/completions".into(),
            chat(r#","max_tokens":100000000"#),
            400,
            "context_length_exceeded",
        ),
        ("/v1/chat/completions".into(), chat(r#","n":0"#), 400, ""),
        ("/v1/chat/completions".into(), chat(r#","n":1000"#), 400, ""),
        (
            "/v1/chat/completions".into(),
            chat(r#","temperature":-1"#),
            400,
            "",
        ),
        (
            "/v1/completions".into(),
            format!(
                r#"{{"model":"{MODEL}","prompt":{}}}"#,
                Value::String(long_prompt)
            ),
            400,
            "context_length_exceeded",
        ),
        ("/v1/nope".into(), "{}".into(), 404, "unknown_url"),
    ];
    for (path, body, status, code) in cases {
        let r = e.post(&path, &body);
        assert_eq!(r.status, status, "{path} {body:.80}: {}", r.body);
        let err = &r.json()["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            r.body
        );
        assert!(err["type"].is_string(), "{}", r.body);
        if !code.is_empty() {
            assert_eq!(err["code"], code, "{}", r.body);
        }
    }
    // Invalid UTF-8 and an oversized body.
    let r = request_bytes(
        e.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        b"{\"model\":\"\xff\xfe\"}",
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let big = vec![b' '; 100 << 20];
    let r = request_bytes(e.addr, "POST", "/v1/chat/completions", &[], &big);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    assert_eq!(
        e.chat("What is the capital of France?", "").json()["choices"][0]["message"]["content"],
        PARIS
    );
}

#[test]
fn engine_token_and_logprobs() {
    let e = Engine::start("[auth]\nengine_token = \"gw-secret\"");
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"The quick brown fox","max_tokens":3,"temperature":0,"logprobs":2}}"#
    );
    assert_eq!(e.post("/v1/completions", &body).status, 401);
    assert_eq!(e.get("/v1/models").status, 401);
    let r = request(
        e.addr,
        "POST",
        "/v1/completions",
        &[("authorization", "Bearer gw-secret")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let lp = &r.json()["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3, "{lp}");
    assert_eq!(lp["tokens"][0], " with");
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    assert!(first < 0.0 && first > -5.0, "{lp}");
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 2, "{lp}");
    // Greedy: the chosen token is the most likely one.
    let best = top
        .values()
        .map(|v| v.as_f64().unwrap())
        .fold(f64::MIN, f64::max);
    assert!((best - first).abs() < 1e-4, "{lp}");
    assert_eq!(lp["text_offset"][0], 0);
}

//! Tracing end to end: a real gateway in front of a real SmolLM2 engine, both exporting over
//! OTLP/HTTP to a real receiver that decodes with the official `opentelemetry-proto`
//! definitions. One request is one trace: the client's span, the gateway's root with its auth,
//! rate-limit, routing and upstream spans, and under the upstream span the engine's request with
//! its queue, prefill and decode. Then what a client cannot do with a `traceparent`, a request
//! whose client leaves mid-stream, and a collector that is down.

use kvgate_tests::gateway::{
    chat_body, config, engine_toml, stream_and_leave, StoreKind, TestGateway,
};
use kvgate_tests::otlp::OtlpReceiver;
use kvgate_tests::{request, Engine, Response};
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// A system prompt several blocks long, so that a second request hits the cache.
const SYSTEM: &str = "You are a careful assistant for a bicycle repair shop. Answer in one short \
    sentence, name the tool the customer needs, and never recommend a competitor's shop.";

const GATEWAY_SPANS: [&str; 5] = [
    "gateway.request",
    "gateway.auth",
    "gateway.rate_limit",
    "gateway.route",
    "gateway.upstream",
];
const ENGINE_SPANS: [&str; 4] = [
    "engine.request",
    "engine.queue",
    "engine.prefill",
    "engine.decode",
];

fn traced_engine(endpoint: &str) -> Engine {
    Engine::start(&format!(
        "{}[tracing]\notlp_endpoint = \"{endpoint}\"\n",
        engine_toml("")
    ))
}

fn traced_gateway(engine: &Engine, endpoint: &str, sample_ratio: f64) -> TestGateway {
    let mut c = config(&[("e0", engine.addr)]);
    c.tracing.otlp_endpoint = Some(endpoint.to_owned());
    c.tracing.sample_ratio = sample_ratio;
    let gw = TestGateway::start(c, StoreKind::Memory);
    gw.wait_ready(1);
    gw
}

/// A receiver, an engine and a gateway exporting to it (sampling `sample_ratio`), and a key of
/// tenant `acme`; `None` where the venv has no `opentelemetry-proto` (the test skips).
fn traced_stack(sample_ratio: f64) -> Option<(OtlpReceiver, Engine, TestGateway, String)> {
    let otlp = OtlpReceiver::start()?;
    let engine = traced_engine(&otlp.endpoint());
    let gw = traced_gateway(&engine, &otlp.endpoint(), sample_ratio);
    let key = gw.tenant("acme", serde_json::json!({}));
    Some((otlp, engine, gw, key))
}

fn chat_with(gw: &TestGateway, key: &str, traceparent: &str, user: &str) -> Response {
    let auth = format!("Bearer {key}");
    let body = chat_body(Some(SYSTEM), user, r#","max_tokens":6"#);
    let r = request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", &auth), ("traceparent", traceparent)],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

/// The one span of a trace with this name.
fn one<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    let found: Vec<&Value> = spans.iter().filter(|s| s["name"] == name).collect();
    assert_eq!(found.len(), 1, "{name}: {found:?}");
    found[0]
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    &span["attributes"][key]
}

fn int(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("not an integer: {v}"))
}

/// `inner` lies within `outer` in time.
fn within(inner: &Value, outer: &Value) {
    let (s, e) = (int(&inner["start_ns"]), int(&inner["end_ns"]));
    let (os, oe) = (int(&outer["start_ns"]), int(&outer["end_ns"]));
    assert!(
        os <= s && e <= oe && s <= e,
        "{} [{s}, {e}] is not within {} [{os}, {oe}]",
        inner["name"],
        outer["name"]
    );
}

/// One request, one trace: every span with the right parent, service and attributes.
fn check_request_trace(spans: &[Value], usage: &Value, cached_expected: bool) {
    let root = one(spans, "gateway.request");
    assert_eq!(
        root["parent_span_id"], CLIENT_SPAN,
        "the client's span is the parent"
    );
    assert_eq!(root["service"], "kvgate-gateway");
    assert_eq!(root["kind"], 2, "server");
    assert_eq!(int(attr(root, "http.response.status_code")), 200);
    assert_eq!(attr(root, "kvgate.tenant"), "acme");
    for name in &GATEWAY_SPANS[1..] {
        let s = one(spans, name);
        assert_eq!(s["parent_span_id"], root["span_id"], "{name}'s parent");
        assert_eq!(s["service"], "kvgate-gateway");
        within(s, root);
    }
    let route = one(spans, "gateway.route");
    assert!(attr(route, "kvgate.route.decision").is_string());
    assert_eq!(attr(route, "kvgate.engine"), "e0");
    let upstream = one(spans, "gateway.upstream");
    assert_eq!(upstream["kind"], 3, "client");
    assert_eq!(int(attr(upstream, "http.response.status_code")), 200);

    let engine = one(spans, "engine.request");
    assert_eq!(
        engine["parent_span_id"], upstream["span_id"],
        "the engine's request is a child of the gateway's attempt"
    );
    assert_eq!(engine["service"], "kvgate-engine");
    within(engine, upstream);
    for name in &ENGINE_SPANS[1..] {
        let s = one(spans, name);
        assert_eq!(s["parent_span_id"], engine["span_id"], "{name}'s parent");
        assert_eq!(s["service"], "kvgate-engine");
        within(s, engine);
    }
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let prefill = one(spans, "engine.prefill");
    assert_eq!(int(attr(prefill, "kvgate.prefill.cached_tokens")), cached);
    assert_eq!(
        int(attr(prefill, "kvgate.prefill.computed_tokens")),
        prompt - cached
    );
    assert_eq!(
        int(attr(
            one(spans, "engine.decode"),
            "kvgate.completion_tokens"
        )),
        usage["completion_tokens"].as_u64().unwrap()
    );
    let matched = int(attr(route, "kvgate.route.matched_blocks"));
    if cached_expected {
        assert!(cached > 0, "the second request hits the cache: {usage}");
        assert!(matched > 0, "and routing saw the match");
    } else {
        assert_eq!((cached, matched), (0, 0), "a cold cache");
    }
    // The queue ends where the prefill starts, the prefill where the decode starts.
    let queue = one(spans, "engine.queue");
    assert_eq!(queue["end_ns"], prefill["start_ns"]);
    assert_eq!(prefill["end_ns"], one(spans, "engine.decode")["start_ns"]);
    assert!(
        spans.iter().all(|s| s["status_code"] != 2),
        "nothing failed: {spans:?}"
    );
}

#[test]
fn one_request_is_one_trace_across_gateway_and_engine() {
    let Some((otlp, _engine, gw, key)) = traced_stack(1.0) else {
        return;
    };
    let mut names: Vec<&str> = GATEWAY_SPANS.to_vec();
    names.extend(ENGINE_SPANS);

    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let first = chat_with(&gw, &key, &parent, "My chain skips.");
    let spans = otlp.wait_trace(CLIENT_TRACE, &names);
    assert_eq!(spans.len(), names.len(), "{spans:?}");
    check_request_trace(&spans, &first.json()["usage"], false);

    // The same prefix again, in a trace of its own: cached tokens in the prefill span, once
    // the gateway knows the first request's blocks.
    let block = u64::from(gw.gw.router.config().block_size);
    gw.wait_indexed(first.json()["usage"]["prompt_tokens"].as_u64().unwrap() / block);
    let second_trace = "0af7651916cd43dd8448eb211c80319c";
    let parent = format!("00-{second_trace}-{CLIENT_SPAN}-01");
    let second = chat_with(&gw, &key, &parent, "My brakes squeal.");
    let spans = otlp.wait_trace(second_trace, &names);
    check_request_trace(&spans, &second.json()["usage"], true);

    // A client's flags decide nothing: not sampled still recorded (the gateway samples all).
    let unsampled = "1af7651916cd43dd8448eb211c80319c";
    chat_with(
        &gw,
        &key,
        &format!("00-{unsampled}-{CLIENT_SPAN}-00"),
        "Hi.",
    );
    let spans = otlp.wait_trace(unsampled, &names);
    assert_eq!(spans.len(), names.len());

    // A request refused before it is authenticated (anyone can send one) leaves no trace.
    let refused = "2af7651916cd43dd8448eb211c80319c";
    let r = request(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("authorization", "Bearer kvg_not_a_key"),
            ("traceparent", &format!("00-{refused}-{CLIENT_SPAN}-01")),
        ],
        &chat_body(None, "Hi.", ""),
    );
    assert_eq!(r.status, 401, "{}", r.body);

    // A malformed traceparent is no parent: a fresh trace, rooted at the gateway.
    let before: usize = otlp.spans().len();
    let garbage = "00-ZZf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    chat_with(&gw, &key, garbage, "Hello.");
    let fresh = wait_new_root(&otlp, before);
    assert_eq!(fresh["parent_span_id"], "", "a root with no parent");
    assert_ne!(fresh["trace_id"], "zzf92f3577b34da6a3ce929d0e0e4736");
    otlp.wait_trace(fresh["trace_id"].as_str().unwrap(), &names);
    assert!(
        otlp.spans().iter().all(|s| s["trace_id"] != refused),
        "the unauthenticated request was exported"
    );

    // The export's counters.
    let metrics = gw.metrics();
    assert!(
        metrics.contains("kvgate_gateway_trace_spans_exported_total"),
        "{metrics}"
    );
}

/// The next `gateway.request` span past the first `before` spans received.
fn wait_new_root(otlp: &OtlpReceiver, before: usize) -> Value {
    for _ in 0..300 {
        if let Some(root) = otlp
            .spans()
            .into_iter()
            .skip(before)
            .find(|s| s["name"] == "gateway.request")
        {
            return root;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("no new trace arrived");
}

/// A streamed request whose client leaves after the first token: the gateway's root ends as
/// 499 with its upstream span, and the engine's request is marked cancelled, all exported.
#[test]
fn a_stream_cut_by_its_client_is_traced_to_its_end() {
    let Some((otlp, _engine, gw, key)) = traced_stack(1.0) else {
        return;
    };
    let body = chat_body(
        Some(SYSTEM),
        "Tell me a long story.",
        r#","max_tokens":200,"stream":true,"ignore_eos":true"#,
    );
    let parent = format!("traceparent: 00-{CLIENT_TRACE}-{CLIENT_SPAN}-01\r\n");
    stream_and_leave(gw.addr, &key, &parent, &body);
    let spans = otlp.wait_trace(CLIENT_TRACE, &["gateway.request", "engine.request"]);
    let root = one(&spans, "gateway.request");
    assert_eq!(int(attr(root, "http.response.status_code")), 499);
    let upstream = one(&spans, "gateway.upstream");
    assert_eq!(attr(upstream, "kvgate.stream_end"), "client_gone");
    let engine = one(&spans, "engine.request");
    assert_eq!(engine["parent_span_id"], upstream["span_id"]);
    assert_eq!(engine["status_code"], 2, "error: {engine}");
    assert!(engine["status_message"]
        .as_str()
        .unwrap()
        .contains("cancelled"));
    let by_name: HashMap<&str, usize> = spans.iter().fold(HashMap::new(), |mut m, s| {
        *m.entry(s["name"].as_str().unwrap()).or_default() += 1;
        m
    });
    assert_eq!(by_name.get("engine.queue"), Some(&1));
    assert_eq!(by_name.get("engine.prefill"), Some(&1));
}

/// A gateway that samples nothing records nothing and sends the engine no trace context, so
/// the engine (which follows its gateway) records nothing either; a collector that is down
/// costs requests nothing and is counted.
#[test]
fn unsampled_requests_leave_no_spans_and_a_dead_collector_costs_nothing() {
    let Some((otlp, engine, gw, key)) = traced_stack(0.0) else {
        return;
    };
    for i in 0..3 {
        let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
        chat_with(&gw, &key, &parent, &format!("Question {i}?"));
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(otlp.spans().is_empty(), "{:?}", otlp.spans());
    drop(gw);

    // Nothing listens on this port: every export fails, every request succeeds.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gw = traced_gateway(&engine, &dead, 1.0);
    let key = gw.tenant("acme", serde_json::json!({}));
    for i in 0..3 {
        let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
        chat_with(&gw, &key, &parent, &format!("Question {i}?"));
    }
    let failed = "kvgate_gateway_trace_spans_failed_total ";
    let mut lost = 0.0;
    for _ in 0..100 {
        lost = gw
            .metrics()
            .lines()
            .find_map(|l| l.strip_prefix(failed))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        if lost >= 15.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(lost >= 15.0, "3 requests x 5 spans counted as lost: {lost}");
}

//! Faults between the gateway and real engines: an engine that dies mid-stream (the client gets
//! an SSE error event; requests not yet streaming go elsewhere), and a client that goes away
//! mid-stream (the engine request is cancelled and frees its blocks).

use kvgate_tests::gateway::{chat_body, config, gated_engine, Relay, StoreKind, TestGateway};
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Opens a streaming chat through the gateway and returns the connection after the first SSE
/// event arrived.
fn open_stream(gw: &TestGateway, key: &str, system: &str, max_tokens: u32) -> (TcpStream, String) {
    let body = chat_body(
        Some(system),
        "Write a very long story about the sea.",
        &format!(r#","max_tokens":{max_tokens},"ignore_eos":true,"stream":true"#),
    );
    let mut s = TcpStream::connect(gw.addr).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream closed early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    (s, String::from_utf8_lossy(&got).into_owned())
}

fn read_rest(mut s: TcpStream) -> String {
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    String::from_utf8_lossy(&rest).into_owned()
}

#[test]
fn engine_dies_mid_stream_and_requests_move() {
    let a = gated_engine("blocks = 1024");
    let b = gated_engine("blocks = 1024");
    let mut relay = Relay::start(a.addr);
    let gw = TestGateway::start(
        config(&[("a", relay.addr), ("b", b.addr)]),
        StoreKind::Memory,
    );
    gw.wait_ready(2);
    // Find a tenant whose prefix lives on engine a.
    let mut on_a = None;
    for i in 0..8 {
        let key = gw.tenant(&format!("t{i}"), json!({}));
        let system = format!("You are assistant {i} of the harbor company. Be brief and kind.");
        let r = gw.chat(&key, Some(&system), "Hello", r#","max_tokens":1"#);
        assert_eq!(r.status, 200, "{}", r.body);
        if r.header("x-kvgate-engine") == Some("a") {
            on_a = Some((key, system));
            break;
        }
    }
    let (key, system) = on_a.expect("some tenant lands on engine a");

    let (stream, head) = open_stream(&gw, &key, &system, 400);
    assert!(head.contains("x-kvgate-engine: a"), "{head}");
    relay.kill();
    let rest = read_rest(stream);
    let all = head + &rest;
    assert!(
        all.contains("\"error\"") && all.contains("failed mid-stream"),
        "the client is told the stream failed: {all}"
    );
    assert!(all.trim_end().ends_with("data: [DONE]") || all.contains("data: [DONE]"));

    // Requests that had not started streaming are served by the engine still alive.
    for _ in 0..4 {
        let r = gw.chat(&key, Some(&system), "Are you there?", r#","max_tokens":1"#);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvgate-engine"), Some("b"));
    }
    // Engine a's KV blocks are no longer in the gateway's index once its stream broke.
    let engines = gw.admin("GET", "/admin/engines", "").json();
    let a_view = engines["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "a")
        .unwrap()
        .clone();
    assert_eq!(a_view["cached_blocks_indexed"], 0, "{a_view}");
}

#[test]
fn client_disconnect_cancels_the_engine_request() {
    let e = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e", e.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("t", json!({}));
    let before = e.metric("kvgate_generation_tokens_total");
    let (stream, _) = open_stream(&gw, &key, "You are a storyteller.", 2000);
    assert_eq!(e.state.inflight.load(Ordering::SeqCst), 1);
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(20);
    while e.state.inflight.load(Ordering::SeqCst) != 0 {
        assert!(Instant::now() < deadline, "the engine kept generating");
        std::thread::sleep(Duration::from_millis(20));
    }
    let generated = e.metric("kvgate_generation_tokens_total") - before;
    assert!(generated < 1000.0, "cancelled early: {generated} tokens");
    // Every block is back: nothing in use on the engine.
    let status = e.admin("GET", "/admin/status", "").json();
    assert_eq!(status["blocks"]["used"], 0, "{status}");
    // And the gateway counts nothing in flight.
    let engines = gw.admin("GET", "/admin/engines", "").json();
    assert_eq!(engines["engines"][0]["inflight"], 0, "{engines}");
}

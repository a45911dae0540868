//! Live scrapes for the operations checks: a real engine and gateway serve a few requests (a
//! success, a rate-limited one, a bad key), then their `/metrics` are written to
//! `target/ops/engine.prom` and `target/ops/gateway.prom`. `scripts/check-ops` (run by
//! `scripts/test` after the tests) checks every metric the dashboards, recording rules and alerts
//! read against these scrapes, and runs `promtool check metrics` on them.

use kvgate_tests::gateway::{config, gated_engine, StoreKind, TestGateway};
use serde_json::json;
use std::path::Path;

#[test]
fn write_live_scrapes() {
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(config(&[("e0", engine.addr)]), StoreKind::Memory);
    gw.wait_ready(1);
    let key = gw.tenant("ops", json!({"requests_per_min": 1, "kv_block_quota": 256}));
    let r = gw.chat(&key, Some("You are terse."), "Hi", r#","max_tokens":2"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = gw.chat(
        &key,
        Some("You are terse."),
        "Hi again",
        r#","max_tokens":2"#,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    let r = gw.chat("kvg_wrong", None, "Hi", "");
    assert_eq!(r.status, 401);

    let gateway = gw.metrics();
    let engine_text = engine.get("/metrics").body;
    for needle in [
        "kvgate_gateway_requests_total{tenant=\"ops\",code=\"200\"}",
        "kvgate_gateway_ratelimited_total{tenant=\"ops\"} 1",
        "kvgate_gateway_engine_up{engine=\"e0\"} 1",
        "kvgate_gateway_route_decisions_total{reason=",
    ] {
        assert!(gateway.contains(needle), "{needle} missing:\n{gateway}");
    }
    assert!(engine_text.contains("kvgate_prefix_cache_queried_tokens_total"));
    assert!(
        engine_text.contains("kvgate_tenant_kv_quota_blocks{tenant=\"ops\"} 256"),
        "{engine_text}"
    );
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ops");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("gateway.prom"), gateway).unwrap();
    std::fs::write(dir.join("engine.prom"), engine_text).unwrap();
}

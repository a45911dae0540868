//! The gateway on a real Redis: no API key is ever stored in clear, and when Redis goes away
//! keys verified before keep working for their cache TTL while unknown keys get a prompt 503.

use kvgate_tests::gateway::{config, gated_engine, StoreKind, TestGateway};
use kvgate_tests::redis::RedisServer;
use serde_json::json;
use std::time::{Duration, Instant};

#[test]
fn keys_hashed_in_redis_and_cached_through_an_outage() {
    let mut redis = RedisServer::start();
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(
        config(&[("e0", engine.addr)]),
        StoreKind::Redis(redis.url()),
    );
    gw.wait_ready(1);
    let used = gw.tenant("acme", json!({"requests_per_min": 1000}));
    let unused = gw.issue_key("acme");
    let r = gw.chat(&used, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "{}", r.body);

    // The whole keyspace: names and values, never a key in clear.
    let keys = redis.keys();
    assert!(keys.iter().all(|k| k.starts_with("kvgate:")), "{keys:?}");
    for k in &keys {
        for v in redis.dump_values(k).iter().chain(std::iter::once(k)) {
            assert!(
                !v.contains(&used) && !v.contains(&unused) && !v.contains(&used[4..]),
                "a key in clear under {k}: {v}"
            );
        }
    }

    redis.stop();
    let r = gw.chat(&used, None, "Still there?", r#","max_tokens":1"#);
    assert_eq!(r.status, 200, "a verified key keeps working: {}", r.body);
    let t = Instant::now();
    let r = gw.chat(&unused, None, "Hi", r#","max_tokens":1"#);
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.header("retry-after").is_some());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "no hang: {:?}",
        t.elapsed()
    );
    assert!(gw.metrics().contains("kvgate_gateway_store_errors_total"));
}

//! `kvgate usage-sink` as a process, between a real Redis and a real PostgreSQL: every ledger
//! record of real requests (finished and cut by their clients) lands in `usage_records` exactly
//! once, through a PostgreSQL outage, a sink killed and restarted, a consumer that died with
//! entries pending, and every entry delivered twice.

use kvgate_tests::gateway::{
    chat_body, config, gated_engine, stream_and_leave, StoreKind, TestGateway,
};
use kvgate_tests::postgres::PostgresServer;
use kvgate_tests::redis::RedisServer;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn sink(redis: &str, postgres: &str, consumer: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    c.args(["usage-sink", "--redis", redis, "--postgres", postgres])
        .args([
            "--consumer",
            consumer,
            "--batch",
            "16",
            "--claim-idle-secs",
            "1",
        ])
        .args(extra)
        .env("KVGATE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a run of traffic sent, and what the finished requests' clients were told.
#[derive(Default)]
struct Sent {
    requests: u64,
    cut: u64,
    prompt: u64,
    completion: u64,
}

/// `n` requests from each key: whole answers, and every third a stream cut after its first
/// token.
fn traffic(gw: &TestGateway, keys: &[String], n: usize, sent: &mut Sent) {
    for i in 0..n {
        for key in keys {
            let user = format!("Name a colour, number {i}.");
            sent.requests += 1;
            if i % 3 == 2 {
                cut_stream(gw, key, &user);
                sent.cut += 1;
                continue;
            }
            let r = gw.chat(key, None, &user, r#","max_tokens":2"#);
            assert_eq!(r.status, 200, "{}", r.body);
            let u = &r.json()["usage"];
            sent.prompt += u["prompt_tokens"].as_u64().unwrap();
            sent.completion += u["completion_tokens"].as_u64().unwrap();
        }
    }
}

fn cut_stream(gw: &TestGateway, key: &str, user: &str) {
    let body = chat_body(None, user, r#","max_tokens":32,"stream":true"#);
    stream_and_leave(gw.addr, key, "", &body);
}

/// The gateway's ledger records, newest first.
fn ledger(gw: &TestGateway) -> Vec<Value> {
    let r = gw.admin("GET", "/admin/usage/records?limit=10000", "");
    r.json()["records"].as_array().cloned().unwrap()
}

fn rows(pg: &PostgresServer) -> u64 {
    pg.query("SELECT count(*) FROM usage_records")
        .parse()
        .unwrap()
}

fn wait_rows(pg: &PostgresServer, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let count = || {
        pg.try_query("SELECT count(*) FROM usage_records")
            .and_then(|c| c.parse::<u64>().ok())
    };
    while count() != Some(n) {
        assert!(
            Instant::now() < deadline,
            "{:?} of {n} rows after 60 s",
            count()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn every_record_lands_in_postgres_exactly_once() {
    let redis = RedisServer::start();
    let mut pg = PostgresServer::start();
    let engine = gated_engine("blocks = 1024");
    let gw = TestGateway::start(
        config(&[("e0", engine.addr)]),
        StoreKind::Redis(redis.url()),
    );
    gw.wait_ready(1);
    let keys: Vec<String> = ["red", "green", "blue"]
        .iter()
        .map(|t| gw.tenant(t, json!({})))
        .collect();

    let mut a = Proc(
        sink(&redis.url(), &pg.url(), "sink-a", &[])
            .spawn()
            .unwrap(),
    );
    // 201 requests from 3 tenants in all (67 each), 63 of them streams cut by their client.
    let mut sent = Sent::default();
    traffic(&gw, &keys, 22, &mut sent);
    wait_rows(&pg, sent.requests);

    // PostgreSQL goes down: the records wait in the stream, the sink retries.
    pg.stop();
    traffic(&gw, &keys, 22, &mut sent);
    std::thread::sleep(Duration::from_millis(500));
    pg.restart();
    wait_rows(&pg, sent.requests);

    // The sink is killed; records arrive meanwhile; it comes back under its name.
    let _ = a.0.kill();
    let _ = a.0.wait();
    traffic(&gw, &keys, 11, &mut sent);
    a = Proc(
        sink(&redis.url(), &pg.url(), "sink-a", &[])
            .spawn()
            .unwrap(),
    );
    wait_rows(&pg, sent.requests);
    drop(a);

    // A consumer that read entries and died before writing them: another sink claims them.
    traffic(&gw, &keys, 12, &mut sent);
    assert_eq!((sent.requests, sent.cut), (201, 63));
    let claimed = redis.cmd(&[
        "XREADGROUP",
        "GROUP",
        "kvgate-usage-sink",
        "ghost",
        "COUNT",
        "5",
        "STREAMS",
        "kvgate:usage:records",
        ">",
    ]);
    assert!(format!("{claimed:?}").contains("u_"), "{claimed:?}");
    std::thread::sleep(Duration::from_millis(1100));
    let out = sink(&redis.url(), &pg.url(), "sink-b", &["--once"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(rows(&pg), sent.requests);

    // Every entry delivered again (a sink that committed and died before acknowledging):
    // nothing is counted twice.
    redis.cmd(&[
        "XGROUP",
        "SETID",
        "kvgate:usage:records",
        "kvgate-usage-sink",
        "0",
    ]);
    let out = sink(&redis.url(), &pg.url(), "sink-c", &["--once"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(rows(&pg), sent.requests);

    // The table says what the ledger says, record by record, and what the clients were told.
    let records = ledger(&gw);
    assert_eq!(records.len() as u64, sent.requests);
    let sum = |f: &str| records.iter().map(|r| r[f].as_u64().unwrap()).sum::<u64>();
    let table = pg.query(
        "SELECT count(DISTINCT id), sum(prompt_tokens), sum(completion_tokens), \
         sum(cached_tokens), count(*) FILTER (WHERE ending = 'cancelled') FROM usage_records",
    );
    let expect = format!(
        "{}|{}|{}|{}|{}",
        sent.requests,
        sum("prompt_tokens"),
        sum("completion_tokens"),
        sum("cached_tokens"),
        sent.cut
    );
    assert_eq!(table, expect);
    let done = pg.query(
        "SELECT sum(prompt_tokens), sum(completion_tokens) FROM usage_records \
         WHERE ending = 'completed'",
    );
    assert_eq!(done, format!("{}|{}", sent.prompt, sent.completion));
    let cut_served: u64 = pg
        .query("SELECT min(completion_tokens) FROM usage_records WHERE ending = 'cancelled'")
        .parse()
        .unwrap();
    assert!(cut_served >= 1, "a cut stream is billed what it served");
    let schema = pg.query("SELECT max(version) FROM kvgate_schema");
    assert_eq!(schema, "1");
}

//! The gateway's Redis store against a real `redis-server`: the same behaviour as the in-memory
//! store, limits shared by two replicas, migrations, no API key in clear, and failing fast (then
//! recovering) when Redis goes away.

use kvgate_gateway::audit::{AuditEntry, AuditQuery};
use kvgate_gateway::store::{
    Admission, MemoryStore, RecordQuery, RedisStore, Refusal, Store, StoreError, SCHEMA_VERSION,
};
use kvgate_gateway::tenant::{
    generate_key, EngineRecord, KeyHash, KeyRecord, OperatorToken, RateLimits, Role, Tenant,
};
use kvgate_gateway::usage::{self, Ending, UsageRecord};
use kvgate_tests::redis::{RedisServer, Reply};
use std::sync::Arc;
use std::time::Duration;

const PEPPER: &[u8] = b"test-pepper";

async fn migrated(server: &RedisServer) -> RedisStore {
    let store = RedisStore::connect(&server.url()).await.expect("connect");
    store.migrate().await.expect("migrate");
    store
}

fn limits(rpm: Option<u32>, tpm: Option<u64>, conc: Option<u32>) -> RateLimits {
    RateLimits {
        requests_per_min: rpm,
        tokens_per_min: tpm,
        max_concurrent: conc,
    }
}

fn adm<'a>(tenant: &'a str, limits: RateLimits, id: &'a str) -> Admission<'a> {
    Admission {
        tenant,
        limits,
        lease: id,
        lease_ms: 30_000,
        tokens: 0,
    }
}

/// A key record for a fresh key; returns the clear key too (what a client would hold).
fn new_key(tenant: &str, created_at: u64) -> (String, KeyRecord) {
    let clear = generate_key();
    let rec = KeyRecord {
        created_at,
        ..KeyRecord::new(tenant, KeyHash::of(PEPPER, &clear), &clear[..8])
    };
    (clear, rec)
}

#[tokio::test]
async fn tenants_keys_and_engines_crud() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    assert_eq!(s.get_tenant("acme").await.unwrap(), None);
    let mut t = Tenant::new("acme");
    t.requests_per_min = Some(10);
    t.allowed_models = vec!["m".into()];
    s.put_tenant(&t).await.unwrap();
    s.put_tenant(&Tenant::new("beta")).await.unwrap();
    assert_eq!(s.get_tenant("acme").await.unwrap(), Some(t.clone()));
    t.priority = 3;
    s.put_tenant(&t).await.unwrap();
    let ids: Vec<_> = (s.list_tenants().await.unwrap().into_iter())
        .map(|t| (t.id, t.priority))
        .collect();
    assert_eq!(ids, [("acme".to_owned(), 3), ("beta".to_owned(), 1)]);

    let (_, a1) = new_key("acme", 2);
    let (_, a2) = new_key("acme", 1);
    let (_, b1) = new_key("beta", 1);
    for k in [&a1, &a2, &b1] {
        s.put_key(k).await.unwrap();
    }
    assert_eq!(s.key_by_hash(&a1.hash).await.unwrap(), Some(a1.clone()));
    assert_eq!(s.list_keys("acme").await.unwrap(), [a2.clone(), a1.clone()]);
    assert!(!s.revoke_key("beta", &a1.id).await.unwrap());
    assert!(s.revoke_key("acme", &a1.id).await.unwrap());
    assert!(!s.revoke_key("acme", "key_000000000000").await.unwrap());
    assert!(s.key_by_hash(&a1.hash).await.unwrap().unwrap().revoked);

    // Deleting a tenant takes its keys and its rate-limit state with it.
    let l = limits(Some(5), Some(100), Some(5));
    assert_eq!(s.admit(adm("acme", l, "r1")).await.unwrap(), Ok(()));
    s.release("acme", l, "r0", 10).await.unwrap();
    assert!(s.delete_tenant("acme").await.unwrap());
    assert!(!s.delete_tenant("acme").await.unwrap());
    assert_eq!(s.key_by_hash(&a1.hash).await.unwrap(), None);
    assert_eq!(s.key_by_hash(&a2.hash).await.unwrap(), None);
    assert!(s.list_keys("acme").await.unwrap().is_empty());
    assert_eq!(s.list_keys("beta").await.unwrap(), [b1]);
    let left: Vec<String> = server.keys();
    assert!(!left.iter().any(|k| k.contains("acme")), "{left:?}");

    let e = |n: &str| EngineRecord {
        name: n.into(),
        url: format!("http://{n}:8081"),
        added_at: 5,
    };
    s.put_engine(&e("b")).await.unwrap();
    s.put_engine(&e("a")).await.unwrap();
    assert_eq!(s.list_engines().await.unwrap(), [e("a"), e("b")]);
    assert!(s.remove_engine("a").await.unwrap());
    assert!(!s.remove_engine("a").await.unwrap());
    assert_eq!(s.list_engines().await.unwrap(), [e("b")]);
}

#[tokio::test]
async fn a_corrupt_record_is_reported_as_such() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    server.cmd(&["SET", "kvgate:tenant:bad", "{not json"]);
    server.cmd(&["SADD", "kvgate:tenants", "bad"]);
    let err = s.get_tenant("bad").await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Corrupt { key, .. } if key == "kvgate:tenant:bad"),
        "{err:?}"
    );
    assert!(matches!(
        s.list_tenants().await,
        Err(StoreError::Corrupt { .. })
    ));
}

#[tokio::test]
async fn requests_per_minute_burst_then_refusal() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let l = limits(Some(5), None, None); // T = 12 s
    for i in 0..5 {
        assert_eq!(
            s.admit(adm("acme", l, &i.to_string())).await.unwrap(),
            Ok(())
        );
    }
    let r = s.admit(adm("acme", l, "x")).await.unwrap().unwrap_err();
    assert!(matches!(r, Refusal::Requests { .. }), "{r:?}");
    // The next slot frees 12 s after the burst began (less the little time the test took).
    assert!(
        r.retry_after_ms() > 10_000 && r.retry_after_ms() <= 12_000,
        "{r:?}"
    );
    assert_eq!(s.admit(adm("beta", l, "x")).await.unwrap(), Ok(()));
    // The arrival time expires once it is in the past.
    let ttl = server.cmd(&["PTTL", "kvgate:rl:acme:req"]);
    assert!(
        matches!(ttl, Reply::Int(ms) if ms > 50_000 && ms <= 60_000),
        "{ttl:?}"
    );
}

#[tokio::test]
async fn zero_limits_refuse_everything() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let r = s.admit(adm("a", limits(Some(0), None, None), "r")).await;
    assert_eq!(
        r.unwrap(),
        Err(Refusal::Requests {
            retry_after_ms: 60_000
        })
    );
    let r = s.admit(adm("a", limits(None, Some(0), None), "r")).await;
    assert_eq!(
        r.unwrap(),
        Err(Refusal::Tokens {
            retry_after_ms: 60_000
        })
    );
    let r = s.admit(adm("a", limits(None, None, Some(0)), "r")).await;
    assert_eq!(
        r.unwrap(),
        Err(Refusal::Concurrency {
            retry_after_ms: 1000
        })
    );
    let r = s.admit(adm("a", RateLimits::default(), "r")).await;
    assert_eq!(r.unwrap(), Ok(()));
}

#[tokio::test]
async fn tokens_per_minute_debt() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let l = limits(None, Some(1000), None);
    assert_eq!(s.admit(adm("acme", l, "1")).await.unwrap(), Ok(()));
    // 1500 tokens at 1000/min: 90 s of balance, 30 s beyond the allowed minute of debt.
    s.release("acme", l, "1", 1500).await.unwrap();
    let r = s.admit(adm("acme", l, "2")).await.unwrap().unwrap_err();
    assert!(matches!(r, Refusal::Tokens { .. }), "{r:?}");
    assert!(
        r.retry_after_ms() > 28_000 && r.retry_after_ms() <= 30_000,
        "{r:?}"
    );
    // Less than a minute in debt still admits.
    let l2 = limits(None, Some(600_000), None);
    s.release("beta", l2, "1", 590_000).await.unwrap();
    assert_eq!(s.admit(adm("beta", l2, "2")).await.unwrap(), Ok(()));
}

#[tokio::test]
async fn concurrency_release_and_lease_expiry() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let l = limits(None, None, Some(2));
    let lease = |id, lease_ms| Admission {
        tenant: "acme",
        limits: l,
        lease: id,
        lease_ms,
        tokens: 0,
    };
    assert_eq!(s.admit(lease("a", 30_000)).await.unwrap(), Ok(()));
    // Terms of seconds, not milliseconds: a Redis call stalled on a loaded machine must not
    // let a lease lapse before the test means it to.
    assert_eq!(s.admit(lease("b", 2_000)).await.unwrap(), Ok(()));
    assert_eq!(
        s.admit(lease("c", 30_000)).await.unwrap(),
        Err(Refusal::Concurrency {
            retry_after_ms: 1000
        })
    );
    s.release("acme", l, "a", 0).await.unwrap();
    assert_eq!(s.admit(lease("c", 30_000)).await.unwrap(), Ok(()));
    assert!(s.admit(lease("d", 30_000)).await.unwrap().is_err());
    // "b" is never released: its lease lapses (a crashed gateway does not leak the slot).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(s.admit(lease("d", 30_000)).await.unwrap(), Ok(()));
    s.release("acme", l, "nope", 0).await.unwrap();
}

#[tokio::test]
async fn prompt_tokens_are_charged_on_admission() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let l = limits(None, Some(1000), None);
    // 1500 prompt tokens at 1000/min: charged at once, so the next request waits though the
    // first was never released.
    let first = Admission {
        tokens: 1500,
        ..adm("acme", l, "1")
    };
    assert_eq!(s.admit(first).await.unwrap(), Ok(()));
    let r = s.admit(adm("acme", l, "2")).await.unwrap().unwrap_err();
    assert!(matches!(r, Refusal::Tokens { .. }), "{r:?}");
    // A refused admission charges nothing.
    let l2 = limits(Some(1), Some(1000), None);
    assert_eq!(s.admit(adm("beta", l2, "1")).await.unwrap(), Ok(()));
    let refused = Admission {
        tokens: 5000,
        ..adm("beta", l2, "2")
    };
    assert!(s.admit(refused).await.unwrap().is_err());
    let r = s.admit(adm("beta", l2, "3")).await.unwrap().unwrap_err();
    assert!(matches!(r, Refusal::Requests { .. }), "{r:?}");
}

#[tokio::test]
async fn a_renewed_lease_outlives_its_first_term() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let l = limits(None, None, Some(1));
    let short = Admission {
        lease_ms: 2_000,
        ..adm("acme", l, "a")
    };
    assert_eq!(s.admit(short).await.unwrap(), Ok(()));
    s.renew("acme", "a", 30_000).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    // Still held past its first term.
    assert!(s.admit(adm("acme", l, "b")).await.unwrap().is_err());
    s.release("acme", l, "a", 0).await.unwrap();
    // A released lease is not brought back by a late renewal.
    s.renew("acme", "a", 30_000).await.unwrap();
    assert_eq!(s.admit(adm("acme", l, "b")).await.unwrap(), Ok(()));
}

#[tokio::test]
async fn a_refusal_charges_nothing() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let l = limits(Some(2), None, Some(1));
    assert_eq!(s.admit(adm("acme", l, "a")).await.unwrap(), Ok(()));
    let r = s.admit(adm("acme", l, "b")).await.unwrap();
    assert!(matches!(r, Err(Refusal::Concurrency { .. })), "{r:?}");
    s.release("acme", l, "a", 0).await.unwrap();
    // The concurrency refusal did not spend a request.
    assert_eq!(s.admit(adm("acme", l, "b")).await.unwrap(), Ok(()));
    s.release("acme", l, "b", 0).await.unwrap();
    let r = s.admit(adm("acme", l, "c")).await.unwrap();
    assert!(matches!(r, Err(Refusal::Requests { .. })), "{r:?}");
}

/// Two stores (two connections, standing in for two gateway replicas) admit concurrently: the
/// tenant gets its limit once, not once per replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_shared_by_replicas() {
    let server = RedisServer::start();
    let replicas = [
        Arc::new(migrated(&server).await),
        Arc::new(RedisStore::connect(&server.url()).await.unwrap()),
    ];
    let run = |l: RateLimits, tenant: &'static str| {
        let mut tasks = Vec::new();
        for (r, store) in replicas.iter().enumerate() {
            for i in 0..40 {
                let store = store.clone();
                tasks.push(tokio::spawn(async move {
                    let id = format!("{r}-{i}");
                    store.admit(adm(tenant, l, &id)).await.unwrap().is_ok()
                }));
            }
        }
        tasks
    };
    let mut admitted = 0;
    for t in run(limits(Some(30), None, None), "rpm") {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 30);
    let mut admitted = 0;
    for t in run(limits(None, None, Some(7)), "conc") {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 7);
    let zcard = server.cmd(&["ZCARD", "kvgate:rl:conc:conc"]);
    assert_eq!(zcard, Reply::Int(7));
}

#[tokio::test]
async fn migrations_apply_once_and_refuse_newer() {
    let server = RedisServer::start();
    let s = RedisStore::connect(&server.url()).await.unwrap();
    assert_eq!(s.schema_version().await.unwrap(), 0);
    let err = s.check_schema().await.unwrap_err();
    assert!(matches!(err, StoreError::Schema(_)), "{err:?}");

    let all: Vec<u32> = (1..=SCHEMA_VERSION).collect();
    assert_eq!(s.migrate().await.unwrap(), all);
    assert_eq!(s.schema_version().await.unwrap(), SCHEMA_VERSION);
    s.check_schema().await.unwrap();
    let history = server.cmd(&["HGET", "kvgate:migrations", "1"]);
    assert!(
        history
            .as_str()
            .and_then(|t| t.parse::<u64>().ok())
            .is_some(),
        "{history:?}"
    );
    // Again: a no-op.
    assert!(s.migrate().await.unwrap().is_empty());
    s.check_schema().await.unwrap();

    // A keyspace from a newer kvgate: neither served nor migrated.
    let newer = (SCHEMA_VERSION + 1).to_string();
    server.cmd(&["SET", "kvgate:schema_version", &newer]);
    let err = s.check_schema().await.unwrap_err();
    assert!(matches!(err, StoreError::Schema(_)), "{err:?}");
    let err = s.migrate().await.unwrap_err();
    assert!(matches!(err, StoreError::Schema(_)), "{err:?}");
    assert_eq!(
        server.cmd(&["GET", "kvgate:schema_version"]),
        Reply::Str(newer)
    );
}

#[tokio::test]
async fn migration_refuses_foreign_data() {
    let server = RedisServer::start();
    server.cmd(&["SET", "kvgate:tenants", "something else"]);
    let s = RedisStore::connect(&server.url()).await.unwrap();
    let err = s.migrate().await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Schema(m) if m.contains("kvgate:tenants")),
        "{err:?}"
    );
    assert_eq!(s.schema_version().await.unwrap(), 0);
}

/// A version-1 keyspace (a key record without the fields version 2 adds) moves to version 2 and
/// its key reads back as an unnamed key with no expiry and no limits; a version-2 name already
/// used with another type stops the migration at version 1.
#[tokio::test]
async fn migration_0002_upgrades_a_version_1_keyspace() {
    let server = RedisServer::start();
    let v1_key = r#"{"id":"key_000000000001","tenant":"acme","hash":"00000000000000000000000000000000000000000000000000000000000000aa","prefix":"kvg_AbCd","created_at":5,"revoked":false}"#;
    let hash = "00000000000000000000000000000000000000000000000000000000000000aa";
    server.cmd(&["SET", "kvgate:schema_version", "1"]);
    server.cmd(&["SET", &format!("kvgate:key:{hash}"), v1_key]);
    server.cmd(&["SADD", "kvgate:tenant_keys:acme", hash]);
    let s = RedisStore::connect(&server.url()).await.unwrap();
    assert_eq!(s.migrate().await.unwrap(), vec![2]);
    let keys = s.list_keys("acme").await.unwrap();
    assert_eq!(keys.len(), 1);
    let k = &keys[0];
    assert_eq!(
        (k.name.as_str(), k.expires_at, k.requests_per_min),
        ("", None, None)
    );
    assert!(k.labels.is_empty() && k.budget.is_none() && k.rotated_to.is_none());

    let other = RedisServer::start();
    other.cmd(&["SET", "kvgate:schema_version", "1"]);
    other.cmd(&["SET", "kvgate:audit", "not a stream"]);
    let s = RedisStore::connect(&other.url()).await.unwrap();
    let err = s.migrate().await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Schema(m) if m.contains("0002") && m.contains("kvgate:audit")),
        "{err:?}"
    );
    assert_eq!(s.schema_version().await.unwrap(), 1);
}

#[tokio::test]
async fn api_keys_are_never_stored_in_clear() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    let mut clear = Vec::new();
    for (i, tenant) in ["acme", "beta"].iter().enumerate() {
        s.put_tenant(&Tenant::new(*tenant)).await.unwrap();
        for j in 0..3 {
            let (key, rec) = new_key(tenant, (i * 10 + j) as u64);
            s.put_key(&rec).await.unwrap();
            clear.push((key, rec));
        }
    }
    let (_, first) = &clear[0];
    assert!(s.revoke_key("acme", &first.id).await.unwrap());
    let keys = server.keys();
    assert!(keys.len() > 6, "{keys:?}");
    for name in &keys {
        assert!(
            name.starts_with("kvgate:"),
            "{name} is outside the kvgate: keyspace"
        );
        let values = server.dump_values(name);
        for (key, rec) in &clear {
            // Not the key, nor the part after its displayed prefix.
            let secret = &key[rec.prefix.len()..];
            assert!(!name.contains(secret), "a key appears in key name {name}");
            assert!(
                !values.iter().any(|v| v.contains(secret)),
                "a key appears in the value of {name}"
            );
        }
    }
    // ...while its hash finds the record.
    for (key, rec) in &clear {
        let found = s.key_by_hash(&KeyHash::of(PEPPER, key)).await.unwrap();
        assert_eq!(found.map(|k| k.id), Some(rec.id.clone()));
    }
}

/// With Redis gone every call fails fast with `Unavailable` (a gateway must answer 503, not
/// hang); when it is back the same store works again.
#[tokio::test]
async fn redis_down_fails_fast_then_recovers() {
    let mut server = RedisServer::start();
    let s = migrated(&server).await;
    s.put_tenant(&Tenant::new("acme")).await.unwrap();
    server.stop();
    let l = limits(Some(10), Some(100), Some(3));
    for round in 0..3 {
        let calls: Vec<(&str, Result<(), StoreError>)> = vec![
            ("get_tenant", s.get_tenant("acme").await.map(drop)),
            ("admit", s.admit(adm("acme", l, "r")).await.map(drop)),
            ("release", s.release("acme", l, "r", 5).await),
            ("list_engines", s.list_engines().await.map(drop)),
        ];
        for (what, r) in calls {
            assert!(
                matches!(r, Err(StoreError::Unavailable(_))),
                "round {round}: {what} gave {r:?}"
            );
        }
    }
    // Every call is bounded by the store's own deadline; this one guards against a hang.
    let r = tokio::time::timeout(Duration::from_secs(3), s.schema_version()).await;
    assert!(matches!(r, Ok(Err(StoreError::Unavailable(_)))), "{r:?}");
    // Connecting to a Redis that is down fails fast too.
    let r = tokio::time::timeout(Duration::from_secs(3), RedisStore::connect(&server.url())).await;
    assert!(matches!(r, Ok(Err(StoreError::Unavailable(_)))), "{r:?}");

    server.restart();
    // The connection manager reconnects in the background; give it a few attempts.
    let mut result = Err(StoreError::Unavailable("never tried".into()));
    for _ in 0..50 {
        result = s.migrate().await;
        if result.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Nothing was persisted, so the fresh server needed migrating again.
    assert_eq!(result.unwrap(), (1..=SCHEMA_VERSION).collect::<Vec<_>>());
    s.put_tenant(&Tenant::new("acme")).await.unwrap();
    assert!(s.get_tenant("acme").await.unwrap().is_some());
    assert_eq!(s.admit(adm("acme", l, "r")).await.unwrap(), Ok(()));
}

/// A Redis that accepts connections but never answers (stopped with SIGSTOP, like a stuck host)
/// must not hang the gateway either.
#[tokio::test]
async fn a_stuck_redis_times_out() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    server.pause();
    let l = limits(Some(10), None, None);
    let r = tokio::time::timeout(Duration::from_secs(3), s.admit(adm("acme", l, "r"))).await;
    assert!(matches!(r, Ok(Err(StoreError::Unavailable(_)))), "{r:?}");
    let r = tokio::time::timeout(Duration::from_secs(3), s.get_tenant("acme")).await;
    assert!(matches!(r, Ok(Err(StoreError::Unavailable(_)))), "{r:?}");
    server.resume();
    let mut result = Err(StoreError::Unavailable("never tried".into()));
    for _ in 0..50 {
        result = s.admit(adm("acme", l, "r")).await;
        if result.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(result.unwrap(), Ok(()));
}

fn record(
    tenant: &str,
    key: &str,
    at_ms: u64,
    prompt: u64,
    cached: u64,
    completion: u64,
) -> UsageRecord {
    UsageRecord {
        id: usage::record_id(),
        request_id: "req".into(),
        tenant: tenant.into(),
        key_id: key.into(),
        key_lineage: None,
        model: "smollm2:135m".into(),
        engine: Some("e0".into()),
        prompt_tokens: prompt,
        cached_tokens: cached,
        completion_tokens: completion,
        cost_micros: prompt + completion,
        status: 200,
        ending: Ending::Completed,
        finish_reason: Some("stop".into()),
        ttft_ms: Some(3),
        duration_ms: 7,
        at_ms,
    }
}

/// The ledger, the audit log, operator tokens and last-used times: the same on both stores.
async fn ledger_audit_and_tokens(s: &dyn Store) {
    // 2025-12-01 and 2025-12-02, UTC.
    let (d1, d2) = (1_764_547_200_000, 1_764_633_600_000);
    let a = record("acme", "key_a", d1 + 5, 100, 40, 10);
    let b = record("acme", "key_b", d2 + 5, 50, 0, 5);
    let c = record("beta", "key_c", d2 + 9, 7, 0, 1);
    let batch = [a.clone(), b.clone(), c.clone()];
    s.record_usage("batch-1", &batch).await.unwrap();
    // A retry of a batch already written (an answer lost) counts nothing twice.
    s.record_usage("batch-1", &batch).await.unwrap();
    let all = s
        .usage_records(&RecordQuery {
            tenant: None,
            since_ms: 0,
            until_ms: u64::MAX / 2,
            limit: 100,
        })
        .await
        .unwrap();
    // Newest first.
    assert_eq!(all, vec![c.clone(), b.clone(), a.clone()]);
    let acme_d2 = s
        .usage_records(&RecordQuery {
            tenant: Some("acme".into()),
            since_ms: d2,
            until_ms: d2 + 86_399_999,
            limit: 100,
        })
        .await
        .unwrap();
    assert_eq!(acme_d2, vec![b.clone()]);
    let periods = [
        "2025-12-01".to_owned(),
        "2025-12-02".into(),
        "2025-12".into(),
        "2025-11".into(),
    ];
    let agg = s.usage_aggregates("acme", &periods).await.unwrap();
    assert_eq!(agg[0]["requests"], 1);
    assert_eq!(agg[0]["cached"], 40);
    assert_eq!(agg[0]["k:key_a:prompt"], 100);
    assert_eq!(agg[0]["m:smollm2:135m:completion"], 10);
    assert_eq!(agg[1]["prompt"], 50);
    assert_eq!(usage::spent(&agg[2], None).tokens, 165);
    assert_eq!(usage::spent(&agg[2], Some("key_b")).tokens, 55);
    assert_eq!(usage::spent(&agg[2], None).cost_micros, 165);
    assert!(agg[3].is_empty());
    let (tenant, key) = s.spent("acme", "2025-12", "key_b").await.unwrap();
    assert_eq!((tenant.tokens, key.tokens, key.cost_micros), (165, 55, 55));
    let (none, _) = s.spent("nobody", "2025-12", "key_b").await.unwrap();
    assert_eq!(none, usage::Spent::default());

    for (i, action) in ["tenant.create", "key.issue", "engine.drain"]
        .iter()
        .enumerate()
    {
        let e = AuditEntry {
            at_ms: 1000 + i as u64,
            actor: "ci".into(),
            role: Role::Admin,
            action: (*action).into(),
            target: "tenant:acme".into(),
            status: 201,
            error: None,
        };
        s.append_audit(&e).await.unwrap();
    }
    let q = |since_ms, limit| AuditQuery {
        since_ms,
        until_ms: u64::MAX / 2,
        limit,
    };
    let newest: Vec<String> = (s.audit(q(0, 2)).await.unwrap())
        .into_iter()
        .map(|e| e.action)
        .collect();
    assert_eq!(newest, ["engine.drain", "key.issue"]);
    assert_eq!(s.audit(q(1001, 10)).await.unwrap().len(), 2);

    let clear = "kvo_clear-token-for-the-test";
    let tok = OperatorToken {
        name: "ci".into(),
        role: Role::Operator,
        hash: KeyHash::of(PEPPER, clear),
        prefix: clear[..8].into(),
        created_at: 1,
        revoked: false,
    };
    assert!(s.create_operator_token(&tok).await.unwrap());
    // A name is taken once, whatever the token.
    let other = OperatorToken {
        hash: KeyHash::of(PEPPER, "kvo_another"),
        ..tok.clone()
    };
    assert!(!s.create_operator_token(&other).await.unwrap());
    assert_eq!(
        s.operator_token_by_hash(&tok.hash).await.unwrap(),
        Some(tok.clone())
    );
    assert!(s.revoke_operator_token("ci").await.unwrap());
    assert!(!s.revoke_operator_token("nobody").await.unwrap());
    let listed = s.list_operator_tokens().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].revoked);

    let mut t = Tenant::new("acme");
    t.requests_per_min = Some(5);
    s.put_tenant(&t).await.unwrap();
    let (_, k) = new_key("acme", 1);
    s.put_key(&k).await.unwrap();
    assert_eq!(s.list_keys("acme").await.unwrap()[0].last_used_at, None);
    s.touch_key(&k.id, 1234).await.unwrap();
    assert_eq!(
        s.list_keys("acme").await.unwrap()[0].last_used_at,
        Some(1234)
    );
}

#[tokio::test]
async fn ledger_audit_and_tokens_on_redis() {
    let server = RedisServer::start();
    let s = migrated(&server).await;
    ledger_audit_and_tokens(&s).await;
    // Nothing in clear: the operator token is stored as its hash.
    for k in server.keys() {
        for v in server.dump_values(&k) {
            assert!(!v.contains("clear-token"), "{k}: {v}");
        }
    }
}

#[tokio::test]
async fn ledger_audit_and_tokens_in_memory() {
    ledger_audit_and_tokens(&MemoryStore::new()).await;
}

/// Every connection the store opens, reconnections included, is driven by the runtime the store
/// was connected on. A gateway's API threads each run a runtime of their own; a reconnection
/// started by one of them used to be driven there, so when that thread stopped (a graceful
/// stop ends the API threads one by one) the connection broke for every caller, and the
/// rate-limit releases still on their way failed with a broken pipe.
#[test]
fn a_reconnection_outlives_the_runtime_that_started_it() {
    let mut server = RedisServer::start();
    let home = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = Arc::new(home.block_on(migrated(&server)));
    // Redis goes away and comes back: the next call made anywhere reconnects.
    server.stop();
    assert!(home.block_on(store.schema_version()).is_err());
    server.restart();
    // Another runtime, as an API thread's, makes that call, then ends.
    let s = store.clone();
    let reconnected = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            for _ in 0..50 {
                if s.schema_version().await.is_ok() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            false
        })
    })
    .join()
    .unwrap();
    assert!(reconnected, "never reconnected");
    // The connection it opened still works: the first call here succeeds.
    assert_eq!(home.block_on(store.schema_version()).unwrap(), 0);
}

//! The gateway's Redis store against a real `redis-server`: the same behaviour as the in-memory
//! store, limits shared by two replicas, migrations, no API key in clear, and failing fast (then
//! recovering) when Redis goes away.

use kvgate_gateway::store::{Admission, RedisStore, Refusal, Store, StoreError, SCHEMA_VERSION};
use kvgate_gateway::tenant::{
    generate_key, generate_key_id, EngineRecord, KeyHash, KeyRecord, RateLimits, Tenant,
};
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
        id: generate_key_id(),
        tenant: tenant.into(),
        hash: KeyHash::of(PEPPER, &clear),
        prefix: clear[..8].to_owned(),
        created_at,
        revoked: false,
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
    assert_eq!(s.admit(lease("b", 200)).await.unwrap(), Ok(()));
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
    tokio::time::sleep(Duration::from_millis(300)).await;
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
        lease_ms: 300,
        ..adm("acme", l, "a")
    };
    assert_eq!(s.admit(short).await.unwrap(), Ok(()));
    s.renew("acme", "a", 30_000).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
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

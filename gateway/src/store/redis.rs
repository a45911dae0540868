//! The Redis store, shared by every gateway replica.
//!
//! Keyspace (all under `kvgate:`; `migrations/README.md` is the reference):
//! - `kvgate:schema_version` (integer) and `kvgate:migrations` (hash: number -> unix seconds
//!   applied);
//! - `kvgate:tenant:{id}` (JSON [`Tenant`]) and the set `kvgate:tenants` of ids;
//! - `kvgate:key:{sha256 hex}` (JSON [`KeyRecord`], which holds the hash, never the key) and the
//!   set `kvgate:tenant_keys:{tenant}` of hashes;
//! - `kvgate:engine:{name}` (JSON [`EngineRecord`]) and the set `kvgate:engines` of names;
//! - `kvgate:rl:{tenant}:req` and `kvgate:rl:{tenant}:tok`: GCRA theoretical arrival times in
//!   unix microseconds (Redis server time), expiring when they fall into the past;
//!   `kvgate:rl:{tenant}:conc`: a sorted set of lease id -> expiry (unix milliseconds).
//!
//! Rate limits: `admit`, `renew` and `release` are one Lua script each, so the check and the charge are
//! atomic across replicas, and both read the clock with `redis.call('TIME')` so replicas with
//! skewed clocks agree. The arithmetic mirrors `memory.rs` exactly:
//! - requests/min: GCRA, emission interval `T = 60000/rpm` ms (rounded up to a whole
//!   microsecond), burst tolerance `tau = (rpm - 1) * T = 60000 - T` ms: admit when
//!   `TAT - now <= tau`, then `TAT = max(TAT, now) + T`. Exactly `rpm` requests pass at once,
//!   then one every `T`: `rpm` per minute sustained. (A 60 s window that starts with a full burst
//!   also sees that minute's refill, so it can hold up to `2 * rpm - 1`; capping every sliding
//!   minute at `rpm` as well would need a log of each request, not one number.) A refusal's
//!   `retry_after_ms` is when the next slot frees.
//! - tokens/min: a GCRA balance: admit while `TAT - now <= 60000` ms (at most one minute's worth
//!   in debt); a charge of `n` tokens sets `TAT = max(TAT, now) + n * 60000 / tpm` ms. The
//!   prompt is charged by `admit` itself, the completion by `release`. A refusal waits until the
//!   debt is back under a minute.
//! - concurrency: drop lapsed leases (`ZREMRANGEBYSCORE`), admit when `ZCARD < max`, then
//!   `ZADD lease now + lease_ms`; `renew` moves a live lease's expiry; a refusal asks for 1000 ms.
//!
//! Checks run in that order and a refusal charges nothing (dropping lapsed leases is not a
//! charge). A limit of `None` skips its check; `Some(0)` refuses everything. A limit of zero
//! retries after a minute.
//!
//! Every call has a deadline ([`CALL_TIMEOUT`]): with Redis down it fails fast with
//! [`StoreError::Unavailable`], and the connection manager reconnects in the background.
//! Every call runs in the context of the runtime the store was connected on (its home), so the
//! connection's driver task, and any reconnection a failed call starts, live there: a gateway's
//! API threads each run a runtime of their own, and a connection driven by one of them would
//! break for every caller when that thread stops.
//! Scripts that touch keys they do not declare (`delete_tenant`, migrations) assume one Redis
//! primary (with replicas), not Redis Cluster.

use super::memory::{sort_keys, MAX_CHARGED_TOKENS};
use super::{
    Admission, OnTenantChange, RecordQuery, Refusal, Store, StoreError, RECORDS_READ_MAX,
    SCHEMA_VERSION,
};
use crate::audit::{AuditEntry, AuditQuery, AUDIT_READ_MAX, AUDIT_RETENTION};
use crate::tenant::{EngineRecord, KeyHash, KeyRecord, OperatorToken, RateLimits, Tenant};
use crate::usage::{increments, Spent, UsageRecord, STREAM_RETENTION};
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, RedisError, Script};
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

/// The longest any one store call may take, reconnection included.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(1500);
/// Per connection attempt and per response, inside the connection manager.
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// The error code a migration script refuses with (`redis.error_reply('KVGATE_MIGRATION ...')`).
const MIGRATION_ERROR: &str = "KVGATE_MIGRATION";
const SCHEMA_KEY: &str = "kvgate:schema_version";
const MIGRATIONS_KEY: &str = "kvgate:migrations";
const TENANTS: &str = "kvgate:tenants";
const ENGINES: &str = "kvgate:engines";

/// The numbered migrations, in order (embedded from the repository's `migrations/`).
pub(crate) const MIGRATIONS: &[(u32, &str)] = &[
    (1, include_str!("../../../migrations/0001_init.lua")),
    (
        2,
        include_str!("../../../migrations/0002_usage_audit_tokens.lua"),
    ),
];

/// The ledger's stream: one entry per record, fields `id` (the record's id) and `r` (JSON).
pub const USAGE_STREAM: &str = "kvgate:usage:records";
/// Tenants with any usage recorded.
const USAGE_TENANTS: &str = "kvgate:usage:tenants";
/// The audit log's stream: one entry per action, field `e` (JSON).
const AUDIT_STREAM: &str = "kvgate:audit";
const OPERATOR_TOKENS: &str = "kvgate:optokens";
const KEY_LAST_USED: &str = "kvgate:key_last_used";
/// How long a recorded batch is remembered, against a retry counting twice (a day: the gateway
/// retries a batch until it is written, within seconds of the store coming back).
const RECORDED_TTL_SECS: u64 = 86_400;
/// How long aggregates are kept: days 400 days, months 800 days.
const DAY_TTL_SECS: u64 = 400 * 86_400;
const MONTH_TTL_SECS: u64 = 800 * 86_400;

fn tenant_key(id: &str) -> String {
    format!("kvgate:tenant:{id}")
}
fn key_key(hash_hex: &str) -> String {
    format!("kvgate:key:{hash_hex}")
}
fn tenant_keys_key(tenant: &str) -> String {
    format!("kvgate:tenant_keys:{tenant}")
}
fn engine_key(name: &str) -> String {
    format!("kvgate:engine:{name}")
}
fn rl_key(tenant: &str, what: &str) -> String {
    format!("kvgate:rl:{tenant}:{what}")
}
fn usage_key(tenant: &str, period: &str) -> String {
    // A day (YYYY-MM-DD) and a month (YYYY-MM) never name the same key.
    format!("kvgate:usage:{tenant}:{period}")
}
fn recorded_key(batch_id: &str) -> String {
    format!("kvgate:usage:batch:{batch_id}")
}
fn operator_token_key(hash_hex: &str) -> String {
    format!("kvgate:optoken:{hash_hex}")
}
fn operator_name_key(name: &str) -> String {
    format!("kvgate:optoken_name:{name}")
}

/// KEYS: stream, batch marker, usage tenants. ARGV: stream retention, marker ttl, the number of
/// records R, R (id, JSON) pairs, then per aggregate: its key, its ttl, its tenant, N, and N
/// (field, count) pairs. Returns 0 when the batch was recorded before, else 1. The marker is set
/// last and every count is below 2^53 (capped by the gateway), so a script that runs runs whole.
/// The aggregates' keys are undeclared: one Redis primary, as for the other scripts.
const RECORD_LUA: &str = r"
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'id', ARGV[i], 'r', ARGV[i + 1])
  i = i + 2
end
while i <= #ARGV do
  local key, ttl, tenant, n = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  i = i + 4
  for _ = 1, n do
    redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
    i = i + 2
  end
  redis.call('EXPIRE', key, ttl)
  redis.call('SADD', KEYS[3], tenant)
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
return 1
";

/// Shared by both rate-limit scripts: integer ceil division on Lua doubles (exact below 2^53),
/// and microseconds to milliseconds rounded up.
const LUA_HELPERS: &str = r"
local MINUTE = 60000000
local function ceil_div(a, b)
  local q = math.floor(a / b)
  while q * b < a do q = q + 1 end
  while q > 0 and (q - 1) * b >= a do q = q - 1 end
  return q
end
local function ms(us) return ceil_div(us, 1000) end
local function int(x) return string.format('%d', x) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now / 1000)
local function charge(key, tpm, tokens)
  if tpm <= 0 or tokens <= 0 then return end
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  tat = tat + ceil_div(tokens * MINUTE, tpm)
  redis.call('SET', key, int(tat), 'PX', int(ms(tat - now)))
end
";

/// KEYS: req, tok, conc. ARGV: rpm, tpm, max concurrent (-1: no limit), lease id, lease ms,
/// tokens charged on admission. Returns {0, 0} when admitted, else {1 requests | 2 tokens | 3 concurrency, retry after ms}.
const ADMIT_LUA: &str = r"
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local req_tat = nil
if rpm >= 0 then
  if rpm == 0 then return {1, 60000} end
  local T = ceil_div(MINUTE, rpm)
  local tau = (rpm - 1) * T
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tat < now then tat = now end
  if tat - now > tau then return {1, ms(tat - now - tau)} end
  req_tat = tat + T
end
if tpm >= 0 then
  if tpm == 0 then return {2, 60000} end
  local tat = tonumber(redis.call('GET', KEYS[2]) or '0')
  if tat - now > MINUTE then return {2, ms(tat - now - MINUTE)} end
end
if maxc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', int(now_ms))
  if redis.call('ZCARD', KEYS[3]) >= maxc then return {3, 1000} end
end
if req_tat then
  redis.call('SET', KEYS[1], int(req_tat), 'PX', int(ms(req_tat - now)))
end
if maxc >= 0 then
  redis.call('ZADD', KEYS[3], int(now_ms + tonumber(ARGV[5])), ARGV[4])
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[3], int(math.max(tonumber(last[2]) - now_ms, 0) + 1))
end
charge(KEYS[2], tpm, tonumber(ARGV[6]))
return {0, 0}
";

/// KEYS: conc. ARGV: lease id, lease ms. Moves a live lease's expiry to now + lease ms; a lease
/// that lapsed or was released is left gone.
const RENEW_LUA: &str = r"
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now_ms then return 0 end
local until_ms = now_ms + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], int(until_ms), ARGV[1])
if redis.call('PTTL', KEYS[1]) < until_ms - now_ms + 1 then
  redis.call('PEXPIRE', KEYS[1], int(until_ms - now_ms + 1))
end
return 1
";

/// KEYS: tok, conc. ARGV: tpm (-1: no limit), request id, tokens.
const RELEASE_LUA: &str = r"
redis.call('ZREM', KEYS[2], ARGV[2])
charge(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[3]))
return 1
";

/// KEYS: tenant record, tenants set, tenant_keys set, rl req, rl tok, rl conc. ARGV: tenant id.
/// Deletes the key records named in the tenant's set (undeclared keys: one primary only).
const DELETE_TENANT_LUA: &str = r"
for _, h in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  redis.call('DEL', 'kvgate:key:' .. h)
end
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return redis.call('DEL', KEYS[1])
";

/// A store in Redis; cheap to clone (one multiplexed connection, reconnecting on failure).
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    /// The runtime the store was connected on, which outlives its callers' (see the module
    /// documentation).
    home: tokio::runtime::Handle,
    /// For the pub/sub connection that follows tenant changes.
    client: redis::Client,
    /// Host and port only: a URL may carry a password.
    addr: String,
    admit: Script,
    renew: Script,
    release: Script,
    delete_tenant: Script,
    record: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn decode<T: DeserializeOwned>(key: &str, json: &str) -> Result<T, StoreError> {
    serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        reason: e.to_string(),
    })
}

fn encode<T: serde::Serialize>(value: &T) -> String {
    // Plain structs of strings and numbers: serialization cannot fail.
    serde_json::to_string(value).unwrap_or_default()
}

fn limit_arg<T: Into<i64>>(limit: Option<T>) -> i64 {
    limit.map_or(-1, Into::into)
}

impl RedisStore {
    /// Connects to `url` (`redis://[:password@]host:port[/db]`), failing within about a
    /// second when Redis is unreachable. The runtime this runs on becomes the store's home (see
    /// the module documentation): it must keep running while the store is used, as a
    /// multi-thread runtime does, or be the runtime every call is made on.
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Unavailable(format!("bad redis url: {e}")))?;
        let addr = client.get_connection_info().addr.to_string();
        // No reconnection retries inside the manager: its backoff starts at a second, which
        // would hold every call while Redis is down. Each failed call starts one reconnection
        // attempt in the background instead, so calls fail at once and the first one after
        // Redis is back finds a fresh connection.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(IO_TIMEOUT)
            .set_response_timeout(IO_TIMEOUT)
            .set_number_of_retries(0);
        let conn = deadline(async {
            ConnectionManager::new_with_config(client.clone(), config)
                .await
                .map_err(unavailable)
        })
        .await?;
        Ok(RedisStore {
            conn,
            home: tokio::runtime::Handle::current(),
            client,
            addr,
            admit: Script::new(&format!("{LUA_HELPERS}{ADMIT_LUA}")),
            renew: Script::new(&format!("{LUA_HELPERS}{RENEW_LUA}")),
            release: Script::new(&format!("{LUA_HELPERS}{RELEASE_LUA}")),
            delete_tenant: Script::new(DELETE_TENANT_LUA),
            record: Script::new(RECORD_LUA),
        })
    }

    /// Errors unless the keyspace is exactly at [`SCHEMA_VERSION`]: newer means this build is
    /// too old to use it, older (0: never migrated) means `kvgate migrate` has not run.
    pub async fn check_schema(&self) -> Result<(), StoreError> {
        let v = self.schema_version().await?;
        if v > SCHEMA_VERSION {
            return Err(StoreError::Schema(format!(
                "the Redis keyspace is at version {v}, newer than this build's {SCHEMA_VERSION}: upgrade kvgate"
            )));
        }
        if v < SCHEMA_VERSION {
            return Err(StoreError::Schema(format!(
                "the Redis keyspace is at version {v}, this build needs {SCHEMA_VERSION}: run `kvgate migrate --redis URL`"
            )));
        }
        Ok(())
    }

    /// Runs one command under the call deadline.
    async fn call<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        deadline(self.at_home(async { f(self.conn.clone()).await.map_err(unavailable) })).await
    }

    /// Polls `f` in the home runtime's context: whatever it spawns (a connection's driver, a
    /// reconnection) runs there, and its timers and sockets register there. (The call's deadline
    /// stays on the caller's runtime: it holds however busy the home is.)
    async fn at_home<T>(&self, f: impl Future<Output = T>) -> T {
        let mut f = std::pin::pin!(f);
        std::future::poll_fn(|cx| {
            let _home = self.home.enter();
            f.as_mut().poll(cx)
        })
        .await
    }

    async fn get_json<T: DeserializeOwned>(&self, key: String) -> Result<Option<T>, StoreError> {
        let k = key.clone();
        let raw: Option<String> = self.call(|mut c| async move { c.get(k).await }).await?;
        raw.map(|j| decode(&key, &j)).transpose()
    }

    /// The records named by a set's members, skipping members whose record is gone.
    async fn list_json<T: DeserializeOwned>(
        &self,
        set: &str,
        record_key: fn(&str) -> String,
    ) -> Result<Vec<T>, StoreError> {
        let set = set.to_owned();
        let members: Vec<String> = self
            .call(|mut c| async move { c.smembers(set).await })
            .await?;
        if members.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = members.iter().map(|m| record_key(m)).collect();
        let k = keys.clone();
        let raw: Vec<Option<String>> = self
            .call(|mut c| async move { redis::cmd("MGET").arg(k).query_async(&mut c).await })
            .await?;
        (keys.iter().zip(raw))
            .filter_map(|(key, json)| json.map(|j| decode(key, &j)))
            .collect()
    }
}

async fn deadline<T>(f: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
    tokio::time::timeout(CALL_TIMEOUT, f)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "no answer from redis within {} ms",
                CALL_TIMEOUT.as_millis()
            )))
        })
}

/// The pub/sub channel on which replicas announce tenant changes (payload: the tenant id).
const CHANGES_CHANNEL: &str = "kvgate:changes:tenants";

/// Follows [`CHANGES_CHANNEL`], reconnecting with backoff; every (re)subscription reports
/// `None` first, since changes may have been published while no one listened.
async fn follow_changes(client: redis::Client, addr: String, on_change: OnTenantChange) {
    use futures_util::StreamExt;
    let mut pause = Duration::from_millis(100);
    loop {
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(CHANGES_CHANNEL).await?;
            Ok::<_, RedisError>(pubsub)
        };
        match tokio::time::timeout(CALL_TIMEOUT, subscribed).await {
            Ok(Ok(pubsub)) => {
                pause = Duration::from_millis(100);
                if !on_change(None) {
                    return;
                }
                let mut messages = pubsub.into_on_message();
                while let Some(msg) = messages.next().await {
                    let tenant: String = msg.get_payload().unwrap_or_default();
                    if !on_change(Some(&tenant)) {
                        return;
                    }
                }
                tracing::warn!(%addr, "tenant-change subscription ended; reconnecting");
            }
            Ok(Err(e)) => tracing::warn!(%addr, error = %e, "cannot follow tenant changes"),
            Err(_) => tracing::warn!(%addr, "cannot follow tenant changes: no answer"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn publish_tenant_change(&self, tenant: &str) -> Result<(), StoreError> {
        let tenant = tenant.to_owned();
        self.call(|mut c| async move {
            redis::cmd("PUBLISH")
                .arg(CHANGES_CHANNEL)
                .arg(tenant)
                .query_async::<i64>(&mut c)
                .await
        })
        .await
        .map(drop)
    }

    fn follow_tenant_changes(
        &self,
        on_change: OnTenantChange,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (client, addr) = (self.client.clone(), self.addr.clone());
        Some(self.home.spawn(follow_changes(client, addr, on_change)))
    }

    async fn schema_version(&self) -> Result<u32, StoreError> {
        let v: Option<String> = self
            .call(|mut c| async move { c.get(SCHEMA_KEY).await })
            .await?;
        match v {
            None => Ok(0),
            Some(v) => v.parse().map_err(|_| StoreError::Corrupt {
                key: SCHEMA_KEY.into(),
                reason: format!("not a version number: {v:?}"),
            }),
        }
    }

    async fn migrate(&self) -> Result<Vec<u32>, StoreError> {
        let current = self.schema_version().await?;
        if current > SCHEMA_VERSION {
            return Err(StoreError::Schema(format!(
                "the Redis keyspace is at version {current}, newer than this build's {SCHEMA_VERSION}: refusing to migrate"
            )));
        }
        let mut applied = Vec::new();
        for &(n, lua) in MIGRATIONS.iter().filter(|(n, _)| *n > current) {
            let script = Script::new(lua);
            // Each script re-checks the version itself, so concurrent migrators apply it once.
            let mut c = self.conn.clone();
            let done: i64 = deadline(self.at_home(async {
                let mut inv = script.prepare_invoke();
                inv.key(SCHEMA_KEY).key(MIGRATIONS_KEY).arg(n);
                inv.invoke_async(&mut c).await.map_err(|e| {
                    if e.code() == Some(MIGRATION_ERROR) {
                        StoreError::Schema(format!(
                            "migration {n:04}: {}",
                            e.detail().unwrap_or("")
                        ))
                    } else {
                        unavailable(e)
                    }
                })
            }))
            .await?;
            if done == 1 {
                applied.push(n);
            }
        }
        Ok(applied)
    }

    async fn put_tenant(&self, tenant: &Tenant) -> Result<(), StoreError> {
        let (key, id, json) = (tenant_key(&tenant.id), tenant.id.clone(), encode(tenant));
        self.call(|mut c| async move {
            redis::pipe()
                .atomic()
                .set(key, json)
                .sadd(TENANTS, id)
                .exec_async(&mut c)
                .await
        })
        .await
    }

    async fn get_tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        self.get_json(tenant_key(id)).await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let mut all: Vec<Tenant> = self.list_json(TENANTS, tenant_key).await?;
        all.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(all)
    }

    async fn delete_tenant(&self, id: &str) -> Result<bool, StoreError> {
        let script = self.delete_tenant.clone();
        let id = id.to_owned();
        let deleted: i64 = self
            .call(|mut c| async move {
                script
                    .key(tenant_key(&id))
                    .key(TENANTS)
                    .key(tenant_keys_key(&id))
                    .key(rl_key(&id, "req"))
                    .key(rl_key(&id, "tok"))
                    .key(rl_key(&id, "conc"))
                    .arg(&id)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(deleted > 0)
    }

    async fn put_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        let hex = key.hash.hex();
        let (k, set, json) = (key_key(&hex), tenant_keys_key(&key.tenant), encode(key));
        self.call(|mut c| async move {
            redis::pipe()
                .atomic()
                .set(k, json)
                .sadd(set, hex)
                .exec_async(&mut c)
                .await
        })
        .await
    }

    async fn key_by_hash(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, StoreError> {
        self.get_json(key_key(&hash.hex())).await
    }

    async fn list_keys(&self, tenant: &str) -> Result<Vec<KeyRecord>, StoreError> {
        let mut keys: Vec<KeyRecord> = self.list_json(&tenant_keys_key(tenant), key_key).await?;
        keys.retain(|k| k.tenant == tenant);
        sort_keys(&mut keys);
        if !keys.is_empty() {
            let ids: Vec<String> = keys.iter().map(|k| k.id.clone()).collect();
            let used: Vec<Option<u64>> = self
                .call(|mut c| async move {
                    redis::cmd("HMGET")
                        .arg(KEY_LAST_USED)
                        .arg(ids)
                        .query_async(&mut c)
                        .await
                })
                .await?;
            for (k, at) in keys.iter_mut().zip(used) {
                k.last_used_at = at;
            }
        }
        Ok(keys)
    }

    async fn revoke_key(&self, tenant: &str, key_id: &str) -> Result<bool, StoreError> {
        let Some(mut key) = (self.list_keys(tenant).await?.into_iter()).find(|k| k.id == key_id)
        else {
            return Ok(false);
        };
        key.revoked = true;
        let (k, json) = (key_key(&key.hash.hex()), encode(&key));
        // XX: a tenant deleted meanwhile must not get a revoked key back.
        self.call(|mut c| async move {
            redis::cmd("SET")
                .arg(k)
                .arg(json)
                .arg("XX")
                .exec_async(&mut c)
                .await
        })
        .await?;
        Ok(true)
    }

    async fn put_engine(&self, engine: &EngineRecord) -> Result<(), StoreError> {
        let (key, name, json) = (
            engine_key(&engine.name),
            engine.name.clone(),
            encode(engine),
        );
        self.call(|mut c| async move {
            redis::pipe()
                .atomic()
                .set(key, json)
                .sadd(ENGINES, name)
                .exec_async(&mut c)
                .await
        })
        .await
    }

    async fn list_engines(&self) -> Result<Vec<EngineRecord>, StoreError> {
        let mut all: Vec<EngineRecord> = self.list_json(ENGINES, engine_key).await?;
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    async fn remove_engine(&self, name: &str) -> Result<bool, StoreError> {
        let (key, name) = (engine_key(name), name.to_owned());
        let (deleted, _): (i64, i64) = self
            .call(|mut c| async move {
                redis::pipe()
                    .atomic()
                    .del(key)
                    .srem(ENGINES, name)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(deleted > 0)
    }

    async fn admit(&self, req: Admission<'_>) -> Result<Result<(), Refusal>, StoreError> {
        let script = self.admit.clone();
        let t = req.tenant;
        let keys = [rl_key(t, "req"), rl_key(t, "tok"), rl_key(t, "conc")];
        let l = req.limits;
        let args = (
            limit_arg(l.requests_per_min),
            limit_arg(
                l.tokens_per_min
                    .map(|v| i64::try_from(v).unwrap_or(i64::MAX)),
            ),
            limit_arg(l.max_concurrent),
            req.lease.to_owned(),
            req.lease_ms,
            req.tokens.min(MAX_CHARGED_TOKENS),
        );
        let (code, retry_after_ms): (u32, u64) = self
            .call(|mut c| async move {
                let mut inv = script.prepare_invoke();
                inv.key(&keys[..]).arg(args.0).arg(args.1).arg(args.2);
                inv.arg(args.3).arg(args.4).arg(args.5);
                inv.invoke_async(&mut c).await
            })
            .await?;
        Ok(match code {
            0 => Ok(()),
            1 => Err(Refusal::Requests { retry_after_ms }),
            2 => Err(Refusal::Tokens { retry_after_ms }),
            _ => Err(Refusal::Concurrency { retry_after_ms }),
        })
    }

    async fn record_usage(
        &self,
        batch_id: &str,
        records: &[UsageRecord],
    ) -> Result<(), StoreError> {
        if records.is_empty() {
            return Ok(());
        }
        let script = self.record.clone();
        let keys = [
            USAGE_STREAM.to_owned(),
            recorded_key(batch_id),
            USAGE_TENANTS.to_owned(),
        ];
        let mut args: Vec<String> = vec![
            STREAM_RETENTION.to_string(),
            RECORDED_TTL_SECS.to_string(),
            records.len().to_string(),
        ];
        for r in records {
            args.extend([r.id.clone(), encode(r)]);
        }
        for inc in increments(records) {
            let ttl = if inc.is_day() {
                DAY_TTL_SECS
            } else {
                MONTH_TTL_SECS
            };
            args.extend([
                usage_key(&inc.tenant, &inc.period),
                ttl.to_string(),
                inc.tenant,
                inc.fields.len().to_string(),
            ]);
            for (f, v) in inc.fields {
                args.extend([f, v.to_string()]);
            }
        }
        self.call(|mut c| async move {
            let mut inv = script.prepare_invoke();
            inv.key(&keys[..]).arg(args);
            inv.invoke_async::<i64>(&mut c).await
        })
        .await
        .map(drop)
    }

    async fn usage_records(&self, q: &RecordQuery) -> Result<Vec<UsageRecord>, StoreError> {
        let limit = q.limit.min(RECORDS_READ_MAX);
        let mut out = Vec::new();
        // Newest first. An entry's id is when it was added: at or after its record ended (later
        // when the gateway buffered it through an outage), so no entry older than `since` holds
        // a record in range.
        let mut end = "+".to_owned();
        let start = format!("{}-0", q.since_ms);
        // A tenant's records among others': at most this many pages are read per call.
        for _ in 0..64 {
            let e = end.clone();
            let s = start.clone();
            let page: Vec<(String, Vec<String>)> = self
                .call(|mut c| async move {
                    redis::cmd("XREVRANGE")
                        .arg(USAGE_STREAM)
                        .arg(e)
                        .arg(s)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut c)
                        .await
                })
                .await?;
            let Some((last, _)) = page.last() else { break };
            end = format!("({last}");
            let n = page.len();
            for (_, fields) in page {
                let Some(json) = fields
                    .chunks(2)
                    .find(|f| f[0] == "r")
                    .and_then(|f| f.get(1))
                else {
                    continue;
                };
                let r: UsageRecord = decode(USAGE_STREAM, json)?;
                let in_range = (q.since_ms..=q.until_ms).contains(&r.at_ms);
                if in_range && q.tenant.as_ref().is_none_or(|t| *t == r.tenant) {
                    out.push(r);
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
            }
            if n < 1000 {
                break;
            }
        }
        Ok(out)
    }

    async fn usage_aggregates(
        &self,
        tenant: &str,
        periods: &[String],
    ) -> Result<Vec<HashMap<String, u64>>, StoreError> {
        let keys: Vec<String> = periods.iter().map(|p| usage_key(tenant, p)).collect();
        self.call(|mut c| async move {
            let mut pipe = redis::pipe();
            for k in &keys {
                pipe.hgetall(k);
            }
            pipe.query_async(&mut c).await
        })
        .await
    }

    async fn spent(
        &self,
        tenant: &str,
        month: &str,
        key_id: &str,
    ) -> Result<(Spent, Spent), StoreError> {
        let key = usage_key(tenant, month);
        let fields = [
            "tokens".to_owned(),
            "cost".to_owned(),
            format!("k:{key_id}:tokens"),
            format!("k:{key_id}:cost"),
        ];
        let v: Vec<Option<u64>> = self
            .call(|mut c| async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg(&fields[..])
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let get = |i: usize| v.get(i).copied().flatten().unwrap_or(0);
        Ok((
            Spent {
                tokens: get(0),
                cost_micros: get(1),
            },
            Spent {
                tokens: get(2),
                cost_micros: get(3),
            },
        ))
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let json = encode(entry);
        self.call(|mut c| async move {
            redis::cmd("XADD")
                .arg(AUDIT_STREAM)
                .arg("MAXLEN")
                .arg("~")
                .arg(AUDIT_RETENTION)
                .arg("*")
                .arg("e")
                .arg(json)
                .query_async::<String>(&mut c)
                .await
        })
        .await
        .map(drop)
    }

    async fn audit(&self, q: AuditQuery) -> Result<Vec<AuditEntry>, StoreError> {
        let limit = q.limit.min(AUDIT_READ_MAX);
        let end = q
            .until_ms
            .saturating_add(60_000)
            .min(u64::MAX / 2)
            .to_string();
        let start = q.since_ms.to_string();
        let page: Vec<(String, Vec<String>)> = self
            .call(|mut c| async move {
                redis::cmd("XREVRANGE")
                    .arg(AUDIT_STREAM)
                    .arg(end)
                    .arg(start)
                    .arg("COUNT")
                    .arg(limit)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        // An entry's id is when it was appended, just after its `at_ms`: the id range bounds
        // the read, its time filters it.
        let entries: Vec<AuditEntry> = page
            .iter()
            .filter_map(|(_, f)| f.chunks(2).find(|f| f[0] == "e").and_then(|f| f.get(1)))
            .map(|json| decode(AUDIT_STREAM, json))
            .collect::<Result<_, _>>()?;
        Ok(entries
            .into_iter()
            .filter(|e| (q.since_ms..=q.until_ms).contains(&e.at_ms))
            .collect())
    }

    async fn create_operator_token(&self, token: &OperatorToken) -> Result<bool, StoreError> {
        let hex = token.hash.hex();
        let (k, json) = (operator_token_key(&hex), encode(token));
        let name = operator_name_key(&token.name);
        let h = hex.clone();
        // The name first, atomically: of two tokens issued at once under one name, one wins.
        let taken: Option<String> = self
            .call(|mut c| async move {
                redis::cmd("SET")
                    .arg(name)
                    .arg(h)
                    .arg("NX")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        if taken.is_none() {
            return Ok(false);
        }
        self.call(|mut c| async move {
            redis::pipe()
                .atomic()
                .set(k, json)
                .sadd(OPERATOR_TOKENS, hex)
                .exec_async(&mut c)
                .await
        })
        .await?;
        Ok(true)
    }

    async fn operator_token_by_hash(
        &self,
        hash: &KeyHash,
    ) -> Result<Option<OperatorToken>, StoreError> {
        self.get_json(operator_token_key(&hash.hex())).await
    }

    async fn list_operator_tokens(&self) -> Result<Vec<OperatorToken>, StoreError> {
        let mut all: Vec<OperatorToken> =
            self.list_json(OPERATOR_TOKENS, operator_token_key).await?;
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    async fn revoke_operator_token(&self, name: &str) -> Result<bool, StoreError> {
        let mut found = false;
        for mut t in self.list_operator_tokens().await? {
            if t.name != name {
                continue;
            }
            found = true;
            t.revoked = true;
            let (k, json) = (operator_token_key(&t.hash.hex()), encode(&t));
            self.call(|mut c| async move { c.set::<_, _, ()>(k, json).await })
                .await?;
        }
        Ok(found)
    }

    async fn touch_key(&self, key_id: &str, at: u64) -> Result<(), StoreError> {
        let id = key_id.to_owned();
        self.call(|mut c| async move { c.hset::<_, _, _, i64>(KEY_LAST_USED, id, at).await })
            .await
            .map(drop)
    }

    async fn renew(&self, tenant: &str, lease: &str, lease_ms: u64) -> Result<(), StoreError> {
        let script = self.renew.clone();
        let key = rl_key(tenant, "conc");
        let lease = lease.to_owned();
        self.call(|mut c| async move {
            let mut inv = script.prepare_invoke();
            inv.key(&key).arg(&lease).arg(lease_ms);
            inv.invoke_async::<i64>(&mut c).await
        })
        .await
        .map(drop)
    }

    async fn release(
        &self,
        tenant: &str,
        limits: RateLimits,
        lease: &str,
        tokens: u64,
    ) -> Result<(), StoreError> {
        let script = self.release.clone();
        let keys = [rl_key(tenant, "tok"), rl_key(tenant, "conc")];
        let tpm = limit_arg(
            limits
                .tokens_per_min
                .map(|v| i64::try_from(v).unwrap_or(i64::MAX)),
        );
        let id = lease.to_owned();
        let tokens = tokens.min(MAX_CHARGED_TOKENS);
        self.call(|mut c| async move {
            let mut inv = script.prepare_invoke();
            inv.key(&keys[..]).arg(tpm).arg(id).arg(tokens);
            inv.invoke_async::<i64>(&mut c).await
        })
        .await
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_migrations_are_numbered_in_order_up_to_the_schema() {
        let numbers: Vec<u32> = MIGRATIONS.iter().map(|m| m.0).collect();
        let expected: Vec<u32> = (1..=SCHEMA_VERSION).collect();
        assert_eq!(numbers, expected);
        for (n, lua) in MIGRATIONS {
            assert!(lua.contains(&format!("kvgate migration {n:04}")), "{n}");
            assert!(
                !lua.contains("error_reply('kvgate"),
                "{n}: errors use {MIGRATION_ERROR}"
            );
        }
    }
}

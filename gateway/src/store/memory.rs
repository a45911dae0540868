//! The in-process store for a single gateway (`kvgate serve`): plain maps behind one
//! `std::sync::Mutex`, never held across an `.await`.
//!
//! The rate limiter here is the reference for the Lua scripts in `redis.rs`: the same integer
//! arithmetic on the same units (microseconds for the GCRA arrival times, milliseconds for
//! concurrency leases), checks in the same order (requests, tokens, concurrency), and the same
//! `retry_after_ms` values, so the shared test suite passes unchanged on both. All operations
//! are O(1) except listings (O(n log n), sorted) and concurrency admission (O(leases of the
//! tenant), to drop the lapsed ones).
//!
//! A `MemoryStore` is created by this build, so its keyspace is always current: it reports
//! [`SCHEMA_VERSION`] and `migrate` has nothing to apply.

use super::{Admission, RecordQuery, Refusal, Store, StoreError, RECORDS_READ_MAX, SCHEMA_VERSION};
use crate::audit::{AuditEntry, AuditQuery, AUDIT_READ_MAX, AUDIT_RETENTION};
use crate::tenant::{EngineRecord, KeyHash, KeyRecord, OperatorToken, RateLimits, Tenant};
use crate::usage::{increments, spent, Spent, UsageRecord};
use async_trait::async_trait;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// One minute in microseconds: the GCRA window.
pub(super) const MINUTE_US: u64 = 60_000_000;
/// What a concurrency refusal asks the client to wait.
pub(super) const CONCURRENCY_RETRY_MS: u64 = 1000;
/// What a zero limit (nothing allowed) asks the client to wait.
pub(super) const ZERO_LIMIT_RETRY_MS: u64 = 60_000;
/// Usage charged by one `release` is capped here, so `tokens * 60e6` stays exact in the Lua
/// scripts' doubles (below 2^53).
pub(super) const MAX_CHARGED_TOKENS: u64 = 100_000_000;

#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    tenants: BTreeMap<String, Tenant>,
    keys: HashMap<[u8; 32], KeyRecord>,
    engines: BTreeMap<String, EngineRecord>,
    limits: HashMap<String, Buckets>,
    /// The ledger's newest records, at most [`MEMORY_RECORDS`].
    records: VecDeque<UsageRecord>,
    /// The newest batch ids recorded, at most [`MEMORY_BATCHES`].
    batches: HashSet<String>,
    batch_order: VecDeque<String>,
    /// (tenant, day or month) -> field -> count.
    aggregates: HashMap<(String, String), HashMap<String, u64>>,
    audit: VecDeque<AuditEntry>,
    operator_tokens: HashMap<[u8; 32], OperatorToken>,
    last_used: HashMap<String, u64>,
}

/// Ledger records the in-process store keeps (the aggregates keep everything).
pub const MEMORY_RECORDS: usize = 100_000;
/// Batch ids the in-process store remembers, against a batch counted twice.
const MEMORY_BATCHES: usize = 4096;

/// One tenant's rate-limit state.
#[derive(Debug, Default)]
struct Buckets {
    /// GCRA theoretical arrival time of the next request, unix microseconds.
    req_tat_us: u64,
    /// Tokens balance as a theoretical arrival time, unix microseconds.
    tok_tat_us: u64,
    /// In-flight lease id -> expiry, unix milliseconds.
    leases: HashMap<String, u64>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves plain maps behind, still consistent
        // enough to serve: recover rather than fail every later request.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// [`Store::admit`] at a given time (unix microseconds), for tests.
    pub(crate) fn admit_at(&self, req: Admission<'_>, now_us: u64) -> Result<(), Refusal> {
        let mut inner = self.lock();
        let b = inner.limits.entry(req.tenant.to_owned()).or_default();
        let next_req_tat = match req.limits.requests_per_min {
            Some(rpm) => Some(check_requests(b.req_tat_us, now_us, rpm)?),
            None => None,
        };
        if let Some(tpm) = req.limits.tokens_per_min {
            check_tokens(b.tok_tat_us, now_us, tpm)?;
        }
        let now_ms = now_us / 1000;
        if let Some(max) = req.limits.max_concurrent {
            b.leases.retain(|_, expiry| *expiry > now_ms);
            if b.leases.len() >= max as usize {
                return Err(Refusal::Concurrency {
                    retry_after_ms: CONCURRENCY_RETRY_MS,
                });
            }
        }
        if let Some(tat) = next_req_tat {
            b.req_tat_us = tat;
        }
        if req.limits.max_concurrent.is_some() {
            b.leases.insert(req.lease.to_owned(), now_ms + req.lease_ms);
        }
        if let Some(tpm) = req.limits.tokens_per_min {
            charge(&mut b.tok_tat_us, now_us, req.tokens, tpm);
        }
        Ok(())
    }

    /// [`Store::renew`] at a given time (unix microseconds), for tests.
    pub(crate) fn renew_at(&self, tenant: &str, lease: &str, lease_ms: u64, now_us: u64) {
        let mut inner = self.lock();
        if let Some(expiry) = inner
            .limits
            .get_mut(tenant)
            .and_then(|b| b.leases.get_mut(lease))
        {
            let now_ms = now_us / 1000;
            if *expiry > now_ms {
                *expiry = now_ms + lease_ms;
            }
        }
    }

    /// [`Store::release`] at a given time (unix microseconds), for tests.
    pub(crate) fn release_at(
        &self,
        tenant: &str,
        limits: RateLimits,
        lease: &str,
        tokens: u64,
        now_us: u64,
    ) {
        let mut inner = self.lock();
        let b = inner.limits.entry(tenant.to_owned()).or_default();
        b.leases.remove(lease);
        if let Some(tpm) = limits.tokens_per_min {
            charge(&mut b.tok_tat_us, now_us, tokens, tpm);
        }
    }
}

/// Adds `tokens` to a tokens/min balance (its theoretical arrival time).
fn charge(tat_us: &mut u64, now_us: u64, tokens: u64, tpm: u64) {
    if tpm > 0 && tokens > 0 {
        *tat_us = (*tat_us).max(now_us) + token_cost_us(tokens, tpm);
    }
}

/// Unix time in microseconds from the system clock (Redis uses its own `TIME`).
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Microseconds to whole milliseconds, rounded up (a retry never comes too early).
pub(super) fn ceil_ms(us: u64) -> u64 {
    us.div_ceil(1000)
}

/// GCRA emission interval for `rpm` requests per minute, rounded up to a whole microsecond so
/// that `rpm` intervals never sum to less than a minute.
pub(super) fn emission_us(rpm: u32) -> u64 {
    MINUTE_US.div_ceil(u64::from(rpm))
}

/// The time `tokens` take off a `tpm` balance, rounded up.
pub(super) fn token_cost_us(tokens: u64, tpm: u64) -> u64 {
    let tokens = tokens.min(MAX_CHARGED_TOKENS);
    (u128::from(tokens) * u128::from(MINUTE_US)).div_ceil(u128::from(tpm)) as u64
}

/// requests/min: admits when `tat - now <= tau` with `tau = (rpm - 1) * T` (= 60 s - T), so a
/// burst of exactly `rpm` passes; returns the new arrival time.
pub(super) fn check_requests(tat_us: u64, now_us: u64, rpm: u32) -> Result<u64, Refusal> {
    if rpm == 0 {
        return Err(Refusal::Requests {
            retry_after_ms: ZERO_LIMIT_RETRY_MS,
        });
    }
    let t = emission_us(rpm);
    let tau = u64::from(rpm - 1) * t;
    let tat = tat_us.max(now_us);
    if tat - now_us > tau {
        return Err(Refusal::Requests {
            retry_after_ms: ceil_ms(tat - now_us - tau),
        });
    }
    Ok(tat + t)
}

/// tokens/min: admits while the balance is at most one minute in debt.
pub(super) fn check_tokens(tat_us: u64, now_us: u64, tpm: u64) -> Result<(), Refusal> {
    if tpm == 0 {
        return Err(Refusal::Tokens {
            retry_after_ms: ZERO_LIMIT_RETRY_MS,
        });
    }
    let debt = tat_us.saturating_sub(now_us);
    if debt > MINUTE_US {
        return Err(Refusal::Tokens {
            retry_after_ms: ceil_ms(debt - MINUTE_US),
        });
    }
    Ok(())
}

#[async_trait]
impl Store for MemoryStore {
    async fn schema_version(&self) -> Result<u32, StoreError> {
        Ok(SCHEMA_VERSION)
    }

    async fn migrate(&self) -> Result<Vec<u32>, StoreError> {
        Ok(Vec::new())
    }

    async fn put_tenant(&self, tenant: &Tenant) -> Result<(), StoreError> {
        self.lock()
            .tenants
            .insert(tenant.id.clone(), tenant.clone());
        Ok(())
    }

    async fn get_tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        Ok(self.lock().tenants.get(id).cloned())
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        Ok(self.lock().tenants.values().cloned().collect())
    }

    async fn delete_tenant(&self, id: &str) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        inner.keys.retain(|_, k| k.tenant != id);
        inner.limits.remove(id);
        let own_bucket = format!("{id}:key:");
        inner
            .limits
            .retain(|bucket, _| !bucket.starts_with(&own_bucket));
        Ok(inner.tenants.remove(id).is_some())
    }

    async fn put_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        self.lock().keys.insert(key.hash.0, key.clone());
        Ok(())
    }

    async fn key_by_hash(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.lock().keys.get(&hash.0).cloned())
    }

    async fn list_keys(&self, tenant: &str) -> Result<Vec<KeyRecord>, StoreError> {
        let inner = self.lock();
        let mut keys: Vec<KeyRecord> = (inner.keys.values())
            .filter(|k| k.tenant == tenant)
            .map(|k| KeyRecord {
                last_used_at: inner.last_used.get(&k.id).copied(),
                ..k.clone()
            })
            .collect();
        sort_keys(&mut keys);
        Ok(keys)
    }

    async fn revoke_key(&self, tenant: &str, key_id: &str) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        let found = (inner.keys.values_mut()).find(|k| k.tenant == tenant && k.id == key_id);
        Ok(found.map(|k| k.revoked = true).is_some())
    }

    async fn put_engine(&self, engine: &EngineRecord) -> Result<(), StoreError> {
        self.lock()
            .engines
            .insert(engine.name.clone(), engine.clone());
        Ok(())
    }

    async fn list_engines(&self) -> Result<Vec<EngineRecord>, StoreError> {
        Ok(self.lock().engines.values().cloned().collect())
    }

    async fn remove_engine(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.lock().engines.remove(name).is_some())
    }

    async fn admit(&self, req: Admission<'_>) -> Result<Result<(), Refusal>, StoreError> {
        Ok(self.admit_at(req, now_us()))
    }

    async fn record_usage(
        &self,
        batch_id: &str,
        records: &[UsageRecord],
    ) -> Result<(), StoreError> {
        // The trait's contract: a batch sent again (here only by a caller's mistake: in process
        // no answer is lost) counts once. The newest batch ids are remembered.
        let mut inner = self.lock();
        if inner.batches.contains(batch_id) {
            return Ok(());
        }
        inner.batches.insert(batch_id.to_owned());
        inner.batch_order.push_back(batch_id.to_owned());
        if inner.batch_order.len() > MEMORY_BATCHES {
            if let Some(old) = inner.batch_order.pop_front() {
                inner.batches.remove(&old);
            }
        }
        for inc in increments(records) {
            let agg = inner
                .aggregates
                .entry((inc.tenant, inc.period))
                .or_default();
            for (f, v) in inc.fields {
                let n = agg.entry(f).or_insert(0);
                *n = n.saturating_add(v);
            }
        }
        inner.records.extend(records.iter().cloned());
        let over = inner.records.len().saturating_sub(MEMORY_RECORDS);
        inner.records.drain(..over);
        Ok(())
    }

    async fn usage_records(&self, q: &RecordQuery) -> Result<Vec<UsageRecord>, StoreError> {
        let inner = self.lock();
        Ok((inner.records.iter().rev())
            .filter(|r| (q.since_ms..=q.until_ms).contains(&r.at_ms))
            .filter(|r| q.tenant.as_ref().is_none_or(|t| *t == r.tenant))
            .take(q.limit.min(RECORDS_READ_MAX))
            .cloned()
            .collect())
    }

    async fn usage_aggregates(
        &self,
        tenant: &str,
        periods: &[String],
    ) -> Result<Vec<HashMap<String, u64>>, StoreError> {
        let inner = self.lock();
        Ok(periods
            .iter()
            .map(|p| {
                (inner.aggregates)
                    .get(&(tenant.to_owned(), p.clone()))
                    .cloned()
                    .unwrap_or_default()
            })
            .collect())
    }

    async fn spent(
        &self,
        tenant: &str,
        month: &str,
        key_id: &str,
    ) -> Result<(Spent, Spent), StoreError> {
        let inner = self.lock();
        let empty = HashMap::new();
        let agg = (inner.aggregates)
            .get(&(tenant.to_owned(), month.to_owned()))
            .unwrap_or(&empty);
        Ok((spent(agg, None), spent(agg, Some(key_id))))
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let mut inner = self.lock();
        inner.audit.push_back(entry.clone());
        if inner.audit.len() as u64 > AUDIT_RETENTION {
            inner.audit.pop_front();
        }
        Ok(())
    }

    async fn audit(&self, q: AuditQuery) -> Result<Vec<AuditEntry>, StoreError> {
        let inner = self.lock();
        Ok((inner.audit.iter().rev())
            .filter(|e| (q.since_ms..=q.until_ms).contains(&e.at_ms))
            .take(q.limit.min(AUDIT_READ_MAX))
            .cloned()
            .collect())
    }

    async fn create_operator_token(&self, token: &OperatorToken) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        if inner.operator_tokens.values().any(|t| t.name == token.name) {
            return Ok(false);
        }
        inner.operator_tokens.insert(token.hash.0, token.clone());
        Ok(true)
    }

    async fn operator_token_by_hash(
        &self,
        hash: &KeyHash,
    ) -> Result<Option<OperatorToken>, StoreError> {
        Ok(self.lock().operator_tokens.get(&hash.0).cloned())
    }

    async fn list_operator_tokens(&self) -> Result<Vec<OperatorToken>, StoreError> {
        let mut all: Vec<OperatorToken> = self.lock().operator_tokens.values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    async fn revoke_operator_token(&self, name: &str) -> Result<bool, StoreError> {
        let mut inner = self.lock();
        let mut found = false;
        for t in inner
            .operator_tokens
            .values_mut()
            .filter(|t| t.name == name)
        {
            t.revoked = true;
            found = true;
        }
        Ok(found)
    }

    async fn touch_key(&self, key_id: &str, at: u64) -> Result<(), StoreError> {
        self.lock().last_used.insert(key_id.to_owned(), at);
        Ok(())
    }

    async fn renew(&self, tenant: &str, lease: &str, lease_ms: u64) -> Result<(), StoreError> {
        self.renew_at(tenant, lease, lease_ms, now_us());
        Ok(())
    }

    async fn release(
        &self,
        tenant: &str,
        limits: RateLimits,
        lease: &str,
        tokens: u64,
    ) -> Result<(), StoreError> {
        self.release_at(tenant, limits, lease, tokens, now_us());
        Ok(())
    }
}

/// Listing order shared by both stores: oldest first, then by id.
pub(super) fn sort_keys(keys: &mut [KeyRecord]) {
    keys.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::generate_key;

    const T0: u64 = 1_700_000_000_000_000;

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

    fn key(tenant: &str, created_at: u64) -> KeyRecord {
        KeyRecord {
            created_at,
            ..KeyRecord::new(tenant, KeyHash::of(b"pepper", &generate_key()), "kvg_AbCd")
        }
    }

    #[tokio::test]
    async fn store_tenant_crud() {
        let s = MemoryStore::new();
        assert_eq!(s.schema_version().await.unwrap(), SCHEMA_VERSION);
        assert!(s.migrate().await.unwrap().is_empty());
        assert_eq!(s.get_tenant("acme").await.unwrap(), None);
        let mut t = Tenant::new("acme");
        t.requests_per_min = Some(10);
        s.put_tenant(&t).await.unwrap();
        s.put_tenant(&Tenant::new("beta")).await.unwrap();
        assert_eq!(s.get_tenant("acme").await.unwrap(), Some(t.clone()));
        t.priority = 3;
        s.put_tenant(&t).await.unwrap();
        let ids: Vec<_> = (s.list_tenants().await.unwrap().into_iter())
            .map(|t| (t.id, t.priority))
            .collect();
        assert_eq!(ids, [("acme".to_owned(), 3), ("beta".to_owned(), 1)]);
        assert!(s.delete_tenant("beta").await.unwrap());
        assert!(!s.delete_tenant("beta").await.unwrap());
        assert_eq!(s.list_tenants().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn store_keys_revoke_and_cascade() {
        let s = MemoryStore::new();
        s.put_tenant(&Tenant::new("acme")).await.unwrap();
        s.put_tenant(&Tenant::new("beta")).await.unwrap();
        let (a1, a2, b1) = (key("acme", 2), key("acme", 1), key("beta", 1));
        for k in [&a1, &a2, &b1] {
            s.put_key(k).await.unwrap();
        }
        assert_eq!(s.key_by_hash(&a1.hash).await.unwrap(), Some(a1.clone()));
        assert_eq!(s.list_keys("acme").await.unwrap(), [a2.clone(), a1.clone()]);
        // Revoking needs the owning tenant.
        assert!(!s.revoke_key("beta", &a1.id).await.unwrap());
        assert!(s.revoke_key("acme", &a1.id).await.unwrap());
        assert!(!s.revoke_key("acme", "key_000000000000").await.unwrap());
        assert!(s.key_by_hash(&a1.hash).await.unwrap().unwrap().revoked);
        assert!(s.delete_tenant("acme").await.unwrap());
        assert_eq!(s.key_by_hash(&a1.hash).await.unwrap(), None);
        assert_eq!(s.key_by_hash(&a2.hash).await.unwrap(), None);
        assert!(s.list_keys("acme").await.unwrap().is_empty());
        assert_eq!(s.list_keys("beta").await.unwrap(), [b1]);
    }

    #[tokio::test]
    async fn store_engines() {
        let s = MemoryStore::new();
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

    #[test]
    fn store_requests_burst_then_steady_rate() {
        let s = MemoryStore::new();
        let l = limits(Some(6), None, None); // T = 10 s
        for i in 0..6 {
            assert_eq!(s.admit_at(adm("acme", l, &i.to_string()), T0), Ok(()));
        }
        assert_eq!(
            s.admit_at(adm("acme", l, "x"), T0),
            Err(Refusal::Requests {
                retry_after_ms: 10_000
            })
        );
        // A refusal charged nothing: the slot frees exactly when promised.
        assert_eq!(
            s.admit_at(adm("acme", l, "x"), T0 + 9_999_000),
            Err(Refusal::Requests { retry_after_ms: 1 })
        );
        assert_eq!(s.admit_at(adm("acme", l, "x"), T0 + 10_000_000), Ok(()));
        assert!(s.admit_at(adm("acme", l, "y"), T0 + 10_000_000).is_err());
        // Other tenants are independent.
        assert_eq!(s.admit_at(adm("beta", l, "x"), T0), Ok(()));
    }

    #[test]
    fn store_requests_gcra_bounds() {
        // 7 does not divide a minute: T rounds up (8571429 us), so the rate never exceeds rpm.
        let (s, l, t_us) = (MemoryStore::new(), limits(Some(7), None, None), 8_571_429);
        let mut admitted = Vec::new();
        let mut t = T0;
        while t < T0 + 5 * MINUTE_US {
            // A greedy client: as many as it can get at every instant.
            while s.admit_at(adm("acme", l, "r"), t).is_ok() {
                admitted.push(t);
            }
            t += 250_000;
        }
        // A burst of exactly rpm, then one per T with no drift: 7 + floor(300 s / T) = 7 + 34.
        assert_eq!(admitted.iter().filter(|&&a| a == T0).count(), 7);
        assert_eq!(admitted.len(), 7 + 34);
        assert!(admitted[7] >= T0 + t_us && admitted[7] < T0 + t_us + 250_000);
        // GCRA's window bound: a burst plus a minute of refill, 2 * rpm - 1 in any 60 s.
        let most = (0..admitted.len())
            .map(|i| {
                (admitted[i..].iter())
                    .take_while(|&&b| b < admitted[i] + MINUTE_US)
                    .count()
            })
            .max();
        assert_eq!(most, Some(2 * 7 - 1));
    }

    #[test]
    fn store_zero_limits_refuse() {
        let s = MemoryStore::new();
        let r = s.admit_at(adm("a", limits(Some(0), None, None), "r"), T0);
        assert_eq!(
            r,
            Err(Refusal::Requests {
                retry_after_ms: 60_000
            })
        );
        let r = s.admit_at(adm("a", limits(None, Some(0), None), "r"), T0);
        assert_eq!(
            r,
            Err(Refusal::Tokens {
                retry_after_ms: 60_000
            })
        );
        let r = s.admit_at(adm("a", limits(None, None, Some(0)), "r"), T0);
        assert_eq!(
            r,
            Err(Refusal::Concurrency {
                retry_after_ms: 1000
            })
        );
    }

    #[test]
    fn store_tokens_debt() {
        let s = MemoryStore::new();
        let l = limits(None, Some(1000), None);
        assert_eq!(s.admit_at(adm("acme", l, "1"), T0), Ok(()));
        // 1500 tokens at 1000/min: 90 s of balance, 30 s beyond the allowed minute of debt.
        s.release_at("acme", l, "1", 1500, T0);
        assert_eq!(
            s.admit_at(adm("acme", l, "2"), T0),
            Err(Refusal::Tokens {
                retry_after_ms: 30_000
            })
        );
        assert!(s.admit_at(adm("acme", l, "2"), T0 + 29_999_000).is_err());
        assert_eq!(s.admit_at(adm("acme", l, "2"), T0 + 30_000_000), Ok(()));
        // Exactly one minute in debt still admits; any more does not.
        let l2 = limits(None, Some(60), None);
        s.release_at("beta", l2, "1", 60, T0);
        assert_eq!(s.admit_at(adm("beta", l2, "2"), T0), Ok(()));
        s.release_at("beta", l2, "2", 1, T0);
        assert_eq!(
            s.admit_at(adm("beta", l2, "3"), T0),
            Err(Refusal::Tokens {
                retry_after_ms: 1000
            })
        );
        // The balance accrues from now, not from a stale past.
        s.release_at("gamma", l, "1", 500, T0);
        s.release_at("gamma", l, "2", 1500, T0 + 10 * MINUTE_US);
        assert!(s
            .admit_at(adm("gamma", l, "3"), T0 + 10 * MINUTE_US)
            .is_err());
    }

    #[test]
    fn store_concurrency_release_and_lease_expiry() {
        let s = MemoryStore::new();
        let l = limits(None, None, Some(2));
        let lease = |id, lease_ms| Admission {
            tenant: "acme",
            limits: l,
            lease: id,
            lease_ms,
            tokens: 0,
        };
        assert_eq!(s.admit_at(lease("a", 30_000), T0), Ok(()));
        assert_eq!(s.admit_at(lease("b", 5_000), T0), Ok(()));
        assert_eq!(
            s.admit_at(lease("c", 30_000), T0),
            Err(Refusal::Concurrency {
                retry_after_ms: 1000
            })
        );
        s.release_at("acme", l, "a", 0, T0 + 1000);
        assert_eq!(s.admit_at(lease("c", 30_000), T0 + 1000), Ok(()));
        assert!(s.admit_at(lease("d", 30_000), T0 + 1000).is_err());
        // "b" was never released: its lease lapses at T0 + 5 s.
        assert!(s.admit_at(lease("d", 30_000), T0 + 4_999_000).is_err());
        assert_eq!(s.admit_at(lease("d", 30_000), T0 + 5_000_000), Ok(()));
        // Releasing an unknown id is harmless.
        s.release_at("acme", l, "nope", 0, T0 + 5_000_000);
        s.release_at("nobody", l, "nope", 0, T0);
    }

    #[test]
    fn store_prompt_charge_and_lease_renewal() {
        let s = MemoryStore::new();
        let l = limits(None, Some(1000), Some(1));
        let first = Admission {
            tokens: 1500,
            lease_ms: 300,
            ..adm("acme", l, "a")
        };
        assert_eq!(s.admit_at(first, T0), Ok(()));
        s.renew_at("acme", "a", 30_000, T0 + 200_000);
        s.release_at("acme", l, "a", 0, T0 + 1_000_000);
        // Released (the renewal kept it past 300 ms), but the 1500 prompt tokens stay charged.
        assert!(matches!(
            s.admit_at(adm("acme", l, "b"), T0 + 1_000_000),
            Err(Refusal::Tokens { .. })
        ));
        // A lapsed lease is not renewed back.
        let l2 = limits(None, None, Some(1));
        let short = Admission {
            lease_ms: 100,
            ..adm("beta", l2, "x")
        };
        assert_eq!(s.admit_at(short, T0), Ok(()));
        s.renew_at("beta", "x", 30_000, T0 + 200_000);
        assert_eq!(s.admit_at(adm("beta", l2, "y"), T0 + 200_000), Ok(()));
    }

    #[test]
    fn store_refusal_charges_nothing_across_limits() {
        let s = MemoryStore::new();
        let l = limits(Some(2), None, Some(1));
        assert_eq!(s.admit_at(adm("acme", l, "a"), T0), Ok(()));
        // Refused on concurrency: the requests budget must not be spent.
        assert!(matches!(
            s.admit_at(adm("acme", l, "b"), T0),
            Err(Refusal::Concurrency { .. })
        ));
        s.release_at("acme", l, "a", 0, T0);
        assert_eq!(s.admit_at(adm("acme", l, "b"), T0), Ok(()));
        s.release_at("acme", l, "b", 0, T0);
        assert!(matches!(
            s.admit_at(adm("acme", l, "c"), T0),
            Err(Refusal::Requests { .. })
        ));
    }

    #[tokio::test]
    async fn store_admit_uses_the_clock() {
        let s = MemoryStore::new();
        let l = limits(Some(1), Some(100), Some(1));
        assert_eq!(s.admit(adm("acme", l, "a")).await.unwrap(), Ok(()));
        let r = s.admit(adm("acme", l, "b")).await.unwrap().unwrap_err();
        assert!(matches!(r, Refusal::Requests { .. }));
        assert!(r.retry_after_ms() > 59_000 && r.retry_after_ms() <= 60_000);
        s.release("acme", l, "a", 10).await.unwrap();
        assert!(s
            .admit(adm("x", RateLimits::default(), "a"))
            .await
            .unwrap()
            .is_ok());
    }
}

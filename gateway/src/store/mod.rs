//! Where the gateway keeps its shared state: tenants, API key hashes, the engine registry and the
//! rate-limit counters. [`RedisStore`] is shared by every gateway replica; [`MemoryStore`] serves
//! one process (`kvgate serve`). Both implement the same semantics, and the same tests run on both.
//!
//! Rate limits (one atomic step per request, so N replicas enforce the configured limit, not N
//! times it):
//! - requests/min: GCRA, one request per 60/rpm s on average with a burst of up to `rpm` at once
//!   (so a minute that starts with a full burst may admit up to 2·rpm - 1; over any longer span
//!   the rate never exceeds rpm per minute);
//! - tokens/min: a GCRA balance; a request is admitted while the balance is not in debt, its
//!   prompt tokens are charged in the same step, and the tokens it generated are charged when it
//!   ends, however it ends (so leaving a stream early does not escape the charge);
//! - concurrency: a set of in-flight leases with expiry. A lease id is made by the gateway, never
//!   taken from the client (one client id sent N times must still hold N slots); a live request
//!   renews its lease, and a crashed gateway's leases lapse instead of leaking slots.

mod memory;
mod redis;

pub use self::memory::MemoryStore;
pub use self::redis::{RedisStore, USAGE_STREAM};

use crate::audit::{AuditEntry, AuditQuery};
use crate::tenant::{EngineRecord, KeyHash, KeyRecord, OperatorToken, RateLimits, Tenant};
use crate::usage::{Spent, UsageRecord};
use async_trait::async_trait;
use std::collections::HashMap;

/// The newest keyspace version this build understands (see `migrations/`).
pub const SCHEMA_VERSION: u32 = 2;

/// Which ledger records to read: oldest first, ended within `[since_ms, until_ms]`, of one
/// tenant or all, at most `limit`.
#[derive(Debug, Clone)]
pub struct RecordQuery {
    pub tenant: Option<String>,
    pub since_ms: u64,
    pub until_ms: u64,
    pub limit: usize,
}

/// Most ledger records one read returns.
pub const RECORDS_READ_MAX: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backing store cannot be reached (Redis down, timeout).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A stored value could not be decoded.
    #[error("corrupt record {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// The keyspace is newer than this build, or not migrated.
    #[error("schema: {0}")]
    Schema(String),
}

/// Why a request was not admitted, and when to try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Requests { retry_after_ms: u64 },
    Tokens { retry_after_ms: u64 },
    Concurrency { retry_after_ms: u64 },
}

impl Refusal {
    pub fn retry_after_ms(self) -> u64 {
        match self {
            Refusal::Requests { retry_after_ms }
            | Refusal::Tokens { retry_after_ms }
            | Refusal::Concurrency { retry_after_ms } => retry_after_ms,
        }
    }

    pub fn what(self) -> &'static str {
        match self {
            Refusal::Requests { .. } => "requests per minute",
            Refusal::Tokens { .. } => "tokens per minute",
            Refusal::Concurrency { .. } => "concurrent requests",
        }
    }
}

/// One admission attempt.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    pub tenant: &'a str,
    pub limits: RateLimits,
    /// The request's lease id, made by the gateway and unique per request; renewed with
    /// [`Store::renew`] and released with [`Store::release`].
    pub lease: &'a str,
    /// How long the concurrency slot is held unless renewed or released.
    pub lease_ms: u64,
    /// Tokens charged to tokens/min when admitted (the prompt's, known before it runs).
    pub tokens: u64,
}

/// What a gateway does with a tenant change heard from another replica; returns false to stop
/// following.
pub type OnTenantChange = std::sync::Arc<dyn Fn(Option<&str>) -> bool + Send + Sync>;

#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// The applied keyspace version (0 when nothing was ever applied).
    async fn schema_version(&self) -> Result<u32, StoreError>;
    /// Applies every migration newer than the current version, in order; returns the versions
    /// applied (empty when already current).
    async fn migrate(&self) -> Result<Vec<u32>, StoreError>;

    async fn put_tenant(&self, tenant: &Tenant) -> Result<(), StoreError>;
    async fn get_tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError>;
    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError>;
    /// Deletes the tenant and every key it holds; `false` if it did not exist.
    async fn delete_tenant(&self, id: &str) -> Result<bool, StoreError>;

    async fn put_key(&self, key: &KeyRecord) -> Result<(), StoreError>;
    /// The key whose hash is `hash`, revoked or not.
    async fn key_by_hash(&self, hash: &KeyHash) -> Result<Option<KeyRecord>, StoreError>;
    async fn list_keys(&self, tenant: &str) -> Result<Vec<KeyRecord>, StoreError>;
    /// Marks the key revoked; `false` if the tenant has no such key.
    async fn revoke_key(&self, tenant: &str, key_id: &str) -> Result<bool, StoreError>;

    async fn put_engine(&self, engine: &EngineRecord) -> Result<(), StoreError>;
    async fn list_engines(&self) -> Result<Vec<EngineRecord>, StoreError>;
    async fn remove_engine(&self, name: &str) -> Result<bool, StoreError>;

    /// Admits one request against all three limits atomically, or refuses it without charging
    /// anything.
    async fn admit(&self, req: Admission<'_>) -> Result<Result<(), Refusal>, StoreError>;
    /// Tells every gateway replica that a tenant changed (its record, limits, scope or keys), so
    /// they drop what they cached of it. A single-process store has no one to tell.
    async fn publish_tenant_change(&self, _tenant: &str) -> Result<(), StoreError> {
        Ok(())
    }

    /// Follows the changes other replicas publish, calling `on_change(Some(tenant))` for each
    /// and `on_change(None)` when some may have been missed (after a reconnection), until
    /// `on_change` returns false. `None` when the store has no other replicas to hear from.
    fn follow_tenant_changes(
        &self,
        _on_change: OnTenantChange,
    ) -> Option<tokio::task::JoinHandle<()>> {
        None
    }

    /// Appends a batch of records to the ledger and adds each to its tenant's daily and monthly
    /// aggregates, in one atomic step. A batch whose id was recorded before (a retry after an
    /// answer was lost: the gateway retries the same batch) is skipped, so retries never count
    /// twice.
    async fn record_usage(&self, batch_id: &str, records: &[UsageRecord])
        -> Result<(), StoreError>;
    /// Ledger records, oldest first (see [`RecordQuery`]).
    async fn usage_records(&self, q: &RecordQuery) -> Result<Vec<UsageRecord>, StoreError>;
    /// A tenant's aggregates for each named period (a day `YYYY-MM-DD` or a month `YYYY-MM`), in
    /// order: field -> count (`usage.rs` names the fields); empty for a period with nothing.
    async fn usage_aggregates(
        &self,
        tenant: &str,
        periods: &[String],
    ) -> Result<Vec<HashMap<String, u64>>, StoreError>;

    /// What a tenant, and one of its keys, spent in a month (`YYYY-MM`): the monthly
    /// aggregate's four fields budgets read, without the rest of it.
    async fn spent(
        &self,
        tenant: &str,
        month: &str,
        key_id: &str,
    ) -> Result<(Spent, Spent), StoreError>;

    /// Appends an entry to the audit log.
    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError>;
    /// Audit entries, newest first.
    async fn audit(&self, q: AuditQuery) -> Result<Vec<AuditEntry>, StoreError>;

    /// Stores a new operator token unless its name is taken (then `false`): a name is never
    /// reused, revoked or not.
    async fn create_operator_token(&self, token: &OperatorToken) -> Result<bool, StoreError>;
    /// The operator token whose hash is `hash`, revoked or not.
    async fn operator_token_by_hash(
        &self,
        hash: &KeyHash,
    ) -> Result<Option<OperatorToken>, StoreError>;
    async fn list_operator_tokens(&self) -> Result<Vec<OperatorToken>, StoreError>;
    /// Marks the named token revoked; `false` if there is none.
    async fn revoke_operator_token(&self, name: &str) -> Result<bool, StoreError>;

    /// Notes that a key was used at `at` (unix seconds); listings report it as `last_used_at`.
    async fn touch_key(&self, key_id: &str, at: u64) -> Result<(), StoreError>;

    /// Extends a live request's concurrency lease to `lease_ms` from now (nothing when the lease
    /// is gone: a lapsed lease is not brought back).
    async fn renew(&self, tenant: &str, lease: &str, lease_ms: u64) -> Result<(), StoreError>;
    /// Ends a request: frees its concurrency slot and charges `tokens` (those not charged at
    /// admission: the completion's) to the tenant's tokens/min balance.
    async fn release(
        &self,
        tenant: &str,
        limits: RateLimits,
        lease: &str,
        tokens: u64,
    ) -> Result<(), StoreError>;
}

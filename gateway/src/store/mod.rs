//! Where the gateway keeps its shared state: tenants, API key hashes, the engine registry and the
//! rate-limit counters. [`RedisStore`] is shared by every gateway replica; [`MemoryStore`] serves
//! one process (`kvgate serve`). Both implement the same semantics, and the same tests run on both.
//!
//! Rate limits (one atomic step per request, so N replicas enforce the configured limit, not N
//! times it):
//! - requests/min: GCRA, one request per 60/rpm s on average with a burst of up to `rpm` at once
//!   (so a minute that starts with a full burst may admit up to 2·rpm - 1; over any longer span
//!   the rate never exceeds rpm per minute);
//! - tokens/min: a GCRA balance charged after the fact with the final usage; a request is admitted
//!   while the balance is not in debt;
//! - concurrency: a set of in-flight request ids with lease expiry (a crashed gateway's leases
//!   lapse instead of leaking slots).

mod memory;
mod redis;

pub use self::memory::MemoryStore;
pub use self::redis::RedisStore;

use crate::tenant::{EngineRecord, KeyHash, KeyRecord, RateLimits, Tenant};
use async_trait::async_trait;

/// The newest keyspace version this build understands (see `migrations/`).
pub const SCHEMA_VERSION: u32 = 1;

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
    /// Unique per request; released with [`Store::release`].
    pub request_id: &'a str,
    /// How long the concurrency slot is held if never released (the request timeout).
    pub lease_ms: u64,
}

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
    /// Ends a request: frees its concurrency slot and charges `tokens` (prompt + completion) to
    /// the tenant's tokens/min balance.
    async fn release(
        &self,
        tenant: &str,
        limits: RateLimits,
        request_id: &str,
        tokens: u64,
    ) -> Result<(), StoreError>;
}

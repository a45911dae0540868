//! API keys -> tenants. A key is hashed with the pepper (SHA-256), looked up in the store by that
//! hash, and the stored hash is compared with the computed one in constant time. Verified keys
//! are cached in process for a short TTL, so the store sees one lookup per key per TTL, and a
//! key that was verified keeps working for its TTL when the store is down; a key that is not
//! cached then fails with 503 rather than hanging or being let in. A change to a tenant or its
//! keys through any replica reaches every replica's cache at once (the store's change feed, see
//! `Gateway::start`); the TTL bounds it when that feed is down.

use crate::store::{Store, StoreError};
use crate::tenant::{KeyHash, Tenant};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Principal {
    pub tenant: Arc<Tenant>,
    pub key_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("missing API key")]
    Missing,
    #[error("invalid API key")]
    Invalid,
    #[error("the key store is unavailable")]
    Unavailable,
}

/// How long an unknown key's refusal is cached (bounds store lookups from a client retrying a
/// bad key, without delaying a newly issued key by much).
const NEGATIVE_TTL: Duration = Duration::from_secs(1);
/// Most cached keys; past it the cache starts over.
const MAX_CACHED: usize = 100_000;

#[derive(Debug, Clone)]
struct Cached {
    at: Instant,
    principal: Option<Arc<Principal>>,
}

#[derive(Debug)]
pub struct Auth {
    store: Arc<dyn Store>,
    pepper: Vec<u8>,
    ttl: Duration,
    cache: Mutex<HashMap<KeyHash, Cached>>,
}

impl Auth {
    pub fn new(store: Arc<dyn Store>, pepper: &str, ttl: Duration) -> Self {
        Auth {
            store,
            pepper: pepper.as_bytes().to_vec(),
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn hash(&self, key: &str) -> KeyHash {
        KeyHash::of(&self.pepper, key)
    }

    /// The tenant behind `key`.
    pub async fn authenticate(&self, key: Option<&str>) -> Result<Arc<Principal>, AuthError> {
        let key = key.filter(|k| !k.is_empty()).ok_or(AuthError::Missing)?;
        if !key.starts_with("kvg_") || key.len() > 128 {
            return Err(AuthError::Invalid);
        }
        let hash = self.hash(key);
        let now = Instant::now();
        if let Some(c) = self.lock().get(&hash).cloned() {
            let ttl = if c.principal.is_some() {
                self.ttl
            } else {
                NEGATIVE_TTL
            };
            if now.duration_since(c.at) < ttl {
                return c.principal.ok_or(AuthError::Invalid);
            }
        }
        let principal = match self.lookup(&hash).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "key lookup failed");
                return Err(AuthError::Unavailable);
            }
        };
        let mut cache = self.lock();
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(
            hash,
            Cached {
                at: now,
                principal: principal.clone(),
            },
        );
        principal.ok_or(AuthError::Invalid)
    }

    async fn lookup(&self, hash: &KeyHash) -> Result<Option<Arc<Principal>>, StoreError> {
        let Some(rec) = self.store.key_by_hash(hash).await? else {
            return Ok(None);
        };
        if !rec.hash.ct_eq(hash) || rec.revoked {
            return Ok(None);
        }
        let Some(tenant) = self.store.get_tenant(&rec.tenant).await? else {
            return Ok(None);
        };
        Ok(Some(Arc::new(Principal {
            tenant: Arc::new(tenant),
            key_id: rec.id,
        })))
    }

    /// Drops cached entries of one tenant (after it changed, lost a key, or was deleted).
    pub fn invalidate_tenant(&self, tenant: &str) {
        self.lock()
            .retain(|_, c| c.principal.as_ref().is_none_or(|p| p.tenant.id != tenant));
    }

    /// Drops every cached entry (changes may have been missed).
    pub fn invalidate_all(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<KeyHash, Cached>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

//! API keys -> tenants. A key is hashed with the pepper (SHA-256), looked up in the store by that
//! hash, and the stored hash is compared with the computed one in constant time. Verified keys
//! are cached in process for a short TTL, so the store sees one lookup per key per TTL, and a
//! key that was verified keeps working for its TTL when the store is down; a key that is not
//! cached then fails with 503 rather than hanging or being let in. A change to a tenant or its
//! keys through any replica reaches every replica's cache at once (the store's change feed, see
//! `Gateway::start`); the TTL bounds it when that feed is down.

use crate::store::{Store, StoreError};
use crate::tenant::{unix_now, KeyHash, KeyRecord, OperatorToken, Role, Tenant};
use kvgate_protocol::openai::ApiError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Principal {
    pub tenant: Arc<Tenant>,
    pub key_id: String,
    /// The key's record: its own limits, budget and expiry.
    pub key: Arc<KeyRecord>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("missing API key")]
    Missing,
    #[error("invalid API key")]
    Invalid,
    /// A key past its expiry (unix seconds): a rotated key after its grace time, or a key
    /// issued with an expiry.
    #[error("expired API key")]
    Expired(u64),
    #[error("the key store is unavailable")]
    Unavailable,
}

/// How often a key's last-used time is written to the store, at most.
const TOUCH_EVERY: Duration = Duration::from_secs(60);

/// How long an unknown key's refusal is cached (bounds store lookups from a client retrying a
/// bad key, without delaying a newly issued key by much).
const NEGATIVE_TTL: Duration = Duration::from_secs(1);
/// Most cached keys; past it the cache starts over.
const MAX_CACHED: usize = 100_000;

#[derive(Debug, Clone)]
struct Cached {
    at: Instant,
    principal: Option<Arc<Principal>>,
    /// When this process last wrote the key's last-used time.
    touched: Option<Instant>,
}

#[derive(Debug)]
pub struct Auth {
    store: Arc<dyn Store>,
    pepper: Vec<u8>,
    ttl: Duration,
    cache: Mutex<HashMap<KeyHash, Cached>>,
    /// The runtime that records keys' last use: the one `new` ran on (the gateway's own, which
    /// outlives the API threads), if any.
    background: Option<tokio::runtime::Handle>,
}

impl Auth {
    pub fn new(store: Arc<dyn Store>, pepper: &str, ttl: Duration) -> Self {
        Auth {
            store,
            pepper: pepper.as_bytes().to_vec(),
            ttl,
            cache: Mutex::new(HashMap::new()),
            background: tokio::runtime::Handle::try_current().ok(),
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
        let cached = self.lock().get(&hash).cloned();
        let fresh = cached.as_ref().filter(|c| {
            let ttl = if c.principal.is_some() {
                self.ttl
            } else {
                NEGATIVE_TTL
            };
            now.duration_since(c.at) < ttl
        });
        let principal = match fresh {
            Some(c) => c.principal.clone(),
            None => {
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
                        touched: cached.and_then(|c| c.touched),
                    },
                );
                principal
            }
        };
        let principal = principal.ok_or(AuthError::Invalid)?;
        // Checked on every use, cached or not: a key stops at its expiry, not a TTL later.
        if let Some(at) = principal.key.expires_at.filter(|at| *at <= unix_now()) {
            return Err(AuthError::Expired(at));
        }
        self.touch(&hash, &principal, now);
        Ok(principal)
    }

    /// Writes the key's last-used time, at most once a [`TOUCH_EVERY`] per process, in the
    /// background (a failed write is only logged: it is bookkeeping).
    fn touch(&self, hash: &KeyHash, principal: &Principal, now: Instant) {
        {
            let mut cache = self.lock();
            let Some(c) = cache.get_mut(hash) else { return };
            if c.touched
                .is_some_and(|t| now.duration_since(t) < TOUCH_EVERY)
            {
                return;
            }
            c.touched = Some(now);
        }
        let (store, id) = (self.store.clone(), principal.key_id.clone());
        if let Some(rt) = &self.background {
            rt.spawn(async move {
                if let Err(e) = store.touch_key(&id, unix_now()).await {
                    tracing::debug!(error = %e, "could not record a key's last use");
                }
            });
        }
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
            key_id: rec.id.clone(),
            key: Arc::new(rec),
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

/// The change-feed message that tells every replica to forget the operator tokens it cached
/// (not a tenant id: those have no `@`).
pub const OPERATOR_TOKENS_CHANGED: &str = "@operator-tokens";
/// How long a verified operator token is trusted without asking the store again (a revocation
/// reaches every replica at once through the change feed; this bounds it when that is down).
const OPERATOR_TTL: Duration = Duration::from_secs(5);
/// Most cached operator tokens; past it the cache starts over.
const OPERATOR_CACHE_MAX: usize = 10_000;
/// Who is calling the admin API.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

/// The admin API's authentication: the bootstrap token and the named tokens.
#[derive(Debug)]
pub struct Operators {
    store: Arc<dyn Store>,
    pepper: Vec<u8>,
    bootstrap: Option<String>,
    cache: Mutex<HashMap<KeyHash, (Instant, Option<OperatorToken>)>>,
    /// Per token name: the current minute's start and the refusals audited in it.
    refusals: Mutex<HashMap<String, (Instant, u32)>>,
}

impl Operators {
    pub fn new(store: Arc<dyn Store>, pepper: &str, bootstrap: Option<String>) -> Operators {
        Operators {
            store,
            pepper: pepper.as_bytes().to_vec(),
            bootstrap,
            cache: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a refusal of `name` goes to the audit log: the first
    /// [`crate::audit::REFUSALS_PER_MINUTE`] each minute do.
    pub fn audit_refusal(&self, name: &str) -> bool {
        let now = Instant::now();
        let mut m = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > OPERATOR_CACHE_MAX {
            m.clear();
        }
        let (start, n) = m.entry(name.to_owned()).or_insert((now, 0));
        if now.duration_since(*start) >= Duration::from_secs(60) {
            *start = now;
            *n = 0;
        }
        *n += 1;
        *n <= crate::audit::REFUSALS_PER_MINUTE
    }

    pub fn hash(&self, token: &str) -> KeyHash {
        KeyHash::of(&self.pepper, token)
    }

    /// The caller behind a bearer token: 401 when it is missing, unknown or revoked, 403 when
    /// the admin API is off (no bootstrap token), 503 when the store cannot say.
    pub async fn authenticate(&self, bearer: Option<&str>) -> Result<Caller, ApiError> {
        let Some(bootstrap) = &self.bootstrap else {
            return Err(ApiError::forbidden(
                "The admin API is disabled: no operator token is configured.",
            ));
        };
        let wrong = || ApiError::unauthorized("Missing or wrong operator token.");
        let token = bearer.filter(|t| !t.is_empty()).ok_or_else(wrong)?;
        if kvgate_http::constant_time_eq(token.as_bytes(), bootstrap.as_bytes()) {
            return Ok(Caller {
                name: "bootstrap".into(),
                role: Role::Admin,
            });
        }
        if !token.starts_with("kvo_") || token.len() > 128 {
            return Err(wrong());
        }
        let hash = self.hash(token);
        let now = Instant::now();
        let cached = self.lock().get(&hash).cloned();
        let record = match cached {
            Some((at, rec)) if now.duration_since(at) < OPERATOR_TTL => rec,
            _ => {
                let rec = self
                    .store
                    .operator_token_by_hash(&hash)
                    .await
                    .map_err(|e| {
                        tracing::warn!(error = %e, "operator token lookup failed");
                        ApiError::unavailable("The token store is unavailable; try again shortly.")
                    })?;
                let rec = rec.filter(|r| r.hash.ct_eq(&hash) && !r.revoked);
                let mut cache = self.lock();
                if cache.len() >= OPERATOR_CACHE_MAX {
                    cache.clear();
                }
                cache.insert(hash, (now, rec.clone()));
                rec
            }
        };
        let rec = record.ok_or_else(wrong)?;
        Ok(Caller {
            name: rec.name,
            role: rec.role,
        })
    }

    /// Forgets every cached token (one was revoked here or on another replica).
    pub fn invalidate(&self) {
        self.lock().clear();
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<KeyHash, (Instant, Option<OperatorToken>)>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

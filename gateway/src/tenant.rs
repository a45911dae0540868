//! Tenants, API keys and engine records: what the store keeps.

use crate::usage::{Budget, Prices};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// One customer of the service. Every limit is optional; `None` means unlimited.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tenant {
    /// Stable id (`[a-z0-9_-]{1,64}`), used in keys, metrics labels and the default cache scope.
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub requests_per_min: Option<u32>,
    #[serde(default)]
    pub tokens_per_min: Option<u64>,
    #[serde(default)]
    pub max_concurrent: Option<u32>,
    /// KV blocks this tenant may hold on one engine (passed to the engine as a header).
    #[serde(default)]
    pub kv_block_quota: Option<u32>,
    /// A named shared scope set by an operator; `None` means the tenant's own (isolated) scope.
    #[serde(default)]
    pub cache_scope: Option<String>,
    /// Scheduler weight on the engines (fair share), at least 1.
    #[serde(default = "default_priority")]
    pub priority: u32,
    /// Models this tenant may call; empty means all.
    #[serde(default)]
    pub allowed_models: Vec<String>,
    /// Prepended to chat requests that carry no system message.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Prices for this tenant, in place of the model's (USD per million tokens).
    #[serde(default)]
    pub prices: Option<Prices>,
    /// The tenant's monthly budget, across all its keys.
    #[serde(default)]
    pub budget: Option<Budget>,
    /// Unix seconds.
    #[serde(default)]
    pub created_at: u64,
}

fn default_priority() -> u32 {
    1
}

impl Tenant {
    pub fn new(id: impl Into<String>) -> Self {
        let id = id.into();
        Tenant {
            name: id.clone(),
            id,
            requests_per_min: None,
            tokens_per_min: None,
            max_concurrent: None,
            kv_block_quota: None,
            cache_scope: None,
            priority: 1,
            allowed_models: Vec::new(),
            system_prompt: None,
            prices: None,
            budget: None,
            created_at: unix_now(),
        }
    }

    /// The scope its cache hashes are bound to: the shared scope if an operator set one, else
    /// its own id (prefixed, so a shared scope can never be named like a tenant).
    pub fn scope(&self) -> String {
        match &self.cache_scope {
            Some(s) => format!("shared:{s}"),
            None => format!("tenant:{}", self.id),
        }
    }

    pub fn rate_limits(&self) -> RateLimits {
        RateLimits {
            requests_per_min: self.requests_per_min,
            tokens_per_min: self.tokens_per_min,
            max_concurrent: self.max_concurrent,
        }
    }

    pub fn allows_model(&self, model: &str) -> bool {
        self.allowed_models.is_empty() || self.allowed_models.iter().any(|m| m == model)
    }
}

/// `true` when `id` is a valid tenant id (`[a-z0-9_-]{1,64}`).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A tenant's limits, as the rate limiter sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateLimits {
    pub requests_per_min: Option<u32>,
    pub tokens_per_min: Option<u64>,
    pub max_concurrent: Option<u32>,
}

/// SHA-256(pepper | key): the only form in which a key is ever stored.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KeyHash(#[serde(with = "hex32")] pub [u8; 32]);

impl KeyHash {
    pub fn of(pepper: &[u8], key: &str) -> Self {
        let mut h = Sha256::new();
        h.update((pepper.len() as u64).to_le_bytes());
        h.update(pepper);
        h.update(key.as_bytes());
        KeyHash(h.finalize().into())
    }

    pub fn hex(&self) -> String {
        hex32::encode(&self.0)
    }

    /// Constant-time equality: the time taken does not depend on where the bytes differ.
    pub fn ct_eq(&self, other: &KeyHash) -> bool {
        let mut diff = 0u8;
        for (a, b) in self.0.iter().zip(other.0.iter()) {
            diff |= a ^ b;
        }
        std::hint::black_box(diff) == 0
    }
}

impl std::fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyHash({}..)", &self.hex()[..8])
    }
}

/// A stored API key: its hash, never the key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// Public id, safe to show and log (`key_` + 12 hex digits of a random value).
    pub id: String,
    pub tenant: String,
    pub hash: KeyHash,
    /// The first characters of the key (`kvg_AbCd`), so an operator can tell keys apart.
    pub prefix: String,
    pub created_at: u64,
    #[serde(default)]
    pub revoked: bool,
    /// What the operator calls it (`ci`, `prod-eu`); empty when unnamed.
    #[serde(default)]
    pub name: String,
    /// Free-form labels (team, environment), for the operator's own bookkeeping.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Unix seconds after which the key is refused (401, "expired"); `None`: never.
    #[serde(default)]
    pub expires_at: Option<u64>,
    /// This key's own limits, on top of its tenant's (both must admit a request).
    #[serde(default)]
    pub requests_per_min: Option<u32>,
    #[serde(default)]
    pub tokens_per_min: Option<u64>,
    /// This key's own monthly budget, within its tenant's.
    #[serde(default)]
    pub budget: Option<Budget>,
    /// The key that replaced this one (`keys rotate`); this one works until `expires_at`.
    #[serde(default)]
    pub rotated_to: Option<String>,
    /// The first key of this key's rotation chain (`None`: this key): a chain shares one
    /// monthly budget.
    #[serde(default)]
    pub lineage: Option<String>,
    /// Last time the key was used, unix seconds (kept at most once a minute; filled in by the
    /// store's listing).
    #[serde(default)]
    pub last_used_at: Option<u64>,
}

impl KeyRecord {
    /// A new, unnamed key record with no limits of its own.
    pub fn new(tenant: &str, hash: KeyHash, prefix: &str) -> KeyRecord {
        KeyRecord {
            id: generate_key_id(),
            tenant: tenant.to_owned(),
            hash,
            prefix: prefix.to_owned(),
            created_at: unix_now(),
            revoked: false,
            name: String::new(),
            labels: BTreeMap::new(),
            expires_at: None,
            requests_per_min: None,
            tokens_per_min: None,
            budget: None,
            rotated_to: None,
            lineage: None,
            last_used_at: None,
        }
    }

    /// The id its budget is counted under: the first key of its rotation chain.
    pub fn lineage(&self) -> &str {
        self.lineage.as_deref().unwrap_or(&self.id)
    }

    /// Whether the key has expired at `now` (unix seconds).
    pub fn expired(&self, now: u64) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }

    /// The key's own limits (never a concurrency limit: that is the tenant's).
    pub fn rate_limits(&self) -> RateLimits {
        RateLimits {
            requests_per_min: self.requests_per_min,
            tokens_per_min: self.tokens_per_min,
            max_concurrent: None,
        }
    }

    /// The rate-limit bucket of this key's own limits (`{tenant}:key:{id}`: a tenant id has no
    /// `:`, so it never names a tenant's bucket).
    pub fn bucket(&self) -> String {
        format!("{}:key:{}", self.tenant, self.id)
    }
}

/// What an operator sets on a key (issue, update; a rotation copies it to the successor).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    /// Unix seconds.
    #[serde(default)]
    pub expires_at: Option<u64>,
    /// Seconds from now (instead of `expires_at`).
    #[serde(default)]
    pub expires_in_secs: Option<u64>,
    #[serde(default)]
    pub requests_per_min: Option<u32>,
    #[serde(default)]
    pub tokens_per_min: Option<u64>,
    #[serde(default)]
    pub budget: Option<Budget>,
}

impl KeySpec {
    /// The spec of an existing key (what its successor inherits).
    pub fn of(k: &KeyRecord) -> KeySpec {
        KeySpec {
            name: Some(k.name.clone()),
            labels: Some(k.labels.clone()),
            expires_at: None,
            expires_in_secs: None,
            requests_per_min: k.requests_per_min,
            tokens_per_min: k.tokens_per_min,
            budget: k.budget,
        }
    }

    /// The first field that is wrong, and why (a 400 names it).
    pub fn invalid(&self) -> Option<(String, String)> {
        if let Some(n) = &self.name {
            if n.len() > 64 || n.chars().any(char::is_control) {
                return Some((
                    "name".into(),
                    "A key name is at most 64 printable characters.".into(),
                ));
            }
        }
        if let Some(labels) = &self.labels {
            if labels.len() > 32 {
                return Some(("labels".into(), "A key has at most 32 labels.".into()));
            }
            for (k, v) in labels {
                if k.is_empty() || k.len() > 64 || v.len() > 256 {
                    return Some((
                        format!("labels.{}", k.chars().take(64).collect::<String>()),
                        "A label's name is 1-64 characters and its value at most 256.".into(),
                    ));
                }
            }
        }
        if self.expires_at.is_some() && self.expires_in_secs.is_some() {
            return Some((
                "expires_in_secs".into(),
                "Give expires_at or expires_in_secs, not both.".into(),
            ));
        }
        if let Some(f) = self.budget.as_ref().and_then(Budget::invalid_field) {
            return Some((
                format!("budget.{f}"),
                "A budget is a finite, non-negative amount.".into(),
            ));
        }
        None
    }

    /// Sets the fields this spec names on `rec` (a `PATCH`: the others stay).
    pub fn apply(&self, rec: &mut KeyRecord) {
        if let Some(n) = &self.name {
            rec.name = n.clone();
        }
        if let Some(l) = &self.labels {
            rec.labels = l.clone();
        }
        if let Some(at) = self.expires_at {
            rec.expires_at = Some(at);
        }
        if let Some(secs) = self.expires_in_secs {
            // From the next whole second: a key given `secs` lives at least that long (a key
            // expires once the clock's whole seconds reach `expires_at`).
            let now = since_epoch();
            let next_second = now.as_secs() + u64::from(now.subsec_nanos() > 0);
            rec.expires_at = Some(next_second.saturating_add(secs));
        }
        if self.requests_per_min.is_some() {
            rec.requests_per_min = self.requests_per_min;
        }
        if self.tokens_per_min.is_some() {
            rec.tokens_per_min = self.tokens_per_min;
        }
        if self.budget.is_some() {
            rec.budget = self.budget;
        }
    }
}

/// What an operator token may do on the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything.
    Admin,
    /// Reads, plus drain, undrain and cache flush; not tenants, keys, engines or tokens.
    Operator,
    /// Reads only.
    Viewer,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Viewer => "viewer",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "operator" => Some(Role::Operator),
            "viewer" => Some(Role::Viewer),
            _ => None,
        }
    }
}

/// A named operator token: its hash, never the token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorToken {
    /// Unique name (`[a-z0-9_-]{1,64}`), shown in the audit log.
    pub name: String,
    pub role: Role,
    pub hash: KeyHash,
    /// The first characters of the token (`kvo_AbCd`).
    pub prefix: String,
    pub created_at: u64,
    #[serde(default)]
    pub revoked: bool,
}

/// A new operator token: `kvo_` + 32 random bytes in base62.
pub fn generate_operator_token() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("kvo_{}", base62(&bytes))
}

/// An engine in the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    pub name: String,
    /// Base URL, for example `http://10.0.0.7:8081`.
    pub url: String,
    #[serde(default)]
    pub added_at: u64,
}

const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// A new API key: `kvg_` + 32 random bytes in base62 (43 characters).
pub fn generate_key() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("kvg_{}", base62(&bytes))
}

/// Big-endian base62 of `bytes`, padded to the length of the largest value (43 digits for 32 bytes).
fn base62(bytes: &[u8; 32]) -> String {
    let mut n = bytes.to_vec();
    let mut digits = Vec::with_capacity(43);
    for _ in 0..43 {
        let mut rem = 0u32;
        for b in n.iter_mut() {
            let cur = (rem << 8) | u32::from(*b);
            *b = (cur / 62) as u8;
            rem = cur % 62;
        }
        digits.push(BASE62[rem as usize]);
    }
    digits.reverse();
    String::from_utf8(digits).unwrap_or_default()
}

/// A new public key id.
pub fn generate_key_id() -> String {
    use rand::RngCore;
    let mut b = [0u8; 6];
    rand::rngs::OsRng.fill_bytes(&mut b);
    format!(
        "key_{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

pub fn unix_now() -> u64 {
    since_epoch().as_secs()
}

/// Time since the Unix epoch (zero for a clock set before it).
fn since_epoch() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

pub(crate) mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn encode(b: &[u8; 32]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    pub fn decode(s: &str) -> Option<[u8; 32]> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(out)
    }

    pub fn serialize<S: Serializer>(b: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let s = String::deserialize(d)?;
        decode(&s).ok_or_else(|| serde::de::Error::custom("expected 64 hex digits"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_base62_and_distinct() {
        let a = generate_key();
        let b = generate_key();
        assert_ne!(a, b);
        assert_eq!(a.len(), 4 + 43);
        assert!(a[4..].bytes().all(|c| c.is_ascii_alphanumeric()));
    }

    #[test]
    fn base62_of_extremes() {
        assert_eq!(base62(&[0; 32]), "0".repeat(43));
        // 2^256 - 1 < 62^43: 43 digits, starting "yhj".
        let max = base62(&[0xff; 32]);
        assert_eq!(max.len(), 43);
        assert!(max.starts_with("yhj"), "{max}");
    }

    #[test]
    fn key_hash_depends_on_pepper_and_compares() {
        let k = generate_key();
        let a = KeyHash::of(b"pepper-a", &k);
        assert!(a.ct_eq(&KeyHash::of(b"pepper-a", &k)));
        assert!(!a.ct_eq(&KeyHash::of(b"pepper-b", &k)));
        assert_eq!(hex32::decode(&a.hex()), Some(a.0));
    }

    #[test]
    fn scopes_cannot_collide() {
        let mut t = Tenant::new("acme");
        assert_eq!(t.scope(), "tenant:acme");
        t.cache_scope = Some("acme".into());
        assert_eq!(t.scope(), "shared:acme");
    }
}

//! Tenants, API keys and engine records: what the store keeps.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

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
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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

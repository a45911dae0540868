//! The audit log: one entry per admin write (every method but GET) and per refusal of an
//! authenticated operator token, kept by the store in a stream with bounded retention and read
//! by `GET /admin/audit` (`kvgate admin audit`). An entry says who (the operator token's name
//! and role), what (the action and its target: ids and names, never a key, a token or a
//! prompt), when, and the result (the HTTP status, and the error's message on failure).

use crate::tenant::Role;
use serde::{Deserialize, Serialize};

/// Entries the store's audit stream keeps (approximately: trimmed in whole nodes).
pub const AUDIT_RETENTION: u64 = 100_000;
/// Most entries one read returns.
pub const AUDIT_READ_MAX: usize = 10_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Unix milliseconds.
    pub at_ms: u64,
    /// The operator token's name (`bootstrap` for the token from the config).
    pub actor: String,
    pub role: Role,
    /// `tenant.create`, `key.rotate`, `engine.drain`, ... (`kvgate admin audit` lists them).
    pub action: String,
    /// What it acted on: `tenant:acme`, `key:acme/key_0123`, `engine:e0`, `token:ci`, `cache:*`.
    pub target: String,
    pub status: u16,
    /// The error's message when it failed.
    #[serde(default)]
    pub error: Option<String>,
}

/// Which entries to read: newest first, at most `limit`, within `[since_ms, until_ms]`.
#[derive(Debug, Clone, Copy)]
pub struct AuditQuery {
    pub since_ms: u64,
    pub until_ms: u64,
    pub limit: usize,
}

/// The action and target of an admin request (`parts`: its path after `/admin/`).
pub fn describe(method: &str, parts: &[&str]) -> (String, String) {
    let (action, target) = match (method, parts) {
        ("POST", ["tenants"]) => ("tenant.create", String::new()),
        ("PATCH" | "PUT", ["tenants", id]) => ("tenant.update", format!("tenant:{id}")),
        ("DELETE", ["tenants", id]) => ("tenant.delete", format!("tenant:{id}")),
        ("POST", ["tenants", id, "keys"]) => ("key.issue", format!("tenant:{id}")),
        ("PATCH", ["tenants", id, "keys", key]) => ("key.update", format!("key:{id}/{key}")),
        ("DELETE", ["tenants", id, "keys", key]) => ("key.revoke", format!("key:{id}/{key}")),
        ("POST", ["tenants", id, "keys", key, "rotate"]) => {
            ("key.rotate", format!("key:{id}/{key}"))
        }
        ("POST", ["engines"]) => ("engine.add", String::new()),
        ("DELETE", ["engines", name]) => ("engine.remove", format!("engine:{name}")),
        ("POST", ["engines", name, "drain"]) => ("engine.drain", format!("engine:{name}")),
        ("POST", ["engines", name, "undrain"]) => ("engine.undrain", format!("engine:{name}")),
        ("POST", ["cache", "flush"]) => ("cache.flush", "cache:*".to_owned()),
        ("POST", ["tokens"]) => ("token.issue", String::new()),
        ("DELETE", ["tokens", name]) => ("token.revoke", format!("token:{name}")),
        _ => {
            let path = parts.join("/");
            return (
                format!("{} /admin/{path}", method),
                format!("path:/admin/{path}"),
            );
        }
    };
    (action.to_owned(), target)
}

/// Bounds a path segment that goes into the log (ids are short; anything longer is cut).
pub fn bounded(s: &str) -> String {
    s.chars().take(128).collect()
}

/// Whether a path segment looks like an API key or an operator token (which must never be
/// logged): an operator who pasted the secret where its id belongs.
pub fn looks_secret(segment: &str) -> bool {
    segment.starts_with("kvg_") || segment.starts_with("kvo_")
}

/// Audited refusals per operator token per minute; past it refusals are only counted.
pub const REFUSALS_PER_MINUTE: u32 = 30;
